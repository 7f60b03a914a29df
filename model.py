"""The decoder: a pre-norm GQA transformer with dense or MoE SwiGLU feed-forward, looped by plan.

SMELT (Sec. 3.1) and How to Loop share one template: token embedding, pre-norm blocks (RMSNorm ->
attention -> residual, RMSNorm -> feed-forward -> residual), a final RMSNorm and an untied head.

  * `Block`: one visit of one layer with its residual scales (1/r inside a looped span, SMELT Eq. 8-9).
  * `GPT` runs the visits of `loop.plan(n_layer, cfg.loop)`; PLT (`loop.parallel`) runs the span's loops
    in order in training (How-to-Loop Algorithm 1), batched when decoding one token (Algorithm 2).
  * `forward` -> (logits, ce + aux_loss_coef * load-balance + z_loss_coef * z-loss); `run` -> `Output`.
  * `new_cache`, `forward_step`, `generate`: decoding, with the full forward's logits.
  * `init_weights`: N(0, init_std); `RESIDUAL_OUT` parameters std / sqrt(2 * n_layer) (GPT-2's rule).

Read loop.py, attention.py and moe.py next; design notes and measurements: docs/model.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import partial
from numbers import Integral, Real

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from attention import KV, Attention, Cache, Ctx, rope_table
from checks import check_fields, from_dict
from loop import LoopConfig, PLTInject, RMSNorm, Visit, make_adapters, plan, shift_states
from moe import IMPLS as MOE_IMPLS, MoE, RouterStats


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
    n_shared_experts: int = 0       # always-active dense SwiGLU experts of width d_ff per MoE layer (moe.py)
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
        for name in ("vocab_size", "block_size", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff",
                     "rope_theta", "norm_eps", "init_std"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("aux_loss_coef", "z_loss_coef", "n_experts", "n_shared_experts"):
            if getattr(self, name) < 0:
                bad(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.rope_theta <= 1e30:   # float32 angles: below 1 they spin > 1 rad/token, far below overflow
            bad(f"rope_theta={self.rope_theta} makes the rotary angles non-finite or meaningless: use [1, 1e30]")
        for name, most in (("aux_loss_coef", 1e3), ("z_loss_coef", 1e3), ("init_std", 10.0), ("norm_eps", 1.0)):
            if getattr(self, name) > most:   # finite but absurd: the loss or the weights overflow float32
                bad(f"{name}={getattr(self, name)} overflows or swamps the float32 loss or weights: use <= {most:g}")
        for name, choices in (("attn_backend", ("auto", "sdpa", "flex", "math")), ("moe_impl", MOE_IMPLS)):
            if getattr(self, name) not in choices:
                bad(f"{name} must be {'|'.join(choices)}, got {getattr(self, name)!r}")
        if self.n_head % self.n_kv_head:
            bad(f"n_head % n_kv_head must be 0 (grouped-query attention), got {self.n_head} % {self.n_kv_head}")
        if self.head_dim is None and self.d_model % self.n_head:
            bad(f"d_model % n_head must be 0 when head_dim is None, got {self.d_model} % {self.n_head}")
        if self.hd <= 0 or self.hd % 2:
            bad(f"head_dim must be a positive even number (RoPE rotates pairs), got {self.hd}")
        if self.n_experts > 0 and not 1 <= self.top_k <= self.n_experts:
            bad(f"top_k must satisfy 1 <= top_k <= n_experts, got top_k={self.top_k}, n_experts={self.n_experts}")
        if self.n_shared_experts and not self.n_experts:
            bad(f"n_shared_experts={self.n_shared_experts} needs routed experts (n_experts > 0)")
        self.loop.validate(self.n_layer)
        if self.n_experts and self.loop.active and self.loop.adapter != "none" and self.loop.part == "mlp":
            bad(f"loop.part='mlp' with n_experts={self.n_experts} adds no adapter: MoE blocks take adapters on "
                f"attention only (docs/loop.md); use part='attn' or 'both'")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":   # unknown keys are named in a ValueError
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


# ---- Blocks --------------------------------------------------------------------------------------

class SwiGLU(nn.Module):
    RESIDUAL_OUT = ("down.weight",)                     # GPT.init_weights: depth-scaled std

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        D, Fd = cfg.d_model, cfg.d_ff
        self.gate = nn.Linear(D, Fd, bias=False)
        self.up = nn.Linear(D, Fd, bias=False)
        self.down = nn.Linear(Fd, D, bias=False)
        self.adapters = (make_adapters({"gate": (D, Fd), "up": (D, Fd), "down": (Fd, D)}, cfg.loop)
                         if cfg.loop.adapted(layer, "mlp") else None)

    def forward(self, x: Tensor, loop: int | None = None) -> Tensor:
        """loop: this visit's loop index for the adapters (None: x is a stacked PLT batch, loop-major)."""
        if self.adapters is None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        ad = self.adapters
        h = F.silu(ad["gate"].add_to(self.gate(x), x, loop)) * ad["up"].add_to(self.up(x), x, loop)
        return ad["down"].add_to(self.down(h), h, loop)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        lc = cfg.loop
        self.attn = Attention(cfg, layer, partial(make_adapters, loop=lc) if lc.adapted(layer, "attn") else None)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = (MoE(cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.top_k, cfg.router_renormalize, cfg.moe_impl,
                        cfg.n_shared_experts) if cfg.n_experts > 0 else SwiGLU(cfg, layer))

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
            m, stats = self.mlp(h) if isinstance(self.mlp, MoE) else (self.mlp(h, loop), None)
            m = visit.mlp_scale * m
            x = x + m
            if cap is not None:
                cap.update(mlp_norm=h, mlp_write=m)
                if stats is not None:
                    cap["topk_idx"] = stats.topk_idx
        return x, stats


# ---- Argument checks (host reads in eager code only) ---------------------------------------------

def _check_idx(cfg: ModelConfig, idx: Tensor, start: int = 0) -> None:
    """Token ids: an integer (B, T) tensor within the vocabulary and the context."""
    if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"idx must be an integer tensor of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
    if start + idx.shape[1] > cfg.block_size:
        raise ValueError(f"sequence of {start + idx.shape[1]} tokens exceeds block_size={cfg.block_size}")
    if idx.numel() and not torch.compiler.is_compiling():   # a host sync: checked in eager code only
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, vocab_size={cfg.vocab_size}), got min {lo}, max {hi}")


def _check_run_args(cfg: ModelConfig, idx: Tensor, targets: Tensor | None, doc_ids: Tensor | None) -> None:
    """The full forward's argument rules, each a ValueError naming the argument."""
    _check_idx(cfg, idx)
    if 0 in idx.shape:
        raise ValueError(f"idx must hold at least one sequence of at least one token, got shape {tuple(idx.shape)}")
    for name, t in (("doc_ids", doc_ids), ("targets", targets)):
        if t is not None and t.shape != idx.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} must equal idx shape {tuple(idx.shape)}")
    if doc_ids is not None and doc_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"doc_ids must be an integer tensor (document numbers), got {doc_ids.dtype}")
    if targets is not None:
        if targets.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
        if not torch.compiler.is_compiling():   # a host sync: checked in eager code only
            bad = (targets < -1) | (targets >= cfg.vocab_size)
            if bool(bad.any()):
                raise ValueError(f"targets must lie in [0, vocab_size={cfg.vocab_size}) or be -1 (ignored), "
                                 f"got {targets[bad][0].item()}")


def init_roles(model: nn.Module) -> tuple[set[str], set[str]]:
    """(names of `RESIDUAL_OUT` parameters, names of `OWN_INIT` ones: True for all of a module's, or a tuple)."""
    residual, own = set(), set()
    for prefix, m in model.named_modules():
        pre = prefix + "." if prefix else ""
        declared = getattr(m, "OWN_INIT", False)
        if declared is True:
            own.update(pre + n for n, _ in m.named_parameters())
        elif declared:
            own.update(pre + n for n in declared)
        residual.update(pre + n for n in getattr(m, "RESIDUAL_OUT", ()))
    present = {n for n, _ in model.named_parameters()}   # a declared parameter may be optional (kv_gate)
    return residual & present, own & present


# ---- The model -----------------------------------------------------------------------------------

class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.plan = plan(cfg.n_layer, cfg.loop)   # static: a function of the config
        self._visit_of = {(v.layer, v.visit): v for v in self.plan}
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        lc = cfg.loop
        self.plt = (nn.ModuleList(PLTInject(cfg.d_model, lc.inject, cfg.norm_eps) for _ in range(lc.n_loops - 1))
                    if lc.parallel else None)
        cos, sin = rope_table(cfg.block_size, cfg.hd, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    # -- init ------------------------------------------------------------------------------
    def init_weights(self) -> None:
        """N(0, init_std) for every matrix, 1 for RMSNorm gains; RESIDUAL_OUT / sqrt(2 * n_layer): stored layers,
        not visits (SMELT App. A), as the loop's 1/r residual scale normalises the extra visits (Eq. 8-9)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layer)
        residual, own = init_roles(self)
        gains = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, RMSNorm)}
        for name, p in self.named_parameters():
            if name in own:
                continue   # adapters / PLT gates own their init (zero where it must be a no-op)
            if name in gains:
                nn.init.ones_(p)
            elif p.dim() < 2:   # a bias or gain of a new module: it must say how it starts
                raise ValueError(f"GPT.init_weights: {name} is not an RMSNorm gain nor a matrix; "
                                 f"declare its init in its module's OWN_INIT")
            elif name in residual:
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, std)

    # -- full forward ------------------------------------------------------------------------
    def forward(self, idx: Tensor, targets: Tensor | None = None, doc_ids: Tensor | None = None):
        out = self.run(idx, targets, doc_ids)
        return out.logits, out.loss

    def run(self, idx: Tensor, targets: Tensor | None = None, doc_ids: Tensor | None = None,
            capture: dict | None = None) -> Output:
        """Full forward. capture: a dict that receives {(layer, visit): {name: tensor}} for probes."""
        _check_run_args(self.cfg, idx, targets, doc_ids)
        router = []
        x = self._body(self.tok_emb(idx), self.full_ctx(idx, doc_ids, capture), doc_ids, router)
        return self._head(x, targets, router)

    def full_ctx(self, idx: Tensor, doc_ids: Tensor | None = None, capture: dict | None = None) -> Ctx:
        """The context of a full forward over idx (B, T) from position 0: positions, RoPE rows, document ids."""
        B, T = idx.shape
        return Ctx(torch.arange(T, device=idx.device), self.rope_cos[:T], self.rope_sin[:T], doc_ids, B,
                   capture=capture)

    def _visits(self, x: Tensor, ctx: Ctx, visits, router: list) -> Tensor:
        """Run visits in order; each visit's loop index is its visit number."""
        for visit in visits:
            x, st = self.blocks[visit.layer](x, visit, ctx, visit.visit)
            if st is not None:
                router.append((visit, st))
        return x

    def _plt_loops(self, e: Tensor, ctx: Ctx, doc_ids: Tensor | None, h_prev: Tensor | None,
                   router: list) -> list[Tensor]:
        """PLT Algorithm 1, every loop's output: loop 1 runs the span on e, loop l >= 2 on combine(e, h^(l-1)
        shifted one token right). h_prev (r-1, B, D): each loop's state at the token before (decoding)."""
        lc = self.cfg.loop
        outs = []
        for l in range(lc.n_loops):
            if l == 0:
                h = e
            else:
                prev = None if h_prev is None else h_prev[l - 1]
                h = self.plt[l - 1](e, shift_states(outs[-1], doc_ids, prev) if lc.shift else outs[-1])
            span = [self._visit_of[(i, l)] for i in range(lc.start, lc.start + lc.length)]
            outs.append(self._visits(h, ctx, span, router))   # PLT: schedule "block", visit l is loop l
        return outs

    def _body(self, x: Tensor, ctx: Ctx, doc_ids: Tensor | None, router: list) -> Tensor:
        """The plan's visits; a PLT span runs as Algorithm 1 in a full forward, `_plt_step` in decoding."""
        if self.plt is None:
            return self._visits(x, ctx, self.plan, router)
        lc = self.cfg.loop
        e = self._visits(x, ctx, [v for v in self.plan if v.layer < lc.start], router)
        h = self._plt_loops(e, ctx, doc_ids, None, router)[-1] if ctx.cache is None else self._plt_step(e, ctx)
        return self._visits(h, ctx, [v for v in self.plan if v.layer >= lc.start + lc.length], router)

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
            return KV(z(), z(), torch.full((cap,), -1, device=device, dtype=torch.long) if ring else None)

        kv = {}
        for visit in (v for v in self.plan if v.attn):
            if self.plt is None or not lc.in_span(visit.layer):
                kv[(visit.layer, visit.visit)] = alloc(B, max_len)
            elif visit.visit == 0:
                if lc.kv_window:
                    kv[("full", visit.layer)] = alloc(B, max_len)
                    kv[("ring", visit.layer)] = alloc((lc.n_loops - 1) * B, min(lc.kv_window - 1, max_len), True)
                else:
                    kv[("plt", visit.layer)] = alloc(lc.n_loops * B, max_len)
        plt_h = (torch.zeros(lc.n_loops - 1, B, cfg.d_model, device=device, dtype=dtype)
                 if self.plt is not None else None)
        return Cache(kv, B, max_len, 0, plt_h)

    @torch.no_grad()
    def forward_step(self, idx: Tensor, cache: Cache) -> Tensor:
        """Append idx (B, T_new) to the cache and return logits (B, T_new, V)."""
        _check_idx(self.cfg, idx, cache.length)
        B, T = idx.shape
        if B != cache.batch_size:
            raise ValueError(f"idx batch {B} does not match the cache's batch_size {cache.batch_size}")
        if cache.length + T > cache.max_len:
            raise ValueError(f"cache holds {cache.length} of max_len={cache.max_len} tokens; {T} more do not fit")
        p0 = cache.length
        ctx = Ctx(torch.arange(p0, p0 + T, device=idx.device), self.rope_cos[p0:p0 + T], self.rope_sin[p0:p0 + T],
                  None, B, cache=cache, start=p0)
        logits = self._head(self._body(self.tok_emb(idx), ctx, None, []), None, []).logits
        for ring, slots, keep in ctx.ring_pos_updates:
            ring.pos[slots] = keep
        cache.length += T
        return logits

    def _plt_step(self, e: Tensor, ctx: Ctx) -> Tensor:
        """The PLT span in decoding, from its input e; each loop's last state is kept in cache.plt_h."""
        lc, cache = self.cfg.loop, ctx.cache
        r, B = lc.n_loops, e.shape[0]
        if e.shape[1] == 1 and lc.shift:
            # Algorithm 2: every loop's input exists already -> one batched call per span layer
            inputs = [e] + [self.plt[l - 1](e, cache.plt_h[l - 1][:, None]) for l in range(1, r)]
            h = torch.cat(inputs, dim=0)                                    # (r*B, 1, D)
            for i in range(lc.start, lc.start + lc.length):
                h, _ = self.blocks[i](h, self._visit_of[(i, 0)], ctx, None)   # part="both": same scales every loop
            outs = list(h.view(r, B, 1, -1))
        else:   # a chunk (prefill) or the unshifted control: loops in order, as in training
            outs = self._plt_loops(e, ctx, None, cache.plt_h, [])
        cache.plt_h = torch.stack([o[:, -1] for o in outs[:-1]])
        return outs[-1]

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
        _check_idx(self.cfg, idx)
        B, T = idx.shape
        if B == 0 or T == 0:
            raise ValueError(f"generate: the prompt idx must hold at least one token in each row, got shape {(B, T)}")
        need = T + max(max_new_tokens - 1, 0)   # the last sampled token is returned, never fed back
        if need > self.cfg.block_size:
            raise ValueError(f"prompt {T} + max_new_tokens {max_new_tokens} - 1 exceeds "
                             f"block_size={self.cfg.block_size}")
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


def compile_model(module: nn.Module, *, fullgraph: bool = False, backend="inductor") -> nn.Module:
    """torch.compile a training module as train.py does: one static graph per shape (dynamic=False). The reset
    keeps many runs under dynamo's recompile limit and clears every compiled function: call it where one
    training run owns the process (train.Trainer; docs/model.md). fullgraph=True: graph breaks are errors."""
    torch._dynamo.reset()
    return torch.compile(module, fullgraph=fullgraph, dynamic=False, backend=backend)
