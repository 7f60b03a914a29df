"""Mixture-of-Experts feed-forward (SMELT Sec. 3.1): top-k router, grouped matmul, dropless SwiGLU experts.

  * Router: top-k of softmax(x W_r), renormalised to sum to one (Mixtral; `renormalize=False`: Qwen-MoE).
    Load-balancing loss (Switch) n_experts * sum_e f_e P_e (1 when balanced) and z-loss (ST-MoE) mean
    logsumexp(logits)^2, returned in `RouterStats`, never kept in module state. Dropless: no capacity.
  * Shared experts (`n_shared`; DeepSeek-MoE / Qwen-MoE without a gate): dense SwiGLUs of the
    expert width that every token passes through.
  * `grouped_mm(x, w, group_sizes)`: rows sorted by expert, block g times w[g]; checked against
    `grouped_mm_reference`:
      "loop"    CPU eager: torch.mm(out=) per group, hand-written backward (a custom op when compiled)
      "torch"   torch._grouped_mm: fused and sync-free in bf16 on Hopper / B200
      "padded"  static shapes, nothing read back: groups padded to tiles, one bmm (compiled, other CUDA)
      "auto"    torch where it is fused, padded on other CUDA or when compiling, else loop
  * bf16: the experts compute in the autocast dtype (`compute_dtype`), the output in the input's.
  * `combine`: each token's k rows summed back by a gather and k adds, no atomics (deterministic on CUDA),
    bit-identical on CPU to the index_add_ it replaced (`_combine_reference`).
  * `MoE.forward_reference`: the per-token, per-expert loop that defines the layer's output.

Read next: model.py (Block picks MoE or SwiGLU), budget.py (what it costs); timings: docs/moe.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


# ---- Grouped matmul ------------------------------------------------------------------------------

def grouped_mm_reference(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    chunks = torch.split(x, group_sizes.tolist(), dim=0)
    return torch.cat([c @ w[g] for g, c in enumerate(chunks)], dim=0)


def _mm_loop(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:   # one mm per non-empty group
    sizes = group_sizes.tolist()
    out = x.new_empty(x.shape[0], w.shape[2])
    for x_g, w_g, out_g, n in zip(x.split(sizes), w.unbind(0), out.split(sizes), sizes):
        if n:
            torch.mm(x_g, w_g, out=out_g)
    return out


def _wgrad_loop(x: Tensor, dy: Tensor, group_sizes: Tensor) -> Tensor:   # dW[g] = x_g^T dy_g, 0 if empty
    sizes = group_sizes.tolist()
    dw = x.new_empty(group_sizes.shape[0], x.shape[1], dy.shape[1])
    for x_g, dy_g, dw_g, n in zip(x.split(sizes), dy.split(sizes), dw.unbind(0), sizes):
        if n:
            torch.mm(x_g.t(), dy_g, out=dw_g)
        else:
            dw_g.zero_()
    return dw


def _grouped_mm_backward(ctx, dy, mm=_mm_loop, wgrad=_wgrad_loop):
    x, w, group_sizes = ctx.saved_tensors
    dy = dy.contiguous()   # a stride-0 (expanded) gradient cannot be sliced into mm's out=
    dx = mm(dy, w.transpose(1, 2), group_sizes) if ctx.needs_input_grad[0] else None
    dw = wgrad(x, dy, group_sizes) if ctx.needs_input_grad[1] else None
    return dx, dw, None


class _GroupedMM(torch.autograd.Function):
    """Eager path: the two loops above with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, w, group_sizes):
        ctx.save_for_backward(x, w, group_sizes)
        return _mm_loop(x, w, group_sizes)

    backward = staticmethod(_grouped_mm_backward)


class _ContiguousGrad(torch.autograd.Function):
    """Identity with a contiguous gradient: torch._grouped_mm's backward rejects y.sum()'s stride-0 one."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return dy.contiguous()


# Compiled path: the same loops as opaque custom ops, so torch.compile sees one call with a
# static output shape instead of a data-dependent Python loop (which would break the graph).
# Eager code does not use them: their first call imports torch._dynamo (seconds per process).
@torch.library.custom_op("looped_moe::grouped_mm", mutates_args=())
def _grouped_mm_op(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    return _mm_loop(x, w, group_sizes)


@_grouped_mm_op.register_fake
def _(x, w, group_sizes):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("looped_moe::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(x: Tensor, dy: Tensor, group_sizes: Tensor) -> Tensor:
    return _wgrad_loop(x, dy, group_sizes)


@_grouped_mm_wgrad_op.register_fake
def _(x, dy, group_sizes):
    return x.new_empty(group_sizes.shape[0], x.shape[1], dy.shape[1])


_grouped_mm_op.register_autograd(partial(_grouped_mm_backward, mm=_grouped_mm_op, wgrad=_grouped_mm_wgrad_op),
                                 setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


IMPLS = ("auto", "loop", "torch", "padded", "reference")


def padded_tile_rows(n_rows: int, n_groups: int) -> int:
    """Rows per "padded" tile: ~ a quarter of the mean group, a multiple of 8 (>= 8)."""
    return max(8, -(-n_rows // (4 * n_groups * 8)) * 8)


def grouped_mm_padded(x: Tensor, w: Tensor, group_sizes: Tensor, tile: int | None = None) -> Tensor:
    """Groups padded to whole tiles of `tile` rows, one bmm: shapes depend on (N, G, tile) only, no host read."""
    N, G = x.shape[0], w.shape[0]
    M = tile or padded_tile_rows(N, G)
    n_tiles = N // M + G                                   # >= sum_g ceil(n_g / M) for any routing
    sizes = group_sizes.to(torch.int64)
    tiles_g = (sizes + (M - 1)) // M                        # (G,) tiles of each group
    tile_end = torch.cumsum(tiles_g, 0)                     # (G,) first tile after each group
    row_end = torch.cumsum(sizes, 0)                        # (G,) first row after each group
    rows = torch.arange(N, device=x.device)
    g_row = torch.searchsorted(row_end, rows, right=True)   # (N,) group of each row
    dest = (tile_end - tiles_g)[g_row] * M + rows - (row_end - sizes)[g_row]   # (N,) row in the padded layout
    x_pad = x.new_zeros(n_tiles * M, x.shape[1]).index_copy(0, dest, x)        # unused rows stay zero
    g_tile = torch.searchsorted(tile_end, torch.arange(n_tiles, device=x.device), right=True)
    w_tile = w.index_select(0, g_tile.clamp(max=G - 1))   # (n_tiles, d_in, d_out); empty tail tiles: any expert
    y_pad = torch.bmm(x_pad.view(n_tiles, M, -1), w_tile)  # (n_tiles, M, d_out)
    return y_pad.view(n_tiles * M, -1).index_select(0, dest)


def fused_grouped_mm_available(device: torch.device) -> bool:
    """torch._grouped_mm has its fused, sync-free bf16 kernel here (CUDA capability 9.0 or 10.0)."""
    if device.type != "cuda":
        return False
    p = torch.cuda.get_device_properties(device)   # constant-folded under torch.compile
    return (p.major, p.minor) in ((9, 0), (10, 0))


def resolve_impl(impl: str, device: torch.device, dtype: torch.dtype | None, d_in: int, d_out: int) -> str:
    """The implementation "auto" stands for with operands of this device and dtype (None: x and w differ)."""
    if impl != "auto":
        return impl
    if (dtype == torch.bfloat16 and fused_grouped_mm_available(device)
            and d_in % 8 == 0 and d_out % 8 == 0):   # _grouped_mm wants 16-byte aligned rows
        return "torch"
    if device.type == "cuda" or torch.compiler.is_compiling():
        return "padded"
    return "loop"


def grouped_mm(x: Tensor, w: Tensor, group_sizes: Tensor, impl: str = "auto") -> Tensor:
    """x (N, d_in) rows sorted by group, w (G, d_in, d_out), group_sizes (G,) summing to N -> (N, d_out)."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_mm: shapes x {tuple(x.shape)}, w {tuple(w.shape)}, "
                         f"group_sizes {tuple(group_sizes.shape)} do not fit (N,d_in), (G,d_in,d_out), (G,)")
    impl = resolve_impl(impl, x.device, x.dtype if w.dtype == x.dtype else None, x.shape[1], w.shape[2])
    if impl in ("loop", "reference") and group_sizes.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool((group_sizes < 0).any()) or int(group_sizes.sum()) != x.shape[0]:   # these read the sizes anyway
            raise ValueError(f"grouped_mm: group_sizes must be >= 0 and sum to x's {x.shape[0]} rows, "
                             f"got {group_sizes.tolist()}")
    if impl == "loop":
        if torch.compiler.is_compiling():
            return _grouped_mm_op(x, w, group_sizes)
        return _GroupedMM.apply(x, w, group_sizes)
    if impl == "padded":
        return grouped_mm_padded(x, w, group_sizes)
    if impl == "torch":
        offs = torch.cumsum(group_sizes, 0, dtype=torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))
    if impl == "reference":
        return grouped_mm_reference(x, w, group_sizes)
    raise ValueError(f"grouped_mm: impl must be one of {'|'.join(IMPLS)}, got {impl!r}")


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's when autocast is on for x's device, else x's."""
    dev = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def weighted_swiglu(gu: Tensor, w: Tensor) -> Tensor:
    """silu(g) * u * w for gu = [g | u] (N, 2F), w (N,) -> (N, F): plain ops, which inductor fuses when compiled."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u * w[:, None]


# ---- Combine: each token's k expert rows summed back -------------------------------------------

def _combine_reference(y_sorted: Tensor, token: Tensor, n_tokens: int, dtype: torch.dtype) -> Tensor:
    """The combine before issue 54: one index_add_ (on CUDA atomic adds, whose order, so bits, vary)."""
    return y_sorted.new_zeros(n_tokens, y_sorted.shape[1], dtype=dtype).index_add_(0, token, y_sorted.to(dtype))


def combine(y_sorted: Tensor, token: Tensor, n_tokens: int, dtype: torch.dtype) -> Tensor:
    """Each token's k rows summed: y_sorted (N*k, D) sorted by expert, token (N*k,) their tokens -> (N, D) dtype.

    A gather and k adds in a fixed order: deterministic on every device (the gather's backward writes each
    row once, so no two atomic adds meet). Each token's rows are added to zero in ascending row order, the
    order CPU index_add_ visits them, so it is bit-identical to `_combine_reference` there, values and
    gradients; bf16 / fp16 accumulate in fp32 and round once, as CPU index_add_ does (tests/test_moe.py).
    """
    k, D = token.shape[0] // n_tokens, y_sorted.shape[1]
    rows_Nk = torch.argsort(token, stable=True).view(n_tokens, k)   # token n's rows, ascending: index_add_'s order
    y_NkD = y_sorted.to(dtype).index_select(0, rows_Nk.flatten()).view(n_tokens, k, D)   # dtype's values, as there
    y_ND = y_NkD.new_zeros(n_tokens, D, dtype=torch.promote_types(dtype, torch.float32))
    for y_j in y_NkD.unbind(1):   # from zero, like index_add_ (-0.0 + 0 = +0.0); unbind's backward: one stack
        y_ND = y_ND + y_j
    return y_ND.to(dtype)


# ---- Router and MoE layer ------------------------------------------------------------------------

@dataclass
class RouterStats:
    aux_loss: Tensor            # () Switch load-balancing loss
    z_loss: Tensor              # () router z-loss
    tokens_per_expert: Tensor   # (n_experts,) routed (token, slot) pairs per expert
    topk_idx: Tensor            # (B, T, top_k) chosen experts
    topk_weight: Tensor         # (B, T, top_k) their mixing weights


class Router(nn.Module):
    def __init__(self, d_model: int, n_experts: int, top_k: int, renormalize: bool = True):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))

    def forward(self, x_ND: Tensor):
        with torch.autocast(x_ND.device.type, enabled=False):     # routing decisions from fp32 logits
            logits = F.linear(x_ND.float(), self.weight.float())   # (N, E)
        probs = logits.softmax(-1)
        w, idx = probs.topk(self.top_k, dim=-1)                        # (N, k)
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True)
        E = probs.shape[-1]
        flat = idx.flatten()
        counts = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))                            # (E,) on the device: no sync
        f = counts.float() / idx.numel()
        aux = E * (f * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).square().mean()
        return w, idx, counts, aux, z


class MoE(nn.Module):
    """Dropless top-k SwiGLU experts, plus n_shared always-active ones: x (B,T,D) -> (y, RouterStats)."""
    RESIDUAL_OUT = ("w_out", "shared_w_out")   # write into the residual stream: depth-scaled init (model.py)

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int,
                 renormalize: bool = True, impl: str = "auto", n_shared: int = 0):
        super().__init__()
        for name, v, lo in (("d_model", d_model, 1), ("d_ff", d_ff, 1), ("n_experts", n_experts, 1),
                            ("top_k", top_k, 1), ("n_shared", n_shared, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"MoE: {name} must be an int >= {lo}, got {v!r}")
        for ok, rule in ((isinstance(renormalize, bool), f"renormalize must be True or False, got {renormalize!r}"),
                         (top_k <= n_experts, f"need top_k <= n_experts, got top_k={top_k}, n_experts={n_experts}"),
                         (impl in IMPLS, f"impl must be one of {'|'.join(IMPLS)}, got {impl!r}")):
            if not ok:
                raise ValueError(f"MoE: {rule}")
        self.n_experts, self.top_k, self.d_ff, self.impl, self.n_shared = n_experts, top_k, d_ff, impl, n_shared
        self.router = Router(d_model, n_experts, top_k, renormalize)
        self.w_in = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_ff))   # [gate | up] fused
        self.w_out = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        # laid out like the routed experts; none when off (the same parameters and RNG draws as without)
        self.shared_w_in = nn.Parameter(torch.empty(n_shared, d_model, 2 * d_ff)) if n_shared else None
        self.shared_w_out = nn.Parameter(torch.empty(n_shared, d_ff, d_model)) if n_shared else None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """N(0, std) for a standalone layer; GPT.init_weights re-initialises it with depth scaling."""
        for p in (self.router.weight, self.w_in, self.w_out, self.shared_w_in, self.shared_w_out):
            if p is not None:
                nn.init.normal_(p, 0.0, std)

    def experts(self, x_sorted: Tensor, counts: Tensor, w_sorted: Tensor) -> Tensor:
        """Routing-weighted SwiGLU of rows sorted by expert, (N*k, D) -> (N*k, D), in x_sorted's dtype."""
        dt = x_sorted.dtype
        gu = grouped_mm(x_sorted, self.w_in.to(dt), counts, self.impl)                 # (N*k, 2F)
        return grouped_mm(weighted_swiglu(gu, w_sorted.to(dt)), self.w_out.to(dt), counts, self.impl)

    def shared_experts(self, x_ND: Tensor) -> Tensor:
        """Sum of the n_shared SwiGLUs, (N, D) -> (N, D), in x's dtype: one SwiGLU of width n_shared * d_ff."""
        S, D, F2 = self.shared_w_in.shape
        w_in = self.shared_w_in.to(x_ND.dtype).transpose(0, 1).reshape(D, S * F2)    # (D, S*2F)
        g, u = (x_ND @ w_in).view(-1, S, F2).chunk(2, dim=-1)                         # (N, S, F) each
        h = (F.silu(g) * u).reshape(-1, S * F2 // 2)                                  # (N, S*F)
        return h @ self.shared_w_out.to(x_ND.dtype).reshape(S * F2 // 2, D)

    def kernels(self, x_BTD: Tensor) -> tuple[str, str]:
        """The grouped-matmul implementations forward(x_BTD) uses for w_in and w_out (autocast included)."""
        dt = compute_dtype(x_BTD)
        return tuple(resolve_impl(self.impl, x_BTD.device, dt, w.shape[1], w.shape[2]) for w in (self.w_in, self.w_out))

    def forward(self, x_BTD: Tensor) -> tuple[Tensor, RouterStats]:
        if x_BTD.dim() != 3 or x_BTD.shape[-1] != self.w_in.shape[1]:
            raise ValueError(f"MoE: x must be (B, T, d_model={self.w_in.shape[1]}), got {tuple(x_BTD.shape)}")
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(-1, D)                                       # (N, D)
        w, idx, counts, aux, z = self.router(x)
        flat = idx.flatten()                                           # (N*k,) expert of each pair
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k                                    # source row of each sorted pair
        xc = x.to(compute_dtype(x))                                    # bf16 under autocast (see the docstring)
        # index_select, not x[token] / w[order]: its backward is an index_add, faster than indexing's index_put
        w_sorted = w.flatten().index_select(0, order)
        y_sorted = self.experts(xc.index_select(0, token), counts, w_sorted)   # (N*k, D), weighted
        y = combine(y_sorted, token, x.shape[0], x.dtype)              # (N, D): no atomics (see combine)
        if self.n_shared:
            y = y + self.shared_experts(xc).to(x.dtype)
        return y.view(B, T, D), RouterStats(aux, z, counts, idx.view(B, T, -1), w.view(B, T, -1))

    def forward_reference(self, x_BTD: Tensor) -> Tensor:
        """Per-token, per-expert loop: the slow, obvious definition of the layer's output."""
        x = x_BTD.reshape(-1, x_BTD.shape[-1])
        w, idx, *_ = self.router(x)
        y = torch.zeros_like(x)
        for n in range(x.shape[0]):
            for j in range(self.top_k):
                e = idx[n, j]
                gate, up = (x[n] @ self.w_in[e]).chunk(2)
                y[n] += w[n, j].to(x.dtype) * ((F.silu(gate) * up) @ self.w_out[e])
            for s in range(self.n_shared):   # shared experts: every token, weight 1
                gate, up = (x[n] @ self.shared_w_in[s]).chunk(2)
                y[n] += (F.silu(gate) * up) @ self.shared_w_out[s]
        return y.view_as(x_BTD)
