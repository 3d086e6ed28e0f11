"""The command lines' one language, shared by train.py, sample.py, eval_hellaswag.py and
python -m data.fineweb / data.tinystories / data.hellaswag.

    --name=value    --name value    --max-steps or --max_steps (either spelling of a name)

A bare `--name` is a switch: train.py's bool settings (`--resume`, `--resume False` also works)
and the argparse commands' on/off flags. A value that begins with "--" needs the `=` form; a
negative number may follow its flag (`--beta1 -1`, `--z_loss -1e-4`). Flags are spelled in full:
argparse's abbreviations are off, as a typo that happened to be a prefix would pass unnoticed.
An unknown flag raises UsageError naming the closest known flag; errors.run_main prints it as one
line with exit status 2, as it does every usage error.
"""

import argparse
import difflib
import sys

from gpt2_fused.training.errors import UsageError

BOOL_WORDS = ("True", "False", "None")  # what may follow a switch as its value


def key(flag):
    """A flag's name without dashes or spelling: --max-steps, --max_steps -> max_steps."""
    return flag.lstrip("-").replace("-", "_")


def closest(name, known):
    """The entry of `known` (names or flags) nearest to `name`, whatever their spelling."""
    keys = {key(k): k for k in known}
    match = difflib.get_close_matches(key(name), keys, n=1, cutoff=0.0)
    return keys[match[0]] if match else None


def unknown_flag(flag, known, error=UsageError):
    """`error` saying that `flag` is unknown, naming the closest of `known`."""
    near = closest(flag, known)
    hint = f"; did you mean {near}?" if near else ""
    return error(f"{flag}: unknown flag{hint} (--help lists them)")


def positive_int(text):
    """argparse's type for a count that must be >= 1: a bad one is a usage error naming it."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def config_argv(argv, names, switches, error=UsageError):
    """train.py's arguments in the one form its config parser reads: `--name=value`, the name
    spelled with underscores, as `names` are. `--name value` is joined unless the value begins
    with "--"; a name in `switches` takes the next word only when it is True, False or None, so
    `--resume configs/x.py` keeps the config file. Anything else (config files) passes as is."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        if key(name) not in names:
            raise unknown_flag(name, [f"--{n}" for n in names], error)
        if not eq and i < len(argv):
            nxt = argv[i]
            takes = nxt in BOOL_WORDS if key(name) in switches else not nxt.startswith("--")
            if takes:
                eq, value, i = "=", nxt, i + 1
        out.append(f"--{key(name)}{eq}{value}")
    return out


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with the description as written and each option's default after its help."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        shown = default is None or default is False or default is argparse.SUPPRESS
        if not shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


class ArgumentParser(argparse.ArgumentParser):
    """argparse speaking the shared language: either spelling of a flag, a negative number after
    its flag, no abbreviations, a usage error raised as UsageError (one line and exit 2 through
    run_main) instead of the usage block, and defaults in --help. Subcommands' parsers are of
    this class too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(message)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._normalise(args), namespace)

    def parse_args(self, args=None, namespace=None):
        args, extras = self.parse_known_args(args, namespace)
        if extras:  # flags were checked by _normalise: these are stray words
            self.error(f"unexpected argument {extras[0]!r}")
        return args

    def _normalise(self, args):
        """Each flag as this parser spells it, `--flag=-1e-4` for a number after a one-value
        flag; an unknown flag is a UsageError. A subcommand's words are left to its parser."""
        flags = {key(s): s for s in self._option_string_actions}
        commands = set()
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):  # no public way to find them
                commands.update(action.choices)
        out, i = [], 0
        while i < len(args):
            arg = args[i]
            i += 1
            if arg == "--" or arg in commands:
                return out + args[i - 1 :]
            if not arg.startswith("-") or arg == "-" or _is_number(arg):
                out.append(arg)
                continue
            name, eq, value = arg.partition("=")
            if key(name) not in flags:
                raise unknown_flag(name, sorted(set(flags.values())))
            flag = flags[key(name)]
            one_value = self._option_string_actions[flag].nargs is None
            if not eq and one_value and i < len(args) and args[i].startswith("-"):
                if _is_number(args[i]):  # argparse would take -1e-4 for a flag
                    eq, value, i = "=", args[i], i + 1
            out.append(f"{flag}{eq}{value}")
        return out
