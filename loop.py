"""Which layers run when: loop schedules, the 1/r residual scale, per-loop adapters, PLT inputs.

`LoopConfig` is one stack's loop (span, r, schedule, repeated sub-layer, adapters, PLT options); `LoopSpec`
is an experiment's loop at any depth (`SMELT.at(L)`); `plan` is the execution order with each visit's
sub-layers and residual scales (SMELT Sec. 3.1, Eq. 8-9: 1/r inside the span). `LoopAdapter` is
How-to-Loop Definition 1 (per-loop low-rank corrections), `PLTInject` / `shift_states` Definition 2
(loop l >= 2 at token n reads combine(e_n, h^(l-1)_(n-1)), never across a document boundary).
Placements: `middle_span` (SMELT, Appendix A), `middle_third` (How-to-Loop's Middle looping).
Read after model.py (it runs this plan); every option and design choice: docs/loop.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import UserError, check_fields, nonneg_int, positive_int, unit_fraction

SCHEDULES = ("block", "per_layer")
PARTS = ("both", "attn", "mlp")
ADAPTERS = ("none", "lora", "matrix", "softmax")
INJECTS = ("add", "norm_half", "norm_gate")
GATE_RANK = 8  # How-to-Loop's W_down is 8 x 2d
MAX_LOOPS = 64   # r above this is refused (the papers use r <= 8; each pass keeps its activations for backward)


@dataclass
class LoopConfig:
    start: int = 0            # first looped layer (0-based)
    length: int = 0           # number of looped layers m; 0 -> no loop
    n_loops: int = 1          # r: passes over the span
    schedule: str = "block"   # "block": span, span, ...; "per_layer": each layer r times in a row
    part: str = "both"        # "both" | "attn" | "mlp": which sub-layer is repeated
    residual_scale: bool = True  # scale each repeated sub-layer update in the span by 1/r (SMELT; How to Loop: False)
    adapter: str = "none"     # "none" | "lora" | "matrix" | "softmax"
    adapter_rank: int = 8
    parallel: bool = False    # PLT: shifted cross-loop inputs, batched decoding
    inject: str = "norm_gate"  # PLT re-injection: "add" | "norm_half" | "norm_gate"
    shift: bool = True        # PLT: False is the paper's unshifted control (h^(l-1)_n)
    kv_window: int = 0        # 0: one KV cache per loop; w>0: later loops share loop 1's cache + own window of w keys

    def __post_init__(self):
        self.validate()

    @property
    def active(self) -> bool:   # some layer really runs more than once
        return self.n_loops > 1 and self.length > 0

    def in_span(self, layer: int) -> bool:
        return self.start <= layer < self.start + self.length

    def adapted(self, layer: int, sublayer: str, moe: bool = False) -> bool:
        """Whether `sublayer` ("attn" | "mlp") of `layer` carries per-loop adapters: only a repeated one does,
        and an MoE layer's mlp never does (adapters on MoE blocks: attention only, docs/loop.md)."""
        return (self.active and self.in_span(layer) and self.adapter != "none" and self.part in ("both", sublayer)
                and not (moe and sublayer == "mlp"))

    def validate(self, n_layer: int | None = None) -> None:
        """ValueError naming the field and its rule; n_layer None (construction): those that need no stack."""
        check_fields(self, "LoopConfig")

        def one_of(name, choices):
            return getattr(self, name) in choices, f"{name} must be one of {choices}, got {getattr(self, name)!r}"

        end = self.start + self.length
        rules = [(1 <= self.n_loops <= MAX_LOOPS, f"n_loops must lie in [1, {MAX_LOOPS}], got {self.n_loops}"),
                 (self.length >= 0 and self.start >= 0,
                  f"start and length must be >= 0, got start={self.start}, length={self.length}"),
                 (n_layer is None or end <= n_layer, f"span [start, start+length) = [{self.start}, {end}) lies "
                                                     f"outside the stack of n_layer={n_layer} layers"),
                 (self.n_loops == 1 or self.length > 0,
                  f"n_loops={self.n_loops} needs a span: set length > 0 (e.g. loop.middle_span(n_layer))"),
                 one_of("schedule", SCHEDULES), one_of("part", PARTS), one_of("adapter", ADAPTERS),
                 (self.adapter_rank >= 1, f"adapter_rank must be >= 1, got {self.adapter_rank}"),
                 one_of("inject", INJECTS),
                 (self.kv_window >= 0, f"kv_window must be >= 0, got {self.kv_window}"),
                 (not self.parallel or (self.schedule == "block" and self.part == "both"),
                  "parallel=True (PLT) needs schedule='block' and part='both'"),
                 (not self.parallel or self.active, "parallel=True needs n_loops > 1 and a span (length > 0)"),
                 (not self.kv_window or (self.parallel and self.shift),
                  "kv_window > 0 is PLT's KV sharing: it needs parallel=True and shift=True")]
        for ok, rule in rules:
            if not ok:
                raise ValueError(f"LoopConfig: {rule}")


def middle_span(n_layer: int, fraction: float = 0.5) -> tuple[int, int]:
    """SMELT placement: m = n_layer * fraction looped layers, floor((L - m) / 2) before them."""
    if n_layer < 1 or not 0.0 < fraction <= 1.0:
        raise ValueError(f"middle_span: need n_layer >= 1 and 0 < fraction <= 1, got {n_layer}, {fraction}")
    m = max(1, int(n_layer * fraction + 0.5))   # round half up: 5 layers -> a 3-layer span
    return (n_layer - m) // 2, m


def middle_third(n_layer: int) -> tuple[int, int]:
    """How-to-Loop's Middle looping: keep floor(B/3) unique blocks on each side, loop M = B - 2 floor(B/3)."""
    k = n_layer // 3
    return k, n_layer - 2 * k


PLACEMENTS = ("middle", "first", "last")


@dataclass(frozen=True)
class LoopSpec:
    """How an experiment loops every looped model, whatever its depth: one object from the plan through the
    ladder, the runs, the report and the scripts. `at(n_layer)` is the LoopConfig of one stack."""
    n_loops: int = 2            # r: passes over the span
    span_fraction: float = 0.5  # looped share of the stack (middle_span's rounding)
    placement: str = "middle"   # "middle" (SMELT, Appendix A) | "first" | "last"
    part: str = "both"          # which sub-layer repeats (LoopConfig.part)
    adapter: str = "none"       # per-loop adapters (LoopConfig.adapter)
    n_shared_experts: int = 0   # always-active experts beside the routed ones, Baseline and looped model alike

    def __post_init__(self):
        LoopConfig(length=1, n_loops=self.n_loops, part=self.part, adapter=self.adapter)   # LoopConfig's rules
        f = self.span_fraction
        for ok, rule in ((isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1,
                          "span_fraction must lie in (0, 1]"),
                         (self.placement in PLACEMENTS, f"placement must be one of {PLACEMENTS}"),
                         (isinstance(self.n_shared_experts, int) and not isinstance(self.n_shared_experts, bool)
                          and self.n_shared_experts >= 0, "n_shared_experts must be an int >= 0")):
            if not ok:
                raise ValueError(f"LoopSpec: {rule}, got {self}")

    def span(self, n_layer: int) -> tuple[int, int]:
        """(start, length) of the looped span in a stack of n_layer layers."""
        start, m = middle_span(n_layer, self.span_fraction)
        return {"middle": start, "first": 0, "last": n_layer - m}[self.placement], m

    def at(self, n_layer: int) -> LoopConfig:
        start, length = self.span(n_layer)
        return LoopConfig(start=start, length=length, n_loops=self.n_loops, part=self.part, adapter=self.adapter)

    def tag(self) -> str:
        """A directory-name suffix of every field that differs from SMELT's: "" for SMELT, "_r3_last" ..."""
        short = {"n_loops": "r", "span_fraction": "span", "placement": "", "part": "", "adapter": "",
                 "n_shared_experts": "shared"}   # a field not named here is spelled in full
        return "".join(f"_{short.get(f.name, f.name)}{getattr(self, f.name)}" for f in fields(self)
                       if getattr(self, f.name) != getattr(SMELT, f.name))


SMELT = LoopSpec()   # SMELT's loop: the middle half of the stack, twice (Sec. 3.1, Appendix A)


def add_loop_args(ap, without: tuple = ()) -> None:
    """A LoopSpec's fields as command-line options, but the fields `without` (those a script sweeps itself);
    each defaults to None: `loop_spec` keeps the caller's spec where an option is not given."""
    options = [("n_loops", "--loops", dict(type=positive_int, metavar="R", help="r: passes over the span")),
               ("span_fraction", "--span-fraction", dict(type=unit_fraction, help="looped share of the stack")),
               ("placement", "--placement", dict(choices=PLACEMENTS, help="where the span sits")),
               ("part", "--part", dict(choices=PARTS, help="which sub-layer repeats")),
               ("adapter", "--adapter", dict(choices=ADAPTERS, help="per-loop adapters")),
               ("n_shared_experts", "--shared-experts", dict(type=nonneg_int, metavar="N", help="always-active "
                                                             "experts per MoE layer, Baseline and looped model alike"))]
    for name, flag, kw in options:
        if name not in without:
            kw["help"] += f" (default: SMELT's {getattr(SMELT, name)})"
            ap.add_argument(flag, dest=name, default=None, **kw)


def loop_spec(args, base: LoopSpec = SMELT) -> LoopSpec:
    """`base` with the add_loop_args options that were given; a combination LoopSpec refuses is a UserError."""
    try:
        return replace(base, **{f.name: getattr(args, f.name) for f in fields(LoopSpec)
                                if getattr(args, f.name, None) is not None})
    except ValueError as e:   # e.g. --loops above MAX_LOOPS: one line, exit 2 (checks.run_main)
        raise UserError(str(e)) from None


@dataclass(frozen=True)
class Visit:
    """One execution of one physical layer."""
    layer: int          # physical layer index
    visit: int          # 0-based visit number of this layer (the loop index l - 1)
    attn: bool          # run the attention sub-layer on this visit
    mlp: bool           # run the feed-forward sub-layer on this visit
    attn_scale: float   # residual scale of the attention update (1/r inside the span)
    mlp_scale: float    # residual scale of the feed-forward update


def schedule(n_layer: int, loop: LoopConfig) -> list[tuple[int, int]]:
    """Execution order as (layer, visit) pairs."""
    loop.validate(n_layer)
    if not loop.active:
        return [(i, 0) for i in range(n_layer)]
    r, span = loop.n_loops, range(loop.start, loop.start + loop.length)
    pre = [(i, 0) for i in range(loop.start)]
    post = [(i, 0) for i in range(loop.start + loop.length, n_layer)]
    if loop.schedule == "block":
        return pre + [(i, v) for v in range(r) for i in span] + post
    return pre + [(i, v) for i in span for v in range(r)] + post   # per_layer


def plan(n_layer: int, loop: LoopConfig) -> list[Visit]:
    """The execution order with, per visit, which sub-layers run and their residual scales."""
    r = loop.n_loops if loop.active else 1
    s = 1.0 / r if loop.residual_scale else 1.0
    out = []
    for layer, v in schedule(n_layer, loop):
        if r == 1 or not loop.in_span(layer):
            out.append(Visit(layer, v, True, True, 1.0, 1.0))
        elif loop.part == "both":
            out.append(Visit(layer, v, True, True, s, s))
        elif loop.part == "attn":   # attention every visit, the MLP once (after the last attention)
            out.append(Visit(layer, v, True, v == r - 1, s, 1.0))
        else:                       # "mlp": attention once (first visit), the MLP every visit
            out.append(Visit(layer, v, v == 0, True, 1.0, s))
    return out


def executed_visits(n_layer: int, loop: LoopConfig) -> tuple[int, int]:
    """(attention executions, feed-forward executions) per token: what FLOPs and KV grow with."""
    p = plan(n_layer, loop)
    return sum(v.attn for v in p), sum(v.mlp for v in p)


# ---- Per-loop adapters (How-to-Loop Definition 1) ------------------------------------------------

class LoopAdapter(nn.Module):
    """Per-loop low-rank correction Delta W_l of one shared projection d_in -> d_out: "lora" B_l A_l, "matrix"
    sum_j M[l, j] B_j A_j (M = I at init), "softmax" M's rows through a softmax. A (L, rank, d_in), B (L, d_out,
    rank), M (L, L): L * rank * (d_in + d_out) (+ L^2) parameters, against L * d_in * d_out for separate loops."""
    OWN_INIT = True      # B = 0 (and M = I or 0) make it a no-op at init: model.GPT.init_weights skips it
    NO_DECAY = ("M",)    # the loop-mixing matrix is not pulled towards 0 (train.decay_split)

    def __init__(self, d_in: int, d_out: int, n_loops: int, rank: int, kind: str):
        super().__init__()
        self.kind = kind
        self.A = nn.Parameter(torch.randn(n_loops, rank, d_in) / math.sqrt(d_in))
        self.B = nn.Parameter(torch.zeros(n_loops, d_out, rank))   # zero: exact no-op at init
        if kind == "matrix":
            self.M = nn.Parameter(torch.eye(n_loops))
        elif kind == "softmax":
            self.M = nn.Parameter(torch.zeros(n_loops, n_loops))  # softmax rows start uniform

    def mixing(self) -> torch.Tensor | None:
        """(L, L) coefficients M[l, j] of pair j in loop l; None for plain LoRA."""
        if self.kind == "lora":
            return None
        return self.M.softmax(-1) if self.kind == "softmax" else self.M

    def add_to(self, y: torch.Tensor, x: torch.Tensor, loop: int | None) -> torch.Tensor:
        """y = W x of the shared projection plus this adapter's correction: loop `loop`'s, or with loop=None
        each loop's on a stacked PLT batch x (L*B, ..., d_in), loop-major (model.GPT's batched step)."""
        if loop is None:
            x = x.reshape(self.A.shape[0], -1, *x.shape[1:])
        return y + self(x, loop).reshape(y.shape)

    def forward(self, x: torch.Tensor, loop: int | None) -> torch.Tensor:
        """x (..., d_in) for one loop, or x (L, ..., d_in) with loop=None (all loops stacked)."""
        M = self.mixing()
        if loop is not None:
            if M is None:
                return (x @ self.A[loop].t()) @ self.B[loop].t()
            u = torch.einsum("...i,jri->...jr", x, self.A) * M[loop][:, None]   # (..., L, rank)
            return torch.einsum("...jr,jor->...o", u, self.B)
        xs = x.reshape(x.shape[0], -1, x.shape[-1])                             # (L, N, d_in)
        if M is None:
            y = torch.bmm(torch.bmm(xs, self.A.transpose(1, 2)), self.B.transpose(1, 2))
        else:
            u = torch.einsum("lni,jri->lnjr", xs, self.A) * M[:, None, :, None]
            y = torch.einsum("lnjr,jor->lno", u, self.B)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def make_adapters(shapes: dict[str, tuple[int, int]], loop: LoopConfig) -> nn.ModuleDict:
    """One LoopAdapter per named projection {name: (d_in, d_out)}."""
    return nn.ModuleDict({name: LoopAdapter(di, do, loop.n_loops, loop.adapter_rank, loop.adapter)
                          for name, (di, do) in shapes.items()})


# ---- RMSNorm: every block's pre-norm (model.py imports it from here) and PLT's re-injection norms ----

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


# ---- Parallel Loop Transformer: the input of loop l >= 2 (How-to-Loop Definition 2) --------------

class PLTInject(nn.Module):
    """combine(e, h) for one loop l >= 2; e and h are (..., D)."""
    OWN_INIT = ("up.weight", "up.bias")   # zero: the gate starts at exactly 50/50 (down gets GPT's N(0, std))

    def __init__(self, d_model: int, inject: str, eps: float = 1e-6):
        super().__init__()
        self.inject = inject
        if inject != "add":
            self.norm_e = RMSNorm(d_model, eps)
            self.norm_h = RMSNorm(d_model, eps)
        if inject == "norm_gate":
            self.down = nn.Linear(2 * d_model, GATE_RANK, bias=False)
            self.up = nn.Linear(GATE_RANK, d_model, bias=True)
            nn.init.zeros_(self.up.weight)   # with the zero bias: g = sigmoid(0) = 1/2 exactly
            nn.init.zeros_(self.up.bias)

    def forward(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if self.inject == "add":
            return e + h
        ne, nh = self.norm_e(e), self.norm_h(h)
        if self.inject == "norm_half":
            return 0.5 * ne + 0.5 * nh
        g = torch.sigmoid(self.up(self.down(torch.cat([ne, nh], dim=-1))))
        return g * ne + (1.0 - g) * nh


def shift_states(h_BTD: torch.Tensor, doc_ids: torch.Tensor | None, h_prev_BD: torch.Tensor | None = None):
    """h^(l-1)_(n-1) for every n: shift right by one token, zero at document starts; h_prev_BD is the state of
    the token before this chunk (decoding), None at position 0."""
    B, T, D = h_BTD.shape
    first = h_BTD.new_zeros(B, 1, D) if h_prev_BD is None else h_prev_BD[:, None, :]
    out = torch.cat([first, h_BTD[:, :-1]], dim=1)
    if doc_ids is not None:
        start = torch.ones_like(doc_ids, dtype=torch.bool)
        start[:, 0] = h_prev_BD is None   # a chunk's first token continues the token before it
        start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        out = out.masked_fill(start[..., None], 0.0)
    return out
