"""Attention for the decoder (SMELT Sec. 3.1, How to Loop): RoPE, grouped-query attention, KV caches.

`head_dim` is independent of d_model / n_head (budget matching changes head geometry), there are no
biases, and packed contexts get document masks (SMELT 3.1: "segment-level attention masks").

  * `rope_table`, `apply_rope` (Llama's half-split layout), `build_mask` (causal, same document, window).
  * `attention_kernel` picks one call's kernel: SDPA, flex attention with a block mask (CUDA, skips masked
    tiles), or "math", the explicit softmax probes read. `attend` runs it; masks are built once per forward.
  * `KV`, `Cache`: a KV cache per attention visit; PLT with `kv_window = w` shares loop 1's cache and keeps
    a ring of the w - 1 previous positions per later loop (How-to-Loop's KV sharing, mixed by a per-head gate).
  * `Attention`: the sub-layer, with per-loop adapters on q/k/v/o inside a looped span (loop.LoopAdapter),
    PLT's batched one-token step and the captures probes.py reads.

Read model.py first (the block that calls this); design notes: docs/attention.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# ---- Rotary embedding and attention kernels ------------------------------------------------------

def rope_table(block_size: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """(cos, sin) rows (T, hd) in the layout `apply_rope` reads: [cos | cos], [-sin | sin]."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(block_size, dtype=torch.float32), inv)   # (T, hd/2)
    c, s = ang.cos(), ang.sin()
    return torch.cat([c, c], dim=-1), torch.cat([-s, s], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, T, hd) -> x cos + [x2 | x1] sin: bit-identical to `apply_rope_reference` (a + (-b) is a - b)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([x2, x1], dim=-1) * sin).type_as(x)


def apply_rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The obvious form: rotate (first half, second half) pairs (Llama layout) by the half tables."""
    half = x.shape[-1] // 2
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, None, :, :half], sin[None, None, :, half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).type_as(x)


def build_mask(q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None, k_doc: Tensor | None,
               window: int = 0) -> Tensor:
    """Boolean (B|1, 1, T, S) mask, True = may attend; positions are absolute, a key position < 0 is empty."""
    m = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= 0)
    if window:
        m = m & (q_pos[:, None] - k_pos[None, :] < window)
    m = m[None, None]
    if q_doc is not None:
        m = m & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    return m


# Inductor's CUDA flex kernel (tl.dot) needs head dims >= 16 ("NYI: embedding dimension ... must be at least 16")
FLEX_MIN_HEAD_DIM = 16


def attention_kernel(backend: str, device_type: str, head_dim: int, training_shape: bool, masked: bool,
                     want_probs: bool = False) -> str:
    """"flex", "sdpa" or "math" for one call. "auto": flex on CUDA for full-sequence attention with a document
    mask or window, except for heads narrower than FLEX_MIN_HEAD_DIM (SDPA: exact; an explicit "flex" raises)."""
    if backend == "math" or want_probs:
        return "math"
    narrow = device_type == "cuda" and head_dim < FLEX_MIN_HEAD_DIM
    if backend == "flex":
        if not training_shape:
            raise ValueError("attn_backend='flex' supports full-sequence attention only (use sdpa for decoding)")
        if narrow:
            raise ValueError(f"attn_backend='flex' needs head_dim >= {FLEX_MIN_HEAD_DIM} on CUDA, got head_dim="
                             f"{head_dim}; use attn_backend='auto' (SDPA for such heads) or wider heads")
        return "flex"
    auto_flex = backend == "auto" and device_type == "cuda" and training_shape and masked and not narrow
    return "flex" if auto_flex else "sdpa"


_flex_compiled = None   # flex_attention compiled once per process for eager CUDA callers (validation)


def _flex(q, k, v, doc: Tensor | None, window: int, masks: dict | None = None) -> Tensor:
    """Flex attention, block mask from document ids (S == T) kept in masks; compiled when eager on CUDA."""
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
    """q (B, H, T, hd), k/v (B, Hkv, S, hd) -> (out (B, H, T, hd), probs (B, H, T, S) or None)."""
    _, H, T, hd = q.shape
    training_shape = k.shape[2] == T and k_doc is q_doc   # keys are the queries' own sequence (no cached prefix)
    kernel = attention_kernel(backend, q.device.type, hd, training_shape, q_doc is not None or bool(window),
                              want_probs)
    if kernel == "math":   # explicit softmax: probes read the probabilities
        rep = H // k.shape[1]
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = (q.float() @ kk.float().transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(~build_mask(q_pos, k_pos, q_doc, k_doc, window), float("-inf")).softmax(-1)
        return (att @ vv.float()).type_as(q), (att if want_probs else None)
    if kernel == "flex":
        return _flex(q, k, v, q_doc, window, masks), None
    gqa = k.shape[1] != H
    if q_doc is None and not window and (training_shape or T == 1):   # one new token sees every cached key
        return F.scaled_dot_product_attention(q, k, v, is_causal=training_shape, enable_gqa=gqa), None
    mask = None if masks is None or not training_shape else masks.get(("bool", window))
    if mask is None:
        mask = build_mask(q_pos, k_pos, q_doc, k_doc, window)
        if masks is not None and training_shape:
            masks[("bool", window)] = mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa), None


# ---- KV cache ------------------------------------------------------------------------------------

@dataclass
class KV:
    """One attention visit's cache. Full caches hold positions [0, max_len); rings hold the last w - 1."""
    k: Tensor                 # (B', Hkv, capacity, hd)
    v: Tensor
    pos: Tensor | None = None  # rings only: (capacity,) absolute position held in each slot, -1 = empty


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
        """Each batch row repeated n times in a row (per loop in PLT caches), for tasks.score_options."""
        if n < 1:
            raise ValueError(f"Cache.repeat: n must be >= 1, got {n}")
        B = self.batch_size

        def rep(t: Tensor) -> Tensor:   # (r*B, ...) -> (r*B*n, ...), loop-major as before
            return t.view(-1, B, *t.shape[1:]).repeat_interleave(n, dim=1).reshape(-1, *t.shape[1:])

        kv = {name: KV(rep(c.k), rep(c.v), None if c.pos is None else c.pos.clone())
              for name, c in self.kv.items()}
        plt_h = None if self.plt_h is None else self.plt_h.repeat_interleave(n, dim=1)
        return Cache(kv, B * n, self.max_len, self.length, plt_h)


# ---- The attention sub-layer ---------------------------------------------------------------------

class Attention(nn.Module):
    RESIDUAL_OUT = ("wo.weight",)                       # GPT.init_weights: depth-scaled std
    OWN_INIT = ("kv_gate.weight",)                      # zero-initialised here, skipped by GPT.init_weights

    def __init__(self, cfg, layer: int, adapters=None):
        """cfg: a model.ModelConfig; adapters: None or loop.make_adapters bound to cfg.loop (model.Block)."""
        super().__init__()
        D, H, Hkv, hd = cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.hd
        self.n_head, self.n_kv_head, self.hd, self.backend = H, Hkv, hd, cfg.attn_backend
        self.wq = nn.Linear(D, H * hd, bias=False)
        self.wk = nn.Linear(D, Hkv * hd, bias=False)
        self.wv = nn.Linear(D, Hkv * hd, bias=False)
        self.wo = nn.Linear(H * hd, D, bias=False)
        self.adapters = (adapters({"q": (D, H * hd), "k": (D, Hkv * hd), "v": (D, Hkv * hd), "o": (H * hd, D)})
                         if adapters is not None else None)
        # PLT KV sharing: later loops mix attention over loop 1's keys with a window of their own
        self.window = cfg.loop.kv_window if cfg.loop.active and cfg.loop.in_span(layer) else 0
        if self.window:
            self.kv_gate = nn.Linear(D, H, bias=False)
            nn.init.zeros_(self.kv_gate.weight)   # per-head gate starts at 1/2

    def proj(self, name: str, lin: nn.Linear, x: Tensor, loop: int | None) -> Tensor:
        """lin(x), plus the loop's adapter correction inside an adapted span (loop None: stacked PLT batch)."""
        return lin(x) if self.adapters is None else self.adapters[name].add_to(lin(x), x, loop)

    def forward(self, x: Tensor, ctx: Ctx, visit, loop: int | None) -> Tensor:   # visit: a loop.Visit
        B, T, _ = x.shape
        H, Hkv, hd = self.n_head, self.n_kv_head, self.hd
        q = self.proj("q", self.wq, x, loop).view(B, T, H, hd).transpose(1, 2)
        k = self.proj("k", self.wk, x, loop).view(B, T, Hkv, hd).transpose(1, 2)
        v = self.proj("v", self.wv, x, loop).view(B, T, Hkv, hd).transpose(1, 2)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
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
        out = self.proj("o", self.wo, y, loop)
        if cap is not None:
            cap.update(pv=y, o=out)
        return out

    def _attend_cached(self, q, k, v, ctx, visit, loop, want_probs=False, backend=None):
        """Attention over the keys before these (the cache, written first) and these; a full forward: these."""
        backend = backend or self.backend
        if ctx.cache is None:
            return attend(q, k, v, ctx.q_pos, ctx.q_pos, ctx.doc, ctx.doc, 0, backend, want_probs, ctx.masks)
        kv, rows = ctx.slot(visit, loop)
        p0, T = ctx.start, q.shape[2]
        kv.k[rows, :, p0:p0 + T] = k
        kv.v[rows, :, p0:p0 + T] = v
        K, V = kv.k[rows, :, :p0 + T], kv.v[rows, :, :p0 + T]
        k_pos = torch.arange(p0 + T, device=q.device)
        return attend(q, K, V, ctx.q_pos, k_pos, None, None, 0, backend, want_probs)

    def _mix(self, x, y_global, y_local):
        g = torch.sigmoid(self.kv_gate(x)).transpose(1, 2)[..., None]  # (B, H, T, 1)
        return g * y_global + (1 - g) * y_local

    def _shared_kv(self, q, k, v, x, ctx, visit):
        """A loop >= 2 with KV sharing, training or chunked decoding: window and ring attention run SDPA."""
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
        """Attend over (ring contents + new keys) within the window, then keep the last n slots in the ring."""
        K = torch.cat([ring.k[rows], k], dim=2)
        V = torch.cat([ring.v[rows], v], dim=2)
        k_pos = torch.cat([ring.pos, ctx.q_pos])
        y, _ = attend(q, K, V, ctx.q_pos, k_pos, None, None, self.window, "sdpa")
        n = ring.k.shape[2]                       # w - 1: a window of w positions ends at the query's own key
        if n:
            keep = ctx.q_pos[-min(q.shape[2], n):]
            slots = keep % n
            ring.k[rows, :, slots] = k[:, :, -len(keep):]
            ring.v[rows, :, slots] = v[:, :, -len(keep):]
            ctx.ring_pos_updates.append((ring, slots, keep))
        return y

    def _shared_kv_step(self, q, k, v, x, ctx, visit):
        """Batched one-token PLT step with KV sharing: rows [0:B] are loop 1, the rest later loops."""
        B = ctx.batch
        y1, _ = self._attend_cached(q[:B], k[:B], v[:B], ctx, visit, 0, backend="sdpa")   # writes loop 1's cache
        full, _ = ctx.slot(visit, 0)
        K1, V1 = full.k[:, :, :ctx.start + 1], full.v[:, :, :ctx.start + 1]
        L1 = q.shape[0] // B - 1                                          # later loops
        ql = q[B:].view(L1, B, *q.shape[1:]).permute(1, 2, 0, 3, 4).flatten(2, 3)  # (B, H, L1, hd)
        yg = F.scaled_dot_product_attention(ql, K1, V1, enable_gqa=K1.shape[1] != ql.shape[1])
        yg = yg.view(B, q.shape[1], L1, 1, -1).permute(2, 0, 1, 3, 4).flatten(0, 1)  # (L1*B, H, 1, hd)
        ring, rows = ctx.slot(visit, None, ring=True)
        yl = self._ring_attend(q[B:], k[B:], v[B:], ring, rows, ctx)
        return torch.cat([y1, self._mix(x[B:], yg, yl)], dim=0)


@dataclass
class Ctx:
    """Per-call context handed to every block: positions, RoPE rows, masks, cache, capture."""
    q_pos: Tensor                 # (T,) absolute positions of the new tokens
    cos: Tensor
    sin: Tensor
    doc: Tensor | None            # (B, T) document ids (full forward only)
    batch: int
    cache: Cache | None = None
    start: int = 0                # cache length before this call
    capture: dict | None = None
    shared: dict = field(default_factory=dict)   # layer -> loop-1 (k, v) for PLT KV sharing
    ring_pos_updates: list = field(default_factory=list)  # applied after the call: all loops read the old ring
    masks: dict = field(default_factory=dict)    # attention masks built once per forward (flex block masks)

    def slot(self, visit, loop: int | None, ring: bool = False) -> tuple[KV, slice]:   # visit: a loop.Visit
        """(KV, rows) this visit reads and writes: stacked PLT caches hold loop l in rows [l*B, (l+1)*B) (None:
        all); with KV sharing ("full", layer) is loop 1's and ("ring", layer) the later loops' windows."""
        c, L, B = self.cache, visit.layer, self.batch
        if ("plt", L) in c.kv:
            return c.kv[("plt", L)], slice(None) if loop is None else slice(loop * B, (loop + 1) * B)
        if ("ring", L) in c.kv:
            if not ring:
                return c.kv[("full", L)], slice(None)
            return c.kv[("ring", L)], slice(None) if loop is None else slice((loop - 1) * B, loop * B)
        return c.kv[(L, visit.visit)], slice(None)
