"""Performance benchmarks (not tests): each times what it compares side by side in one process and prints
the ratios beside their targets (nothing asserts), so no figure depends on another run's timing.
  flex    (CUDA) flex attention vs SDPA on the document mask: output and gradient differences, times.
  steps   (CUDA) compiled training steps of dense, MoE, SMELT and PLT configs: compile s, graphs, syncs, loss.
  moe     MoE layer fwd+bwd vs a dense SwiGLU of equal active FLOPs (CPU: the tiny ladder's own MoE, a small-like one).
  decode  batch-1 time per token: unlooped, sequential 2-loop, PLT 2-loop (target: PLT <= 1.15x unlooped).
  train   tokens/s of a preset's matched Baseline / SMELT pair: time vs FLOP ratio (within 15 %); MFU on CUDA.
  cells   every tiny cell's Baseline / SMELT step: tok/s, F ratio, time ratio (within 10 %), its parts, MoE cost.
Every figure goes to DIR/bench.json (--out-dir) as soon as it exists; a failing benchmark leaves {"error": ...}
beside its partial figures and the others still run (exit 1). --budget-s S: each benchmark under a limit from
what is left (LIMITS; docs/gpu.md). Timing, limits and saving: bench_harness.py; each benchmark in full:
docs/bench.md. Read first: model.py, moe.py (what is measured).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import warnings
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

import attention
import budget
import checks
import configs
import data as data_mod
import train
from lab.bench_harness import clock_for, interleaved, machine, run_benchmarks, threads, timed, update_json
from loop import SMELT, LoopConfig
from model import GPT, ModelConfig, compile_model
from moe import MoE, compute_dtype


class DenseSwiGLU(nn.Module):
    def __init__(self, d_model: int, width: int):
        super().__init__()
        self.w_in = nn.Linear(d_model, 2 * width, bias=False)
        self.w_out = nn.Linear(width, d_model, bias=False)

    def forward(self, x):
        g, u = self.w_in(x).chunk(2, -1)
        return self.w_out(F.silu(g) * u)


def _autocast(device):
    """bf16 autocast on CUDA (what train.py trains with), nothing on CPU (fp32 training)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def bench_moe(device, tokens=4096, d_model=256, d_ff=128, n_experts=64, top_k=8, iters=8, label="",
              target=1.5) -> dict:
    """MoE layer fwd+bwd on the path training takes (fp32 modules; bf16 autocast on CUDA), beside dense."""
    torch.manual_seed(0)
    x = torch.randn(1, tokens, d_model, device=device, requires_grad=True)
    cuda = device.type == "cuda"

    def moe_layer(impl, compiled=False):
        torch.manual_seed(1)
        layer = MoE(d_model, d_ff, n_experts, top_k, impl=impl).to(device)
        return torch.compile(layer, dynamic=False, fullgraph=True) if compiled else layer

    def step(mod, is_moe=True):
        def f():
            with _autocast(device):
                y = mod(x)[0] if is_moe else mod(x)
            y.float().square().mean().backward()
        return f

    dense = DenseSwiGLU(d_model, top_k * d_ff).to(device)
    fns = {"dense": step(dense, False)}
    if cuda:   # eager "auto" is torch._grouped_mm on Hopper / B200, the padded fallback elsewhere
        fns["dense_compiled"] = step(torch.compile(dense, dynamic=False), False)
        fns["moe_auto"] = step(moe_layer("auto"))
        with _autocast(device):
            fused = moe_layer("auto").kernels(x) == ("torch", "torch")
        if fused:
            fns["moe_torch_compiled"] = step(moe_layer("torch", compiled=True))
        fns["moe_padded_compiled"] = step(moe_layer("padded", compiled=True))
    # CUDA: the pre-issue-15 path, one sync per expert; CPU: what training runs (train.py does not compile there)
    fns["moe_loop"] = step(moe_layer("loop"))
    if not cuda:
        fns |= {"moe_padded": step(moe_layer("padded")), "moe_reference": step(moe_layer("reference"))}
    t0 = time.perf_counter()
    for f in fns.values():    # compile and warm everything before timing
        f()
    warm_s = time.perf_counter() - t0
    res = interleaved(fns, device, warmup=1, iters=iters, clock=clock_for(device))
    with _autocast(device):
        dt, auto = compute_dtype(x), "/".join(moe_layer("auto").kernels(x))
    print(f"\nMoE fwd+bwd{' (' + label + ')' if label else ''}, {tokens} tokens, d_model {d_model}, d_ff {d_ff}, "
          f"{n_experts} experts, top-{top_k} ({device.type}, {'bf16 autocast' if cuda else 'fp32'}, "
          f"{torch.get_num_threads()} threads; experts compute in {dt}, eager 'auto' = {auto}):")
    for k, v in res.items():
        print(f"  {k:22s} {v * 1e3:8.2f} ms   {v / res['dense']:5.2f}x dense")
    main = "moe_auto" if cuda else "moe_loop"
    ok = res[main] <= target * res["dense"]
    print(f"  target: {main} <= {target}x dense -> {'met' if ok else 'NOT met'}  (compile + warm-up {warm_s:.0f} s)")
    out = {"ms": {k: v * 1e3 for k, v in res.items()}, "x_dense": {k: v / res["dense"] for k, v in res.items()},
           "compute_dtype": str(dt), "eager_auto_impl": auto, "warmup_and_compile_s": warm_s,
           "shape": dict(tokens=tokens, d_model=d_model, d_ff=d_ff, n_experts=n_experts, top_k=top_k),
           "threads": torch.get_num_threads(), "target_x_dense": target, "target_met": ok}
    if "moe_padded_compiled" in res:
        out["padded_compiled_vs_" + main] = res["moe_padded_compiled"] / res[main]
    return out


def tiny_cells():
    """The tiny preset's ladder cells as reproduce.py builds them, and the prepared data they are sized to."""
    d = data_mod.TokenData(data_mod.default_data_dir("tiny"))
    return budget.ladder_cells("tiny", budget.preset_doc_length("tiny", d), vocab_size=d.vocab_size,
                               arms=configs.PLANS["tiny"].arms), d


def bench_moe_shapes(device) -> dict:
    """bench_moe at the tiny preset's own MoE (the ladder's most experts, 4 x 128 tokens; target 2x) and at a
    small-like shape (4096 tokens, d 160, 32 experts of width 160, top-4; target 1.5x), on one CPU thread."""
    if device.type == "cuda":
        return {"default": bench_moe(device)}
    cfg = max((ModelConfig.from_dict(c[a]) for c in tiny_cells()[0] for a in ("baseline", "smelt")),
              key=lambda c: c.n_experts)
    with threads(1):   # as reproduce.py's training workers
        return {"tiny": bench_moe(device, 4 * cfg.block_size, cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.top_k,
                                  iters=20, label="tiny ladder's largest pool", target=2.0),
                "small": bench_moe(device, 4096, 160, 160, 32, 4, label="small-like", target=1.5)}


def _moe_vs_dense(cfg: ModelConfig, device, tokens: int) -> dict:
    """fwd+bwd of one MoE layer of cfg's shape (its router losses included) and of the dense SwiGLU of
    equal active FLOPs, for `interleaved`."""
    torch.manual_seed(0)
    moe = MoE(cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.top_k).to(device)
    dense = DenseSwiGLU(cfg.d_model, cfg.top_k * cfg.d_ff).to(device)
    x = torch.randn(1, tokens, cfg.d_model, device=device, requires_grad=True)

    def moe_step():
        y, st = moe(x)
        (y.square().mean() + st.aux_loss + st.z_loss).backward()
    return {"moe": moe_step, "dense": lambda: dense(x).square().mean().backward()}


def _visit_step(gpt: GPT, idx, doc):
    """fwd+bwd of one block visit of gpt at the training shape (its router losses included), for `interleaved`:
    a middle visit of the plan (inside the looped span for SMELT), on the step's document mask (built once)."""
    v = gpt.plan[len(gpt.plan) // 2]
    ctx = gpt.full_ctx(idx, doc)
    x = torch.randn(*idx.shape, gpt.cfg.d_model, device=idx.device, requires_grad=True)

    def step():
        y, st = gpt.blocks[v.layer](x, v, ctx, v.visit)
        (y.square().mean() + (0 if st is None else st.aux_loss + st.z_loss)).backward()
    return step


def bench_cells(device, batch_size=4, steps=20) -> dict:
    """Per tiny ladder cell, Baseline and SMELT training steps side by side (one thread on CPU, as
    reproduce.py's workers): tok/s, the head-excluded F ratio of the match, the time ratio, and the
    forward+backward and optimizer (clip + AdamW) parts apart. All eight models take turns each round."""
    ladder, d = tiny_cells()
    cells = {f"{c['scale']} {c['sparsity_label']}": c for c in ladder}
    tc = train.TrainConfig()
    T = next(iter(cells.values()))["baseline"]["block_size"]
    runs, times = {}, {}
    for name, c in cells.items():
        for arch in ("baseline", "smelt"):
            torch.manual_seed(0)
            gpt = GPT(ModelConfig.from_dict(c[arch])).to(device)
            runs[(name, arch)] = (gpt, train.Objective(gpt), train.make_optimizer(gpt, tc))
    with threads(1 if device.type == "cpu" else torch.get_num_threads()):
        clock = clock_for(device)
        for i in range(2 + steps):                         # two warm-up rounds
            idx, tgt, doc = (t.to(device) for t in d.train_batch(i, batch_size, T, seed=0))
            for key, (gpt, obj, opt) in runs.items():
                fwd_bwd = timed(lambda: train.forward_backward(obj, gpt.cfg, idx, tgt, doc, train.step_scale(tgt)),
                                device, clock)[0]
                optim = timed(lambda: train.update(gpt, opt, tc.grad_clip), device, clock)[0]
                if i >= 2:
                    times.setdefault(key, []).append((fwd_bwd + optim, fwd_bwd, optim))
        layer = interleaved({(k, part): f for k, (gpt, _, _) in runs.items()
                             for part, f in _moe_vs_dense(gpt.cfg, device, batch_size * T).items()},
                            device, warmup=2, iters=steps, clock=clock)
        idx, _, doc = (t.to(device) for t in d.train_batch(0, batch_size, T, seed=0))
        visit = interleaved({k: _visit_step(gpt, idx, doc) for k, (gpt, _, _) in runs.items()},
                            device, warmup=2, iters=steps, clock=clock)
    med = {k: [statistics.median(part) for part in zip(*v)] for k, v in times.items()}   # step, fwd+bwd, optim
    # the MoE's cost above its dense equivalent, per step: (layer excess) x (MoE visits of the plan)
    excess = {k: sum(v.mlp for v in gpt.plan) * (layer[(k, "moe")] - layer[(k, "dense")])
              for k, (gpt, _, _) in runs.items()}
    print(f"\nTiny cells, Baseline vs SMELT training step ({device.type}, batch {batch_size} x {T}, "
          f"{'1 thread, thread CPU time' if device.type == 'cpu' else 'wall time'}, median of {steps} interleaved rounds):")
    print(f"  {'cell':12s} {'base tok/s':>10s} {'SMELT tok/s':>11s} {'F ratio':>7s} {'time':>6s} {'time/F':>6s} "
          f"{'fwd+bwd':>7s} {'optim':>6s} {'params':>6s} {'MoE@dense':>9s} {'visits':>6s} {'visit t/F':>9s} "
          f"{'visits@base':>11s}")
    res, tok = {}, batch_size * T
    for name, c in cells.items():
        kb, ks = (name, "baseline"), (name, "smelt")
        b, s, fr = med[kb], med[ks], c["match"]["smelt"]["flops_ratio"]
        # a block visit's FLOPs are F / visits (head excluded): SMELT's per visit over the Baseline's
        Vb, Vs = len(runs[kb][0].plan), len(runs[ks][0].plan)
        f_visit = fr * Vb / Vs
        time_over_flops = s[0] / b[0] / fr
        res[name] = r = {
            "baseline_tok_s": tok / b[0], "smelt_tok_s": tok / s[0], "flops_ratio": fr, "time_ratio": s[0] / b[0],
            "fwd_bwd_ratio": s[1] / b[1], "optimizer_ratio": s[2] / b[2], "params_ratio": c["match"]["smelt"]["params_ratio"],
            "optimizer_share_smelt": s[2] / s[0], "moe_excess_s": {"baseline": excess[kb], "smelt": excess[ks]},
            "time_ratio_moe_at_dense_cost": (s[0] - excess[ks]) / (b[0] - excess[kb]),
            "time_over_flops": time_over_flops, "within_10_percent": abs(time_over_flops - 1) <= 0.10,
            "visits": {"baseline": Vb, "smelt": Vs}, "visit_s": {"baseline": visit[kb], "smelt": visit[ks]},
            "visit_time_over_flops": visit[ks] / visit[kb] / f_visit,
            # the step's time/F had SMELT's visits cost the Baseline's time per FLOP (the rest as measured)
            "time_over_flops_visits_at_baseline_cost": (s[0] - Vs * visit[ks] + Vs * visit[kb] * f_visit) / b[0] / fr}
        print(f"  {name:12s} {r['baseline_tok_s']:10.0f} {r['smelt_tok_s']:11.0f} {fr:7.3f} "
              f"{r['time_ratio']:6.3f} {time_over_flops:6.3f} {r['fwd_bwd_ratio']:7.3f} "
              f"{r['optimizer_ratio']:6.3f} {r['params_ratio']:6.3f} {r['time_ratio_moe_at_dense_cost']:9.3f} "
              f"{Vs:>2d} / {Vb:<2d} {r['visit_time_over_flops']:9.3f} "
              f"{r['time_over_flops_visits_at_baseline_cost']:11.3f}")
    ok = all(r["within_10_percent"] for r in res.values())
    print(f"  target: time ratio within 10 % of the F ratio in every cell -> {'met' if ok else 'NOT met'} "
          f"(params: total-parameter ratio, which the optimizer's time follows; MoE@dense: the time ratio with "
          f"every MoE visit at the cost of its equal-FLOP dense SwiGLU, measured beside; visits: block visits per "
          f"step, SMELT / Baseline; visit t/F: one block visit's fwd+bwd, SMELT's time per FLOP over the Baseline's; "
          f"visits@base: time/F had SMELT's visits the Baseline's time per FLOP)")
    return {"cells": res, "batch_size": batch_size, "block_size": T, "target_met": ok}


def decode_models(d_model=512, n_layer=8, n_head=8, d_ff=1536, vocab=4096):
    span = SMELT.at(n_layer)
    base = dict(vocab_size=vocab, block_size=512, n_layer=n_layer, d_model=d_model, n_head=n_head,
                n_kv_head=n_head // 4, d_ff=d_ff)
    return {"unlooped": ModelConfig(**base), "sequential_2loop": ModelConfig(**base, loop=span),
            "plt_2loop": ModelConfig(**base, loop=replace(span, parallel=True))}


def bench_decode(device, dtype, prompt=64, new_tokens=64, reps=7) -> dict:
    """Median over reps of the median per-token time of greedy decoding, the models taking turns token by token."""
    models = {}
    for name, cfg in decode_models().items():
        torch.manual_seed(0)
        models[name] = GPT(cfg).to(device, dtype).eval()
    idx = torch.randint(0, models["unlooped"].cfg.vocab_size, (1, prompt), device=device)

    def decoder(m):   # prefill (not timed), then one greedy token per call
        cache = m.new_cache(1, prompt + new_tokens)
        logits = m.forward_step(idx, cache)[:, -1]

        def next_token():
            nonlocal logits
            logits = m.forward_step(logits.argmax(-1, keepdim=True), cache)[:, -1]
        return next_token

    per_rep = []
    for _ in range(reps + 1):                                      # the first rep is the warm-up
        steps = {name: decoder(m) for name, m in models.items()}
        per_rep.append(interleaved(steps, device, warmup=0, iters=new_tokens))   # token by token, in turn
    r = {k: statistics.median(rep[k] for rep in per_rep[1:]) for k in per_rep[0]}
    depth = len(models["sequential_2loop"].plan) / models["unlooped"].cfg.n_layer
    res = r | {"plt_ratio": r["plt_2loop"] / r["unlooped"], "sequential_ratio": r["sequential_2loop"] / r["unlooped"]}
    print(f"\nBatch-1 decode, per token ({device.type}, {dtype}):")
    for name, v in r.items():
        print(f"    {name:18s} {v * 1e3:8.3f} ms   {v / r['unlooped']:5.2f}x unlooped")
    print(f"  executed-depth ratio of the sequential model: {depth:.2f}")
    print(f"  target: PLT <= 1.15x unlooped -> {'met' if res['plt_ratio'] <= 1.15 else 'NOT met'}")
    return res | {"executed_depth_ratio": depth}


def packed_doc_ids(batch_size: int, T: int, mean_len: int, seed: int = 0) -> torch.Tensor:
    """(B, T) document ids of rows packed with documents of geometric lengths (mean mean_len)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch_size, T, generator=g) < 1.0 / mean_len
    starts[:, 0] = True
    return starts.long().cumsum(1) - 1


def train_pair(preset: str, device, batch_size: int) -> tuple:
    """(scale, label, Baseline, SMELT, match report) the train benchmark runs: the preset's (upper) middle scale,
    S~85 %; refused (checks.TooLargeError) when either with batch_size rows cannot fit `device`."""
    cells = budget.preset_baselines(preset)
    scales = list(dict.fromkeys(sc for sc, _, _ in cells))
    scale, label, base_cfg = next(c for c in cells if c[0] == scales[len(scales) // 2] and c[1] == "S~85%")
    smelt_cfg, report = budget.match(base_cfg, SMELT.at(base_cfg.n_layer), base_cfg.block_size,
                                     **configs.LADDERS[preset].get("search", {}))
    for cfg in (base_cfg, smelt_cfg):   # both models and their batch, before either is built
        budget.refuse_oversized(cfg, device, batch_size, cfg.block_size, f"the {preset} train benchmark",
                                "--train-batch", train=True, model_hint="use a smaller --train-preset")
    return scale, label, base_cfg, smelt_cfg, report


def bench_train(device, preset="tiny", steps=10, batch_size=8, mean_doc=256, save=None) -> dict:
    """Training tokens/s of a matched Baseline / SMELT pair at the preset's (upper) middle scale, S~85 %, as
    train.py runs it (on CUDA compiled, on rows with document ids): each first step alone (compile_s: it minus
    the median step), then the two in turns. save(res), when given, gets the pair, then each first step."""
    scale, label, base_cfg, smelt_cfg, report = train_pair(preset, device, batch_size)
    ctx = base_cfg.block_size
    cuda = device.type == "cuda"
    doc = packed_doc_ids(batch_size, ctx, mean_doc).to(device) if cuda else None
    flops_ctx = min(data_mod.effective_doc_length(doc.cpu()), ctx) if cuda else ctx
    res = {"cell": f"{scale}/{label}", "match": report, "batch_size": batch_size, "block_size": ctx,
           "flops_ctx": flops_ctx}
    steps_of, save = {}, save or (lambda _res: None)
    save(res)
    cfgs = {"baseline": base_cfg, "smelt": smelt_cfg}
    tc = train.TrainConfig()
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        gpt = GPT(cfg).to(device)
        model, opt = train.Objective(gpt), train.make_optimizer(gpt, tc)
        idx = torch.randint(0, cfg.vocab_size, (batch_size, ctx), device=device)
        if cuda:            # as train.py runs it (the warm-up steps absorb compiling)
            model = torch.compile(model, dynamic=False)   # not compile_model: its reset would drop the other's

        def step(gpt=gpt, model=model, opt=opt, idx=idx):   # train.py's step: forward, backward, clip, AdamW
            train.forward_backward(model, gpt.cfg, idx, idx, doc, train.step_scale(idx),
                                   autocast=lambda: _autocast(device))
            train.update(gpt, opt, tc.grad_clip)
        steps_of[name] = step
        res[name] = {"first_step_s": timed(step, device)[0]}   # on CUDA: the compile
        save(res)
    med = interleaved(steps_of, device, iters=steps)
    peak = train.peak_flops(device)
    for name, cfg in cfgs.items():
        t = med[name]
        flops = budget.flops_per_token(cfg, flops_ctx, include_head=True)   # what the hardware runs (MFU)
        res[name] |= {"s_per_step": t, "compile_s": res[name]["first_step_s"] - t,
                      "tokens_per_s": batch_size * ctx / t, "flops_per_token": flops}
        if peak:
            res[name]["mfu"] = flops * batch_size * ctx / t / peak
    time_ratio = res["smelt"]["s_per_step"] / res["baseline"]["s_per_step"]
    flop_ratio = res["smelt"]["flops_per_token"] / res["baseline"]["flops_per_token"]
    ok = abs(time_ratio / flop_ratio - 1) <= 0.15
    res |= {"time_ratio": time_ratio, "flop_ratio": flop_ratio, "peak_flops": peak, "within_15_percent": ok}
    print(f"\nTraining throughput, {preset} preset cell {res['cell']} ({device.type}, batch {batch_size} x {ctx}):")
    for name in ("baseline", "smelt"):
        r = res[name]
        extra = f"  MFU {r['mfu']:.1%}" if "mfu" in r else ""
        print(f"  {name:9s} {r['tokens_per_s']:10.0f} tok/s  {r['flops_per_token']:.3e} FLOPs/token{extra}")
    print(f"  time ratio {time_ratio:.3f} vs FLOP ratio {flop_ratio:.3f} -> within 15 %: {'yes' if ok else 'NO'}")
    return res


def flex_vs_sdpa(device, B=4, H=8, Hkv=2, T=1024, hd=64, dtype=torch.bfloat16, mean_doc=200, seed=0,
                 time_it=True, iters=10) -> dict:
    """Flex attention vs SDPA on the boolean block-diagonal causal mask, fwd+bwd through attention.attend on the
    same packed document ids: the largest difference of out, dq, dk, dv (absolute, and relative to SDPA's
    largest), each backend's first call (flex's compiles) and, with time_it, the median time of each."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dy = (torch.randn(B, h, T, hd, generator=g).to(device, dtype) for h in (H, Hkv, Hkv, H))
    for t in (q, k, v):
        t.requires_grad_()
    doc = packed_doc_ids(B, T, mean_doc, seed).to(device)
    pos = torch.arange(T, device=device)
    masks = {"sdpa": {}, "flex": {}}   # each mask built once, as one forward shares it across layers

    def run(backend):
        for t in (q, k, v):
            t.grad = None
        out, _ = attention.attend(q, k, v, pos, pos, doc, doc, 0, backend, masks=masks[backend])
        (out * dy).sum().backward()
        return [out.detach().float()] + [t.grad.float() for t in (q, k, v)]

    # the first call compiles (flex kernel, block mask): timed apart
    first = {backend: timed(lambda: run(backend), device) for backend in ("sdpa", "flex")}
    res = {"shape": dict(B=B, H=H, Hkv=Hkv, T=T, head_dim=hd, documents=int((doc.max(1).values + 1).sum())),
           "dtype": str(dtype), "first_call_s": {b: t for b, (t, _) in first.items()}}
    for name, a, b in zip(("out", "dq", "dk", "dv"), first["sdpa"][1], first["flex"][1]):
        res[f"max_abs_diff_{name}"] = float((a - b).abs().max())
        res[f"rel_diff_{name}"] = float((a - b).abs().max() / a.abs().max().clamp(min=1e-30))
    if time_it:
        med = interleaved({"sdpa": lambda: run("sdpa"), "flex": lambda: run("flex")}, device, warmup=2, iters=iters)
        res |= {"sdpa_ms": med["sdpa"] * 1e3, "flex_ms": med["flex"] * 1e3, "flex_speedup": med["sdpa"] / med["flex"],
                "flex_compile_s": res["first_call_s"]["flex"] - med["flex"]}
    return res


def bench_flex(device, save=None) -> dict:
    """flex_vs_sdpa in bf16 (timed) and fp32; save(res), when given, is called after each dtype."""
    if device.type != "cuda":
        raise RuntimeError("the flex benchmark needs CUDA (CPU flex attention has no backward)")
    res = {}
    for dt, kw in (("bf16", {}), ("fp32", dict(dtype=torch.float32, time_it=False))):
        res[dt] = flex_vs_sdpa(device, **kw)
        if save:
            save(res)
    b = res["bf16"]
    print(f"\nFlex vs SDPA (document mask), B {b['shape']['B']} T {b['shape']['T']} hd {b['shape']['head_dim']}:")
    for dt, r in res.items():
        print(f"  {dt}: relative max diff out {r['rel_diff_out']:.2e}  dq {r['rel_diff_dq']:.2e}  "
              f"dk {r['rel_diff_dk']:.2e}  dv {r['rel_diff_dv']:.2e}")
    print(f"  fwd+bwd: sdpa {b['sdpa_ms']:.2f} ms, flex {b['flex_ms']:.2f} ms ({b['flex_speedup']:.2f}x); "
          f"flex compile {b['flex_compile_s']:.1f} s")
    return res


def step_configs() -> dict[str, ModelConfig]:
    """The four model kinds the compiled-step benchmark trains (head_dim 32: flex runs on CUDA), riskiest
    first: a time limit keeps what finished."""
    base = dict(vocab_size=4096, block_size=512, n_layer=4, d_model=256, n_head=8, n_kv_head=2, d_ff=512)
    moe = dict(base, d_ff=128, n_experts=32, top_k=4)
    span = LoopConfig(start=1, length=2, n_loops=2)
    return {"smelt": ModelConfig(**moe, loop=span), "moe": ModelConfig(**moe),
            "plt": ModelConfig(**base, loop=replace(span, parallel=True)), "dense": ModelConfig(**base)}


def count_syncs(fn, device) -> int | None:
    """Synchronising CUDA calls fn makes (torch.cuda sync debug mode "warn"); None off CUDA."""
    if device.type != "cuda":
        return None
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    return sum("synchroniz" in str(x.message).lower() for x in w)


def bench_steps(device, batch_size=8, steps=10, save=None, deadline=None) -> dict:
    """Compiled (fullgraph) training steps of dense, MoE, SMELT and PLT configs: compile time, graphs, syncs.
    save(res), when given, is called after each config, so a time limit keeps the finished ones. deadline
    (a time.monotonic() value): a config whose start leaves less than the slowest config's time is skipped."""
    from torch._dynamo.utils import counters
    print(f"\nCompiled training steps ({device.type}{', bf16 autocast' if device.type == 'cuda' else ''}):")
    res, T = {}, 512
    for name, cfg in step_configs().items():
        slowest = max((r.get("bench_s", 0) for r in res.values()), default=0)
        if deadline is not None and time.monotonic() + slowest > deadline:
            res[name] = {"skipped": f"the slowest config so far ({slowest:.0f} s) would pass the time limit"}
            continue
        t_cfg = time.perf_counter()
        torch.manual_seed(0)
        gpt = GPT(cfg).to(device)
        obj = train.Objective(gpt)
        idx = torch.randint(0, cfg.vocab_size, (batch_size, T), device=device)
        doc = packed_doc_ids(batch_size, T, 128).to(device)
        counters.clear()
        compiled = compile_model(obj, fullgraph=True)

        def step(fn=compiled):   # train.py's forward and backward, without the update
            return train.forward_backward(fn, cfg, idx, idx, doc, train.step_scale(idx),
                                          autocast=lambda: _autocast(device))[2]

        first_s, loss_c = timed(step, device)
        step()                                          # a recompile would show in the graph count
        graphs = int(counters["stats"]["unique_graphs"])   # training graphs only: before the eager step compiles
        gpt.zero_grad(set_to_none=True)                    # flex and the block mask on their own
        loss_e = step(obj)
        gpt.zero_grad(set_to_none=True)
        syncs = count_syncs(step, device)
        t = interleaved({name: step}, device, warmup=1, iters=steps)[name]
        r = {"compile_s": first_s - t, "first_step_s": first_s, "graphs": graphs, "step_ms": t * 1e3,
             "tokens_per_s": batch_size * T / t, "host_syncs_per_step": syncs,
             "loss_compiled": float(loss_c), "loss_eager": float(loss_e)}
        if cfg.n_experts:
            with _autocast(device):   # what eager code takes; compiled, "auto" is the same or "padded" on CPU
                r["moe_impl_eager"] = "/".join(gpt.blocks[0].mlp.kernels(idx[..., None].float()))
        res[name] = r | {"bench_s": time.perf_counter() - t_cfg}
        print(f"  {name:6s} compile {r['compile_s']:6.1f} s  graphs {r['graphs']}  step {t * 1e3:7.2f} ms  "
              f"syncs/step {syncs}  loss {r['loss_compiled']:.4f} (eager {r['loss_eager']:.4f})"
              + (f"  moe {r['moe_impl_eager']}" if "moe_impl_eager" in r else ""), flush=True)
        if save:
            save(res)
    return res


BENCHMARKS = ("flex", "steps", "moe", "decode", "train", "cells")
# (cap, floor) seconds per benchmark under --budget-s: estimates for one H200 from a cold start (why each:
# docs/gpu.md); a benchmark gets min(cap, what is left once the later ones' floors are set aside)
LIMITS = {"flex": (110, 40), "steps": (190, 60), "train": (130, 50), "decode": (40, 15), "moe": (60, 20),
          "cells": (300, 60)}


def build_parser() -> argparse.ArgumentParser:
    ap = checks.parser(__doc__)
    ap.add_argument("which", nargs="*", metavar="{" + ",".join(BENCHMARKS) + "}",
                    help="benchmarks to run (default: moe, decode, train on CPU; all of them on CUDA, in the order listed)")
    checks.add_device(ap)
    ap.add_argument("--train-preset", default=None, choices=list(configs.LADDERS),
                    help="preset for the train benchmark (default: tiny on CPU, small on CUDA)")
    ap.add_argument("--train-batch", type=checks.positive_int, default=None,
                    help="sequences per step in the train benchmark (default: 8 on CPU, 32 on CUDA)")
    checks.add_out_dir(ap, "merge the measured figures into DIR/bench.json, after each benchmark (default: print only)")
    ap.add_argument("--budget-s", type=checks.positive_float, default=None, metavar="S",
                    help="seconds for all the benchmarks: each runs under a limit from what is left "
                         "(bench.LIMITS; default: no limit)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    device = torch.device(checks.resolve_device(args.device))
    cuda = device.type == "cuda"
    which = args.which or ([*BENCHMARKS] if cuda else ["moe", "decode", "train"])
    if set(which) - set(BENCHMARKS):
        ap.error(f"unknown benchmark(s) {sorted(set(which) - set(BENCHMARKS))}: choose from {', '.join(BENCHMARKS)}")
    train_preset = args.train_preset or ("small" if cuda else "tiny")
    train_batch = args.train_batch or (32 if cuda else 8)
    if "train" in which:
        train_pair(train_preset, device, train_batch)   # a batch or preset this device cannot hold: one line, first
    json_path = os.path.join(args.out_dir, "bench.json") if args.out_dir else None
    info = {"machine": machine(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "capability": list(torch.cuda.get_device_capability(device)) if cuda else None}
    print(f"machine: {info['machine']}, torch {info['torch']}")
    if json_path:
        update_json(json_path, "machine", info)
    runs = {"flex": lambda save, deadline: bench_flex(device, save),
            "steps": lambda save, deadline: bench_steps(device, save=save, deadline=deadline),
            "moe": lambda save, deadline: bench_moe_shapes(device),
            "cells": lambda save, deadline: bench_cells(device),
            "decode": lambda save, deadline: bench_decode(device, torch.bfloat16 if cuda else torch.float32),
            "train": lambda save, deadline: bench_train(device, train_preset, batch_size=train_batch, save=save)}
    failed = run_benchmarks(runs, which, json_path, LIMITS, args.budget_s)
    if failed:
        print(f"bench: failed: {' '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(checks.run_main(main))
