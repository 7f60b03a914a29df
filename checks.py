"""Bad input refused up front: config field types and ranges, config dicts with unknown keys, and
JSON files that cannot be parsed, each with an error naming the field / key / file and line.

  * `check_fields`: types come from each dataclass field's annotation, so a field added later is
    type-checked without touching this file: "int" refuses floats (2.0 included) and booleans,
    "float" refuses NaN, infinity and booleans, "bool" accepts only True / False, "str" only
    strings, "list[int]" a list of ints; numpy scalars are stored as Python int / float.
  * `from_dict`: unknown keys in a config dict (a typo such as "n_expert") are an error naming the key.
  * `parse_json` / `read_json` / `require_keys`: JSON errors are `JSONFileError` (a ValueError)
    whose message starts with `path:line:column`, as compilers print them.
  * `UserError`: the base of every refusal a user can act on (cli.run_main prints it in one line).

ModelConfig, LoopConfig and TrainConfig apply these at construction (their `validate` adds the
field-specific ranges); train.py, data.py, runfiles.py and the CLIs read JSON through them.
Why, and the fuzz that found the gaps: docs/checks.md. Read next: loop.py, model.py.
"""
from __future__ import annotations

import difflib
import json
import math
import numbers
from dataclasses import fields
from pathlib import Path


class UserError(Exception):
    """An error the user can fix (a bad file, value or directory, a locked run, a full disk): an entry point
    prints it as one line and exits with status 2 (cli.run_main); the project's own refusals subclass it."""


class BadFileError(UserError, ValueError):
    """A file (a config, a checkpoint, a results file) that cannot be used as it is."""


class JSONFileError(BadFileError):
    """A JSON file (or one line of a JSON-lines file) that cannot be parsed or is malformed."""


# ----------------------------------------------------------------------------------------
# Config fields

def _kind(v) -> str:
    return f"{v!r} ({type(v).__name__})"


def _as_int(v, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{where} must be an int, got {_kind(v)}")
    return int(v)


def _as_float(v, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{where} must be a number, got {_kind(v)}")
    if not math.isfinite(v):
        raise ValueError(f"{where} must be finite, got {v}")
    return v if type(v) in (int, float) else float(v)


def check_fields(obj, owner: str) -> None:
    """Type-check every field of dataclass `obj` against its annotation (see the module docstring);
    numpy scalars are normalised in place to Python numbers. Raises ValueError naming the field."""
    for f in fields(obj):
        v, where, ann = getattr(obj, f.name), f"{owner}: {f.name}", str(f.type).replace(" ", "")
        if ann in ("int", "int|None", "float", "float|None") and v is None:
            if not ann.endswith("|None"):
                raise ValueError(f"{where} must be {'an int' if ann == 'int' else 'a number'}, got None")
            continue
        if ann.startswith("int"):
            setattr(obj, f.name, _as_int(v, where))
        elif ann.startswith("float"):
            setattr(obj, f.name, _as_float(v, where))
        elif ann == "bool":
            if not isinstance(v, bool):
                raise ValueError(f"{where} must be True or False, got {_kind(v)}")
        elif ann == "str":
            if not isinstance(v, str):
                raise ValueError(f"{where} must be a string, got {_kind(v)}")
        elif ann == "list[int]":
            if not isinstance(v, (list, tuple)):
                raise ValueError(f"{where} must be a list of ints, got {_kind(v)}")
            setattr(obj, f.name, [_as_int(x, f"{where}[{i}]") for i, x in enumerate(v)])


def from_dict(cls, d, owner: str | None = None):
    """cls(**d) for a config dataclass, refusing a non-dict and unknown keys by name."""
    owner = owner or cls.__name__
    if not isinstance(d, dict):
        raise ValueError(f"{owner}: expected a JSON object (dict) of fields, got {type(d).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(d) - set(known))
    if unknown:
        close = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        hint = "; ".join(f"{k!r}: did you mean {c[0]!r}?" for k, c in close.items() if c)
        raise ValueError(f"{owner}: unknown key(s) {unknown}" + (f" ({hint})" if hint else f"; known keys: {known}"))
    return cls(**d)


def config_from(cls, d, where, fix: str = "fix the file"):
    """cls.from_dict(d) for a config read from a user's file; a bad field is a BadFileError naming `where`."""
    try:
        return cls.from_dict(d)
    except (TypeError, ValueError) as e:
        raise BadFileError(f"{where}: {e}: {fix}") from None


# ----------------------------------------------------------------------------------------
# JSON files

def parse_json(text: str, path: str | Path, line: int | None = None):
    """json.loads(text); on failure a JSONFileError naming `path` and the line (`line` is the line
    number of `text` within a JSON-lines file; None when text is the whole file)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = f"{path}:{line}:{e.colno}" if line is not None else f"{path}:{e.lineno}:{e.colno}"
        at_end = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")   # both: input ended early
        hint = " (truncated: an interrupted write?)" if at_end else ""
        raise JSONFileError(f"{at}: not valid JSON: {e.msg}{hint}") from None


def read_json(path: str | Path, keys: tuple[str, ...] = ()):
    """Parse a JSON file; with `keys`, the file must hold an object that has all of them."""
    path = Path(path)
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise JSONFileError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
    obj = parse_json(text, path)
    if keys:
        require_keys(obj, keys, str(path))
    return obj


def require_keys(obj, keys, where: str) -> None:
    """Raise JSONFileError naming `where` and every missing key."""
    if not isinstance(obj, dict):
        raise JSONFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise JSONFileError(f"{where}: missing key(s) {missing}")


def positive_ints(where: str, **values) -> None:
    """ValueError naming the first value that is not a positive integer (a sequence: every element)."""
    for name, v in values.items():
        for x in (v if isinstance(v, (tuple, list)) else [v]):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
                raise ValueError(f"{where}: {name} must be a positive integer (or a non-empty list of them), "
                                 f"got {v!r}")
        if isinstance(v, (tuple, list)) and not v:
            raise ValueError(f"{where}: {name} must not be empty")
