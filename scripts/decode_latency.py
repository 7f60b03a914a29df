"""Batch-1 decode latency: unlooped vs sequential 2-loop vs PLT 2-loop, and KV-cache bytes per token.

  python scripts/decode_latency.py --preset smoke|tiny|small [--prompt P] [--new-tokens N] [--device D]

Timing is bench.bench_decode (its fixed models, bench.decode_models: d_model 512, 8 layers, a
2-loop middle span; median of 7 timed decodes after a warm-up, fp32 on CPU, bf16 on CUDA; the
table uses the default projection layout, and on CPU the ratios with plain F.linear are kept too).
The preset sets the prompt and the number of decoded tokens (smoke 8 + 8: seconds; tiny 64 + 64;
small 128 + 256); --prompt and --new-tokens override them (this script trains nothing). KV bytes per
token (bf16) are budget.kv_bytes_per_token of the same configs at the decode length, plus PLT
with KV sharing (a window of a quarter of the context), which bench.py does not time.
Writes results.json and a table.
"""
from __future__ import annotations

from dataclasses import replace

import torch

import common  # noqa: I001  (puts the repo root on sys.path)

from lab import bench
from lab import bench_harness
import budget
import checks

LENGTHS = {"smoke": (8, 8), "tiny": (64, 64), "small": (128, 256)}   # (prompt, decoded tokens)


def build_parser():
    ap = common.parser(__doc__, training=False)
    ap.add_argument("--prompt", type=checks.positive_int, default=None,
                    help="prompt tokens (default: smoke 8, tiny 64, small 128)")
    ap.add_argument("--new-tokens", type=checks.positive_int, default=None,
                    help="decoded tokens (default: smoke 8, tiny 64, small 256)")
    checks.add_device(ap)
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("decode_latency", args)
    prompt, new = LENGTHS[args.preset]
    prompt, new = args.prompt or prompt, args.new_tokens or new
    device = torch.device(checks.resolve_device(args.device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfgs = bench.decode_models()
    ctx = prompt + new
    if ctx > cfgs["unlooped"].block_size:
        raise checks.UserError(f"prompt + tokens = {ctx} exceeds the bench models' block_size {cfgs['unlooped'].block_size}")
    timed = bench.bench_decode(device, dtype, prompt=prompt, new_tokens=new)
    timing = timed["skinny"]
    plt = cfgs["plt_2loop"]
    cfgs["plt_2loop_kv_shared"] = replace(plt, loop=replace(plt.loop, kv_window=max(1, ctx // 4)))
    base_kv = budget.kv_bytes_per_token(cfgs["unlooped"], 2, ctx)
    rows = []
    for name, cfg in cfgs.items():
        kv = budget.kv_bytes_per_token(cfg, 2, ctx)
        t = timing.get(name)
        rows.append({"model": name, "ms_per_token": 1e3 * t if t is not None else None,
                     "vs_unlooped": t / timing["unlooped"] if t is not None else None,
                     "kv_bytes_per_token": kv, "kv_ratio": kv / base_kv, "kv_mib_at_ctx": kv * ctx / 2 ** 20,
                     "flops_per_token": budget.flops_per_token(cfg, ctx), "params": budget.count_params(cfg)["blocks"]})
    return exp.finish({"device": bench_harness.machine(), "dtype": str(dtype), "prompt": prompt, "new_tokens": new,
                       "plt_ratio": timing["plt_ratio"], "sequential_ratio": timing["sequential_ratio"],
                       "executed_depth_ratio": timed["executed_depth_ratio"], "rows": rows,
                       "f_linear": timed.get("F.linear")}, [
        ("model", "model", ""), ("ms / token", "ms_per_token", ".3f"), ("x unlooped", "vs_unlooped", ".2f"),
        ("KV B/token", "kv_bytes_per_token", ",.0f"), ("KV ratio", "kv_ratio", ".2f"),
        ("KV MiB @ctx", "kv_mib_at_ctx", ".3f"), ("train FLOPs/token", "flops_per_token", ".3g")], trained=False)


if __name__ == "__main__":
    checks.run_main(main)
