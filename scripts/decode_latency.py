"""Batch-1 decode latency: unlooped vs sequential 2-loop vs PLT 2-loop, and KV-cache bytes per token.

  python scripts/decode_latency.py --preset smoke|tiny|small [--prompt P] [--new-tokens N] [--device D]

Times bench.bench_decode's fixed models (bench.decode_models); KV bytes per token (bf16) are
budget.kv_bytes_per_token at the decode length, plus PLT with KV sharing (untimed). Trains nothing;
writes results.json and a table. In full: docs/scripts.md, "Measurement scripts".
"""
from __future__ import annotations

from dataclasses import replace

import torch

import common  # noqa: I001  (puts the repo root on sys.path)

from lab import bench, bench_harness
import budget
import checks

LENGTHS = {"smoke": (8, 8), "tiny": (64, 64), "small": (128, 256)}   # (prompt, decoded tokens)


def build_parser():
    ap = common.parser(__doc__, training=False)
    ap.add_argument("--prompt", type=checks.positive_int, help="prompt tokens (default: smoke 8, tiny 64, small 128)")
    ap.add_argument("--new-tokens", type=checks.positive_int,
                    help="decoded tokens (default: smoke 8, tiny 64, small 256)")
    checks.add_device(ap)
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("decode_latency", args)
    prompt, new = args.prompt or LENGTHS[args.preset][0], args.new_tokens or LENGTHS[args.preset][1]
    device = torch.device(checks.resolve_device(args.device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfgs, ctx = bench.decode_models(), prompt + new
    if ctx > cfgs["unlooped"].block_size:
        raise checks.UserError(f"prompt + tokens = {ctx} exceeds the bench models' block_size {cfgs['unlooped'].block_size}")
    timed = bench.bench_decode(device, dtype, prompt=prompt, new_tokens=new)
    timing, plt = timed, cfgs["plt_2loop"]
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
                       "executed_depth_ratio": timed["executed_depth_ratio"], "rows": rows}, [
        ("model", "model", ""), ("ms / token", "ms_per_token", ".3f"), ("x unlooped", "vs_unlooped", ".2f"),
        ("KV B/token", "kv_bytes_per_token", ",.0f"), ("KV ratio", "kv_ratio", ".2f"),
        ("KV MiB @ctx", "kv_mib_at_ctx", ".3f"), ("train FLOPs/token", "flops_per_token", ".3g")], trained=False)


if __name__ == "__main__":
    checks.run_main(main)
