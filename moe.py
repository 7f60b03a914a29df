"""Mixture-of-Experts feed-forward: top-k router, grouped matmul, dropless SwiGLU experts.

SMELT (Sec. 3.1) routes every token to its top-8 experts in every MoE layer. This file holds
the one MoE layer used by model.py, the router with its auxiliary losses, and the grouped
matrix multiply the experts run on.

Router. logits = x W_r (no bias); p = softmax(logits) over n_experts; the top-k experts are
kept and their probabilities renormalised to sum to one (Mixtral's choice; `renormalize=False`
gives Qwen-MoE's unnormalised weights). Renormalising keeps the size of the MoE write
independent of the pool size, which matters here because budget matching changes n_experts
between the Baseline and SMELT at the same scale.
  * load-balancing loss (Switch Transformer): n_experts * sum_e f_e * P_e, where f_e is the
    fraction of routed (token, slot) pairs sent to expert e and P_e the mean router
    probability of e; equals 1 for a perfectly balanced router.
  * router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2.
Both are *returned* (`RouterStats`) with the tokens per expert and the chosen ids; the model
adds them to the training loss with coefficients from its config. Nothing is kept in module
state. Routing is dropless: every (token, slot) pair is computed; there is no capacity.

Grouped matmul. The (token, slot) rows are sorted by expert so expert g owns a contiguous
block of rows; `grouped_mm(x, w, group_sizes)` multiplies block g by w[g]: a loop of
`torch.mm(..., out=slice)` over the groups in forward, and the same for dx and dW in a
hand-written backward. Under `torch.compile` the same loops run as `torch.library` custom ops,
so the compiler sees one opaque call (no graph break, no data-dependent shapes in the graph:
the output has x's row count); eager code uses a plain autograd.Function over the same loops.
Why: autograd over a Python loop of slices allocates a full-size gradient for every slice in
backward (~20x a dense layer on CPU); gather + padded bmm pays for the padding (~3-4x).
Writing each block into a preallocated output, and computing the weight gradient per block
directly, costs only the useful FLOPs plus one small call per expert. The per-expert views come
from one `split` / `unbind` each rather than a slice per expert (8-36 % faster per grouped_mm on
CPU at 16-64 experts, the gain growing with the expert count). `grouped_mm_reference`
is the slow, obvious version (torch.split + cat) the tests compare it against. On CUDA with
bf16, `impl="auto"` uses `torch._grouped_mm` (one fused kernel on Hopper); bench.py measures
both. The measured CPU ratio against a dense SwiGLU of equal active FLOPs is in the README.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


# ----------------------------------------------------------------------------------------
# Grouped matmul

def grouped_mm_reference(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    """Slow, obvious reference: split rows by group, multiply each by its weight, concatenate."""
    chunks = torch.split(x, group_sizes.tolist(), dim=0)
    return torch.cat([c @ w[g] for g, c in enumerate(chunks)], dim=0)


def _mm_loop(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    """x (N, d_in) sorted by group, w (G, d_in, d_out) -> (N, d_out), one mm per non-empty group."""
    sizes = group_sizes.tolist()
    out = x.new_empty(x.shape[0], w.shape[2])
    for x_g, w_g, out_g, n in zip(x.split(sizes), w.unbind(0), out.split(sizes), sizes):
        if n:
            torch.mm(x_g, w_g, out=out_g)
    return out


def _wgrad_loop(x: Tensor, dy: Tensor, group_sizes: Tensor) -> Tensor:
    """dW[g] = x_g^T dy_g: (G, d_in, d_out); empty groups get zeros."""
    sizes = group_sizes.tolist()
    dw = x.new_empty(group_sizes.shape[0], x.shape[1], dy.shape[1])
    for x_g, dy_g, dw_g, n in zip(x.split(sizes), dy.split(sizes), dw.unbind(0), sizes):
        if n:
            torch.mm(x_g.t(), dy_g, out=dw_g)
        else:
            dw_g.zero_()
    return dw


class _GroupedMM(torch.autograd.Function):
    """Eager path: the two loops above with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, w, group_sizes):
        ctx.save_for_backward(x, w, group_sizes)
        return _mm_loop(x, w, group_sizes)

    @staticmethod
    def backward(ctx, dy):
        x, w, group_sizes = ctx.saved_tensors
        dy = dy.contiguous()   # a stride-0 (expanded) gradient cannot be sliced into mm's out=
        dx = _mm_loop(dy, w.transpose(1, 2), group_sizes) if ctx.needs_input_grad[0] else None
        dw = _wgrad_loop(x, dy, group_sizes) if ctx.needs_input_grad[1] else None
        return dx, dw, None


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


def _op_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _op_backward(ctx, dy):
    x, w, group_sizes = ctx.saved_tensors
    dy = dy.contiguous()
    dx = _grouped_mm_op(dy, w.transpose(1, 2), group_sizes) if ctx.needs_input_grad[0] else None
    dw = _grouped_mm_wgrad_op(x, dy, group_sizes) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_mm_op.register_autograd(_op_backward, setup_context=_op_setup)


def grouped_mm(x: Tensor, w: Tensor, group_sizes: Tensor, impl: str = "auto") -> Tensor:
    """x (N, d_in) rows sorted by group, w (G, d_in, d_out), group_sizes (G,) summing to N -> (N, d_out).

    impl: "loop" (the custom op above, every device), "torch" (torch._grouped_mm, CUDA bf16),
    "reference" (the slow split/cat version), or "auto" ("torch" on CUDA bf16, else "loop").
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_mm: shapes x {tuple(x.shape)}, w {tuple(w.shape)}, "
                         f"group_sizes {tuple(group_sizes.shape)} do not fit (N,d_in), (G,d_in,d_out), (G,)")
    if impl == "auto":
        impl = "torch" if (x.is_cuda and x.dtype == torch.bfloat16) else "loop"
    if impl == "loop":
        if torch.compiler.is_compiling():
            return _grouped_mm_op(x, w, group_sizes)
        return _GroupedMM.apply(x, w, group_sizes)
    if impl == "torch":
        offs = torch.cumsum(group_sizes, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    if impl == "reference":
        return grouped_mm_reference(x, w, group_sizes)
    raise ValueError(f"grouped_mm: impl must be auto|loop|torch|reference, got {impl!r}")


class _WeightedSwiGLU(torch.autograd.Function):
    """h = silu(g) * u * w for gu = [g | u] (N, 2F) and per-row routing weights w (N,).

    Applying the routing weight here, on the F-wide activation, instead of on the D-wide expert
    output, and writing both halves of the gradient into one (N, 2F) buffer (no chunk/cat in
    backward) cut the MoE layer's elementwise time roughly in half on CPU (bench.py moe). The
    backward makes ten passes over (N, F) with four temporaries, written in place where it can
    (d silu / dg = s (1 + g - silu)): 15-41 % faster than the plain thirteen-pass version
    (32k rows of F = 128 on CPU: 103-112 -> 75-95 ms on 1 thread, 71-77 -> 45-48 ms on 2).
    """

    @staticmethod
    def forward(ctx, gu, w):
        g, u = gu.chunk(2, dim=-1)
        ctx.save_for_backward(gu, w)
        return F.silu(g) * u * w[:, None]

    @staticmethod
    def backward(ctx, dh):
        gu, w = ctx.saved_tensors
        g, u = gu.chunk(2, dim=-1)
        w_ = w[:, None]
        sig = torch.sigmoid(g)
        silu = g * sig
        dgu = torch.empty_like(gu)
        dg, du = dgu.chunk(2, dim=-1)
        torch.mul(dh, w_, out=du)
        du.mul_(silu)                                          # du = dh w silu(g)
        t = dh * u
        dw = torch.linalg.vecdot(t, silu) if ctx.needs_input_grad[1] else None   # sum_f dh silu(g) u
        torch.sub(g, silu, out=silu)                           # g (1 - s), reusing silu's buffer
        torch.addcmul(sig, sig, silu, out=silu)                # d silu / dg = s (1 + g (1 - s))
        torch.mul(t, w_, out=dg)
        dg.mul_(silu)                                          # dg = dh u w silu'(g)
        return dgu, dw


# ----------------------------------------------------------------------------------------
# Router and MoE layer

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
        logits = F.linear(x_ND, self.weight).float()                  # (N, E) in fp32
        probs = logits.softmax(-1)
        w, idx = probs.topk(self.top_k, dim=-1)                        # (N, k)
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True)
        E = probs.shape[-1]
        counts = torch.bincount(idx.flatten(), minlength=E)            # (E,)
        f = counts.float() / idx.numel()
        aux = E * (f * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).square().mean()
        return w, idx, counts, aux, z


class MoE(nn.Module):
    """Dropless top-k SwiGLU experts. forward(x (B,T,D)) -> (y (B,T,D), RouterStats)."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int,
                 renormalize: bool = True, impl: str = "auto"):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE: need 1 <= top_k <= n_experts, got top_k={top_k}, n_experts={n_experts}")
        self.n_experts, self.top_k, self.d_ff, self.impl = n_experts, top_k, d_ff, impl
        self.router = Router(d_model, n_experts, top_k, renormalize)
        self.w_in = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_ff))   # [gate | up] fused
        self.w_out = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """N(0, std) for a standalone layer; GPT.init_weights re-initialises it with depth scaling."""
        for p in (self.router.weight, self.w_in, self.w_out):
            nn.init.normal_(p, 0.0, std)

    def experts(self, x_sorted: Tensor, counts: Tensor, w_sorted: Tensor) -> Tensor:
        """Routing-weighted SwiGLU of rows already sorted by expert: (N*k, D), (N*k,) -> (N*k, D)."""
        gu = grouped_mm(x_sorted, self.w_in, counts, self.impl)            # (N*k, 2F)
        return grouped_mm(_WeightedSwiGLU.apply(gu, w_sorted.to(gu.dtype)), self.w_out, counts, self.impl)

    def forward(self, x_BTD: Tensor) -> tuple[Tensor, RouterStats]:
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(-1, D)                                       # (N, D)
        w, idx, counts, aux, z = self.router(x)
        flat = idx.flatten()                                           # (N*k,) expert of each pair
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k                                    # source row of each sorted pair
        # index_select, not x[token]: its backward is an index_add (measured 45 -> 25 ms fwd+bwd on CPU
        # for 32k rows of 256), where indexing's backward is a slower accumulating index_put
        y_sorted = self.experts(x.index_select(0, token), counts, w.flatten()[order])  # (N*k, D), weighted
        y = torch.zeros_like(x).index_add_(0, token, y_sorted)
        stats = RouterStats(aux, z, counts, idx.view(B, T, -1), w.view(B, T, -1))
        return y.view(B, T, D), stats

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
        return y.view_as(x_BTD)
