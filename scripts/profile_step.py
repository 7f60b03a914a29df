"""Where one training step's time goes: torch.profiler over one ladder cell's step, as train.py runs it
(forward, backward, clipping, AdamW at the preset's batch and context, one thread, the prepared data).

  python scripts/profile_step.py                                  # tiny, t96 S~85 % SMELT
  python scripts/profile_step.py --scale t64 --sparsity-label "S=0%" --arch baseline --top 30
  python scripts/profile_step.py --dtype bf16                     # under bf16 autocast (train.py --dtype bf16)

Prints the median step time, aten calls per step and the top operators by self time. Needs the preset's
data (`python -m lab.corpus --preset P`). Read with bench.py's `cells`; what it showed: docs/bench.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import common  # noqa: F401,I001  (puts the repo root on sys.path)

from lab import bench_harness
import budget
import checks
import configs
import data as data_mod
import train
from model import GPT, ModelConfig


def build_parser() -> argparse.ArgumentParser:
    ap = checks.parser(__doc__)
    ap.add_argument("--preset", default="tiny", choices=configs.SCRIPT_PRESETS, help="ladder, batch and data")
    ap.add_argument("--scale", help="ladder scale, e.g. t64 (default: the ladder's largest)")
    ap.add_argument("--sparsity-label", help="the cell's sparsity label, e.g. 'S=0%%' (default: the ladder's last)")
    ap.add_argument("--arch", default="smelt", choices=("baseline", "smelt"), help="which model of the pair")
    ap.add_argument("--steps", type=checks.positive_int, default=10, help="profiled steps (after 18 timed ones)")
    ap.add_argument("--top", type=checks.positive_int, default=20, help="operators listed")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                    help="fp32 (the CPU default) or bf16 autocast, as train.py's --dtype")
    checks.add_out_dir(ap, "also write DIR/profile.json (default: print only)")
    return ap


def main(argv=None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    plan = configs.PLANS[args.preset]
    d = data_mod.TokenData(data_mod.default_data_dir(plan.data))
    ladder = budget.ladder_cells(plan.ladder, budget.preset_doc_length(plan.ladder, d), vocab_size=d.vocab_size,
                                 arms=plan.arms)
    cell = (args.scale or ladder[-1]["scale"], args.sparsity_label or ladder[-1]["sparsity_label"])
    cells = {(c["scale"], c["sparsity_label"]): c for c in ladder}
    if cell not in cells:
        ap.error(f"no {args.preset} cell {cell[0]} {cell[1]}; the ladder has {sorted(cells)}")
    cfg = ModelConfig.from_dict(cells[cell][args.arch])
    tc = train.TrainConfig(device="cpu", dtype=args.dtype)
    _, autocast = train.select_device(tc, train.Dist())
    B, T = plan.batch_size, plan.block_size
    budget.refuse_oversized(cfg, "cpu", B, T, f"a {args.preset} training step", train=True,
                            model_hint="profile a smaller --scale", rows_hint="profile a smaller --preset")
    torch.manual_seed(0)
    gpt = GPT(cfg)
    obj, opt = train.Objective(gpt), train.make_optimizer(gpt, tc)

    def step(i):   # train.py's step: forward, backward, clip, AdamW
        idx, tgt, doc = d.train_batch(i, B, T, seed=0)
        train.forward_backward(obj, cfg, idx, tgt, doc, train.step_scale(tgt), autocast=autocast)
        train.update(gpt, opt, tc.grad_clip)

    with bench_harness.threads(1):   # as reproduce.py's CPU workers
        times = [bench_harness.timed(lambda: step(i), torch.device("cpu"))[0] for i in range(18)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(args.steps):
                step(i)
    med = statistics.median(times[3:])   # three warm-up steps left out
    ka = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ka)
    calls = sum(e.count for e in ka if e.key.startswith("aten::")) / args.steps
    print(f"{args.preset} {cell[0]} {cell[1]} {args.arch} {args.dtype}: d_model {cfg.d_model}, {cfg.n_layer} layers, "
          f"{len(gpt.plan)} visits, {cfg.n_experts} experts; median step {1e3 * med:.1f} ms "
          f"({B * T / med:.0f} tok/s, 1 thread); {calls:.0f} aten calls per step")
    print(f"  {'operator':60s} {'ms/step':>8s} {'share':>6s} {'calls/step':>10s}")
    top = []
    for e in ka[:args.top]:
        ms, share = e.self_cpu_time_total / 1e3 / args.steps, e.self_cpu_time_total / total
        top.append({"op": e.key, "ms_per_step": ms, "share": share, "calls_per_step": e.count / args.steps})
        print(f"  {e.key[:60]:60s} {ms:8.2f} {100 * share:5.1f}% {e.count / args.steps:10.0f}")
    res = {"preset": args.preset, "cell": list(cell), "arch": args.arch, "dtype": args.dtype, "step_s": med,
           "aten_calls_per_step": calls, "top": top}
    if args.out_dir:
        checks.atomic_write_bytes(Path(args.out_dir) / "profile.json", json.dumps(res, indent=1).encode())
    return res


if __name__ == "__main__":
    checks.run_main(main)
