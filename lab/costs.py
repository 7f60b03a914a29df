"""The main job's cost model on one GPU (FLOPs, compiles, forward calls, host reads, wall time per stage)
and the disk a run keeps.

`stage_costs` counts train (optimizer steps), validation (checkpoint.logged's plus one per branch end), eval
(few-shot scoring on CUDA, planned by tasks.scoring_batches: no model runs) and probes (plan.probe_tokens per
matched pair); a forward is a third of a training step (budget's 6N). Wall time = FLOPs / (peak x MFU) + compiles
x compile s / jobs + eager calls x launch overhead + host reads x sync cost, at both ends of ASSUMED: estimates,
never run on a GPU. `disk_estimate` replays checkpoint.py's save / prune rules (sizes: docs/checkpoint.md).
Read next: reproduce.py (which prints it), docs/gpu.md.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch

import budget
import checks
import configs
from checkpoint import logged, needed_checkpoints, save_kind
from model import GPT, ModelConfig
from train import TrainConfig, train_config

# (best, worst) of each assumption; the wall time's low end takes every best, its high end every worst
ASSUMED = {"mfu": (0.15, 0.05),               # narrow models (d 96-192): launch- and memory-bound
           "compile_s": (30.0, 90.0),         # a training graph: dynamo + AOT + inductor per run, cold cache
           "flex_compile_s": (3.0, 20.0),     # eager flex kernel + block mask per run's validation (low: cached)
           "eager_call_s": (2e-3, 10e-3),     # one uncompiled forward of a looped MoE model (launch-bound)
           "host_read_s": (2e-5, 2e-4)}       # one device-to-host scalar read (a sync; pipeline drained)
# `jobs` runs on one GPU divide only the compiles (host CPU); their kernels take turns on the device (no MPS)
GPU_HOST = {"cpus": 16, "gpu_bytes": 139 << 30}   # the lent H200 machine: --plan-only's jobs off a GPU
PEAK_FLOPS = budget.PEAK_BF16_FLOPS["H200"]
VAL_READS_PER_BATCH = 4        # validation.val_loss_report (train.evaluate): float, int, two bincount .cpu()
TRAIN_READS_PER_STEP = 1       # train.Trainer's step: stats and grad norm read once, before opt.step
PROBE_BATCH = 8                # probe_pairs.probe_pairs' batch_size default


def run_cost(cfg: ModelConfig, ctx_len: float, tokens: float) -> dict:
    """F (no head) and F x D, both also with the head, tpp (D / (F/6), SMELT 4.3), tokens per non-embedding
    parameter and GPU minutes at ASSUMED's MFU (best, worst) of training cfg on `tokens` tokens."""
    if not tokens > 0 or not math.isfinite(tokens):
        raise ValueError(f"run_cost: tokens must be a finite number > 0, got {tokens!r}")
    F, Fh = budget.flops_per_token(cfg, ctx_len), budget.flops_per_token(cfg, ctx_len, include_head=True)
    return {"tokens": float(tokens), "F": F, "F_with_head": Fh, "flops": F * tokens, "flops_with_head": Fh * tokens,
            "tpp": tokens / (F / 6), "tokens_per_param": tokens / budget.count_params(cfg)["blocks"],
            "gpu_minutes": [Fh * tokens / (PEAK_FLOPS * m) / 60 for m in ASSUMED["mfu"]]}


def scoring_counts(plan: configs.Plan, vocab_size: int, enc) -> dict:
    """Forward calls, rows, padded tokens, logit positions and host reads of one endpoint's few-shot scoring."""
    from lab import tasks as tasks_mod
    n = Counter()
    for name in tasks_mod.resolve_tasks(plan.tasks):
        task = tasks_mod.get_task(name)
        for k in (k for k in plan.shots if k <= tasks_mod.demos_available(task)):
            req = tasks_mod.task_requests(enc, task, k, plan.seeds, plan.max_items, plan.block_size, enc.eot_token)
            seqs, ns, batches = tasks_mod.scoring_batches(tasks_mod.continuations(req), plan.block_size, vocab_size,
                                                          True, tasks_mod.BATCH_TOKENS["cuda"], tasks_mod.MAX_LOGITS)
            for b in batches:
                T, M = tasks_mod.batch_shape(seqs, ns, b)
                n.update(calls=1, rows=len(b), tokens=len(b) * T, positions=len(b) * M, host_reads=1)
    return {k: n[k] for k in ("calls", "rows", "tokens", "positions", "host_reads")}


def val_counts(data, batch_size: int, block_size: int, max_tokens: int) -> dict:
    """Forward calls and target tokens of one validation pass (data.val_batches over every source)."""
    calls = tokens = 0
    for src in data.sources:
        for idx, *_ in data.val_batches(src, batch_size, block_size, max_tokens):
            calls, tokens = calls + 1, tokens + idx.numel()
    return {"calls": calls, "tokens": tokens}


def run_steps(plan: configs.Plan) -> tuple[int, int]:
    """(optimizer steps, validations) of one run: the stable phase, every decay branch, checkpoint.logged."""
    tc = train_config(plan)
    segments = [(0, tc.stable_steps)] + [(b, b + tc.decay_steps) for b in tc.branches]
    steps = sum(end - start for start, end in segments)
    vals = sum(logged(tc, done, end)[1] for start, end in segments for done in range(start + 1, end + 1))
    return steps, vals + len(tc.branches)


def _stage(flops, compiles, calls, reads, eager_calls, compile_key="flex_compile_s", overlap: int = 1) -> dict:
    """One stage's counts and wall seconds (best, worst), compiling `overlap` at a time."""
    ends = [{k: v[i] for k, v in ASSUMED.items()} for i in (0, 1)]
    serial = [compiles * a[compile_key] for a in ends]
    secs = [flops / (PEAK_FLOPS * a["mfu"]) + c / overlap + eager_calls * a["eager_call_s"]
            + reads * a["host_read_s"] for a, c in zip(ends, serial)]
    return {"flops": flops, "compiles": compiles, "forward_calls": calls, "host_reads": reads,
            "eager_calls": eager_calls, "seconds": secs, "compile_seconds": serial, "overlap": overlap}


def stage_costs(plan: configs.Plan, ladder: list[dict], data, cost: dict, jobs: int = 1) -> dict:
    """The plan's cost model; cost: reproduce.plan_cost(plan, ladder, ...); jobs: runs sharing the GPU."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"stage_costs: jobs must be an int >= 1, got {jobs!r}")
    runs = configs.plan_runs(Path("."), ladder, plan)
    if len(runs) != len(cost["runs"]):
        raise ValueError(f"stage_costs: plan_cost has {len(cost['runs'])} runs, the plan {len(runs)}")
    n, cfgs = len(runs), [(ModelConfig.from_dict(r.cell[r.arch]), r.cell["ctx_len"]) for r in runs]
    fwd = [budget.flops_per_token(c, x, include_head=False) / 3 for c, x in cfgs]     # forward, no head
    head = [budget.flops_per_token(c, x, include_head=True) / 3 - f for (c, x), f in zip(cfgs, fwd)]
    steps, vals = run_steps(plan)
    n_branches, overlap = len(train_config(plan).branches), min(jobs, n)
    train = _stage(cost["total_flops"], n, steps * n, TRAIN_READS_PER_STEP * steps * n, 0, "compile_s", overlap)
    v = val_counts(data, plan.batch_size, plan.block_size, plan.eval_tokens)
    vc = vals * v["calls"] * n
    validation = _stage(sum(vals * v["tokens"] * (f + h) for f, h in zip(fwd, head)), n, vc,
                        VAL_READS_PER_BATCH * vc, vc, overlap=overlap)
    sc = scoring_counts(plan, data.vocab_size, data.tokenizer())
    eval_flops = n_branches * sum(sc["tokens"] * f + sc["positions"] * h for f, h in zip(fwd, head))
    n_ep = n_branches * n
    evals = _stage(eval_flops, 0, sc["calls"] * n_ep, sc["host_reads"] * n_ep, sc["calls"] * n_ep)
    contexts = max(1, plan.probe_tokens // plan.block_size)
    probe_calls = math.ceil(contexts / PROBE_BATCH) * n
    probes = _stage(sum(contexts * plan.block_size * (f + h) for f, h in zip(fwd, head)), 0, probe_calls, 0,
                    probe_calls)
    stages = {"train": train, "validation": validation, "eval": evals, "probes": probes}
    S = list(stages.values())
    total = {k: sum(s[k] for s in S) for k in ("flops", "compiles", "forward_calls", "host_reads", "eager_calls")}
    total.update({k: [sum(s[k][i] for s in S) for i in (0, 1)] for k in ("seconds", "compile_seconds")})
    total["seconds_one_job"] = [sum(s["seconds"][i] + s["compile_seconds"][i] * (1 - 1 / s["overlap"]) for s in S)
                                for i in (0, 1)]
    return {"stages": stages, "total": total, "assumptions": ASSUMED, "peak_flops": PEAK_FLOPS,
            "scoring_per_endpoint": sc, "endpoints": n_ep, "runs": n, "jobs": jobs}


def format_costs(c: dict) -> str:
    a = c["assumptions"]
    lines = [f"cost model on one GPU ({c['runs']} runs, {c['endpoints']} endpoints, {c['jobs']} at a time; "
             f"estimates at MFU {a['mfu'][1]:.0%}-{a['mfu'][0]:.0%} of {c['peak_flops'] / 1e12:.0f} TFLOP/s, "
             f"{a['compile_s'][0]:.0f}-{a['compile_s'][1]:.0f} s per training compile, "
             f"{a['flex_compile_s'][0]:.0f}-{a['flex_compile_s'][1]:.0f} s per eager flex compile, "
             f"{a['eager_call_s'][0] * 1e3:.0f}-{a['eager_call_s'][1] * 1e3:.0f} ms per eager call):",
             f"  {'stage':10s} {'FLOPs':>9s} {'compiles':>8s} {'fwd calls':>10s} {'host reads':>10s} {'minutes':>12s}"]
    for name, s in [*c["stages"].items(), ("total", c["total"])]:
        lo, hi = (x / 60 for x in s["seconds"])
        lines.append(f"  {name:10s} {s['flops']:9.3g} {s['compiles']:8d} {s['forward_calls']:10d} "
                     f"{s['host_reads']:10d} {lo:5.1f} - {hi:5.1f}")
    if c["jobs"] > 1:
        lo, hi = (x / 60 for x in c["total"]["seconds_one_job"])
        lines.append(f"  {'(1 job)':10s} {'':9s} {'':8s} {'':10s} {'':10s} {lo:5.1f} - {hi:5.1f}   "
                     f"(the same plan one run at a time: compiles in series)")
    sc = c["scoring_per_endpoint"]
    lines.append(f"  few-shot scoring per endpoint: {sc['rows']} sequences ({sc['tokens'] / 1e6:.1f}M tokens) in "
                 f"{sc['calls']} forward calls, {sc['host_reads']} host reads")
    return "\n".join(lines)


def report(plan: configs.Plan, ladder: list[dict], data, cost: dict, log=print, jobs: int = 1) -> dict:
    """stage_costs at `jobs`, printed with format_costs through log (reproduce.py --plan-only); returns the costs."""
    c = stage_costs(plan, ladder, data, cost, jobs)
    log(format_costs(c))
    return c


# ---------------------------------------------------------------------------------------- disk: what a run writes
# A torch file's bytes beyond its tensors' data (zip headers, alignment, pickle; docs/checkpoint.md)
_FILE_BYTES = 1261 + checks._TRAILER_LEN
_TENSOR_BYTES = 280
_RNG_BYTES = 5056 + 625 * 8 * 2 + 3 * _TENSOR_BYTES   # torch, numpy and python generator states
_METRICS_ROW_BYTES = 420   # one metrics.jsonl row with its hash


def disk_estimate(model_cfg: ModelConfig, tc: TrainConfig) -> dict:
    """Bytes one train() run keeps ("peak", "final"), "written" (deleted files too) and the per-file sizes."""
    tc = type(tc).from_dict({**asdict(tc), "block_size": tc.block_size or model_cfg.block_size})
    with torch.device("meta"):   # the endpoint: fp32 weights and JSON meta; a full checkpoint adds AdamW and RNG
        params = list(GPT(model_cfg).named_parameters())
    meta = len(json.dumps({"format": 2, "kind": "endpoint", "model": model_cfg.to_dict(), "train": asdict(tc),
                           "step": 0, "branch": 0, "tokens": 0, "wall_s": 0.0, "run": {}})) + 100
    endpoint = _FILE_BYTES + sum(p.numel() * 4 + _TENSOR_BYTES for _, p in params) + meta
    adam = sum(2 * (p.numel() * 4 + _TENSOR_BYTES) + 4 + _TENSOR_BYTES + 2 * (len(n) + 12) for n, p in params)
    full = endpoint + adam + _RNG_BYTES + 600
    row = len(json.dumps({"config": model_cfg.to_dict(), "train": asdict(tc)})) + len(json.dumps(
        budget.dense_control(model_cfg).to_dict())) + 1500   # results row: configs, losses by source, hash
    logs = 2 * len(json.dumps({"model": model_cfg.to_dict(), "train": asdict(tc)}, indent=2))  # config.json
    ckpts: set = set()                                   # the full checkpoints on disk
    state = {"peak": 0, "written": logs, "kept": logs}   # kept: endpoints + logs

    def write(n: int, key=None) -> None:
        state["written"] += n
        if key is None:
            state["kept"] += n
        else:
            ckpts.add(key)
        state["peak"] = max(state["peak"], state["kept"] + full * len(ckpts))

    pending = list(tc.branches)
    for s, b in zip([0, *tc.branches], tc.branches):   # s: where the stable segment before branch b starts
        for branch, start, end in ((None, s, b), (b, b, b + tc.decay_steps)):
            for done in range(start + 1, end + 1):
                if any(logged(tc, done, end)):
                    write(_METRICS_ROW_BYTES)
                kind = save_kind(tc, branch, done, end)
                if kind == "endpoint":
                    write(endpoint)
                elif kind == "full":
                    write(full, (branch, done))
                    ckpts &= needed_checkpoints(ckpts, pending)
        write(row)
        pending.remove(b)
        ckpts &= needed_checkpoints(ckpts, pending)
    write(endpoint)   # ckpt.pt
    return {"peak": state["peak"], "final": state["kept"] + full * len(ckpts), "written": state["written"],
            "full_checkpoint": full, "endpoint": endpoint}


def plan_disk_estimate(model_cfgs: list[ModelConfig], tc: TrainConfig, jobs: int = 1) -> dict:
    """disk_estimate of runs trained `jobs` at a time; "peak" adds the `jobs` largest surpluses (an upper bound)."""
    ests = [disk_estimate(c, tc) for c in model_cfgs]
    final = sum(e["final"] for e in ests)
    surplus = sorted(max(0, e["peak"] - e["final"]) for e in ests)[::-1][:max(1, jobs)]
    return {"final": final, "peak": final + sum(surplus), "written": sum(e["written"] for e in ests),
            "runs": len(ests)}
