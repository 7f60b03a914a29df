"""Probes: what the second visit of a looped layer computes (SMELT Section 6, Appendix D).

One capture pass over held-out tokens (`GPT.run(..., capture={})`) records, for every
(layer, visit) of the execution plan, the residual input x, the RMSNorm outputs, Q/K/V,
the attention probabilities, PV, O, the attention and feed-forward writes and the routed
experts. Each batch is reduced at once into running sums per *unit* (`ProbeAccumulator`;
a unit is a held-out document group, see below), so memory grows with the number of units,
never with tokens, and no T x T map outlives its batch. From those sums, for every matched
(Baseline, SMELT) pair:

  Sec. 6.1, Fig. 21  expert-set overlap |S1 ∩ S2| per token between consecutive visits of
                     a layer (distribution over 0..k) against random routing (k^2 / n).
  Sec. 6.2, Fig. 22  residual RMS ||x||/sqrt(D), update RMS ||Δx||/sqrt(D) (Δx = attention
                     write + feed-forward write, both after the 1/r scale), and ||Δx||/||x||
                     per layer and visit; visit-2 / visit-1 norm ratios of the full update,
                     the attention write, the MoE write and the RMSNorm outputs (Fig. 23e-h).
  Sec. 6.2, Fig. 24  token-averaged cosine between residual updates of every pair of visits
                     in flattened execution order; same-layer cross-visit entries against the
                     other (non-matching) cross-visit pairs of the looped span.
  Sec. 6.3, Fig. 25  cross-visit cosines of X = RMSNorm(x) (Eq. 10), Q, K, V, PV (per token
                     and head) and O (per token); also of the raw residual x.
  Sec. 6.3, Fig. 26  top-1 / top-8 attended-token overlap of head h between visits 1 and 2,
                     against the paper's control: head h against head (h + H/2) mod H *at the
                     same layer and visit* ("shares the same positional context but uses
                     different learned weights; ... every head is used exactly once"), taken on
                     both visits; and the attention-distribution overlap sum_j min(p1_j, p2_j).
  Sec. 6.4, Fig. 28/30, App. D  attention-sink mass: attention a query puts on the first
                     token of its document (segment start), per layer, visit and head.
  Sec. 6.4, Fig. 27  Dyck case study (`dyck_case_study`): BIG-bench dyck_languages prompts with
                     k in {1, 2, 4, 8} "Output:" demonstrations built by eval.build_prompt, the
                     Dyck head chosen by ablation, and its BOS vs demonstration-answer mass per
                     visit at three answer targets.

`probe_pairs` runs all of it on every matched pair over one held-out sample; `claims` turns
the result into Section 6's claims, each a paired quantity with a `stats.Interval` and the
paper's direction, for `stats.verdict`; `plot_pairs` draws Fig. 23 (one point per pair),
Appendix D's sink profiles and the per-pair figures.

Design choices (where the paper is silent), with reasons:
  * Held-out sample (`held_out_sample`): an equal token share from every domain present
    (SMELT: "spanning all five source categories"), spread evenly over each domain's sources,
    contexts taken in stream order from the start of each source's validation split. The same
    sample serves every model, so quantities pair across Baseline, SMELT and cells.
  * Unit of every probe interval: a *held-out document group*, the contexts of one source that
    share a document (a document cut by a context boundary joins the two contexts). Tokens of
    one document are strongly correlated, so a token-level bootstrap would be far too narrow;
    documents (or groups of them) are the independent draws of the held-out set. Intervals are
    percentile bootstraps over units (`stats.bootstrap_interval`), the same resample for all
    pairs, so a pair-averaged quantity is a paired comparison. On the tiny corpus 4k tokens
    give about 30 units (most sources' documents are longer than a context). The Dyck claims
    use prompts as units (independent items).
  * A claim's `interval` is the mean over pairs; `per_pair` holds each pair's own interval and
    `weakest` the bootstrap interval of the least favourable pair (min for '>' claims, max for
    '<'), the reading of the paper's "in all 16 cells"; `across_pairs` is the t-interval over
    the pairs' point estimates (cell-to-cell spread, not sampling noise).
  * Metrics are pure functions of tensors; the accumulator only sums and counts them. A
    Baseline is the same code with one visit per layer: sink mass and the update-cosine
    matrix, but no cross-visit metrics. With r > 2 visits, "cross-visit" compares
    consecutive visits (v, v+1) of each layer.
  * Attention metrics count only queries that have a choice: top-k overlap uses queries
    with more than k visible keys (otherwise both sets are the whole visible prefix), sink
    mass and distribution overlap use queries that are not their document's first token.
  * Norm ratios are ratios of token-averaged norms (a per-token ratio blows up where the
    first-visit update is near zero), averaged over the span's layers. Cosines are averaged
    per token (and head).
  * Memory: a batch's capture holds every visit's (B, H, T, T) probabilities at once, about
    n_visits * B * H * T^2 * 4 bytes; pick the batch size for that.
  * Visits are numbered from 1, as in the paper, in every label, figure and JSON field
    ("L3.v2" = layer 3, second visit; "visit": 2). Layers outside the looped span run once and
    are labelled by layer only ("L0") and called unlooped. (Capture keys stay `loop.Visit`'s
    0-based (layer, visit).)
  * Dyck (Sec. 6.4): items whose gold answer is three closing brackets (three tokens: the
    three targets, teacher-forced), demonstrations nested across k (the k = 2 prompt adds one
    demonstration to the k = 1 prompt's) and the first demonstration's answer already holds
    every target's closing symbol, as the paper requires. Demonstrations are drawn from the
    shortest quarter of the items so that as many k as possible fit the context the model was
    trained on (`probe_pairs`; RoPE distances beyond it were never seen); a k that does not fit
    is reported as skipped, never truncated (tiny, 128-token contexts: k = 1, 2, 4). Ablating a head zeroes its slice of PV before W_O
    in that physical layer, i.e. on every visit (the weights are shared). The Dyck loss is
    the mean cross-entropy of the target tokens over all prompts; the Dyck head is the head
    of the looped span whose ablation raises it most.

CLI: python probes.py --pair NAME BASELINE_RUN SMELT_RUN [--pair ...] [--tokens N] [--out DIR]
writes probes.json and the figures (Fig. 21-28/30 per pair, Fig. 23 grid, App. D profiles).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import cli
import stats
from loop import Visit

EPS = 1e-8
STAGES = {"resid": "x", "X": "attn_norm", "Q": "q", "K": "k", "V": "v", "PV": "pv", "O": "o"}
RATIOS = {"update": "update_rms", "attn_write": "attn_write_rms", "mlp_write": "mlp_write_rms",
          "attn_norm": "attn_norm_rms", "mlp_norm": "mlp_norm_rms"}
DYCK_KS = (1, 2, 4, 8)
CLOSERS = (")", "]", "}", ">")


def label(layer: int, visit: int | None = None) -> str:
    """'L3.v2' for layer 3's second visit (visit is 1-based, as in the paper); 'L3' for an unlooped layer."""
    return f"L{layer}" if visit is None else f"L{layer}.v{visit}"


def visit_labels(plan: Sequence[Visit]) -> dict[tuple[int, int], str]:
    """Capture key (layer, 0-based visit) -> label: looped layers get 'Ll.vN' (N from 1), unlooped 'Ll'."""
    n = {}
    for v in plan:
        n[v.layer] = n.get(v.layer, 0) + 1
    return {(v.layer, v.visit): label(v.layer, v.visit + 1 if n[v.layer] > 1 else None) for v in plan}


# ----------------------------------------------------------------------------------------
# Pure metric functions (tensors in, tensors out; no state)

def doc_positions(doc_ids: Tensor | None, B: int, T: int, device=None) -> tuple[Tensor, Tensor]:
    """(start (B, T): index of the first token of each token's document, pos (B, T): offset in it)."""
    t = torch.arange(T, device=device).expand(B, T)
    if doc_ids is None:
        return torch.zeros_like(t), t.clone()
    is_start = torch.ones(B, T, dtype=torch.bool, device=device)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(is_start, t, torch.zeros_like(t)).cummax(dim=1).values
    return start, t - start


def token_norm(x: Tensor) -> Tensor:
    """L2 norm over the last dim, in fp32."""
    return x.float().norm(dim=-1)


def token_rms(x: Tensor) -> Tensor:
    """||x||_2 / sqrt(D) over the last dim (the paper's residual / update RMS)."""
    return token_norm(x) / math.sqrt(x.shape[-1])


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Cosine over the last dim; 0 where either vector is zero."""
    return F.cosine_similarity(a.float(), b.float(), dim=-1, eps=EPS)


def split_heads(x_BTX: Tensor, n_head: int) -> Tensor:
    """(B, T, H*hd) -> (B, H, T, hd)."""
    B, T, _ = x_BTX.shape
    return x_BTX.view(B, T, n_head, -1).transpose(1, 2)


def expert_overlap(idx1: Tensor, idx2: Tensor) -> Tensor:
    """|S1 ∩ S2| per token from top-k expert ids (..., k) of two visits -> (...,) in 0..k."""
    return (idx1[..., :, None] == idx2[..., None, :]).sum(dim=(-1, -2))


def random_overlap(k: int, n: int) -> tuple[float, list[float]]:
    """Independent uniform top-k routing over n experts: E|S1 ∩ S2| = k^2/n and the pmf over 0..k."""
    pmf = [math.comb(k, j) * math.comb(n - k, k - j) / math.comb(n, k) for j in range(k + 1)]
    return k * k / n, pmf


def topk_overlap(p1: Tensor, p2: Tensor, k: int) -> Tensor:
    """|top-k(p1) ∩ top-k(p2)| / k per query: p (..., S) attention rows -> (...,) in [0, 1]."""
    i1, i2 = p1.topk(k, dim=-1).indices, p2.topk(k, dim=-1).indices
    return (i1[..., :, None] == i2[..., None, :]).sum(dim=(-1, -2)).float() / k


def mass_overlap(p1: Tensor, p2: Tensor) -> Tensor:
    """sum_j min(p1_j, p2_j) per query: 1 for identical distributions, 0 for disjoint ones."""
    return torch.minimum(p1.float(), p2.float()).sum(-1)


def control_heads(n_head: int) -> list[int] | None:
    """SMELT Sec. 6.3's control pairing: head h with head (h + H/2) mod H of the same layer and visit
    (a fixed offset of half the head count, so every head is used exactly once). None for one head."""
    if n_head < 2:
        return None
    return [(h + n_head // 2) % n_head for h in range(n_head)]


def sink_mass(p_BHTS: Tensor, start_BT: Tensor) -> Tensor:
    """Attention each query puts on the first token of its document -> (B, H, T)."""
    B, H, T, _ = p_BHTS.shape
    idx = start_BT[:, None, :, None].expand(B, H, T, 1)
    return p_BHTS.gather(-1, idx).squeeze(-1).float()


def update_cosine_sums(updates: Sequence[Tensor], chunk: int = 4096) -> Tensor:
    """Sum over tokens of the pairwise cosine between visits' updates: list of (N, D) -> (V, V)."""
    V, N = len(updates), updates[0].shape[0]
    out = torch.zeros(V, V, dtype=torch.float64, device=updates[0].device)
    for s in range(0, N, chunk):
        U = torch.stack([F.normalize(u[s:s + chunk].float(), dim=-1, eps=EPS) for u in updates])
        out += torch.einsum("vnd,wnd->vw", U, U).double()
    return out


def visit_update(c: dict) -> Tensor:
    """Δx of one visit: attention write + feed-forward write (each already scaled by 1/r)."""
    writes = [c[n] for n in ("attn_write", "mlp_write") if c.get(n) is not None]
    return sum(writes[1:], writes[0]) if writes else torch.zeros_like(c["x"])


def cross_visit_pairs(plan: Sequence[Visit]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((layer, v), (layer, v+1)) for every layer visited more than once, in layer order (0-based v)."""
    visits = {}
    for v in plan:
        visits.setdefault(v.layer, []).append(v.visit)
    return [((l, a), (l, a + 1)) for l in sorted(visits) for a in sorted(visits[l])[:-1]]


def pair_label(a: tuple[int, int], b: tuple[int, int]) -> str:
    """'L3.v1-v2': layer 3, visit 1 against visit 2 (1-based)."""
    return f"{label(a[0], a[1] + 1)}-v{b[1] + 1}"


# ----------------------------------------------------------------------------------------
# Streaming accumulator (sums per unit)

class ProbeAccumulator:
    """Running sums of every probe, kept per unit (a held-out document group; any hashable key).

    Every sum has shape (n_units, *shape) with a count (n_units,), so global means are
    sum / count over units and a bootstrap resamples units. The state grows with the number
    of units seen, never with tokens or batches of units already seen.
    """

    def __init__(self, plan: Sequence[Visit], n_head: int, n_experts: int = 0, top_k: int = 0,
                 attn_topk: Sequence[int] = (1, 8)):
        self.visits = [(v.layer, v.visit) for v in plan]
        self.labels = visit_labels(plan)
        self.pairs = cross_visit_pairs(plan)
        self.n_head, self.n_experts, self.top_k = n_head, n_experts, top_k
        self.attn_topk = tuple(attn_topk)
        self.control = control_heads(n_head)
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}
        self.units: list = []
        self._unit_pos: dict = {}
        self._rows = torch.zeros(0, dtype=torch.long)
        self.tokens = 0

    # -- bookkeeping ---------------------------------------------------------------------
    def _set_units(self, units: Sequence) -> None:
        rows = []
        for u in units:
            if u not in self._unit_pos:
                self._unit_pos[u] = len(self.units)
                self.units.append(u)
            rows.append(self._unit_pos[u])
        self._rows = torch.tensor(rows, dtype=torch.long)

    def _add(self, name: str, total: Tensor, n: Tensor) -> None:
        """total (B, *shape): one row per context; n (B,): what each row's total counts."""
        total, n = total.detach().double().cpu(), n.detach().double().cpu().reshape(-1)
        U = len(self.units)
        if name not in self.sums:
            self.sums[name] = torch.zeros(U, *total.shape[1:], dtype=torch.float64)
            self.counts[name] = torch.zeros(U, dtype=torch.float64)
        elif self.sums[name].shape[0] < U:                           # new units since: pad with zeros
            pad = U - self.sums[name].shape[0]
            self.sums[name] = torch.cat([self.sums[name], self.sums[name].new_zeros(pad, *total.shape[1:])])
            self.counts[name] = torch.cat([self.counts[name], self.counts[name].new_zeros(pad)])
        self.sums[name].index_add_(0, self._rows, total)
        self.counts[name].index_add_(0, self._rows, n)

    def _add_mean(self, name: str, v: Tensor) -> None:
        """Per-row sum of every value of v (B, ...)."""
        B = v.shape[0]
        self._add(name, v.reshape(B, -1).sum(1), torch.full((B,), v[0].numel()))

    def _add_heads(self, name: str, v_BHT: Tensor, mask_BT: Tensor) -> None:
        """Per-row, per-head sums over the queries where mask is True."""
        m = mask_BT[:, None, :].to(v_BHT.dtype)
        self._add(name, (v_BHT * m).sum(dim=2), mask_BT.sum(1))

    def unit_sum(self, name: str) -> tuple[Tensor, Tensor] | None:
        """(sums (n_units, *shape), counts (n_units,)), zero rows for units that never had a value."""
        if name not in self.sums:
            return None
        s, c, U = self.sums[name], self.counts[name], len(self.units)
        if s.shape[0] < U:
            s = torch.cat([s, s.new_zeros(U - s.shape[0], *s.shape[1:])])
            c = torch.cat([c, c.new_zeros(U - c.shape[0])])
        return s, c

    def mean(self, name: str) -> Tensor | None:
        if name not in self.sums or self.counts[name].sum() == 0:
            return None
        return self.sums[name].sum(0) / self.counts[name].sum()

    def state_sizes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every running sum (what tests check stays fixed as batches of known units stream in)."""
        return {k: tuple(v.shape) for k, v in self.sums.items()}

    # -- one batch -----------------------------------------------------------------------
    @torch.no_grad()
    def update(self, capture: dict, doc_ids: Tensor | None = None, units: Sequence | None = None) -> None:
        """Reduce one batch's capture {(layer, visit): {name: tensor}} into the running sums.

        units: one key per row (default: a new unit per row, numbered in arrival order)."""
        x0 = capture[self.visits[0]]["x"]
        B, T, D = x0.shape
        if units is None:
            units = [("row", self.tokens // T + b) for b in range(B)]
        if len(units) != B:
            raise ValueError(f"units: need one key per row ({B}), got {len(units)}")
        self._set_units(list(units))
        start, pos = doc_positions(doc_ids, B, T, x0.device)
        self.tokens += B * T
        updates = {}
        for lv in self.visits:                                       # per layer and visit
            c, name = capture[lv], self.labels[lv]
            upd = updates[lv] = visit_update(c)
            self._add_mean(f"{name}/x_rms", token_rms(c["x"]))
            self._add_mean(f"{name}/update_rms", token_rms(upd))
            self._add_mean(f"{name}/relative_update", token_norm(upd) / token_norm(c["x"]).clamp_min(EPS))
            for key in ("attn_write", "mlp_write", "attn_norm", "mlp_norm"):
                if c.get(key) is not None:
                    self._add_mean(f"{name}/{key}_rms", token_rms(c[key]))
            if c.get("attn_probs") is not None:
                self._add_heads(f"{name}/sink", sink_mass(c["attn_probs"], start), pos >= 1)
        M = torch.stack([update_cosine_sums([updates[lv][b] for lv in self.visits]) for b in range(B)])
        self._add("update_cosine", M, torch.full((B,), T))
        for a, b in self.pairs:                                      # cross-visit metrics
            ca, cb, name = capture[a], capture[b], pair_label(a, b)
            self._add_mean(f"{name}/cos/update", cosine(updates[a], updates[b]))
            for stage, key in STAGES.items():
                if ca.get(key) is None or cb.get(key) is None:
                    continue
                ta, tb = ca[key], cb[key]
                if key == "pv":                                      # per token and head
                    ta, tb = split_heads(ta, self.n_head), split_heads(tb, self.n_head)
                self._add_mean(f"{name}/cos/{stage}", cosine(ta, tb))
            if ca.get("topk_idx") is not None and cb.get("topk_idx") is not None:
                ov = expert_overlap(ca["topk_idx"], cb["topk_idx"]).reshape(B, T)
                self._add(f"{name}/expert_hist", F.one_hot(ov, self.top_k + 1).sum(1), torch.full((B,), T))
            pa, pb = ca.get("attn_probs"), cb.get("attn_probs")
            if pa is None or pb is None:
                continue
            for k in self.attn_topk:
                if k <= T:
                    self._add_heads(f"{name}/top{k}/same", topk_overlap(pa, pb, k), pos + 1 > k)
            self._add_heads(f"{name}/mass/same", mass_overlap(pa, pb), pos >= 1)
            if self.control is None:
                continue
            for p in (pa, pb):                                       # control: other head, same layer and visit
                for k in self.attn_topk:
                    if k <= T:
                        self._add_heads(f"{name}/top{k}/control", topk_overlap(p, p[:, self.control], k), pos + 1 > k)
                self._add_heads(f"{name}/mass/control", mass_overlap(p, p[:, self.control]), pos >= 1)

    # -- summary -------------------------------------------------------------------------
    def _unit_block(self) -> dict:
        """Per-unit sums of the quantities Section 6's claims rest on (for bootstrap intervals)."""
        q: dict[str, dict] = {}

        def put(name, parts, count):
            q[name] = {"sum": torch.stack(parts, 1).tolist(), "count": count.tolist()}

        if not self.pairs:
            return {"keys": [list(u) if isinstance(u, tuple) else u for u in self.units], "layers": [],
                    "quantities": q}
        names = [pair_label(a, b) for a, b in self.pairs]
        for r, key in RATIOS.items():
            got = [(self.unit_sum(f"{self.labels[a]}/{key}"), self.unit_sum(f"{self.labels[b]}/{key}"))
                   for a, b in self.pairs]
            if all(x is not None and y is not None for x, y in got):
                put(f"ratio_{r}", [torch.stack([x[0], y[0]], 1) for x, y in got], got[0][0][1])
        uc = self.unit_sum("update_cosine")
        if uc is not None:
            idx = {lv: i for i, lv in enumerate(self.visits)}
            M, n = uc
            put("ucos_same", [M[:, idx[a], idx[b]] for a, b in self.pairs], n)
            looped = {a[0] for a, _ in self.pairs}
            other = [(idx[a], idx[b]) for a in self.visits for b in self.visits
                     if a[0] in looped and b[0] in looped and a[0] != b[0] and a[1] < b[1]]
            if other:
                o = torch.stack([M[:, i, j] for i, j in other], 1).mean(1)
                put("ucos_other", [o] * len(self.pairs), n)
        for stage in ["update", *STAGES]:
            got = [self.unit_sum(f"{nm}/cos/{stage}") for nm in names]
            if all(g is not None for g in got):
                put(f"cos_{stage}", [g[0] for g in got], got[0][1])
        for kind in [f"top{k}" for k in self.attn_topk] + ["mass"]:
            for side in ("same", "control"):
                got = [self.unit_sum(f"{nm}/{kind}/{side}") for nm in names]
                if all(g is not None for g in got):                  # per-head sums -> mean over heads
                    put(f"{kind}_{side}", [g[0].mean(1) for g in got], got[0][1])
        got = [self.unit_sum(f"{nm}/expert_hist") for nm in names]
        if all(g is not None for g in got):
            ar = torch.arange(self.top_k + 1, dtype=torch.float64)
            put("expert_overlap", [(g[0] * ar).sum(1) for g in got], got[0][1])
        got = [(self.unit_sum(f"{self.labels[a]}/sink"), self.unit_sum(f"{self.labels[b]}/sink")) for a, b in self.pairs]
        if all(x is not None and y is not None for x, y in got):
            put("sink", [torch.stack([x[0].mean(1), y[0].mean(1)], 1) for x, y in got], got[0][0][1])
        return {"keys": [list(u) if isinstance(u, tuple) else u for u in self.units], "layers": names,
                "quantities": q}

    def result(self) -> dict:
        """JSON-able summary of everything accumulated so far (visits numbered from 1)."""
        f = lambda t: None if t is None else float(t.mean())
        looped = sorted({a[0] for a, _ in self.pairs})
        per_visit = {}
        for layer, visit in self.visits:
            name = self.labels[(layer, visit)]
            d = {"layer": layer, "visit": visit + 1, "looped": layer in looped}
            for key in ("x_rms", "update_rms", "relative_update", "attn_write_rms", "mlp_write_rms",
                        "attn_norm_rms", "mlp_norm_rms"):
                d[key] = f(self.mean(f"{name}/{key}"))
            sink = self.mean(f"{name}/sink")
            d["sink_mass"], d["sink_mass_per_head"] = f(sink), None if sink is None else sink.tolist()
            per_visit[name] = d
        M = self.mean("update_cosine")
        idx = {lv: i for i, lv in enumerate(self.visits)}
        diag = [M[idx[a], idx[b]].item() for a, b in self.pairs] if M is not None else []
        other = [M[idx[a], idx[b]].item() for a in self.visits for b in self.visits
                 if M is not None and a[0] in looped and b[0] in looped and a[0] != b[0] and a[1] < b[1]]
        cross = {}
        for a, b in self.pairs:
            name = pair_label(a, b)
            va, vb = per_visit[self.labels[a]], per_visit[self.labels[b]]
            d = {"layer": a[0], "visits": [a[1] + 1, b[1] + 1],
                 "cosine": {s: f(self.mean(f"{name}/cos/{s}")) for s in ["update", *STAGES]},
                 "norm_ratio": {r: (vb[k] / va[k] if va[k] and vb[k] is not None else None)
                                for r, k in RATIOS.items()}}
            hist = self.mean(f"{name}/expert_hist")
            if hist is not None:
                exp, pmf = random_overlap(self.top_k, self.n_experts)
                d["expert_overlap"] = {"distribution": hist.tolist(), "mean": float((hist * torch.arange(
                    len(hist))).sum()), "k": self.top_k, "n_experts": self.n_experts, "random_mean": exp,
                    "random_distribution": pmf}
            att = {}
            for kind in ("same", "control"):
                for k in self.attn_topk:
                    att[f"top{k}" + ("" if kind == "same" else "_control")] = f(self.mean(f"{name}/top{k}/{kind}"))
                att["mass" + ("" if kind == "same" else "_control")] = f(self.mean(f"{name}/mass/{kind}"))
            d["attention"] = att
            cross[name] = d
        avg = lambda xs: (sum(x for x in xs if x is not None) / len([x for x in xs if x is not None])
                          if any(x is not None for x in xs) else None)
        summary = {"update_cosine_cross_visit": avg(diag), "update_cosine_other": avg(other)}
        for s in ["update", *STAGES]:
            summary[f"cos_{s}"] = avg([d["cosine"][s] for d in cross.values()])
        for r in RATIOS:
            summary[f"ratio_{r}"] = avg([d["norm_ratio"][r] for d in cross.values()])
        summary["ratio_norm"] = avg([summary["ratio_attn_norm"], summary["ratio_mlp_norm"]])
        summary["expert_overlap"] = avg([d["expert_overlap"]["mean"] for d in cross.values() if "expert_overlap" in d])
        summary["expert_overlap_frac"] = (summary["expert_overlap"] / self.top_k
                                          if summary["expert_overlap"] is not None else None)
        summary["expert_overlap_random"] = (random_overlap(self.top_k, self.n_experts)[0]
                                            if summary["expert_overlap"] is not None else None)
        for key in (cross[next(iter(cross))]["attention"] if cross else {}):
            summary[f"attn_{key}"] = avg([d["attention"][key] for d in cross.values()])
        summary["sink_mass"] = avg([d["sink_mass"] for d in per_visit.values()])
        n_vis = max((d["visit"] for d in per_visit.values()), default=1)
        for v in range(1, n_vis + 1):                                # the looped span, per visit
            summary[f"sink_mass_span_v{v}"] = avg([d["sink_mass"] for d in per_visit.values()
                                                   if d["looped"] and d["visit"] == v])
        return {"tokens": self.tokens, "visits": [self.labels[lv] for lv in self.visits], "looped_layers": looped,
                "attn_topk": list(self.attn_topk), "per_visit": per_visit,
                "update_cosine": {"labels": [self.labels[lv] for lv in self.visits],
                                  "matrix": None if M is None else M.tolist(),
                                  "cross_visit_diagonal": diag, "cross_visit_mean": avg(diag),
                                  "other_cross_visit_mean": avg(other)},
                "cross_visit": cross, "summary": summary, "units": self._unit_block()}


# ----------------------------------------------------------------------------------------
# Running a model

def _unpack(batch) -> tuple[Tensor, Tensor | None]:
    """Accept idx, (idx, targets) or (idx, targets, doc_ids[, ...])."""
    if isinstance(batch, Tensor):
        return batch, None
    return batch[0], (batch[2] if len(batch) > 2 else None)


@torch.no_grad()
def probe(model, batches: Iterable, max_tokens: int | None = None, attn_topk: Sequence[int] = (1, 8),
          log_every: int = 0, units: Sequence | None = None) -> dict:
    """Capture every visit on each batch, reduce it, and return the JSON-able summary.

    units: one key per row over all batches, in order (default: every row its own unit)."""
    cfg, device = model.cfg, next(model.parameters()).device
    was_training = model.training
    model.eval()
    acc = ProbeAccumulator(model.plan, cfg.n_head, cfg.n_experts, cfg.top_k if cfg.n_experts else 0, attn_topk)
    t0, row = time.time(), 0
    for i, batch in enumerate(batches):
        idx, doc = _unpack(batch)
        if max_tokens is not None:
            rows = min(idx.shape[0], math.ceil((max_tokens - acc.tokens) / idx.shape[1]))
            if rows <= 0:
                break
            idx, doc = idx[:rows], (doc[:rows] if doc is not None else None)
        B = idx.shape[0]
        if units is not None and row + B > len(units):
            raise ValueError(f"units: {len(units)} keys for more rows than that ({row + B} so far)")
        idx = idx.to(device)
        doc = doc.to(device) if doc is not None else None
        capture: dict = {}
        model.run(idx, doc_ids=doc, capture=capture)
        acc.update(capture, doc, None if units is None else units[row:row + B])
        row += B
        del capture
        if log_every and (i + 1) % log_every == 0:
            print(f"  probe batch {i + 1}: {acc.tokens} tokens, {acc.tokens / (time.time() - t0):.0f} tok/s",
                  flush=True)
    model.train(was_training)
    out = acc.result()
    out["config"] = cfg.to_dict()
    return out


# ----------------------------------------------------------------------------------------
# The held-out sample: every domain, equal shares, document groups as units

@dataclass
class Sample:
    """Held-out contexts: idx/doc (N, T), and per row its unit (source, document group), source, domain."""
    idx: Tensor
    doc: Tensor
    units: list[tuple[str, int]]
    sources: list[str]
    domains: list[str]

    def batches(self, batch_size: int):
        for s in range(0, self.idx.shape[0], batch_size):
            yield self.idx[s:s + batch_size], None, self.doc[s:s + batch_size]

    def describe(self) -> dict:
        T = self.idx.shape[1]
        by_domain: dict[str, int] = {}
        by_source: dict[str, int] = {}
        for s, d in zip(self.sources, self.domains):
            by_domain[d] = by_domain.get(d, 0) + T
            by_source[s] = by_source.get(s, 0) + T
        return {"tokens": int(self.idx.numel()), "contexts": int(self.idx.shape[0]), "block_size": T,
                "units": len(set(self.units)), "domains": sorted(by_domain), "tokens_by_domain": by_domain,
                "tokens_by_source": by_source}


def held_out_sample(data, tokens: int, block_size: int) -> Sample:
    """About `tokens` validation tokens in contexts of block_size: the same number of contexts from every
    domain present, spread round-robin over each domain's sources (a short source passes its share on),
    each source's contexts in stream order from its start. Units: contexts of one source that share a
    document (one cut by a context boundary) form one unit."""
    if tokens < block_size or block_size < 2:
        raise ValueError(f"held_out_sample: need tokens >= block_size >= 2, got tokens={tokens}, "
                         f"block_size={block_size}")
    domains = sorted({data.domains[s] for s in data.sources})
    if not domains:
        raise ValueError("held_out_sample: the dataset has no validation sources")
    per_domain = max(1, tokens // (len(domains) * block_size))
    idx, doc, units, srcs, doms = [], [], [], [], []
    for d in domains:
        sources = [s for s in data.sources if data.domains[s] == d]
        lengths = {s: np.asarray(data.val_doc_lengths(s)) for s in sources}
        avail = {s: max(0, (int(lengths[s].sum()) - 1) // block_size) for s in sources}
        alloc, want = dict.fromkeys(sources, 0), per_domain
        while want > 0 and any(alloc[s] < avail[s] for s in sources):
            for s in sources:
                if want > 0 and alloc[s] < avail[s]:
                    alloc[s] += 1
                    want -= 1
        for s in sources:
            n = alloc[s]
            if n == 0:
                continue
            x, _, dd = next(iter(data.val_batches(s, n, block_size, n * block_size)))[:3]
            starts = set(np.concatenate([[0], np.cumsum(lengths[s])[:-1]]).tolist())
            group = 0
            for j in range(x.shape[0]):
                if j > 0 and j * block_size in starts:               # a document starts exactly here
                    group += 1
                units.append((s, group))
            idx.append(x)
            doc.append(dd)
            srcs += [s] * x.shape[0]
            doms += [d] * x.shape[0]
    if not idx:
        raise ValueError(f"held_out_sample: no source has a full {block_size}-token validation context")
    return Sample(torch.cat(idx), torch.cat(doc), units, srcs, doms)


# ----------------------------------------------------------------------------------------
# Dyck case study (Sec. 6.4, Fig. 27)

@contextmanager
def ablate_head(model, layer: int, head: int):
    """Zero head `head`'s slice of PV before W_O in physical layer `layer` (every visit: weights are shared)."""
    attn = model.blocks[layer].attn
    H, hd = attn.n_head, attn.hd
    if not 0 <= head < H:
        raise ValueError(f"ablate_head: head must be in [0, {H}), got {head}")

    def hook(_module, args):
        y = args[0].clone()
        y[..., head * hd:(head + 1) * hd] = 0
        return (y, *args[1:])

    handle = attn.wo.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _char_spans_to_tokens(enc, tokens: list[int], text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Indices of tokens whose characters overlap any [start, end) span of text (tokens decode to text)."""
    decoded, offsets = enc.decode_with_offsets(tokens)
    if decoded != text:
        raise ValueError("dyck prompt does not round-trip through the tokenizer")
    ends = offsets[1:] + [len(decoded)]
    return [i for i, (a, b) in enumerate(zip(offsets, ends)) if any(a < e and s < b for s, e in spans)]


def dyck_prompts(enc, block_size: int, ks: Sequence[int] = DYCK_KS, n_items: int = 8, n_targets: int = 3,
                 seed: int = 0, task=None) -> dict:
    """Few-shot BIG-bench dyck_languages prompts (tasks.build_prompt) at every k, nested across k.

    Returns {"prompts": [{"k", "item", "tokens", "targets" (positions whose next token is one of the gold
    answer's closing brackets), "answer" (those bracket tokens; a tokenizer may also give the answer
    space tokens, which are not targets), "demo" (positions of demonstration-answer tokens)}],
    "ks": the k values used, "skipped_k": those that cannot fit block_size}.
    """
    import tasks as ev   # build_prompt, load_bigbench
    task = task or ev.load_bigbench("dyck_languages")
    encode = getattr(enc, "encode_ordinary", None) or enc.encode
    items = task.items
    if not ks or min(ks) < 1:
        raise ValueError(f"dyck_prompts: ks must be k >= 1 demonstrations, got {ks}")
    length = [len(encode(it.query + it.answer + it.sep)) for it in items]
    pool = sorted(range(len(items)), key=lambda j: (length[j], j))[:max(4 * max(ks), len(items) // 4)]
    prefix = len(encode(items[0].prefix)) + 1
    room = block_size - prefix - n_targets - min(length)
    used_ks = [k for k in ks if k * min(length[j] for j in pool) <= room]
    out = {"ks": used_ks, "skipped_k": [k for k in ks if k not in used_ks], "n_targets": n_targets,
           "block_size": block_size, "prompts": []}
    cands = [j for j in range(len(items)) if len(items[j].answer.split()) == n_targets]
    while used_ks and not out["prompts"]:                            # drop the largest k until prompts fit
        out["prompts"] = _dyck_build(enc, ev, items, cands, pool, used_ks, n_items, n_targets, block_size, seed)
        if not out["prompts"]:
            out["skipped_k"].append(used_ks.pop())
    out["ks"], out["skipped_k"] = used_ks, sorted(out["skipped_k"])
    return out


def _dyck_build(enc, ev, items, cands, pool, used_ks, n_items, n_targets, block_size, seed) -> list[dict]:
    """dyck_prompts' search: up to n_items query items whose prompts fit at every k in used_ks."""
    encode = getattr(enc, "encode_ordinary", None) or enc.encode
    bos, out, done = enc.eot_token, [], 0
    rng = random.Random(f"probes/dyck/{seed}")
    for qi in rng.sample(cands, len(cands)):
        if done == n_items:
            break
        item, need = items[qi], set(items[qi].answer.split())
        firsts = [j for j in pool if j != qi and need <= set(items[j].answer.split())]
        rest = [j for j in pool if j != qi]
        if not firsts or len(rest) < max(used_ks):
            continue
        first = rng.choice(firsts)
        demos = [first] + rng.sample([j for j in rest if j != first], max(used_ks) - 1)
        prompts = []
        for k in used_ks:
            shown = [items[j] for j in demos[:k]]
            ctx, conts = ev.build_prompt(item, shown)
            body, cont = encode(ctx), encode(conts[0])
            sym = [i for i, t in enumerate(cont) if enc.decode([t]).strip() in CLOSERS]   # the closing brackets
            if len(sym) != n_targets or 1 + len(body) + len(cont) > block_size:
                break
            spans, cur = [], 0
            for d in shown:                                          # each demonstration's answer characters
                at = ctx.find(d.query + d.answer, cur)
                if at < 0:
                    raise ValueError("tasks.build_prompt did not lay demonstrations out as query + answer")
                s = at + len(d.query)
                spans.append((s, s + len(d.answer)))
                cur = s + len(d.answer)
            demo = [1 + i for i in _char_spans_to_tokens(enc, body, ctx, spans)]
            prompts.append({"k": k, "item": qi, "tokens": [bos] + body + cont,
                            "targets": [len(body) + i for i in sym], "answer": [cont[i] for i in sym], "demo": demo})
        if len(prompts) == len(used_ks):
            out += prompts
            done += 1
    return out


def _target_loss(logits: Tensor, prompts: list[dict]) -> Tensor:
    """Cross-entropy of every prompt's gold answer tokens at its target positions -> (n_prompts, n_targets)."""
    return torch.stack([F.cross_entropy(logits[i, p["targets"]].float(), torch.tensor(p["answer"], device=logits.device),
                                        reduction="none") for i, p in enumerate(prompts)])


@torch.no_grad()
def dyck_case_study(model, enc, block_size: int | None = None, ks: Sequence[int] = DYCK_KS, n_items: int = 8,
                    seed: int = 0, prompts: dict | None = None, select_k: int | None = 4) -> dict:
    """SMELT Sec. 6.4 on one model: the Dyck head by ablation, then its BOS and demonstration-answer mass per visit.

    For every head of the looped span (every layer if the model is unlooped) the selection prompts
    (those at k = select_k, the paper's Fig. 27 setting, or the largest k below it; None: every
    prompt) run with that head ablated; its effect is the rise of their mean target cross-entropy.
    The head with the largest effect is the Dyck head. At each of the n_targets answer positions of
    every prompt (every k), its attention splits into BOS (position 0), demonstration-answer tokens
    and everything else, per visit. (Selecting on one k keeps the sweep to one forward of n_items
    prompts per head: on the tiny preset's largest SMELT model it took 9 of the pair's 10 CPU
    seconds when every k's prompts ran per head.)
    """
    cfg = model.cfg
    block = block_size or cfg.block_size
    P = prompts or dyck_prompts(enc, block, ks, n_items, seed=seed)
    out = {"ks": P["ks"], "skipped_k": P["skipped_k"], "n_prompts": len(P["prompts"])}
    if not P["prompts"]:
        return {**out, "error": f"no Dyck prompt fits block_size {block}"}
    prompts = P["prompts"]
    device = next(model.parameters()).device
    T = max(len(p["tokens"]) for p in prompts)
    x = torch.full((len(prompts), T), enc.eot_token, dtype=torch.long)
    for i, p in enumerate(prompts):
        x[i, :len(p["tokens"])] = torch.tensor(p["tokens"])
    x = x.to(device)
    was_training = model.training
    model.eval()
    capture: dict = {}
    logits = model.run(x, capture=capture).logits
    clean = _target_loss(logits, prompts)                            # (n, n_targets)
    sel_k = None if select_k is None else max([k for k in P["ks"] if k <= select_k] or P["ks"][:1])
    sel = [i for i, p in enumerate(prompts) if sel_k is None or p["k"] == sel_k]
    xs = x[sel, :max(len(prompts[i]["tokens"]) for i in sel)]
    lc = cfg.loop
    layers = list(range(lc.start, lc.start + lc.length)) if lc.active else list(range(cfg.n_layer))
    effect = []
    for layer in layers:
        row = []
        for h in range(cfg.n_head):
            with ablate_head(model, layer, h):
                ablated = _target_loss(model.run(xs).logits, [prompts[i] for i in sel])
            row.append(float(ablated.mean() - clean[sel].mean()))
        effect.append(row)
    model.train(was_training)
    E = torch.tensor(effect)
    li, hi = divmod(int(E.argmax()), cfg.n_head)
    layer, head = layers[li], hi
    visits = sorted(v.visit for v in model.plan if v.layer == layer)
    masses = {"bos": [], "demo": [], "other": []}                    # (n_prompts, n_visits), target-averaged
    for i, p in enumerate(prompts):
        L = len(p["tokens"])
        demo = torch.zeros(L, dtype=torch.bool)
        demo[p["demo"]] = True
        rest = ~demo
        rest[0] = False
        rows = {k: [] for k in masses}
        for v in visits:
            a = capture[(layer, v)]["attn_probs"][i, head][p["targets"], :L].float().cpu()   # (n_targets, L)
            rows["bos"].append(float(a[:, 0].mean()))
            rows["demo"].append(float(a[:, demo].sum(-1).mean()))
            rows["other"].append(float(a[:, rest].sum(-1).mean()))
        for k in masses:
            masses[k].append(rows[k])
    correct = [bool((logits[i, p["targets"]].argmax(-1).cpu() == torch.tensor(p["answer"])).all())
               for i, p in enumerate(prompts)]
    by_k = {}
    for k in P["ks"]:
        at = [i for i, p in enumerate(prompts) if p["k"] == k]
        by_k[str(k)] = {"n": len(at), "accuracy": sum(correct[i] for i in at) / len(at),
                        "target_loss": float(clean[at].mean()),
                        **{f"{m}_mass": [sum(masses[m][i][j] for i in at) / len(at) for j in range(len(visits))]
                           for m in masses}}
    ex_k = max([k for k in P["ks"] if k <= 4] or P["ks"][:1])        # Fig. 27 shows a k = 4 prompt
    ex = next(i for i, p in enumerate(prompts) if p["k"] == ex_k)
    L = len(prompts[ex]["tokens"])
    example = {"k": ex_k, "tokens": [enc.decode([t]) for t in prompts[ex]["tokens"]], "targets": prompts[ex]["targets"],
               "demo": prompts[ex]["demo"],
               "attention": [capture[(layer, v)]["attn_probs"][ex, head][prompts[ex]["targets"], :L].float().cpu().tolist()
                             for v in visits]}
    return {**out, "layers": layers, "ablation_effect": effect, "selection_k": sel_k,
            "clean_loss": float(clean.mean()), "selection_loss": float(clean[sel].mean()),
            "head": {"layer": layer, "head": head, "effect": float(E.max())}, "visits": [v + 1 for v in visits],
            "prompt_keys": [[p["k"], p["item"]] for p in prompts], "mass": masses, "correct": correct,
            "by_k": by_k, "example": example}


# ----------------------------------------------------------------------------------------
# Every matched pair on one held-out sample

def _load(model_or_path, device):
    if isinstance(model_or_path, (str, os.PathLike)):
        from eval import load_model   # one loader for run directories and endpoint files
        return load_model(model_or_path, device)[0]
    return model_or_path


def probe_pairs(pairs: Sequence[tuple], data, tokens: int, block_size: int, batch_size: int = 8,
                dyck: bool = True, dyck_items: int = 8, dyck_ks: Sequence[int] = DYCK_KS,
                dyck_block_size: int | None = None, seed: int = 0,
                attn_topk: Sequence[int] = (1, 8), device: str | None = None, n_draws: int = 1000,
                log: Callable[[str], None] | None = print) -> dict:
    """SMELT Section 6 on every matched pair: [(name, baseline, smelt)], each model a GPT or a run directory /
    endpoint file (loaded one at a time). All models see one held-out sample (`held_out_sample`: about
    `tokens` tokens, every domain equally) in contexts of block_size (the training context); the SMELT
    model of each pair also runs the Dyck case study (prompts from data.tokenizer() that fit
    block_size, or dyck_block_size if given: a k whose prompts do not fit is reported in "skipped_k",
    never truncated).

    Returns a JSON-able dict: "sample" (what was probed), "pairs" {name: {"baseline", "smelt" (probe
    results), "dyck", "seconds"}}, "aggregate" (each summary quantity averaged over pairs), "claims"
    (`claims(result)` as JSON), "pair_intervals" (Fig. 23's quantities per pair, as JSON) and
    "seconds". Pass the result to `claims` (for stats.Interval objects) and `plot_pairs`.
    """
    if not pairs:
        raise ValueError("probe_pairs: no pairs given")
    names = [p[0] for p in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"probe_pairs: pair names must be unique, got {names}")
    log = log or (lambda m: None)
    t0 = time.time()
    sample = held_out_sample(data, tokens, block_size)
    desc = sample.describe()
    log(f"probes: {len(pairs)} pairs on {desc['tokens']} held-out tokens ({desc['contexts']} contexts, "
        f"{desc['units']} document groups, domains {', '.join(desc['domains'])})")
    enc = data.tokenizer() if dyck else None
    out: dict = {"sample": desc, "pairs": {}, "order": names}
    prompts_cache: dict[int, dict] = {}
    for i, (name, base, smelt) in enumerate(pairs):
        t1 = time.time()
        entry: dict = {}
        for arch, m in (("baseline", base), ("smelt", smelt)):
            model = _load(m, device or ("cuda" if torch.cuda.is_available() else "cpu"))
            entry[arch] = probe(model, sample.batches(batch_size), attn_topk=attn_topk, units=sample.units)
            if arch == "smelt" and dyck:
                blk = min(model.cfg.block_size, dyck_block_size or block_size)   # no unseen distances
                if blk not in prompts_cache:
                    prompts_cache[blk] = dyck_prompts(enc, blk, dyck_ks, dyck_items, seed=seed)
                entry["dyck"] = dyck_case_study(model, enc, prompts=prompts_cache[blk])
            del model
        entry["seconds"] = round(time.time() - t1, 2)
        out["pairs"][name] = entry
        s = entry["smelt"]["summary"]
        log(f"probes {i + 1}/{len(pairs)} {name}: update ratio {_f(s.get('ratio_update'))}, top-8 overlap "
            f"{_f(s.get('attn_top8'))} (control {_f(s.get('attn_top8_control'))}), sink in span "
            f"{_f(s.get('sink_mass_span_v1'))} -> {_f(s.get('sink_mass_span_v2'))} ({entry['seconds']:.1f}s, "
            f"eta {(time.time() - t0) / (i + 1) * (len(pairs) - i - 1):.0f}s)")
    out["aggregate"] = aggregate(out)
    cells = _cells(out)                                              # shared: every bootstrap draws the same units
    out["claims"] = [claim_json(c) for c in claims(out, n_draws, seed, _cells_of=cells)]
    out["pair_intervals"] = {q: {n: iv.to_dict() for n, iv in pair_intervals(out, q, n_draws, seed, cells).items()}
                             for q, *_ in GRID}
    out["n_draws"] = n_draws
    out["seconds"] = round(time.time() - t0, 2)
    log(f"probes: done in {out['seconds']:.0f}s")
    return out


def _f(x, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def aggregate(result: dict) -> dict:
    """Each numeric summary quantity of the SMELT and Baseline models, averaged over pairs (point estimates)."""
    out = {}
    for arch in ("smelt", "baseline"):
        keys = {k for e in result["pairs"].values() for k, v in e[arch]["summary"].items() if isinstance(v, float)}
        for k in sorted(keys):
            xs = [e[arch]["summary"].get(k) for e in result["pairs"].values()]
            xs = [x for x in xs if x is not None]
            out[f"{arch}/{k}"] = sum(xs) / len(xs) if xs else None
    return out


# ----------------------------------------------------------------------------------------
# Quantities with intervals (units: held-out document groups, the same for every pair)

def _ratio(m) -> float:
    """Mean over layers of visit-2 / visit-1 token-averaged norm: m (layers, 2)."""
    return float((m[:, 1] / m[:, 0]).sum()) / len(m)


def _mean(m) -> float:
    return float(m.sum()) / m.size


# name -> (the unit quantities it reads, function of their per-layer means and the model's meta)
QUANTITIES: dict[str, tuple[tuple[str, ...], Callable]] = {
    **{f"ratio_{r}": ((f"ratio_{r}",), lambda m, _: _ratio(m)) for r in RATIOS},
    "ratio_norm": (("ratio_attn_norm", "ratio_mlp_norm"), lambda a, m, _: (_ratio(a) + _ratio(m)) / 2),
    "ucos_same": (("ucos_same",), lambda m, _: _mean(m)),
    "ucos_other": (("ucos_other",), lambda m, _: _mean(m)),
    "ucos_gap": (("ucos_same", "ucos_other"), lambda a, b, _: _mean(a) - _mean(b)),
    **{f"cos_{s}": ((f"cos_{s}",), lambda m, _: _mean(m)) for s in ["update", *STAGES]},
    "cos_Q_minus_V": (("cos_Q", "cos_V"), lambda a, b, _: _mean(a) - _mean(b)),
    "cos_K_minus_V": (("cos_K", "cos_V"), lambda a, b, _: _mean(a) - _mean(b)),
    **{f"{a}_{side}": ((f"{a}_{side}",), lambda m, _: _mean(m)) for a in ("top1", "top8", "mass")
       for side in ("same", "control")},
    **{f"{a}_gap": ((f"{a}_same", f"{a}_control"), lambda x, y, _: _mean(x) - _mean(y)) for a in ("top1", "top8", "mass")},
    "expert_frac": (("expert_overlap",), lambda m, meta: _mean(m) / meta["top_k"]),
    "expert_random_frac": (("expert_overlap",), lambda m, meta: meta["top_k"] / meta["n_experts"]),
    "expert_gap": (("expert_overlap",), lambda m, meta: _mean(m) - meta["top_k"] ** 2 / meta["n_experts"]),
    "sink_v1": (("sink",), lambda m, _: _mean(m[:, 0])),
    "sink_v2": (("sink",), lambda m, _: _mean(m[:, 1])),
    "sink_change": (("sink",), lambda m, _: _mean(m[:, 1] - m[:, 0])),
}


class _Cell:
    """One SMELT result's per-unit sums, each quantity a (units, values + 1 count) matrix, for fast bootstrap draws."""

    def __init__(self, res: dict, keys: list | None = None):
        u = res["units"]
        own = [tuple(k) if isinstance(k, list) else k for k in u["keys"]]
        order = list(range(len(own)))
        if keys is not None:
            pos = {k: i for i, k in enumerate(own)}
            if set(pos) != set(keys):
                raise ValueError("probe results of different pairs were not taken on the same held-out units")
            order = [pos[k] for k in keys]
        self.keys = [own[i] for i in order]
        self.cols: dict[str, tuple[np.ndarray, tuple]] = {}
        for name, q in u["quantities"].items():
            s = np.asarray(q["sum"], dtype=float)[order]
            count = np.asarray(q["count"], dtype=float)[order][:, None]
            self.cols[name] = (np.concatenate([s.reshape(len(order), -1), count], 1), s.shape[1:])
        cfg = res.get("config", {})
        self.meta = {"top_k": cfg.get("top_k", 0) if cfg.get("n_experts") else 0, "n_experts": cfg.get("n_experts", 0)}
        self._memo: dict = {}   # every bootstrap uses the same seed, hence the same draws: compute each once

    def value(self, name: str, w: np.ndarray | None = None) -> float | None:
        """Quantity `name` on units weighted by w (bootstrap multiplicities; None: every unit once);
        None when the model does not have it (no experts, one head, no loop)."""
        key = (name, None if w is None else w.tobytes())
        if key in self._memo:
            return self._memo[key]
        deps, fn = QUANTITIES[name]
        if any(d not in self.cols for d in deps) or (deps == ("expert_overlap",) and not self.meta["top_k"]):
            out = None
        else:
            means = []
            for d in deps:
                M, shape = self.cols[d]
                v = M.sum(0) if w is None else w @ M
                means.append(v[:-1].reshape(shape) / max(v[-1], EPS))
            out = fn(*means, self.meta)
        self._memo[key] = out
        return out


def _cells(result: dict) -> tuple[list[str], list[_Cell]]:
    names = result.get("order") or list(result["pairs"])
    cells, keys = [], None
    for n in names:
        c = _Cell(result["pairs"][n]["smelt"], keys)
        keys = keys or c.keys
        cells.append(c)
    return names, cells


def _interval(n_units: int, stat: Callable[[np.ndarray | None], float], n_draws: int, seed: int) -> stats.Interval:
    """stats.bootstrap_interval over units: stat gets the multiplicity of each unit in a draw."""
    iv = stats.bootstrap_interval(np.arange(n_units), lambda a: stat(np.bincount(a.astype(int), minlength=n_units)),
                                  n_draws=n_draws, seed=seed)
    return stats.Interval(stat(None), iv.lo, iv.hi, iv.n, iv.level, "bootstrap over held-out document groups")


def pair_intervals(result: dict, quantity: str, n_draws: int = 1000, seed: int = 0,
                   _cells_of: tuple | None = None) -> dict[str, stats.Interval]:
    """{pair name: Interval of `quantity` on its SMELT model} (pairs that lack the quantity are left out)."""
    names, cells = _cells_of or _cells(result)
    out = {}
    for n, c in zip(names, cells):
        if c.value(quantity) is not None:
            out[n] = _interval(len(c.keys), lambda w, c=c: c.value(quantity, w), n_draws, seed)
    return out


# (id, quantity, direction, value, figure, what, the paper's figure) -- SMELT Section 6 in order
CLAIMS = [
    ("update_ratio", "ratio_update", ">", 1.0, "Fig. 23e", "visit-2 / visit-1 norm of the full update Δx",
     "1.2-3.5x, > 1 in all 16 cells"),
    ("attn_write_ratio", "ratio_attn_write", ">", 1.0, "Fig. 23f", "visit-2 / visit-1 norm of the attention write",
     "> 1 in all 16 cells"),
    ("moe_write_ratio", "ratio_mlp_write", ">", 1.0, "Fig. 23g", "visit-2 / visit-1 norm of the MoE write",
     "> 1 in all 16 cells"),
    ("norm_ratio", "ratio_norm", ">", 1.0, "Fig. 23h", "visit-2 / visit-1 norm of the RMSNorm outputs",
     "> 1 in all 16 cells"),
    ("update_cosine", "ucos_gap", ">", 0.0, "Fig. 24",
     "update cosine: same layer across visits minus non-matching cross-visit pairs", "0.56 vs 0.16 (1.6B)"),
    ("q_stabler_than_v", "cos_Q_minus_V", ">", 0.0, "Fig. 25", "cross-visit cosine of Q minus that of V",
     "Q 0.89-0.93 vs V 0.65-0.74"),
    ("k_stabler_than_v", "cos_K_minus_V", ">", 0.0, "Fig. 25", "cross-visit cosine of K minus that of V",
     "K 0.89-0.93 vs V 0.65-0.74"),
    ("top8_overlap", "top8_gap", ">", 0.0, "Fig. 26b",
     "top-8 attended-token overlap across visits minus the other-head control", "0.56-0.66 vs 0.28-0.34"),
    ("expert_overlap", "expert_gap", ">", 0.0, "Fig. 21",
     "experts shared between visits minus random routing (k^2/n)", "2-3 of 8 at S~97 %, far above random"),
    ("sink_shrinks", "sink_change", "<", 0.0, "Fig. 28/30, App. D",
     "attention-sink mass in the looped span, visit 2 minus visit 1", "visit 2 below visit 1 throughout the span"),
]
PARTS = {"ucos_gap": ("ucos_same", "ucos_other"), "cos_Q_minus_V": ("cos_Q", "cos_V"),
         "cos_K_minus_V": ("cos_K", "cos_V"), "top8_gap": ("top8_same", "top8_control"),
         "expert_gap": ("expert_frac", "expert_random_frac"), "sink_change": ("sink_v1", "sink_v2")}
DYCK_CLAIMS = [
    ("dyck_bos_falls", "bos", "<", 0.0, "Fig. 27", "Dyck head's BOS mass at the targets, visit 2 minus visit 1",
     "0.60 -> 0.02 (1.6B, k = 4)"),
    ("dyck_demo_rises", "demo", ">", 0.0, "Fig. 27",
     "Dyck head's demonstration-answer mass at the targets, visit 2 minus visit 1", "0.24 -> 0.85 (1.6B, k = 4)"),
]


def claims(result: dict, n_draws: int = 1000, seed: int = 0, _cells_of: tuple | None = None) -> list[dict]:
    """Section 6's claims on a `probe_pairs` result, each a paired quantity with intervals.

    Each dict: id, figure, what, paper, direction ('>' | '<') and value (the claim is "quantity
    direction value"), interval (stats.Interval of the quantity averaged over pairs, bootstrap over
    held-out document groups resampled jointly for all pairs; prompts for Dyck), per_pair
    {name: Interval}, weakest (Interval of the least favourable pair: "in every cell"),
    across_pairs (t-interval over the pairs' point estimates), parts (the two sides, averaged over
    pairs), unit, and verdict = stats.verdict(interval, direction, value). Quantities no pair has
    (a dense pair has no expert overlap) give interval None: not resolved.
    """
    names, cells = _cells_of or _cells(result)
    U = len(cells[0].keys) if cells else 0
    out = []
    for cid, q, sign, value, fig, what, paper in CLAIMS:
        have = [(n, c) for n, c in zip(names, cells) if c.value(q) is not None]
        d = {"id": cid, "quantity": q, "figure": fig, "what": what, "paper": paper, "direction": sign,
             "value": value, "unit": f"held-out document groups (n = {U}), resampled jointly for all pairs",
             "pairs": [n for n, _ in have]}
        if have:
            pick = min if sign == ">" else max
            d["interval"] = _interval(U, lambda w: float(np.mean([c.value(q, w) for _, c in have])), n_draws, seed)
            d["weakest"] = _interval(U, lambda w: float(pick([c.value(q, w) for _, c in have])), n_draws, seed)
            d["per_pair"] = {n: _interval(U, lambda w, c=c: c.value(q, w), n_draws, seed) for n, c in have}
            d["across_pairs"] = stats.mean_interval([c.value(q) for _, c in have])
            d["parts"] = {p: float(np.mean([c.value(p) for _, c in have])) for p in PARTS.get(q, ())}
        else:
            d.update(interval=None, weakest=None, per_pair={}, across_pairs=None, parts={})
        d["verdict"] = stats.verdict(d["interval"], sign, value)
        out.append(d)
    out += _dyck_claims(result, n_draws, seed)
    return out


def _dyck_claims(result: dict, n_draws: int, seed: int) -> list[dict]:
    """Visit-2 minus visit-1 mass of each pair's Dyck head, per prompt (the unit), averaged over pairs."""
    dy = {n: e["dyck"] for n, e in result["pairs"].items() if e.get("dyck", {}).get("mass")
          and len(e["dyck"]["visits"]) >= 2}
    out = []
    for cid, m, sign, value, fig, what, paper in DYCK_CLAIMS:
        d = {"id": cid, "quantity": f"dyck_{m}_change", "figure": fig, "what": what, "paper": paper,
             "direction": sign, "value": value, "pairs": list(dy), "interval": None, "weakest": None,
             "per_pair": {}, "across_pairs": None, "parts": {}}
        if dy:
            keys = [tuple(k) for k in next(iter(dy.values()))["prompt_keys"]]
            if any([tuple(k) for k in v["prompt_keys"]] != keys for v in dy.values()):
                raise ValueError("Dyck case studies of different pairs used different prompts")
            M = np.array([v["mass"][m] for v in dy.values()])[:, :, :2]   # (pairs, prompts, visits 1-2)
            diff = M[:, :, 1] - M[:, :, 0]
            d["unit"] = f"Dyck prompts (n = {len(keys)}: items x k)"
            d["interval"] = _interval(len(keys), lambda w: float(diff.mean(0) @ w / w.sum()) if w is not None
                                      else float(diff.mean()), n_draws, seed)
            pick = np.min if sign == ">" else np.max
            d["weakest"] = _interval(len(keys), lambda w: float(pick(diff @ w / w.sum())) if w is not None
                                     else float(pick(diff.mean(1))), n_draws, seed)
            d["per_pair"] = {n: _interval(len(keys), lambda w, i=i: float(diff[i] @ w / w.sum()) if w is not None
                                          else float(diff[i].mean()), n_draws, seed) for i, n in enumerate(dy)}
            d["across_pairs"] = stats.mean_interval(diff.mean(1))
            d["parts"] = {"visit 1": float(M[:, :, 0].mean()), "visit 2": float(M[:, :, 1].mean())}
        d["verdict"] = stats.verdict(d["interval"], sign, value)
        out.append(d)
    return out


def claim_json(c: dict) -> dict:
    """A claim with its Intervals as dicts (for probes.json)."""
    iv = lambda x: None if x is None else x.to_dict()
    return {**c, "interval": iv(c["interval"]), "weakest": iv(c["weakest"]), "across_pairs": iv(c["across_pairs"]),
            "per_pair": {n: iv(x) for n, x in c["per_pair"].items()}}


# ----------------------------------------------------------------------------------------
# Figures (matplotlib Agg). Visits are numbered 1 and 2; layers outside the span are "unlooped".

VISIT_COLORS = ["tab:blue", "tab:red", "tab:green", "tab:purple"]


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str, paths: list[str] | None = None, tight: bool = True) -> str:
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    if paths is not None:
        paths.append(path)
    return path


def _n_visits(result: dict) -> int:
    return max((d["visit"] for d in result["per_visit"].values()), default=1)


def _looped_series(result: dict, key: str, visit: int) -> list[float | None]:
    return [result["per_visit"].get(label(l, visit), {}).get(key) for l in result["looped_layers"]]


def _nan(xs):
    return [float("nan") if x is None else x for x in xs]


def _heat(ax, grid, cmap: str, symmetric: bool = False, annotate: bool = True, vmin=None, vmax=None):
    """imshow on a colour scale fitted to the data (symmetric about 0 for differences), values written in."""
    a = np.asarray(grid, dtype=float)
    finite = a[np.isfinite(a)]
    if vmin is None or vmax is None:
        if symmetric:
            m = float(np.abs(finite).max()) if finite.size else 1.0
            vmin, vmax = -(m or 1.0), (m or 1.0)
        else:
            lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
            vmin, vmax = lo, (hi if hi > lo else lo + 1e-6)
    im = ax.imshow(a, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    if annotate and a.size <= 120:
        mid = (vmin + vmax) / 2
        for (i, j), v in np.ndenumerate(a):
            if np.isfinite(v):
                dark = v < mid if not symmetric else abs(v) > 0.6 * vmax
                ax.text(j, i, f"{v:+.2g}" if symmetric else f"{v:.2g}", ha="center", va="center",
                        fontsize=6, color="white" if dark else "black")
    return im


def plot_probes(result: dict, out_dir: str, baseline: dict | None = None, title: str = "") -> list[str]:
    """One figure per SMELT figure the result supports (one looped model, its Baseline beside it)."""
    plt, paths = _plt(), []
    os.makedirs(out_dir, exist_ok=True)
    cross, layers = result["cross_visit"], result["looped_layers"]
    n_visits, tag = _n_visits(result), f" {title}" if title else ""
    hists = [d["expert_overlap"] for d in cross.values() if "expert_overlap" in d]
    if hists:                                                        # Fig. 21
        k = hists[0]["k"]
        dist = [sum(h["distribution"][j] for h in hists) / len(hists) for j in range(k + 1)]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(range(k + 1), dist, color="tab:blue", label="visit 1 vs visit 2 (looped layers)")
        ax.plot(range(k + 1), hists[0]["random_distribution"], "o", color="grey", label="random routing")
        ax.axvline(hists[0]["random_mean"], ls="--", color="purple",
                   label=f"random mean k²/n = {hists[0]['random_mean']:.2f}")
        ax.set(xlabel="|S1 ∩ S2| (experts shared)", ylabel="fraction of tokens", xticks=range(k + 1),
               ylim=(0, 1.3 * max(dist + hists[0]["random_distribution"])), title=f"Expert-set overlap (Fig. 21){tag}")
        ax.legend(fontsize=7, loc="upper left")
        _save(fig, os.path.join(out_dir, "fig21_expert_overlap.png"), paths)
    if layers:                                                       # Fig. 22
        fig, axes = plt.subplots(3, 1, figsize=(5, 7), sharex=True)
        for ax, key, name in zip(axes, ("x_rms", "update_rms", "relative_update"),
                                 ("residual RMS", "update RMS", "||Δx|| / ||x||")):
            for v in range(1, n_visits + 1):
                ax.plot(layers, _nan(_looped_series(result, key, v)), "o-", color=VISIT_COLORS[v - 1],
                        label=f"visit {v}")
            ax.set_ylabel(name)
        axes[0].legend(fontsize=7)
        axes[0].set_title(f"Residual flow in the looped span (Fig. 22){tag}")
        axes[-1].set(xlabel="physical layer (looped span)", xticks=layers)
        _save(fig, os.path.join(out_dir, "fig22_residual_flow.png"), paths)
    panels = [(baseline, "Baseline")] if baseline else []
    panels.append((result, "SMELT"))                                 # Fig. 24
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.8), squeeze=False)
    offdiag = [abs(x) for res, _ in panels for i, row in enumerate(res["update_cosine"]["matrix"] or [])
               for j, x in enumerate(row) if i != j]
    m = max(offdiag, default=1.0) or 1.0
    for ax, (res, name) in zip(axes[0], panels):
        M, labels = res["update_cosine"]["matrix"], res["update_cosine"]["labels"]
        im = _heat(ax, M, "RdBu_r", vmin=-m, vmax=m, symmetric=True, annotate=len(labels) <= 10)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        span = [i for i, lab in enumerate(labels) if res["per_visit"][lab]["looped"]]
        for edge in ([span[0] - 0.5, span[-1] + 0.5] if span else []):
            ax.axhline(edge, ls="--", color="k", lw=0.8)
            ax.axvline(edge, ls="--", color="k", lw=0.8)
        ax.set_title(f"{name}: update cosine (execution order)", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label=f"cosine (scale ±{m:.2f}, diagonal = 1)")
    fig.suptitle(f"Residual-update cosine (Fig. 24){tag}", fontsize=9)
    _save(fig, os.path.join(out_dir, "fig24_update_cosine.png"), paths, tight=False)
    if cross:                                                        # Fig. 25
        stages = list(STAGES)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for d in cross.values():
            ax.plot(stages, _nan([d["cosine"][s] for s in stages]), "o-", alpha=0.6, label=f"layer {d['layer']}")
        ax.plot(stages, _nan([result["summary"][f"cos_{s}"] for s in stages]), "k-s", lw=2, label="mean")
        ax.set(ylabel="cosine, visit 1 vs visit 2", title=f"Cross-visit cosine by attention stage (Fig. 25){tag}")
        ax.legend(fontsize=6)
        _save(fig, os.path.join(out_dir, "fig25_cross_visit_cosines.png"), paths)
    if cross and any(d["attention"].get("mass") is not None for d in cross.values()):   # Fig. 26
        keys = [f"top{k}" for k in result["attn_topk"]] + ["mass"]
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
        names = list(cross)
        for ax, key in zip(axes[0], keys):
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], _nan([cross[n]["attention"].get(key) for n in names]), 0.4,
                   color="tab:blue", label="same head, visit 1 vs 2")
            ax.bar([x + 0.2 for x in xs], _nan([cross[n]["attention"].get(f"{key}_control") for n in names]), 0.4,
                   color="grey", label="control: head h vs h + H/2, same layer and visit")
            ax.set_xticks(list(xs), [f"layer {cross[n]['layer']}" for n in names], fontsize=7)
            ax.set(ylim=(0, 1.15), title=f"top-{key[3:]} attended-token overlap" if key != "mass"
                   else "attention-mass overlap")
        axes[0][0].legend(fontsize=6)
        fig.suptitle(f"Attended-token overlap (Fig. 26){tag}", fontsize=9)
        _save(fig, os.path.join(out_dir, "fig26_attended_token_overlap.png"), paths)
    if layers and result["per_visit"][label(layers[0], 1)]["sink_mass_per_head"] is not None:   # Fig. 28
        grids = [np.array([_nan(result["per_visit"][label(l, v)]["sink_mass_per_head"]) for l in layers]).T
                 for v in range(1, n_visits + 1)]                   # (heads, looped layers) per visit
        lo, hi = float(min(g.min() for g in grids)), float(max(g.max() for g in grids))
        H = grids[0].shape[0]
        fig, axes = plt.subplots(1, n_visits + 1, figsize=(3.2 * (n_visits + 1) + 1.5, 1.2 + 0.28 * H + 1.2),
                                 squeeze=False, layout="constrained")
        for v, (ax, g) in enumerate(zip(axes[0], grids), 1):
            im = _heat(ax, g, "magma", vmin=lo, vmax=hi if hi > lo else lo + 1e-6)
            ax.set(title=f"visit {v}")
        fig.colorbar(im, ax=axes[0, :n_visits].tolist(), label=f"segment-start mass ({lo:.3f} to {hi:.3f})")
        im = _heat(axes[0, -1], grids[-1] - grids[0], "RdBu_r", symmetric=True)
        axes[0, -1].set(title=f"visit {n_visits} - visit 1")
        fig.colorbar(im, ax=axes[0, -1], label="difference")
        for ax in axes[0]:
            ax.set(xticks=range(len(layers)), xticklabels=layers, xlabel="physical layer (looped span)",
                   yticks=range(H), ylabel="head")
        fig.suptitle(f"Per-head segment-start attention mass (Fig. 28){tag}", fontsize=9)
        _save(fig, os.path.join(out_dir, "fig28_sink_heads.png"), paths, tight=False)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))                       # Fig. 30 / App. D
    _sink_profile(ax, result, baseline)
    ax.set_title(f"Attention-sink mass by depth (Fig. 30){tag}", fontsize=9)
    ax.legend(fontsize=7)
    _save(fig, os.path.join(out_dir, "fig30_attention_sink.png"), paths)
    return paths


def _sink_profile(ax, result: dict, baseline: dict | None) -> None:
    """Baseline over all layers; SMELT's unlooped layers; SMELT's visits 1, 2 over the looped span."""
    if baseline:
        pts = sorted((d["layer"], d["sink_mass"]) for d in baseline["per_visit"].values() if d["sink_mass"] is not None)
        if pts:
            ax.plot(*zip(*pts), "k--", marker="s", ms=4, label="Baseline")
    pv = result["per_visit"].values()
    pts = sorted((d["layer"], d["sink_mass"]) for d in pv if not d["looped"] and d["sink_mass"] is not None)
    if pts:
        ax.plot(*zip(*pts), "o", color="grey", label="SMELT, unlooped layers")
    for v in range(1, _n_visits(result) + 1):
        pts = sorted((d["layer"], d["sink_mass"]) for d in pv if d["looped"] and d["visit"] == v
                     and d["sink_mass"] is not None)
        if pts:
            ax.plot(*zip(*pts), "o-", color=VISIT_COLORS[v - 1], label=f"SMELT visit {v} (looped span)")
    if result["looped_layers"]:
        ax.axvspan(min(result["looped_layers"]) - 0.3, max(result["looped_layers"]) + 0.3, color="0.92", zorder=0)
    ax.set_xticks(sorted({d["layer"] for d in pv}))
    ax.set(xlabel="physical layer", ylabel="attention on segment start")


# Fig. 23: (quantity, its reference, panel title, reference label)
GRID = [("top8_same", "top8_control", "top-8 attended-token overlap", "other-head control"),
        ("mass_same", "mass_control", "attention-mass overlap", "other-head control"),
        ("expert_frac", "expert_random_frac", "expert-set overlap / k", "random routing k/n"),
        ("ucos_same", "ucos_other", "update cosine, same layer", "non-matching cross-visit pairs"),
        ("ratio_update", None, "norm ratio v2/v1: update Δx", None),
        ("ratio_attn_write", None, "norm ratio v2/v1: attention write", None),
        ("ratio_mlp_write", None, "norm ratio v2/v1: MoE write", None),
        ("ratio_norm", None, "norm ratio v2/v1: RMSNorm output", None)]


def plot_grid(result: dict, path: str, n_draws: int = 1000) -> str:
    """Figure 23: eight cross-visit diagnostics, one point per matched pair with its 95 % bootstrap interval
    over held-out document groups; grey: the quantity's reference (control, random routing, 1)."""
    plt = _plt()
    names, cells = _cells(result)
    fig, axes = plt.subplots(2, 4, figsize=(15, 6.5))
    xs = np.arange(len(names))
    stored = result.get("pair_intervals", {}) if result.get("n_draws") == n_draws else {}
    for ax, (key, ref, title), letter in zip(axes.flat, [g[:3] for g in GRID], "abcdefgh"):
        ivs = ({n: stats.Interval(**iv) for n, iv in stored[key].items()} if key in stored
               else pair_intervals(result, key, n_draws, _cells_of=(names, cells)))
        if not ivs:
            ax.text(0.5, 0.5, "not measured\n(no pair has it)", ha="center", va="center", transform=ax.transAxes)
        else:
            x = [i for i, n in enumerate(names) if n in ivs]
            m = np.array([ivs[names[i]].mean for i in x])
            lo = np.array([ivs[names[i]].lo for i in x])
            hi = np.array([ivs[names[i]].hi for i in x])
            ax.errorbar(x, m, yerr=[np.nan_to_num(m - lo), np.nan_to_num(hi - m)], fmt="o", color="tab:red",
                        capsize=3, label="SMELT, visit 2 vs 1")
            if ref:
                r = [cells[i].value(ref) for i in x]
                ax.plot(x, _nan(r), "s", color="grey", label=dict((g[0], g[3]) for g in GRID)[key])
        if key.startswith("ratio"):
            ax.axhline(1.0, ls="--", color="grey", lw=1)
        ax.set_xticks(xs, names, rotation=30, fontsize=7, ha="right")
        ax.set_xlim(-0.5, len(names) - 0.5)
        ax.set_title(f"({letter}) {title}", fontsize=9)
        if ref or not key.startswith("ratio"):
            ax.legend(fontsize=6)
    fig.suptitle("Cross-visit diagnostics per matched pair (SMELT Fig. 23); bars: 95 % intervals over held-out "
                 "document groups", fontsize=10)
    return _save(fig, path)


def plot_sink_profiles(result: dict, path: str) -> str:
    """Appendix D (Fig. 56): the sink profile of every pair, Baseline vs SMELT visits 1 and 2."""
    plt = _plt()
    names = result.get("order") or list(result["pairs"])
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, n in zip(axes.flat, names):
        e = result["pairs"][n]
        _sink_profile(ax, e["smelt"], e["baseline"])
        ax.set_title(n, fontsize=9)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=6)
    fig.suptitle("Attention-sink mass by depth, every pair (SMELT Fig. 30 / App. D)", fontsize=10)
    return _save(fig, path)


def plot_dyck(dyck: dict, path: str, title: str = "") -> str:
    """Fig. 27: the Dyck head's attention at the three targets of a k = 4 prompt on visits 1, 2 and their
    difference (demonstration-answer keys marked), and its BOS / demonstration mass per visit against k."""
    plt = _plt()
    ex = dyck["example"]
    n_keys = max(ex["targets"]) + 1                                  # later keys are masked for every target
    att = [np.array(a)[:, :n_keys] for a in ex["attention"]]
    demo = [j for j in ex["demo"] if j < n_keys]
    nv = len(att)
    fig = plt.figure(figsize=(14, 1.6 * (nv + 1) + 1.2), layout="constrained")
    gs = fig.add_gridspec(nv + 1, 2, width_ratios=[4, 1.2])
    hi = float(max(a.max() for a in att))
    rows = []
    for v, a in enumerate(att):
        ax = fig.add_subplot(gs[v, 0])
        im = ax.imshow(a, cmap="magma", vmin=0, vmax=hi, aspect="auto")
        ax.set_ylabel(f"visit {dyck['visits'][v]}\ntarget", fontsize=7)
        ax.set_yticks(range(len(a)))
        ax.set_xticks([])
        ax.plot(demo, [-0.7] * len(demo), "|", color="orange", ms=6, clip_on=False)
        rows.append(ax)
    fig.colorbar(im, ax=rows, fraction=0.02, pad=0.01, label=f"attention (0 to {hi:.2f})")
    ax = fig.add_subplot(gs[nv, 0])
    d = att[-1] - att[0]
    m = float(np.abs(d).max()) or 1.0
    im = ax.imshow(d, cmap="RdBu_r", vmin=-m, vmax=m, aspect="auto")
    ax.set_ylabel(f"visit {dyck['visits'][-1]}\n- visit 1", fontsize=7)
    ax.set_yticks(range(len(d)))
    ax.set_xticks(range(n_keys), [t.replace("\n", "⏎") for t in ex["tokens"][:n_keys]], rotation=90, fontsize=4)
    ax.plot(demo, [-0.7] * len(demo), "|", color="orange", ms=6, clip_on=False)
    fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01, label="difference")
    ax2 = fig.add_subplot(gs[:, 1])
    ks = [int(k) for k in dyck["by_k"]]
    for v in range(nv):
        ax2.plot(ks, [dyck["by_k"][str(k)]["bos_mass"][v] for k in ks], "o--", color=VISIT_COLORS[v],
                 label=f"BOS, visit {dyck['visits'][v]}", alpha=0.8, ms=7 - 2 * v)
        ax2.plot(ks, [dyck["by_k"][str(k)]["demo_mass"][v] for k in ks], "s-", color=VISIT_COLORS[v],
                 label=f"demo answers, visit {dyck['visits'][v]}", alpha=0.8, ms=7 - 2 * v)
        ax2.plot(ks, [dyck["by_k"][str(k)]["other_mass"][v] for k in ks], "^:", color=VISIT_COLORS[v],
                 label=f"rest of the prompt, visit {dyck['visits'][v]}", alpha=0.8, ms=7 - 2 * v)
    ax2.set(xscale="log", xticks=ks, xticklabels=ks, xlabel="k demonstrations", ylabel="Dyck head's mass at the targets",
            ylim=(0, 1.02))
    ax2.minorticks_off()
    ax2.legend(fontsize=6, loc="center right")
    h = dyck["head"]
    fig.suptitle(f"Dyck head L{h['layer']} head {h['head']} (ablation raises target loss by {h['effect']:+.3f}), "
                 f"k = {ex['k']} example (orange: demonstration answers) (Fig. 27){' ' + title if title else ''}",
                 fontsize=9)
    return _save(fig, path, tight=False)


def plot_pairs(result: dict, out_dir: str, detail: Sequence[str] | None = None, n_draws: int | None = None) -> list[str]:
    """The main job's probe figures: Fig. 23 over all pairs, Appendix D's sink profiles, and the per-pair
    figures (Fig. 21-28, 30, Dyck Fig. 27) for the `detail` pairs (default: the last pair, the largest)."""
    os.makedirs(out_dir, exist_ok=True)
    names = result.get("order") or list(result["pairs"])
    paths = [plot_grid(result, os.path.join(out_dir, "fig23_grid.png"), n_draws or result.get("n_draws", 1000)),
             plot_sink_profiles(result, os.path.join(out_dir, "fig56_sink_profiles.png"))]
    for n in (names[-1:] if detail is None else detail):
        e = result["pairs"][n]
        sub = os.path.join(out_dir, n)
        paths += plot_probes(e["smelt"], sub, baseline=e["baseline"], title=f"({n})")
        if e.get("dyck", {}).get("example"):
            paths.append(plot_dyck(e["dyck"], os.path.join(sub, "fig27_dyck.png"), title=f"({n})"))
    return paths


# ----------------------------------------------------------------------------------------
# CLI

def build_parser() -> argparse.ArgumentParser:
    ap = cli.parser("SMELT Section 6 probes on matched (Baseline, SMELT) pairs.")
    ap.add_argument("--pair", nargs=3, action="append", required=True, metavar=("NAME", "BASELINE", "SMELT"),
                    help="a matched pair: a name and two run directories or endpoint files (repeatable)")
    ap.add_argument("--data-dir", default=None, help="prepared data directory (default: the SMELT run's data_dir)")
    ap.add_argument("--tokens", type=cli.positive_int, default=4096,
                    help="held-out tokens, split equally over the domains")
    ap.add_argument("--block-size", type=cli.nonneg_int, default=0, help="context length (0: the first SMELT model's)")
    ap.add_argument("--batch-size", type=cli.positive_int, default=8,
                    help="probe batch (memory ~ visits x B x heads x T^2 x 4 bytes for attention maps)")
    ap.add_argument("--dyck-items", type=cli.positive_int, default=8, help="Dyck query items (each at every k)")
    ap.add_argument("--no-dyck", action="store_true", help="skip the Dyck case study")
    ap.add_argument("--seed", type=cli.nonneg_int, default=0, help="Dyck prompt seed and bootstrap seed")
    ap.add_argument("--draws", type=cli.positive_int, default=1000, help="bootstrap draws per interval")
    cli.add_device(ap)
    cli.add_out_dir(ap, "output directory (default: probes/ beside the first SMELT run)")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    import data as data_mod
    from eval import load_model
    device = cli.resolve_device(args.device)
    first, meta = load_model(args.pair[0][2], "cpu")
    data_dir = args.data_dir or meta.get("data_dir")
    if not data_dir:
        raise SystemExit("--data-dir is needed: the SMELT run's config.json names no data_dir")
    block = args.block_size or meta.get("train", {}).get("block_size") or first.cfg.block_size
    del first
    out = args.out_dir or os.path.join(os.path.dirname(os.path.normpath(args.pair[0][2])) or ".", "probes")
    os.makedirs(out, exist_ok=True)
    res = probe_pairs([tuple(p) for p in args.pair], data_mod.TokenData(data_dir), args.tokens, block,
                      args.batch_size, dyck=not args.no_dyck, dyck_items=args.dyck_items, seed=args.seed,
                      device=device, n_draws=args.draws)
    res["figures"] = plot_pairs(res, out, n_draws=args.draws)
    with open(os.path.join(out, "probes.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    for c in res["claims"]:
        iv = c["interval"]
        shown = "n/a" if iv is None else stats.Interval(**iv).fmt()
        print(f"{c['id']:18s} {c['direction']} {c['value']:g}: {shown}  {c['verdict']}  (paper: {c['paper']})")
    print(f"wrote {os.path.join(out, 'probes.json')} and {len(res['figures'])} figures", flush=True)
    return res


if __name__ == "__main__":
    main()
