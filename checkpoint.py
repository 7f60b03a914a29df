"""Checkpoints: what a training run saves, keeps and reads back to resume it exactly (SMELT Sec. 3.1, 4.1).

A resume checkpoint (RUN_DIR/ckpt/stable_SSSSSSS.pt, branchBBBBBBB_SSSSSSS.pt) holds the uncompiled GPT's
state_dict, the optimizer state keyed by parameter name (gathered under FSDP2: one file resumes on 1 process,
DDP or FSDP2), the step, RNG states as tensors and the configs as JSON meta; an endpoint
(RUN_DIR/endpoints/branch_BBBBBBB.pt) holds "model" and "meta". Batches are a pure function of (seed, step),
so on CPU a resumed run is bit for bit the uninterrupted one. Nothing non-finite is saved (DivergenceError).

`needed_checkpoints` keeps at most two full checkpoints per run, none once it has finished; lab/costs.py's
`disk_estimate` replays `save_kind` / `logged` to size a run. Files are written and verified by checks.py
(read it first); train.Trainer inherits `Checkpoints`. Design notes and measured sizes: docs/checkpoint.md.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from checks import (CheckpointError, RunLockedError, atomic_copy, atomic_save, atomic_write_text, file_digest,
                    jsonl_line, load_file, naming, read_json, read_jsonl, remove_stale_tmp, repair_torn_tail, run_lock)
from model import ModelConfig

if TYPE_CHECKING:   # train.py imports this module
    from train import TrainConfig

# Train-config fields that define the trajectory: a checkpoint / results row made with other values is not resumable.
TRAJECTORY = ("lr", "min_lr_frac", "warmup_steps", "stable_steps", "decay_steps", "batch_size", "block_size",
              "weight_decay", "beta1", "beta2", "eps", "grad_clip", "seed")


class DivergenceError(RuntimeError):
    """The loss or gradient norm became non-finite, or the loss far above a uniform guess's (`divergence_limit`)."""


DIVERGENCE_MARGIN = 1.0   # nats above ln V (a uniform guess) that no healthy run reaches after its first steps
DIVERGENCE_WINDOW = 3     # consecutive log rows above the limit that stop a run (one validation does)


def divergence_limit(vocab_size: int) -> float:
    return math.log(vocab_size) + DIVERGENCE_MARGIN


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


def _rekey(osd: dict, key) -> dict:
    """An optimizer state dict with its parameter keys mapped through `key` (index <-> name)."""
    return {"state": {key[i]: st for i, st in osd["state"].items()},
            "param_groups": [{**g, "params": [key[i] for i in g["params"]]} for g in osd["param_groups"]]}


def data_fingerprint(data) -> str:
    """The sha256 of what a run's batches are drawn from: every shard's in a TokenData's manifest (not the
    manifest's own, which changes with the build time), or a stand-in's whole manifest (data.SyntheticData)."""
    m = getattr(data, "manifest", {})
    files = m.get("files")
    blob = json.dumps({k: v["sha256"] for k, v in files.items()} if files else m, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def config_diff(stored: dict, current: dict, prefix: str) -> list[str]:
    """Readable differences between a stored and the current config ('model.n_layer: stored 2, this run 3')."""
    a, b = _flat(stored, prefix), _flat(json.loads(json.dumps(current)), prefix)
    return [f"{k}: stored {a.get(k)!r}, this run {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


def with_defaults(stored: dict, default: dict) -> dict:
    """A stored config as this code reads it: each field it lacks (added since) takes its default, nested too,
    so a new field whose default is the old behaviour leaves finished runs resumable."""
    out = {**default, **stored}
    return {k: with_defaults(v, default[k]) if isinstance(v, dict) and isinstance(default.get(k), dict) else v
            for k, v in out.items()}


def _run_diff(rec: dict, model_cfg: ModelConfig, tc: TrainConfig) -> list[str]:
    cur, train = asdict(tc), with_defaults(rec["train"], asdict(type(tc)()))
    return (config_diff(with_defaults(rec["model"], type(model_cfg)().to_dict()), model_cfg.to_dict(), "model.")
            + config_diff({k: train.get(k) for k in TRAJECTORY}, {k: cur[k] for k in TRAJECTORY}, "train."))


def load_checkpoint(path: str | Path, model_cfg: ModelConfig, tc: TrainConfig) -> dict:
    """A checkpoint (hash checked, weights_only) with "meta" parsed, refused unless of this model and trajectory."""
    ck = load_file(path)
    meta = json.loads(ck["meta"])
    if "train" not in meta:
        raise CheckpointError(f"checkpoint {path} lacks meta['train'] (not written by train.py?)")
    diff = _run_diff(meta, model_cfg, tc)
    if diff:
        raise CheckpointError(f"checkpoint {path} does not match this run: " + "; ".join(diff))
    return {**ck, "meta": meta}


def endpoint_path(run_dir: str | Path, branch: int) -> Path:
    return Path(run_dir) / "endpoints" / f"branch_{branch:07d}.pt"


def save_kind(tc: TrainConfig, branch: int | None, done: int, end: int) -> str | None:
    """What the Trainer writes after optimizer step `done` of a segment ending at `end` (a stable segment ends at
    a fork point): "endpoint" at a branch's end, "full" at a fork point and every ckpt_interval steps, else None."""
    if done == end:
        return "full" if branch is None else "endpoint"
    return "full" if tc.ckpt_interval and done % tc.ckpt_interval == 0 else None


def logged(tc: TrainConfig, done: int, end: int) -> tuple[bool, bool]:
    """(progress row, validation) after optimizer step `done` of a segment ending at `end`."""
    return done % tc.log_interval == 0 or done == end, bool(tc.eval_interval and done % tc.eval_interval == 0)


def needed_checkpoints(on_disk, pending) -> set[tuple[int | None, int]]:
    """Of the (branch or None for the stable run, step) checkpoints on disk, those resuming still needs: for each
    pending branch (no results row yet) its own latest, else the latest stable one at or before its fork."""
    on_disk, keep = set(on_disk), set()
    for b in pending:
        own = [s for bb, s in on_disk if bb == b]
        prior = [s for bb, s in on_disk if bb is None and s <= b]
        if own or prior:
            keep.add((b, max(own)) if own else (None, max(prior)))
    return keep


def _intact_row(raw: bytes) -> bool:
    """Re-hashing an intact JSON-lines row reproduces it byte for byte."""
    try:
        text = raw.decode()
        return jsonl_line(json.loads(text)) == text + "\n"
    except (ValueError, TypeError, AttributeError):   # not text, not JSON, not an object
        return False


def quarantine_damaged_rows(path: str | Path) -> list[int]:
    """Move every row of a JSON-lines log that fails its hash to PATH.damaged (a log row cannot be recomputed, so
    nothing is deleted), keep the intact rows in order, and name the file and the lines; returns those lines."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    rows = [(n, raw) for n, raw in enumerate(data.split(b"\n"), 1) if raw]   # after a final newline: empty
    bad = [(n, raw) for n, raw in rows if not _intact_row(raw)]
    if not bad:
        if rows and not data.endswith(b"\n"):   # an intact last row that lost only its newline
            atomic_write_text(path, "".join(raw.decode() + "\n" for _, raw in rows))
        return []
    damaged = path.with_name(path.name + ".damaged")
    with naming(damaged), open(damaged, "ab") as f:   # why: a failed write() names no file
        f.write(b"".join(raw + b"\n" for _, raw in bad))
    atomic_write_text(path, "".join(raw.decode() + "\n" for n, raw in rows if (n, raw) not in bad))
    print(f"{path}: {len(bad)} damaged row(s) at line(s) {[n for n, _ in bad]} moved to {path.name}.damaged; "
          f"{len(rows) - len(bad)} intact row(s) kept", flush=True)
    return [n for n, _ in bad]


def branches(branch_steps: list[int], stable_steps: int) -> list[int]:
    """The branch steps a run trains (TrainConfig.branches): its fork points, else stable_steps."""
    return sorted(set(branch_steps)) or [stable_steps]


def _branches_of(run_dir: Path) -> list[int]:
    tc = read_json(run_dir / "config.json", keys=("train",))["train"]   # written by this module: validated
    return branches(tc["branch_steps"], tc["stable_steps"])


def export_final(run_dir: str | Path, branch: int | None = None) -> Path:
    """RUN_DIR/ckpt.pt, a byte copy of the endpoint of `branch` (default: config.json's longest), rebuilt when
    missing, corrupt or a copy of another endpoint (the endpoint itself is checked first)."""
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
    atomic_copy(src, dst)
    if file_digest(dst) != want:   # the source changed under us
        raise CheckpointError(f"{dst} does not match {src} after copying it")
    return dst


def load_weights(path: str | Path) -> tuple[dict, dict]:
    """(GPT state_dict, meta: "model", "train", "branch", "step", "tokens") of a run directory (its ckpt.pt), an
    endpoint or a full checkpoint. A corrupt ckpt.pt is served from, and rebuilt from, the endpoint it copies."""
    path = Path(path)
    if path.is_dir():
        if not (path / "ckpt.pt").exists():
            raise CheckpointError(f"{path} has no ckpt.pt: the run has not finished (train.py writes it last)")
        run, path = path, path / "ckpt.pt"
        try:
            file_digest(path)
        except CheckpointError as e:
            src = endpoint_path(run, max(_branches_of(run)))
            try:
                with run_lock(run):
                    export_final(run)
                print(f"{e}; rebuilt it from {src}", flush=True)
            except RunLockedError:
                print(f"{e}; reading {src} instead (a trainer holds the run's lock)", flush=True)
                path = src
    ck = load_file(path)
    return ck["model"], json.loads(ck["meta"])


class Checkpoints:
    """The Trainer's checkpoint side (train.Trainer inherits it): naming, pruning, saving, loading, resuming.
    Rank 0 writes; every rank calls save / save_endpoint (FSDP2 gathers the full state with collectives)."""

    # -- the run directory -------------------------------------------------------------------
    def _ckpt(self, branch: int | None, step: int) -> Path:
        return self.ckpt_dir / f"{'stable' if branch is None else f'branch{branch:07d}'}_{step:07d}.pt"

    def _ckpts(self, branch: int | None) -> dict[int, Path]:
        """{step: path} of this phase's checkpoints on disk."""
        return {s: p for (b, s), p in self._all_ckpts().items() if b == branch}

    def _all_ckpts(self) -> dict[tuple[int | None, int], Path]:
        """{(branch or None, step): path} of every full checkpoint on disk."""
        found = [(m, p) for p in self.ckpt_dir.glob("*.pt")
                 if (m := re.fullmatch(r"(?:stable|branch(\d{7}))_(\d{7})\.pt", p.name))]
        return {(None if m.group(1) is None else int(m.group(1)), int(m.group(2))): p for m, p in found}

    def _last_good(self) -> str:
        return str(max(self.ckpt_dir.glob("*.pt"), key=os.path.getmtime, default="none (no checkpoint yet)"))

    def _guard(self, step: int, branch: int | None, train_ce: float | None, val_loss: float | None) -> None:
        """DivergenceError when the validation loss, or the training CE of this trajectory's last DIVERGENCE_WINDOW
        log rows (self.trail), is above divergence_limit: a finite blow-up (non-finite ones stop in step)."""
        limit = divergence_limit(self.model_cfg.vocab_size)
        where = "stable run" if branch is None else f"branch {branch}"
        if train_ce is not None:
            self.trail.append((branch, step, train_ce))
        # this trajectory's last log rows: the stable run's up to the fork, then the branch's own
        path = sorted((s, ce) for b, s, ce in self.trail if b == branch or (b is None and s <= branch))
        last = [ce for _, ce in path[-DIVERGENCE_WINDOW:]] if train_ce is not None else []
        what = (f"validation loss {val_loss:.4g}" if val_loss is not None and not val_loss <= limit else
                f"training CE {', '.join(f'{ce:.4g}' for ce in last)} at the last {DIVERGENCE_WINDOW} log rows"
                if len(last) == DIVERGENCE_WINDOW and not any(ce <= limit for ce in last) else None)
        if what:
            raise DivergenceError(f"{self.meta.get('run', self.run_dir)}: diverged at optimizer step {step} of the "
                                  f"{where}: {what}, above ln V + {DIVERGENCE_MARGIN:g} = {limit:.3f} (a uniform guess "
                                  f"scores {limit - DIVERGENCE_MARGIN:.3f}); lower the learning rate. No results row "
                                  f"is written for it; the last good checkpoint is {self._last_good()}")

    def _barrier(self) -> None:
        if self.d.world > 1:
            dist.barrier()

    def _append(self, name: str, row: dict, sync: bool = False) -> None:
        """Append one hashed row (a single write of a whole line; results rows are fsynced)."""
        if self.d.rank == 0:
            with naming(self.run_dir / name), open(self.run_dir / name, "a") as f:   # why: write() names no file
                f.write(jsonl_line(row))
                if sync:
                    f.flush()
                    os.fsync(f.fileno())

    def _open_run_dir(self) -> None:
        """Refuse a RUN_DIR/config.json of another run, then (rank 0) write it, cut torn rows and stale temp files."""
        cfg_path, fingerprint = self.run_dir / "config.json", data_fingerprint(self.data)
        if cfg_path.exists():
            stored = read_json(cfg_path, keys=("model", "train"))
            diff = _run_diff(stored, self.model_cfg, self.tc)
            if stored.get("data_sha256", fingerprint) != fingerprint:   # a rebuilt dataset: other batches on resume
                diff.append(f"data_sha256: stored {stored['data_sha256'][:12]}, this run {fingerprint[:12]} "
                            f"(the dataset's shards differ)")
            if diff:
                raise CheckpointError(f"{cfg_path} describes another run: {'; '.join(diff)}; use a new run directory")
        data_dir = getattr(self.data, "dir", None) or getattr(self.data, "manifest", {}).get("preset")
        self._barrier()
        if self.d.rank == 0:
            meta = {k: v for k, v in self.meta.items() if k != "control"}
            atomic_write_text(cfg_path, json.dumps({"model": self.model_cfg.to_dict(), "train": asdict(self.tc),
                                                    "data_dir": str(data_dir), "data_sha256": fingerprint,
                                                    "meta": meta}, indent=2))
            repair_torn_tail(self.run_dir / "results.jsonl")
            quarantine_damaged_rows(self.run_dir / "metrics.jsonl")
            for d in (self.run_dir, self.ckpt_dir, self.run_dir / "endpoints"):   # a killed writer's temp files
                remove_stale_tmp(d)
        self._barrier()

    def _trim_metrics(self, branch: int | None, step: int) -> None:
        """Before training a phase from `step`, drop its metrics rows after it (a crashed attempt's); the rows kept
        are the divergence guard's history (every rank reads them)."""
        path = self.run_dir / "metrics.jsonl"
        rows = read_jsonl(path) if path.exists() else []
        keep = [r for r in rows if not (r.get("branch") == branch and r.get("step", 0) > step)]
        self.trail = [(r.get("branch"), r["step"], r["ce_mean"]) for r in keep if "ce_mean" in r and "step" in r]
        if self.d.rank == 0 and len(keep) != len(rows):
            atomic_write_text(path, "".join(jsonl_line(r) for r in keep))

    def _prune(self, pending: list[int]) -> None:
        """Delete the full checkpoints resuming no longer needs; the directory too once empty."""
        if self.d.rank == 0 and self.ckpt_dir.is_dir():
            on_disk = self._all_ckpts()
            for key in on_disk.keys() - needed_checkpoints(on_disk, pending):
                on_disk[key].unlink(missing_ok=True)
            remove_stale_tmp(self.ckpt_dir)
            if not pending and not any(self.ckpt_dir.iterdir()):
                self.ckpt_dir.rmdir()
        self._barrier()   # other ranks list checkpoints next

    # -- saving and loading the training state -----------------------------------------------
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
        return msd, _rekey(self.opt.state_dict(), self._names()) if optimizer else None

    def _load_state_dicts(self, msd: dict, osd: dict | None) -> None:
        if self.tc.fsdp and self.d.world > 1:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)
            opts = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.objective, msd, options=opts)
            if osd is not None:
                set_optimizer_state_dict(self.objective, self.opt, osd, options=opts)
            return
        self.objective.load_state_dict(msd)
        if osd is not None:
            self.opt.load_state_dict(_rekey(osd, {n: i for i, n in enumerate(self._names())}))

    def _refuse_nonfinite(self, path: Path, step: int, msd: dict, osd: dict | None = None) -> None:
        """DivergenceError (on every rank) when a tensor about to be saved holds NaN / infinity."""
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
        """The branch's weights-only endpoint (all ranks call this)."""
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
        """Load a finished branch's endpoint to evaluate it (a crash came before its results row); False when
        there is none or it is damaged (the branch is trained again)."""
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

    # -- resuming ----------------------------------------------------------------------------
    def _reach_fork(self, b: int) -> None:
        """Bring the model to the stable run's step b (from memory or the latest stable checkpoint at or before b)."""
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

    def _results(self) -> list[dict]:
        """This run's results rows already on disk; CheckpointError if another run's."""
        path = self.run_dir / "results.jsonl"
        rows = read_jsonl(path, keys=("branch_step", "config", "train")) if path.exists() else []
        for r in rows:
            diff = _run_diff({"model": r["config"], "train": r["train"]}, self.model_cfg, self.tc)
            if diff:
                raise CheckpointError(f"{path} holds results of another configuration: {'; '.join(diff)}; "
                                      f"use a new run directory")
        return list({r["branch_step"]: r for r in rows if r["branch_step"] in self.tc.branches}.values())


def refuse_unrunnable(model_cfg: ModelConfig) -> None:
    """ValueError naming the field when a valid-looking config cannot train (rope_theta too small for finite
    angles, a loss coefficient overflowing float32); warns of a coefficient > 1. Memory: budget.refuse_oversized."""
    from attention import rope_table
    if not all(bool(torch.isfinite(t).all()) for t in rope_table(model_cfg.block_size, model_cfg.hd,
                                                                 model_cfg.rope_theta)):
        raise ValueError(f"ModelConfig: rope_theta={model_cfg.rope_theta} makes the rotary angles non-finite in "
                         f"float32 (NaN losses); use a theta >= 1 (10000 is usual)")
    fmax = torch.finfo(torch.float32).max
    for name, most in (("aux_loss_coef", max(1, model_cfg.n_experts * model_cfg.top_k)), ("z_loss_coef", 1)):
        coef = getattr(model_cfg, name)
        if coef * most >= fmax:   # the load-balance loss reaches E * top_k; any z-loss >= 1 would overflow
            raise ValueError(f"ModelConfig: {name}={coef} overflows the float32 loss; use a value <= 1")
        if coef > 1:
            print(f"warning: ModelConfig {name}={coef} > 1: the router loss outweighs the language-model loss",
                  flush=True)
