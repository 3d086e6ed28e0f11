"""TinyStories -> GPT-2 token shards (llm.c format, shard 0 = val).

    python -m data.tinystories    # roneneldan/TinyStories from the HF hub -> data/cache/tinystories
    python -m data.tinystories --from-text stories_train.txt --val-from stories_valid.txt

From the hub, the dataset's own "validation" split becomes the val shard and "train" the train
shards. Local text files use the TinyStories release format: stories separated by a line
`<|endoftext|>`; without `--val-from`, validation is the first 2**20 tokens of whole stories.
data/cache is $GPT2_FUSED_CACHE when that is set. The hub needs network (`datasets` honours
HTTPS_PROXY, HF_ENDPOINT and HF_HUB_OFFLINE); offline, the script stops at once saying so.
"""

from data.prepare import CACHE_DIR, CLI_ERRORS, add_prepare_args, check_hub, prepare, run_local
from gpt2_fused.training import cli
from gpt2_fused.training.errors import UsageError, run_main

HUB_REPO = "roneneldan/TinyStories"


def hub_docs(split):
    """Story texts of one split of TinyStories, streamed from the HF hub in a fixed order."""
    from datasets import load_dataset

    check_hub(HUB_REPO, "data.tinystories")
    ds = load_dataset(HUB_REPO, split=split, streaming=True)
    return (row["text"] for row in ds)


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    add_prepare_args(
        parser, default_name="tinystories", out_dir=f"{CACHE_DIR}/NAME, NAME from --name"
    )
    args = parser.parse_args(argv)
    out_dir = args.out_dir or CACHE_DIR / args.name
    if args.from_text or args.from_jsonl:
        return run_local(args, out_dir)
    if args.val_from or args.val_tokens:
        raise UsageError(
            "--val-from / --val-tokens need local inputs: the hub has a validation split"
        )
    return prepare(
        hub_docs("train"),
        out_dir,
        args.name,
        val_docs=hub_docs("validation"),
        shard_size=args.shard_size,
        workers=args.workers,
        settings={"source": HUB_REPO},
        progress=not args.no_progress,
    )


if __name__ == "__main__":
    run_main(main, CLI_ERRORS)

# Expected output from the hub (estimate, not measurable offline: 2.12M train / 22K validation
# stories of ~220 GPT-2 tokens): tinystories_val_000000.bin ~4.7M tokens (~9.5 MB) and
# tinystories_train_000001..000005.bin, ~470M tokens in all (~0.95 GB).
# Measured on a 5-story file in the release format with --from-text FILE --val-tokens 200
# -> tinystories_val_000000.bin 365 tokens (2 stories) and
# tinystories_train_000001.bin 546 tokens (3 stories); 911 tokens incl. one EOT per story.
