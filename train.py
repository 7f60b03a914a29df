"""Training: AdamW + warmup-stable-decay with decay branches, exact resume, DDP / FSDP2.

SMELT Sec. 3.1 ("Optimizer and schedule") and Sec. 4.1. One call trains a *stable* run (linear warmup, then a
constant learning rate up to `stable_steps`, checkpointed at every fork point) and all of its *decay branches*:
each b in `branch_steps` starts from the stable state after b steps and cosine-decays the learning rate to
`min_lr_frac * lr` over `decay_steps` more steps; decay step j of every branch reads training batch
`stable_steps + j` ("fresh data not seen during the stable phase"). Each endpoint appends one row to
RUN_DIR/results.jsonl: its validation report (eval.py) with D, F (budget.flops_per_token, no head, at the measured
document length), C = F*D, S (SMELT Eq. 1) and N, the points scaling.py fits. RUN_DIR also holds config.json,
metrics.jsonl, ckpt/ (resume points while unfinished), endpoints/ and ckpt.pt (the longest branch's endpoint,
what eval.py and probes.py load). A non-finite loss or gradient norm raises DivergenceError before the update,
a finite blow-up (checkpoint.divergence_limit) at a logged step. CUDA: bf16 autocast, torch.compile; CPU: fp32, eager.
Read first: model.py, budget.py; then checkpoint.py (resume) and checks.py. Design notes: docs/train.md.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import re
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import budget
import checks
import configs
import data as data_mod
from checkpoint import (Checkpoints, DivergenceError, branches, endpoint_path, export_final, logged, refuse_unrunnable,
                        save_kind)
from checks import check_fields, from_dict, run_lock
from data import SyntheticData   # a corpus-free stand-in with TokenData's interface (tests, benchmarks)
from eval import token_nll, val_loss_by
from loop import LoopConfig, LoopSpec
from model import GPT, ModelConfig, compile_model

# a CPU speed path kept beside glibc's defaults: 6-16 % faster tiny steps (docs/train.md, 2026-12-07)
MALLOC_MMAP_BYTES, MALLOC_TRIM_BYTES = 1 << 25, 1 << 30   # glibc caps the mmap threshold at 32 MiB (64-bit)
MALLOC_SETTING = f"mmap threshold {MALLOC_MMAP_BYTES >> 20} MiB, trim {MALLOC_TRIM_BYTES >> 20} MiB"


def machine_settings(allocator: bool = False) -> dict:
    """What this machine offers and a run here uses: CPUs, torch threads, AMX, CUDA, the glibc allocator's mmap /
    trim thresholds, which allocator=True raises in this process (same numbers, faster: docs/train.md)."""
    flags = ""
    with contextlib.suppress(OSError):
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    out = {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "amx_bf16": "amx_bf16" in flags.split(),
           "avx512_bf16": "avx512_bf16" in flags.split(),
           "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "cpu_dtype": "fp32",
           "cpu_adamw": adamw_impl(torch.device("cpu")),
           "malloc": "environment" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "default"}
    if allocator and out["malloc"] == "default":
        with contextlib.suppress(OSError, AttributeError):
            import ctypes
            libc = ctypes.CDLL(None)   # M_TRIM_THRESHOLD = -1, M_MMAP_THRESHOLD = -3 (glibc malloc.h)
            if libc.mallopt(-3, MALLOC_MMAP_BYTES) and libc.mallopt(-1, MALLOC_TRIM_BYTES):
                out["malloc"] = MALLOC_SETTING
    return out


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of a CUDA device (budget.PEAK_BF16_FLOPS by name), None when unknown or not CUDA."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in budget.PEAK_BF16_FLOPS.items() if k in name), None)


def _opt(default, help: str):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


DIST_BACKENDS = ("auto", "nccl", "gloo", "mpi", "ucc")   # auto: nccl on CUDA, gloo on CPU


@dataclass
class TrainConfig:
    lr: float = _opt(1e-3, "peak (stable-phase) learning rate")
    min_lr_frac: float = _opt(0.0, "final learning rate of each decay branch, as a fraction of lr")
    warmup_steps: int = _opt(100, "linear warmup steps")
    stable_steps: int = _opt(1000, "length of the stable run in optimizer steps")
    branch_steps: list[int] = _opt([], "stable steps at which decay branches fork, the last at stable_steps "
                                       "(default: stable_steps)")
    decay_steps: int = _opt(100, "steps of every decay branch (decay tokens = decay_steps x batch_size x block_size)")
    batch_size: int = _opt(32, "global batch in sequences per optimizer step (all ranks, all micro-batches)")
    grad_accum: int = _opt(1, "micro-batches per optimizer step on each rank")
    block_size: int = _opt(0, "training context length (0: the model's block_size)")
    weight_decay: float = _opt(0.1, "AdamW weight decay on matrices")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    eps: float = _opt(1e-8, "AdamW epsilon")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0: no clipping)")
    seed: int = _opt(0, "seed for initialisation and the data order")
    eval_interval: int = _opt(0, "validation every N steps during training (0: only at branch ends)")
    eval_tokens: int = _opt(65536, "validation tokens per source (at most)")
    log_interval: int = _opt(10, "log a metrics row and a progress line every N steps")
    ckpt_interval: int = _opt(0, "extra resume checkpoints every N steps (branch steps are always saved)")
    flops_ctx: float = _opt(0.0, "document length for F in results (0: measured from the training data)")
    device: str = _opt("auto", "auto | cpu | cuda (under torchrun: cuda:LOCAL_RANK)")
    dtype: str = _opt("auto", "auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32")
    compile: bool = _opt(True, "torch.compile the training step on CUDA (ignored on CPU)")
    fsdp: bool = _opt(False, "shard parameters with FSDP2 under torchrun instead of DDP")
    dist_backend: str = _opt("auto", "process group backend under torchrun: auto (nccl on CUDA, gloo on CPU)")
    out_dir: str = _opt("runs/train", "run directory (CLI; the library call takes run_dir)")

    def __post_init__(self):
        self.validate()

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":   # unknown keys are named in a ValueError
        return from_dict(cls, d)

    @property
    def branches(self) -> list[int]:
        return branches(self.branch_steps, self.stable_steps)

    def validate(self, world_size: int = 1) -> None:
        """Types and ranges of every field (at construction with world_size 1; the Trainer's with its own)."""
        def bad(msg):
            raise ValueError(f"TrainConfig: {msg}")
        check_fields(self, "TrainConfig")   # ints are ints (not bools or 2.5), floats finite, bools bools
        rules = [*((n, lambda x: x > 0, "must be > 0") for n in POSITIVE),
                 *((n, lambda x: x >= 0, "must be >= 0") for n in NON_NEGATIVE),
                 ("min_lr_frac", lambda x: 0.0 <= x <= 1.0, "must lie in [0, 1]"),
                 ("beta1", lambda x: 0.0 <= x < 1.0, "must lie in [0, 1)"),
                 ("beta2", lambda x: 0.0 <= x < 1.0, "must lie in [0, 1)"),
                 ("seed", lambda x: x <= 2**32 - 1, "must lie in [0, 2**32 - 1]"),   # numpy's seed range
                 ("dtype", lambda x: x in ("auto", "bf16", "fp32"), "must be auto|bf16|fp32"),
                 ("device", lambda x: re.fullmatch(r"auto|cpu|cuda(:\d+)?", x), "must be auto|cpu|cuda|cuda:N"),
                 ("dist_backend", lambda x: x in DIST_BACKENDS, f"must be {'|'.join(DIST_BACKENDS)}"),
                 ("out_dir", bool, "must be a non-empty path")]
        for name, ok, rule in rules:
            if not ok(getattr(self, name)):
                bad(f"{name} {rule}, got {getattr(self, name)!r}")
        if self.block_size and self.flops_ctx > self.block_size:   # 0: the model's; Trainer checks it then
            bad(f"flops_ctx must be <= block_size ({self.block_size}), got {self.flops_ctx}")
        for b in self.branch_steps:
            if not 1 <= b <= self.stable_steps:
                bad(f"branch_steps must lie in [1, stable_steps={self.stable_steps}], got {b}")
        if self.branch_steps and max(self.branch_steps) != self.stable_steps:   # else steps past it would never train
            bad(f"the stable run ends at its last fork: max(branch_steps) must be stable_steps={self.stable_steps}, "
                f"got {max(self.branch_steps)} (add {self.stable_steps} to branch_steps or lower stable_steps)")
        if self.batch_size % (world_size * self.grad_accum):
            bad(f"batch_size={self.batch_size} must be divisible by world_size x grad_accum = "
                f"{world_size} x {self.grad_accum}")


POSITIVE = ("lr", "stable_steps", "decay_steps", "batch_size", "grad_accum", "log_interval", "eval_tokens", "eps")
NON_NEGATIVE = ("warmup_steps", "block_size", "weight_decay", "grad_clip", "eval_interval", "ckpt_interval",
                "flops_ctx", "seed")


# ---- Schedule and optimizer ----------------------------------------------------------------------

def lr_at(tc: TrainConfig, step: int, branch: int | None = None) -> float:
    """Learning rate of optimizer step `step` (0-based) on the stable run or on the branch forked at `branch`."""
    if branch is None or step < branch:
        return tc.lr * min(1.0, (step + 1) / tc.warmup_steps) if tc.warmup_steps else tc.lr
    start, floor = lr_at(tc, branch), tc.min_lr_frac * tc.lr
    t = min(1.0, (step - branch + 1) / tc.decay_steps)   # the branch's last step reaches the floor
    return floor + (start - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def decay_split(gpt: nn.Module) -> tuple[list[str], list[str]]:
    """(names with weight decay, names without): matrices decay; gains, biases, embeddings and what a module
    declares in NO_DECAY (loop.LoopAdapter's mixing M) do not."""
    emb = {id(m.weight) for m in gpt.modules() if isinstance(m, nn.Embedding)}
    declared = {id(getattr(m, n)) for m in gpt.modules() for n in getattr(m, "NO_DECAY", ()) if hasattr(m, n)}
    decay, keep = [], []
    for name, p in gpt.named_parameters():
        no = p.dim() < 2 or id(p) in emb or id(p) in declared
        (keep if no else decay).append(name)
    return decay, keep


def make_optimizer(gpt: nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    params = dict(gpt.named_parameters())
    decay, keep = decay_split(gpt)
    groups = [{"params": [params[n] for n in decay], "weight_decay": tc.weight_decay},
              {"params": [params[n] for n in keep], "weight_decay": 0.0}]
    fused = adamw_impl(next(gpt.parameters()).device) == "fused"
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, fused=fused or None)


def adamw_impl(device: torch.device) -> str:
    """AdamW's kernels on `device`: fused on CPU (one pass per tensor, measured faster: docs/bench.md), else torch's
    default (for-each). Printed in the machine line."""
    return "fused" if device.type == "cpu" else "foreach"


class Objective(nn.Module):
    """The training step's forward as plain tensors (what DDP, FSDP and torch.compile wrap): (cross-entropy
    summed over non-ignored targets, their count, load-balance loss, z-loss, {"L{layer}.v{visit}": tokens per expert
    (E,)} in execution order)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: Tensor, targets: Tensor, doc_ids: Tensor | None, per_token: bool = False):
        out = self.gpt.run(idx, None, doc_ids)
        logits = out.logits.float()
        if per_token:   # validation: (B, T) cross-entropy, 0 at ignored targets
            return token_nll(logits, targets)
        ce_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="sum")
        load = {f"L{v.layer}.v{v.visit}": s.tokens_per_expert for v, s in out.router}   # labelled: no plan rebuild
        return ce_sum, (targets != -1).sum(), out.aux_loss, out.z_loss, load


def forward_backward(model, cfg: ModelConfig, idx, tgt, doc, scale, accum: int = 1, sync=None,
                     autocast=contextlib.nullcontext):
    """Forward and backward over `accum` micro-batches: loss = CE sum x scale + router losses / accum; sync(last
    micro): DDP's context. Returns (CE sum, aux, z), the objective's load summed over micro-batches (None: dense),
    the detached loss."""
    micro = idx.shape[0] // accum
    stats, load, total = torch.zeros(3, device=idx.device), None, 0.0
    for m in range(accum):
        rows = slice(m * micro, (m + 1) * micro)
        with sync(m == accum - 1) if sync else contextlib.nullcontext(), autocast():
            ce_sum, _, aux, z, tpe = model(idx[rows], tgt[rows], None if doc is None else doc[rows])
            loss = ce_sum * scale + (cfg.aux_loss_coef * aux + cfg.z_loss_coef * z) / accum
        loss.backward()
        total = total + loss.detach()
        stats += torch.stack([ce_sum.detach().float(), aux.detach().float() / accum, z.detach().float() / accum])
        if tpe:   # (visits, E) tokens per expert in the objective's label order, summed over micro-batches
            t = torch.stack(list(tpe.values())).float()
            load = t if load is None else load + t
    return stats, None if load is None else dict(zip(tpe, load)), total


def update(gpt: nn.Module, opt, grad_clip: float, check=None):
    """Clip the gradient norm (0: no clip) and step; check(grad norm) runs before the step, its value returned."""
    gn = torch.nn.utils.clip_grad_norm_(gpt.parameters(), grad_clip or float("inf"))
    out = check(gn.full_tensor() if hasattr(gn, "full_tensor") else gn) if check else None
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out


def step_scale(tgt: Tensor) -> Tensor:
    """forward_backward's scale in one process: 1 / the batch's target count."""
    return 1 / (tgt != -1).sum().clamp(min=1)


# ---- The trainer ---------------------------------------------------------------------------------

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0


def init_distributed(tc: TrainConfig) -> Dist:
    """Join the torchrun process group when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU); else a 1-process Dist."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Dist()
    if not dist.is_initialized():
        cuda = tc.device.startswith("cuda") or (tc.device == "auto" and torch.cuda.is_available())
        dist.init_process_group(tc.dist_backend if tc.dist_backend != "auto" else ("nccl" if cuda else "gloo"))
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def select_device(tc: TrainConfig, d: Dist) -> tuple[torch.device, object]:
    """(device, autocast context factory) of tc.device and tc.dtype; TF32 matmuls on CUDA."""
    dev = checks.resolve_device(tc.device, "TrainConfig.device")
    if dev == "cuda" and d.world > 1:
        dev = f"cuda:{d.local_rank}"
    device = torch.device(dev)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    bf16 = tc.dtype == "bf16" or (tc.dtype == "auto" and cuda)
    return device, ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext)


def wrap_parallel(objective: Objective, d: Dist, fsdp: bool, device: torch.device):
    """(the module the step calls, the DDP wrapper or None): FSDP2 per block + root, DDP, or the objective."""
    if d.world > 1 and fsdp:
        from torch.distributed.fsdp import fully_shard
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # router stats
        for blk in objective.gpt.blocks:
            fully_shard(blk)
        fully_shard(objective)
        return objective, None
    if d.world > 1:
        ddp = nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
        return ddp, ddp
    return objective, None


class Trainer(Checkpoints):
    def __init__(self, model_cfg: ModelConfig, tc: TrainConfig, data, run_dir: str | Path, meta: dict | None = None):
        if not isinstance(model_cfg, ModelConfig) or not isinstance(tc, TrainConfig):
            raise ValueError(f"Trainer needs a ModelConfig and a TrainConfig, got {type(model_cfg).__name__} and "
                             f"{type(tc).__name__}")
        checks.resolve_device(tc.device, "TrainConfig.device")   # before anything is allocated
        self.d = init_distributed(tc)
        if self.d.world == 1 and (tc.fsdp or tc.dist_backend != "auto"):   # would be silently ignored
            raise ValueError(f"TrainConfig: {'fsdp=True' if tc.fsdp else f'dist_backend={tc.dist_backend!r}'} needs "
                             f"torchrun (WORLD_SIZE > 1); run under torchrun or leave it out")
        tc = TrainConfig(**{**asdict(tc), "block_size": tc.block_size or model_cfg.block_size})   # a copy
        tc.validate(self.d.world)
        if tc.block_size > model_cfg.block_size:
            raise ValueError(f"TrainConfig: block_size={tc.block_size} exceeds the model's "
                             f"block_size={model_cfg.block_size}")
        if data.vocab_size > model_cfg.vocab_size:
            raise ValueError(f"ModelConfig: vocab_size={model_cfg.vocab_size} is smaller than the data's "
                             f"{data.vocab_size}")
        self.model_cfg, self.tc, self.data = model_cfg, tc, data
        self.meta = dict(meta or {})
        self.run_dir, self.ckpt_dir = Path(run_dir), Path(run_dir) / "ckpt"
        self.device, self.autocast = select_device(tc, self.d)
        refuse_unrunnable(model_cfg)
        too_large = budget.oversized(model_cfg, self.device, tc.batch_size // self.d.world, tc.block_size,
                                     "one training step", train=True, grad_accum=tc.grad_accum,
                                     shards=self.d.world if tc.fsdp else 1, rows_hint="raise grad_accum",
                                     rows_shown=tc.batch_size)
        if self.d.world > 1:   # every rank refuses together: the others would wait in the model's setup
            flag = torch.tensor([float(too_large is not None)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            too_large = too_large or ("another rank cannot hold one training step (its own error names the setting)"
                                      if flag.item() else None)
        if too_large:
            raise checks.TooLargeError(too_large)
        if model_cfg.loop.active and "control" not in self.meta and self.d.rank == 0:
            print("train: S of this looped model is measured against its own dense control; SMELT Eq. 1 measures "
                  "a matched looped model at its Baseline's scale: pass meta['control'] (reproduce.py does)",
                  file=sys.stderr, flush=True)
        torch.manual_seed(tc.seed)
        random.seed(tc.seed)
        np.random.seed(tc.seed)
        self.gpt = GPT(model_cfg).to(self.device)
        self.objective = Objective(self.gpt)
        model, self.ddp = wrap_parallel(self.objective, self.d, tc.fsdp, self.device)
        self.opt = make_optimizer(self.gpt, tc)
        self.model = compile_model(model) if (tc.compile and self.device.type == "cuda") else model   # fresh per run
        self.tokens_per_step = tc.batch_size * tc.block_size
        self.micro = tc.batch_size // (self.d.world * tc.grad_accum)
        self.peak = peak_flops(self.device)
        self.flops_ctx = tc.flops_ctx or data_mod.measured_doc_length(data, tc.block_size)
        self.F_ctx = min(self.flops_ctx, tc.block_size)
        self.F = budget.flops_per_token(model_cfg, self.F_ctx)   # SMELT's F: no output head
        self.F_with_head = budget.flops_per_token(model_cfg, self.F_ctx, include_head=True)   # what the GPU runs (MFU)
        self.wall = 0.0
        self.ce_window: list[float] = []    # per-step train CE since the last metrics row
        self.prefix = f"[{self.meta['run']}] " if self.meta.get("run") else ""   # names the run in every line
        self.at: tuple[int | None, int] | None = (None, 0)   # the state in memory: (branch or None, step)
        self.pending: list[int] = []                         # branches without a results row
        self.trail: list[tuple] = []                         # (branch, step, train CE) of logged rows (_guard)

    # -- one optimizer step ------------------------------------------------------------------
    def _sync_context(self, last_micro: bool):
        if self.tc.fsdp and self.d.world > 1:
            self.objective.set_requires_gradient_sync(last_micro)
        if self.ddp is not None and not last_micro:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def step(self, step: int, data_step: int, lr: float) -> dict:
        tc, d = self.tc, self.d
        for g in self.opt.param_groups:
            g["lr"] = lr
        batch = self.data.train_batch(data_step, tc.batch_size // d.world, tc.block_size, seed=tc.seed,
                                      rank=d.rank, world_size=d.world)
        idx, tgt, doc = (None if t is None else t.to(self.device, non_blocking=True) for t in batch)
        if idx.shape != (want := (tc.batch_size // d.world, tc.block_size)):
            raise ValueError(f"data.train_batch returned {tuple(idx.shape)}, expected {want} rows for rank {d.rank}")
        n_global = (tgt != -1).sum()
        if d.world > 1:
            dist.all_reduce(n_global)
        scale = d.world / n_global.clamp(min=1)    # DDP / FSDP average gradients over ranks
        stats, load, _ = forward_backward(self.model, self.model_cfg, idx, tgt, doc, scale, tc.grad_accum,
                                          self._sync_context, self.autocast)
        return update(self.gpt, self.opt, tc.grad_clip, lambda gn: self._check_step(step, lr, stats, load, gn,
                                                                                     n_global))

    def _check_step(self, step, lr, stats, load, gn, n_global) -> dict:
        """The step's metrics row over the global batch; a non-finite loss or grad norm raises DivergenceError."""
        cfg, d = self.model_cfg, self.d
        load = None if load is None else torch.stack(list(load.values()))   # (visits, E)
        if d.world > 1:
            dist.all_reduce(stats)
            if load is not None:
                dist.all_reduce(load)
        # the global batch's busiest expert against the mean, worst layer
        load_max = gn.new_zeros(()) if load is None else (load.max(1).values / load.mean(1)).max()
        # one host read for all the row and the guard need (each float() would be a sync); float64 holds each exactly
        s, n, a, zz, g, lm = torch.stack([t.double() for t in (stats[0], n_global, stats[1], stats[2], gn,
                                                               load_max)]).tolist()
        ce = s / max(int(n), 1)
        aux, z = a / d.world, zz / d.world
        row = {"lr": lr, "loss": ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z, "ce": ce, "aux": aux,
               "z": z, "grad_norm": g}
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
            raise DivergenceError(f"non-finite loss {row['loss']} / grad norm {row['grad_norm']} at optimizer step "
                                  f"{step + 1} (lr {lr:.3g}); nothing was saved after it: the last good checkpoint "
                                  f"is {self._last_good()}")
        if load is not None:
            row["load_max"] = lm   # worst expert vs mean over the global batch (1 = balanced)
        return row

    # -- phases ------------------------------------------------------------------------------
    def _log(self, done: int, end: int, branch: int | None, row: dict, sync: bool = False) -> None:
        tc = self.tc
        self.steps_left -= 1
        self.ce_window.append(row["ce"])
        log, ev = logged(tc, done, end)
        if not (log or ev):
            return
        now = time.perf_counter()
        dt, n = now - self.win_t, done - self.win_step
        self.win_t, self.win_step = now, done
        tps = n * self.tokens_per_step / max(dt, 1e-9)
        # ce: this step's batch; ce_mean: the mean over the steps since the last row (what curves plot)
        row = {"phase": "stable" if branch is None else "decay", "branch": branch, "step": done,
               "tokens": done * self.tokens_per_step, **row, "ce_mean": sum(self.ce_window) / len(self.ce_window),
               "ce_steps": len(self.ce_window), "tokens_per_s": tps, "eta_s": self.steps_left * dt / max(n, 1)}
        self.ce_window = []
        if self.peak:
            row["mfu"] = self.F_with_head * tps / (self.peak * self.d.world)
        if ev:
            row["val_loss"] = self.evaluate()["loss"]
            self.win_t = time.perf_counter()   # evaluation time is not training throughput
        self._append("metrics.jsonl", row, sync=sync)
        if self.d.rank == 0:
            name = "stable" if branch is None else f"decay@{branch}"
            mfu = f" | mfu {100 * row['mfu']:.1f}%" if "mfu" in row else ""
            val = f" | val {row['val_loss']:.4f}" if "val_loss" in row else ""
            eta = row["eta_s"]
            print(f"{self.prefix}{name} {done}/{end} | train ce {row['ce_mean']:.4f} | lr {row['lr']:.2e} | "
                  f"gnorm {row['grad_norm']:.2f}"
                  f" | {tps / 1e3:.1f}k tok/s{mfu}{val} | eta {int(eta // 60)}m{int(eta % 60):02d}s", flush=True)
        self._guard(done, branch, row["ce_mean"], row.get("val_loss"))

    def _train(self, start: int, end: int, branch: int | None) -> None:
        """Optimizer steps start..end of the stable run (branch None) or a branch, saving what save_kind says."""
        tc = self.tc
        for step in range(start, end):
            t0 = time.perf_counter()
            data_step = step if branch is None else tc.stable_steps + (step - branch)
            row = self.step(step, data_step, lr_at(tc, step, branch))
            self.wall += time.perf_counter() - t0
            done = step + 1
            kind = save_kind(tc, branch, done, end)
            self._log(done, end, branch, row, sync=kind is not None)   # the row is on disk before its checkpoint
            if kind == "endpoint":
                self.save_endpoint(branch, done)
            elif kind == "full":
                self.save(branch, done)
                self._prune(self.pending)
        self.at = (branch, end)

    def evaluate(self) -> dict:
        """eval.val_loss_by through the (unwrapped) objective, micro-batches padded to one shape."""
        return val_loss_by(lambda i, t, d: self.objective(i, t, d, per_token=True), self.data,
                               self.tc.block_size, self.micro, self.tc.eval_tokens, device=self.device,
                               autocast=self.autocast)

    def _result_row(self, branch: int, ev: dict) -> dict:
        cfg, tc, meta = self.model_cfg, self.tc, dict(self.meta)
        control = meta.pop("control", None)
        if isinstance(control, dict):
            control = ModelConfig.from_dict(control)
        control = control or budget.dense_control(cfg)
        N, N0 = budget.count_params(cfg)["blocks"], budget.count_params(control)["blocks"]
        D = (branch + tc.decay_steps) * self.tokens_per_step
        return {"arch": meta.pop("arch", "smelt" if cfg.loop.active else "baseline"),
                "scale": meta.pop("scale", None), "sparsity_label": meta.pop("sparsity_label", None), **meta,
                "branch_step": branch, "D": D, "F": self.F, "F_with_head": self.F_with_head, "F_ctx": self.F_ctx,
                "C": self.F * D,
                "S": budget.sparsity(self.F, N, budget.flops_per_token(control, self.F_ctx), N0), "N": N,
                "val_loss": ev["loss"], "val_loss_by_source": ev["by_source"], "val_loss_by_domain": ev["by_domain"],
                "val_tokens": ev["tokens"], "val": json.loads(json.dumps(ev)),   # as it reads back (string keys)
                "config": cfg.to_dict(), "control": control.to_dict(), "train": asdict(tc), "wall_s": self.wall,
                "endpoint": endpoint_path(Path("."), branch).as_posix()}

    def run(self) -> list[dict]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ms = machine_settings(allocator=self.device.type == "cpu")   # measured faster, same numbers: docs/train.md
        if self.d.rank == 0:
            print(f"{self.prefix}machine: " + ", ".join(f"{k} {v}" for k, v in ms.items()), flush=True)
        with run_lock(self.run_dir) if self.d.rank == 0 else contextlib.nullcontext():
            return self._run()

    def _run(self) -> list[dict]:
        """The stable run goes to the first pending fork, that branch decays and is evaluated, the stable run
        resumes from the fork checkpoint, and so on (on disk: needed_checkpoints)."""
        tc = self.tc
        self._open_run_dir()
        rows = self._results()
        done = {r["branch_step"] for r in rows}
        self.pending = [b for b in tc.branches if b not in done]
        if self.pending:
            self._set_eta()
        elif self.d.rank == 0:
            print(f"{self.prefix}{self.run_dir}: every branch {list(tc.branches)} is already trained, so this "
                  f"command trained nothing; the rows are in {self.run_dir / 'results.jsonl'}", flush=True)
        for b in list(self.pending):
            end = b + tc.decay_steps
            if not self._load_endpoint(b):
                own = self._ckpts(b)
                if own:
                    self.load(own[max(own)])
                else:
                    self._reach_fork(b)
                step = self.at[1]
                self._trim_metrics(b, step)
                self.win_t, self.win_step = time.perf_counter(), step
                self._train(step, end, b)
            ev = self.evaluate()
            self._guard(end, b, None, ev["loss"])   # a diverged endpoint writes no results row
            row = self._result_row(b, ev)
            self._append("results.jsonl", row, sync=True)
            rows.append(row)
            self.pending.remove(b)
            self._prune(self.pending)
            if self.d.rank == 0:
                print(f"{self.prefix}branch {b}: D={row['D']:.3g} tokens, C={row['C']:.3g} FLOPs, "
                      f"val_loss {row['val_loss']:.4f}", flush=True)
        if self.d.rank == 0:   # RUN_DIR/ckpt.pt, the longest branch's endpoint (rebuilt when missing or corrupt)
            export_final(self.run_dir, max(tc.branches))
        self._barrier()
        self._prune([])
        self._barrier()
        return sorted(rows, key=lambda r: r["branch_step"])


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, data, run_dir: str | Path | None = None,
          meta: dict | None = None) -> list[dict]:
    """Train (or resume) the stable run and every decay branch; the results rows, by branch step. meta adds
    fields to each row (arch, scale, sparsity_label; "control": S's control, default budget.dense_control)."""
    joined = dist.is_initialized()
    try:
        return Trainer(model_cfg, train_cfg, data, run_dir or train_cfg.out_dir, meta).run()
    finally:
        if not joined and dist.is_initialized():   # leave a caller's process group alone
            dist.destroy_process_group()


# ---- CLI -----------------------------------------------------------------------------------------

PRESETS = tuple(configs.SMOKE_MODELS)


def train_config(plan: configs.Plan, seed: int = 0) -> TrainConfig:
    """The TrainConfig of one run of a plan (configs.Plan): its schedule, batch, context and evaluation."""
    return TrainConfig(lr=plan.lr, warmup_steps=plan.warmup_steps, stable_steps=plan.stable_steps,
                       branch_steps=list(plan.branch_steps), decay_steps=plan.decay_steps,
                       batch_size=plan.batch_size, block_size=plan.block_size, eval_tokens=plan.eval_tokens,
                       eval_interval=plan.eval_interval, seed=seed,
                       log_interval=plan.log_interval or max(1, plan.stable_steps // 8))


def preset_model(name: str, vocab_size: int) -> ModelConfig:
    """Tiny named models for smoke runs (configs.SMOKE_MODELS; the reproduction's ladders are configs.LADDERS)."""
    if name not in configs.SMOKE_MODELS:
        raise ValueError(f"--preset must be one of {PRESETS}, got {name!r}")
    kw = {"vocab_size": vocab_size, **configs.SMOKE_MODEL_BASE, **configs.SMOKE_MODELS[name]}
    r = kw.pop("n_loops", 1)
    return ModelConfig(**kw, loop=LoopSpec(n_loops=r).at(kw["n_layer"]) if r > 1 else LoopConfig())


def build_parser() -> argparse.ArgumentParser:
    p = checks.parser(__doc__.split("\n\n")[0])
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model-json", help="path to a ModelConfig JSON (ModelConfig.to_dict())")
    m.add_argument("--preset", choices=PRESETS,
                   help="one of the smoke-size models (run-size presets are reproduce.py's)")
    p.add_argument("--data", default="smoke", choices=[*configs.DATA_PRESETS, "synthetic"],
                   help="corpus preset for corpus.prepare, or random tokens")
    p.add_argument("--data-dir", help="an already prepared TokenData directory, or nanoGPT's train.bin + val.bin "
                                      "(docs/data.md; overrides --data)")
    p.add_argument("--vocab-size", type=checks.positive_int, default=256, help="vocabulary of --data synthetic")
    for key in ("arch", "scale", "sparsity_label"):
        p.add_argument(f"--{key.replace('_', '-')}", help=f"results-row field {key!r}")
    kinds = {"float": float, "int": int, "str": str}   # TrainConfig.validate checks the ranges, in main
    special = {"device": dict(type=checks.device), "dtype": dict(choices=("auto", "bf16", "fp32")),
               "dist_backend": dict(choices=DIST_BACKENDS), "out_dir": dict(metavar="DIR")}
    for f in fields(TrainConfig):
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        elif f.type == "list[int]":
            p.add_argument(flag, type=checks.positive_int, nargs="+", default=[], help=help)
        else:
            kw = {"type": kinds[f.type], "default": f.default, "help": help, **special.get(f.name, {})}
            p.add_argument(flag, **kw)
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    p = build_parser()
    a = p.parse_args(argv)
    try:   # the config's own rules, reported like any bad flag before anything runs
        tc = TrainConfig(**{f.name: getattr(a, f.name) for f in fields(TrainConfig)})
    except ValueError as e:
        p.error(str(e))
    checks.resolve_device(a.device)   # named as the flag, before the corpus is built
    model_json = checks.read_config(a.model_json, ModelConfig, "--model-json") if a.model_json else None
    if a.data == "synthetic" and not a.data_dir:
        data = SyntheticData(a.vocab_size)
    else:
        data_dir = a.data_dir or data_mod.default_data_dir(a.data)
        if not a.data_dir:
            d = init_distributed(tc)
            if d.rank == 0:
                from lab import corpus   # building the corpus is machinery: only this CLI path needs it
                corpus.prepare(a.data)
            if d.world > 1:
                dist.barrier()
        data = data_mod.TokenData(data_dir)
    cfg = model_json or preset_model(a.preset, data.vocab_size)
    meta = {k: getattr(a, k) for k in ("arch", "scale", "sparsity_label") if getattr(a, k) is not None}
    try:
        try:   # what the Trainer refuses before training (memory, torchrun-only flags, numbers) is a bad flag too
            trainer = Trainer(cfg, tc, data, tc.out_dir, meta)
        except ValueError as e:
            p.error(str(e))
        try:
            return trainer.run()
        except BaseException as e:
            if dist.is_initialized():   # the crash's frames hold the Trainer: drop their locals so it goes below
                traceback.clear_frames(e.__traceback__)
            if isinstance(e, DivergenceError):   # one line, exit status 1: the run's own verdict, not a crash
                raise SystemExit(f"train.py: {e}") from None
            raise
    finally:
        if dist.is_initialized():
            trainer = None
            gc.collect()   # the DDP / FSDP model (cyclic garbage) goes while its process group lives, not at exit
            dist.destroy_process_group()


if __name__ == "__main__":
    checks.run_main(main)
