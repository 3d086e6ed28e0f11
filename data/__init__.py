"""Data for GPT-2 pretraining: offline GPT-2 tokenizer, llm.c token shards, prepare scripts, loader.

`resolve_dataset("embedded")` or `resolve_dataset(folder)` gives the (train, val) shard globs that
`data.loader.DataLoader` and `data.loader.iter_val_batches` read.
"""

import glob
from pathlib import Path


def resolve_dataset(dataset):
    """(train_glob, val_glob) for "embedded" (prepared on first use) or a folder of shards."""
    if dataset == "embedded":
        from data.embedded import prepare_embedded

        folder = prepare_embedded()
    else:
        folder = Path(dataset)
        if not folder.is_dir():
            hint = ""
            if any(c in dataset for c in "*?[") and folder.parent.is_dir():  # llm.c's -i style
                hint = f"; pass the folder, --dataset={str(folder.parent)!r}: its *_train_*.bin"
                hint += " and *_val_*.bin are found there"
            raise FileNotFoundError(
                f"dataset {dataset!r} is neither 'embedded' nor a folder of shards{hint}"
            )
    base = glob.escape(str(folder))
    train, val = f"{base}/*_train_*.bin", f"{base}/*_val_*.bin"
    for split, pattern in (("train", train), ("val", val)):
        if not glob.glob(pattern):
            raise FileNotFoundError(
                f"no {split} shards in {folder} (expected files matching *_{split}_*.bin; "
                "make them with python -m data.fineweb or python -m data.tinystories)"
            )
    return train, val
