"""Run-directory files a reader can trust: content hashes, atomic writes, hashed JSON-lines rows, one writer.

Every torch file written here ends with the sha256 of its bytes (`atomic_save`; torch.load ignores the
trailer), checked by `file_digest` / `load_file` before anything is unpickled; every results / metrics
row carries the sha256 of its content (`jsonl_line`, checked by `read_jsonl`, naming file and line).
Writes go to a temp file, fsync, os.replace (`atomic_save`, `atomic_write_text`, `atomic_copy`), so a
crash never leaves a half-written file under the real name; temp files of dead writers are removed at
the next write; a partial last row (a crash during an append) is cut by `repair_torn_tail`. One writer
per run directory: an exclusive OS lock on RUN_DIR/.lock (`run_lock`, else RunLockedError; reproduce.py
locks its out dir the same way). A JSON object carries its own sha256 (`write_json`, checked by
`read_json`; `read_cache` recomputes a damaged cache); an output folder is checked before work starts
(`check_out_dir`: not a file, writable, enough free space). `endpoint_id`: an endpoint record's key.

No training here (train.py and checkpoint.py use these; eval.py, scaling.py and reproduce.py read run
files through them). History and measurements: docs/runfiles.md. Read next: checkpoint.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

from checks import JSONFileError, UserError, parse_json, require_keys
from checks import read_json as checks_read_json


class CheckpointError(UserError, RuntimeError):
    """A checkpoint (or run-directory record) cannot be read or belongs to another configuration."""


class RunLockedError(UserError, RuntimeError):
    """Another process is writing this run directory (it holds RUN_DIR/.lock)."""


# ----------------------------------------------------------------------------------------
# Hashed torch files and atomic writes

# torch.save's bytes + this trailer + their sha256 in hex (torch.load ignores it; why: docs/runfiles.md)
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
    if os.name != "posix":   # no safe liveness probe: treat as alive (the file is left alone)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_tmp(directory: str | Path) -> list[Path]:
    """Delete `*.tmpPID` files in `directory` left by writers that died (PID no longer running)."""
    removed = []
    d = Path(directory)
    if not d.is_dir():
        return removed
    for p in d.iterdir():
        m = _TMP.fullmatch(p.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _atomic_write(path: str | Path, write) -> None:
    """write(f) into PATH.tmpPID, fsync, os.replace: `path` is always a complete file or absent.
    Stale temp files of dead writers in the same directory are removed first."""
    path = Path(path)
    remove_stale_tmp(path.parent)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_save(obj, path: str | Path) -> None:
    """torch.save(obj) + sha256 trailer, written atomically (see _atomic_write)."""
    def write(f):
        w = _HashingWriter(f)
        torch.save(obj, w)
        f.write(HASH_TRAILER + w.sha.hexdigest().encode() + b"\n")
    _atomic_write(path, write)


def atomic_write_text(path: str | Path, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text.encode()))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """`data` to `path` atomically, its folder made if missing (prepared data, BPE files, JSON)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda f: f.write(data))


def sha256_of(path: str | Path) -> str:
    """The plain sha256 of a file's bytes (manifests and packs list it per file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_copy(src: str | Path, dst: str | Path) -> None:
    """A byte copy of `src` at `dst`, written atomically (see _atomic_write)."""
    def copy(f):
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f, 1 << 24)
    _atomic_write(dst, copy)


def file_digest(path: str | Path) -> str:
    """Check a torch file's sha256 trailer against its content; returns the digest. Raises CheckpointError
    naming the file when the trailer is missing (truncated, or not written by this code) or differs."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        tail = b""
        if size >= _TRAILER_LEN:
            f.seek(size - _TRAILER_LEN)
            tail = f.read()
        want = tail[len(HASH_TRAILER):-1]
        if not (tail.startswith(HASH_TRAILER) and tail.endswith(b"\n")
                and re.fullmatch(rb"[0-9a-f]{64}", want)):
            raise CheckpointError(f"checkpoint {path} has no valid content hash at its end: it is truncated or "
                                  f"corrupt (or was not written by train.py)")
        f.seek(0)
        sha, left = hashlib.sha256(), size - _TRAILER_LEN
        while left:
            chunk = f.read(min(left, 1 << 24))
            if not chunk:
                break
            sha.update(chunk)
            left -= len(chunk)
    if sha.hexdigest().encode() != want:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: its sha256 differs from the one "
                              f"recorded in the file")
    return want.decode()


def load_file(path: str | Path) -> dict:
    """A torch file written by atomic_save: content hash checked, then torch.load(weights_only=True) on CPU.
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


# ----------------------------------------------------------------------------------------
# Hashed JSON-lines rows (results.jsonl, metrics.jsonl)

def _row_digest(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


ROW_HASH = "sha256"   # the key of a JSON-lines row's own hash


def jsonl_line(row: dict) -> str:
    """One JSON-lines row with ROW_HASH: the sha256 of its content as it reads back (canonical JSON)."""
    content = json.loads(json.dumps(row))
    content.pop(ROW_HASH, None)
    return json.dumps({**content, ROW_HASH: _row_digest(content)}) + "\n"


def read_jsonl(path: str | Path, keys: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a results.jsonl / metrics.jsonl, each checked against its hash (which is removed) and
    for `keys`. Raises CheckpointError naming the file and line."""
    path, rows = Path(path), []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = parse_json(raw.decode(), path, n)
            require_keys(row, (ROW_HASH, *keys), f"{path}:{n}")
        except (JSONFileError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{e if isinstance(e, JSONFileError) else f'{path}:{n}: not text'}; "
                                  f"delete that line to recompute it") from None
        got = row.pop(ROW_HASH)
        if got != _row_digest(row):
            raise CheckpointError(f"{path}:{n}: row content differs from its sha256 (edited or corrupt); "
                                  f"delete that line to recompute it")
        rows.append(row)
    return rows


def write_json(path: str | Path, obj: dict) -> None:
    """Write a JSON object atomically with ROW_HASH: the sha256 of its content as it reads back, so
    `read_json` catches any later edit or damage (ladder.json, eval/*.json, probes.json, PACK.json ...)."""
    if not isinstance(obj, dict):
        raise TypeError(f"{path}: write_json takes a dict, got {type(obj).__name__}")
    content = json.loads(json.dumps(obj, default=float))   # numpy scalars as numbers
    content.pop(ROW_HASH, None)
    atomic_write_text(path, json.dumps({**content, ROW_HASH: _row_digest(content)}, indent=1) + "\n")


def read_json(path: str | Path, keys: tuple[str, ...] = ()) -> dict:
    """A file `write_json` wrote, checked against its hash (which is removed) and for `keys`. Raises
    JSONFileError naming the file: unparseable, not an object, no hash, hash mismatch, missing keys."""
    path = Path(path)
    obj = checks_read_json(path)
    if isinstance(obj, dict) and ROW_HASH not in obj:
        raise JSONFileError(f"{path}: no sha256 (written by an older version, or edited): delete it to recompute it")
    require_keys(obj, (ROW_HASH,), str(path))
    got = obj.pop(ROW_HASH)
    if got != _row_digest(obj):
        raise JSONFileError(f"{path}: content differs from its sha256 (edited or corrupt)")
    require_keys(obj, keys, str(path))
    return obj


def read_cache(path: str | Path, keys: tuple[str, ...] = ()) -> dict | None:
    """A cached stage result written by `write_json`, or None (recompute it) when it is absent or damaged;
    a damaged one is named on stdout, never trusted."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return read_json(path, keys)
    except JSONFileError as e:
        print(f"{e}; recomputing it", flush=True)
        return None


def repair_torn_tail(path: str | Path) -> bool:
    """Cut a partial last line (an append interrupted by a crash: no final newline) from a JSON-lines file.
    Only the run's writer (lock holder) calls this. Returns True if something was cut."""
    path = Path(path)
    if not path.exists():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    keep = data[:data.rfind(b"\n") + 1]
    atomic_write_text(path, keep.decode(errors="replace"))
    print(f"{path}: removed a partial last row ({len(data) - len(keep)} bytes, an interrupted write)", flush=True)
    return True


# ----------------------------------------------------------------------------------------
# Output locations checked before work starts

class OutDirError(UserError, RuntimeError):
    """An output location that cannot be written: a file, a read-only folder, too little free space."""


def check_out_dir(path: str | Path, need_bytes: int = 0, what: str = "out dir") -> Path:
    """Make `path` (and its parents) and prove it writable by writing a probe file; refuse with OutDirError
    naming the path when it is a file, a parent is a file, it is read-only, or < need_bytes are free."""
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


# ----------------------------------------------------------------------------------------
# One writer per run directory

@contextlib.contextmanager
def run_lock(run_dir: str | Path, holder_kind: str = "trainer"):
    """Hold an exclusive OS lock on RUN_DIR/.lock (fcntl.flock; msvcrt on Windows) for the block. The OS
    drops it when the process exits however it exits, so a killed trainer never leaves a stale lock.
    A second writer gets RunLockedError naming the holder's pid (reproduce.py locks its out dir the same way)."""
    path = Path(run_dir) / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            if os.name == "nt":
                import msvcrt
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            else:
                import fcntl
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise RunLockedError(f"run directory {Path(run_dir)} is in use by another {holder_kind} (pid {holder} holds "
                                 f"{path}); wait for it to finish or use another directory") from None
        if os.name != "nt":   # record the holder for the other writer's message
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        os.close(fd)   # closing the descriptor releases the lock


def endpoint_id(rec: dict) -> str:
    """'RUN_NAME@BRANCH_STEP' (or RUN_NAME alone for an endpoint without a branch): the key of an endpoint."""
    name = rec.get("name") or Path(str(rec.get("run", "?"))).name
    return name if rec.get("branch_step") is None else f"{name}@{rec['branch_step']}"
