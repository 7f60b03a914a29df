"""Training: AdamW + warmup-stable-decay with decay branches, exact resume, DDP / FSDP2.

What (SMELT Sec. 3.1 "Optimizer and schedule", Sec. 4.1). One call trains a *stable* run and
all of its *decay branches*, and writes one results row per branch endpoint:
  stable     linear warmup over `warmup_steps`, then a constant learning rate up to
             `stable_steps`; the stable state is checkpointed at every branch step (a fork point).
  branch b   for each b in `branch_steps`: start from the stable state after b steps and
             cosine-decay the learning rate from its stable value to `min_lr_frac * lr` over
             `decay_steps` more steps, i.e. the same number of extra tokens for every branch
             (SMELT: six branches, each decaying over 10B tokens).
  results    each endpoint is evaluated (token-weighted validation cross-entropy overall, per
             source and per domain) and appended to RUN_DIR/results.jsonl with "D" (tokens seen,
             decay included), F (budget.flops_per_token), C = F*D, S (sparsity, SMELT Eq. 1),
             N (non-embedding parameters): the points scaling.py fits L(F, S, D) to.
             wall_s is the training time to reach the endpoint (stable part included, eval excluded).
             Its "endpoint" names the branch's weights: endpoints/branch_XXXXXXX.pt.
RUN_DIR also holds config.json, metrics.jsonl (one JSON object per logged step), ckpt/ (full resume
points, only while the run is unfinished), endpoints/ (one weights-only file per finished branch: a dict
with "model", the GPT state_dict, and "meta", JSON with "model", "train", "branch", "step", "tokens",
"wall_s") and ckpt.pt (a byte copy of the longest branch's endpoint: the model eval.py and probes.py load;
`load_weights` reads any of them, hash checked).

Design choices, and why:
  * Decay data. SMELT decays on "fresh data not seen during the stable phase". Decay step j of
    every branch reads training batch `stable_steps + j` (same seed): batches no stable step
    reads, identical for all branches, so branches differ only in how long they trained stably.
    For the last branch (b = stable_steps) this is simply the stream continuing.
  * Loss normalisation. Cross-entropy is summed per micro-batch and divided by the number of
    target tokens in the *global* batch (one all-reduce of a count per step), so the gradient is
    the same however the batch is split over ranks and micro-batches (tested: 2 ranks == 1
    process). The router's load-balancing loss is a per-micro-batch statistic (as in Switch /
    Mixtral training) averaged over micro-batches and ranks: the one term that depends on the split.
  * Weight decay on matrices only (attention, dense and expert weights, router, adapter A/B);
    none on norm gains, biases, PLT gate vectors, embeddings or the loop-mixing matrices M
    (decaying M would pull Loop Matrix away from its identity initialisation).
  * Checkpoints hold the uncompiled GPT's state_dict, the optimizer state keyed by parameter
    name (torch.distributed.checkpoint's full-state-dict layout, gathered by it under FSDP2:
    one file resumes on 1 process, DDP or FSDP2), the step, RNG states as tensors and the
    model + train config as JSON. Batches are a pure function of (seed, step), so the step is
    the whole data position. Written atomically (temp file, fsync, os.replace); read with
    torch.load(weights_only=True). On CPU a resumed run is bit-for-bit the uninterrupted one.
  * Order and retention. Each branch runs as soon as the stable run reaches its fork point; the
    stable run then resumes from the fork checkpoint (exact, as any resume). So a run holds at most
    two full checkpoints at once (the fork point resuming needs + the one being written), not one per
    branch, and none once it has finished (`needed_checkpoints`: a full checkpoint is 3x an endpoint
    in fp32, and nothing after the run reads Adam state; adding a branch later re-runs the stable
    phase, deterministically). `disk_estimate` replays this rule to size a run before it starts.
  * Verifiable files (issue 16: 11 of 40 four-byte flips in a checkpoint loaded silently). Every torch
    file ends with the sha256 of its bytes (`atomic_save`; torch.load ignores the trailer), checked by
    `load_file` before loading; every results / metrics row carries the sha256 of its content
    (`jsonl_line`, checked by `read_jsonl`, naming file and line). A partial last row (a crash during
    an append) is cut on the next run; temp files of dead writers are removed at the next write; a
    corrupt ckpt.pt is rebuilt from the endpoint it copies (`export_final`).
  * One writer per run directory: an exclusive flock on RUN_DIR/.lock (released by the OS however
    the process ends); a second trainer gets RunLockedError.
  * Divergence: loss and gradient norm are checked every step (one host sync), before the
    update; a non-finite value raises DivergenceError. A checkpoint is written only when every model
    and optimizer tensor is finite (else DivergenceError), so "the last good checkpoint" is good.
  * F in results rows follows SMELT's convention: no output head (budget.flops_per_token's default;
    "F_with_head" is reported beside it and MFU uses it), at the effective *document* length
    (SMELT 3.2: attention stays inside each document) that data.measured_doc_length measures on one
    fixed sample of the training contexts, the same number the ladder was matched at; `flops_ctx`
    > 0 overrides it.
  * Multi-process: the same script under torchrun uses DDP (NCCL on CUDA, gloo on CPU), or
    FSDP2 (`fully_shard` per block + root) with --fsdp; each rank takes its rows of the global
    batch. Validation runs the same batches on every rank (FSDP needs all ranks in each forward).
  * CUDA: bf16 autocast and torch.compile (flags); CPU: fp32, eager.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import budget
import cli
import configs
import data as data_mod
from checks import JSONFileError, check_fields, from_dict, parse_json, read_json, require_keys
from loop import LoopConfig, middle_span
from model import GPT, ModelConfig, compile_model

# Dense bf16 peak FLOP/s per GPU (vendor datasheets, no sparsity), for MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of a CUDA device (PEAK_BF16_FLOPS by name), None when unknown or not CUDA."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


# Train-config fields that define the trajectory: a checkpoint / results row made with other values is not resumable.
TRAJECTORY = ("lr", "min_lr_frac", "warmup_steps", "stable_steps", "decay_steps", "batch_size", "block_size",
              "weight_decay", "beta1", "beta2", "eps", "grad_clip", "seed")


def _opt(default, help: str):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    lr: float = _opt(1e-3, "peak (stable-phase) learning rate")
    min_lr_frac: float = _opt(0.0, "final learning rate of each decay branch, as a fraction of lr")
    warmup_steps: int = _opt(100, "linear warmup steps")
    stable_steps: int = _opt(1000, "length of the stable run in optimizer steps")
    branch_steps: list[int] = _opt([], "stable steps at which decay branches fork (default: stable_steps)")
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
    def from_dict(cls, d: dict) -> "TrainConfig":
        """TrainConfig(**d) for a stored config ("train" of config.json, a results row, a checkpoint's meta);
        unknown keys are named in a ValueError."""
        return from_dict(cls, d)

    @property
    def branches(self) -> list[int]:
        return sorted(set(self.branch_steps)) or [self.stable_steps]

    def validate(self, world_size: int = 1) -> None:
        """Types and ranges of every field (run at construction with world_size 1; the Trainer re-runs it
        with the real world size). Raises ValueError naming the field."""
        def bad(msg):
            raise ValueError(f"TrainConfig: {msg}")
        check_fields(self, "TrainConfig")   # ints are ints (not bools or 2.5), floats finite, bools bools
        for name in ("lr", "stable_steps", "decay_steps", "batch_size", "grad_accum", "log_interval", "eval_tokens",
                     "eps"):
            if not getattr(self, name) > 0:
                bad(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("warmup_steps", "block_size", "weight_decay", "grad_clip", "eval_interval", "ckpt_interval",
                     "flops_ctx", "seed"):
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            bad(f"min_lr_frac must lie in [0, 1], got {self.min_lr_frac}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                bad(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        for b in self.branch_steps:
            if not 1 <= b <= self.stable_steps:
                bad(f"branch_steps must lie in [1, stable_steps={self.stable_steps}], got {b}")
        if self.batch_size % (world_size * self.grad_accum):
            bad(f"batch_size={self.batch_size} must be divisible by world_size x grad_accum = "
                f"{world_size} x {self.grad_accum}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            bad(f"dtype must be auto|bf16|fp32, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            bad(f"device must be auto|cpu|cuda|cuda:N, got {self.device!r}")
        if self.dist_backend not in ("auto", "nccl", "gloo", "mpi", "ucc"):
            bad(f"dist_backend must be auto|nccl|gloo|mpi|ucc, got {self.dist_backend!r}")
        if not self.out_dir:
            bad("out_dir must be a non-empty path")


class DivergenceError(RuntimeError):
    """The loss or gradient norm became non-finite; the last checkpoint on disk is the last good one."""


class CheckpointError(RuntimeError):
    """A checkpoint (or run-directory record) cannot be read or belongs to another configuration."""


# ----------------------------------------------------------------------------------------
# Schedule and optimizer

def lr_at(tc: TrainConfig, step: int, branch: int | None = None) -> float:
    """Learning rate of optimizer step `step` (0-based) on the stable run or on the branch forked at `branch`."""
    if branch is None or step < branch:
        return tc.lr * min(1.0, (step + 1) / tc.warmup_steps) if tc.warmup_steps else tc.lr
    start, floor = lr_at(tc, branch), tc.min_lr_frac * tc.lr
    t = min(1.0, (step - branch + 1) / tc.decay_steps)   # the branch's last step reaches the floor
    return floor + (start - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def decay_split(gpt: nn.Module) -> tuple[list[str], list[str]]:
    """(names with weight decay, names without): matrices decay; gains, biases, embeddings, loop mixing M do not."""
    emb = {id(m.weight) for m in gpt.modules() if isinstance(m, nn.Embedding)}
    decay, keep = [], []
    for name, p in gpt.named_parameters():
        no = p.dim() < 2 or id(p) in emb or name.endswith(".M")
        (keep if no else decay).append(name)
    return decay, keep


def make_optimizer(gpt: nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    params = dict(gpt.named_parameters())
    decay, keep = decay_split(gpt)
    groups = [{"params": [params[n] for n in decay], "weight_decay": tc.weight_decay},
              {"params": [params[n] for n in keep], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps)


class Objective(nn.Module):
    """The training step's forward as plain tensors (what DDP, FSDP and torch.compile wrap).

    Returns (summed cross-entropy over non-ignored targets, their count, load-balance loss,
    z-loss, tokens per expert (visits, E)). Summing lets the caller normalise by the global batch.
    """

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: Tensor, targets: Tensor, doc_ids: Tensor | None):
        out = self.gpt.run(idx, None, doc_ids)
        logits = out.logits.float()
        ce_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="sum")
        load = (torch.stack([s.tokens_per_expert for _, s in out.router]) if out.router
                else logits.new_zeros(0, 0))
        return ce_sum, (targets != -1).sum(), out.aux_loss, out.z_loss, load


# ----------------------------------------------------------------------------------------
# Verifiable files: content-hashed checkpoints, hashed JSON-lines rows, atomic writes, one writer

class RunLockedError(RuntimeError):
    """Another process is writing this run directory (it holds RUN_DIR/.lock)."""


def _rng_state() -> dict[str, Tensor]:
    np_state = np.random.get_state()
    st = {"torch": torch.get_rng_state(),
          "numpy": torch.from_numpy(np.append(np_state[1], np_state[2]).astype(np.int64)),
          "python": torch.tensor(random.getstate()[1], dtype=torch.int64)}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict[str, Tensor]) -> None:
    torch.set_rng_state(st["torch"])
    keys = st["numpy"].numpy()
    np.random.set_state(("MT19937", keys[:-1].astype(np.uint32), int(keys[-1]), 0, 0.0))
    random.setstate((3, tuple(int(v) for v in st["python"]), None))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


# A torch file we write is torch.save's bytes followed by this trailer and the sha256 (hex) of those
# bytes: torch.load ignores bytes after the zip archive, so the file stays an ordinary checkpoint, and
# any changed byte (data, zip structure, pickle or trailer) fails the check. Hex digits cannot form the
# zip end-of-directory signature, so the trailer can never be mistaken for part of the archive.
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


@contextlib.contextmanager
def run_lock(run_dir: str | Path):
    """Hold an exclusive OS lock on RUN_DIR/.lock (fcntl.flock; msvcrt on Windows) for the block. The OS
    drops it when the process exits however it exits, so a killed trainer never leaves a stale lock.
    A second writer gets RunLockedError naming the holder's pid."""
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
            raise RunLockedError(f"run directory {Path(run_dir)} is in use by another trainer (pid {holder} holds "
                                 f"{path}); wait for it to finish or use another directory") from None
        if os.name != "nt":   # record the holder for the other writer's message
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        os.close(fd)   # closing the descriptor releases the lock


def _nonfinite(tree, prefix: str = "") -> list[str]:
    """Names of floating-point tensors in a (nested) state dict holding NaN or infinity."""
    if isinstance(tree, Tensor):
        return [prefix] if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return [n for k, v in items for n in _nonfinite(v, f"{prefix}.{k}" if prefix else str(k))]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_diff(stored: dict, current: dict, prefix: str) -> list[str]:
    """Readable differences between a stored and the current config ('model.n_layer: stored 2, this run 3')."""
    a, b = _flat(stored, prefix), _flat(json.loads(json.dumps(current)), prefix)
    return [f"{k}: stored {a.get(k)!r}, this run {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


def _run_diff(rec: dict, model_cfg: ModelConfig, tc: TrainConfig) -> list[str]:
    cur = asdict(tc)
    return (config_diff(rec["model"], model_cfg.to_dict(), "model.")
            + config_diff({k: rec["train"].get(k) for k in TRAJECTORY}, {k: cur[k] for k in TRAJECTORY}, "train."))


def load_checkpoint(path: str | Path, model_cfg: ModelConfig, tc: TrainConfig) -> dict:
    """Read a checkpoint (hash checked; no code runs: weights_only) and check it belongs to this model and
    trajectory. Returns the dict with "meta" parsed."""
    ck = load_file(path)
    meta = json.loads(ck["meta"])
    if "train" not in meta:
        raise CheckpointError(f"checkpoint {path} lacks meta['train'] (not written by train.py?)")
    diff = _run_diff(meta, model_cfg, tc)
    if diff:
        raise CheckpointError(f"checkpoint {path} does not match this run: " + "; ".join(diff))
    return {**ck, "meta": meta}


def _branches_of(run_dir: Path) -> list[int]:
    return TrainConfig.from_dict(read_json(run_dir / "config.json", keys=("train",))["train"]).branches


def export_final(run_dir: str | Path, branch: int | None = None) -> Path:
    """RUN_DIR/ckpt.pt, a byte copy of the longest branch's endpoint (`branch`, default: the longest of
    config.json's branches). Rebuilt when missing, corrupt or a copy of another endpoint; the endpoint
    itself is checked first (CheckpointError if it is corrupt)."""
    run = Path(run_dir)
    b = max(_branches_of(run)) if branch is None else branch
    src, dst = endpoint_path(run, b), run / "ckpt.pt"
    want = file_digest(src)
    if dst.exists():
        try:
            if file_digest(dst) == want:
                return dst
        except CheckpointError as e:
            print(f"{e}: rebuilding it from {src}", flush=True)
    def copy(f):
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f, 1 << 24)
    _atomic_write(dst, copy)
    if file_digest(dst) != want:   # the source changed under us (it should not: one writer per run)
        raise CheckpointError(f"{dst} does not match {src} after copying it")
    return dst


def endpoint_path(run_dir: str | Path, branch: int) -> Path:
    return Path(run_dir) / "endpoints" / f"branch_{branch:07d}.pt"


def load_weights(path: str | Path) -> tuple[dict, dict]:
    """(GPT state_dict, meta) of a run directory (its ckpt.pt), an endpoint or a full training checkpoint,
    content hash checked. meta is the checkpoint's JSON meta ("model": ModelConfig dict, "train", "branch",
    "step", "tokens"). A run directory whose ckpt.pt is corrupt is served from the intact endpoint that
    ckpt.pt copies, and ckpt.pt is rebuilt from it (unless a trainer holds the run's lock)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "ckpt.pt").exists():
            raise CheckpointError(f"{path} has no ckpt.pt: the run has not finished (train.py writes it last)")
        try:
            file_digest(path / "ckpt.pt")
            path = path / "ckpt.pt"
        except CheckpointError as e:
            src = endpoint_path(path, max(_branches_of(path)))
            try:
                with run_lock(path):
                    export_final(path)
                print(f"{e}; rebuilt it from {src}", flush=True)
            except RunLockedError:
                print(f"{e}; reading {src} instead (a trainer holds the run's lock)", flush=True)
                path = src
            else:
                path = path / "ckpt.pt"
    ck = load_file(path)
    return ck["model"], json.loads(ck["meta"])


# Which full (resume) checkpoints a run keeps. One rule, used by the Trainer after every save and every
# finished branch, and by disk_estimate's simulation.
def needed_checkpoints(on_disk, pending) -> set[tuple[int | None, int]]:
    """From the (branch or None for the stable run, step) checkpoints on disk, those resuming still needs:
    for each pending branch (no results row yet), its own latest checkpoint, else the latest stable
    checkpoint at or before its fork. A finished run needs none."""
    on_disk = set(on_disk)
    stable = [s for b, s in on_disk if b is None]
    keep = set()
    for b in pending:
        own = [s for bb, s in on_disk if bb == b]
        prior = [s for s in stable if s <= b]
        if own:
            keep.add((b, max(own)))
        elif prior:
            keep.add((None, max(prior)))
    return keep


# ----------------------------------------------------------------------------------------
# Disk: what a run writes, estimated before it starts (pure functions)

# Bytes a torch file costs beyond its tensors' data, measured with torch 2.13 (torch.save of dicts of
# 10-1000 tensors): ~1.3 kB per file, 250-300 B per tensor (zip headers, 64-byte alignment, pickle).
_FILE_BYTES = 1261 + _TRAILER_LEN
_TENSOR_BYTES = 280
_RNG_BYTES = 5056 + 625 * 8 * 2 + 3 * _TENSOR_BYTES   # torch, numpy and python generator states
_METRICS_ROW_BYTES = 420   # one metrics.jsonl row with its hash (measured: 370-410 B)


def logged(tc: TrainConfig, done: int, end: int) -> tuple[bool, bool]:
    """(progress row, validation) after optimizer step `done` of a segment ending at `end`."""
    return done % tc.log_interval == 0 or done == end, bool(tc.eval_interval and done % tc.eval_interval == 0)


def checkpoint_bytes(model_cfg: ModelConfig, tc: TrainConfig) -> tuple[int, int]:
    """(full resume checkpoint, weights-only endpoint) file sizes for this model: fp32 weights, AdamW's two
    fp32 moments + a step per parameter, RNG states, JSON meta. The parameter list comes from a GPT
    built on the meta device (no memory allocated)."""
    with torch.device("meta"):
        gpt = GPT(model_cfg)
    params = list(gpt.named_parameters())
    weights = sum(p.numel() * 4 + _TENSOR_BYTES for _, p in params)
    meta = len(json.dumps({"format": 2, "kind": "endpoint", "model": model_cfg.to_dict(), "train": asdict(tc),
                           "step": 0, "branch": 0, "tokens": 0, "wall_s": 0.0, "run": {}})) + 100
    endpoint = _FILE_BYTES + weights + meta
    adam = sum(2 * (p.numel() * 4 + _TENSOR_BYTES) + 4 + _TENSOR_BYTES + 2 * (len(n) + 12) for n, p in params)
    return endpoint + adam + _RNG_BYTES + 600, endpoint


def disk_estimate(model_cfg: ModelConfig, tc: TrainConfig) -> dict:
    """Bytes one train() run keeps on disk, replaying the Trainer's save / prune rules (save_kind,
    needed_checkpoints, logged): "peak" (the most at any moment), "final" (after the run: endpoints, ckpt.pt,
    logs), "written" (all bytes written, deleted files included), and the per-file sizes."""
    tc = TrainConfig.from_dict({**asdict(tc), "block_size": tc.block_size or model_cfg.block_size})
    full, endpoint = checkpoint_bytes(model_cfg, tc)
    row = len(json.dumps({"config": model_cfg.to_dict(), "train": asdict(tc)})) + len(json.dumps(
        budget.dense_control(model_cfg).to_dict())) + 1500   # results row: configs, losses by source, hash
    logs = 2 * len(json.dumps({"model": model_cfg.to_dict(), "train": asdict(tc)}, indent=2))  # config.json
    ckpts: dict = {}
    state = {"peak": 0, "written": logs, "kept": logs}   # kept: endpoints + logs

    def now() -> int:
        return state["kept"] + full * len(ckpts)

    def write(n: int, key=None) -> None:
        state["written"] += n
        if key is None:
            state["kept"] += n
        else:
            ckpts[key] = True
        state["peak"] = max(state["peak"], now())

    def prune(pending) -> None:
        for key in set(ckpts) - needed_checkpoints(ckpts, pending):
            del ckpts[key]

    pending, s = list(tc.branches), 0
    for b in tc.branches:
        for branch, start, end in ((None, s, b), (b, b, b + tc.decay_steps)):
            for done in range(start + 1, end + 1):
                if any(logged(tc, done, end)):
                    write(_METRICS_ROW_BYTES)
                kind = save_kind(tc, branch, done, end)
                if kind == "endpoint":
                    write(endpoint)
                elif kind == "full":
                    write(full, (branch, done))
                    prune(pending)
        s = b
        write(row)
        pending.remove(b)
        prune(pending)
    write(endpoint)   # ckpt.pt
    return {"peak": state["peak"], "final": now(), "written": state["written"], "full_checkpoint": full,
            "endpoint": endpoint}


def plan_disk_estimate(model_cfgs: list[ModelConfig], tc: TrainConfig, jobs: int = 1) -> dict:
    """disk_estimate over a set of runs trained `jobs` at a time: "final" is the sum of the runs' final
    bytes; "peak" adds the `jobs` largest in-run surpluses (peak - final) on top of it, an upper bound
    (it assumes every other run has already finished)."""
    ests = [disk_estimate(c, tc) for c in model_cfgs]
    final = sum(e["final"] for e in ests)
    surplus = sorted(max(0, e["peak"] - e["final"]) for e in ests)[::-1][:max(1, jobs)]
    return {"final": final, "peak": final + sum(surplus), "written": sum(e["written"] for e in ests),
            "runs": len(ests)}


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


# ----------------------------------------------------------------------------------------
# Evaluation

@torch.no_grad()
def evaluate(objective: nn.Module, data, batch_size: int, block_size: int, max_tokens: int,
             device: torch.device, autocast=contextlib.nullcontext) -> dict:
    """Token-weighted validation cross-entropy: overall, by source and by domain (each source capped at max_tokens)."""
    sums: dict[str, tuple[float, int]] = {}   # source -> (summed cross-entropy, target tokens)
    for src in data.sources:
        s, n = 0.0, 0
        for idx, tgt, doc in data.val_batches(src, batch_size, block_size, max_tokens):
            with autocast():
                ce_sum, cnt, *_ = objective(idx.to(device), tgt.to(device), None if doc is None else doc.to(device))
            s, n = s + float(ce_sum), n + int(cnt)
        sums[src] = (s, n)

    agg = data_mod.token_weighted(sums, data.domains)
    return {"val_loss": agg["loss"], "val_tokens": agg["tokens"],
            "val_loss_by_source": agg["by_source"], "val_loss_by_domain": agg["by_domain"]}


# ----------------------------------------------------------------------------------------
# A corpus-free data source with TokenData's interface (tests, throughput runs)

class SyntheticData:
    """Documents of Zipf-distributed tokens (learnable unigram statistics), no files.

    train_batch(step, batch_size, ...) is a pure function of (seed, step); batch_size is per rank
    and rank r gets rows [r*B, (r+1)*B) of the global batch, as in data.TokenData. The last token
    of each document has target -1 (ignored). Sources differ in their Zipf exponent.
    """

    def __init__(self, vocab_size: int = 256, mean_doc_len: int = 24, n_sources: int = 2):
        self.vocab_size, self.mean_doc_len = vocab_size, mean_doc_len
        self.sources = [f"synthetic{i}" for i in range(n_sources)]
        self.domains = {s: ("code", "prose")[i % 2] for i, s in enumerate(self.sources)}
        self.manifest = {"preset": "synthetic", "vocab_size": vocab_size}

    def _rows(self, gen: torch.Generator, n: int, T: int, alpha: float) -> tuple[Tensor, Tensor, Tensor]:
        probs = 1.0 / torch.arange(1, self.vocab_size + 1, dtype=torch.float64) ** alpha
        tok = torch.multinomial(probs, n * (T + 1), replacement=True, generator=gen).view(n, T + 1)
        doc = (torch.rand(n, T, generator=gen) < 1.0 / self.mean_doc_len).long().cumsum(1)
        tgt = tok[:, 1:].clone()
        tgt[:, :-1][doc[:, 1:] != doc[:, :-1]] = -1
        return tok[:, :-1].contiguous(), tgt, doc - doc[:, :1]

    def train_batch(self, step: int, batch_size: int, block_size: int, seed: int = 0, rank: int = 0,
                    world_size: int = 1) -> tuple[Tensor, Tensor, Tensor]:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        rows = self._rows(gen, batch_size * world_size, block_size, 1.1)
        return tuple(t[rank * batch_size:(rank + 1) * batch_size] for t in rows)

    def val_batches(self, source: str, batch_size: int, block_size: int,
                    max_tokens: int | None = None) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        i = self.sources.index(source)
        gen = torch.Generator().manual_seed(10**9 + i)
        n_ctx = max(1, (max_tokens or 4096) // block_size)
        idx, tgt, doc = self._rows(gen, n_ctx, block_size, 0.9 + 0.4 * i)
        for b in range(0, n_ctx, batch_size):
            yield idx[b:b + batch_size], tgt[b:b + batch_size], doc[b:b + batch_size]


# ----------------------------------------------------------------------------------------
# The trainer

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


def check_device(device: str) -> None:
    """Refuse a CUDA device that this machine / torch build does not have, before anything is allocated."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        build = " (this torch is a CPU-only build)" if torch.version.cuda is None else ""
        raise ValueError(f"TrainConfig: device={device!r} but no CUDA GPU is available{build}; "
                         f"use device='cpu' or 'auto'")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"TrainConfig: device={device!r} but this machine has {torch.cuda.device_count()} GPU(s)")


def save_kind(tc: TrainConfig, branch: int | None, done: int, end: int) -> str | None:
    """What the Trainer writes after optimizer step `done` of a segment ending at `end` (the stable run's
    segments end at fork points): "endpoint" at a branch's end, "full" (a resume checkpoint) at a fork point
    and every ckpt_interval steps, else None. disk_estimate replays the same rule."""
    if done == end:
        return "full" if branch is None else "endpoint"
    return "full" if tc.ckpt_interval and done % tc.ckpt_interval == 0 else None


class Trainer:
    def __init__(self, model_cfg: ModelConfig, tc: TrainConfig, data, run_dir: str | Path, meta: dict | None = None):
        if not isinstance(model_cfg, ModelConfig) or not isinstance(tc, TrainConfig):
            raise ValueError(f"Trainer needs a ModelConfig and a TrainConfig, got {type(model_cfg).__name__} and "
                             f"{type(tc).__name__}")
        check_device(tc.device)
        self.d = init_distributed(tc)
        tc = TrainConfig(**asdict(tc))
        tc.block_size = tc.block_size or model_cfg.block_size
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
        dev = tc.device if tc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if dev == "cuda" and self.d.world > 1:
            dev = f"cuda:{self.d.local_rank}"
        self.device = torch.device(dev)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        bf16 = tc.dtype == "bf16" or (tc.dtype == "auto" and cuda)
        self.autocast = ((lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16
                         else contextlib.nullcontext)
        torch.manual_seed(tc.seed)
        random.seed(tc.seed)
        np.random.seed(tc.seed)
        self.gpt = GPT(model_cfg).to(self.device)
        self.objective = Objective(self.gpt)
        self.ddp = None
        model: nn.Module = self.objective
        if self.d.world > 1 and tc.fsdp:
            from torch.distributed.fsdp import fully_shard
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # router stats
            for blk in self.gpt.blocks:
                fully_shard(blk)
            fully_shard(self.objective)
        elif self.d.world > 1:
            self.ddp = model = nn.parallel.DistributedDataParallel(
                self.objective, device_ids=[self.device.index] if cuda else None, broadcast_buffers=False)
        self.opt = make_optimizer(self.gpt, tc)
        self.model = compile_model(model) if (tc.compile and cuda) else model   # static shapes, fresh per run
        self.tokens_per_step = tc.batch_size * tc.block_size
        self.micro = tc.batch_size // (self.d.world * tc.grad_accum)
        self.peak = peak_flops(self.device)
        self.flops_ctx = tc.flops_ctx or data_mod.measured_doc_length(data, tc.block_size)
        ctx = min(self.flops_ctx, tc.block_size)
        self.F = budget.flops_per_token(model_cfg, ctx)                          # SMELT's F: no output head
        self.F_with_head = budget.flops_per_token(model_cfg, ctx, include_head=True)   # what the GPU runs (MFU)
        self.wall = 0.0
        self.ce_window: list[float] = []    # per-step train CE since the last metrics row
        self.prefix = f"[{self.meta['run']}] " if self.meta.get("run") else ""   # names the run in every line
        self.at: tuple[int | None, int] | None = (None, 0)   # the state in memory: (branch or None, step)
        self.pending: list[int] = []                         # branches without a results row

    # -- bookkeeping -------------------------------------------------------------------------

    @staticmethod
    def _phase(branch: int | None) -> str:
        return "stable" if branch is None else f"branch{branch:07d}"

    def _ckpt(self, branch: int | None, step: int) -> Path:
        return self.ckpt_dir / f"{self._phase(branch)}_{step:07d}.pt"

    def _ckpts(self, branch: int | None) -> dict[int, Path]:
        """{step: path} of this phase's checkpoints on disk."""
        return {int(p.stem[-7:]): p for p in self.ckpt_dir.glob(f"{self._phase(branch)}_{'[0-9]' * 7}.pt")}

    def _all_ckpts(self) -> dict[tuple[int | None, int], Path]:
        """{(branch or None, step): path} of every full checkpoint on disk."""
        out = {}
        for p in self.ckpt_dir.glob("*.pt"):
            m = re.fullmatch(r"(?:stable|branch(\d{7}))_(\d{7})\.pt", p.name)
            if m:
                out[(None if m.group(1) is None else int(m.group(1)), int(m.group(2)))] = p
        return out

    def _last_good(self) -> str:
        return str(max(self.ckpt_dir.glob("*.pt"), key=os.path.getmtime, default="none (no checkpoint yet)"))

    def _barrier(self) -> None:
        if self.d.world > 1:
            dist.barrier()

    def _append(self, name: str, row: dict, sync: bool = False) -> None:
        """Append one hashed row (a single write of a whole line; results rows are fsynced)."""
        if self.d.rank == 0:
            with open(self.run_dir / name, "a") as f:
                f.write(jsonl_line(row))
                if sync:
                    f.flush()
                    os.fsync(f.fileno())

    def _trim_metrics(self, branch: int | None, step: int) -> None:
        """Before training a phase from `step`, drop its metrics rows logged after it (a crashed attempt's)."""
        path = self.run_dir / "metrics.jsonl"
        if self.d.rank != 0 or not path.exists():
            return
        rows = read_jsonl(path)
        keep = [r for r in rows if not (r.get("branch") == branch and r.get("step", 0) > step)]
        if len(keep) != len(rows):
            atomic_write_text(path, "".join(jsonl_line(r) for r in keep))

    def _prune(self, pending: list[int]) -> None:
        """Delete the full checkpoints resuming no longer needs (needed_checkpoints); the directory too once empty."""
        if self.d.rank == 0 and self.ckpt_dir.is_dir():
            on_disk = self._all_ckpts()
            for key in on_disk.keys() - needed_checkpoints(on_disk, pending):
                on_disk[key].unlink(missing_ok=True)
            remove_stale_tmp(self.ckpt_dir)
            if not pending and not any(self.ckpt_dir.iterdir()):
                self.ckpt_dir.rmdir()
        self._barrier()   # other ranks list checkpoints next

    # -- checkpoints -------------------------------------------------------------------------
    def _names(self) -> list[str]:
        """Parameter names ("gpt."-prefixed, as torch.distributed.checkpoint keys them) in optimizer order."""
        names = {id(p): "gpt." + n for n, p in self.gpt.named_parameters()}
        return [names[id(p)] for g in self.opt.param_groups for p in g["params"]]

    def _state_dicts(self, optimizer: bool = True) -> tuple[dict, dict | None]:
        """Full model and name-keyed optimizer state dicts (gathered from the shards under FSDP2)."""
        if self.tc.fsdp and self.d.world > 1:   # collectives; the import is heavy, so only here
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return (get_model_state_dict(self.objective, options=opts),
                    get_optimizer_state_dict(self.objective, self.opt, options=opts) if optimizer else None)
        msd = {"gpt." + k: v for k, v in self.gpt.state_dict().items()}
        if not optimizer:
            return msd, None
        names, osd = self._names(), self.opt.state_dict()
        return (msd, {"state": {names[i]: st for i, st in osd["state"].items()},
                      "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]})

    def _load_state_dicts(self, msd: dict, osd: dict | None) -> None:
        if self.tc.fsdp and self.d.world > 1:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)
            set_model_state_dict(self.objective, msd, options=StateDictOptions(full_state_dict=True))
            if osd is not None:
                set_optimizer_state_dict(self.objective, self.opt, osd,
                                         options=StateDictOptions(full_state_dict=True))
            return
        self.objective.load_state_dict(msd)
        if osd is None:
            return
        index = {n: i for i, n in enumerate(self._names())}
        self.opt.load_state_dict({"state": {index[n]: st for n, st in osd["state"].items()},
                                  "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                                   for g in osd["param_groups"]]})

    def _refuse_nonfinite(self, path: Path, step: int, msd: dict, osd: dict | None = None) -> None:
        """Raise DivergenceError (on every rank) when a tensor about to be saved holds NaN / infinity: a
        checkpoint on disk is always finite, so 'the last good checkpoint' is good."""
        bad = _nonfinite(msd, "model") + (_nonfinite(osd, "optimizer") if osd is not None else [])
        flag = torch.tensor([float(len(bad))])
        if self.d.world > 1:
            flag = flag.to(self.device)
            dist.all_reduce(flag)
        if float(flag) > 0:
            raise DivergenceError(f"refusing to write {path} at step {step}: {int(float(flag))} model / optimizer "
                                  f"tensors hold NaN or infinity ({', '.join(bad[:4]) or 'on another rank'}"
                                  f"{', ...' if len(bad) > 4 else ''}); the last good checkpoint is "
                                  f"{self._last_good()}")

    def _meta(self, branch: int | None, step: int, kind: str) -> str:
        run = {k: v for k, v in self.meta.items() if k != "control"}
        return json.dumps({"format": 2, "kind": kind, "model": self.model_cfg.to_dict(), "train": asdict(self.tc),
                           "step": step, "branch": branch, "tokens": step * self.tokens_per_step,
                           "wall_s": self.wall, "run": run})

    def save(self, branch: int | None, step: int) -> Path:
        """A full resume checkpoint: weights, optimizer, step, RNG, meta (all ranks call this)."""
        msd, osd = self._state_dicts()
        path = self._ckpt(branch, step)
        if self.ddp is not None:   # cheap guard that DDP keeps the replicas identical
            fp = torch.stack([p.detach().double().abs().sum() for p in self.gpt.parameters()]).sum().view(1)
            every = [torch.zeros_like(fp) for _ in range(self.d.world)]
            dist.all_gather(every, fp)
            if any(not torch.equal(f, fp) for f in every):
                raise RuntimeError(f"DDP replicas differ at step {step}: checksums {[float(f) for f in every]}")
        self._refuse_nonfinite(path, step, msd, osd)
        if self.d.rank == 0:
            self.ckpt_dir.mkdir(exist_ok=True)
            atomic_save({"model": {k.removeprefix("gpt."): v for k, v in msd.items()}, "optimizer": osd,
                         "step": step, "wall_s": self.wall, "rng": _rng_state(),
                         "meta": self._meta(branch, step, "resume")}, path)
        self._barrier()
        return path

    def save_endpoint(self, branch: int, step: int) -> Path:
        """The branch's weights-only endpoint RUN_DIR/endpoints/branch_XXXXXXX.pt (all ranks call this)."""
        msd, _ = self._state_dicts(optimizer=False)
        path = endpoint_path(self.run_dir, branch)
        self._refuse_nonfinite(path, step, msd)
        if self.d.rank == 0:
            path.parent.mkdir(exist_ok=True)
            atomic_save({"model": {k.removeprefix("gpt."): v for k, v in msd.items()},
                         "meta": self._meta(branch, step, "endpoint")}, path)
        self._barrier()
        return path

    def load(self, path: Path) -> int:
        """Resume from a full checkpoint; returns its step."""
        ck = load_checkpoint(path, self.model_cfg, self.tc)
        if "optimizer" not in ck or "rng" not in ck:
            raise CheckpointError(f"checkpoint {path} holds no optimizer / RNG state: it is an endpoint, not a "
                                  f"resume checkpoint")
        try:
            self._load_state_dicts({"gpt." + k: v for k, v in ck["model"].items()}, ck["optimizer"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} does not load into this model: {e}") from e
        _set_rng_state(ck["rng"])
        self.wall = float(ck["wall_s"])
        self.at = (ck["meta"]["branch"], int(ck["step"]))
        return int(ck["step"])

    def _load_endpoint(self, branch: int) -> bool:
        """Load a finished branch's endpoint for its evaluation (crash between endpoint and results row).
        False when there is none or it is damaged (then the branch is trained again)."""
        path = endpoint_path(self.run_dir, branch)
        if not path.exists():
            return False
        try:
            ck = load_checkpoint(path, self.model_cfg, self.tc)
            if ck["meta"]["step"] != branch + self.tc.decay_steps:
                raise CheckpointError(f"checkpoint {path} ends at step {ck['meta']['step']}, this run's branch "
                                      f"ends at {branch + self.tc.decay_steps}")
            self._load_state_dicts({"gpt." + k: v for k, v in ck["model"].items()}, None)
        except (CheckpointError, RuntimeError, KeyError) as e:
            if self.d.rank == 0:
                print(f"{e}; training branch {branch} again", flush=True)
            return False
        self.wall = float(ck["meta"]["wall_s"])
        self.at = None   # weights only: no optimizer state to continue from
        return True

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
        if idx.shape != (tc.batch_size // d.world, tc.block_size):
            raise ValueError(f"data.train_batch returned {tuple(idx.shape)}, expected "
                             f"({tc.batch_size // d.world}, {tc.block_size}) rows for rank {d.rank}")
        n_global = (tgt != -1).sum()
        if d.world > 1:
            dist.all_reduce(n_global)
        scale = d.world / n_global.clamp(min=1)    # DDP / FSDP average gradients over ranks
        cfg, A = self.model_cfg, tc.grad_accum
        stats, load = torch.zeros(3, device=self.device), None
        for m in range(A):
            rows = slice(m * self.micro, (m + 1) * self.micro)
            with self._sync_context(m == A - 1), self.autocast():
                ce_sum, _, aux, z, load = self.model(idx[rows], tgt[rows], None if doc is None else doc[rows])
                loss = ce_sum * scale + (cfg.aux_loss_coef * aux + cfg.z_loss_coef * z) / A
            loss.backward()
            stats += torch.stack([ce_sum.detach().float(), aux.detach().float() / A, z.detach().float() / A])
        gn = torch.nn.utils.clip_grad_norm_(self.gpt.parameters(), tc.grad_clip or float("inf"))
        gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
        if d.world > 1:
            dist.all_reduce(stats)
        ce = float(stats[0]) / max(int(n_global), 1)
        aux, z = float(stats[1]) / d.world, float(stats[2]) / d.world
        row = {"lr": lr, "loss": ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z, "ce": ce, "aux": aux,
               "z": z, "grad_norm": float(gn)}
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
            raise DivergenceError(f"non-finite loss {row['loss']} / grad norm {row['grad_norm']} at optimizer step "
                                  f"{step + 1} (lr {lr:.3g}); nothing was saved after it: the last good checkpoint "
                                  f"is {self._last_good()}")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if load is not None and load.numel():
            load = load.float()
            row["load_max"] = float((load.max(1).values / load.mean(1)).max())  # worst expert vs mean (1 = balanced)
        return row

    # -- phases ------------------------------------------------------------------------------
    def _log(self, done: int, end: int, branch: int | None, row: dict) -> None:
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
            row["val_loss"] = self.evaluate()["val_loss"]
            self.win_t = time.perf_counter()   # evaluation time is not training throughput
        self._append("metrics.jsonl", row)
        if self.d.rank == 0:
            name = "stable" if branch is None else f"decay@{branch}"
            mfu = f" | mfu {100 * row['mfu']:.1f}%" if "mfu" in row else ""
            val = f" | val {row['val_loss']:.4f}" if "val_loss" in row else ""
            eta = row["eta_s"]
            print(f"{self.prefix}{name} {done}/{end} | train ce {row['ce_mean']:.4f} | lr {row['lr']:.2e} | "
                  f"gnorm {row['grad_norm']:.2f}"
                  f" | {tps / 1e3:.1f}k tok/s{mfu}{val} | eta {int(eta // 60)}m{int(eta % 60):02d}s", flush=True)

    def _train(self, start: int, end: int, branch: int | None) -> None:
        """Optimizer steps start..end of the stable run (branch None) or of a branch. Saves a full checkpoint
        every ckpt_interval steps and at the end of a stable segment (a fork point); a branch's end is its
        weights-only endpoint. Superseded checkpoints are pruned after each save."""
        tc = self.tc
        for step in range(start, end):
            t0 = time.perf_counter()
            data_step = step if branch is None else tc.stable_steps + (step - branch)
            row = self.step(step, data_step, lr_at(tc, step, branch))
            self.wall += time.perf_counter() - t0
            done = step + 1
            kind = save_kind(tc, branch, done, end)
            if kind == "endpoint":
                self.save_endpoint(branch, done)
            elif kind == "full":
                self.save(branch, done)
                self._prune(self.pending)
            self._log(done, end, branch, row)
        self.at = (branch, end)

    def evaluate(self) -> dict:
        return evaluate(self.objective, self.data, self.micro, self.tc.block_size, self.tc.eval_tokens,
                        self.device, self.autocast)

    def _results(self) -> list[dict]:
        path = self.run_dir / "results.jsonl"
        rows = read_jsonl(path, keys=("branch_step", "config", "train")) if path.exists() else []
        for r in rows:
            diff = _run_diff({"model": r["config"], "train": r["train"]}, self.model_cfg, self.tc)
            if diff:
                raise CheckpointError(f"{path} holds results of another configuration: {'; '.join(diff)}; "
                                      f"use a new run directory")
        return list({r["branch_step"]: r for r in rows if r["branch_step"] in self.tc.branches}.values())

    def _result_row(self, branch: int, ev: dict) -> dict:
        cfg, tc, meta = self.model_cfg, self.tc, dict(self.meta)
        control = meta.pop("control", None)
        if isinstance(control, dict):
            control = ModelConfig.from_dict(control)
        control = control or budget.dense_control(cfg)
        ctx = min(self.flops_ctx, tc.block_size)
        N, N0 = budget.count_params(cfg)["blocks"], budget.count_params(control)["blocks"]
        D = (branch + tc.decay_steps) * self.tokens_per_step
        return {"arch": meta.pop("arch", "smelt" if cfg.loop.active else "baseline"),
                "scale": meta.pop("scale", None), "sparsity_label": meta.pop("sparsity_label", None), **meta,
                "branch_step": branch, "D": D, "F": self.F, "F_with_head": self.F_with_head, "F_ctx": ctx,
                "C": self.F * D,
                "S": budget.sparsity(self.F, N, budget.flops_per_token(control, ctx), N0), "N": N,
                "val_loss": ev["val_loss"], "val_loss_by_source": ev["val_loss_by_source"],
                "val_loss_by_domain": ev["val_loss_by_domain"], "val_tokens": ev["val_tokens"],
                "config": cfg.to_dict(), "control": control.to_dict(), "train": asdict(tc), "wall_s": self.wall}

    def run(self) -> list[dict]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with run_lock(self.run_dir) if self.d.rank == 0 else contextlib.nullcontext():
            return self._run()

    def _run(self) -> list[dict]:
        """Interleaved: the stable run goes to the first pending fork point, that branch decays and is
        evaluated, the stable run resumes from the fork checkpoint, and so on. Only the fork point of the
        next branch and the latest resume point are on disk at any time (needed_checkpoints), not every fork."""
        tc = self.tc
        cfg_path = self.run_dir / "config.json"
        if cfg_path.exists():
            diff = _run_diff(read_json(cfg_path, keys=("model", "train")), self.model_cfg, tc)
            if diff:
                raise CheckpointError(f"{cfg_path} describes another run: {'; '.join(diff)}; use a new run directory")
        data_dir = getattr(self.data, "dir", None) or getattr(self.data, "manifest", {}).get("preset")
        self._barrier()
        if self.d.rank == 0:
            meta = {k: v for k, v in self.meta.items() if k != "control"}
            atomic_write_text(cfg_path, json.dumps({"model": self.model_cfg.to_dict(), "train": asdict(tc),
                                                    "data_dir": str(data_dir), "meta": meta}, indent=2))
            for name in ("results.jsonl", "metrics.jsonl"):
                repair_torn_tail(self.run_dir / name)
            for d in (self.run_dir, self.ckpt_dir, self.run_dir / "endpoints"):   # a killed writer's temp files
                remove_stale_tmp(d)
        self._barrier()
        rows = self._results()
        done = {r["branch_step"] for r in rows}
        self.pending = [b for b in tc.branches if b not in done]
        if self.pending:
            self._set_eta()
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
            row = {**self._result_row(b, self.evaluate()),
                   "endpoint": endpoint_path(Path("."), b).as_posix()}
            self._append("results.jsonl", row, sync=True)
            rows.append(row)
            self.pending.remove(b)
            self._prune(self.pending)
            if self.d.rank == 0:
                print(f"{self.prefix}branch {b}: D={row['D']:.3g} tokens, C={row['C']:.3g} FLOPs, "
                      f"val_loss {row['val_loss']:.4f}", flush=True)
        self._export_final()
        self._prune([])
        self._barrier()
        return sorted(rows, key=lambda r: r["branch_step"])

    def _reach_fork(self, b: int) -> None:
        """Bring the model to the stable run after b steps (continuing in memory, or from the latest stable
        checkpoint at or before b), saving the fork checkpoint at b."""
        forks = {s: p for s, p in self._ckpts(None).items() if s <= b}
        usable = self.at is not None and self.at[0] is None and self.at[1] <= b   # a fresh Trainer: (None, 0)
        if forks and not (usable and self.at[1] >= max(forks)):
            self.load(forks[max(forks)])
        elif not usable:
            raise CheckpointError(f"no stable checkpoint at or before step {b} in {self.ckpt_dir} and the model "
                                  f"in memory has moved past it (was a checkpoint deleted during the run?); "
                                  f"run again to restart from step 0")
        s = self.at[1]
        self._trim_metrics(None, s)
        self.win_t, self.win_step = time.perf_counter(), s
        if s < b:
            self._train(s, b, None)

    def _set_eta(self) -> None:
        """Steps left (stable + decay) for the progress line's ETA."""
        tc, forks = self.tc, self._ckpts(None)
        need = [b for b in self.pending if not self._ckpts(b) and not endpoint_path(self.run_dir, b).exists()]
        start = max((s for s in forks if need and s <= min(need)), default=0)
        left = max(need, default=start) - start
        for b in self.pending:
            own = self._ckpts(b)
            left += b + tc.decay_steps - (max(own) if own else b)
        self.steps_left = left
        self.win_t, self.win_step = time.perf_counter(), start

    def _export_final(self) -> None:
        """RUN_DIR/ckpt.pt: a copy of the longest branch's endpoint, the model eval.py and probes.py read
        (rebuilt when missing or corrupt)."""
        if self.d.rank == 0:
            export_final(self.run_dir, max(self.tc.branches))
        self._barrier()


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, data, run_dir: str | Path | None = None,
          meta: dict | None = None) -> list[dict]:
    """Train the stable run and every decay branch; return the results rows (one per branch, by branch step).

    Re-running a finished run returns its rows without training; an interrupted one resumes from
    its latest checkpoint. meta adds fields to each row (arch, scale, sparsity_label; "control":
    the dense-control ModelConfig that S is measured against, default budget.dense_control(cfg)).
    """
    joined = dist.is_initialized()
    try:
        return Trainer(model_cfg, train_cfg, data, run_dir or train_cfg.out_dir, meta).run()
    finally:
        if not joined and dist.is_initialized():   # leave a caller's process group alone
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# CLI

PRESETS = tuple(configs.SMOKE_MODELS)


def preset_model(name: str, vocab_size: int) -> ModelConfig:
    """Tiny named models for smoke runs (configs.SMOKE_MODELS; the reproduction's ladders are configs.LADDERS)."""
    if name not in configs.SMOKE_MODELS:
        raise ValueError(f"--preset must be one of {PRESETS}, got {name!r}")
    kw = {"vocab_size": vocab_size, **configs.SMOKE_MODEL_BASE, **configs.SMOKE_MODELS[name]}
    r = kw.pop("n_loops", 1)
    return ModelConfig(**kw, loop=LoopConfig(*middle_span(kw["n_layer"]), n_loops=r) if r > 1 else LoopConfig())


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser(__doc__.split("\n\n")[0])
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model-json", help="path to a ModelConfig JSON (ModelConfig.to_dict())")
    m.add_argument("--preset", choices=PRESETS, help="one of the smoke-size models (run-size presets are reproduce.py's)")
    p.add_argument("--data", default="smoke", choices=[*configs.DATA_PRESETS, "synthetic"],
                   help="corpus preset for data.prepare, or random tokens")
    p.add_argument("--data-dir", help="an already prepared TokenData directory (overrides --data)")
    p.add_argument("--vocab-size", type=cli.positive_int, default=256, help="vocabulary of --data synthetic")
    for key in ("arch", "scale", "sparsity_label"):
        p.add_argument(f"--{key.replace('_', '-')}", help=f"results-row field {key!r}")
    kinds = {"float": float, "int": int, "str": str}   # TrainConfig.validate checks the ranges, in main
    special = {"device": dict(type=cli.device), "dtype": dict(choices=("auto", "bf16", "fp32")),
               "dist_backend": dict(choices=("auto", "nccl", "gloo")), "out_dir": dict(metavar="DIR")}
    for f in fields(TrainConfig):
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        elif f.type == "list[int]":
            p.add_argument(flag, type=cli.positive_int, nargs="+", default=[], help=help)
        else:
            p.add_argument(flag, **{"type": kinds[f.type], "default": f.default, "help": help, **special.get(f.name, {})})
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    p = build_parser()
    a = p.parse_args(argv)
    try:   # the config's own rules, reported like any bad flag before anything runs
        tc = TrainConfig(**{f.name: getattr(a, f.name) for f in fields(TrainConfig)})
        tc.validate()
    except ValueError as e:
        p.error(str(e))
    if a.data == "synthetic" and not a.data_dir:
        data = SyntheticData(a.vocab_size)
    else:
        data_dir = a.data_dir or data_mod.default_data_dir(a.data)
        if not a.data_dir:
            d = init_distributed(tc)
            if d.rank == 0:
                data_mod.prepare(a.data)
            if d.world > 1:
                dist.barrier()
        data = data_mod.TokenData(data_dir)
    try:
        cfg = (ModelConfig.from_dict(read_json(a.model_json)) if a.model_json
               else preset_model(a.preset, data.vocab_size))
    except ValueError as e:
        raise ValueError(f"{a.model_json or '--preset ' + a.preset}: {e}") from e
    meta = {k: getattr(a, k) for k in ("arch", "scale", "sparsity_label") if getattr(a, k) is not None}
    try:
        return train(cfg, tc, data, tc.out_dir, meta)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
