"""One-line errors for the command lines (train.py, sample.py, eval_hellaswag.py, python -m data.*).

An error the user can fix is printed as one line, "label: message", instead of a traceback, and
the exit status says which kind it is:

- 2, a usage error (UsageError, and config.ConfigError under it): the command asks for something
  that cannot run: an unknown flag (named with the closest known one), a missing or malformed
  value, a setting out of range or at odds with another, a config file that does not load.
- 1, any other error the user can fix: the command is fine but what it reads or writes is not (a
  damaged shard or checkpoint, a missing file, a full disk).

`--help` prints the full help and exits 0. Ctrl-C outside a training loop (which saves first)
prints "interrupted" and exits 130, as a shell does. GPT2_DEBUG=1 in the environment shows the
traceback instead of the line.
"""

import os
import sys

DEBUG_ENV = "GPT2_DEBUG"
USAGE_EXIT = 2  # the conventional status of a usage error (argparse's, getopt's)


class UsageError(ValueError):
    """A command line (or config file) asking for something that cannot run: exit status 2."""


def run_main(main, user_errors):
    """main(); an exception of a type in `user_errors` ({type: label}, e.g. {ConfigError:
    "config error"}) or a UsageError exits with "label: message" on one line, status 2 for a
    UsageError and 1 for the others. The label is that of the most specific type listed."""
    labels = {UsageError: "usage error", **user_errors}
    debug = os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    try:
        return main()
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(128 + 2)  # 128 + SIGINT
    except tuple(labels) as e:
        if debug:
            raise
        label = next(labels[t] for t in type(e).__mro__ if t in labels)
        text = " ".join(line.strip() for line in str(e).splitlines()) or type(e).__name__
        if isinstance(e, UsageError):
            print(f"{label}: {text}", file=sys.stderr)
            sys.exit(USAGE_EXIT)
        sys.exit(f"{label}: {text}")
