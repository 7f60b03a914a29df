"""Section 6's claims from probe results: one registry of quantities, their intervals and verdicts.

`QUANTITIES` registers each probe quantity once: the per-unit sums of `probes.ProbeAccumulator` it reads,
how it is formed from their means, its paper claim and its Fig. 23 panel (if any); the claims, the panels and
the per-pair intervals all derive from it. Sec. 6.1 (Fig. 21): experts shared between visits; 6.2 (Fig. 23-24):
update norm ratios and cosines; 6.3 (Fig. 25-26): Q, K, V cosines and attended-token overlap; 6.4 (Fig. 27-30):
sink mass and the Dyck head (`DYCK_CLAIMS`, over prompts). Every interval is a percentile bootstrap over
held-out document groups, the same draws for every pair; `claims` gives each with its `stats.verdict`.
Works from the probes.json dict alone. Read probes.py first; figures: probe_plots.py; the reasoning:
docs/probe_claims.md.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lab import stats

_EPS = 1e-8   # as probes.EPS: guards a unit with a zero count


@dataclass(frozen=True)
class Claim:
    """A paper claim "quantity direction value"; `what` may name the visits as {a} / {b} (see visit_words)."""
    id: str
    direction: str
    value: float
    figure: str
    what: str
    paper: str
    parts: tuple[str, ...] = ()   # the two sides reported beside it (quantities of the registry)
    every_cell: bool = False      # the paper says it of every cell: reproduced needs the weakest pair too


@dataclass(frozen=True)
class Panel:
    """A panel of Fig. 23 (ordered by letter); `ref` is a quantity drawn beside it in grey."""
    letter: str
    title: str
    ref: str | None = None
    ref_label: str | None = None
    hline: float | None = None   # a reference line (1 for a norm ratio)


@dataclass(frozen=True)
class Quantity:
    """reads: per-unit sums in a result's "units" block; fn(*their pooled means, meta) -> float."""
    reads: tuple[str, ...]
    fn: Callable
    experts: bool = False        # needs an MoE (meta["top_k"] > 0)
    claim: Claim | None = None
    panel: Panel | None = None


def _ratio(m) -> float:
    """Mean over cross-visit pairs (layer, v -> v+1) of visit v+1 / visit v norm: m (pairs, 2)."""
    return float((m[:, 1] / m[:, 0]).sum()) / len(m)


def _mean(m) -> float:
    return float(m.sum()) / m.size


def _one(name: str, **kw) -> Quantity:
    return Quantity((name,), lambda m, _: _mean(m), **kw)


def _gap(a: str, b: str, **kw) -> Quantity:
    return Quantity((a, b), lambda x, y, _: _mean(x) - _mean(y), **kw)


def _norm_ratio(name: str, **kw) -> Quantity:
    return Quantity((name,), lambda m, _: _ratio(m), **kw)


# the paper's words (SMELT Section 6), quoted with their section and figure
RATIOS_EXCEED_1 = "\"In all 16 cells, all four norm ratios exceed 1 (range 1.2–3.5×)\" (Sec. 6.2, Fig. 23)"
OVERLAP_FALLS = ("\"As sparsity increases and the pool grows by more than an order of magnitude, the overlap drops "
                 "to 2–3\" (Sec. 6.1, Fig. 21)")
Q_K_V = ("\"Q and K sit at 0.89–0.93 across all 16 cells [...] V falls below it to 0.65–0.74\" (Sec. 6.3, "
         "Fig. 25)")
Q_K_X = ("\"Q and K stay at 0.89–0.93, at or above the input’s own 0.84–0.93\" (Fig. 25; \"at or above\": an "
         "interval above 0 reproduces it, one below 0 contradicts it)")
V_X = "\"V falls below the input to 0.65–0.74\" (Fig. 25)"


def _ratio_claim(cid: str, letter: str, what: str, title: str, paper: str = RATIOS_EXCEED_1) -> dict:
    return dict(claim=Claim(cid, ">", 1.0, f"Fig. 23{letter}", f"visit-{{b}} / visit-{{a}} norm of {what}", paper,
                            every_cell=True),   # "In all 16 cells"
                panel=Panel(letter, f"norm ratio {{vb}}/{{va}}: {title}", hline=1.0))


def _cos_gap(a: str, b: str, cid: str, direction: str, paper: str) -> Quantity:
    """Fig. 25: the cross-visit cosine of stage a minus that of stage b, a claim of every cell."""
    what = f"cross-visit cosine of {a} minus that of {'the input X' if b == 'X' else b}"
    parts = (f"cos_{a}", f"cos_{b}")
    return _gap(*parts, claim=Claim(cid, direction, 0.0, "Fig. 25", what, paper, parts, every_cell=True))


_CONTROL = "other-head control"
COS_STAGES = ("update", "resid", "X", "Q", "K", "V", "PV", "O")   # "update" and probes.STAGES, in that order

# name -> Quantity, in Section 6's order (the order of the claims)
QUANTITIES: dict[str, Quantity] = {
    "ratio_update": _norm_ratio("ratio_update", **_ratio_claim(
        "update_ratio", "e", "the full update Δx", "update Δx")),
    "ratio_attn_write": _norm_ratio("ratio_attn_write", **_ratio_claim(
        "attn_write_ratio", "f", "the attention write", "attention write")),
    "ratio_mlp_write": _norm_ratio("ratio_mlp_write", **_ratio_claim(
        "moe_write_ratio", "g", "the MoE write", "MoE write")),
    "ratio_attn_norm": _norm_ratio("ratio_attn_norm"),
    "ratio_mlp_norm": _norm_ratio("ratio_mlp_norm"),
    "ratio_norm": Quantity(("ratio_attn_norm", "ratio_mlp_norm"), lambda a, m, _: (_ratio(a) + _ratio(m)) / 2,
                           **_ratio_claim("norm_ratio", "h", "the RMSNorm outputs", "RMSNorm output")),
    "ucos_same": _one("ucos_same", panel=Panel("d", "update cosine, same layer", "ucos_other",
                                               "non-matching cross-visit pairs")),
    "ucos_other": _one("ucos_other"),
    "ucos_gap": _gap("ucos_same", "ucos_other", claim=Claim(
        "update_cosine", ">", 0.0, "Fig. 24", "update cosine: same layer across visits minus non-matching "
        "cross-visit pairs", "\"cosine ranges from 0.42 to 0.65 (0.56), compared with a mean of 0.16 for nonmatching "
        "cross-visit pairs\" (Sec. 6.2, Fig. 24, 1.6B)", ("ucos_same", "ucos_other"))),
    **{f"cos_{s}": _one(f"cos_{s}") for s in COS_STAGES},
    "cos_Q_minus_V": _cos_gap("Q", "V", "q_stabler_than_v", ">", Q_K_V),
    "cos_K_minus_V": _cos_gap("K", "V", "k_stabler_than_v", ">", Q_K_V),
    "cos_Q_minus_X": _cos_gap("Q", "X", "q_keeps_input", ">", Q_K_X),
    "cos_K_minus_X": _cos_gap("K", "X", "k_keeps_input", ">", Q_K_X),
    "cos_V_minus_X": _cos_gap("V", "X", "v_below_input", "<", V_X),
    "top1_same": _one("top1_same"),
    "top1_control": _one("top1_control"),
    "top1_gap": _gap("top1_same", "top1_control"),
    "top8_same": _one("top8_same", panel=Panel("a", "top-8 attended-token overlap", "top8_control", _CONTROL)),
    "top8_control": _one("top8_control"),
    "top8_gap": _gap("top8_same", "top8_control", claim=Claim(
        "top8_overlap", ">", 0.0, "Fig. 26b", "top-8 attended-token overlap across visits minus the other-head "
        "control", "\"The top-8 attended tokens overlap by 56–66% across visits [...] The other-head control sits at "
        "28–34%\" (Sec. 6.3, Fig. 26b)", ("top8_same", "top8_control"))),
    "mass_same": _one("mass_same", panel=Panel("b", "attention-mass overlap", "mass_control", _CONTROL)),
    "mass_control": _one("mass_control"),
    "mass_gap": _gap("mass_same", "mass_control"),
    "expert_frac": Quantity(("expert_overlap",), lambda m, meta: _mean(m) / meta["top_k"], experts=True,
                            panel=Panel("c", "expert-set overlap / k", "expert_random_frac", "random routing k/n")),
    "expert_random_frac": Quantity(("expert_overlap",), lambda m, meta: meta["top_k"] / meta["n_experts"],
                                   experts=True),
    "expert_gap": Quantity(("expert_overlap",), lambda m, meta: _mean(m) - meta["top_k"] ** 2 / meta["n_experts"],
                           experts=True, claim=Claim(
        "expert_overlap", ">", 0.0, "Fig. 21", "experts shared between visits minus random routing (k^2/n)",
        "\"Even there it stays far above what independent random routing over a pool that large would give\" "
        "(Sec. 6.1, Fig. 21)", ("expert_frac", "expert_random_frac"))),
    "sink_v1": Quantity(("sink",), lambda m, _: _mean(m[:, 0])),   # the earlier visit of each pair
    "sink_v2": Quantity(("sink",), lambda m, _: _mean(m[:, 1])),   # the later one
    "sink_change": Quantity(("sink",), lambda m, _: _mean(m[:, 1] - m[:, 0]), claim=Claim(
        "sink_shrinks", "<", 0.0, "Fig. 28/30, App. D", "attention-sink mass in the looped span, visit {b} minus "
        "visit {a}", "\"the bright, high-mass cells in visit 1 cool broadly on visit 2\" (Sec. 6.4, Fig. 30)",
        ("sink_v1", "sink_v2"))),
}

# (id, mass, direction, value, figure, what, the paper): per prompt, visit 2 minus visit 1 of the Dyck head
DYCK_CLAIMS = [
    ("dyck_bos_falls", "bos", "<", 0.0, "Fig. 27", "Dyck head's BOS mass at the targets, visit 2 minus visit 1",
     "\"the second visit cuts BOS mass from 0.60 to 0.02\" (Sec. 6.4, Fig. 27)"),
    ("dyck_demo_rises", "demo", ">", 0.0, "Fig. 27",
     "Dyck head's demonstration-answer mass at the targets, visit 2 minus visit 1",
     "\"lifts demonstration-answer mass from 0.24 to 0.85\" (Sec. 6.4, Fig. 27)"),
]


def claimed() -> list[tuple[str, Claim]]:
    return [(n, q.claim) for n, q in QUANTITIES.items() if q.claim is not None]


def panels() -> list[tuple[str, Panel]]:
    """(quantity, panel) of Fig. 23, by letter."""
    return sorted(((n, q.panel) for n, q in QUANTITIES.items() if q.panel is not None), key=lambda x: x[1].letter)


def visit_words(n_visits: int) -> dict[str, str]:
    """How labels name the visits compared: 1 and 2 at r = 2, else v and v+1 (every consecutive pair, averaged)."""
    if n_visits <= 2:
        return {"a": "1", "b": "2", "va": "v1", "vb": "v2"}
    return {"a": "v", "b": "v+1", "va": "v", "vb": "v+1"}


def max_visits(result: dict) -> int:
    """The most visits any SMELT model of a `probe_pairs.probe_pairs` result makes to a layer (r)."""
    return max((d["visit"] for e in result["pairs"].values() for d in e["smelt"]["per_visit"].values()), default=1)


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
        self._memo: dict = {}   # every bootstrap draws the same units (one seed): compute each value once

    def value(self, name: str, w: np.ndarray | None = None) -> float | None:
        """Quantity `name` on units weighted by w (bootstrap multiplicities; None: each once), or None when the
        model lacks it (no experts, one head, no loop)."""
        key = (name, None if w is None else w.tobytes())
        if key in self._memo:
            return self._memo[key]
        q = QUANTITIES[name]
        if any(d not in self.cols for d in q.reads) or (q.experts and not self.meta["top_k"]):
            out = None
        else:
            means = []
            for d in q.reads:
                M, shape = self.cols[d]
                v = M.sum(0) if w is None else w @ M
                means.append(v[:-1].reshape(shape) / max(v[-1], _EPS))
            out = q.fn(*means, self.meta)
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


def panel_intervals(result: dict, n_draws: int = 1000, seed: int = 0, _cells_of: tuple | None = None) -> dict:
    """pair_intervals of every Fig. 23 quantity, as JSON: {quantity: {pair: Interval dict}}."""
    cells = _cells_of or _cells(result)
    return {q: {n: iv.to_dict() for n, iv in pair_intervals(result, q, n_draws, seed, cells).items()}
            for q, _ in panels()}


def _verdict(d: dict, direction: str, value: float) -> str:
    """The held-out interval's verdict where the across-pairs (training noise) interval agrees, else not resolved."""
    v = stats.verdict(d["interval"], direction, value)
    return v if v == stats.verdict(d["across_pairs"], direction, value) else "not resolved"


def claims(result: dict, n_draws: int = 1000, seed: int = 0, _cells_of: tuple | None = None) -> list[dict]:
    """Section 6's claims on a `probe_pairs.probe_pairs` result: held-out intervals (units resampled jointly for
    all pairs; prompts for Dyck), "across_pairs" (t-interval over the pairs: training noise), "parts", the verdict
    (`_verdict`; a claim of every cell also needs "weakest"). A quantity no pair has gives interval None."""
    names, cells = _cells_of or _cells(result)
    U = len(cells[0].keys) if cells else 0
    words = visit_words(max_visits(result))
    out = []
    for q, cl in claimed():
        have = [(n, c) for n, c in zip(names, cells) if c.value(q) is not None]
        d = {"id": cl.id, "quantity": q, "figure": cl.figure, "what": cl.what.format(**words), "paper": cl.paper,
             "direction": cl.direction, "value": cl.value,
             "unit": f"held-out document groups (n = {U}), resampled jointly for all pairs",
             "pairs": [n for n, _ in have]}
        if have:
            pick = min if cl.direction == ">" else max
            d["interval"] = _interval(U, lambda w: float(np.mean([c.value(q, w) for _, c in have])), n_draws, seed)
            d["weakest"] = _interval(U, lambda w: float(pick([c.value(q, w) for _, c in have])), n_draws, seed)
            d["per_pair"] = {n: _interval(U, lambda w, c=c: c.value(q, w), n_draws, seed) for n, c in have}
            d["across_pairs"] = stats.mean_interval([c.value(q) for _, c in have])
            d["parts"] = {p: float(np.mean([c.value(p) for _, c in have])) for p in cl.parts}
        else:
            d.update(interval=None, weakest=None, per_pair={}, across_pairs=None, parts={})
        d["verdict"] = _verdict(d, cl.direction, cl.value)
        if cl.every_cell and d["verdict"] == "reproduced" and stats.verdict(d["weakest"], cl.direction,
                                                                             cl.value) != "reproduced":
            d["verdict"] = "not resolved"   # on average yes, but not shown for every cell
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
        d["verdict"] = _verdict(d, sign, value)
        out.append(d)
    return out


def overlap_by_sparsity(result: dict, n_draws: int = 1000, seed: int = 0) -> dict:
    """Sec. 6.1: expert overlap / k falls as sparsity rises. Per scale (its Baseline's width and depth) with two
    pool sizes, the largest pool's SMELT minus the smallest's, averaged over scales, held-out bootstrap."""
    names, cells = _cells(result)
    groups: dict = {}
    for n, c in zip(names, cells):
        if c.value("expert_frac") is not None:
            cfg = result["pairs"][n]["baseline"].get("config", {})
            groups.setdefault((cfg.get("d_model"), cfg.get("n_layer")), []).append(c)
    pool = lambda c: c.meta["n_experts"]
    ends = [(min(g, key=pool), max(g, key=pool)) for g in groups.values() if len({pool(c) for c in g}) > 1]
    if not ends:
        return {"interval": None, "n_scales": 0, "why": "no scale has SMELT pairs at two expert-pool sizes"}
    stat = lambda w: float(np.mean([hi.value("expert_frac", w) - lo.value("expert_frac", w) for lo, hi in ends]))
    return {"interval": _interval(len(cells[0].keys), stat, n_draws, seed), "n_scales": len(ends), "why": None}


def claim_json(c: dict) -> dict:
    """A claim with its Intervals as dicts (for probes.json)."""
    iv = lambda x: None if x is None else x.to_dict()
    return {**c, "interval": iv(c["interval"]), "weakest": iv(c["weakest"]), "across_pairs": iv(c["across_pairs"]),
            "per_pair": {n: iv(x) for n, x in c["per_pair"].items()}}

