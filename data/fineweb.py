"""FineWeb / FineWeb-Edu -> GPT-2 token shards (llm.c format, 100M tokens each, shard 0 = val).

    python -m data.fineweb                  # FineWeb sample-10BT -> data/cache/fineweb10B/
    python -m data.fineweb --version 100BT  # sample-100BT -> data/cache/fineweb100B/
    python -m data.fineweb --edu            # FineWeb-Edu sample-10BT -> data/cache/edufineweb10B/
    python -m data.fineweb --from-text wikipedia_en/train_0*.txt.xz \
        --val-from wikipedia_en/valid.txt.xz --name wiki     # local files -> data/cache/wiki/

From the hub the dataset is streamed with `datasets` and, as in llm.c, validation is the first
`--val-tokens` (default: one whole shard) of the stream. Rerunning resumes after the last finished
shard; the documents before it are streamed again but not tokenised. `--from-text` / `--from-jsonl`
run the same pipeline on local files (see data/prepare.py for the formats), with validation from
`--val-from` files or else the first 2**20 tokens of whole documents, into data/cache/NAME
(`--name`, default "local"). data/cache is $GPT2_FUSED_CACHE when that is set. The hub needs
network (`datasets` honours HTTPS_PROXY, HF_ENDPOINT and HF_HUB_OFFLINE); offline, the script
stops at once saying so.
"""

from data.prepare import CACHE_DIR, CLI_ERRORS, add_prepare_args, check_hub, prepare, run_local
from gpt2_fused.training import cli
from gpt2_fused.training.errors import UsageError, run_main


def hub_docs(version="10BT", edu=False):
    """Texts of FineWeb(-Edu) sample-{version}, streamed from the HF hub in a fixed order."""
    from datasets import load_dataset

    repo = "HuggingFaceFW/fineweb-edu" if edu else "HuggingFaceFW/fineweb"
    check_hub(repo, "data.fineweb")
    ds = load_dataset(repo, name=f"sample-{version}", split="train", streaming=True)
    return (row["text"] for row in ds)


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    where = f"{CACHE_DIR}/fineweb10B (--edu: edufineweb10B, --version 100BT: fineweb100B; "
    where += f"local files: {CACHE_DIR}/NAME, NAME from --name, else local)"
    add_prepare_args(parser, default_name=None, out_dir=where)
    parser.add_argument("--version", choices=["10BT", "100BT"], default="10BT", help="sample size")
    parser.add_argument("--edu", action="store_true", help="FineWeb-Edu instead of FineWeb")
    args = parser.parse_args(argv)
    local = bool(args.from_text or args.from_jsonl)
    if args.name is None:
        args.name = "local" if local else ("edufineweb" if args.edu else "fineweb")
    default_dir = args.name if local else f"{args.name}{args.version[:-1]}"  # fineweb10B, ...
    out_dir = args.out_dir or CACHE_DIR / default_dir
    if local:
        return run_local(args, out_dir)
    if args.val_from:
        raise UsageError("--val-from needs local inputs (--from-text / --from-jsonl)")
    return prepare(
        hub_docs(args.version, args.edu),
        out_dir,
        args.name,
        val_tokens=args.val_tokens or args.shard_size,
        shard_size=args.shard_size,
        workers=args.workers,
        settings={"source": f"{'fineweb-edu' if args.edu else 'fineweb'} sample-{args.version}"},
        progress=not args.no_progress,
    )


if __name__ == "__main__":
    run_main(main, CLI_ERRORS)

# Expected output (FineWeb figures as reported for llm.c / modded-nanogpt; not measurable offline):
#   sample-10BT:      fineweb_val_000000.bin + ~103 train shards, ~10.3B tokens, ~20.6 GB
#   --edu:            edufineweb_val_000000.bin + ~99 train shards, ~10B tokens, ~20 GB
#   --version 100BT:  ~1,000 shards of 100M tokens, ~200 GB
#   each full shard is 200,001,024 bytes (1024-byte header + 2 bytes per token).
# Measured on a Wikipedia dump in WikiExtractor format: --from-text wikipedia_en/train_00.txt.xz
#   --val-from wikipedia_en/valid.txt.xz
#   -> local_val_000000.bin 1,034,743 tokens (472 articles, 2.1 MB) and local_train_000001.bin
#   17,542,134 tokens (5,188 articles, 35.1 MB), ~11 s on 2 cores; timings in bench/RESULTS.md#data.
