"""The decoder: a pre-norm GQA transformer with dense or MoE SwiGLU feed-forward, looped by plan.

SMELT (Sec. 3.1) and How to Loop share one template: token embedding, a stack of pre-norm
blocks (RMSNorm -> attention -> residual, RMSNorm -> feed-forward -> residual), a final
RMSNorm and an untied output head. This file holds that template:

  * `ModelConfig`: sizes, the feed-forward kind (n_experts = 0 -> dense SwiGLU) and a
    `loop.LoopConfig` (default: no loop). Every rule is checked at construction, before any
    allocation, with a ValueError naming the field.
  * Attention: RoPE, grouped-query attention with `head_dim` independent of d_model / n_head
    (budget matching changes head geometry), no biases, document masking for packed
    contexts (SMELT 3.1: "segment-level attention masks"). CPU: `scaled_dot_product_attention`
    with a boolean block-diagonal causal mask (flex attention has no CPU backward). CUDA:
    flex attention with a block mask built from the document ids (skips masked tiles), except
    for heads narrower than 16, which CUDA flex cannot run (`attention_kernel` holds the rule
    and why "auto" falls back to SDPA there). Masks are built once per forward (`Ctx.masks`).
  * torch.compile (`compile_model`): the training objective of every config (dense, MoE,
    looped, PLT) compiles to one graph with `fullgraph=True` (tests/test_compile.py): no
    data-dependent shapes, no host reads, the block mask and flex attention traced inside.
  * Execution follows `loop.plan(n_layer, cfg.loop)`: each entry is one visit of one physical
    layer with its residual scales (1/r inside a looped span, SMELT Eq. 8-9). The unlooped
    model is the plan with one visit per layer. PLT (`loop.parallel`) runs the span's loops in
    order over the whole sequence in training (How-to-Loop Algorithm 1) and, when decoding one
    token, all loops of the span as one batched call over the shared weights (Algorithm 2).
  * Decoding: `new_cache`, `forward_step` (prefill of many tokens or one-token steps) and
    `generate`. Every attention visit keeps its own KV cache (KV grows with executed visits);
    PLT with `kv_window = w` shares loop 1's cache and keeps a ring of w positions per later
    loop. `forward_step` logits equal the full forward's (tested for every loop variant).
  * Projections are plain nn.Linear without bias. One speed switch lives at the end of the file,
    out of the model's way: `forward_step` (so `generate`) on CPU runs the attention, SwiGLU and
    head projections under `few_row_projections`, where products of a few rows use the BLAS
    layout this CPU runs fastest (W x^T). Same results to float rounding (tested); it is what
    lets PLT's batched loops decode at about the unlooped model's time per token on CPU
    (measurements in `few_row_projections` and the README's Benchmarks).
  * One init function, `init_weights`: N(0, init_std) everywhere (embedding included: a small
    embedding std keeps a tied head well scaled and avoids CPU denormals), output projections
    scaled by 1/sqrt(2 * executed depth) (GPT-2's rule, counting visits, not stored layers).

`forward` returns (logits, loss) with loss = cross-entropy + aux_loss_coef * load-balance loss
+ z_loss_coef * router z-loss (the training objective; exactly the cross-entropy for dense
models). `run` returns the full `Output` with the separate terms and per-visit router
statistics; it also takes an optional `capture` dict that probes.py fills with per-visit
activations. Nothing is stored in module state during forward.
"""
from __future__ import annotations

import contextlib
import json
import math
import types
import weakref
from dataclasses import asdict, dataclass, field
from numbers import Integral, Real

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import loop as looping
from checks import check_fields, from_dict
from loop import LoopConfig, PLTInject, RMSNorm, Visit, make_adapters, shift_states
from moe import IMPLS as MOE_IMPLS, MoE, RouterStats


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class ModelConfig:
    vocab_size: int = 512
    block_size: int = 128           # max context length
    n_layer: int = 4                # physical (stored) layers
    d_model: int = 64
    n_head: int = 4
    n_kv_head: int = 4
    head_dim: int | None = None     # None -> d_model // n_head
    d_ff: int = 192                 # dense SwiGLU width, or per-expert width
    n_experts: int = 0              # 0 -> dense feed-forward
    top_k: int = 8
    loop: LoopConfig = field(default_factory=LoopConfig)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    router_renormalize: bool = True  # renormalise the top-k router weights (Mixtral)
    aux_loss_coef: float = 0.01     # Switch load-balancing loss weight
    z_loss_coef: float = 0.001      # router z-loss weight
    init_std: float = 0.02
    moe_impl: str = "auto"          # grouped matmul: auto | loop | torch | padded | reference (moe.py)
    attn_backend: str = "auto"      # auto (flex on CUDA with masks, else sdpa) | sdpa | flex | math

    def __post_init__(self):
        if isinstance(self.loop, dict):
            self.loop = from_dict(LoopConfig, self.loop, "ModelConfig: loop")
        self.validate()

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_head

    def validate(self) -> None:
        def bad(msg):
            raise ValueError(f"ModelConfig: {msg}")
        check_fields(self, "ModelConfig")   # types: ints are ints, floats finite, booleans booleans
        if not isinstance(self.loop, LoopConfig):
            bad(f"loop must be a LoopConfig (or its dict), got {type(self.loop).__name__}")
        for name in ("vocab_size", "block_size", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.n_head % self.n_kv_head:
            bad(f"n_head % n_kv_head must be 0 (grouped-query attention), got {self.n_head} % {self.n_kv_head}")
        if self.head_dim is None and self.d_model % self.n_head:
            bad(f"d_model % n_head must be 0 when head_dim is None, got {self.d_model} % {self.n_head}")
        if self.hd <= 0 or self.hd % 2:
            bad(f"head_dim must be a positive even number (RoPE rotates pairs), got {self.hd}")
        if self.n_experts < 0:
            bad(f"n_experts must be >= 0, got {self.n_experts}")
        if self.n_experts > 0 and not 1 <= self.top_k <= self.n_experts:
            bad(f"top_k must satisfy 1 <= top_k <= n_experts, got top_k={self.top_k}, n_experts={self.n_experts}")
        if self.attn_backend not in ("auto", "sdpa", "flex", "math"):
            bad(f"attn_backend must be auto|sdpa|flex|math, got {self.attn_backend!r}")
        if self.moe_impl not in MOE_IMPLS:
            bad(f"moe_impl must be {'|'.join(MOE_IMPLS)}, got {self.moe_impl!r}")
        self.loop.validate(self.n_layer)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The inverse of to_dict; unknown keys (a typo, another version's field) are named in a ValueError."""
        return from_dict(cls, d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


@dataclass
class Output:
    logits: Tensor                  # (B, T, V)
    loss: Tensor | None             # ce + aux_loss_coef * aux_loss + z_loss_coef * z_loss
    ce: Tensor | None               # mean next-token cross-entropy (nats)
    aux_loss: Tensor                # mean load-balancing loss over MoE visits (0 for dense)
    z_loss: Tensor                  # mean router z-loss over MoE visits
    router: list[tuple[Visit, RouterStats]]  # per executed MoE visit


# ----------------------------------------------------------------------------------------
# Rotary embedding and attention kernels

def rope_table(block_size: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(block_size, dtype=torch.float32), inv)   # (T, hd/2)
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, T, hd), cos/sin (T, hd/2): rotate (first half, second half) pairs (Llama layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, None], sin[None, None]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).type_as(x)


def build_mask(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None, k_doc: Tensor | None,
               window: int = 0) -> Tensor:
    """Boolean (B|1, 1, T, S) mask, True = may attend: causal, same document, within window.

    Positions are absolute token positions; a key position < 0 marks an empty cache slot.
    """
    m = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= 0)
    if window:
        m = m & (q_pos[:, None] - k_pos[None, :] < window)
    m = m[None, None]
    if q_doc is not None:
        m = m & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    return m


# Inductor's CUDA flex-attention kernel multiplies q k^T and p v with tl.dot, which needs
# head dims >= 16 ("NYI: embedding dimension ... must be at least 16"). CPU flex accepts smaller.
FLEX_MIN_HEAD_DIM = 16


def attention_kernel(backend: str, device_type: str, head_dim: int, training_shape: bool, masked: bool) -> str:
    """The kernel that runs one attention call: "flex", "sdpa" or "math" (the model-level head-dim rule).

    backend is ModelConfig.attn_backend. "auto" takes flex attention on CUDA for full-sequence
    attention with a document mask or window (it skips masked tiles) and SDPA everywhere else.
    Heads narrower than FLEX_MIN_HEAD_DIM cannot run flex on CUDA. For them "auto" falls back to
    SDPA with the boolean block-diagonal causal mask, and an explicit "flex" raises a ValueError
    naming head_dim at the first CUDA call. Why a fallback rather than an error for "auto":
    the rule belongs to one backend on one device, not to the model; budget matching may pick
    any even head_dim, and the same config must train on CPU (where SDPA runs anyway) and on
    any GPU. The fallback is exact (tested against flex) and costs only the mask's memory,
    B x T x T booleans (32 MB at 32 x 1024), which is small at the sizes where such narrow
    heads occur. The presets keep head_dim >= 16 so their GPU runs take flex. An explicit
    "flex" is a request to measure flex, so silently running something else would be wrong.
    """
    if backend == "math":
        return "math"
    narrow = device_type == "cuda" and head_dim < FLEX_MIN_HEAD_DIM
    if backend == "flex":
        if not training_shape:
            raise ValueError("attn_backend='flex' supports full-sequence attention only (use sdpa for decoding)")
        if narrow:
            raise ValueError(f"attn_backend='flex' needs head_dim >= {FLEX_MIN_HEAD_DIM} on CUDA (inductor's flex "
                             f"kernel), got head_dim={head_dim}; use attn_backend='auto' (SDPA for such heads) "
                             f"or a config with head_dim >= {FLEX_MIN_HEAD_DIM}")
        return "flex"
    if backend == "auto" and device_type == "cuda" and training_shape and masked and not narrow:
        return "flex"
    return "sdpa"


_flex_compiled = None   # flex_attention compiled once per process for eager CUDA callers (validation)


def _flex(q, k, v, doc: Tensor | None, window: int, masks: dict | None = None) -> Tensor:
    """Flex attention with a block mask from document ids (training: S == T).

    masks: the forward's cache of block masks (Ctx.masks), so a mask is built once per forward
    and window, not once per attention visit. Inside torch.compile the mask construction and
    flex_attention are traced into the caller's graph. Eager on CUDA (validation runs the
    uncompiled model) the mask is built by create_block_mask's compiled path and the kernel is a
    compiled flex_attention: the eager versions materialise B x H x T x T intermediates.
    """
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, H, T, _ = q.shape
    compiling = torch.compiler.is_compiling()
    bm = None if masks is None else masks.get(("flex", window))
    if bm is None:
        def mask_mod(b, h, qi, ki):
            ok = ki <= qi
            if doc is not None:
                ok = ok & (doc[b, qi] == doc[b, ki])
            if window:
                ok = ok & (qi - ki < window)
            return ok

        bm = create_block_mask(mask_mod, B if doc is not None else None, None, T, T, device=q.device,
                               _compile=q.is_cuda and not compiling)
        if masks is not None:
            masks[("flex", window)] = bm
    gqa = k.shape[1] != H
    if q.is_cuda and not compiling:
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention, dynamic=False)
        return _flex_compiled(q, k, v, block_mask=bm, enable_gqa=gqa)
    return flex_attention(q, k, v, block_mask=bm, enable_gqa=gqa)


def attend(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None,
           k_doc: Tensor | None, window: int, backend: str, want_probs: bool = False, masks: dict | None = None):
    """q (B, H, T, hd), k/v (B, Hkv, S, hd) -> (out (B, H, T, hd), probs (B, H, T, S) or None).

    masks: a per-forward dict where flex block masks are kept (Ctx.masks).
    """
    B, H, T, hd = q.shape
    S = k.shape[2]
    training_shape = S == T and k_doc is q_doc
    kernel = "math" if want_probs else attention_kernel(backend, q.device.type, hd, training_shape,
                                                         q_doc is not None or bool(window))
    if kernel == "math":   # explicit softmax: probes read the probabilities
        rep = H // k.shape[1]
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = (q.float() @ kk.float().transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(~build_mask(q_pos, k_pos, q_doc, k_doc, window), float("-inf")).softmax(-1)
        return (att @ vv.float()).type_as(q), (att if want_probs else None)
    if kernel == "flex":
        return _flex(q, k, v, q_doc, window, masks), None
    gqa = k.shape[1] != H
    if q_doc is None and not window and training_shape:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa), None
    if q_doc is None and not window and T == 1:   # one new token: every cached key is visible
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), None
    mask = None if masks is None or not training_shape else masks.get(("bool", window))
    if mask is None:
        mask = build_mask(q_pos, k_pos, q_doc, k_doc, window)
        if masks is not None and training_shape:
            masks[("bool", window)] = mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa), None


# ----------------------------------------------------------------------------------------
# KV cache

@dataclass
class KV:
    """One attention visit's cache. Full caches hold positions [0, max_len); rings hold the last w."""
    k: Tensor                 # (B', Hkv, capacity, hd)
    v: Tensor
    ring: bool = False
    pos: Tensor | None = None  # (capacity,) absolute position held in each ring slot, -1 = empty


@dataclass
class Cache:
    kv: dict                   # slot name -> KV
    batch_size: int
    max_len: int
    length: int = 0            # tokens held so far
    plt_h: Tensor | None = None  # PLT: (r-1, B, D) span output of loops 1..r-1 at the previous token

    def nbytes(self) -> int:
        """Bytes of keys and values allocated (what budget.kv_bytes_per_token accounts for)."""
        return sum(c.k.nbytes + c.v.nbytes for c in self.kv.values())

    def repeat(self, n: int) -> "Cache":
        """A new cache with every batch row repeated n times in a row (row b -> rows b*n .. b*n+n-1).

        For scoring several continuations of one prefilled context (tasks.score_options). Stacked
        PLT caches (rows l*B + b) and ring caches are repeated per loop; ring positions are shared.
        """
        if n < 1:
            raise ValueError(f"Cache.repeat: n must be >= 1, got {n}")
        B = self.batch_size

        def rep(t: Tensor) -> Tensor:   # (r*B, ...) -> (r*B*n, ...), loop-major as before
            return t.view(-1, B, *t.shape[1:]).repeat_interleave(n, dim=1).reshape(-1, *t.shape[1:])

        kv = {name: KV(rep(c.k), rep(c.v), c.ring, None if c.pos is None else c.pos.clone())
              for name, c in self.kv.items()}
        plt_h = None if self.plt_h is None else self.plt_h.repeat_interleave(n, dim=1)
        return Cache(kv, B * n, self.max_len, self.length, plt_h)


# ----------------------------------------------------------------------------------------
# Blocks

class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        D, H, Hkv, hd = cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.hd
        self.n_head, self.n_kv_head, self.hd, self.backend = H, Hkv, hd, cfg.attn_backend
        self.wq = nn.Linear(D, H * hd, bias=False)
        self.wk = nn.Linear(D, Hkv * hd, bias=False)
        self.wv = nn.Linear(D, Hkv * hd, bias=False)
        self.wo = nn.Linear(H * hd, D, bias=False)
        lc = cfg.loop
        looped = lc.active and lc.in_span(layer)
        self.adapters = (make_adapters({"q": (D, H * hd), "k": (D, Hkv * hd), "v": (D, Hkv * hd),
                                        "o": (H * hd, D)}, lc)
                         if looped and lc.adapter != "none" else None)
        # PLT KV sharing: later loops mix attention over loop 1's keys with a window of their own
        self.window = lc.kv_window if looped else 0
        if self.window:
            self.kv_gate = nn.Linear(D, H, bias=False)   # zero-init: per-head gate starts at 1/2

    def proj(self, name: str, lin: nn.Linear, x: Tensor, loop: int | None, n_loops: int) -> Tensor:
        y = lin(x)
        if self.adapters is not None:
            if loop is None:   # stacked PLT batch: (r*B, T, d) -> loop dim first
                xs = x.reshape(n_loops, -1, *x.shape[1:])
                y = y + self.adapters[name](xs, None).reshape(y.shape)
            else:
                y = y + self.adapters[name](x, loop)
        return y

    def forward(self, x: Tensor, ctx: "Ctx", visit: Visit, loop: int | None) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, hd, r = self.n_head, self.n_kv_head, self.hd, ctx.n_loops
        q = self.proj("q", self.wq, x, loop, r).view(B, T, H, hd).transpose(1, 2)
        k = self.proj("k", self.wk, x, loop, r).view(B, T, Hkv, hd).transpose(1, 2)
        v = self.proj("v", self.wv, x, loop, r).view(B, T, Hkv, hd).transpose(1, 2)
        cos, sin = ctx.cos, ctx.sin
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cap = ctx.capture.setdefault((visit.layer, visit.visit), {}) if ctx.capture is not None else None
        if cap is not None:
            cap.update(q=q, k=k, v=v)
        if self.window and loop is None:
            y = self._shared_kv_step(q, k, v, x, ctx, visit)
        elif self.window and loop > 0:
            y = self._shared_kv(q, k, v, x, ctx, visit)
        else:
            if self.window:   # loop 1 of a KV-sharing span: later loops read its keys
                ctx.shared[visit.layer] = (k, v)
            y, probs = self._attend_cached(q, k, v, ctx, visit, loop, cap is not None)
            if cap is not None:   # (the KV-sharing paths mix two attentions: no single probability map)
                cap["attn_probs"] = probs
        y = y.transpose(1, 2).reshape(B, T, H * hd)                  # (B, T, H*hd): PV
        out = self.proj("o", self.wo, y, loop, r)
        if cap is not None:
            cap.update(pv=y, o=out)
        return out

    def _attend_cached(self, q, k, v, ctx, visit, loop, want_probs):
        if ctx.cache is None:
            return attend(q, k, v, ctx.q_pos, ctx.q_pos, ctx.doc, ctx.doc, 0, self.backend, want_probs, ctx.masks)
        kv, rows = ctx.slot(visit, loop)
        p0, T = ctx.start, q.shape[2]
        kv.k[rows, :, p0:p0 + T] = k
        kv.v[rows, :, p0:p0 + T] = v
        K, V = kv.k[rows, :, :p0 + T], kv.v[rows, :, :p0 + T]
        k_pos = torch.arange(p0 + T, device=q.device)
        return attend(q, K, V, ctx.q_pos, k_pos, None, None, 0, self.backend, want_probs)

    def _mix(self, x, y_global, y_local):
        g = torch.sigmoid(self.kv_gate(x)).transpose(1, 2)[..., None]  # (B, H, T, 1)
        return g * y_global + (1 - g) * y_local

    def _shared_kv(self, q, k, v, x, ctx, visit):
        """Training / chunked decoding for a loop >= 2 with KV sharing (original PLT)."""
        if ctx.cache is None:
            k1, v1 = ctx.shared[visit.layer]
            yg, _ = attend(q, k1, v1, ctx.q_pos, ctx.q_pos, ctx.doc, ctx.doc, 0, self.backend, masks=ctx.masks)
            yl, _ = attend(q, k, v, ctx.q_pos, ctx.q_pos, ctx.doc, ctx.doc, self.window, "sdpa", masks=ctx.masks)
            return self._mix(x, yg, yl)
        p0, T = ctx.start, q.shape[2]
        full, _ = ctx.slot(visit, 0)
        K1, V1 = full.k[:, :, :p0 + T], full.v[:, :, :p0 + T]
        yg, _ = attend(q, K1, V1, ctx.q_pos, torch.arange(p0 + T, device=q.device), None, None, 0, "sdpa")
        ring, rows = ctx.slot(visit, visit.visit, ring=True)
        yl = self._ring_attend(q, k, v, ring, rows, ctx)
        return self._mix(x, yg, yl)

    def _ring_attend(self, q, k, v, ring: KV, rows, ctx):
        """Attend over (ring contents + new keys) within the window, then keep the last w in the ring."""
        T = q.shape[2]
        K = torch.cat([ring.k[rows], k], dim=2)
        V = torch.cat([ring.v[rows], v], dim=2)
        k_pos = torch.cat([ring.pos, ctx.q_pos])
        y, _ = attend(q, K, V, ctx.q_pos, k_pos, None, None, self.window, "sdpa")
        w = ring.k.shape[2]
        keep = ctx.q_pos[-min(T, w):]
        slots = keep % w
        ring.k[rows, :, slots] = k[:, :, -len(keep):]
        ring.v[rows, :, slots] = v[:, :, -len(keep):]
        ctx.ring_pos_updates.append((ring, slots, keep))
        return y

    def _shared_kv_step(self, q, k, v, x, ctx, visit):
        """Batched one-token PLT step with KV sharing: rows [0:B] are loop 1, the rest later loops."""
        B = ctx.batch
        full, _ = ctx.slot(visit, 0)
        p0 = ctx.start
        full.k[:, :, p0:p0 + 1] = k[:B]
        full.v[:, :, p0:p0 + 1] = v[:B]
        K1, V1 = full.k[:, :, :p0 + 1], full.v[:, :, :p0 + 1]
        y1, _ = attend(q[:B], K1, V1, ctx.q_pos, torch.arange(p0 + 1, device=q.device), None, None, 0, "sdpa")
        L1 = q.shape[0] // B - 1                                          # later loops
        ql = q[B:].view(L1, B, *q.shape[1:]).permute(1, 2, 0, 3, 4).flatten(2, 3)  # (B, H, L1, hd)
        yg = F.scaled_dot_product_attention(ql, K1, V1, enable_gqa=K1.shape[1] != ql.shape[1])
        yg = yg.view(B, q.shape[1], L1, 1, -1).permute(2, 0, 1, 3, 4).flatten(0, 1)  # (L1*B, H, 1, hd)
        ring, rows = ctx.slot(visit, None, ring=True)
        yl = self._ring_attend(q[B:], k[B:], v[B:], ring, rows, ctx)
        return torch.cat([y1, self._mix(x[B:], yg, yl)], dim=0)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        D, Fd = cfg.d_model, cfg.d_ff
        self.gate = nn.Linear(D, Fd, bias=False)
        self.up = nn.Linear(D, Fd, bias=False)
        self.down = nn.Linear(Fd, D, bias=False)
        lc = cfg.loop
        self.adapters = (make_adapters({"gate": (D, Fd), "up": (D, Fd), "down": (Fd, D)}, lc)
                         if lc.active and lc.in_span(layer) and lc.adapter != "none" else None)

    def forward(self, x: Tensor, loop: int | None = None, n_loops: int = 1) -> Tensor:
        if self.adapters is None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        xs = x.reshape(n_loops, -1, *x.shape[1:]) if loop is None else x

        def proj(name, lin, inp, inp_s):
            d = self.adapters[name](inp_s, loop)
            return lin(inp) + d.reshape(*inp.shape[:-1], -1)

        h = F.silu(proj("gate", self.gate, x, xs)) * proj("up", self.up, x, xs)
        hs = h.reshape(n_loops, -1, *h.shape[1:]) if loop is None else h
        return proj("down", self.down, h, hs)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.n_experts > 0:
            self.mlp = MoE(cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.top_k, cfg.router_renormalize, cfg.moe_impl)
        else:
            self.mlp = SwiGLU(cfg, layer)

    def forward(self, x: Tensor, visit: Visit, ctx: "Ctx", loop: int | None = None):
        """One visit: x (B, T, D) -> (x', RouterStats or None). loop=None: stacked PLT batch."""
        cap = ctx.capture.setdefault((visit.layer, visit.visit), {}) if ctx.capture is not None else None
        if cap is not None:
            cap["x"] = x
        stats = None
        if visit.attn:
            h = self.attn_norm(x)
            a = visit.attn_scale * self.attn(h, ctx, visit, loop)
            x = x + a
            if cap is not None:
                cap.update(attn_norm=h, attn_write=a)
        if visit.mlp:
            h = self.mlp_norm(x)
            if isinstance(self.mlp, MoE):
                m, stats = self.mlp(h)
            else:
                m = self.mlp(h, loop, ctx.n_loops)
            m = visit.mlp_scale * m
            x = x + m
            if cap is not None:
                cap.update(mlp_norm=h, mlp_write=m)
                if stats is not None:
                    cap["topk_idx"] = stats.topk_idx
        return x, stats


@dataclass
class Ctx:
    """Per-call context handed to every block: positions, RoPE rows, masks, cache, capture."""
    q_pos: Tensor                 # (T,) absolute positions of the new tokens
    cos: Tensor
    sin: Tensor
    doc: Tensor | None            # (B, T) document ids (full forward only)
    n_loops: int
    batch: int
    cache: Cache | None = None
    start: int = 0                # cache length before this call
    capture: dict | None = None
    shared: dict = field(default_factory=dict)   # layer -> loop-1 (k, v) for PLT KV sharing
    ring_pos_updates: list = field(default_factory=list)  # applied after the call: all loops read the old ring
    masks: dict = field(default_factory=dict)    # attention masks built once per forward (flex block masks)

    def slot(self, visit: Visit, loop: int | None, ring: bool = False) -> tuple[KV, slice]:
        """(KV, rows) of the cache this attention visit reads and writes.

        Stacked PLT caches hold loop l in rows [l*B, (l+1)*B); loop=None means all rows.
        With KV sharing, ("full", layer) is loop 1's cache and ("ring", layer) the later loops' windows.
        """
        c, L, B = self.cache, visit.layer, self.batch
        if ("plt", L) in c.kv:
            return c.kv[("plt", L)], slice(None) if loop is None else slice(loop * B, (loop + 1) * B)
        if ("ring", L) in c.kv:
            if not ring:
                return c.kv[("full", L)], slice(None)
            return c.kv[("ring", L)], slice(None) if loop is None else slice((loop - 1) * B, loop * B)
        return c.kv[(L, visit.visit)], slice(None)


# ----------------------------------------------------------------------------------------
# The model

class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.plan = looping.plan(cfg.n_layer, cfg.loop)   # static: a function of the config
        self._visit_of = {(v.layer, v.visit): v for v in self.plan}
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        lc = cfg.loop
        self.plt = (nn.ModuleList(PLTInject(cfg.d_model, lc.inject) for _ in range(lc.n_loops - 1))
                    if lc.parallel else None)
        cos, sin = rope_table(cfg.block_size, cfg.hd, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    # -- init ------------------------------------------------------------------------------
    def init_weights(self) -> None:
        """N(0, init_std) for every matrix; residual-output projections / sqrt(2 * executed depth)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * len(self.plan))
        for name, p in self.named_parameters():
            if "adapters" in name or ".plt." in name or name.startswith("plt.") or "kv_gate" in name:
                continue   # adapters / PLT gates own their init (zero where it must be a no-op)
            if p.dim() == 1:
                nn.init.ones_(p)                                   # RMSNorm gains
            elif name.endswith(("wo.weight", "down.weight", "w_out")):
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, std)
        for blk in self.blocks:
            if blk.attn.window:
                nn.init.zeros_(blk.attn.kv_gate.weight)

    # -- checks ----------------------------------------------------------------------------
    def _check_idx(self, idx: Tensor, start: int = 0) -> None:
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be an integer tensor of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
        T = idx.shape[1]
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size={self.cfg.block_size}")
        if idx.numel() and not torch.compiler.is_compiling():   # a host sync: checked in eager code only
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"token ids must lie in [0, vocab_size={self.cfg.vocab_size}), got min {lo}, max {hi}")

    # -- full forward ------------------------------------------------------------------------
    def forward(self, idx: Tensor, targets: Tensor | None = None, doc_ids: Tensor | None = None):
        out = self.run(idx, targets, doc_ids)
        return out.logits, out.loss

    def run(self, idx: Tensor, targets: Tensor | None = None, doc_ids: Tensor | None = None,
            capture: dict | None = None) -> Output:
        """Full forward. capture: a dict that receives {(layer, visit): {name: tensor}} for probes."""
        self._check_idx(idx)
        B, T = idx.shape
        if B == 0 or T == 0:
            raise ValueError(f"idx must hold at least one sequence of at least one token, got shape {(B, T)}")
        if doc_ids is not None and doc_ids.shape != idx.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} must equal idx shape {tuple(idx.shape)}")
        if doc_ids is not None and doc_ids.dtype not in _INT_DTYPES:
            raise ValueError(f"doc_ids must be an integer tensor (document numbers), got {doc_ids.dtype}")
        if targets is not None:
            if targets.shape != idx.shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
            if targets.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
            if not torch.compiler.is_compiling():   # a host sync: checked in eager code only
                bad = (targets < -1) | (targets >= self.cfg.vocab_size)
                if bool(bad.any()):
                    raise ValueError(f"targets must lie in [0, vocab_size={self.cfg.vocab_size}) or be -1 (ignored), "
                                     f"got {targets[bad][0].item()}")
        pos = torch.arange(T, device=idx.device)
        ctx = Ctx(pos, self.rope_cos[:T], self.rope_sin[:T], doc_ids, self.cfg.loop.n_loops, B, capture=capture)
        x, router = self._body(self.tok_emb(idx), ctx, doc_ids)
        return self._head(x, targets, router)

    def _visits(self, x: Tensor, ctx: Ctx, visits, router: list) -> Tensor:
        """Run visits in order; each visit's loop index is its visit number."""
        for visit in visits:
            x, st = self.blocks[visit.layer](x, visit, ctx, visit.visit)
            if st is not None:
                router.append((visit, st))
        return x

    def _parts(self):
        """(prelude, coda) visits around the PLT span."""
        lc = self.cfg.loop
        return ([v for v in self.plan if v.layer < lc.start],
                [v for v in self.plan if v.layer >= lc.start + lc.length])

    def _plt_loops(self, e: Tensor, ctx: Ctx, doc_ids: Tensor | None, h_prev: Tensor | None,
                   router: list) -> list[Tensor]:
        """PLT Algorithm 1: loop 1 runs the span on e; loop l >= 2 on combine(e, h^(l-1) shifted one
        token right). h_prev (r-1, B, D) holds each loop's state at the token before this chunk
        (decoding); None means the chunk starts the sequence. Returns every loop's output."""
        lc = self.cfg.loop
        outs = []
        for l in range(lc.n_loops):
            if l == 0:
                h = e
            else:
                prev = None if h_prev is None else h_prev[l - 1]
                h = self.plt[l - 1](e, shift_states(outs[-1], doc_ids, prev) if lc.shift else outs[-1])
            for i in range(lc.start, lc.start + lc.length):
                visit = self._span_visit(i, l)
                h, st = self.blocks[i](h, visit, ctx, l)
                if st is not None:
                    router.append((visit, st))
            outs.append(h)
        return outs

    def _body(self, x: Tensor, ctx: Ctx, doc_ids: Tensor | None):
        router = []
        if self.plt is None:
            return self._visits(x, ctx, self.plan, router), router
        prelude, coda = self._parts()
        e = self._visits(x, ctx, prelude, router)
        h = self._plt_loops(e, ctx, doc_ids, None, router)[-1]
        return self._visits(h, ctx, coda, router), router

    def _span_visit(self, layer: int, l: int) -> Visit:
        return self._visit_of[(layer, l)]

    def _head(self, x: Tensor, targets: Tensor | None, router) -> Output:
        x = self.norm_f(x)
        logits = F.linear(x, self.tok_emb.weight) if self.lm_head is None else self.lm_head(x)
        zero = logits.new_zeros(())
        aux = torch.stack([s.aux_loss for _, s in router]).mean() if router else zero
        z = torch.stack([s.z_loss for _, s in router]).mean() if router else zero
        ce = loss = None
        if targets is not None:
            ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)
            loss = ce + self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z
        return Output(logits, loss, ce, aux, z, router)

    # -- decoding ----------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> Cache:
        """Allocate every attention visit's KV cache for up to max_len tokens."""
        cfg, lc = self.cfg, self.cfg.loop
        if not 0 < max_len <= cfg.block_size:
            raise ValueError(f"max_len must be in (0, block_size={cfg.block_size}], got {max_len}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        device = device or self.tok_emb.weight.device
        dtype = dtype or self.tok_emb.weight.dtype
        Hkv, hd, B = cfg.n_kv_head, cfg.hd, batch_size

        def alloc(rows, cap, ring=False):
            z = lambda: torch.zeros(rows, Hkv, cap, hd, device=device, dtype=dtype)
            return KV(z(), z(), ring, torch.full((cap,), -1, device=device, dtype=torch.long) if ring else None)

        kv = {}
        for visit in self.plan:
            if not visit.attn:
                continue
            in_plt = self.plt is not None and lc.in_span(visit.layer)
            if not in_plt:
                kv[(visit.layer, visit.visit)] = alloc(B, max_len)
            elif visit.visit == 0:
                if lc.kv_window:
                    kv[("full", visit.layer)] = alloc(B, max_len)
                    kv[("ring", visit.layer)] = alloc((lc.n_loops - 1) * B, min(lc.kv_window, max_len), True)
                else:
                    kv[("plt", visit.layer)] = alloc(lc.n_loops * B, max_len)
        plt_h = (torch.zeros(lc.n_loops - 1, B, cfg.d_model, device=device, dtype=dtype)
                 if self.plt is not None else None)
        return Cache(kv, B, max_len, 0, plt_h)

    @torch.no_grad()
    def forward_step(self, idx: Tensor, cache: Cache) -> Tensor:
        """Append idx (B, T_new) to the cache and return logits (B, T_new, V)."""
        self._check_idx(idx, cache.length)
        B, T = idx.shape
        if B != cache.batch_size:
            raise ValueError(f"idx batch {B} does not match the cache's batch_size {cache.batch_size}")
        if cache.length + T > cache.max_len:
            raise ValueError(f"cache holds {cache.length} of max_len={cache.max_len} tokens; {T} more do not fit")
        p0 = cache.length
        pos = torch.arange(p0, p0 + T, device=idx.device)
        ctx = Ctx(pos, self.rope_cos[p0:p0 + T], self.rope_sin[p0:p0 + T], None,
                  self.cfg.loop.n_loops, B, cache=cache, start=p0)
        with few_row_projections(self):   # a CPU speed switch only (end of this file); same logits
            x = self.tok_emb(idx)
            x = self._visits(x, ctx, self.plan, []) if self.plt is None else self._plt_step(x, ctx, cache)
            logits = self._head(x, None, []).logits
        for ring, slots, keep in ctx.ring_pos_updates:
            ring.pos[slots] = keep
        cache.length += T
        return logits

    def _plt_step(self, x: Tensor, ctx: Ctx, cache: Cache) -> Tensor:
        lc = self.cfg.loop
        r, B = lc.n_loops, x.shape[0]
        prelude, coda = self._parts()
        e = self._visits(x, ctx, prelude, [])
        if x.shape[1] == 1 and lc.shift:
            # Algorithm 2: every loop's input exists already -> one batched call per span layer
            inputs = [e] + [self.plt[l - 1](e, cache.plt_h[l - 1][:, None]) for l in range(1, r)]
            h = torch.cat(inputs, dim=0)                                    # (r*B, 1, D)
            for i in range(lc.start, lc.start + lc.length):
                h, _ = self.blocks[i](h, self._span_visit(i, 0), ctx, None)
            outs = list(h.view(r, B, 1, -1))
        else:   # a chunk (prefill) or the unshifted control: loops in order, as in training
            outs = self._plt_loops(e, ctx, None, cache.plt_h, [])
        cache.plt_h = torch.stack([o[:, -1] for o in outs[:-1]])
        return self._visits(outs[-1], ctx, coda, [])

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Sample max_new_tokens continuations of idx (B, T) with a KV cache; temperature 0 = greedy."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, Real) \
                or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"generate: temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 1):
            raise ValueError(f"generate: top_k must be None or an int >= 1, got {top_k!r}")
        self._check_idx(idx)
        B, T = idx.shape
        if B == 0 or T == 0:
            raise ValueError(f"generate: the prompt idx must hold at least one sequence of at least one token, "
                             f"got shape {(B, T)}")
        need = T + max(max_new_tokens - 1, 0)   # the last sampled token is returned, never fed back
        if need > self.cfg.block_size:
            raise ValueError(f"prompt {T} + max_new_tokens {max_new_tokens} - 1 exceeds block_size={self.cfg.block_size}")
        cache = self.new_cache(B, need)
        logits = self.forward_step(idx, cache)[:, -1]
        out = [idx]
        for _ in range(max_new_tokens):
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                lg = logits / temperature
                if top_k is not None:
                    kth = torch.topk(lg, min(top_k, lg.shape[-1])).values[:, -1:]
                    lg = lg.masked_fill(lg < kth, float("-inf"))
                nxt = torch.multinomial(lg.softmax(-1), 1, generator=generator)
            out.append(nxt)
            if len(out) - 1 < max_new_tokens:
                logits = self.forward_step(nxt, cache)[:, -1]
        return torch.cat(out, dim=1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ----------------------------------------------------------------------------------------
# Compiling for training

def compile_model(module: nn.Module, *, fullgraph: bool = False, backend="inductor", fresh: bool = True) -> nn.Module:
    """torch.compile a training module (train.Objective, or DDP around it) the way train.py runs it.

    dynamic=False: every distinct shape gets its own static graph. With the default (automatic
    dynamic shapes) the second shape a process sees, e.g. the next run of the main job, would
    be recompiled with symbolic sizes and slower kernels.
    fresh=True: `torch._dynamo.reset()` first. The main job trains many runs in one process on
    CUDA; each has its own shapes, so a run's graphs are never reused by the next, yet they
    would all stay cached under the same code objects, and dynamo stops compiling a function
    after `recompile_limit` (8) entries: run 9 of the small preset's 12 (and most of the paper
    preset's 32) would train eagerly. Resetting per run keeps one run's entries (the training
    graph, plus validation's compiled flex / block-mask helpers) far below the limit whatever
    the ladder's size, instead of raising a global limit by a number that must track it, and
    frees the finished run's graphs. The cost, recompiling a shape that a later run repeats
    (none does in the main job), is mostly met by inductor's on-disk cache. The reset clears
    every compiled function of the process, so it belongs where one training run owns the
    process (train.Trainer), not in code that interleaves several compiled models.
    fullgraph=True makes any graph break an error (tests/test_compile.py holds every config to
    it); training leaves it off so an unforeseen break costs speed, not the run.
    """
    if fresh:
        torch._dynamo.reset()
    return torch.compile(module, fullgraph=fullgraph, dynamic=False, backend=backend)


# ----------------------------------------------------------------------------------------
# Decoding on CPU: the few-row projection layout (a speed switch; the model above never needs it)

# Products with at most this many rows (batch-1 decoding; PLT's r stacked loops) run as
# W @ x^T under `few_row_projections`. 0 turns the rule off (bench.py times both).
SKINNY_ROWS = 16


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight^T, (..., d_in) -> (..., d_out): F.linear, except that in CPU inference a product of
    1..SKINNY_ROWS rows runs as W @ x^T (a single row padded to two when torch has 2+ threads)."""
    rows = x.numel() // x.shape[-1]
    if (not 0 < rows <= SKINNY_ROWS or x.device.type != "cpu" or torch.is_grad_enabled()
            or torch.compiler.is_compiling()):
        return F.linear(x, weight)
    x_RD = x.reshape(rows, x.shape[-1])
    if rows == 1:   # MKL's GEMV runs on one thread here; a two-column GEMM uses them all
        if torch.get_num_threads() == 1:
            return F.linear(x, weight)
        x_RD = torch.cat([x_RD, x_RD])
    y_RO = torch.mm(weight, x_RD.t())[:, :rows].t().contiguous()   # (rows, d_out), F.linear's layout
    return y_RO.view(*x.shape[:-1], weight.shape[0])


def _few_row_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return linear(x, self.weight)


# model -> [(projection, its few-row forward)]: weak keys, so a model's entry goes with the model
_BOUND: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


def _projections(model: nn.Module) -> list[nn.Linear]:
    """The matrices a decoded token passes: attention q/k/v/o, dense SwiGLU gate/up/down, the head."""
    lins = []
    for m in model.modules():
        if isinstance(m, Attention):
            lins += [m.wq, m.wk, m.wv, m.wo]
        elif isinstance(m, SwiGLU):
            lins += [m.gate, m.up, m.down]
    head = getattr(model, "lm_head", None)
    return lins + ([head] if head is not None else [])


@contextlib.contextmanager
def few_row_projections(model: nn.Module):
    """Within this block, the model's projections (`_projections`) compute with `linear` on CPU.

    Batch-1 decoding multiplies 1 row (the unlooped model) or r rows (PLT's stacked loops) by
    weights that do not stay in cache. Measured per product with fp32 weights cycling through
    48 matrices, torch 2.13 (MKL) on a 2-core AMD EPYC, 3072 x 512 weight:

                               1 thread    2 threads
      F.linear, 1 row            0.93 ms     0.97 ms   (GEMV: one thread either way)
      F.linear, 2 rows           1.77 ms     1.97 ms
      W @ x^T,  2 rows           0.84 ms     0.61 ms
      W @ [x; x]^T (1 row)       1.09 ms     0.61 ms

    So F.linear gave PLT's batched loops nothing (2 rows cost 2 rows), while W x^T does 2 rows
    in about one row's time on either thread count (and beats F.linear up to 64 rows on 2
    threads): a few rows run as W x^T. A single row is padded to two only with more than one
    thread, where the GEMM's threads beat the one-thread GEMV; that speeds the unlooped model
    as much as PLT, so the comparison stays like for like. With gradients, under torch.compile,
    above SKINNY_ROWS rows or off CPU it is plain F.linear, and outside this block the model
    is plain nn.Linear everywhere. A tied head (`tie_embeddings`) stays F.linear.

    Mechanism: each projection gets an instance-level `forward` for the duration of the block,
    removed on exit (also on error); a block nested inside another leaves the outer one's in
    place. The list of projections is built once per model (`_BOUND`; entering costs ~10 us, not
    the ~150 us of walking the modules every token; a projection swapped in later runs plain
    F.linear: slower, same results). `forward_step` (and so `generate`, eval's
    shared-context scoring) enters it.
    """
    pairs = _BOUND.get(model)
    if pairs is None:   # built once per model: this runs for every decoded token
        pairs = _BOUND[model] = [(m, types.MethodType(_few_row_forward, m)) for m in _projections(model)]
    if not pairs or pairs[0][0].weight.device.type != "cpu":
        yield model
        return
    mine = [(m, f) for m, f in pairs if "forward" not in m.__dict__]
    for m, f in mine:
        m.__dict__["forward"] = f
    try:
        yield model
    finally:
        for m, _ in mine:
            m.__dict__.pop("forward", None)
