"""Fault cases of issue 55: an OS error names the file and what to do.

A write() or fsync on an open file raises an OSError with no filename (EFBIG from `ulimit -f`, ENOSPC);
the write helpers give it the path they were writing (`checks.naming`) and `checks.run_main` turns it
into one line by errno (`checks.os_error_line`). A run lock that is not a regular file (a folder, a FIFO)
is refused the same way. Nothing is lost: the old file is kept, no temp file is left.
"""
import builtins
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import checks
import checkpoint

ROOT = Path(__file__).resolve().parents[1]
EFBIG_FIX = "raise it (ulimit -f unlimited) and run the same command again (finished work is kept)"


class _Capped:
    """An open file whose write() fails as a write past `ulimit -f` does: EFBIG, no filename."""

    def __init__(self, f):
        self.f = f

    def write(self, b):
        raise OSError(errno.EFBIG, "File too large")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _capped_open(file, mode="r", *a, **k):
    f = builtins.open(file, mode, *a, **k)
    return _Capped(f) if any(c in mode for c in "wa") else f


def _one_line(capsys, main) -> str:
    with pytest.raises(SystemExit) as e:
        checks.run_main(main, [], prog="x.py")
    assert e.value.code == 2
    return capsys.readouterr().err


HELPERS = {
    "atomic_write_text": lambda p: checks.atomic_write_text(p, "new\n"),
    "atomic_write_bytes": lambda p: checks.atomic_write_bytes(p, b"new\n"),
    "write_json": lambda p: checks.write_json(p, {"a": 1}),
    "atomic_save": lambda p: checks.atomic_save({"w": torch.zeros(3)}, p),
    "atomic_copy": lambda p: checks.atomic_copy(p.with_name("src"), p),   # export_final's copy
}


@pytest.mark.fault("disk")
@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_efbig_in_a_write_helper_names_the_path_and_keeps_the_old_file(tmp_path, monkeypatch, capsys, helper):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"old\n")
    (tmp_path / "src").write_bytes(b"src\n")
    monkeypatch.setattr(checks, "open", _capped_open, raising=False)
    err = _one_line(capsys, lambda argv: HELPERS[helper](path))
    assert err == f"x.py: error: the file size limit (ulimit -f) stopped writing {path}: {EFBIG_FIX}\n"
    assert path.read_bytes() == b"old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "src"]


@pytest.mark.fault("disk")
def test_a_full_disk_on_resume_names_the_file(tmp_path, monkeypatch, capsys):
    """repair_torn_tail (run on resume) hits ENOSPC at fsync: the line names the log; the log is untouched."""
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(b'{"a": 1}\n{"a"')

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checks.os, "fsync", full)
    err = _one_line(capsys, lambda argv: checks.repair_torn_tail(log))
    assert err == (f"x.py: error: no space left on the device: {log}: free some space, or pass --out-dir on a "
                   f"disk with room\n")
    assert log.read_bytes() == b'{"a": 1}\n{"a"' and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


@pytest.mark.fault("disk")
def test_efbig_moving_damaged_rows_names_the_damaged_file(tmp_path, monkeypatch):
    log = tmp_path / "results.jsonl"
    log.write_bytes(b"not json\n")
    monkeypatch.setattr(checkpoint, "open", _capped_open, raising=False)
    with pytest.raises(OSError) as e:
        checkpoint.quarantine_damaged_rows(log)
    assert e.value.filename == str(tmp_path / "results.jsonl.damaged") and log.read_bytes() == b"not json\n"


@pytest.mark.fault("disk")
@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="RLIMIT_FSIZE is POSIX")
def test_a_real_file_size_limit_is_one_line_naming_the_file(tmp_path):
    """A child with `ulimit -f` 1 KiB (SIGXFSZ ignored, so write() returns EFBIG) writes a 64 KiB file."""
    out = tmp_path / "train.bin"
    out.write_bytes(b"old\n")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        import checks
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        checks.run_main(lambda argv: checks.atomic_write_bytes({str(out)!r}, bytes(65536)), [], prog="x.py")
        """)], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert p.returncode == 2 and p.stderr == (f"x.py: error: the file size limit (ulimit -f) stopped writing "
                                              f"{out}: {EFBIG_FIX}\n")
    assert out.read_bytes() == b"old\n" and [q.name for q in tmp_path.iterdir()] == ["train.bin"]


@pytest.mark.fault("disk")
def test_a_folder_at_the_run_lock_is_one_line(tmp_path, capsys):
    (tmp_path / ".lock").mkdir()

    def main(argv):
        with checks.run_lock(tmp_path):
            raise AssertionError("locked a folder")
    err = _one_line(capsys, main)
    assert err == (f"x.py: error: {tmp_path / '.lock'} is a folder where a regular file must be: move it away (or "
                   f"pass another --out-dir) and run the same command again\n")


@pytest.mark.fault("disk")
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_at_the_run_lock_is_one_line_and_does_not_hang(tmp_path, capsys):
    os.mkfifo(tmp_path / ".lock")

    def main(argv):
        with checks.run_lock(tmp_path):
            raise AssertionError("locked a FIFO")
    err = _one_line(capsys, main)
    assert err.startswith(f"x.py: error: {tmp_path / '.lock'} is not a regular file")
    assert "replace it with a regular file" in err


@pytest.mark.fault("cli")
@pytest.mark.parametrize("code,says", [(errno.EACCES, "fix its permissions"), (errno.EPERM, "fix its permissions"),
                                       (errno.ENOTDIR, "a file where a folder must be"),
                                       (errno.EROFS, "read-only file system"), (errno.EIO, "check the path")])
def test_each_errno_line_names_the_path_and_what_to_do(code, says):
    line = checks.os_error_line(OSError(code, os.strerror(code), "/x/out/ckpt.pt"))
    assert "/x/out/ckpt.pt" in line and says in line
    assert ": :" not in checks.os_error_line(OSError(code, os.strerror(code)))   # no path: no empty ": "
