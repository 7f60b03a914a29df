"""How bench.py measures: `interleaved` timing (turns, so drift hits all alike: docs/bench.md), `clock_for`,
`threads` and `time_limit` for one block, and `run_benchmarks`, the budgeted runner that merges every figure
into one JSON as soon as it exists (docs/gpu.md). Machinery: read bench.py for what is measured.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import statistics
import time
import traceback
from pathlib import Path

import torch

from checks import atomic_write_bytes


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def timed(fn, device, clock=time.perf_counter):
    """(seconds, what fn returned) of one call of fn, the device synchronised before and after."""
    sync(device)
    t0 = clock()
    out = fn()
    sync(device)
    return clock() - t0, out


def interleaved(fns: dict, device, warmup: int = 2, iters: int = 8, clock=time.perf_counter) -> dict:
    """Median seconds per call of each fn, the fns taking turns (ABCABC...) so drift hits all alike."""
    times = {name: [] for name in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            t = timed(fn, device, clock)[0]
            if i >= warmup:
                times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items()}


def clock_for(device):
    """time.thread_time on one CPU thread (other tenants' load does not count), else wall time."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


@contextlib.contextmanager
def threads(n: int):
    """torch intra-op threads set to n within the block, restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class BenchTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise BenchTimeout in the main thread once `seconds` have passed (SIGALRM; None: no limit)."""
    if seconds is None:
        yield
        return

    def alarm(_sig, _frame):
        raise BenchTimeout(f"timed out after {seconds:.0f} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def update_json(path: str, key: str, value) -> None:
    """Merge {key: value} into the JSON file at path (created, and its folder, if absent), atomically."""
    old = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    old[key] = value
    atomic_write_bytes(path, json.dumps(old, indent=2, default=str).encode())


def run_benchmarks(runs: dict, which: list[str], json_path: str | None, limits: dict,
                   budget_s: float | None = None) -> list[str]:
    """runs[name](save, deadline) for each name of which, in order; returns the names that failed. save(res)
    merges a result into json_path at once. With budget_s, each runs under time_limit(min(cap, left - the
    later ones' floors)), limits[name] = (cap, floor); a timeout or a crash keeps the partial figures."""
    t_start, failed, saved = time.monotonic(), [], {}
    for i, name in enumerate(which):
        def save(res, name=name):
            saved[name] = dict(res)
            if json_path:
                update_json(json_path, name, res)
        limit = None
        if budget_s is not None:
            left = budget_s - (time.monotonic() - t_start)
            limit = min(limits[name][0], left - sum(limits[n][1] for n in which[i + 1:]))
            if limit < limits[name][1]:
                print(f"bench: {name} skipped: {left:.0f} s of the budget left")
                failed.append(name)
                save({"skipped": f"{left:.0f} s of the {budget_s:.0f} s budget left"})
                continue
        t0 = time.perf_counter()
        try:
            with time_limit(limit):
                out = runs[name](save, None if limit is None else time.monotonic() + limit)
        except Exception as e:   # record it and go on: the other figures still count
            traceback.print_exc()
            out = {**saved.get(name, {}), "error": f"{type(e).__name__}: {e}"}
            failed.append(name)
        if isinstance(out, dict):
            out["bench_seconds"] = time.perf_counter() - t0
        save(out)
    return failed
