"""The main job: the reduced-scale SMELT reproduction, end to end, with a report.

  python reproduce.py [--preset smoke|tiny|small|medium|paper] [--out-dir DIR] [--loops R] [--placement last] ...

Stages (each reads the JSON the previous one wrote; finished work is skipped on re-run):
  1. data      the offline multi-domain corpus (lab/corpus.py, or a pack: --data-dir).
  2. ladder    budget.ladder_cells: each of the plan's looped arms (SMELT by default) matched to its Baseline (SMELT 3.2).
  3. train     train.train for every run of configs.plan_runs: WSD with decay branches (SMELT 3.1).
  4. eval      lab/evaluate.py on every branch endpoint, then lab/downstream_claims.py (SMELT 5, App. C, Eq. 6-7).
  5. scaling   lab/scaling_analysis.py: surfaces per architecture, CE gain and TPP (SMELT 4, 5.2).
  6. probes    lab/probe_pairs.py on every matched pair (SMELT 6).
  7. report    lab/report.py: REPORT.md, each claim reproduced / contradicted / not resolved; the curves.
Stages 4-7 compare each looped arm with the Baseline by name, the plan's first arm in OUT, any other in OUT/arms/NAME.
Also here: the worker pool (`--jobs`), the plan's cost and disk check. Why the scheduling and run-folder
rules: docs/reproduce.md. Read first: configs.py (the presets), budget.py, train.py.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

import budget
import checks
import configs
import data as data_mod
import eval as ev
import train
from lab import costs, train_plots
from lab import report as reporting
from loop import add_loop_args, executed_visits, loop_spec
from model import ModelConfig


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(path: Path, obj) -> None:
    """A script's own output (no hash; never read back by the pipeline, whose files use checks.write_json)."""
    checks.atomic_write_text(path, json.dumps(obj, indent=2, default=float))


def read_ladder(out: str | Path) -> list[dict]:
    """The cells of OUT/ladder.json (hash checked; JSONFileError naming the file when damaged)."""
    return checks.read_hashed_json(Path(out) / "ladder.json", ("cells",))["cells"]


def fmt_time(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


# ---- Stages --------------------------------------------------------------------------------------

def stage_data(plan: configs.Plan, allow_missing: bool = False):   # --data-dir: a pack (cache root) or nanoGPT's
    preset = plan.data in configs.DATA_PRESETS
    if preset:
        from lab import corpus
        corpus.prepare(plan.data, allow_missing=allow_missing)
    d = data_mod.TokenData(data_mod.default_data_dir(plan.data) if preset else plan.data)
    what = f"{plan.data} preset ({d.dir})" if preset else f"{d.dir} ({d.manifest['format']}, " + ", ".join(
        f"{f} sha256 {v['sha256'][:12]}" for f, v in d.manifest["files"].items()) + ")"
    log(f"data: {what}, vocab {d.vocab_size}, {len(d.sources)} sources, domains {sorted(set(d.domains.values()))}")
    return d, d.manifest


def plan_cells(plan: configs.Plan, cells: list[dict]) -> list[dict]:
    """The ladder cells `plan` trains: its first `scales` scales, then only its `cells` (None: all)."""
    scales = list(dict.fromkeys(c["scale"] for c in cells))[:plan.scales]
    kept = [c for c in cells if c["scale"] in scales
            and (plan.cells is None or (c["scale"], c["sparsity_label"]) in {tuple(x) for x in plan.cells})]
    if not kept:
        raise ValueError(f"Plan: no ladder cell left after scales={plan.scales}, cells={plan.cells}")
    return kept


def stage_ladder(plan: configs.Plan, data, out: Path) -> list[dict]:
    """budget.ladder_cells (`python budget.py --ladder`) at the data's vocabulary and document length: ladder.json."""
    block = configs.LADDERS[plan.ladder]["block"]
    if plan.block_size != block:
        raise ValueError(f"Plan: block_size={plan.block_size} differs from configs.LADDERS[{plan.ladder!r}]'s "
                         f"{block}: the ladder is matched at that context")
    ctx = budget.preset_doc_length(plan.ladder, data)
    cells = plan_cells(plan, budget.ladder_cells(plan.ladder, ctx, vocab_size=data.vocab_size, arms=plan.arms))
    log(f"ladder: {plan.ladder}, FLOPs without the head at the measured document length {ctx:.1f} (block {block})")
    for c in cells:
        for arm, m in c["match"].items():
            log(f"ladder {c['scale']} {c['sparsity_label']}: {configs.arm_label(arm)} d_model {c[arm]['d_model']}, "
                f"{c[arm]['n_experts']} experts; F {m['flops_ratio']:.3f}  N {m['params_ratio']:.3f}  "
                f"KV {m['kv_ratio']:.3f}" + ("" if m["within_tolerance"] else "  (outside SMELT's tolerances)"))
    checks.write_json(out / "ladder.json", {"cells": cells})
    return cells


CUDA_WORKER_OVERHEAD_BYTES = 2 << 30   # a worker's GPU memory beyond its step's floor (CUDA context, slack)
CPU_WORKER_OVERHEAD_BYTES = 1 << 30    # a worker's RAM beyond its step's floor (torch itself, slack)
CUDA_MAX_JOBS = 4        # runs sharing one GPU by default: their compiles overlap, their kernels take turns


def default_jobs(device: str, cpus: int, mem_free: int | None = None, mem_per_run: int | None = None) -> int:
    """Runs trained at once by default. CPU: one per core, one thread each. CUDA: min(CUDA_MAX_JOBS, cpus // 4)
    (4+ cores each for inductor). Both: at most the runs that fit mem_free (RAM on CPU, the GPU's on CUDA) at
    mem_per_run bytes each, at least 1."""
    if device not in ("cpu", "cuda") or cpus < 1:
        raise ValueError(f"default_jobs: device must be 'cpu' or 'cuda' and cpus >= 1, got {device!r}, {cpus}")
    jobs = cpus if device == "cpu" else min(CUDA_MAX_JOBS, cpus // 4)
    if mem_free is not None and mem_per_run:
        jobs = min(jobs, mem_free // mem_per_run)
    return max(1, jobs)


def run_steps(plan: configs.Plan, ladder: list[dict]) -> list[tuple[str, ModelConfig, dict]]:
    """(run name, model, its training step's budget.step_memory sizes: the plan's batch and block) of every run."""
    tc = train.train_config(plan)
    return [(r.name, c, dict(rows=tc.batch_size, T=tc.block_size or c.block_size, grad_accum=tc.grad_accum))
            for r in configs.plan_runs(Path("."), ladder, plan) for c in [ModelConfig.from_dict(r.cell[r.arch])]]


def bytes_per_run(plan: configs.Plan, ladder: list[dict], overhead: int) -> int:
    """A lower bound on one worker's memory: the largest run's budget.step_memory + `overhead`."""
    return overhead + max(sum(budget.step_memory(c, **sizes).values()) for _, c, sizes in run_steps(plan, ladder))


def refuse_oversized_runs(plan: configs.Plan, ladder: list[dict], device: str, per_run: int, free: int | None):
    """checks.TooLargeError naming the run and the setting when one run's step alone cannot fit `device`
    (looked for only when per_run, the worker's overhead included, exceeds the `free` bytes)."""
    if free is None or per_run <= free:
        return
    for name, c, sizes in run_steps(plan, ladder):
        budget.refuse_oversized(c, device, what=f"run {name}'s training step", train=True, **sizes,
                                model_hint="use a smaller --preset, or a machine with more memory",
                                rows_hint="use a smaller --preset")


def gpu_bytes_per_run(plan: configs.Plan, ladder: list[dict]) -> int:
    return bytes_per_run(plan, ladder, CUDA_WORKER_OVERHEAD_BYTES)


def cpu_bytes_per_run(plan: configs.Plan, ladder: list[dict]) -> int:
    return bytes_per_run(plan, ladder, CPU_WORKER_OVERHEAD_BYTES)


class WorkerDiedError(checks.UserError, RuntimeError):
    """A pool_run worker died (killed from outside, out of memory): a re-run resumes, so one line, exit status 2."""


def _death(procs) -> str:
    """How the pool's worker died: pid and signal (a negative exitcode) or exit status; the pool SIGTERMs the
    others once one dies, so another ending is taken first."""
    import signal
    ended = [p for p in procs if p.exitcode not in (None, 0)]
    ended.sort(key=lambda p: p.exitcode == -signal.SIGTERM)
    if not ended:
        return ""
    p = ended[0]
    if p.exitcode > 0:
        return f"pid {p.pid}, exit status {p.exitcode}"
    try:
        sig = signal.Signals(-p.exitcode).name
    except ValueError:
        sig = str(-p.exitcode)
    return f"pid {p.pid}, signal {sig}" + (": killed, or out of memory" if sig == "SIGKILL" else "")


def pool_run(fn, jobs_list: list, jobs: int, cost=None, on_done=None, name=str, threads: int = 1) -> list:
    """[fn(j) for j in jobs_list], `jobs` at a time in spawned workers with `threads` intra-op threads each,
    largest `cost` first (so they finish together), calling on_done(k, job, result) as each finishes.
    A worker that dies is a WorkerDiedError (a UserError) naming its signal and the unfinished jobs (`name(job)`)."""
    order = sorted(range(len(jobs_list)), key=lambda i: -cost(jobs_list[i]) if cost else 0)
    done: dict[int, object] = {}
    if jobs <= 1:
        for k, i in enumerate(order, 1):
            done[i] = fn(jobs_list[i])
            if on_done:
                on_done(k, jobs_list[i], done[i])
        return [done[i] for i in range(len(jobs_list))]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool
    left = None
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                             initargs=(os.getpid(), threads)) as pool:
        procs = pool._processes   # pid -> Process, kept: the exit codes are read once the pool is shut down
        futures = {pool.submit(fn, jobs_list[i]): i for i in order}
        for k, f in enumerate(as_completed(futures), 1):
            i = futures[f]
            try:
                done[i] = f.result()
            except BrokenProcessPool:
                left = [name(jobs_list[j]) for j in order if j not in done]
                break
            if on_done:
                on_done(k, jobs_list[i], done[i])
    if left is not None:   # the `with` has joined the workers: their exit codes are known
        running = left[0] if len(left) == 1 else "one of " + ", ".join(left)
        raise WorkerDiedError(f"a worker process died ({_death(list(procs.values())) or 'killed, or out of memory'}) "
                              f"while running {running}; run the same command again to resume (finished work is kept)")
    return [done[i] for i in range(len(jobs_list))]


def _worker_init(parent: int, threads: int = 1) -> None:
    """pool_run's worker: `threads` intra-op threads, and die with the parent (Linux: PR_SET_PDEATHSIG; and a
    thread that exits once the parent pid changes), so a killed reproduce.py leaves no workers writing its runs."""
    import signal
    import sys
    import threading
    torch.set_num_threads(threads)
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))   # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    if os.getppid() != parent:   # the parent died before the death signal was armed
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def train_one(job: tuple) -> list[dict]:
    """(model config dict, train config dict, data dir, run dir, meta) -> train.train's rows."""
    cfg, tc, data_dir, run, meta = job
    return train.train(ModelConfig.from_dict(cfg), train.TrainConfig(**tc), data_mod.TokenData(data_dir), run, meta)


def run_tokens(plan: configs.Plan) -> int:
    """Tokens one run trains on: the stable phase and every decay branch (TrainConfig.branches)."""
    tc = train.train_config(plan)
    return (tc.stable_steps + len(tc.branches) * tc.decay_steps) * tc.batch_size * tc.block_size


def plan_cost(plan: configs.Plan, ladder: list[dict], train_tokens: int | None = None) -> dict:
    """The plan's training cost per run and in total (costs.run_cost: GPU minutes on one H200 at its MFU range)."""
    rows, tokens = [], run_tokens(plan)
    final = (max(plan.branch_steps) + plan.decay_steps) * plan.batch_size * plan.block_size
    for r in configs.plan_runs(Path("."), ladder, plan):
        cfg = ModelConfig.from_dict(r.cell[r.arch])
        c = costs.run_cost(cfg, r.cell["ctx_len"], tokens)
        rows.append({"run": r.name, **c, "tpp_final": final / (c["F"] / 6),
                     "tokens_per_param_final": final / budget.count_params(cfg)["blocks"]})
    return {"runs": rows, "tokens_per_run": tokens, "train_tokens": train_tokens,
            # the data read (stable phase + the shared decay window), not the tokens trained on
            "epochs_per_run": configs.plan_epochs(plan, train_tokens) if train_tokens else None,
            "total_flops": sum(r["flops_with_head"] for r in rows),
            "gpu_minutes": [sum(r["gpu_minutes"][i] for r in rows) for i in (0, 1)], "mfu": costs.ASSUMED["mfu"],
            "peak_flops": costs.PEAK_FLOPS}


def log_plan_cost(cost: dict) -> None:
    tpp = [r["tpp_final"] for r in cost["runs"]]
    tpn = [r["tokens_per_param_final"] for r in cost["runs"]]
    ep = (f" ({cost['epochs_per_run']:.2f} epochs of the training stream: the stable phase and the one decay window "
          f"the branches share)" if cost.get("epochs_per_run") else "")
    log(f"plan: {len(cost['runs'])} runs x {cost['tokens_per_run'] / 1e6:.2f}M tokens{ep}; longest endpoint "
        f"{min(tpp):.3g}-{max(tpp):.3g} tokens per dense-equivalent parameter (TPP), {min(tpn):.3g}-{max(tpn):.3g} "
        f"tokens per total parameter; {cost['total_flops']:.3g} FLOPs in all = {cost['gpu_minutes'][0]:.1f}-"
        f"{cost['gpu_minutes'][1]:.1f} min on one H200 at an assumed {100 * cost['mfu'][0]:.0f}-"
        f"{100 * cost['mfu'][1]:.0f} % MFU (training FLOPs only; the whole job: --plan-only's cost model)")
    if (cost.get("epochs_per_run") or 0) > 1:
        log(f"plan: WARNING: decay data {configs.decay_freshness(cost['epochs_per_run'])}")


def plan_design(plan: configs.Plan, ladder: list[dict]) -> dict:
    """Print and return what the plan's fitted grid can decide before it trains (SMELT 4.3's identification rules):
    its spans and points per surface, and the power scaling_analysis.design_power simulates on that shape."""
    from lab import scaling_analysis
    shape = scaling_analysis.design_shape(plan, ladder)
    power = scaling_analysis.design_power(shape)
    by = ", ".join(f"{a} {n}" for a, n in power["identified_by_arch"].items())
    verdict = (f"no fit can be identified ({'; '.join(power['why'])})" if power["why"] else
               f"not forecast: {power['unforecast']}" if power["unforecast"] else
               f"the surfaces {power['prior']}, drawn at this plan's F, S and D with their measured noise, refit "
               f"identified in {by} of {power['datasets']} draws, both in {power['identified']} (scripts/grid_power.py)")
    log(f"plan: design {shape['n_cells']} fitted cells x {len(shape['horizons'])} endpoints = {shape['points']} points "
        f"per surface; F spans {shape['F_span']:.2f}x, D {shape['D_span']:.2f}x, C {shape['C_span']:.1f}x; expected "
        f"power: {verdict}")
    return {"shape": shape, "power": power}


def check_disk(plan: configs.Plan, ladder: list[dict], out: Path, jobs: int, refuse: bool = True) -> dict:
    """Print what training keeps on disk (costs.plan_disk_estimate); refuse (`refuse`) when `out` cannot hold it."""
    import shutil
    cfgs = [ModelConfig.from_dict(r.cell[r.arch]) for r in configs.plan_runs(out, ladder, plan)]
    est = costs.plan_disk_estimate(cfgs, train.train_config(plan), jobs)
    done = sum(f.stat().st_size for f in (out / "runs").rglob("*") if f.is_file()) if (out / "runs").exists() else 0
    free, fmt = shutil.disk_usage(out).free, checks.format_bytes
    need = max(0, est["peak"] - done)
    log(f"disk: the {est['runs']} runs keep {fmt(est['final'])} when finished and up to {fmt(est['peak'])} while "
        f"training ({fmt(done)} already written); {fmt(free)} free at {out}")
    if refuse and need > free:
        raise checks.UserError(f"not enough disk at {out}: training needs up to {fmt(need)} more and "
                            f"{fmt(free)} is free; free space or pass --out-dir on a larger disk")
    return est


def run_time_proxy(cfg: ModelConfig, ctx: float) -> float:
    """A run's relative training time (longest first; the ETA): FLOPs per token with the head, times
    1 + (executed / stored layers - 1) / 2 for the work FLOPs leave out (measured: docs/reproduce.md)."""
    attn, _ = executed_visits(cfg.n_layer, cfg.loop)
    return budget.flops_per_token(cfg, ctx, include_head=True) * (1 + (attn / cfg.n_layer - 1) / 2)


def stage_train(plan: configs.Plan, ladder: list[dict], data, out: Path, jobs: int, threads: int = 1) -> list[dict]:
    todo = []
    for r in configs.plan_runs(out, ladder, plan):
        meta = {"arch": r.arch, "scale": r.cell["scale"], "sparsity_label": r.cell["sparsity_label"],
                "seed": r.seed, "run": r.name,
                "control": budget.dense_control(ModelConfig.from_dict(r.cell["baseline"])).to_dict()}
        tc = {**asdict(train.train_config(plan, r.seed)), "flops_ctx": r.cell["ctx_len"]}   # F at the ladder's length
        todo.append((r.cell[r.arch], tc, str(data.dir), r.dir, meta))
    cost = lambda job: run_time_proxy(ModelConfig.from_dict(job[0]), plan.block_size)
    total = sum(cost(j) for j in todo)
    t0, state = time.time(), {"cost": 0.0}
    log(f"train: {len(todo)} runs, {jobs} at a time")

    def on_done(k, job, rows):
        state["cost"] += cost(job)
        el = time.time() - t0
        eta = el * (total - state["cost"]) / max(state["cost"], 1e-9)
        log(f"train: run {k}/{len(todo)} done: {job[3].name} val {max(rows, key=lambda r: r['D'])['val_loss']:.3f} "
            f"| elapsed {fmt_time(el)}, training ETA {fmt_time(eta)}")

    rows = [r for run_rows in pool_run(train_one, todo, jobs, cost, on_done=on_done, name=lambda j: j[3].name,
                                       threads=threads) for r in run_rows]
    checks.atomic_write_text(out / "results.jsonl", "".join(checks.jsonl_line(r) for r in rows))
    return rows


EVAL_KEYS = ("run", "arch", "scale", "sparsity_label", "branch_step", "val", "summary")   # what stage_eval reads


def _eval_one(job: tuple) -> dict:
    """(endpoint, data dir, plan, cache path, tag, run dir relative to OUT) -> the record, cached at the path."""
    from lab import evaluate
    path, data_dir, plan, cache, tag, run = job
    rec = evaluate.evaluate_endpoint(path, tasks=plan.tasks, shots=plan.shots, seeds=plan.seeds,
                                     max_items=plan.max_items, val_tokens_per_source=plan.eval_tokens,
                                     data=data_mod.TokenData(data_dir), log=lambda m: None)
    rec["run"] = run
    checks.write_json(Path(cache), rec)
    return rec


def pair_runs(plan: configs.Plan, ladder: list[dict], out: Path, arm: str) -> list[configs.Run]:
    """The runs one arm's comparison reads: the Baseline's and the arm's, paired by cell and seed."""
    return [r for r in configs.plan_runs(out, ladder, plan) if r.arch in (configs.BASELINE, arm)]


def stage_eval(plan: configs.Plan, ladder: list[dict], data, out: Path, jobs: int, threads: int = 1,
               arm: str = "smelt") -> dict:
    """SMELT 5 on every branch endpoint of the Baseline and `arm` (cached in OUT/eval, shared by the arms), then
    downstream_claims.downstream_report (App. C, 5.3, Eq. 6) and its figures in arm_dir."""
    from lab import downstream_claims, eval_plots
    (out / "eval").mkdir(exist_ok=True)
    where = configs.arm_dir(out, plan, arm)
    where.mkdir(parents=True, exist_ok=True)
    eps = [e for r in pair_runs(plan, ladder, out, arm) for e in ev.run_endpoints(r.dir)]
    records, todo = {}, []
    for e in eps:
        key = f"{Path(e['run']).name}@{e['branch_step']}"
        cache = out / "eval" / f"{key.replace('@', '_b')}.json"
        rec = checks.read_cache(cache, EVAL_KEYS)   # absent or damaged: evaluated again
        if rec is not None:
            records[key] = rec
        else:
            todo.append((e["path"], str(data.dir), plan, str(cache), key, os.path.relpath(e["run"], out)))
    t0 = time.time()
    log(f"eval: {len(eps)} endpoints ({len(eps) - len(todo)} done before), {len(todo)} to evaluate, {jobs} at a time")

    def on_done(k, job, rec):
        el = time.time() - t0
        log(f"eval: endpoint {k}/{len(todo)} done: {job[4]} ({rec.get('seconds', 0):.1f} s) | elapsed {fmt_time(el)}, "
            f"ETA {fmt_time(el / k * (len(todo) - k))}")

    res = pool_run(_eval_one, todo, jobs, lambda j: Path(j[0]).stat().st_size, on_done=on_done, name=lambda j: j[4],
                   threads=threads)
    records.update(zip((j[4] for j in todo), res))
    recs = downstream_claims.as_pair(list(records.values()), arm)
    report = downstream_claims.downstream_report(recs, n_boot=plan.bootstrap * 10, unit="run")
    figs = eval_plots.plot_downstream(report, recs, where / "figures")
    figs = {**figs, "figures": {k: p and os.path.relpath(p, out) for k, p in (figs.get("figures") or {}).items()}}
    summary = {"report": report, "figures": figs, "n_endpoints": len(recs),
               "runs": {k: {"arch": v["arch"], "scale": v["scale"], "sparsity_label": v["sparsity_label"],
                            "seed": v.get("seed"), "branch_step": v.get("branch_step"),
                            "val_loss": v["val"]["loss"] if v.get("val") else None, "summary": v["summary"]}
                        for k, v in sorted(records.items())}}
    checks.write_json(where / "eval_summary.json", summary)
    return summary


def stage_scaling(plan: configs.Plan, rows: list[dict], out: Path, arm: str = "smelt") -> dict:
    """SMELT 4 (scaling_analysis.analyse) on the Baseline's and `arm`'s rows; {"error": ...} when the fits fail."""
    from lab import scaling_analysis
    rows = [r for r in rows if r["arch"] in (configs.BASELINE, arm)]
    try:
        return scaling_analysis.analyse(rows, str(configs.arm_dir(out, plan, arm) / "scaling"),
                                        n_boot=plan.bootstrap, n_jobs=2, target=arm,
                                        budgets=scaling_analysis.preset_budgets(plan.ladder))
    except (ValueError, RuntimeError) as e:
        log(f"scaling fits failed: {e}")
        return {"error": str(e)}


def stage_probes(plan: configs.Plan, ladder: list[dict], data, out: Path, arm: str = "smelt") -> dict:
    """SMELT 6 on every matched pair of the Baseline and `arm` (probe_pairs.probe_pairs), one held-out sample over
    all domains."""
    from lab import probe_pairs, probe_plots
    where = configs.arm_dir(out, plan, arm)
    path = where / "probes.json"
    cached = probe_pairs.load_result(path)                             # None when absent or damaged (named)
    if cached is not None:
        return cached
    runs = {(r.key, r.seed, r.arch): r for r in pair_runs(plan, ladder, out, arm)}
    pairs = [(key + (f"_seed{seed}" if seed else ""), str(b.dir), str(runs[key, seed, arm].dir))
             for (key, seed, a), b in runs.items() if a == configs.BASELINE]   # by cell, seed and arm name
    log(f"probes: {len(pairs)} {configs.arm_label(arm)} pairs, {plan.probe_tokens} held-out tokens over every domain")
    res = probe_pairs.probe_pairs(pairs, data, plan.probe_tokens, plan.block_size, log=log,
                                  dyck=data_mod.foreign_tokenizer(getattr(data, "dir", None)) is None)   # text prompts
    largest = configs.cell_key(ladder[-1]["scale"], ladder[-1]["sparsity_label"])   # the per-pair figures: largest cell
    res["figures"] = probe_plots.plot_pairs(res, str(where / "figures" / "probes"), detail=[largest])
    probe_pairs.save_result(path, res)                                 # hashed, figure paths relative to out
    return res


def probe_verdicts(prb: dict) -> list[dict]:
    """The probe claims with their verdicts (probe_claims.claims); [] without probes."""
    if not prb.get("pairs"):
        return []
    from lab import probe_claims
    return probe_claims.claims(prb)


# ---- Command line --------------------------------------------------------------------------------

def free_gpu_bytes() -> int:
    return checks.available_memory("cuda")


def free_cpu_bytes() -> int | None:
    return checks.available_memory("cpu")   # MemAvailable; None where the OS does not say


def choose_jobs(asked: int | None, plan: configs.Plan, ladder: list[dict]) -> tuple[int, dict]:
    """(jobs, the runtime entries, "jobs_from" saying why): --jobs, else default_jobs; on CPU, one thread each and
    at most the runs that fit RAM (cpu_bytes_per_run each); on CUDA, cores // jobs threads each, and a --jobs
    whose runs cannot fit the free GPU memory (gpu_bytes_per_run each) is refused before any training."""
    cpus = os.cpu_count() or 1
    fmt = lambda n: f"{n / 2**30:.1f} GiB"
    source = "--jobs" if asked else "default_jobs"
    if not torch.cuda.is_available():
        per_run, free = cpu_bytes_per_run(plan, ladder), free_cpu_bytes()
        refuse_oversized_runs(plan, ladder, "cpu", per_run, free)   # before any training
        jobs = asked or default_jobs("cpu", cpus, free, per_run)
        have = "memory unknown" if free is None else f"{fmt(free)} available"
        return jobs, {"jobs": jobs, "jobs_from": f"{source}: {cpus} cores, {have}, >= {fmt(per_run)} per run",
                      "threads_per_worker": 1 if jobs > 1 else torch.get_num_threads(), "device": "cpu"}
    per_run, free = gpu_bytes_per_run(plan, ladder), free_gpu_bytes()
    refuse_oversized_runs(plan, ladder, "cuda", per_run, free)
    jobs = asked or default_jobs("cuda", cpus, free, per_run)
    if jobs > 1 and jobs * per_run > free:
        raise checks.UserError(f"--jobs {jobs} on one GPU needs at least {fmt(jobs * per_run)} "
                            f"({fmt(per_run)} per run: reproduce.gpu_bytes_per_run), {fmt(free)} is free; "
                            f"use --jobs {max(1, free // per_run)}")
    return jobs, {"jobs": jobs, "jobs_from": f"{source}, sharing the GPU: {cpus} "
                                       f"cores, {fmt(free)} free, >= {fmt(per_run)} per run",
                  "threads_per_worker": max(1, cpus // jobs) if jobs > 1 else torch.get_num_threads(),
                  "device": "cuda"}


def build_parser() -> argparse.ArgumentParser:
    ap = checks.parser(__doc__)
    ap.add_argument("--preset", default="tiny", choices=list(configs.PLANS), help="size of the reproduction")
    checks.add_out_dir(ap, "output directory (default: runs/reproduce_PRESET, plus the loop options that differ "
                           "from the plan's, e.g. runs/reproduce_tiny_r3_last)")
    ap.add_argument("--data-dir", default=None, metavar="DIR",
                    help="read the data from a pack made by `python -m lab.corpus --preset PRESET --pack DIR` "
                         "(for a machine without network: nothing is downloaded; default: prepare the preset's), "
                         "or nanoGPT's train.bin, val.bin and optional meta.json (docs/data.md)")
    ap.add_argument("--jobs", type=checks.positive_int, default=None,
                    help="runs trained at once (default: one per CPU core, one thread each; on CUDA min(4, cores // 4) "
                         "sharing the GPU; both capped by memory: reproduce.default_jobs)")
    ap.add_argument("--allow-missing-sources", action="store_true",
                    help="build the corpus without the sources that cannot be fetched (recorded in its manifest and "
                         "REPORT.md's corpus fingerprint; default: such a source stops the run)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["eval", "scaling", "probes"],
                    help="stages to leave out")
    add_loop_args(ap)   # how every looped model loops, matched again to the same Baselines (default: the plan's)
    ap.add_argument("--plan-only", action="store_true",
                    help="print the ladder and what training it costs (tokens, TPP, FLOPs, GPU minutes), then stop")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with combinations that cannot mean anything refused by name."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.plan_only and (args.skip or args.jobs):
        ap.error(f"--plan-only trains nothing: {'--skip' if args.skip else '--jobs'} has no effect with it")
    if args.data_dir and not Path(args.data_dir).is_dir():
        ap.error(f"--data-dir {args.data_dir}: no such directory (make a pack with `python -m lab.corpus --pack DIR`, "
                 f"or give nanoGPT's train.bin and val.bin)")
    if args.jobs and args.jobs > (os.cpu_count() or 1):
        log(f"warning: --jobs {args.jobs} is more than the {os.cpu_count()} CPU cores: the runs will share cores")
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    plan = configs.PLANS[args.preset]
    plan = replace(plan, arms={a: loop_spec(args, s) for a, s in plan.arms.items()})   # the loop options: every arm
    if args.data_dir and data_mod.is_bin_dir(args.data_dir):   # nanoGPT's layout: read in place (plan.json names it)
        plan = replace(plan, data=str(Path(args.data_dir).resolve()))
        if (name := data_mod.foreign_tokenizer(args.data_dir)) and "eval" not in args.skip:
            own = data_mod.project_tokenizer(data_mod.bin_meta(args.data_dir)["vocab_size"])
            log(f"data: {args.data_dir}'s tokenizer {name!r} is not this project's {own!r}: the few-shot tasks "
                f"cannot encode their text, so stage eval is skipped"
                + (" (the probes run without the Dyck case study)" if "probes" not in args.skip else ""))
            args.skip = [*args.skip, "eval"]
    out = checks.check_out_dir(args.out_dir or f"runs/reproduce_{args.preset}{plan.loop.tag()}")   # before any work
    with checks.run_lock(out, "reproduce.py"):   # one invocation per out dir (runs inside have their own lock)
        if args.data_dir and plan.data in configs.DATA_PRESETS:   # the pack: this process's cache root (and workers')
            from lab import corpus
            corpus.use_pack(args.data_dir, plan.data)
        return _pipeline(args, plan, out)


def _pipeline(args: argparse.Namespace, plan: configs.Plan, out: Path) -> Path:
    """Every stage, in order, into the locked out dir `out`."""
    t0, stage_s = time.time(), {}
    torch.manual_seed(0)
    log(f"reproduce: preset {args.preset} -> {out}")

    def timed(name, fn, *a):
        t = time.time()
        r = fn(*a)
        stage_s[name] = stage_s.get(name, 0.0) + time.time() - t
        return r

    data, _ = timed("data", stage_data, plan, args.allow_missing_sources)
    ladder = timed("ladder", stage_ladder, plan, data, out)
    cost = plan_cost(plan, ladder, len(data.train))
    log_plan_cost(cost)
    design = plan_design(plan, ladder)
    checks.write_json(out / "plan.json", {"preset": args.preset, **asdict(plan), "cost": cost, "design": design})
    if args.plan_only:
        cuda = torch.cuda.is_available()
        host = {"cpus": os.cpu_count() or 1, "gpu_bytes": free_gpu_bytes()} if cuda else costs.GPU_HOST
        jobs = default_jobs("cuda", host["cpus"], host["gpu_bytes"], gpu_bytes_per_run(plan, ladder))
        log(f"cost model: {jobs} runs at a time, reproduce.default_jobs on {'this' if cuda else 'the lent'} GPU "
            f"host ({host['cpus']} cores, {host['gpu_bytes'] / 2**30:.0f} GiB{' free' if cuda else ''})")
        costs.report(plan, ladder, data, cost, log, jobs)   # the GPU cost model per stage
        check_disk(plan, ladder, out, jobs, refuse=False)
        return out / "plan.json"
    entropy = data_mod.unigram_entropy(data)
    unigram_val = data_mod.unigram_val_loss(data, plan.block_size, plan.eval_tokens)
    log(f"data: unigram entropy of the training stream {entropy:.3f} nats (the target: every model "
        f"<= {entropy - 1.5:.3f}); the unigram model scores {unigram_val:.3f} on the validation set")
    jobs, runtime = choose_jobs(args.jobs, plan, ladder)
    ms = train.machine_settings()   # each training worker also sets the CPU allocator thresholds (train.py)
    runtime.update({k: ms[k] for k in ("cpus", "amx_bf16", "avx512_bf16", "cpu_dtype", "cpu_adamw")},
                   malloc=f"per worker: {'environment' if ms['malloc'] == 'environment' else train.MALLOC_SETTING}"
                   if runtime["device"] == "cpu" else ms["malloc"])
    log("runtime: " + ", ".join(f"{k} {v}" for k, v in runtime.items()))
    check_disk(plan, ladder, out, jobs)
    threads = runtime["threads_per_worker"]   # 1 per CPU worker; in-process (jobs 1) it is not used
    rows = timed("train", stage_train, plan, ladder, data, out, jobs, threads)
    train_plots.plot_curves(out, ladder, entropy, plan)
    compared = {}   # each looped arm against the Baseline, by name
    for arm in plan.arms:
        (where := configs.arm_dir(out, plan, arm)).mkdir(parents=True, exist_ok=True)
        ts = reporting.training_summary(plan, ladder, rows, entropy, arm)
        ts["learned"]["unigram_val_loss"] = unigram_val
        checks.write_json(where / "training_summary.json", ts)
        ev_sum = timed("eval", stage_eval, plan, ladder, data, out, jobs, threads, arm) if "eval" not in args.skip else {}
        scal = (timed("scaling", stage_scaling, plan, rows, out, arm) if "scaling" not in args.skip
                else {"error": "skipped"})
        prb = timed("probes", stage_probes, plan, ladder, data, out, arm) if "probes" not in args.skip else {}
        compared[arm] = reporting.Compared(ts, ev_sum, scal, prb, probe_verdicts(prb))
    summary = {**reporting.run_summary(args.preset, stage_s, time.time() - t0, data.manifest), "runtime": runtime}
    checks.write_json(out / "summary.json", summary)
    report = reporting.write_report(args.preset, plan, out, ladder, rows, compared, summary, cost)
    log(f"done in {(time.time() - t0) / 60:.1f} min: {report}")
    return report


if __name__ == "__main__":
    checks.run_main(main)
