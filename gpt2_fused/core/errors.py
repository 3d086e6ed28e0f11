"""One-line errors for the command lines (train.py, sample.py, python -m data.fineweb, ...).

An error the user can fix (a bad setting, a damaged shard, a checkpoint that cannot be written or
read) is printed as one line naming the file and the problem, with exit status 1, instead of a
traceback. GPT2_DEBUG=1 in the environment shows the traceback instead.
"""

import os
import sys

DEBUG_ENV = "GPT2_DEBUG"


def run_main(main, user_errors):
    """main(); an exception of a type in `user_errors` ({type: label}, e.g. {ConfigError:
    "config error"}) exits with status 1 and "label: message" on one line."""
    try:
        return main()
    except tuple(user_errors) as e:
        if os.environ.get(DEBUG_ENV, "0") not in ("", "0"):
            raise
        label = next(label for typ, label in user_errors.items() if isinstance(e, typ))
        text = " ".join(line.strip() for line in str(e).splitlines()) or type(e).__name__
        sys.exit(f"{label}: {text}")
