"""Training: AdamW + warmup-stable-decay with decay branches, exact resume, DDP / FSDP2.

What (SMELT Sec. 3.1 "Optimizer and schedule", Sec. 4.1). One call trains a *stable* run and
all of its *decay branches*, and writes one results row per branch endpoint:
  stable     linear warmup over `warmup_steps`, then a constant learning rate up to
             `stable_steps`; the stable state is checkpointed at every branch step.
  branch b   for each b in `branch_steps`: start from the stable checkpoint after b steps and
             cosine-decay the learning rate from its stable value to `min_lr_frac * lr` over
             `decay_steps` more steps, i.e. the same number of extra tokens for every branch
             (SMELT: six branches, each decaying over 10B tokens).
  results    each endpoint is evaluated (token-weighted validation cross-entropy overall, per
             source and per domain) and appended to RUN_DIR/results.jsonl with "D" (tokens seen,
             decay included), F (budget.flops_per_token), C = F*D, S (sparsity, SMELT Eq. 1),
             N (non-embedding parameters): the points scaling.py fits L(F, S, D) to.
             wall_s is the training time to reach the endpoint (stable part included, eval excluded).
RUN_DIR also holds config.json, metrics.jsonl (one JSON object per logged step), ckpt/ (resume points)
and ckpt.pt (a copy of the longest branch's endpoint: the final model that eval.py and probes.py load).

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
  * Divergence: loss and gradient norm are checked every step (one host sync), before the
    update; a non-finite value raises DivergenceError, so the last checkpoint stays good.
  * F in results rows is taken at the effective *document* length (SMELT 3.2: attention stays
    inside each document): 2 x (mean keys a token sees under the document mask) - 1, measured
    on the first training batches (L for documents of length L); `flops_ctx` > 0 overrides it.
  * Multi-process: the same script under torchrun uses DDP (NCCL on CUDA, gloo on CPU), or
    FSDP2 (`fully_shard` per block + root) with --fsdp; each rank takes its rows of the global
    batch. Validation runs the same batches on every rank (FSDP needs all ranks in each forward).
  * CUDA: bf16 autocast and torch.compile (flags); CPU: fp32, eager.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
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
import data as data_mod
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

    @property
    def branches(self) -> list[int]:
        return sorted(set(self.branch_steps)) or [self.stable_steps]

    def validate(self, world_size: int = 1) -> None:
        def bad(msg):
            raise ValueError(f"TrainConfig: {msg}")
        for name in ("lr", "stable_steps", "decay_steps", "batch_size", "grad_accum", "log_interval", "eval_tokens"):
            if not getattr(self, name) > 0:
                bad(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("warmup_steps", "block_size", "weight_decay", "grad_clip", "eval_interval", "ckpt_interval",
                     "flops_ctx"):
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            bad(f"min_lr_frac must lie in [0, 1], got {self.min_lr_frac}")
        for b in self.branch_steps:
            if not 1 <= b <= self.stable_steps:
                bad(f"branch_steps must lie in [1, stable_steps={self.stable_steps}], got {b}")
        if self.batch_size % (world_size * self.grad_accum):
            bad(f"batch_size={self.batch_size} must be divisible by world_size x grad_accum = "
                f"{world_size} x {self.grad_accum}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            bad(f"dtype must be auto|bf16|fp32, got {self.dtype!r}")


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
# Checkpoints

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


def atomic_save(obj, path: str | Path) -> None:
    """torch.save to a temp file, fsync, then os.replace: `path` is always a complete file or absent."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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
    """Read a checkpoint (no code runs: weights_only) and check it belongs to this model and trajectory."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
        meta = json.loads(ck["meta"])
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); it is truncated or "
                              f"corrupt: delete it to resume from the previous checkpoint") from e
    diff = _run_diff(meta, model_cfg, tc)
    if diff:
        raise CheckpointError(f"checkpoint {path} does not match this run: " + "; ".join(diff))
    return ck


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


def effective_doc_length(doc_ids: Tensor) -> float:
    """2 x (mean keys a token sees under a causal document mask) - 1: the document length L that
    budget.flops_per_token charges the same attention FLOPs for (exactly L for documents of length L)."""
    B, T = doc_ids.shape
    pos = torch.arange(T).expand(B, T)
    new = torch.ones(B, T, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(new, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return 2.0 * float((pos - start + 1).double().mean()) - 1.0


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


class Trainer:
    def __init__(self, model_cfg: ModelConfig, tc: TrainConfig, data, run_dir: str | Path, meta: dict | None = None):
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
        self.flops_ctx = tc.flops_ctx or self._measure_doc_length()
        self.F = budget.flops_per_token(model_cfg, min(self.flops_ctx, tc.block_size))
        self.wall = 0.0

    # -- bookkeeping -------------------------------------------------------------------------
    def _measure_doc_length(self, n_batches: int = 4) -> float:
        docs = [self.data.train_batch(s, self.tc.batch_size, self.tc.block_size, seed=self.tc.seed)[2]
                for s in range(min(n_batches, self.tc.stable_steps))]
        return effective_doc_length(torch.cat(docs))

    @staticmethod
    def _phase(branch: int | None) -> str:
        return "stable" if branch is None else f"branch{branch:07d}"

    def _ckpt(self, branch: int | None, step: int) -> Path:
        return self.ckpt_dir / f"{self._phase(branch)}_{step:07d}.pt"

    def _ckpts(self, branch: int | None) -> dict[int, Path]:
        """{step: path} of this phase's checkpoints on disk."""
        return {int(p.stem[-7:]): p for p in self.ckpt_dir.glob(f"{self._phase(branch)}_{'[0-9]' * 7}.pt")}

    def _barrier(self) -> None:
        if self.d.world > 1:
            dist.barrier()

    def _append(self, name: str, row: dict) -> None:
        if self.d.rank == 0:
            with open(self.run_dir / name, "a") as f:
                f.write(json.dumps(row) + "\n")

    def _trim_metrics(self, branch: int | None, step: int) -> None:
        """On resume, drop metrics rows of this phase logged after the checkpoint (they are recomputed)."""
        path = self.run_dir / "metrics.jsonl"
        if self.d.rank != 0 or not path.exists():
            return
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        keep = [r for r in rows if not (r.get("branch") == branch and r["step"] > step)]
        if len(keep) != len(rows):
            path.write_text("".join(json.dumps(r) + "\n" for r in keep))

    # -- checkpoints -------------------------------------------------------------------------
    def _names(self) -> list[str]:
        """Parameter names ("gpt."-prefixed, as torch.distributed.checkpoint keys them) in optimizer order."""
        names = {id(p): "gpt." + n for n, p in self.gpt.named_parameters()}
        return [names[id(p)] for g in self.opt.param_groups for p in g["params"]]

    def _state_dicts(self) -> tuple[dict, dict]:
        """Full model and name-keyed optimizer state dicts (gathered from the shards under FSDP2)."""
        if self.tc.fsdp and self.d.world > 1:   # collectives; the import is heavy, so only here
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return (get_model_state_dict(self.objective, options=opts),
                    get_optimizer_state_dict(self.objective, self.opt, options=opts))
        names, osd = self._names(), self.opt.state_dict()
        return ({"gpt." + k: v for k, v in self.gpt.state_dict().items()},
                {"state": {names[i]: st for i, st in osd["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]})

    def _load_state_dicts(self, msd: dict, osd: dict) -> None:
        if self.tc.fsdp and self.d.world > 1:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)
            set_model_state_dict(self.objective, msd, options=StateDictOptions(full_state_dict=True))
            set_optimizer_state_dict(self.objective, self.opt, osd, options=StateDictOptions(full_state_dict=True))
            return
        self.objective.load_state_dict(msd)
        index = {n: i for i, n in enumerate(self._names())}
        self.opt.load_state_dict({"state": {index[n]: st for n, st in osd["state"].items()},
                                  "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                                   for g in osd["param_groups"]]})

    def save(self, branch: int | None, step: int) -> Path:
        msd, osd = self._state_dicts()
        path = self._ckpt(branch, step)
        if self.ddp is not None:   # cheap guard that DDP keeps the replicas identical
            fp = torch.stack([p.detach().double().abs().sum() for p in self.gpt.parameters()]).sum().view(1)
            every = [torch.zeros_like(fp) for _ in range(self.d.world)]
            dist.all_gather(every, fp)
            if any(not torch.equal(f, fp) for f in every):
                raise RuntimeError(f"DDP replicas differ at step {step}: checksums {[float(f) for f in every]}")
        if self.d.rank == 0:
            meta = {"format": 1, "model": self.model_cfg.to_dict(), "train": asdict(self.tc), "step": step,
                    "branch": branch, "tokens": step * self.tokens_per_step}
            atomic_save({"model": {k.removeprefix("gpt."): v for k, v in msd.items()}, "optimizer": osd,
                         "step": step, "wall_s": self.wall, "rng": _rng_state(), "meta": json.dumps(meta)}, path)
        self._barrier()
        return path

    def load(self, path: Path) -> int:
        ck = load_checkpoint(path, self.model_cfg, self.tc)
        try:
            self._load_state_dicts({"gpt." + k: v for k, v in ck["model"].items()}, ck["optimizer"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} does not load into this model: {e}") from e
        _set_rng_state(ck["rng"])
        self.wall = float(ck["wall_s"])
        return int(ck["step"])

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
            last = max(self.ckpt_dir.glob("*.pt"), key=os.path.getmtime, default="none")
            raise DivergenceError(f"non-finite loss {row['loss']} / grad norm {row['grad_norm']} at optimizer step "
                                  f"{step + 1} (lr {lr:.3g}); nothing was saved after it: the last good checkpoint "
                                  f"is {last}")
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
        log = done % tc.log_interval == 0 or done == end
        ev = tc.eval_interval and done % tc.eval_interval == 0
        if not (log or ev):
            return
        now = time.perf_counter()
        dt, n = now - self.win_t, done - self.win_step
        self.win_t, self.win_step = now, done
        tps = n * self.tokens_per_step / max(dt, 1e-9)
        row = {"phase": "stable" if branch is None else "decay", "branch": branch, "step": done,
               "tokens": done * self.tokens_per_step, **row, "tokens_per_s": tps,
               "eta_s": self.steps_left * dt / max(n, 1)}
        if self.peak:
            row["mfu"] = self.F * tps / (self.peak * self.d.world)
        if ev:
            row["val_loss"] = self.evaluate()["val_loss"]
            self.win_t = time.perf_counter()   # evaluation time is not training throughput
        self._append("metrics.jsonl", row)
        if self.d.rank == 0:
            name = "stable" if branch is None else f"decay@{branch}"
            mfu = f" | mfu {100 * row['mfu']:.1f}%" if "mfu" in row else ""
            val = f" | val {row['val_loss']:.4f}" if "val_loss" in row else ""
            eta = row["eta_s"]
            print(f"{name} {done}/{end} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | gnorm {row['grad_norm']:.2f}"
                  f" | {tps / 1e3:.1f}k tok/s{mfu}{val} | eta {int(eta // 60)}m{int(eta % 60):02d}s", flush=True)

    def _train(self, start: int, end: int, branch: int | None, save_at: set[int]) -> None:
        tc = self.tc
        for step in range(start, end):
            t0 = time.perf_counter()
            data_step = step if branch is None else tc.stable_steps + (step - branch)
            row = self.step(step, data_step, lr_at(tc, step, branch))
            self.wall += time.perf_counter() - t0
            done = step + 1
            periodic = tc.ckpt_interval and done % tc.ckpt_interval == 0
            if done in save_at or periodic or done == end:
                old = self._ckpts(branch)
                self.save(branch, done)
                for s, p in old.items():   # superseded resume points (fork points and finals are kept)
                    if s < done and s not in save_at and self.d.rank == 0:
                        p.unlink(missing_ok=True)
            self._log(done, end, branch, row)

    def evaluate(self) -> dict:
        return evaluate(self.objective, self.data, self.micro, self.tc.block_size, self.tc.eval_tokens,
                        self.device, self.autocast)

    def _results(self) -> list[dict]:
        path = self.run_dir / "results.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
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
                "branch_step": branch, "D": D, "F": self.F, "F_ctx": ctx, "C": self.F * D,
                "S": budget.sparsity(self.F, N, budget.flops_per_token(control, ctx), N0), "N": N,
                "val_loss": ev["val_loss"], "val_loss_by_source": ev["val_loss_by_source"],
                "val_loss_by_domain": ev["val_loss_by_domain"], "val_tokens": ev["val_tokens"],
                "config": cfg.to_dict(), "control": control.to_dict(), "train": asdict(tc), "wall_s": self.wall}

    def run(self) -> list[dict]:
        tc = self.tc
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir.mkdir(exist_ok=True)
        cfg_path = self.run_dir / "config.json"
        if cfg_path.exists():
            diff = _run_diff(json.loads(cfg_path.read_text()), self.model_cfg, tc)
            if diff:
                raise CheckpointError(f"{cfg_path} describes another run: {'; '.join(diff)}; use a new run directory")
        data_dir = getattr(self.data, "dir", None) or getattr(self.data, "manifest", {}).get("preset")
        self._barrier()
        if self.d.rank == 0:
            meta = {k: v for k, v in self.meta.items() if k != "control"}
            cfg_path.write_text(json.dumps({"model": self.model_cfg.to_dict(), "train": asdict(tc),
                                            "data_dir": str(data_dir), "meta": meta}, indent=2))
        rows = self._results()
        done = {r["branch_step"] for r in rows}
        pending = [b for b in tc.branches if b not in done]
        if not pending:
            self._export_final()
            return sorted(rows, key=lambda r: r["branch_step"])
        forks = self._ckpts(None)
        need = [b for b in pending if b not in forks and not self._ckpts(b)]
        target = max(need, default=0)
        start = max((s for s in forks if s <= target), default=0)
        self.steps_left = target - start + len(pending) * tc.decay_steps
        self.win_t, self.win_step = time.perf_counter(), start
        if need:
            if start:
                self.load(forks[start])
            self._trim_metrics(None, start)
            self._train(start, target, None, set(tc.branches))
        for b in pending:
            end, resumes = b + tc.decay_steps, self._ckpts(b)
            step = self.load(resumes[max(resumes)] if resumes else self._ckpt(None, b))
            self.steps_left -= step - b
            self._trim_metrics(b, step)
            self.win_t, self.win_step = time.perf_counter(), step
            if step < end:
                self._train(step, end, b, {end})
            row = self._result_row(b, self.evaluate())
            self._append("results.jsonl", row)
            rows.append(row)
            if self.d.rank == 0:
                print(f"branch {b}: D={row['D']:.3g} tokens, C={row['C']:.3g} FLOPs, "
                      f"val_loss {row['val_loss']:.4f}", flush=True)
        self._export_final()
        return sorted(rows, key=lambda r: r["branch_step"])

    def _export_final(self) -> None:
        """RUN_DIR/ckpt.pt: the endpoint of the longest branch, the model eval.py and probes.py read."""
        last = max(self.tc.branches)
        src = self._ckpts(last).get(last + self.tc.decay_steps)
        dst = self.run_dir / "ckpt.pt"
        if self.d.rank == 0 and src is not None and not dst.exists():
            tmp = dst.with_suffix(".pt.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)


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

PRESETS = ("smoke-dense", "smoke-moe", "smoke-smelt")


def preset_model(name: str, vocab_size: int) -> ModelConfig:
    """Tiny named models for smoke runs (the reproduction's ladders live in budget.py / reproduce.py)."""
    base = dict(vocab_size=vocab_size, block_size=64, n_layer=4, d_model=32, n_head=2, n_kv_head=1, d_ff=32)
    moe = dict(n_experts=4, top_k=2)
    kw = {"smoke-dense": {**base, "d_ff": 64}, "smoke-moe": {**base, **moe},   # smelt: middle half looped twice
          "smoke-smelt": {**base, **moe, "loop": LoopConfig(*middle_span(4), n_loops=2)}}
    if name not in kw:
        raise ValueError(f"--preset must be one of {PRESETS}, got {name!r}")
    return ModelConfig(**kw[name])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model-json", help="path to a ModelConfig JSON (ModelConfig.to_dict())")
    m.add_argument("--preset", choices=PRESETS, help="a named tiny model")
    p.add_argument("--data", default="smoke", help="data preset for data.prepare (smoke|tiny|small) or 'synthetic'")
    p.add_argument("--data-dir", help="an already prepared TokenData directory (overrides --data)")
    p.add_argument("--vocab-size", type=int, default=256, help="vocabulary of --data synthetic")
    for key in ("arch", "scale", "sparsity_label"):
        p.add_argument(f"--{key.replace('_', '-')}", help=f"results-row field {key!r}")
    kinds = {"float": float, "int": int, "str": str}
    for f in fields(TrainConfig):
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        elif f.type == "list[int]":
            p.add_argument(flag, type=int, nargs="+", default=[], help=help)
        else:
            p.add_argument(flag, type=kinds[f.type], default=f.default, help=help)
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    a = build_parser().parse_args(argv)
    tc = TrainConfig(**{f.name: getattr(a, f.name) for f in fields(TrainConfig)})
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
    cfg = (ModelConfig.from_dict(json.loads(Path(a.model_json).read_text())) if a.model_json
           else preset_model(a.preset, data.vocab_size))
    meta = {k: getattr(a, k) for k in ("arch", "scale", "sparsity_label") if getattr(a, k) is not None}
    try:
        return train(cfg, tc, data, tc.out_dir, meta)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
