"""Parameter / FLOP / KV-cache accounting, compute-equivalent sparsity, budget matching, ladders (SMELT Sec. 3.2).

SMELT compares a looped MoE transformer with an unlooped Baseline at equal per-token training FLOPs, total
non-embedding parameters and KV cache. One table, `_sublayers`, gives per sub-layer how many are stored and run
(loop.plan), the parameters of one and the weights a token passes per visit: count_params and flops_per_token
(6 per weight passed, plus 12*q*ctx/2 attention-score FLOPs per attention visit at the *document* length ctx;
SMELT's F leaves the output head out) both sum it; kv_bytes_per_token counts executed attention visits.
sparsity is SMELT Eq. 1 against `dense_control`. `match` keeps depth, top_k, the loop and the shared experts and
searches d_model, d_ff and heads (numpy grid, experts in closed form): of the candidates within F in [1, 1.04],
N +-1 %, KV +-4 % the shape nearest the Baseline's (so a small change of a count moves it at most a step). ladder_cells / ladder: a preset's Baseline and matched SMELT per cell.
Formulas, conventions and measured figures: docs/budget.md. Read before: model.py, loop.py, moe.py.
Read next: train.py (what a run costs), scaling.py (S, C and TPP in the fits).
"""
from __future__ import annotations

import argparse
import json
import math
import numbers
import os
import time
import warnings
from dataclasses import dataclass, replace

import numpy as np

import checks
import configs
import loop as looping
from loop import SMELT, LoopConfig, LoopSpec, add_loop_args, loop_spec
from model import ModelConfig

CONVENTIONS = ("smelt", "howtoloop")
TOLERANCES = {"flops": 0.04, "params": 0.01, "kv": 0.04}   # SMELT Table 3.2 (F one-sided: tolerance_bands)
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12}   # dense, datasheets: MFU


# ---- Width-independent facts of a config: what is stored and what runs ---------------------------

@dataclass(frozen=True)
class Plan:
    n_layer: int; moe: bool; top_k: int; vocab: int; tied: bool
    attn_visits: int            # executed attention sub-layers per token
    mlp_visits: int             # executed feed-forward sub-layers per token
    n_loops: int                # adapter L (rows of A, B, M)
    adapter: str; rank: int
    adapter_attn_layers: int    # layers whose attention holds adapters (a repeated sub-layer in the span)
    adapter_mlp_layers: int     # layers whose dense MLP holds adapters
    adapter_attn_visits: int    # attention visits through adapted projections
    adapter_mlp_visits: int     # dense MLP visits through adapted projections
    window: int                 # PLT kv_window (0: none)
    window_layers: int
    window_visits: int          # attention visits of loops >= 2 on KV-sharing layers (gate + window)
    n_inject: int               # PLT re-injections (r - 1)
    inject: str


def plan_of(cfg: ModelConfig, loop: LoopConfig | None = None) -> Plan:
    """The Plan of cfg, or of cfg's depth and expert type under another loop."""
    lc = cfg.loop if loop is None else loop
    visits = looping.plan(cfg.n_layer, lc)
    moe = cfg.n_experts > 0
    looped = [lc.active and lc.in_span(i) for i in range(cfg.n_layer)]
    ad_attn = [lc.adapted(i, "attn") for i in range(cfg.n_layer)]
    ad_mlp = [lc.adapted(i, "mlp", moe) for i in range(cfg.n_layer)]
    win = lc.kv_window if lc.active else 0
    attn_v, mlp_v = looping.executed_visits(cfg.n_layer, lc)
    return Plan(
        n_layer=cfg.n_layer, moe=moe, top_k=cfg.top_k, vocab=cfg.vocab_size, tied=cfg.tie_embeddings,
        attn_visits=attn_v, mlp_visits=mlp_v, n_loops=lc.n_loops, adapter=lc.adapter, rank=lc.adapter_rank,
        adapter_attn_layers=sum(ad_attn), adapter_mlp_layers=sum(ad_mlp),
        adapter_attn_visits=sum(v.attn for v in visits if ad_attn[v.layer]),
        adapter_mlp_visits=sum(v.mlp for v in visits if ad_mlp[v.layer]),
        window=win, window_layers=sum(looped) if win else 0,
        window_visits=sum(v.attn and v.visit >= 1 for v in visits if win and looped[v.layer]),
        n_inject=lc.n_loops - 1 if lc.parallel else 0, inject=lc.inject)


def _widths(cfg: ModelConfig) -> dict:
    return dict(d=cfg.d_model, nh=cfg.n_head, nkv=cfg.n_kv_head, hd=cfg.hd, ff=cfg.d_ff, E=cfg.n_experts,
                sh=cfg.n_shared_experts)


# ---- The sub-layer table (6 FLOPs per weight passed); Python ints give exact counts, numpy arrays the grid ----

def _adapters(p: Plan, shapes):
    """Loop adapters of the projections (d_in, d_out): L pairs A (rank x d_in), B (d_out x rank) each and,
    for Loop Matrix / Softmax, M (L x L); a visit passes its own pair (LoRA) or all L and one row of M."""
    pairs = sum(p.rank * (d_in + d_out) for d_in, d_out in shapes)
    mix = len(shapes) if p.adapter in ("matrix", "softmax") else 0
    passed = 1 if p.adapter == "lora" else p.n_loops
    return p.n_loops * pairs + mix * p.n_loops ** 2, passed * pairs + mix * p.n_loops


def _plt_inject(d, inject: str, counted):
    """PLT re-injection of one loop >= 2: "add" nothing; "norm_half" two gains; "norm_gate" those and the
    gate, down (2D x R), up (R x D) and its bias (D), R = loop.GATE_RANK."""
    gains = {"add": 0, "norm_half": 2, "norm_gate": 2}[inject]
    gate = 2 * d * looping.GATE_RANK + looping.GATE_RANK * d + d if inject == "norm_gate" else 0
    return gains * d + gate, gains * counted * d + gate


def _sublayers(p: Plan, d, nh, nkv, hd, ff, E, sh, counted=1) -> dict:
    """{sub-layer: (instances stored, visits per token, parameters of one, weights passed per visit)};
    counted=0: How-to-Loop counts no norm FLOPs."""
    q, kv, L = nh * hd, nkv * hd, p.n_layer
    attn = 2 * d * q + 2 * d * kv                                   # wq, wo (D x q) and wk, wv (D x kv)
    subs = {"attention": (L, p.attn_visits, attn, attn),
            "attn_norm": (L, p.attn_visits, d, counted * d),       # an RMSNorm gain
            "mlp_norm": (L, p.mlp_visits, d, counted * d),
            "final_norm": (1, 1, d, counted * d),
            "attn_adapters": (p.adapter_attn_layers, p.adapter_attn_visits,
                              *_adapters(p, [(d, q), (d, kv), (d, kv), (q, d)])),   # q, k, v, o
            "kv_gates": (p.window_layers, p.window_visits, nh * d, nh * d),   # PLT KV sharing's gate (n_head x D)
            "plt": (p.n_inject, p.n_inject, *_plt_inject(d, p.inject, counted))}
    if p.moe:   # the router W_r (E x D) scores every expert; E SwiGLU experts stored, top_k passed; no adapters
        subs.update(router=(L, p.mlp_visits, E * d, E * d),
                    experts=(L, p.mlp_visits, 3 * E * d * ff, 3 * p.top_k * d * ff),
                    shared_experts=(L, p.mlp_visits, 3 * sh * d * ff, 3 * sh * d * ff))   # always active
    else:       # dense SwiGLU: gate, up (D x d_ff) and down (d_ff x D)
        subs.update(swiglu=(L, p.mlp_visits, 3 * d * ff, 3 * d * ff),
                    mlp_adapters=(p.adapter_mlp_layers, p.adapter_mlp_visits,
                                  *_adapters(p, [(d, ff), (d, ff), (ff, d)])))      # gate, up, down
    return subs


GROUPS = {"attention": ("attention",), "ffn": ("swiglu", "router", "experts", "shared_experts"),
          "norms": ("attn_norm", "mlp_norm", "final_norm"), "adapters": ("attn_adapters", "mlp_adapters"),
          "kv_gates": ("kv_gates",), "plt": ("plt",)}   # param_breakdown's groups


def _params(p: Plan, d, nh, nkv, hd, ff, E, sh) -> dict:
    subs = _sublayers(p, d, nh, nkv, hd, ff, E, sh)
    out = {g: sum(subs[s][0] * subs[s][2] for s in names if s in subs) for g, names in GROUPS.items()}
    out["blocks"] = sum(out.values())
    n, _, stored, passed = subs["experts"] if p.moe else (0, 0, 0, 0)
    out["active"] = out["blocks"] - n * (stored - passed)     # less the pool's experts a token skips
    out["embedding"] = p.vocab * d                             # a lookup: no FLOPs
    out["head"] = 0 if p.tied else p.vocab * d
    return out


def _flops(p: Plan, ctx: float, convention: str, include_head: bool, d, nh, nkv, hd, ff, E, sh):
    counted = 1 if convention == "smelt" else 0              # How-to-Loop counts no norm gains
    w = sum(visits * passed for _, visits, _, passed in _sublayers(p, d, nh, nkv, hd, ff, E, sh, counted).values())
    # a windowed query's keys: the mean over positions t in (0, ctx] of min(t, window)
    window_keys = ctx / 2 if p.window >= ctx else p.window - p.window * p.window / (2 * ctx)
    keys = p.attn_visits * ctx / 2 + (p.window_visits * window_keys if p.window else 0)
    coef = 12 if convention == "smelt" else 14               # attention-score FLOPs per (query width x key)
    # the output head: FLOPs also when tied to the embedding
    return 6 * w + coef * (nh * hd) * keys + (6 * (p.vocab * d) if include_head else 0)


def _kv_slots(p: Plan, ctx: float | None) -> float:
    """Cached (key, value) positions per token, summed over attention visits."""
    # a later loop's ring holds the w - 1 keys before the query's own (attention.Attention._ring_attend)
    later = p.window_layers * (p.n_loops - 1) * (1 - min(p.window - 1, ctx) / ctx) if p.window else 0
    return p.attn_visits - later


# ---- The tolerance check (SMELT Table 3.2) -------------------------------------------------------

def tolerance_bands(tolerances: dict | None = None) -> dict:
    """{"flops", "params", "kv"}: (lo, hi) of each SMELT / Baseline ratio; F one-sided, [1, 1 + tol]."""
    tol = {**TOLERANCES, **(tolerances or {})}
    return {k: (1.0 if k == "flops" else 1.0 - t, 1.0 + t) for k, t in tol.items()}


def mismatch(flops_ratio, params_ratio, kv_ratio, tolerances: dict | None = None):
    """The worst ratio's distance from its band's centre in half-bands (<= 1: within); scalars or arrays."""
    x = {"flops": flops_ratio, "params": params_ratio, "kv": kv_ratio}
    return np.maximum.reduce([np.abs(np.asarray(x[k], dtype=float) - (lo + hi) / 2) / ((hi - lo) / 2)
                              for k, (lo, hi) in tolerance_bands(tolerances).items()])


def within_tolerance(flops_ratio, params_ratio, kv_ratio, tolerances: dict | None = None) -> bool:
    """Whether all three ratios lie in tolerance_bands (the one check; docs/budget.md)."""
    return bool(mismatch(flops_ratio, params_ratio, kv_ratio, tolerances) <= 1 + 1e-9)


# ---- Public accounting ---------------------------------------------------------------------------

def _check_cfg(cfg) -> None:
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"expected a model.ModelConfig, got {type(cfg).__name__}")
    cfg.validate()


def _check_ctx(cfg: ModelConfig, ctx_len) -> None:
    if isinstance(ctx_len, bool) or not isinstance(ctx_len, numbers.Real) or not ctx_len > 0:
        raise ValueError(f"ctx_len must be a number > 0 (tokens of document length), got {ctx_len!r}")
    if ctx_len > cfg.block_size:
        raise ValueError(f"ctx_len={ctx_len} exceeds block_size={cfg.block_size}: no token attends that far")


def param_breakdown(cfg: ModelConfig) -> dict:
    """Every parameter group: attention, ffn, norms, adapters, kv_gates, plt, blocks, active, embedding, head."""
    _check_cfg(cfg)
    return _params(plan_of(cfg), **_widths(cfg))


def count_params(cfg: ModelConfig) -> dict:
    """{"blocks", "active", "embedding", "head"}; blocks + embedding + head == GPT(cfg) parameters."""
    b = param_breakdown(cfg)
    return {k: b[k] for k in ("blocks", "active", "embedding", "head")}


def _head_default(convention: str, include_head: bool | None) -> bool:
    """Each paper's own convention: SMELT's F leaves the output head out, How-to-Loop's counts it."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    if include_head is not None and not isinstance(include_head, bool):
        raise ValueError(f"include_head must be True, False or None, got {include_head!r}")
    return convention == "howtoloop" if include_head is None else include_head


def flops_per_token(cfg: ModelConfig, ctx_len: float, convention: str = "smelt",
                    include_head: bool | None = None) -> float:
    """Training FLOPs per token at document length ctx_len; include_head None: the convention's choice."""
    _check_cfg(cfg)
    _check_ctx(cfg, ctx_len)
    head = _head_default(convention, include_head)
    return float(_flops(plan_of(cfg), ctx_len, convention, head, **_widths(cfg)))


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_elem: int = 2, ctx_len: float | None = None):
    """KV-cache bytes per token; with PLT KV sharing (kv_window > 0) pass ctx_len, the cache length."""
    _check_cfg(cfg)
    if isinstance(bytes_per_elem, bool) or not isinstance(bytes_per_elem, int) or bytes_per_elem <= 0:
        raise ValueError(f"bytes_per_elem must be a positive int, got {bytes_per_elem!r}")
    p = plan_of(cfg)
    if p.window:
        if ctx_len is None:
            raise ValueError("kv_bytes_per_token: loop.kv_window > 0 amortises each later loop's window "
                             "over the context; pass ctx_len (the cache length in tokens)")
        _check_ctx(cfg, ctx_len)
    return 2 * cfg.n_kv_head * cfg.hd * bytes_per_elem * _kv_slots(p, ctx_len)


def step_memory(cfg: ModelConfig, rows: int, T: int, train: bool = True, grad_accum: int = 1, shards: int = 1,
                weight_bytes: int = 4) -> dict[str, int]:
    """A lower bound on one step's bytes on one device, by term, for `rows` sequences of T tokens. train: fp32
    weights, gradients and AdamW's two moments (/ shards under FSDP), the batch's three int64 tensors, one
    micro-batch's fp32 logits and their gradient, and the residual stream (bf16) saved at every layer visit;
    else the weights, the tokens, fp32 logits and one layer's residual stream."""
    _check_cfg(cfg)
    c, p = count_params(cfg), plan_of(cfg)
    n, micro = c["blocks"] + c["embedding"] + c["head"], max(1, rows // grad_accum)
    if train:
        return {"parameters": 16 * n // shards, "batch": 24 * rows * T, "logits": 8 * micro * T * cfg.vocab_size,
                "activations": 2 * micro * T * cfg.d_model * (p.attn_visits + p.mlp_visits)}
    return {"parameters": weight_bytes * n, "batch": 8 * rows * T, "logits": 4 * rows * T * cfg.vocab_size,
            "activations": 4 * rows * T * cfg.d_model}


_SIZE_FIELDS = ("vocab_size", "d_model", "d_ff", "n_experts", "n_layer", "n_head", "head_dim")


def _dominant(cfg: ModelConfig, rows: int, T: int, need, rows_name: str) -> tuple[str, int]:
    """The setting `need(cfg, rows, T)` grows fastest with (its doubling's log2 ratio); near-ties go to the one
    furthest above its default (ModelConfig's, 8 rows), so a vocabulary of 2e9 is named, not the batch."""
    base, out = need(cfg, rows, T), []
    for name, value, default in ((rows_name, rows, 8), ("block_size", T, ModelConfig.block_size),
                                 *((f, getattr(cfg, f), getattr(ModelConfig, f)) for f in _SIZE_FIELDS)):
        if not value:
            continue
        try:
            doubled = (need(cfg, 2 * rows, T) if name == rows_name else need(cfg, rows, 2 * T) if name == "block_size"
                       else need(replace(cfg, **{name: 2 * value}), rows, T))
        except ValueError:   # a doubling the config refuses (e.g. heads the KV heads no longer divide)
            continue
        out.append((round(math.log2(doubled / base), 1), math.log(value / (default or 1)), name, value))
    _, _, name, value = max(out)
    return name, value


def oversized(cfg: ModelConfig, device, rows: int, T: int, what: str, rows_name: str = "batch_size",
              train: bool = False, grad_accum: int = 1, shards: int = 1, weight_bytes: int = 4, rows_hint: str = "",
              model_hint: str = "", rows_shown: int | None = None) -> str | None:
    """One line naming the setting that dominates when step_memory exceeds what `device` can give (None: it fits).
    The way out: "lower NAME" (and rows_hint when the rows dominate; model_hint instead when a model size does
    and the caller cannot change it); rows_shown: the rows as the user set them (all ranks' batch)."""
    def need(c, r, t):
        return sum(step_memory(c, r, t, train, grad_accum, shards, weight_bytes).values())
    terms, have = step_memory(cfg, rows, T, train, grad_accum, shards, weight_bytes), checks.available_memory(device)
    if have is None or sum(terms.values()) <= have:
        return None
    name, value = _dominant(cfg, rows, T, need, rows_name)
    parts = ", ".join(f"{k} {checks.format_bytes(v)}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v)
    if name == rows_name:
        value, fix = rows if rows_shown is None else rows_shown, f"lower {name}" + (f" or {rows_hint}" * bool(rows_hint))
    else:
        fix = model_hint or f"lower {name}"
    return (f"{name}={value}: {what} needs at least {checks.format_bytes(sum(terms.values()))} on {device} ({parts}), "
            f"more than the {checks.format_bytes(have)} available there: {fix}")


def refuse_oversized(*args, **kw) -> None:
    """checks.TooLargeError with `oversized`'s line, if any. Every entry point that builds a model or a batch calls
    it first: train.py, reproduce.py, lab.bench, eval.load_model (lab.evaluate), lab.probe_pairs, profile_step."""
    if msg := oversized(*args, **kw):
        raise checks.TooLargeError(msg)


def sparsity(F: float, N: float, F0: float, N0: float) -> float:
    """SMELT Eq. 1: N_act^eq = (F/F0) N0, S = 1 - N_act^eq / N."""
    if bad := [f"{k}={v!r}" for k, v in (("F", F), ("N", N), ("F0", F0), ("N0", N0)) if not v > 0]:
        raise ValueError(f"sparsity: F, N, F0, N0 must be > 0, got {', '.join(bad)}")
    return 1.0 - (F / F0) * N0 / N


def dense_control(cfg: ModelConfig) -> ModelConfig:
    """The fully-active control: cfg unlooped with n_experts = top_k (a dense config: itself, unlooped)."""
    _check_cfg(cfg)
    return replace(cfg, n_experts=cfg.top_k if cfg.n_experts else 0, loop=LoopConfig())


def config_sparsity(cfg: ModelConfig, ctx_len: float, control: ModelConfig | None = None,
                    include_head: bool = False) -> float:
    """S of cfg (Eq. 1) against `control` (default dense_control(cfg); a matched looped model: its Baseline's)."""
    control = dense_control(cfg) if control is None else control
    return sparsity(flops_per_token(cfg, ctx_len, include_head=include_head), count_params(cfg)["blocks"],
                    flops_per_token(control, ctx_len, include_head=include_head), count_params(control)["blocks"])


# ---- Budget matching (SMELT 3.2) -----------------------------------------------------------------

SEARCH_DEFAULTS = dict(
    d_range=(0.5, 1.0),      # d_model as a fraction of the Baseline's
    d_multiple=None,         # alignment of d_model (None: 8 from d_model 256 up, else 4)
    ff_band=0.25,            # per-expert width within +-25% of Baseline d_ff * D/D0
    ff_multiple=None,        # alignment of d_ff (None: 8 from d_ff 256 up, else 4)
    q_band=0.25,             # query width n_head*head_dim within +-25% of the Baseline's q/D * D
    hd_range=(0.5, 1.5),     # head_dim as a fraction of the Baseline's
    head_dim_multiple=None,  # alignment of head_dim (None: 8 from head_dim 64 up, else 2)
    head_dims=None,          # explicit head_dim candidates (overrides hd_range)
    n_kv_heads=None,         # explicit n_kv_head candidates (default 1 .. 2 * Baseline's)
    expert_multiple=1,       # expert count alignment
    tolerances=None,         # {"flops", "params", "kv"} (default SMELT's 4 %, 1 %, 4 %)
    include_head=None,       # count the output head in FLOPs (None: the convention's choice; SMELT: no)
    min_head_dim=16,         # CUDA flex attention needs head_dim >= 16 (inductor: "NYI ... at least 16")
    convention="smelt",
)


def _search_options(base: ModelConfig, search: dict) -> dict:
    if unknown := sorted(set(search) - set(SEARCH_DEFAULTS)):
        raise ValueError(f"match: unknown search option(s) {unknown}; known: {sorted(SEARCH_DEFAULTS)}")
    o = {**SEARCH_DEFAULTS, **search}
    o["d_multiple"] = o["d_multiple"] or (8 if base.d_model >= 256 else 4)
    o["ff_multiple"] = o["ff_multiple"] or (8 if base.d_ff >= 256 else 4)
    o["head_dim_multiple"] = o["head_dim_multiple"] or (8 if base.hd >= 64 else 2)
    o["tolerances"] = {**TOLERANCES, **(o["tolerances"] or {})}
    o["include_head"] = _head_default(o["convention"], o["include_head"])
    for name, least in (("min_head_dim", 2), ("d_multiple", 1), ("ff_multiple", 1), ("head_dim_multiple", 1),
                        ("expert_multiple", 1)):
        if not isinstance(o[name], int) or o[name] < least:
            raise ValueError(f"match: {name} must be an int >= {least}, got {o[name]!r}")
    if not 0 < o["d_range"][0] <= o["d_range"][1]:
        raise ValueError(f"match: d_range must satisfy 0 < lo <= hi, got {o['d_range']}")
    if o["head_dim_multiple"] % 2:
        raise ValueError("match: head_dim_multiple must be even (RoPE rotates pairs)")
    for k, v in o["tolerances"].items():
        if k not in TOLERANCES or not v > 0:
            raise ValueError(f"match: tolerances must map flops/params/kv to values > 0, got {k}={v!r}")
    if not (0 <= o["ff_band"] < math.inf and 0 <= o["q_band"] < math.inf):   # NaN fails too
        raise ValueError(f"match: ff_band and q_band must be >= 0 and finite, got {o['ff_band']}, {o['q_band']}")
    return o


def _multiples(span: tuple, x: float, m: int):   # the multiples of m in [span[0] * x, span[1] * x]
    return np.arange(math.ceil(span[0] * x / m), math.floor(span[1] * x / m) + 1) * m


def _near(center, step: int, band: float):
    """Multiples of `step` within +-band of each center (array, shape (n,)), the nearest one always kept:
    (index of its center, multiple) of every candidate."""
    span = int(band * center.max() / step) + 1
    off = np.arange(-span, span + 1) * step
    vals = np.maximum(np.rint(center / step), 1)[:, None] * step + off[None, :]
    ok = (vals >= step) & ((np.abs(vals / center[:, None] - 1) <= band + 1e-9) | (off[None, :] == 0))
    r, c = np.nonzero(ok)
    return r, vals[r, c]


def _head_pairs(b: ModelConfig, o: dict, ps: Plan, ctx_len: float, kv_b: float):
    """(head_dim, n_kv_head) candidates, flattened: KV depends only on them, so keep the pairs that match it."""
    hds = (np.array(sorted(set(o["head_dims"])), dtype=float) if o["head_dims"] else
           np.union1d(_multiples(o["hd_range"], b.hd, o["head_dim_multiple"]), [b.hd]).astype(float))
    hds = hds[(hds >= o["min_head_dim"]) & (hds % 2 == 0)]
    kvh = np.array(o["n_kv_heads"] or range(1, 2 * b.n_kv_head + 1), dtype=float)
    HD, KVH = (a.ravel() for a in np.meshgrid(hds, kvh))
    if not HD.size:
        raise ValueError(f"match: no valid head_dim candidates (even, >= min_head_dim={o['min_head_dim']})")
    kv_err = np.abs(KVH * HD * _kv_slots(ps, ctx_len) / kv_b - 1)
    lo, hi = tolerance_bands(o["tolerances"])["kv"]
    keep = kv_err <= (hi - lo) / 2 + 1e-12
    if not keep.any():
        keep = kv_err <= kv_err.min() * (1 + 1e-9) + 1e-12
    return HD[keep], KVH[keep]


def _grid(b: ModelConfig, o: dict, HD, KVH):
    """d_model grid x head pairs, then n_head and d_ff around the Baseline's proportions: candidate arrays
    (D, n_head, n_kv_head, head_dim, d_ff)."""
    ds = _multiples(o["d_range"], b.d_model, o["d_multiple"])
    if not ds.size:
        raise ValueError(f"match: no d_model multiple of {o['d_multiple']} in d_range {o['d_range']} x {b.d_model}")
    D, I = (a.ravel() for a in np.meshgrid(ds.astype(float), np.arange(HD.size)))
    hd, nkv = HD[I], KVH[I]
    r, groups = _near(b.n_head * b.hd / b.d_model * D / hd / nkv, 1, o["q_band"])   # n_head / n_kv_head
    D, hd, nkv = D[r], hd[r], nkv[r]
    r, ff = _near(b.d_ff / b.d_model * D, o["ff_multiple"], o["ff_band"])
    return D[r], (groups * nkv)[r], nkv[r], hd[r], ff


def _counts(cfg: ModelConfig, ctx_len: float, o: dict) -> tuple[float, int, float]:
    """(F, blocks, KV slots x width) of cfg under the search's convention: what a match's ratios compare."""
    return (flops_per_token(cfg, ctx_len, o["convention"], o["include_head"]), count_params(cfg)["blocks"],
            cfg.n_kv_head * cfg.hd * _kv_slots(plan_of(cfg), ctx_len))


def _match_report(b: ModelConfig, cfg: ModelConfig, ctx_len: float, o: dict, candidates: int, t0: float) -> dict:
    """The report of cfg matched to b's budgets, recounted through the scalar path."""
    tol, conv, head = o["tolerances"], o["convention"], o["include_head"]
    (F_b, N_b, kv_b), (Fm, Nm, kvm) = _counts(b, ctx_len, o), _counts(cfg, ctx_len, o)
    rep = {"flops_ratio": Fm / F_b, "params_ratio": Nm / N_b, "kv_ratio": kvm / kv_b,
           # the other head convention, reported beside the matched one (not matched on)
           "flops_ratio_other_head": (flops_per_token(cfg, ctx_len, conv, not head)
                                      / flops_per_token(b, ctx_len, conv, not head))}
    ratios = (rep["flops_ratio"], rep["params_ratio"], rep["kv_ratio"])
    rep.update(within_tolerance=within_tolerance(*ratios, tol), worst=float(mismatch(*ratios, tol)), tolerances=tol,
               ctx_len=ctx_len, convention=conv, include_head=head, flops=(F_b, Fm), params=(float(N_b), Nm),
               kv_bytes_bf16=(4 * kv_b, 4 * kvm), candidates=candidates, seconds=time.perf_counter() - t0,
               message="matched within tolerance")
    if not rep["within_tolerance"]:
        rep["message"] = (f"no candidate within tolerance (flops +0..{tol['flops']:.0%}, params {tol['params']:.0%}, "
                          f"kv {tol['kv']:.0%}); best: flops x{rep['flops_ratio']:.3f}, params "
                          f"x{rep['params_ratio']:.3f}, kv x{rep['kv_ratio']:.3f}")
        warnings.warn(f"match: {rep['message']}", RuntimeWarning, stacklevel=3)
    return rep


GEOMETRY = ("d_model", "n_head", "n_kv_head", "head_dim", "d_ff", "n_experts")   # what a match chooses


def fixed_match(base_cfg: ModelConfig, loop: LoopConfig, ctx_len: float, geometry: tuple, **search):
    """(config, match's report) of a given GEOMETRY on base_cfg with `loop` (configs.PAPER_SMELT's)."""
    t0, o = time.perf_counter(), _search_options(base_cfg, search)
    _check_ctx(base_cfg, ctx_len)
    cfg = replace(base_cfg, loop=loop, **dict(zip(GEOMETRY, geometry)))
    return cfg, _match_report(base_cfg, cfg, ctx_len, o, 1, t0)


def match(base_cfg: ModelConfig, loop: LoopConfig, ctx_len: float, target: ModelConfig | None = None,
          **search) -> tuple[ModelConfig, dict]:
    """The looped config matching base_cfg's FLOPs per token, blocks and KV cache (depth, top_k, vocab and
    n_shared_experts the Baseline's, the loop `loop`) and its _match_report; search: SEARCH_DEFAULTS options.
    Of the candidates within tolerance the one whose shape is nearest the Baseline's, else the least mismatch.
    target: match target's budgets instead, base_cfg still giving the depth and the widths the search is centred
    on (scripts/depth_sweep.py: a depth-P model against a depth-L reference)."""
    t0, b, tgt = time.perf_counter(), base_cfg, base_cfg if target is None else target
    _check_cfg(b)
    if not isinstance(loop, LoopConfig):
        raise ValueError(f"match: loop must be a loop.LoopConfig, got {type(loop).__name__}")
    loop.validate(b.n_layer)
    _check_ctx(b, ctx_len)
    _check_cfg(tgt)
    o, ps, sh = _search_options(b, search), plan_of(b, loop), b.n_shared_experts
    F_b, N_b, kv_b = _counts(tgt, ctx_len, o)
    D, nh, nkv, hd, ff = _grid(b, o, *_head_pairs(b, o, ps, ctx_len, kv_b))
    E = np.zeros_like(D)
    if ps.moe:   # expert count: blocks are linear in E -> solve, try the two neighbouring multiples
        rest = _params(ps, D, nh, nkv, hd, ff, 0, sh)["blocks"]
        per = _params(ps, D, nh, nkv, hd, ff, 1, sh)["blocks"] - rest
        m_e, e_star = o["expert_multiple"], (N_b - rest) / per / o["expert_multiple"]
        E = np.concatenate([np.floor(e_star), np.ceil(e_star)]) * m_e
        E = np.maximum(E, math.ceil(b.top_k / m_e) * m_e)
        D, nh, nkv, hd, ff = (np.concatenate([a, a]) for a in (D, nh, nkv, hd, ff))
    F = _flops(ps, ctx_len, o["convention"], o["include_head"], D, nh, nkv, hd, ff, E, sh) / F_b
    N = _params(ps, D, nh, nkv, hd, ff, E, sh)["blocks"] / N_b
    worst = mismatch(F, N, nkv * hd * _kv_slots(ps, ctx_len) / kv_b, o["tolerances"])
    shape = (np.abs(np.log(ff / (b.d_ff / b.d_model * D)))
             + np.abs(np.log(nh * hd / D / (b.n_head * b.hd / b.d_model)))
             + np.abs(np.log(hd / b.hd)) + np.abs(np.log(nkv / b.n_kv_head)))
    # within tolerance: the shape nearest the Baseline's (the accounting only decides who is in), equal shapes
    # (the two expert counts of one geometry) by mismatch; none within: the least mismatch (docs/budget.md)
    within = worst <= 1 + 1e-9                                      # = within_tolerance
    best = (np.lexsort((worst, np.where(within, shape, np.inf))) if within.any()
            else np.lexsort((shape, worst)))[0]
    cfg = replace(b, loop=loop, **{k: int(a[best]) for k, a in zip(GEOMETRY, (D, nh, nkv, hd, ff, E))})
    return cfg, _match_report(tgt, cfg, ctx_len, o, int(D.size), t0)


# ---- Ladders (SMELT Appendix A; the preset tables are configs.LADDERS) ---------------------------

def _ladder(preset: str) -> dict:
    if preset not in configs.LADDERS:
        raise ValueError(f"preset must be one of {sorted(configs.LADDERS)}, got {preset!r}")
    return configs.LADDERS[preset]


def preset_search(preset: str) -> dict:
    """A preset ladder's match search options (configs.LADDERS): every match of its configs starts from them."""
    return dict(_ladder(preset).get("search", {}))


def preset_doc_length(preset: str, data=None) -> float:
    """The document length a preset's ladder is matched and its F counted at: measured on its prepared data
    (`data`, default the cached TokenData) at its block size, as train.py's rows; paper: configs.PAPER_DOC_LEN."""
    p = _ladder(preset)
    if p["data"] is None:
        return float(configs.PAPER_DOC_LEN)
    import data as data_mod
    if data is None:
        path = data_mod.default_data_dir(p["data"])
        if not os.path.exists(os.path.join(path, "manifest.json")):
            raise FileNotFoundError(f"preset {preset!r}: the ladder is matched at the document length of its data, "
                                    f"and {path} is not prepared: run `python -m lab.corpus --preset {p['data']}` "
                                    f"(or pass ctx_len / --ctx-len explicitly)")
        data = data_mod.TokenData(path)
    return data_mod.measured_doc_length(data, p["block"])


def preset_baselines(preset: str) -> list[tuple[str, str, ModelConfig]]:
    """[(scale, sparsity label, Baseline ModelConfig)] for "tiny", "small" or "paper"."""
    p = _ladder(preset)
    return [(scale, label, ModelConfig(vocab_size=p["vocab"], block_size=p["block"], n_layer=L, d_model=d, n_head=nh,
                                       n_kv_head=nkv, head_dim=hd, d_ff=ff, n_experts=E, top_k=p["top_k"]))
            for scale, d, L, nh, nkv, hd, ff in p["scales"] for label, E in p["pools"]]


def _row(scale, label, arch, cfg, ctx, control) -> dict:
    c, lc = count_params(cfg), cfg.loop
    return dict(scale=scale, sparsity=label, arch=arch, d_model=cfg.d_model, n_layer=cfg.n_layer,
                n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, head_dim=cfg.hd, d_ff=cfg.d_ff, n_experts=cfg.n_experts,
                top_k=cfg.top_k, loop=f"{lc.start + 1}-{lc.start + lc.length} x{lc.n_loops}" if lc.active else "-",
                active=c["active"], blocks=c["blocks"], S=config_sparsity(cfg, ctx, control),
                flops=flops_per_token(cfg, ctx), flops_with_head=flops_per_token(cfg, ctx, include_head=True),
                kv_bytes=kv_bytes_per_token(cfg, 2, ctx))


def ladder_cells(preset: str, ctx_len: float, vocab_size: int | None = None, arms: dict | None = None,
                 **search) -> list[dict]:
    """Every cell of a preset's grid (the one ladder builder, for `ladder` and reproduce.py): {"scale",
    "sparsity_label", "ctx_len", "baseline" and each arm of `arms` (name -> loop.LoopSpec, default {"smelt": SMELT})
    as a ModelConfig dict, "match": {arm: match's report, "source": "matched" | "published" (LADDERS "smelt"
    geometries, for SMELT's own loop)}}. Each arm loops spec.at(n_layer); every model gets the arms' common
    n_shared_experts (configs.Plan checks it); vocab_size: the data's (not in F)."""
    arms = {"smelt": SMELT} if arms is None else arms
    cells, opts = [], {**preset_search(preset), **search}
    shared = next(iter(arms.values())).n_shared_experts
    for scale, label, base in preset_baselines(preset):
        base = replace(base, vocab_size=vocab_size or base.vocab_size, n_shared_experts=shared)
        cell = {"scale": scale, "sparsity_label": label, "ctx_len": float(ctx_len), "baseline": base.to_dict(),
                "match": {}}
        for arm, spec in arms.items():
            loop = spec.at(base.n_layer)
            fixed = configs.LADDERS[preset].get("smelt", {}).get((scale, label))
            published = fixed is not None and loop == SMELT.at(base.n_layer) and not spec.n_shared_experts
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)   # the report and the table say it instead
                cfg, rep = (fixed_match(base, loop, ctx_len, fixed, **opts) if published
                            else match(base, loop, ctx_len, **opts))
            rep["source"] = "published" if published else "matched"
            cell[arm], cell["match"][arm] = cfg.to_dict(), rep
        cells.append(cell)
    return cells


def ladder(preset: str, ctx_len: float | None = None, spec: LoopSpec = SMELT, **search) -> list[dict]:
    """Baseline and SMELT (looping `spec`) table rows of every ladder_cells cell at document length ctx_len (default
    preset_doc_length(preset)); F leaves the head out (SMELT's), the rows also give F with it."""
    ctx = preset_doc_length(preset) if ctx_len is None else ctx_len
    rows = []
    for i, cell in enumerate(ladder_cells(preset, ctx, arms={"smelt": spec}, **search)):
        base, cfg = ModelConfig.from_dict(cell["baseline"]), ModelConfig.from_dict(cell["smelt"])
        scale, label, control, rep = cell["scale"], cell["sparsity_label"], dense_control(base), cell["match"]["smelt"]
        rows.append(_row(scale, label, "Baseline", base, ctx, control))
        row = _row(scale, label, "SMELT", cfg, ctx, control)
        row.update(flops_ratio=rep["flops_ratio"], params_ratio=rep["params_ratio"], kv_ratio=rep["kv_ratio"],
                   flops_ratio_with_head=rep["flops_ratio_other_head"] if not rep["include_head"]
                   else rep["flops_ratio"], within_tolerance=rep["within_tolerance"], seconds=rep["seconds"])
        if preset == "paper":
            pub = configs.PAPER_PUBLISHED[scale][i % len(configs.PAPER_POOLS)]
            rows[-1]["paper_S"] = pub[0]
            row.update(paper_d_model=pub[1], paper_n_experts=pub[2], paper_flops_ratio=pub[3], paper_kv_ratio=pub[4])
        rows.append(row)
    return [{**r, "ctx_len": float(ctx)} for r in rows]


def format_ladder(rows: list[dict]) -> str:
    """A fixed-width table of ladder rows. F, N, KV: the matched ratios (F without the head, SMELT's); F+head."""
    paper = "paper_flops_ratio" in rows[-1]
    head = (f"{'scale':>6} {'S label':>7} {'arch':>8} {'D':>5} {'L':>3} {'H/Hkv x hd':>12} {'d_ff':>5} {'E':>4} "
            f"{'k':>2} {'loop':>8} {'active':>9} {'total':>9} {'S':>6} {'F':>6} {'N':>6} {'KV':>6} {'ok':>3} "
            f"{'F+head':>6}"
            + (f" | {'paper: S':>8} {'D':>5} {'E':>4} {'F':>6} {'KV':>6}" if paper else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        smelt, heads = r["arch"] == "SMELT", f"{r['n_head']}/{r['n_kv_head']} x{r['head_dim']}"
        s = (f"{r['scale']:>6} {r['sparsity']:>7} {r['arch']:>8} {r['d_model']:>5} {r['n_layer']:>3} "
             f"{heads:>12} {r['d_ff']:>5} {r['n_experts']:>4} "
             f"{r['top_k']:>2} {r['loop']:>8} {r['active'] / 1e6:>8.2f}M {r['blocks'] / 1e6:>8.2f}M {r['S']:>6.1%} ")
        s += (f"{r['flops_ratio']:>6.3f} {r['params_ratio']:>6.3f} {r['kv_ratio']:>6.3f} "
              f"{'yes' if r['within_tolerance'] else 'NO':>3} {r['flops_ratio_with_head']:>6.3f}" if smelt
              else f"{'':>6} {'':>6} {'':>6} {'':>3} {'':>6}")
        if paper:
            s += (f" | {'':>8} {r['paper_d_model']:>5} {r['paper_n_experts']:>4} {r['paper_flops_ratio']:>6.3f} "
                  f"{r['paper_kv_ratio']:>6.3f}" if smelt else f" | {r['paper_S']:>7.1f}%")
        lines.append(s)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = checks.parser("Budget accounting and SMELT budget matching (see the module docstring).")
    ap.add_argument("--ladder", choices=list(configs.LADDERS),
                    help="print the matched Baseline/SMELT grid of a preset")
    ap.add_argument("--config", help="print the accounting of a ModelConfig JSON file (e.g. a run's config.json)")
    ap.add_argument("--ctx-len", type=checks.positive_float, default=None, help="document length for attention FLOPs "
                    "(default: measured on the preset's prepared data, the paper's 833 for --ladder paper; "
                    "with --config, the config's block_size)")
    add_loop_args(ap)   # how the looped model loops (default SMELT's: loop.LoopSpec)
    checks.add_out_dir(ap, "also write the ladder rows to DIR/ladder_PRESET.json (default: print only)")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.ladder and not args.config:
        ap.error("give --ladder PRESET or --config FILE")
    if args.ladder and args.ctx_len and args.ctx_len > _ladder(args.ladder)["block"]:
        ap.error(f"--ctx-len {args.ctx_len:g} exceeds preset {args.ladder}'s block size "
                 f"{_ladder(args.ladder)['block']}")
    if args.config:
        cfg = checks.read_config(args.config, ModelConfig, "--config", key="model")
        ctx = args.ctx_len or cfg.block_size
        if ctx > cfg.block_size:
            ap.error(f"--ctx-len {ctx:g} exceeds the config's block size {cfg.block_size}: no token attends that far")
        print(json.dumps({**count_params(cfg), "flops_per_token": flops_per_token(cfg, ctx),
                          "flops_per_token_with_head": flops_per_token(cfg, ctx, include_head=True), "ctx_len": ctx,
                          "kv_bytes_per_token_bf16": kv_bytes_per_token(cfg, 2, ctx)}, indent=2))
    if args.ladder:
        t0 = time.perf_counter()
        rows = ladder(args.ladder, args.ctx_len, spec=loop_spec(args))
        src = "given" if args.ctx_len else ("the paper's" if configs.LADDERS[args.ladder]["data"] is None
                                            else f"measured on the {configs.LADDERS[args.ladder]['data']} data")
        print(f"preset {args.ladder}: FLOPs per token without the output head at document length "
              f"{rows[0]['ctx_len']:.1f} ({src})\n")
        print(format_ladder(rows))
        n, ok = sum(r["arch"] == "SMELT" for r in rows), sum(r.get("within_tolerance", False) for r in rows)
        print(f"\n{ok}/{n} cells within tolerance (F +0..4 %, N 1 %, KV 4 %); "
              f"{time.perf_counter() - t0:.1f} s total. Ratios are SMELT / Baseline.")
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, f"ladder_{args.ladder}.json"), "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    checks.run_main(main)
