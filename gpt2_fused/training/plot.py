"""Loss curves from train.py's out_dir/log.jsonl: the PNG a finished run writes when matplotlib is
installed (pip install matplotlib, or the `plot` extra), and python -m bench.plot_loss's plots."""

import os

from gpt2_fused.training.jsonl import read_jsonl


def read_log(path):
    """(train {step: loss}, val {step: val_loss}) from one log.jsonl; a log that a resumed run
    appended to may hold a step twice: the last record of each step wins."""
    train, val = {}, {}
    for rec in read_jsonl(path):
        if "val_loss" in rec:
            val[rec["step"]] = rec["val_loss"]
        elif "loss" in rec:
            train[rec["step"]] = rec["loss"]
    return train, val


def plot_logs(logs, out, title=""):
    """Train loss lines and val points of each log.jsonl into the PNG `out`; ImportError without
    matplotlib."""
    # Figure without pyplot: no GUI backend is chosen, and a caller's own pyplot state is untouched
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=120)
    ax = fig.add_subplot()
    for path in logs:
        train, val = read_log(path)
        # out/a/log.jsonl is named "a" (its out_dir); any other file is named by its stem
        stem = os.path.splitext(os.path.basename(path))[0]
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) if stem == "log" else stem
        steps = sorted(train)
        line = ax.plot(steps, [train[s] for s in steps], lw=1, alpha=0.8, label=f"{label} train")
        if val:
            vs = sorted(val)
            color = line[0].get_color()
            ax.plot(vs, [val[s] for s in vs], "o-", ms=3, color=color, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def loss_curve(out_dir):
    """Writes out_dir/loss.png from out_dir/log.jsonl if matplotlib is installed; returns the line
    that says where the curve is, or how to draw it."""
    log, png = os.path.join(out_dir, "log.jsonl"), os.path.join(out_dir, "loss.png")
    try:
        plot_logs([log], png)
    except ImportError:
        return f"loss curve: python -m bench.plot_loss {log} (pip install matplotlib)"
    except (OSError, ValueError) as e:  # the run itself is done: a curve it cannot draw is a note
        return f"loss curve: not drawn ({e}); python -m bench.plot_loss {log}"
    return f"loss curve: {png}"
