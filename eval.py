"""Evaluating one endpoint: validation loss by source, domain and document length; loading endpoints.

SMELT 3.1 "Evaluation" and 5.3: `val_loss_by`, the token-weighted validation loss overall and by source, domain
and document-length bucket (`length_bounds`), is what train.py runs at each branch end (`stored_report` reads it
back); `normalised_shape` / `long_short_ratio` give a gain's length shape (Fig. 20a); `load_model` reads a run
directory, an endpoint file or a checkpoint (hash checked); `run_endpoints` lists a run's finished branches.
Read before: data.py (TokenData.val_batches). Read next: lab/evaluate.py, lab/tasks.py. Notes: docs/eval.md.
"""
from __future__ import annotations

import contextlib
import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import data as data_mod


def length_bounds(block_size: int, n_buckets: int = 8) -> list[int]:
    """Bucket upper bounds: powers of two ending at the first one >= block_size (32..4096 at 4096)."""
    top = 1 << max(0, math.ceil(math.log2(block_size)))
    return sorted({max(1, top >> i) for i in range(n_buckets)})


def segment_lengths(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) length of the run of equal ids (the document's segment) at each position."""
    B, T = doc_ids.shape
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    seg = start.long().cumsum(1) + torch.arange(B, device=doc_ids.device)[:, None] * (T + 1)
    return torch.bincount(seg.flatten())[seg]


def length_bucket(lengths: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Each length -> the index of the smallest bucket bound >= it (longer than every bound -> the top bucket)."""
    return torch.bucketize(lengths, bounds).clamp(max=len(bounds) - 1)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T, V) float logits, (B, T) targets -> (B, T) cross-entropy, 0 where the target is -1 (ignored);
    on flattened rows, not logits.transpose(1, 2): 6x faster on CPU (docs/eval.md)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1,
                           reduction="none").view(targets.shape)


def pad_batch(batch: tuple, batch_size: int) -> tuple:
    """(idx, targets, doc_ids[, lengths]) padded to batch_size rows with 0, -1 (ignored), 0, 1; a full batch as is."""
    n = batch[0].shape[0]
    if n > batch_size:
        raise ValueError(f"pad_batch: a validation batch of {n} rows exceeds batch_size={batch_size}")
    if n == batch_size:
        return batch
    fill = (0, -1, 0, 1)
    return tuple(None if t is None else torch.cat([t, t.new_full((batch_size - n, *t.shape[1:]), fill[i])])
                 for i, t in enumerate(batch))


def _batches(data, src: str, batch_size: int, block_size: int, max_tokens: int | None):
    """(the source's validation batches with a lengths tensor each, "document" | "segment")."""
    try:
        return data.val_batches(src, batch_size, block_size, max_tokens, doc_lengths=True), "document"
    except TypeError:   # a data source without whole-document lengths: use segments from doc_ids
        return ((*b[:3], segment_lengths(b[2])) for b in data.val_batches(src, batch_size, block_size,
                                                                           max_tokens)), "segment"


@torch.no_grad()
def val_loss_by(nll_fn, data, block_size: int, batch_size: int, max_tokens_per_source: int | None = None,
                n_buckets: int = 8, device: torch.device | str = "cpu", autocast=contextlib.nullcontext) -> dict:
    """Token-weighted validation loss in one pass: overall, by source, by domain, by document-length bucket.
    nll_fn(idx, targets, doc_ids) -> (B, T) per-token cross-entropy (0 at ignored targets); data: a TokenData."""
    bounds = length_bounds(block_size, n_buckets)
    src_sum, src_n = defaultdict(float), defaultdict(int)
    len_sum, len_n = np.zeros(len(bounds)), np.zeros(len(bounds), dtype=np.int64)
    bounds_t = torch.tensor(bounds, device=device)
    length_from = "document"
    for src in data.sources:
        batches, length_from = _batches(data, src, batch_size, block_size, max_tokens_per_source)
        for batch in batches:
            idx, targets, doc_ids, lengths = (t.to(device) for t in pad_batch(batch, batch_size))
            with autocast():
                nll = nll_fn(idx, targets, doc_ids).float()
            valid = targets >= 0
            src_sum[src] += float(nll[valid].sum())
            src_n[src] += int(valid.sum())
            which = length_bucket(lengths, bounds_t)
            len_sum += torch.bincount(which[valid], nll[valid].double(), len(bounds)).cpu().numpy()
            len_n += torch.bincount(which[valid], minlength=len(bounds)).cpu().numpy()
    agg = data_mod.token_weighted({s: (src_sum[s], src_n[s]) for s in src_n}, data.domains)
    if not agg["tokens"]:
        raise ValueError("no validation tokens: every source is empty or shorter than one context")
    return {"loss": agg["loss"], "loss_macro": float(np.mean(list(agg["by_source"].values()))),  # over sources
            "tokens": agg["tokens"], "by_source": agg["by_source"], "by_domain": agg["by_domain"],
            "by_length": {b: float(len_sum[i] / len_n[i]) for i, b in enumerate(bounds) if len_n[i]},
            "tokens_by_length": {b: int(len_n[i]) for i, b in enumerate(bounds) if len_n[i]},
            "length_from": length_from, "settings": settings(data, block_size, max_tokens_per_source, n_buckets)}


def settings(data, block_size: int, max_tokens_per_source: int | None, n_buckets: int = 8) -> dict:
    """What a report was measured on; a stored report is reused only for the same settings."""
    where = getattr(data, "dir", None)
    return {"data": str(Path(where).resolve()) if where else str(getattr(data, "manifest", {}).get("preset")),
            "block_size": int(block_size), "max_tokens_per_source": max_tokens_per_source,
            "n_buckets": int(n_buckets)}


def stored_report(run_dir: str | Path | None, branch_step: int | None, data, block_size: int,
                  max_tokens_per_source: int | None, n_buckets: int = 8) -> dict | None:
    """The report train.py stored for this endpoint (RUN_DIR/results.jsonl, hash checked), when it was made on
    the same data, context, token cap and buckets; else None (then the caller computes it)."""
    path = Path(run_dir or ".") / "results.jsonl"
    if run_dir is None or branch_step is None or data is None or not path.is_file():
        return None
    rows = [r for r in checks.read_jsonl(path, ("branch_step",)) if r["branch_step"] == branch_step]
    rep = rows[-1].get("val") if rows else None
    if not isinstance(rep, dict) or rep.get("settings") != settings(data, block_size, max_tokens_per_source, n_buckets):
        return None
    return {**rep, "by_length": {int(b): v for b, v in rep["by_length"].items()},   # JSON keys are strings
            "tokens_by_length": {int(b): n for b, n in rep["tokens_by_length"].items()}}


def normalised_shape(ref_by_length: dict, new_by_length: dict) -> dict[int, float]:
    """SMELT 5.3: improvement per bucket (ref loss - new loss) divided by its mean over buckets."""
    ref, new = {int(k): v for k, v in ref_by_length.items()}, {int(k): v for k, v in new_by_length.items()}
    buckets = sorted(set(ref) & set(new))
    gain = np.array([ref[b] - new[b] for b in buckets])
    mean = gain.mean() if len(gain) else 0.0
    if abs(mean) < 1e-12:
        return {b: float("nan") for b in buckets}
    return {b: float(g / mean) for b, g in zip(buckets, gain)}


def long_short_ratio(shape: dict) -> float:
    """Mean normalised gain over the longer half of the buckets / over the shorter half (SMELT: 1.52)."""
    vals = [shape[b] for b in sorted(shape, key=int)]
    h = len(vals) // 2
    return float(np.mean(vals[len(vals) - h:]) / np.mean(vals[:h])) if h else float("nan")


def val_loss_report(model: nn.Module, data, block_size: int, batch_size: int, max_tokens_per_source: int | None = None,
                    n_buckets: int = 8) -> dict:
    """val_loss_by of a model (GPT or any module returning logits), in eval mode."""
    model.eval()
    return val_loss_by(lambda i, t, d: token_nll(forward_logits(model, i, d), t), data, block_size, batch_size,
                       max_tokens_per_source, n_buckets, device=model_device(model))


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """(GPT, meta) from a run directory (RUN_DIR/ckpt.pt, the longest branch, with config.json), an endpoint file
    (RUN_DIR/endpoints/branch_BBBBBBB.pt) or a training checkpoint (RUN_DIR/ckpt/*.pt). The ModelConfig comes
    from the file's own "meta", else from the run's config.json; meta: config.json's keys plus those below.
    Weights that cannot fit `device` are refused before the model is built (budget.refuse_oversized)."""
    import budget
    from model import GPT, ModelConfig
    p = Path(path)
    if p.is_dir():
        run, file = p, p / "ckpt.pt"
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p / 'config.json'} not found: a run directory needs config.json and ckpt.pt "
                                    f"(train.py writes both)")
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: train.py writes it when the run's longest branch finishes; "
                                    f"give an endpoint file (RUN_DIR/endpoints/*.pt) to evaluate another branch")
    elif p.is_file():
        file, parent = p, p.parent.parent
        run = parent if p.parent.name in ("endpoints", "ckpt") and (parent / "config.json").is_file() else None
    else:
        raise FileNotFoundError(f"{p} not found: give a run directory (config.json + ckpt.pt), an endpoint file "
                                f"or a training checkpoint")
    config = checks.read_json(run / "config.json") if run is not None else {}
    checks.require_keys(config, (), f"{run}/config.json")   # an object, not a list
    checks.file_digest(file)   # the sha256 trailer first: a flipped byte is a CheckpointError naming the file
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, pickle with code, not a torch file
        raise checks.BadFileError(f"{file} could not be loaded as a weights-only checkpoint: {e}") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise checks.BadFileError(f"{file} has no 'model' entry (expected torch.save({{'model': state_dict, ...}}))")
    own = ckpt.get("meta")
    own = checks.parse_json(own, f"{file}: its 'meta' entry") if isinstance(own, str) else own
    own = own if isinstance(own, dict) else {}
    cfg = own.get("model") or config.get("model")
    if not isinstance(cfg, dict):
        raise checks.BadFileError(f"{file} has no model config: neither its 'meta' nor "
                                  f"{run / 'config.json' if run else 'a config.json beside it'} has a 'model' key "
                                  f"(expected ModelConfig.to_dict())")
    mc = checks.config_from(ModelConfig, cfg, run / "config.json" if cfg is config.get("model") else file)
    budget.refuse_oversized(mc, device, 0, mc.block_size, str(file), train=False)
    model = GPT(mc)
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise checks.BadFileError(f"{file} does not match its model config: {e}") from e
    scalars = {k: v for k, v in ckpt.items() if k not in ("model", "optimizer", "rng", "meta") and
               isinstance(v, (int, float, str, bool))}
    branch = own.get("branch")
    named = re.fullmatch(r"branch_?(\d{7})(?:_\d{7})?\.pt", file.name)   # endpoints/branch_B.pt, ckpt/branchB_E.pt
    if branch is None and named:
        branch = int(named.group(1))
    meta = {**config, "model": cfg, "checkpoint": {**scalars, **({"meta": own} if own else {})},
            "run_dir": str(run) if run is not None else None,
            "endpoint": str(file.relative_to(run)) if run is not None and file.parent != run else None,
            "branch_step": int(branch) if branch is not None else None,
            "step": own.get("step", scalars.get("step")), "tokens": own.get("tokens")}
    return model.to(device).eval(), meta


def run_endpoints(run_dir: str | Path) -> list[dict]:
    """Every finished decay branch of RUN_DIR/results.jsonl (its last row wins), by branch step, with the first
    endpoint file that exists: the row's "endpoint", endpoints/branch_B.pt, the branch's last ckpt/branchB_E.pt."""
    run = Path(run_dir)
    res = run / "results.jsonl"
    if not res.is_file():
        raise FileNotFoundError(f"{res} not found: train.py writes one row per finished decay branch")
    try:
        rows = {int(r["branch_step"]): r for r in checks.read_jsonl(res, ("branch_step",))}   # hash-checked
    except checks.CheckpointError as e:
        raise ValueError(str(e)) from None
    out = []
    for b, r in sorted(rows.items()):
        decay = (r.get("train") or {}).get("decay_steps")
        cands = [r["endpoint"]] if r.get("endpoint") else []
        cands += [f"endpoints/branch_{b:07d}.pt"] + ([f"ckpt/branch{b:07d}_{b + decay:07d}.pt"] if decay else [])
        found = next((c for c in cands if (run / c).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{run}: branch {b} finished (results.jsonl) but none of its endpoint files "
                                    f"exists: {', '.join(cands)}")
        out.append({"run": str(run), "branch_step": b, "endpoint": found, "path": str(run / found)})
    return out


def forward_logits(model: nn.Module, idx: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The model's float logits (B, T, V) for idx (B, T), under bf16 autocast on CUDA."""
    with torch.autocast("cuda", torch.bfloat16, enabled=idx.is_cuda):
        out = model(idx) if doc_ids is None else model(idx, doc_ids=doc_ids)
    return (out[0] if isinstance(out, tuple) else out).float()


def model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
