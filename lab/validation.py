"""Validation loss of one endpoint, computed once: overall, by source, by domain, by document-length bucket.

`val_loss_report` is the one pass train.py runs at each branch end (stored in the results row under "val")
and eval.evaluate_endpoint reuses through `stored_report` (SMELT 3.1 "Evaluation", 5.3's length buckets).
`length_bounds`: powers of two ending at the context length (32..4096 at 4096: eight buckets). A token is
bucketed by its whole document's length where the data offers it, else by its segment's (`segment_lengths`).
Every batch is padded to `batch_size` rows with ignored targets (`pad_batch`), so a compiled model sees one
shape; padded rows add nothing to any sum. `token_nll` is the one per-token cross-entropy both callers use.
`normalised_shape` / `long_short_ratio`: the length shape of a gain between two reports (SMELT 5.3, Fig. 20a).
Read before: data.py (TokenData.val_batches, token_weighted). Design notes: docs/train.md.
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

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


def length_bucket(lengths: torch.Tensor, block_size: int, n_buckets: int = 8) -> torch.Tensor:
    """Each length -> the smallest bucket bound >= it (longer than every bound -> the top bucket)."""
    bounds = torch.tensor(length_bounds(block_size, n_buckets), device=lengths.device)
    return bounds[torch.bucketize(lengths, bounds).clamp(max=len(bounds) - 1)]


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T, V) float logits, (B, T) targets -> (B, T) cross-entropy, 0 where the target is -1 (ignored)."""
    # flattened rows, not logits.transpose(1, 2): the same numbers, 6x faster on CPU (docs/eval.md)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1,
                           reduction="none").view(targets.shape)


def pad_batch(batch: tuple, batch_size: int) -> tuple:
    """(idx, targets, doc_ids[, lengths]) with fewer than batch_size rows -> batch_size rows: idx / doc ids 0,
    targets -1 (ignored), lengths 1 in the added rows. A full batch is returned as it is."""
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
def val_loss_report(nll_fn, data, block_size: int, batch_size: int, max_tokens_per_source: int | None = None,
                    n_buckets: int = 8, device: torch.device | str = "cpu", autocast=contextlib.nullcontext) -> dict:
    """Token-weighted validation loss in one pass: overall, by source, by domain, by document-length bucket.

    nll_fn(idx, targets, doc_ids) -> (B, T) per-token cross-entropy (0 at ignored targets), e.g.
    `lambda i, t, d: token_nll(logits(i, d), t)`; data: a data.TokenData (sources, domains, val_batches).
    Returns {"loss", "loss_macro" (mean over sources), "tokens", "by_source", "by_domain",
    "by_length": {bucket: loss}, "tokens_by_length", "length_from": "document" | "segment", "settings"}.
    """
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
            which = torch.bucketize(lengths, bounds_t).clamp(max=len(bounds) - 1)
            len_sum += torch.bincount(which[valid], nll[valid].double(), len(bounds)).cpu().numpy()
            len_n += torch.bincount(which[valid], minlength=len(bounds)).cpu().numpy()
    agg = data_mod.token_weighted({s: (src_sum[s], src_n[s]) for s in src_n}, data.domains)
    if not agg["tokens"]:
        raise ValueError("no validation tokens: every source is empty or shorter than one context")
    return {"loss": agg["loss"],
            "loss_macro": float(np.mean(list(agg["by_source"].values()))),
            "tokens": agg["tokens"],
            "by_source": agg["by_source"],
            "by_domain": agg["by_domain"],
            "by_length": {b: float(len_sum[i] / len_n[i]) for i, b in enumerate(bounds) if len_n[i]},
            "tokens_by_length": {b: int(len_n[i]) for i, b in enumerate(bounds) if len_n[i]},
            "length_from": length_from,
            "settings": settings(data, block_size, max_tokens_per_source, n_buckets)}


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
    import runfiles
    path = Path(run_dir or ".") / "results.jsonl"
    if run_dir is None or branch_step is None or data is None or not path.is_file():
        return None
    want = settings(data, block_size, max_tokens_per_source, n_buckets)
    rows = [r for r in runfiles.read_jsonl(path, ("branch_step",)) if r["branch_step"] == branch_step]
    rep = rows[-1].get("val") if rows else None
    if not isinstance(rep, dict) or rep.get("settings") != want:
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
