"""Plot train and val loss from train.py's JSONL log(s) into a PNG.

    python -m bench.plot_loss out/log.jsonl                       # -> out/loss.png
    python -m bench.plot_loss out/a/log.jsonl out/b/log.jsonl -o compare.png

Needs matplotlib (pip install matplotlib); training does not, and writes out_dir/loss.png itself
when it is installed (gpt2_fused/training/plot.py draws both). A log that a resumed run appended to
may hold a step twice: the last record of each step wins.
"""

import argparse
import os
import sys

from gpt2_fused.training.plot import plot_logs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="log.jsonl files written by train.py")
    parser.add_argument("-o", "--out", help="PNG path (default: loss.png beside the first log)")
    parser.add_argument("--title", default="", help="plot title")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(args.logs[0]) or ".", "loss.png")
    for path in args.logs:
        if not os.path.isfile(path):
            sys.exit(f"no such log: {path}")
    try:
        plot_logs(args.logs, out, args.title)
    except ImportError:
        sys.exit("plot_loss.py needs matplotlib: pip install matplotlib")
    except ValueError as e:  # a line that is not JSON, named with its file and line number
        sys.exit(str(e))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

# Expected output: "wrote out/loss.png", a PNG of about 30-60 KB with one train line per log and
# its val points.
