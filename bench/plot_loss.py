"""Plot train and val loss from train.py's JSONL log(s) into a PNG.

    python bench/plot_loss.py out/log.jsonl                       # -> out/loss.png
    python bench/plot_loss.py out/a/log.jsonl out/b/log.jsonl -o compare.png

Needs matplotlib (pip install matplotlib); training does not. A log that a resumed run appended to
may hold a step twice: the last record of each step wins.
"""

import argparse
import json
import os
import sys


def read_log(path):
    """(train {step: loss}, val {step: val_loss}) from one log.jsonl."""
    train, val = {}, {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not a JSON line ({e})") from None
            if "val_loss" in rec:
                val[rec["step"]] = rec["val_loss"]
            elif "loss" in rec:
                train[rec["step"]] = rec["loss"]
    return train, val


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="log.jsonl files written by train.py")
    parser.add_argument("-o", "--out", help="PNG path (default: loss.png beside the first log)")
    parser.add_argument("--title", default="", help="plot title")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_loss.py needs matplotlib: pip install matplotlib")

    out = args.out or os.path.join(os.path.dirname(args.logs[0]) or ".", "loss.png")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for path in args.logs:
        if not os.path.isfile(path):
            sys.exit(f"no such log: {path}")
        train, val = read_log(path)
        # out/a/log.jsonl is named "a" (its out_dir); any other file is named by its stem
        stem = os.path.splitext(os.path.basename(path))[0]
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) if stem == "log" else stem
        steps = sorted(train)
        line = ax.plot(steps, [train[s] for s in steps], lw=1, alpha=0.8, label=f"{label} train")
        if val:
            vs = sorted(val)
            ax.plot(
                vs,
                [val[s] for s in vs],
                "o-",
                ms=3,
                color=line[0].get_color(),
                label=f"{label} val",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

# Expected output: "wrote out/loss.png", a PNG of about 30-60 KB with one train line per log and
# its val points.
