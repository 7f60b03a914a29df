"""What is checked before it is trusted: config values, JSON files, command-line flags, run files.

* Values: `check_fields` types dataclass fields by annotation; `from_dict` refuses unknown keys (did you
  mean ...?); JSON errors start with `path:line:column`; `UserError` is every refusal a user can act on.
* Flags: every entry point builds its parser with `parser` and the value types below; `run_main` is
  every `__main__`: a user's error ends in one line and exit status 2, a bug keeps its traceback.
* Run files: every torch file ends with the sha256 of its bytes (`atomic_save`, checked by `file_digest`
  / `load_file` before anything is unpickled); every results / metrics row and hashed JSON object
  carries the sha256 of its content (`jsonl_line` / `read_jsonl`, `write_json` / `read_hashed_json`).
  Writes go to a temp file, fsync, os.replace; `repair_torn_tail` cuts a partial last row. One writer
  per run directory (`run_lock`); `check_out_dir` checks an output folder before work starts.

Why each rule, and the fuzz that found the gaps: docs/checks.md.
Read next: loop.py, model.py.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import hashlib
import json
import math
import numbers
import os
import re
import shutil
import stat
import sys
import traceback
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path

import torch


class UserError(Exception):
    """An error the user can fix (a bad file, value or directory, a locked run, a full disk): run_main
    prints it as one line and exits with status 2; the project's own refusals subclass it."""


class BadFileError(UserError, ValueError):
    """A file (a config, a checkpoint, a results file) that cannot be used as it is."""


class JSONFileError(BadFileError):
    """A JSON file (or one line of a JSON-lines file) that cannot be parsed or is malformed."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint (or run-directory record) cannot be read or belongs to another configuration."""


class RunLockedError(UserError, RuntimeError):
    """Another process is writing this run directory (it holds RUN_DIR/.lock)."""


class OutDirError(UserError, RuntimeError):
    """An output location that cannot be written: a file, a read-only folder, too little free space."""


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
    """Type-check every field of dataclass `obj` against its annotation ("int" refuses floats and booleans,
    "float" NaN and infinity); numpy scalars become Python numbers in place. ValueError names the field."""
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
        elif ann == "bool" and not isinstance(v, bool):
            raise ValueError(f"{where} must be True or False, got {_kind(v)}")
        elif ann == "str" and not isinstance(v, str):
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


def need_ints(where: str, lo: int = 1, none_ok: bool = False, **values) -> None:
    """ValueError naming the first value that is not an integer >= lo (None passes where none_ok; a list or tuple:
    every element, and not empty). The one check of integer arguments in library functions."""
    for name, v in values.items():
        if v is None and none_ok:
            continue
        if isinstance(v, (tuple, list)) and not v:
            raise ValueError(f"{where}: {name} must not be empty")
        for x in (v if isinstance(v, (tuple, list)) else [v]):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < lo:
                raise ValueError(f"{where}: {name} must be an integer >= {lo}{' or None' if none_ok else ''}"
                                 f"{' (each of a list)' if isinstance(v, (tuple, list)) else ''}, got {v!r}")


def parse_json(text: str, path: str | Path, line: int | None = None):
    """json.loads(text), else a JSONFileError naming `path` and the line (`line`: the line of `text` within a
    JSON-lines file; None when text is the whole file)."""
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
    if not isinstance(obj, dict):
        raise JSONFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise JSONFileError(f"{where}: missing key(s) {missing}")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps a module docstring's layout and appends "(default: X)" to an option's help unless it says
    "default" already, is a flag, or has no default (None: computed, explained in the help)."""

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
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._negative_number_matcher = re.compile(r"^-\.?\d")   # "-1e20" is a value its range check refuses, not a flag

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def parser(description: str | None = None, **kw) -> argparse.ArgumentParser:
    return Parser(description=description, formatter_class=HelpFormatter, **kw)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


# errno -> what to do; {where} is ": PATH" (empty if unnamed), {path} the path or "a file" (issue 55)
_OS_FIXES = {
    errno.ENOSPC: "no space left on the device{where}: free some space, or pass --out-dir on a disk with room",
    errno.EFBIG: "the file size limit (ulimit -f) stopped writing {path}: raise it (ulimit -f unlimited) and run "
                 "the same command again (finished work is kept)",
    errno.EISDIR: "{path} is a folder where a regular file must be: move it away (or pass another --out-dir) and "
                  "run the same command again",
    errno.ENOTDIR: "{path}: a part of this path is a file where a folder must be: move it away or pass another "
                   "--out-dir",
    errno.EINVAL: "{path} is not a regular file (a FIFO, device or special file system?): replace it with a "
                  "regular file or folder, or pass another --out-dir",
    errno.EACCES: "permission denied{where}: fix its permissions (or its folder's) or pass another --out-dir",
    errno.EPERM: "operation not permitted{where}: fix its permissions (or its folder's) or pass another --out-dir",
    errno.EROFS: "read-only file system{where}: pass --out-dir on a writable disk",
}


def os_error_line(e: OSError) -> str:
    """One line for an OSError: the file it names and what to do (by errno), else its text and the path."""
    path = e.filename
    fix = _OS_FIXES.get(e.errno)
    if fix is None:
        return f"{e.strerror or e}{f': {path}' if path else ''}: check the path and its permissions"
    return fix.format(where=f": {path}" if path else "", path=path or "a file")


@contextlib.contextmanager
def naming(path: str | Path):
    """Give an OSError that names no file (a write() or fsync on an open file) the path being written."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:   # only the caller knows which file a write() was for
            e.filename = str(path)
        raise


def run_main(main, argv=None, prog: str | None = None):
    """main(argv), as every `__main__` runs it: a UserError or an OSError ends the command with one line on
    stderr, exit status 2; any other exception is a bug: its traceback and exit status 1."""
    prog = prog or os.path.basename(sys.argv[0])
    try:
        return main(argv)
    except UserError as e:
        msg = str(e)
    except OSError as e:
        msg = os_error_line(e)
    except ModuleNotFoundError as e:
        msg = f"the package {e.name!r} is not installed: pip install -r requirements.txt"
    except Exception as e:
        msg = allocator_line(e)   # the allocator's out-of-memory error is a size, not a bug
        if msg is None:
            traceback.print_exc()
            print(f"{prog}: this is a bug in looped-moe, not in your input: please report it with the command line "
                  f"and the traceback above", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
    print(f"{prog}: error: {one_line(msg)}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def read_config(path: str, cls, flag: str, key: str | None = None):
    """The config dataclass `cls` from the JSON file `path` a user passed as `flag` (a run's config.json
    holds it under `key`), checked field by field; any problem is a BadFileError naming flag, file and fix."""
    try:
        d = read_json(path)
    except JSONFileError as e:
        raise BadFileError(f"{flag} {e}: fix the file") from None
    except OSError as e:
        raise BadFileError(f"{flag} {path}: {e.strerror or e}: give the path of a JSON file") from None
    if key and isinstance(d, dict) and isinstance(d.get(key), dict):
        d = d[key]
    return config_from(cls, d, f"{flag} {path}", f"fix the file (it holds {cls.__name__}.to_dict()'s fields)")


def _ranged(name: str, cast, ok, rule: str):
    """An argparse type: cast(text) (a finite number) for which ok(x) holds, else the error "RULE, got TEXT"."""
    def check(text: str):
        try:
            x = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if cast is int else 'a number'}, "
                                             f"got {text!r}") from None
        if cast is float and not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if not ok(x):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return x
    check.__name__ = check.__qualname__ = name
    return check


# sizes, counts, steps, batch sizes; counts where 0 has a documented meaning; lengths, FLOP budgets, rates
positive_int = _ranged("positive_int", int, lambda n: n >= 1, "must be a positive integer (>= 1)")
nonneg_int = _ranged("nonneg_int", int, lambda n: n >= 0, "must be a non-negative integer (>= 0)")
positive_float = _ranged("positive_float", float, lambda x: x > 0, "must be a positive number (> 0)")
unit_fraction = _ranged("unit_fraction", float, lambda x: 0 < x <= 1, "must lie in (0, 1]")   # a share of the stack


def int_range(lo: int, hi: int):
    return _ranged(f"int in [{lo}, {hi}]", int, lambda n: lo <= n <= hi, f"must lie in [{lo}, {hi}]")


def device(text: str) -> str:
    """auto, or a device torch knows of a type the code is tested on: cpu, cuda, cuda:N."""
    if text == "auto":
        return text
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


class DeviceError(UserError, ValueError):
    """A --device this machine does not have (no CUDA, or cuda:N past the last GPU)."""


def resolve_device(name: str | None, flag: str = "--device") -> str:
    """auto (or None) -> "cuda" when torch sees a GPU, else "cpu"; a CUDA device this machine lacks is a
    DeviceError naming `flag`; anything else unchanged. The one device check every entry point uses."""
    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(name).startswith("cuda"):
        if not torch.cuda.is_available():
            why = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}: no driver or GPU"
            raise DeviceError(f"{flag} {name}: torch sees no CUDA device here (torch {torch.__version__}, {why}): "
                              f"use {flag} cpu or auto")
        index, count = torch.device(name).index or 0, torch.cuda.device_count()
        if index >= count:
            raise DeviceError(f"{flag} {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}: "
                              f"pick one of those, or use {flag} auto")
    return name


class TooLargeError(UserError, ValueError):
    """A model or batch that cannot fit the device's free memory (budget.refuse_oversized)."""


def available_memory(device: str | torch.device) -> int | None:
    """What this process can still allocate on `device`: CUDA's free bytes plus its own cache's unused ones (a
    finished run's blocks, reused by the next), else the OS's MemAvailable (None if unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


_ALLOC = re.compile(r"(?:tried to allocate|Tried to allocate) ([\d.]+) ?(bytes|[KMGT]iB)")


def allocator_line(e: BaseException) -> str | None:
    """One line for the allocator's out-of-memory error (CUDA's OutOfMemoryError or the CPU allocator's), else
    None: the backstop for a size budget.refuse_oversized's lower bound did not catch."""
    text = str(e)
    if not (isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in text):
        return None
    m = _ALLOC.search(text)
    size = f" {m.group(1)} {m.group(2)}" if m else ""
    return (f"out of memory: the allocator could not find{size} more (a model, batch or sequence larger than this "
            f"machine holds): lower the batch size (or raise grad_accum), or use a smaller model")


def add_out_dir(ap: argparse.ArgumentParser, help: str, default: str | None = None) -> None:
    ap.add_argument("--out-dir", default=default, metavar="DIR", help=help)


def add_device(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", type=device, default="auto",
                    help="where to run: auto (cuda when available, else cpu), cpu, cuda or cuda:N")


# torch.save's bytes + this trailer + their sha256 in hex (torch.load ignores it; why: docs/checks.md)
HASH_TRAILER = b"\nlooped-moe-sha256:"
_TRAILER_LEN = len(HASH_TRAILER) + 64 + 1
_TMP = re.compile(r".+\.tmp(\d+)")


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through it (torch.save streams into it)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, b) -> int:
        self.sha.update(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def _pid_alive(pid: int) -> bool:
    try:
        if os.name == "posix":   # elsewhere no safe liveness probe: alive (the file is left alone)
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, another user's
        pass
    return True


def remove_stale_tmp(directory: str | Path) -> list[Path]:
    """Delete `*.tmpPID` files in `directory` left by writers that died (PID no longer running)."""
    d = Path(directory)
    stale = [p for p in (d.iterdir() if d.is_dir() else ())
             if (m := _TMP.fullmatch(p.name)) and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1)))]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _atomic_write(path: str | Path, write) -> None:
    """write(f) into PATH.tmpPID, fsync, os.replace: `path` is always a complete file or absent."""
    path = Path(path)
    remove_stale_tmp(path.parent)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with naming(path), open(tmp, "wb") as f:   # why: a failed write() names no file
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_save(obj, path: str | Path) -> None:
    """torch.save(obj) + sha256 trailer, written atomically."""
    def write(f):
        w = _HashingWriter(f)
        torch.save(obj, w)
        f.write(HASH_TRAILER + w.sha.hexdigest().encode() + b"\n")
    _atomic_write(path, write)


def atomic_write_text(path: str | Path, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text.encode()))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """`data` to `path` atomically, its folder made if missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda f: f.write(data))


def sha256_of(path: str | Path) -> str:
    """The plain sha256 of a file's bytes (manifests and packs list it per file)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def atomic_copy(src: str | Path, dst: str | Path) -> None:
    def copy(f):
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f, 1 << 24)
    _atomic_write(dst, copy)


def file_digest(path: str | Path) -> str:
    """Check a torch file's sha256 trailer against its content; returns the digest. CheckpointError naming
    the file when the trailer is missing (truncated, or not written by this code) or differs."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(size - _TRAILER_LEN, 0))
        tail = f.read()   # a shorter file cannot hold a valid trailer
        want = tail[len(HASH_TRAILER):-1]
        if not (tail.startswith(HASH_TRAILER) and tail.endswith(b"\n")
                and re.fullmatch(rb"[0-9a-f]{64}", want)):
            raise CheckpointError(f"checkpoint {path} has no valid content hash at its end: it is truncated or "
                                  f"corrupt (or was not written by train.py)")
        f.seek(0)
        sha, left = hashlib.sha256(), size - _TRAILER_LEN
        while left and (chunk := f.read(min(left, 1 << 24))):
            sha.update(chunk)
            left -= len(chunk)
    if sha.hexdigest().encode() != want:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: its sha256 differs from the one "
                              f"recorded in the file")
    return want.decode()


def load_file(path: str | Path) -> dict:
    """A torch file written by atomic_save: hash checked, then torch.load(weights_only=True) on CPU.
    Every failure is a CheckpointError naming the file."""
    path = Path(path)
    file_digest(path)
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
        meta = json.loads(ck["meta"])
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); it is truncated or "
                              f"corrupt") from e
    if not isinstance(ck.get("model"), dict) or not isinstance(meta, dict) or "model" not in meta:
        raise CheckpointError(f"checkpoint {path} lacks 'model' weights or meta['model'] (not written by train.py?)")
    return ck


ROW_HASH = "sha256"   # the key of a JSON-lines row's (or a JSON object's) own hash


def _hashed(obj: dict, default=None) -> dict:
    """obj as it reads back as JSON, with ROW_HASH: the sha256 of its canonical JSON."""
    content = json.loads(json.dumps(obj, default=default))
    content.pop(ROW_HASH, None)
    return {**content, ROW_HASH: _row_digest(content)}


def _row_digest(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def jsonl_line(row: dict) -> str:
    return json.dumps(_hashed(row)) + "\n"


def read_jsonl(path: str | Path, keys: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a results.jsonl / metrics.jsonl, each checked against its hash (which is removed) and
    for `keys`. Raises CheckpointError naming the file and line."""
    path, rows = Path(path), []
    for n, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            row = parse_json(raw.decode(), path, n)
            require_keys(row, (ROW_HASH, *keys), f"{path}:{n}")
        except (JSONFileError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{e if isinstance(e, JSONFileError) else f'{path}:{n}: not text'}; "
                                  f"delete that line to recompute it") from None
        if row.pop(ROW_HASH) != _row_digest(row):
            raise CheckpointError(f"{path}:{n}: row content differs from its sha256 (edited or corrupt); "
                                  f"delete that line to recompute it")
        rows.append(row)
    return rows


def write_json(path: str | Path, obj: dict) -> None:
    """Write a JSON object atomically with its own ROW_HASH, so `read_hashed_json` catches a later edit."""
    if not isinstance(obj, dict):
        raise TypeError(f"{path}: write_json takes a dict, got {type(obj).__name__}")
    atomic_write_text(path, json.dumps(_hashed(obj, default=float), indent=1) + "\n")


def read_hashed_json(path: str | Path, keys: tuple[str, ...] = ()) -> dict:
    """A file `write_json` wrote, checked against its hash (which is removed) and for `keys`; JSONFileError
    naming the file when unparseable, not an object, without a hash, edited, or missing keys."""
    path = Path(path)
    obj = read_json(path)
    if isinstance(obj, dict) and ROW_HASH not in obj:
        raise JSONFileError(f"{path}: no sha256 (written by an older version, or edited): delete it to recompute it")
    require_keys(obj, (), str(path))
    if obj.pop(ROW_HASH) != _row_digest(obj):
        raise JSONFileError(f"{path}: content differs from its sha256 (edited or corrupt); if you edited it on "
                            f"purpose: python -m checks restamp {path}")
    require_keys(obj, keys, str(path))
    return obj


def restamp(path: str | Path) -> str:
    """Re-hash a `write_json` file edited on purpose, appending {"date", "previous_sha256"} to its "edited" list;
    a file that is not a JSON object with a hash is refused as `read_hashed_json` refuses it."""
    path = Path(path)
    obj = read_json(path, (ROW_HASH,))
    old = obj.pop(ROW_HASH)
    if old == _row_digest(obj):
        return f"{path}: unchanged (its sha256 matches), not restamped"
    stamp = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "previous_sha256": old}
    write_json(path, {**obj, "edited": [*obj.get("edited", []), stamp]})
    return f"{path}: restamped, edit recorded under \"edited\""


def main(argv: list[str] | None = None) -> None:
    p = parser("Run files: `restamp FILE...` accepts hashed JSON files (ladder.json, ...) you edited by hand.")
    p.add_argument("command", choices=["restamp"])
    p.add_argument("files", nargs="+", metavar="FILE")
    for f in p.parse_args(argv).files:
        print(restamp(f), flush=True)


def read_cache(path: str | Path, keys: tuple[str, ...] = ()) -> dict | None:
    """A cached stage result written by `write_json`, or None (recompute it) when absent or damaged
    (named on stdout, never trusted)."""
    if not Path(path).exists():
        return None
    try:
        return read_hashed_json(path, keys)
    except JSONFileError as e:
        print(f"{e}; recomputing it", flush=True)
        return None


def repair_torn_tail(path: str | Path) -> bool:
    """Cut a partial last line (an append interrupted by a crash: no final newline) from a JSON-lines file
    (only the run's lock holder calls this). True if something was cut."""
    path = Path(path)
    data = path.read_bytes() if path.exists() else b""
    if not data or data.endswith(b"\n"):
        return False
    keep = data[:data.rfind(b"\n") + 1]
    atomic_write_text(path, keep.decode(errors="replace"))
    print(f"{path}: removed a partial last row ({len(data) - len(keep)} bytes, an interrupted write)", flush=True)
    return True


def check_out_dir(path: str | Path, need_bytes: int = 0, what: str = "out dir") -> Path:
    """Make `path` (and its parents) and prove it writable with a probe file; OutDirError naming the path
    when it or a parent is a file, it is read-only, or fewer than need_bytes are free."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutDirError(f"{what} {path} is a file, not a directory: pass another --out-dir")
    parent = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not parent.is_dir():
        raise OutDirError(f"{what} {path}: {parent} is a file, not a directory: pass another --out-dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe.tmp{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise OutDirError(f"{what} {path} is not writable ({e.strerror}): fix its permissions or pass another "
                          f"--out-dir") from None
    free = shutil.disk_usage(path).free
    if need_bytes > free:
        raise OutDirError(f"{what} {path}: needs {need_bytes / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free: free "
                          f"space or pass another --out-dir")
    return path


@contextlib.contextmanager
def run_lock(run_dir: str | Path, holder_kind: str = "trainer"):
    """Hold an exclusive OS lock on RUN_DIR/.lock (fcntl.flock; msvcrt on Windows) for the block; the OS
    drops it however the process exits. A second writer gets RunLockedError naming the holder's pid."""
    path = Path(run_dir) / ".lock"
    # why O_NONBLOCK: a FIFO left at .lock must not hang the open; it is refused below instead
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0), 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        try:
            if os.name == "nt":
                import msvcrt
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            else:
                import fcntl
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if os.name != "nt" and e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise OSError(e.errno, e.strerror, str(path)) from None   # why: no other writer (e.g. no locks here)
            try:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise RunLockedError(f"run directory {Path(run_dir)} is in use by another {holder_kind} (pid {holder} "
                                 f"holds {path}); wait for it to finish or use another directory") from None
        if os.name != "nt":   # record the holder for the other writer's message
            with naming(path):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        os.close(fd)   # releases the lock


def endpoint_id(rec: dict) -> str:
    """'RUN_NAME@BRANCH_STEP' (or RUN_NAME alone for an endpoint without a branch): the key of an endpoint."""
    name = rec.get("name") or Path(str(rec.get("run", "?"))).name
    return name if rec.get("branch_step") is None else f"{name}@{rec['branch_step']}"


if __name__ == "__main__":
    run_main(main)
