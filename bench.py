"""Performance benchmarks (not tests): MoE kernels, decode latency, training throughput / MFU.

Each benchmark measures the things it compares side by side in one process and prints the
ratios, so a figure never depends on another machine's or another run's timing. Targets
(from the issues) are printed beside the measurement; nothing here asserts.

  moe     MoE layer forward+backward at d_model 256, d_ff 128, 64 experts, top-8, 4096 tokens,
          against a dense SwiGLU with the same active FLOPs (width top_k * d_ff = 1024), the
          slow split/cat reference, and (CUDA bf16) torch._grouped_mm. Target: MoE <= 1.5x dense.
  decode  batch-1 time per generated token: unlooped model, sequential 2-loop middle span,
          PLT 2-loop middle span of the same width. Target: PLT <= 1.15x unlooped; sequential
          near the executed-depth ratio (executed / physical layers). On CPU each model is
          also timed with model.Linear's few-row layout turned off (plain F.linear).
  train   training tokens/s of the tiny preset's matched Baseline / SMELT pair; time per token
          ratio vs FLOP ratio (target: within 15 %); the two models alternate steps. On CUDA also MFU
          at the small preset, compiled as train.py runs it, 32 sequences per step
          (targets dense >= 45 %, SMELT MoE >= 40 %).

Timing (`interleaved`): the things compared take turns (ABAB...), warm-up rounds first, then the
median of the timed rounds (torch.cuda.synchronize on GPU). Taking turns matters on a shared
CPU: timing A's ten steps and then B's let the machine's drift decide the ratio (the train pair
read 1.02-1.06 one after the other and 1.17-1.21 taking turns, in the same hour). Results also
go to --json for the README.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from loop import LoopConfig, middle_span
from model import GPT, ModelConfig
from moe import MoE


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


class DenseSwiGLU(nn.Module):
    def __init__(self, d_model: int, width: int):
        super().__init__()
        self.w_in = nn.Linear(d_model, 2 * width, bias=False)
        self.w_out = nn.Linear(width, d_model, bias=False)

    def forward(self, x):
        g, u = self.w_in(x).chunk(2, -1)
        return self.w_out(F.silu(g) * u)


def interleaved(fns: dict, device, warmup: int = 2, iters: int = 8) -> dict:
    """Median seconds per call of each fn, the fns taking turns (ABCABC...) so drift hits all alike."""
    times = {name: [] for name in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_moe(device, dtype, tokens=4096, d_model=256, d_ff=128, n_experts=64, top_k=8) -> dict:
    torch.manual_seed(0)
    x = torch.randn(1, tokens, d_model, device=device, dtype=dtype, requires_grad=True)
    dense = DenseSwiGLU(d_model, top_k * d_ff).to(device, dtype)

    def moe_layer(impl):
        return MoE(d_model, d_ff, n_experts, top_k, impl=impl).to(device, dtype)

    def step(mod, is_moe):
        def f():
            y = mod(x)[0] if is_moe else mod(x)
            y.float().square().mean().backward()
        return f

    fns = {"dense": step(dense, False)}
    impls = ["loop", "reference"] + (["torch"] if device.type == "cuda" and dtype == torch.bfloat16 else [])
    for impl in impls:
        fns[f"moe_{impl}"] = step(moe_layer(impl), True)
    res = interleaved(fns, device)
    print(f"\nMoE fwd+bwd, {tokens} tokens, d_model {d_model}, d_ff {d_ff}, {n_experts} experts, top-{top_k} "
          f"({device.type}, {dtype}):")
    for k, v in res.items():
        print(f"  {k:15s} {v * 1e3:8.2f} ms   {v / res['dense']:5.2f}x dense")
    print(f"  target: moe_loop <= 1.5x dense -> {'met' if res['moe_loop'] <= 1.5 * res['dense'] else 'NOT met'}")
    return {k: v for k, v in res.items()} | {"ratio_loop_vs_dense": res["moe_loop"] / res["dense"]}


def decode_models(d_model=512, n_layer=8, n_head=8, d_ff=1536, vocab=4096):
    s, m = middle_span(n_layer)
    base = dict(vocab_size=vocab, block_size=512, n_layer=n_layer, d_model=d_model, n_head=n_head,
                n_kv_head=n_head // 4, d_ff=d_ff)
    return {
        "unlooped": ModelConfig(**base),
        "sequential_2loop": ModelConfig(**base, loop=LoopConfig(start=s, length=m, n_loops=2)),
        "plt_2loop": ModelConfig(**base, loop=LoopConfig(start=s, length=m, n_loops=2, parallel=True)),
    }


def bench_decode(device, dtype, prompt=64, new_tokens=64, reps=7) -> dict:
    """Median per-token time of greedy decoding, under both CPU projection layouts (model.Linear).

    Models and layouts take turns token by token (each decodes one token, then the next model
    does), so the machine's drift hits all alike; the figure is, per model, the median over reps
    of the median time per token. "skinny" is the default (few-row products as W x^T on CPU);
    "F.linear" turns that rule off. On CUDA only the default is timed (the rule never applies).
    """
    import model as model_lib
    models = {}
    for name, cfg in decode_models().items():
        torch.manual_seed(0)
        models[name] = GPT(cfg).to(device, dtype).eval()
    idx = torch.randint(0, models["unlooped"].cfg.vocab_size, (1, prompt), device=device)
    layouts = {"skinny": model_lib.SKINNY_ROWS} | ({"F.linear": 0} if device.type == "cpu" else {})

    def one_token(lay, name, state):
        def f():
            model_lib.SKINNY_ROWS = layouts[lay]
            nxt = state["logits"].argmax(-1, keepdim=True)
            state["logits"] = models[name].forward_step(nxt, state["cache"])[:, -1]
        return f

    per_rep = []
    default = model_lib.SKINNY_ROWS
    try:
        for rep in range(reps + 1):                                # rep 0 is the warm-up
            steps = {}
            for lay in layouts:
                for name, m in models.items():
                    model_lib.SKINNY_ROWS = layouts[lay]
                    state = {"cache": m.new_cache(1, prompt + new_tokens)}
                    state["logits"] = m.forward_step(idx, state["cache"])[:, -1]     # prefill: not timed
                    steps[(lay, name)] = one_token(lay, name, state)
            med = interleaved(steps, device, warmup=0, iters=new_tokens)          # token by token, in turn
            if rep:
                per_rep.append(med)
    finally:
        model_lib.SKINNY_ROWS = default
    med = {k: statistics.median(r[k] for r in per_rep) for k in per_rep[0]}
    depth = len(models["sequential_2loop"].plan) / models["unlooped"].cfg.n_layer
    res = {}
    print(f"\nBatch-1 decode, per token ({device.type}, {dtype}):")
    for lay in layouts:
        base = med[(lay, "unlooped")]
        print(f"  projections: {lay}")
        for name in models:
            v = med[(lay, name)]
            print(f"    {name:18s} {v * 1e3:8.3f} ms   {v / base:5.2f}x unlooped")
        res[lay] = {name: med[(lay, name)] for name in models} | {
            "plt_ratio": med[(lay, "plt_2loop")] / base, "sequential_ratio": med[(lay, "sequential_2loop")] / base}
    print(f"  executed-depth ratio of the sequential model: {depth:.2f}")
    ok = res["skinny"]["plt_ratio"] <= 1.15
    print(f"  target: PLT <= 1.15x unlooped (default layout) -> {'met' if ok else 'NOT met'}")
    return res | {"executed_depth_ratio": depth}


def bench_train(device, preset="tiny", steps=10, batch_size=8) -> dict:
    """Training tokens/s of a matched Baseline / SMELT pair (the preset's middle scale, highest sparsity).

    The two models take alternate steps (ABAB...) after two warm-up steps each, so drift in the
    machine's speed hits both alike; the figure is the median step time of each.
    """
    import budget
    cells = budget.preset_baselines(preset)
    scale, label, base_cfg = cells[len(cells) // 2]
    s, m = middle_span(base_cfg.n_layer)
    ctx = base_cfg.block_size
    smelt_cfg, report = budget.match(base_cfg, LoopConfig(start=s, length=m, n_loops=2), ctx)
    res = {"cell": f"{scale}/{label}", "match": report}
    use_bf16 = device.type == "cuda"
    cfgs = {"baseline": base_cfg, "smelt": smelt_cfg}
    steps_of = {}
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        idx = torch.randint(0, cfg.vocab_size, (batch_size, ctx), device=device)
        if device.type == "cuda":            # as train.py runs it (the warm-up steps absorb compiling)
            model = torch.compile(model)

        def step(model=model, opt=opt, idx=idx):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                loss = model(idx, idx)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps_of[name] = step
    med = interleaved(steps_of, device, iters=steps)
    for name, cfg in cfgs.items():
        t = med[name]
        flops = budget.flops_per_token(cfg, ctx)
        res[name] = {"s_per_step": t, "tokens_per_s": batch_size * ctx / t, "flops_per_token": flops}
        if device.type == "cuda":
            from train import peak_flops
            peak = peak_flops(device)
            if peak:
                res[name]["mfu"] = flops * batch_size * ctx / t / peak
    time_ratio = res["smelt"]["s_per_step"] / res["baseline"]["s_per_step"]
    flop_ratio = res["smelt"]["flops_per_token"] / res["baseline"]["flops_per_token"]
    res |= {"time_ratio": time_ratio, "flop_ratio": flop_ratio}
    print(f"\nTraining throughput, {preset} preset cell {res['cell']} ({device.type}):")
    for name in ("baseline", "smelt"):
        r = res[name]
        extra = f"  MFU {r['mfu']:.1%}" if "mfu" in r else ""
        print(f"  {name:9s} {r['tokens_per_s']:10.0f} tok/s  {r['flops_per_token']:.3e} FLOPs/token{extra}")
    ok = abs(time_ratio / flop_ratio - 1) <= 0.15
    print(f"  time ratio {time_ratio:.3f} vs FLOP ratio {flop_ratio:.3f} -> within 15 %: {'yes' if ok else 'NO'}")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", metavar="{moe,decode,train}",
                    help="benchmarks to run (default: all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    ap.add_argument("--train-preset", default=None, help="preset for the train benchmark (default: tiny on CPU, small on CUDA)")
    ap.add_argument("--train-batch", type=int, default=None,
                    help="sequences per step in the train benchmark (default: 8 on CPU, 32 on CUDA)")
    ap.add_argument("--json", default=None, help="write the measured figures to this JSON file")
    args = ap.parse_args()
    which = args.which or ["moe", "decode", "train"]
    if set(which) - {"moe", "decode", "train"}:
        ap.error(f"unknown benchmark(s) {sorted(set(which) - {'moe', 'decode', 'train'})}: choose from moe, decode, train")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {"machine": machine(), "torch": torch.__version__}
    print(f"machine: {out['machine']}, torch {out['torch']}")
    if "moe" in which:
        out["moe"] = bench_moe(device, dtype)
    if "decode" in which:
        out["decode"] = bench_decode(device, dtype)
    if "train" in which:
        cuda = device.type == "cuda"
        out["train"] = bench_train(device, args.train_preset or ("small" if cuda else "tiny"),
                                   batch_size=args.train_batch or (32 if cuda else 8))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)


if __name__ == "__main__":
    main()
