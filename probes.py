"""Probes: what a looped layer computes on its next visit (SMELT Section 6, Appendix D).

One capture pass over held-out tokens (`GPT.run(..., capture={})`) records every (layer, visit) of the plan:
residual input x, RMSNorm outputs, Q/K/V, attention probabilities, PV, O, the sub-layer writes and the routed
experts. `ProbeAccumulator` reduces each batch at once into running sums per *unit* (a held-out document group;
memory grows with the units, never with tokens): expert-set overlap (Fig. 21), residual and update RMS and their
ratios (Fig. 22-23), update cosines (Fig. 24), cross-visit cosines of x, X, Q, K, V, PV, O (Fig. 25),
attended-token overlap against the other-head control (Fig. 26), attention-sink mass (Fig. 28/30). `probe` runs
one model, `held_out_sample` draws the tokens every model sees. Visits are numbered from 1 ("L3.v2").
Every measure and choice: docs/probes.md. Read next: lab/probe_pairs.py (every matched pair, the CLI),
lab/probe_claims.py (the claims).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from loop import Visit

EPS = 1e-8
STAGES = {"resid": "x", "X": "attn_norm", "Q": "q", "K": "k", "V": "v", "PV": "pv", "O": "o"}
RATIOS = {"update": "update_rms", "attn_write": "attn_write_rms", "mlp_write": "mlp_write_rms",
          "attn_norm": "attn_norm_rms", "mlp_norm": "mlp_norm_rms"}


def label(layer: int, visit: int | None = None) -> str:
    """'L3.v2' for layer 3's second visit (visit is 1-based, as in the paper); 'L3' for an unlooped layer."""
    return f"L{layer}" if visit is None else f"L{layer}.v{visit}"


def visit_labels(plan: Sequence[Visit]) -> dict[tuple[int, int], str]:
    """Capture key (layer, 0-based visit) -> label: looped layers get 'Ll.vN' (N from 1), unlooped 'Ll'."""
    n = Counter(v.layer for v in plan)
    return {(v.layer, v.visit): label(v.layer, v.visit + 1 if n[v.layer] > 1 else None) for v in plan}


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


def expert_overlap(idx1: Tensor, idx2: Tensor) -> Tensor:
    """|S1 ∩ S2| per token from top-k expert ids (..., k) of two visits -> (...,) in 0..k."""
    return (idx1[..., :, None] == idx2[..., None, :]).sum(dim=(-1, -2))


def random_overlap(k: int, n: int) -> tuple[float, list[float]]:
    """Independent uniform top-k routing over n experts: E|S1 ∩ S2| = k^2/n and the pmf over 0..k."""
    pmf = [math.comb(k, j) * math.comb(n - k, k - j) / math.comb(n, k) for j in range(k + 1)]
    return k * k / n, pmf


def topk_overlap(p1: Tensor, p2: Tensor, k: int) -> Tensor:
    """|top-k(p1) ∩ top-k(p2)| / k per query: p (..., S) attention rows -> (...,) in [0, 1]."""
    return expert_overlap(p1.topk(k, dim=-1).indices, p2.topk(k, dim=-1).indices).float() / k


def mass_overlap(p1: Tensor, p2: Tensor) -> Tensor:
    """sum_j min(p1_j, p2_j) per query: 1 for identical distributions, 0 for disjoint ones."""
    return torch.minimum(p1.float(), p2.float()).sum(-1)


def control_heads(n_head: int) -> list[int] | None:
    """SMELT Sec. 6.3's control: head h against head (h + H/2) mod H of the same layer and visit; None for one head."""
    return None if n_head < 2 else [(h + n_head // 2) % n_head for h in range(n_head)]


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


def cross_visit_pairs(plan: Sequence[Visit]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((layer, v), (layer, v+1)) for every layer visited more than once, in layer order (0-based v)."""
    visits = {}
    for v in plan:
        visits.setdefault(v.layer, []).append(v.visit)
    return [((l, a), (l, a + 1)) for l in sorted(visits) for a in sorted(visits[l])[:-1]]


def pair_label(a: tuple[int, int], b: tuple[int, int]) -> str:
    """'L3.v1-v2': layer 3, visit 1 against visit 2 (1-based)."""
    return f"{label(a[0], a[1] + 1)}-v{b[1] + 1}"


def _avg(xs: Iterable) -> float | None:   # of the values that are not None
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


class ProbeAccumulator:
    """Running sums of every probe, kept per unit (a held-out document group; any hashable key): every sum
    has shape (n_units, *shape) with a count (n_units,), so global means are sum / count over units and a
    bootstrap resamples units. The state grows with the units seen, never with tokens."""

    def __init__(self, plan: Sequence[Visit], n_head: int, n_experts: int = 0, top_k: int = 0,
                 attn_topk: Sequence[int] = (1, 8)):
        self.visits = [(v.layer, v.visit) for v in plan]
        self.labels = visit_labels(plan)
        self.pairs = cross_visit_pairs(plan)
        self.n_head, self.n_experts, self.top_k = n_head, n_experts, top_k
        self.attn_topk = tuple(attn_topk)
        self.control = control_heads(n_head)
        self._index = {lv: i for i, lv in enumerate(self.visits)}
        self._attn_kinds = [f"top{k}" for k in self.attn_topk] + ["mass"]
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}
        self.units: dict = {}                                        # unit key -> its row, in arrival order
        self._rows = torch.zeros(0, dtype=torch.long)
        self.tokens = 0

    def _add(self, name: str, total: Tensor, n: Tensor) -> None:
        """total (B, *shape): one row per context; n (B,): what each row's total counts."""
        total, n = total.detach().double().cpu(), n.detach().double().cpu().reshape(-1)
        if name not in self.sums:
            self.sums[name] = torch.zeros(0, *total.shape[1:], dtype=torch.float64)
            self.counts[name] = torch.zeros(0, dtype=torch.float64)
        self.sums[name], self.counts[name] = self.unit_sum(name)    # a zero row for every new unit
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

    def _cross_layer(self) -> list[tuple[int, int]]:
        """(i, j) into visits: two different looped layers, i's visit before j's (Fig. 24's other-layer control)."""
        looped = {a[0] for a, _ in self.pairs}
        return [(i, j) for i, a in enumerate(self.visits) for j, b in enumerate(self.visits)
                if a[0] in looped and b[0] in looped and a[0] != b[0] and a[1] < b[1]]

    def state_sizes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every running sum (what tests check stays fixed as batches of known units stream in)."""
        return {k: tuple(v.shape) for k, v in self.sums.items()}

    @torch.no_grad()
    def update(self, capture: dict, doc_ids: Tensor | None = None, units: Sequence | None = None) -> None:
        """Reduce one batch's capture {(layer, visit): {name: tensor}} into the running sums; units: one key per
        row (default: a new unit per row, numbered in arrival order)."""
        x0 = capture[self.visits[0]]["x"]
        B, T, D = x0.shape
        if units is None:
            units = [("row", self.tokens // T + b) for b in range(B)]
        if len(units) != B:
            raise ValueError(f"units: need one key per row ({B}), got {len(units)}")
        self._rows = torch.tensor([self.units.setdefault(u, len(self.units)) for u in units], dtype=torch.long)
        start, pos = doc_positions(doc_ids, B, T, x0.device)
        self.tokens += B * T
        updates = {}
        for lv in self.visits:                                       # per layer and visit
            c, name = capture[lv], self.labels[lv]
            writes = [c[n] for n in ("attn_write", "mlp_write") if c.get(n) is not None]   # each scaled by 1/r
            upd = updates[lv] = sum(writes[1:], writes[0]) if writes else torch.zeros_like(c["x"])   # Δx
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
                ta, tb = ca.get(key), cb.get(key)
                if ta is not None and tb is not None:
                    if key == "pv":                                  # per token and head: (B, H, T, hd)
                        ta, tb = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (ta, tb))
                    self._add_mean(f"{name}/cos/{stage}", cosine(ta, tb))
            if ca.get("topk_idx") is not None and cb.get("topk_idx") is not None:
                ov = expert_overlap(ca["topk_idx"], cb["topk_idx"]).reshape(B, T)
                self._add(f"{name}/expert_hist", F.one_hot(ov, self.top_k + 1).sum(1), torch.full((B,), T))
            pa, pb = ca.get("attn_probs"), cb.get("attn_probs")
            if pa is None or pb is None:
                continue
            sides = [("same", pa, pb)]                               # control: other head, same layer and visit
            sides += [] if self.control is None else [("control", p, p[:, self.control]) for p in (pa, pb)]
            for side, p, q in sides:
                for k in self.attn_topk:
                    if k <= T:
                        self._add_heads(f"{name}/top{k}/{side}", topk_overlap(p, q, k), pos + 1 > k)
                self._add_heads(f"{name}/mass/{side}", mass_overlap(p, q), pos >= 1)

    def _unit_block(self) -> dict:
        """Per-unit sums of the quantities Section 6's claims rest on (for bootstrap intervals)."""
        q: dict[str, dict] = {}
        names = [pair_label(a, b) for a, b in self.pairs]

        def put(name, parts, count):
            q[name] = {"sum": torch.stack(parts, 1).tolist(), "count": count.tolist()}

        def per_pair(name, keys, reduce):
            """put reduce(*unit sums of keys[i]) for every pair i, counted as its first key; only if all exist."""
            got = [[self.unit_sum(k) for k in ks] for ks in keys]
            if got and all(g is not None for row in got for g in row):
                put(name, [reduce(*[g[0] for g in row]) for row in got], got[0][0][1])

        def both(key):                                               # the key on both visits of every pair
            return [(f"{self.labels[a]}/{key}", f"{self.labels[b]}/{key}") for a, b in self.pairs]

        for r, key in RATIOS.items():
            per_pair(f"ratio_{r}", both(key), lambda x, y: torch.stack([x, y], 1))
        uc = self.unit_sum("update_cosine")
        if uc is not None and self.pairs:
            M, n = uc
            put("ucos_same", [M[:, self._index[a], self._index[b]] for a, b in self.pairs], n)
            if self._cross_layer():
                o = torch.stack([M[:, i, j] for i, j in self._cross_layer()], 1).mean(1)
                put("ucos_other", [o] * len(self.pairs), n)
        for stage in ["update", *STAGES]:
            per_pair(f"cos_{stage}", [[f"{nm}/cos/{stage}"] for nm in names], lambda g: g)
        for kind in self._attn_kinds:
            for side in ("same", "control"):                         # per-head sums -> mean over heads
                per_pair(f"{kind}_{side}", [[f"{nm}/{kind}/{side}"] for nm in names], lambda g: g.mean(1))
        ar = torch.arange(self.top_k + 1, dtype=torch.float64)
        per_pair("expert_overlap", [[f"{nm}/expert_hist"] for nm in names], lambda g: (g * ar).sum(1))
        per_pair("sink", both("sink"), lambda x, y: torch.stack([x.mean(1), y.mean(1)], 1))
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
            d.update({key: f(self.mean(f"{name}/{key}")) for key in ("x_rms", "update_rms", "relative_update",
                      "attn_write_rms", "mlp_write_rms", "attn_norm_rms", "mlp_norm_rms")})
            sink = self.mean(f"{name}/sink")
            d["sink_mass"], d["sink_mass_per_head"] = f(sink), None if sink is None else sink.tolist()
            per_visit[name] = d
        M = self.mean("update_cosine")
        diag = [] if M is None else [M[self._index[a], self._index[b]].item() for a, b in self.pairs]
        other = [] if M is None else [M[i, j].item() for i, j in self._cross_layer()]
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
            d["attention"] = {kind + suffix: f(self.mean(f"{name}/{kind}/{side}"))
                              for side, suffix in (("same", ""), ("control", "_control")) for kind in self._attn_kinds}
            cross[name] = d
        cv, pv = list(cross.values()), list(per_visit.values())
        summary = {"update_cosine_cross_visit": _avg(diag), "update_cosine_other": _avg(other)}
        summary.update({f"cos_{s}": _avg(d["cosine"][s] for d in cv) for s in ["update", *STAGES]})
        summary.update({f"ratio_{r}": _avg(d["norm_ratio"][r] for d in cv) for r in RATIOS})
        summary["ratio_norm"] = _avg([summary["ratio_attn_norm"], summary["ratio_mlp_norm"]])
        ov = summary["expert_overlap"] = _avg(d["expert_overlap"]["mean"] for d in cv if "expert_overlap" in d)
        summary["expert_overlap_frac"] = None if ov is None else ov / self.top_k
        summary["expert_overlap_random"] = None if ov is None else random_overlap(self.top_k, self.n_experts)[0]
        summary.update({f"attn_{k}": _avg(d["attention"][k] for d in cv) for k in (cv[0]["attention"] if cv else {})})
        summary["sink_mass"] = _avg(d["sink_mass"] for d in pv)
        for v in range(1, max((d["visit"] for d in pv), default=1) + 1):   # the looped span, per visit
            summary[f"sink_mass_span_v{v}"] = _avg(d["sink_mass"] for d in pv if d["looped"] and d["visit"] == v)
        return {"tokens": self.tokens, "visits": [self.labels[lv] for lv in self.visits], "looped_layers": looped,
                "attn_topk": list(self.attn_topk), "per_visit": per_visit,
                "update_cosine": {"labels": [self.labels[lv] for lv in self.visits],
                                  "matrix": None if M is None else M.tolist(),
                                  "cross_visit_diagonal": diag, "cross_visit_mean": _avg(diag),
                                  "other_cross_visit_mean": _avg(other)},
                "cross_visit": cross, "summary": summary, "units": self._unit_block()}


@torch.no_grad()
def probe(model, batches: Iterable, max_tokens: int | None = None, attn_topk: Sequence[int] = (1, 8),
          units: Sequence | None = None) -> dict:
    """Capture every visit on each batch, reduce it, and return the JSON-able summary; units: one key per row
    over all batches, in order (default: every row its own unit)."""
    cfg, device = model.cfg, next(model.parameters()).device
    was_training = model.training
    model.eval()
    acc = ProbeAccumulator(model.plan, cfg.n_head, cfg.n_experts, cfg.top_k if cfg.n_experts else 0, attn_topk)
    row = 0
    for batch in batches:
        if isinstance(batch, Tensor):                                # idx, (idx, targets) or (idx, targets, doc, ...)
            batch = (batch,)
        idx, doc = batch[0], (batch[2] if len(batch) > 2 else None)
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
    model.train(was_training)
    out = acc.result()
    out["config"] = cfg.to_dict()
    return out


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
        by_domain = {d: n * T for d, n in Counter(self.domains).items()}
        by_source = {s: n * T for s, n in Counter(self.sources).items()}
        return {"tokens": int(self.idx.numel()), "contexts": int(self.idx.shape[0]), "block_size": T,
                "units": len(set(self.units)), "domains": sorted(by_domain), "tokens_by_domain": by_domain,
                "tokens_by_source": by_source}


def held_out_sample(data, tokens: int, block_size: int) -> Sample:
    """About `tokens` validation tokens in contexts of block_size: the same number of contexts from every
    domain present, spread round-robin over each domain's sources (a short source passes its share on),
    each source's contexts spread over its held-out stream (data.val_slots, as validation reads them).
    Units: neighbouring contexts of one source that share a document (one cut by a context boundary, or
    one long enough to span the gap between two sampled contexts) form one unit."""
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
        turns = (s for i in range(max(avail.values())) for s in sources if avail[s] > i)   # round-robin
        alloc = Counter(islice(turns, per_domain))
        for s in [s for s in sources if alloc[s]]:
            n = alloc[s]
            x, _, dd = next(iter(data.val_batches(s, n, block_size, n * block_size)))[:3]
            first = data.val_slots(s, block_size, n * block_size) * block_size    # each context's first token
            doc_starts = np.concatenate([[0], np.cumsum(lengths[s])[:-1]])
            doc_first = np.searchsorted(doc_starts, first, side="right") - 1       # document of its first token
            doc_last = np.searchsorted(doc_starts, first + block_size - 1, side="right") - 1   # and of its last
            breaks = doc_first[1:] != doc_last[:-1]                 # no document runs on from the previous context
            units += [(s, g) for g in [0, *np.cumsum(breaks).tolist()]]
            idx.append(x)
            doc.append(dd)
            srcs += [s] * x.shape[0]
            doms += [d] * x.shape[0]
    if not idx:
        raise ValueError(f"held_out_sample: no source has a full {block_size}-token validation context")
    return Sample(torch.cat(idx), torch.cat(doc), units, srcs, doms)
