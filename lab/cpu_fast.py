"""CPU-only speed tricks: the few-row projection layout (W x^T) for decoding, and the allocator.

Batch-1 decoding multiplies 1 row (the unlooped model) or r rows (PLT's stacked loops,
How-to-Loop Algorithm 2) by weights that do not stay in cache. On CPU, F.linear on 2 rows
costs about 2 rows, while W @ x^T does a few rows in about one row's time: PLT's premise
(a call on r stacked rows costs what a call on one row costs) holds only in that layout.

  * `linear(x, weight)`: x @ weight^T, computed as W @ x^T for 1..SKINNY_ROWS rows in CPU
    inference (one row padded to two when torch has 2+ threads); plain F.linear otherwise
    (with gradients, under torch.compile, off CPU, or above SKINNY_ROWS rows).
  * `few_row_projections(model)`: a context manager under which every projection a decoded
    token passes runs through `linear`. model.GPT.forward_step (so `generate`) enters it.
    Modules name those projections in a class attribute `DECODE_PROJECTIONS` (attention's
    q/k/v/o, the dense SwiGLU's gate/up/down); the untied output head `lm_head` is added.
  * `machine_settings(allocator)`: what this machine offers a run (CPUs, threads, AMX, CUDA), and
    optionally glibc's mmap / trim thresholds raised, so freed activations are not faulted back in.

Same results as plain nn.Linear to float rounding (tests/test_model.py). Read after
model.py and attention.py; measurements and the mechanism's details: docs/cpu_fast.md.
"""
from __future__ import annotations

import contextlib
import os
import types
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# Products with at most this many rows (batch-1 decoding; PLT's r stacked loops) run as
# W @ x^T under `few_row_projections`. 0 turns the rule off (bench.py times both).
SKINNY_ROWS = 16


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight^T, (..., d_in) -> (..., d_out): F.linear, except that in CPU inference a product of
    1..SKINNY_ROWS rows runs as W @ x^T (a single row padded to two when torch has 2+ threads)."""
    rows = x.numel() // x.shape[-1]
    if (not 0 < rows <= SKINNY_ROWS or x.device.type != "cpu" or torch.is_grad_enabled()
            or torch.compiler.is_compiling()):
        return F.linear(x, weight)
    x_RD = x.reshape(rows, x.shape[-1])
    if rows == 1:   # MKL's GEMV runs on one thread here; a two-column GEMM uses them all
        if torch.get_num_threads() == 1:
            return F.linear(x, weight)
        x_RD = torch.cat([x_RD, x_RD])
    y_RO = torch.mm(weight, x_RD.t())[:, :rows].t().contiguous()   # (rows, d_out), F.linear's layout
    return y_RO.view(*x.shape[:-1], weight.shape[0])


def _few_row_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return linear(x, self.weight)


# model -> [(projection, its few-row forward)]: weak keys, so a model's entry goes with the model
_BOUND: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


def _projections(model: nn.Module) -> list[nn.Linear]:
    """The matrices a decoded token passes: each module's DECODE_PROJECTIONS, then the head."""
    lins = []
    for m in model.modules():
        lins += [getattr(m, name) for name in getattr(m, "DECODE_PROJECTIONS", ())]
    head = getattr(model, "lm_head", None)
    lins += [head] if head is not None else []
    if biased := [type(m).__name__ for m in lins if m.bias is not None]:   # _few_row_forward drops a bias
        raise ValueError(f"cpu_fast.few_row_projections: projections with a bias are not supported ({biased})")
    return lins


@contextlib.contextmanager
def few_row_projections(model: nn.Module):
    """Within this block, the model's projections (`_projections`) compute with `linear` on CPU.

    Each projection gets an instance-level `forward` for the duration of the block, removed on
    exit (also on error); a block nested inside another leaves the outer one's in place. The list
    of projections is built once per model (`_BOUND`); a projection swapped in later runs plain
    F.linear (slower, same results). Outside this block the model is plain nn.Linear everywhere,
    and a tied head (`tie_embeddings`) stays F.linear.
    """
    pairs = _BOUND.get(model)
    if pairs is None:   # built once per model: this runs for every decoded token
        pairs = _BOUND[model] = [(m, types.MethodType(_few_row_forward, m)) for m in _projections(model)]
    if not pairs or pairs[0][0].weight.device.type != "cpu":
        yield model
        return
    mine = [(m, f) for m, f in pairs if "forward" not in m.__dict__]
    for m, f in mine:
        m.__dict__["forward"] = f
    try:
        yield model
    finally:
        for m, _ in mine:
            m.__dict__.pop("forward", None)


MALLOC_MMAP_BYTES, MALLOC_TRIM_BYTES = 1 << 25, 1 << 30   # glibc caps the mmap threshold at 32 MiB (64-bit)


def machine_settings(allocator: bool = False) -> dict:
    """What this machine offers and what a run here uses (one line of the run's summary; reproduce.py may print
    it): usable CPUs, torch intra-op threads, the glibc allocator's mmap / trim thresholds, AMX, CUDA.
    allocator=True raises the thresholds in this process (glibc mallopt), so freed activations stay mapped
    instead of being returned to the OS and faulted back in every step; numbers are unchanged. bf16 autocast
    on CPU changes the numbers and measured slower, so fp32 stays the CPU default (docs/train.md)."""
    flags = ""
    with contextlib.suppress(OSError):
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    out = {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "amx_bf16": "amx_bf16" in flags.split(),
           "avx512_bf16": "avx512_bf16" in flags.split(),
           "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "cpu_dtype": "fp32",
           "malloc": "environment" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "default"}
    if allocator and out["malloc"] == "default":
        with contextlib.suppress(OSError, AttributeError):
            import ctypes
            libc = ctypes.CDLL(None)   # M_TRIM_THRESHOLD = -1, M_MMAP_THRESHOLD = -3 (glibc malloc.h)
            if libc.mallopt(-3, MALLOC_MMAP_BYTES) and libc.mallopt(-1, MALLOC_TRIM_BYTES):
                out["malloc"] = f"mmap threshold {MALLOC_MMAP_BYTES >> 20} MiB, trim {MALLOC_TRIM_BYTES >> 20} MiB"
    return out
