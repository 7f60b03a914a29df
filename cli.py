"""The command-line conventions every entry point follows, in one place so they cannot drift.

Every runnable file (reproduce.py, train.py, eval.py, scaling.py, budget.py, bench.py, probes.py,
data.py, scripts/*.py) builds its parser with these helpers; tests/test_cli.py checks each `--help`
against the rules below and feeds every parser a table of bad values.
  --out-dir DIR   where a command writes its files. The old spellings (--out; --json FILE for bench.py
                  and budget.py) are hidden aliases that print a deprecation line; they will be removed.
  --device D      auto | cpu | cuda | cuda:N, default auto wherever a command picks a device
                  (auto: cuda when torch sees a GPU, else cpu). Checked when parsed: a typo fails first.
  --preset NAME   a run size (configs.py): smoke | tiny | small | medium | paper for reproduce.py and
                  budget.py --ladder; smoke | tiny | small for the experiment scripts (their length is
                  --steps) and for the corpus of data.py --preset / train.py --data (the medium and
                  paper plans train on the small corpus); train.py --preset names a smoke model.
  --loops R       r, the loop count, where a command lets it be set (reproduce.py and the loop scripts).
  errors          `run_main` is every `__main__`: an error the user can fix (a bad value, a bad or missing
                  file, a locked run, a full disk) is one line on stderr and exit status 2; anything else is
                  a bug: its traceback and a line asking for a report. `read_config` reads a user's JSON
                  file into its dataclass field by field, naming the flag and the file.
  --help          shows every option's default (`HelpFormatter`): an option whose default is computed
                  (None) says in its own help text what it defaults to.
  counts          argparse refuses bad values before anything runs: `positive_int` for sizes, counts,
                  steps and seeds-as-counts, `nonneg_int` where 0 has a documented meaning (--shots,
                  --max-items 0 = all, --seed, --bootstrap 0 = skip), `positive_float` for lengths and
                  budgets, and `choices` for every enumeration. The reasons: docs/cli.md. Read next: checks.py.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback

from checks import BadFileError, JSONFileError, UserError, config_from, read_json

DEVICE_TYPES = ("cpu", "cuda")   # the device types the code is tested on


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps a module docstring's layout as the description and appends "(default: X)" to every
    option that has a default and does not already describe it ("default" in its help). Flags
    (store_true) and options without a default (None: computed, and explained in the help) get
    nothing appended, so no help line ever shows two defaults."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        d = action.default
        if ("default" in help.lower() or d is None or d is argparse.SUPPRESS or not action.option_strings
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                       argparse._HelpAction, argparse._VersionAction))):
            return help
        shown = (" ".join(map(str, d)) or "none") if isinstance(d, (list, tuple)) else str(d)
        return f"{help} (default: {shown.replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose refusal is one line on stderr (exit status 2) that points at --help."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def parser(description: str | None = None, **kw) -> argparse.ArgumentParser:
    """A Parser with the project's HelpFormatter."""
    return Parser(description=description, formatter_class=HelpFormatter, **kw)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


# ----------------------------------------------------------------------------------------
# Errors: the user's in one line, the code's with a traceback

def _os_message(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    if e.errno == errno.ENOSPC:
        return f"no space left on the device{where}: free some space, or pass --out-dir on a disk with room"
    return f"{e.strerror or e}{where}: check the path and its permissions"


def run_main(main, argv=None, prog: str | None = None):
    """main(argv), as every entry point's `__main__` runs it. A UserError or an OSError (a file, a folder,
    the disk) ends the command with one line on stderr, exit status 2; any other exception is a bug in
    the code: its traceback, a line asking for a report, exit status 1. Returns main's value."""
    prog = prog or os.path.basename(sys.argv[0])
    try:
        return main(argv)
    except UserError as e:
        msg = str(e)
    except OSError as e:
        msg = _os_message(e)
    except ModuleNotFoundError as e:
        msg = f"the package {e.name!r} is not installed: pip install -r requirements.txt"
    except Exception:
        traceback.print_exc()
        print(f"{prog}: this is a bug in looped-moe, not in your input: please report it with the command line "
              f"and the traceback above", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    print(f"{prog}: error: {one_line(msg)}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def read_config(path: str, cls, flag: str, key: str | None = None):
    """The config dataclass `cls` from the JSON file `path` a user passed as `flag` (a run's config.json
    holds it under `key`), checked field by field: unknown fields, wrong types and out-of-range values.
    Any problem is a BadFileError (a UserError) naming the flag, the file and what to fix."""
    try:
        d = read_json(path)
    except JSONFileError as e:
        raise BadFileError(f"{flag} {e}: fix the file") from None
    except OSError as e:
        raise BadFileError(f"{flag} {path}: {e.strerror or e}: give the path of a JSON file") from None
    if key and isinstance(d, dict) and isinstance(d.get(key), dict):
        d = d[key]
    return config_from(cls, d, f"{flag} {path}", f"fix the file (it holds {cls.__name__}.to_dict()'s fields)")


# ----------------------------------------------------------------------------------------
# Types: bad values are refused by argparse, naming the option and the rule

def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if x != x or x in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return x


def positive_int(text: str) -> int:
    """An integer >= 1 (sizes, counts, steps, batch sizes, number of seeds or jobs)."""
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {text}")
    return n


def nonneg_int(text: str) -> int:
    """An integer >= 0 (shot counts, seeds, and counts where 0 has a documented meaning)."""
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer (>= 0), got {text}")
    return n


def int_range(lo: int, hi: int):
    """An integer in [lo, hi]."""
    def check(text: str) -> int:
        n = _int(text)
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"must lie in [{lo}, {hi}], got {text}")
        return n
    check.__name__ = f"int in [{lo}, {hi}]"
    return check


def positive_float(text: str) -> float:
    """A finite number > 0 (lengths, FLOP budgets, learning rates)."""
    x = _float(text)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number (> 0), got {text}")
    return x


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    x = _float(text)
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number (>= 0), got {text}")
    return x


def device(text: str) -> str:
    """auto, or a device torch knows of a supported type: cpu, cuda, cuda:N."""
    if text == "auto":
        return text
    import torch
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in DEVICE_TYPES:
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def resolve_device(name: str | None) -> str:
    """auto (or None) -> "cuda" when torch sees a GPU, else "cpu"; anything else unchanged."""
    if name in (None, "auto"):
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


# ----------------------------------------------------------------------------------------
# The shared options

class _Deprecated(argparse.Action):
    """A hidden old spelling: stores into the new option's dest and says once what to use instead."""

    def __init__(self, option_strings, dest, new: str = "", **kw):
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated_alias(ap: argparse.ArgumentParser, flag: str, dest: str, new: str, **kw) -> None:
    """A hidden old spelling `flag` that stores into `dest` (the new option's) and names `new` on use."""
    ap.add_argument(flag, dest=dest, action=_Deprecated, new=new, help=argparse.SUPPRESS, **kw)


def add_out_dir(ap: argparse.ArgumentParser, help: str, default: str | None = None,
                old: tuple[str, ...] = ("--out",)) -> None:
    """--out-dir DIR (dest out_dir), plus the hidden deprecated spellings `old` (same dest, same meaning)."""
    ap.add_argument("--out-dir", default=default, metavar="DIR", help=help)
    for flag in old:
        deprecated_alias(ap, flag, "out_dir", "--out-dir")


def add_device(ap: argparse.ArgumentParser, help: str = "where to run: auto (cuda when available, else cpu), "
                                                          "cpu, cuda or cuda:N") -> None:
    """--device, default auto, checked when parsed; resolve with `resolve_device`."""
    ap.add_argument("--device", type=device, default="auto", help=help)
