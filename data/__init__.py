"""Data for GPT-2 pretraining: offline GPT-2 tokenizer, llm.c token shards, prepare scripts, loader.

`resolve_dataset("embedded")` or `resolve_dataset(folder)` gives the (train, val) shard globs that
`data.loader.DataLoader` and `data.loader.iter_val_batches` read.
"""

import glob
from pathlib import Path

# the prepare command of each recipe's dataset folder (configs/), by the folder's name
PREPARE = {
    "fineweb10B": "python -m data.fineweb",
    "fineweb100B": "python -m data.fineweb --version 100BT",
    "edufineweb10B": "python -m data.fineweb --edu",
    "edufineweb100B": "python -m data.fineweb --edu --version 100BT",
    "tinystories": "python -m data.tinystories",
}


def prepare_hint(folder):
    """How to make the shards of `folder`: its recipe's command (PREPARE), else local text's;
    or, when the cache holds a prepared folder of that name elsewhere, to pass that one."""
    from data.prepare import CACHE_DIR

    name = Path(folder).name
    there = CACHE_DIR / name
    if there.is_dir() and there.resolve() != Path(folder).resolve():
        return f"the prepared {name} is {there}: pass --dataset={there}"
    command = PREPARE.get(name, "python -m data.fineweb --from-text FILES")
    if there.resolve() != Path(folder).resolve():
        command += f" --out-dir {folder}"
    elif name not in PREPARE:
        command += f" --name {name}"
    return f"make them with {command}"


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
                f"dataset {dataset!r} is neither 'embedded' nor a folder of shards"
                + (hint or f": not prepared yet? {prepare_hint(folder)}")
            )
    base = glob.escape(str(folder))
    train, val = f"{base}/*_train_*.bin", f"{base}/*_val_*.bin"
    for split, pattern in (("train", train), ("val", val)):
        if not glob.glob(pattern):
            raise FileNotFoundError(
                f"no {split} shards in {folder} (expected files matching *_{split}_*.bin): "
                + prepare_hint(folder)
            )
    return train, val
