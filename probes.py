"""Probes: what the second visit of a looped layer computes (SMELT Section 6, Appendix D).

One capture pass over held-out tokens (`GPT.run(..., capture={})`) records, for every
(layer, visit) of the execution plan, the residual input x, the RMSNorm outputs, Q/K/V,
the attention probabilities, PV, O, the attention and feed-forward writes and the routed
experts. Each batch is reduced at once into running sums (`ProbeAccumulator`), so memory
does not grow with the number of batches and no T x T map outlives its batch. From those
sums, for a looped checkpoint and its matched Baseline:

  Sec. 6.1, Fig. 21  expert-set overlap |S1 ∩ S2| per token between consecutive visits of
                     a layer (distribution over 0..k) against random routing (k^2 / n).
  Sec. 6.2, Fig. 22  residual RMS ||x||/sqrt(D), update RMS ||Δx||/sqrt(D) (Δx = attention
                     write + feed-forward write, both after the 1/r scale), and ||Δx||/||x||
                     per layer and visit; visit-(v+1)/visit-v norm ratios of the full update,
                     the attention write, the MoE write and the RMSNorm outputs (Fig. 23e-h).
  Sec. 6.2, Fig. 24  token-averaged cosine between residual updates of every pair of visits
                     in flattened execution order; same-layer cross-visit entries against the
                     other cross-visit pairs of the looped span.
  Sec. 6.3, Fig. 25  cross-visit cosines of X = RMSNorm(x) (Eq. 10), Q, K, V, PV (per token
                     and head) and O (per token); also of the raw residual x.
  Sec. 6.3, Fig. 26  top-1 / top-8 attended-token overlap of head h on both visits against
                     the control "head h on visit v vs head (h + H/2) mod H on visit v+1",
                     and the attention-distribution overlap sum_j min(p1_j, p2_j).
  Sec. 6.4, Fig. 28/30, App. D  attention-sink mass: attention a query puts on the first
                     token of its document (segment start), per layer, visit and head.
  Sec. 6.4           Dyck case study (`dyck_case_study`): on seeded balanced bracket
                     strings, the mass each head on each visit puts on the matching opener.

Design choices (where the paper is silent):
  * Metrics are pure functions of tensors; the accumulator only sums and counts them. A
    Baseline is the same code with one visit per layer: sink mass and the update-cosine
    matrix, but no cross-visit metrics.
  * With r > 2 visits, "cross-visit" compares consecutive visits (v, v+1) of each layer.
  * Attention metrics count only queries that have a choice: top-k overlap uses queries
    with more than k visible keys (otherwise both sets are the whole visible prefix), sink
    mass and distribution overlap use queries that are not their document's first token.
  * Norm ratios are ratios of token-averaged norms (a per-token ratio blows up where the
    first-visit update is near zero). Cosines are averaged per token (and head).
  * Memory: a batch's capture holds every visit's (B, H, T, T) probabilities at once
    (the model fills the dict during its forward), so pick the probe batch size for that:
    about n_visits * B * H * T^2 * 4 bytes.
  * Visit numbers in labels are 0-based, as in `loop.Visit` ("L3.v1" = layer 3, second visit).

CLI: python probes.py --run RUN_DIR [RUN_DIR ...] [--baseline RUN_DIR] [--max-tokens N]
writes probes.json and fig21/22/24/25/26/28/30 (+ fig23 grid for several runs, fig27 Dyck).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from loop import Visit

EPS = 1e-8
STAGES = {"resid": "x", "X": "attn_norm", "Q": "q", "K": "k", "V": "v", "PV": "pv", "O": "o"}
RATIOS = {"update": "update_rms", "attn_write": "attn_write_rms", "mlp_write": "mlp_write_rms",
          "attn_norm": "attn_norm_rms", "mlp_norm": "mlp_norm_rms"}


def label(layer: int, visit: int) -> str:
    return f"L{layer}.v{visit}"


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
    """((layer, v), (layer, v+1)) for every layer visited more than once, in layer order."""
    visits = {}
    for v in plan:
        visits.setdefault(v.layer, []).append(v.visit)
    return [((l, a), (l, a + 1)) for l in sorted(visits) for a in sorted(visits[l])[:-1]]


# ----------------------------------------------------------------------------------------
# Streaming accumulator

class ProbeAccumulator:
    """Running sums of every probe over batches. State size depends on the model only
    (visits, heads, k), never on the number of batches or tokens seen."""

    def __init__(self, plan: Sequence[Visit], n_head: int, n_experts: int = 0, top_k: int = 0,
                 attn_topk: Sequence[int] = (1, 8)):
        self.visits = [(v.layer, v.visit) for v in plan]
        self.pairs = cross_visit_pairs(plan)
        self.n_head, self.n_experts, self.top_k = n_head, n_experts, top_k
        self.attn_topk = tuple(attn_topk)
        self.control = [(h + n_head // 2) % n_head for h in range(n_head)] if n_head > 1 else None
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, float] = {}
        self.tokens = 0

    # -- bookkeeping ---------------------------------------------------------------------
    def _add(self, name: str, total: Tensor, n: float) -> None:
        total = total.detach().double().cpu()
        self.sums[name] = self.sums[name] + total if name in self.sums else total
        self.counts[name] = self.counts.get(name, 0.0) + float(n)

    def _add_mean(self, name: str, values: Tensor) -> None:
        self._add(name, values.sum(), values.numel())

    def _add_heads(self, name: str, v_BHT: Tensor, mask_BT: Tensor) -> None:
        """Per-head sums over the queries where mask is True."""
        m = mask_BT[:, None, :].to(v_BHT.dtype)
        self._add(name, (v_BHT * m).sum(dim=(0, 2)), mask_BT.sum().item())

    def mean(self, name: str) -> Tensor | None:
        if name not in self.sums or self.counts[name] == 0:
            return None
        return self.sums[name] / self.counts[name]

    def state_sizes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every running sum (what tests check stays fixed as batches stream in)."""
        return {k: tuple(v.shape) for k, v in self.sums.items()}

    # -- one batch -----------------------------------------------------------------------
    @torch.no_grad()
    def update(self, capture: dict, doc_ids: Tensor | None = None) -> None:
        """Reduce one batch's capture {(layer, visit): {name: tensor}} into the running sums."""
        x0 = capture[self.visits[0]]["x"]
        B, T, D = x0.shape
        start, pos = doc_positions(doc_ids, B, T, x0.device)
        self.tokens += B * T
        updates = {}
        for lv in self.visits:                                       # per layer and visit
            c, name = capture[lv], label(*lv)
            upd = updates[lv] = visit_update(c)
            self._add_mean(f"{name}/x_rms", token_rms(c["x"]))
            self._add_mean(f"{name}/update_rms", token_rms(upd))
            self._add_mean(f"{name}/relative_update", token_norm(upd) / token_norm(c["x"]).clamp_min(EPS))
            for key in ("attn_write", "mlp_write", "attn_norm", "mlp_norm"):
                if c.get(key) is not None:
                    self._add_mean(f"{name}/{key}_rms", token_rms(c[key]))
            if c.get("attn_probs") is not None:
                self._add_heads(f"{name}/sink", sink_mass(c["attn_probs"], start), pos >= 1)
        self._add("update_cosine", update_cosine_sums([updates[lv].reshape(-1, D) for lv in self.visits]),
                  B * T)
        for a, b in self.pairs:                                      # cross-visit metrics
            ca, cb, name = capture[a], capture[b], f"{label(*a)}-v{b[1]}"
            self._add_mean(f"{name}/cos/update", cosine(updates[a], updates[b]))
            for stage, key in STAGES.items():
                if ca.get(key) is None or cb.get(key) is None:
                    continue
                ta, tb = ca[key], cb[key]
                if key == "pv":                                      # per token and head
                    ta, tb = split_heads(ta, self.n_head), split_heads(tb, self.n_head)
                self._add_mean(f"{name}/cos/{stage}", cosine(ta, tb))
            if ca.get("topk_idx") is not None and cb.get("topk_idx") is not None:
                ov = expert_overlap(ca["topk_idx"], cb["topk_idx"]).flatten()
                self._add(f"{name}/expert_hist", torch.bincount(ov, minlength=self.top_k + 1), ov.numel())
            pa, pb = ca.get("attn_probs"), cb.get("attn_probs")
            if pa is None or pb is None:
                continue
            heads = {"same": pb, "control": pb[:, self.control] if self.control else None}
            for kind, p2 in heads.items():
                if p2 is None:
                    continue
                for k in self.attn_topk:
                    if k <= T:
                        self._add_heads(f"{name}/top{k}/{kind}", topk_overlap(pa, p2, k), pos + 1 > k)
                self._add_heads(f"{name}/mass/{kind}", mass_overlap(pa, p2), pos >= 1)

    # -- summary -------------------------------------------------------------------------
    def result(self) -> dict:
        """JSON-able summary of everything accumulated so far."""
        f = lambda t: None if t is None else float(t.mean())
        looped = sorted({a[0] for a, _ in self.pairs})
        per_visit = {}
        for layer, visit in self.visits:
            name = label(layer, visit)
            d = {"layer": layer, "visit": visit}
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
            name = f"{label(*a)}-v{b[1]}"
            va, vb = per_visit[label(*a)], per_visit[label(*b)]
            d = {"layer": a[0], "visits": [a[1], b[1]],
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
        for key in (cross[next(iter(cross))]["attention"] if cross else {}):
            summary[f"attn_{key}"] = avg([d["attention"][key] for d in cross.values()])
        summary["sink_mass"] = avg([d["sink_mass"] for d in per_visit.values()])
        return {"tokens": self.tokens, "visits": [label(*lv) for lv in self.visits], "looped_layers": looped,
                "attn_topk": list(self.attn_topk), "per_visit": per_visit,
                "update_cosine": {"labels": [label(*lv) for lv in self.visits],
                                  "matrix": None if M is None else M.tolist(),
                                  "cross_visit_diagonal": diag, "cross_visit_mean": avg(diag),
                                  "other_cross_visit_mean": avg(other)},
                "cross_visit": cross, "summary": summary}


# ----------------------------------------------------------------------------------------
# Running a model

def _unpack(batch) -> tuple[Tensor, Tensor | None]:
    """Accept idx, (idx, targets) or (idx, targets, doc_ids)."""
    if isinstance(batch, Tensor):
        return batch, None
    return batch[0], (batch[2] if len(batch) > 2 else None)


@torch.no_grad()
def probe(model, batches: Iterable, max_tokens: int | None = None, attn_topk: Sequence[int] = (1, 8),
          log_every: int = 0) -> dict:
    """Capture every visit on each batch, reduce it, and return the JSON-able summary."""
    cfg, device = model.cfg, next(model.parameters()).device
    was_training = model.training
    model.eval()
    acc = ProbeAccumulator(model.plan, cfg.n_head, cfg.n_experts, cfg.top_k if cfg.n_experts else 0, attn_topk)
    t0 = time.time()
    for i, batch in enumerate(batches):
        idx, doc = _unpack(batch)
        if max_tokens is not None:
            rows = min(idx.shape[0], math.ceil((max_tokens - acc.tokens) / idx.shape[1]))
            if rows <= 0:
                break
            idx, doc = idx[:rows], (doc[:rows] if doc is not None else None)
        idx = idx.to(device)
        doc = doc.to(device) if doc is not None else None
        capture: dict = {}
        model.run(idx, doc_ids=doc, capture=capture)
        acc.update(capture, doc)
        del capture
        if log_every and (i + 1) % log_every == 0:
            print(f"  probe batch {i + 1}: {acc.tokens} tokens, {acc.tokens / (time.time() - t0):.0f} tok/s",
                  flush=True)
    model.train(was_training)
    out = acc.result()
    out["config"] = cfg.to_dict()
    return out


# ----------------------------------------------------------------------------------------
# Dyck case study (Sec. 6.4)

def dyck_sequences(n: int, length: int, pairs: Sequence[tuple[int, int]], seed: int = 0,
                   max_depth: int = 8) -> tuple[Tensor, Tensor]:
    """n balanced bracket strings of even `length` -> (ids (n, length), match (n, length)):
    match[b, t] is the position of the opener that the closer at t closes, -1 elsewhere."""
    if length % 2 or length < 2:
        raise ValueError(f"dyck_sequences: length must be an even number >= 2, got {length}")
    rng = random.Random(seed)
    ids = torch.empty(n, length, dtype=torch.long)
    match = torch.full((n, length), -1, dtype=torch.long)
    for b in range(n):
        stack: list[tuple[int, int]] = []
        for t in range(length):
            left = length - t
            opening = not stack or (len(stack) < left and len(stack) < max_depth and rng.random() < 0.5)
            if opening:
                kind = rng.randrange(len(pairs))
                stack.append((kind, t))
                ids[b, t] = pairs[kind][0]
            else:
                kind, m = stack.pop()
                ids[b, t], match[b, t] = pairs[kind][1], m
    return ids, match


def tokenizer_pairs(encode) -> list[tuple[int, int]]:
    """Bracket pairs ( ) [ ] { } < > that the tokenizer maps to single tokens."""
    out = []
    for o, c in ("()", "[]", "{}", "<>"):
        eo, ec = encode(o), encode(c)
        if len(eo) == 1 and len(ec) == 1:
            out.append((eo[0], ec[0]))
    return out


@torch.no_grad()
def dyck_case_study(model, pairs: Sequence[tuple[int, int]] | None = None, n_seqs: int = 32,
                    length: int | None = None, seed: int = 0, bos: int | None = None) -> dict:
    """Attention each head on each visit puts on the matching opener, on seeded Dyck strings.

    pairs: (open, close) token ids (`tokenizer_pairs(enc.encode)`), default raw ids
    (0,1),(2,3),(4,5),(6,7). bos: an optional token prepended to every string (the sink).
    Queries: "match_mass" at each closing bracket; "match_mass_predict" at the token that
    predicts the closer (the retrieval the paper's Dyck head performs), skipping the case
    where that token is the opener itself. "uniform" is what uniform causal attention gives.
    """
    cfg = model.cfg
    pairs = list(pairs) if pairs else [(2 * i, 2 * i + 1) for i in range(min(4, cfg.vocab_size // 2))]
    off = 1 if bos is not None else 0
    if length is None:
        length = min(cfg.block_size - off, 64) // 2 * 2
    ids, match = dyck_sequences(n_seqs, length, pairs, seed)
    if bos is not None:
        ids = torch.cat([torch.full((n_seqs, 1), bos, dtype=torch.long), ids], dim=1)
        match = torch.cat([torch.full((n_seqs, 1), -1, dtype=torch.long), torch.where(match >= 0, match + 1, match)], 1)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    capture: dict = {}
    logits = model.run(ids.to(device), capture=capture).logits.float().cpu()
    model.train(was_training)
    b, t = (match >= 0).nonzero(as_tuple=True)                       # every closing bracket
    m = match[b, t]
    pred = t - 1 != m                                                # predicting query is not the opener
    closers = torch.tensor([c for _, c in pairs])
    guess = closers[logits[b, t - 1][:, closers].argmax(-1)]
    out = {"pairs": pairs, "n_seqs": n_seqs, "length": length, "seed": seed, "bos": bos,
           "n_closers": int(len(t)), "close_accuracy": float((guess == ids[b, t]).float().mean()),
           "uniform": float((1.0 / (t + 1).float()).mean()),
           "uniform_predict": float((1.0 / t[pred].float()).mean()) if pred.any() else None, "visits": {}}
    for visit in model.plan:
        p = capture[(visit.layer, visit.visit)].get("attn_probs")
        if p is None:
            continue
        p = p.float().cpu()                                          # (n, H, T, T)
        at_close = p[b, :, t, m]                                     # (n_closers, H)
        at_pred = p[b[pred], :, t[pred] - 1, m[pred]]
        out["visits"][label(visit.layer, visit.visit)] = {
            "match_mass": at_close.mean(0).tolist(), "match_mass_predict": at_pred.mean(0).tolist(),
            "first_token_mass": p[b, :, t, 0].mean(0).tolist()}
    return out


# ----------------------------------------------------------------------------------------
# Figures (matplotlib Agg)

def _plt():
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str, paths: list[str]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    paths.append(path)


def _looped_series(result: dict, key: str, visit: int) -> list[float | None]:
    return [result["per_visit"].get(label(l, visit), {}).get(key) for l in result["looped_layers"]]


def _nan(xs):
    return [float("nan") if x is None else x for x in xs]


def plot_probes(result: dict, out_dir: str, baseline: dict | None = None) -> list[str]:
    """One figure per SMELT figure the result supports; returns the written paths."""
    plt, paths = _plt(), []
    os.makedirs(out_dir, exist_ok=True)
    cross, layers = result["cross_visit"], result["looped_layers"]
    n_visits = 1 + max((v["visit"] for v in result["per_visit"].values()), default=0)
    hists = [d["expert_overlap"] for d in cross.values() if "expert_overlap" in d]
    if hists:                                                        # Fig. 21
        k = hists[0]["k"]
        dist = [sum(h["distribution"][j] for h in hists) / len(hists) for j in range(k + 1)]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar(range(k + 1), dist, color="tab:blue", label="visit v vs v+1 (all looped layers)")
        ax.plot(range(k + 1), hists[0]["random_distribution"], "o", color="grey", label="random routing")
        ax.axvline(hists[0]["random_mean"], ls="--", color="purple", label=f"random mean k²/n = {hists[0]['random_mean']:.2f}")
        ax.set(xlabel="|S1 ∩ S2| (experts shared)", ylabel="fraction of tokens", title="Expert-set overlap (Fig. 21)")
        ax.legend(fontsize=7)
        _save(fig, os.path.join(out_dir, "fig21_expert_overlap.png"), paths)
    if layers:                                                       # Fig. 22
        fig, axes = plt.subplots(3, 1, figsize=(5, 7), sharex=True)
        for ax, key, name in zip(axes, ("x_rms", "update_rms", "relative_update"),
                                 ("residual RMS", "update RMS", "||Δx|| / ||x||")):
            for v in range(n_visits):
                ax.plot(layers, _nan(_looped_series(result, key, v)), "o-", label=f"visit {v + 1}")
            ax.set_ylabel(name)
        axes[0].legend(fontsize=7)
        axes[0].set_title("Residual flow in the repeated block (Fig. 22)")
        axes[-1].set_xlabel("physical layer")
        _save(fig, os.path.join(out_dir, "fig22_residual_flow.png"), paths)
    panels = [(baseline, "Baseline")] if baseline else []
    panels.append((result, "looped"))                                # Fig. 24
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    for ax, (res, name) in zip(axes[0], panels):
        M, labels = res["update_cosine"]["matrix"], res["update_cosine"]["labels"]
        im = ax.imshow(M, vmin=-1, vmax=1, cmap="RdBu_r")
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        span = [i for i, lab in enumerate(labels) if res["per_visit"][lab]["layer"] in res["looped_layers"]]
        for edge in ([span[0] - 0.5, span[-1] + 0.5] if span else []):
            ax.axhline(edge, ls="--", color="k", lw=0.8)
            ax.axvline(edge, ls="--", color="k", lw=0.8)
        ax.set_title(f"{name}: update cosine (execution order)", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(os.path.join(out_dir, "fig24_update_cosine.png"), dpi=120)
    plt.close(fig)
    paths.append(os.path.join(out_dir, "fig24_update_cosine.png"))
    if cross:                                                        # Fig. 25
        stages = list(STAGES)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for d in cross.values():
            ax.plot(stages, _nan([d["cosine"][s] for s in stages]), "o-", alpha=0.6, label=f"layer {d['layer']}")
        ax.plot(stages, _nan([result["summary"][f"cos_{s}"] for s in stages]), "k-s", lw=2, label="mean")
        ax.set(ylabel="cross-visit cosine", title="Cross-visit cosine by attention stage (Fig. 25)")
        ax.legend(fontsize=6)
        _save(fig, os.path.join(out_dir, "fig25_cross_visit_cosines.png"), paths)
    if cross and any(d["attention"].get("mass") is not None for d in cross.values()):   # Fig. 26
        keys = [f"top{k}" for k in result["attn_topk"]] + ["mass"]
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
        names = list(cross)
        for ax, key in zip(axes[0], keys):
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], _nan([cross[n]["attention"].get(key) for n in names]), 0.4,
                   color="tab:blue", label="same head")
            ax.bar([x + 0.2 for x in xs], _nan([cross[n]["attention"].get(f"{key}_control") for n in names]), 0.4,
                   color="grey", label="other head (h + H/2)")
            ax.set_xticks(list(xs), names, rotation=45, fontsize=7)
            ax.set(ylim=(0, 1), title=f"{key} overlap" if key != "mass" else "attention-mass overlap")
        axes[0][0].legend(fontsize=7)
        _save(fig, os.path.join(out_dir, "fig26_attended_token_overlap.png"), paths)
    if layers and result["per_visit"][label(layers[0], 0)]["sink_mass_per_head"] is not None:   # Fig. 28
        fig, axes = plt.subplots(1, n_visits, figsize=(3.5 * n_visits, 3.5), squeeze=False)
        for v, ax in enumerate(axes[0]):
            grid = [_nan(result["per_visit"].get(label(l, v), {}).get("sink_mass_per_head") or []) for l in layers]
            im = ax.imshow(torch.tensor(grid).T.numpy(), vmin=0, vmax=1, cmap="magma", aspect="auto")
            ax.set(xticks=range(len(layers)), xticklabels=layers, xlabel="layer", ylabel="head", title=f"visit {v + 1}")
        fig.colorbar(im, ax=axes[0].tolist())
        fig.suptitle("Per-head segment-start mass (Fig. 28)", fontsize=9)
        fig.savefig(os.path.join(out_dir, "fig28_sink_heads.png"), dpi=120)
        plt.close(fig)
        paths.append(os.path.join(out_dir, "fig28_sink_heads.png"))
    fig, ax = plt.subplots(figsize=(5.5, 3.5))                        # Fig. 30 / App. D
    for res, name, style in ([(baseline, "Baseline", "k--")] if baseline else []) + [(result, "looped", "-")]:
        for v in range(1 + max(d["visit"] for d in res["per_visit"].values())):
            pts = sorted((d["layer"], d["sink_mass"]) for d in res["per_visit"].values()
                         if d["visit"] == v and d["sink_mass"] is not None)
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=f"{name} visit {v + 1}" if name != "Baseline" else name)
    ax.set_xticks(sorted({d["layer"] for d in result["per_visit"].values()}))
    ax.set(xlabel="physical layer", ylabel="attention on segment start", title="Attention-sink mass (Fig. 30)")
    ax.legend(fontsize=7)
    _save(fig, os.path.join(out_dir, "fig30_attention_sink.png"), paths)
    return paths


GRID = [("attn_top8", "top-8 attended-token overlap"), ("attn_mass", "attention-mass overlap"),
        ("expert_overlap_frac", "expert overlap / k"), ("update_cosine_cross_visit", "update cosine"),
        ("ratio_update", "ratio ||Δx||"), ("ratio_attn_write", "ratio attention write"),
        ("ratio_mlp_write", "ratio MoE write"), ("ratio_norm", "ratio RMSNorm output")]


def plot_grid(results: dict[str, dict], path: str) -> str:
    """Figure 23 analogue: eight cross-visit diagnostics, one bar per run."""
    plt = _plt()
    fig, axes = plt.subplots(2, 4, figsize=(14, 6))
    names = list(results)
    for ax, (key, title), letter in zip(axes.flat, GRID, "abcdefgh"):
        ax.bar(range(len(names)), _nan([results[n]["summary"].get(key) for n in names]), color="tab:red")
        ax.set_xticks(range(len(names)), names, rotation=45, fontsize=7)
        ax.set_title(f"({letter}) {title}", fontsize=9)
        if key.startswith("ratio"):
            ax.axhline(1.0, ls="--", color="grey")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_dyck(dyck: dict, path: str) -> str:
    """Match mass per visit and head on Dyck strings (a Fig. 27 companion)."""
    plt = _plt()
    names = list(dyck["visits"])
    grid = [dyck["visits"][n]["match_mass_predict"] for n in names]
    fig, ax = plt.subplots(figsize=(4, 0.3 * len(names) + 1.5))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set(yticks=range(len(names)), yticklabels=names, xlabel="head",
           title=f"Dyck: mass on matching opener (uniform {dyck['uniform_predict'] or 0:.2f})")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------
# CLI

def _data_dir(meta: dict, run_dir: str) -> str:
    d = meta["data_dir"]
    return d if os.path.isabs(d) or os.path.exists(d) else os.path.join(run_dir, d)


def _probe_run(run_dir: str, args) -> tuple[dict, dict]:
    import data
    from eval import load_model   # one loader for every run directory (clear errors on bad files)
    model, meta = load_model(run_dir, args.device)
    block = args.block_size or model.cfg.block_size
    batches = data.TokenData(_data_dir(meta, run_dir)).val_batches(args.source, args.batch_size, block, args.max_tokens)
    print(f"probing {run_dir} ({len(model.plan)} visits, up to {args.max_tokens} tokens)", flush=True)
    result = probe(model, batches, args.max_tokens, attn_topk=args.topk, log_every=args.log_every)
    pairs, bos = None, None
    if args.tokenizer:
        import tiktoken
        enc = tiktoken.get_encoding(args.tokenizer)
        pairs, bos = tokenizer_pairs(enc.encode_ordinary), enc.eot_token
    dyck = dyck_case_study(model, pairs, n_seqs=args.dyck_seqs, seed=args.seed, bos=bos)
    return result, dyck


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="SMELT Section 6 probes: what the second visit of a looped layer computes.")
    ap.add_argument("--run", nargs="+", required=True, help="run directory(ies) with config.json and ckpt.pt")
    ap.add_argument("--baseline", default=None, help="matched unlooped Baseline run directory")
    ap.add_argument("--max-tokens", type=int, default=65536, help="held-out tokens to probe per model")
    ap.add_argument("--batch-size", type=int, default=4,
                    help="probe batch (memory ~ n_visits * B * n_head * T^2 * 4 bytes for attention maps)")
    ap.add_argument("--block-size", type=int, default=0, help="context length (0: the model's block_size)")
    ap.add_argument("--source", default=None, help="validation source passed to data.TokenData.val_batches")
    ap.add_argument("--topk", type=int, nargs="+", default=[1, 8], help="attended-token overlap set sizes")
    ap.add_argument("--dyck-seqs", type=int, default=32, help="Dyck strings in the case study")
    ap.add_argument("--tokenizer", default=None,
                    help="tiktoken encoding for Dyck brackets (default: raw token ids 0..7, no BOS)")
    ap.add_argument("--seed", type=int, default=0, help="Dyck generator seed")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--out", default=None, help="output directory (default: FIRST_RUN/probes)")
    ap.add_argument("--log-every", type=int, default=10, help="progress line every N batches (0: quiet)")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out or os.path.join(args.run[0], "probes")
    os.makedirs(out, exist_ok=True)
    report: dict = {"runs": {}, "dyck": {}, "baseline": None, "figures": []}
    base = None
    if args.baseline:
        base, report["dyck"]["baseline"] = _probe_run(args.baseline, args)
        report["baseline"] = base
    names = [os.path.basename(os.path.normpath(r)) or r for r in args.run]
    if len(set(names)) < len(names):                                 # same basename twice: number them
        names = [f"{n}_{i}" for i, n in enumerate(names)]
    for name, run in zip(names, args.run):
        res, dyck = _probe_run(run, args)
        report["runs"][name], report["dyck"][name] = res, dyck
        sub = out if len(args.run) == 1 else os.path.join(out, name)
        report["figures"] += plot_probes(res, sub, baseline=base)
        report["figures"].append(plot_dyck(dyck, os.path.join(sub, "fig27_dyck.png")))
        s = res["summary"]
        print(f"{name}: update cos {s['update_cosine_cross_visit']}, expert overlap {s['expert_overlap']}, "
              f"ratio Δx {s['ratio_update']}, sink {s['sink_mass']}", flush=True)
    if len(args.run) > 1:
        report["figures"].append(plot_grid(report["runs"], os.path.join(out, "fig23_grid.png")))
    with open(os.path.join(out, "probes.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {os.path.join(out, 'probes.json')} and {len(report['figures'])} figures", flush=True)
    return report


if __name__ == "__main__":
    main()
