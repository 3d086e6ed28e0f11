# Twenty-fourth session, call 2: bench/results/s23/call3.sh as it stands (its attention probe
# again, then 124M:64's step timelines, default and plain; then 3ab6aea's tree and ours once
# more each while time is left: only ours ran, "new 3" in old.txt).
#   run: bash bench/results/s23/call3.sh $OUT 230   (carry: [".gpu"])
bash bench/results/s23/call3.sh "$1" 230
