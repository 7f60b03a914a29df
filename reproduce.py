"""The main job: the reduced-scale SMELT reproduction, end to end, with a report.

  python reproduce.py [--preset smoke|tiny|small|medium|paper] [--out-dir DIR]

Stages (each reads the JSON the previous one wrote; finished work is skipped on re-run):
  1. data      data.prepare(preset) (or a pack, --data-dir): the offline multi-domain corpus.
  2. ladder    budget.ladder_cells at the data's measured document length (the function
               `python budget.py --ladder` prints): each SMELT matched to its Baseline on FLOPs
               without the head, parameters and KV cache (SMELT 3.2). Written to ladder.json.
               The plan's cost (tokens, TPP, FLOPs, GPU minutes, disk) is printed before training.
  3. train     train.train for every run (each cell at seed 0, the plan's `repeat` cell over
               `train_seeds` seeds): WSD with decay branches (SMELT 3.1); both models of a cell and
               seed see identical batches. One results row and one endpoint per branch.
  4. eval      eval.evaluate_endpoint on every branch endpoint, then eval.downstream_report: win
               counts, Appendix C averages and permutation tests, Sec. 5.3 families, Eq. 6-7.
  5. scaling   scaling.analyse: separate surfaces per architecture; CE gain and TPP only from
               identified fits, with cell-bootstrap intervals (SMELT 4, 5.2).
  6. probes    probes.probe_pairs on every matched pair, all domains held out (SMELT 6).
  7. report    REPORT.md: every table and plot, and every claim of the paper as reproduced /
               contradicted / not resolved by its interval (stats.verdict).

Presets. smoke: toy sizes, every stage, no download, ~1 minute (the tests run it). tiny (the
default): the real pipeline on the offline corpus, about 12-13 minutes on 2 CPU cores. small: one
GPU, minutes. medium: one GPU, about an hour. paper: the Appendix A grid, for users with the
hardware (days; the configs come from budget.py's reconstruction of Appendix A).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import budget
import cli
from model import ModelConfig


@dataclass
class Plan:
    """Everything a preset decides besides the model ladder (which budget.py owns)."""
    data: str                       # data.prepare preset
    ladder: str                     # budget.PRESETS preset (its block size is the training context)
    block_size: int                 # training context; must equal budget.PRESETS[ladder]["block"]
    batch_size: int
    lr: float
    warmup_steps: int
    stable_steps: int
    branch_steps: list[int]
    decay_steps: int
    eval_tokens: int                # validation tokens per source at each branch end
    tasks: tuple = ("generated", "real")
    shots: tuple = (0, 1, 2, 4, 8)
    seeds: int = 3                  # few-shot demonstration seeds per task and k
    max_items: int = 40
    bootstrap: int = 200
    probe_tokens: int = 8192
    scales: int | None = None       # keep only the first N scales of the ladder (None: all)
    cells: tuple | None = None      # keep only these (scale, sparsity label) cells of the ladder (None: all)
    repeat: tuple | None = None     # (scale, sparsity label) of the cell trained over `train_seeds` seeds
    train_seeds: int = 1            # training seeds of the repeated cell (every other cell: seed 0)
    eval_interval: int = 0          # validation during training every N steps (0: only at branch ends)


PLANS = {
    "smoke": Plan(data="smoke", ladder="smoke", block_size=64, batch_size=8, lr=3e-3, warmup_steps=5,
                  stable_steps=30, branch_steps=[10, 20, 30], decay_steps=6, eval_tokens=2048,
                  tasks=("gen_copy", "gen_kv"), shots=(0, 2), seeds=2, max_items=8, bootstrap=20, probe_tokens=1024,
                  repeat=("m64", "S~85%"), train_seeds=2),
    # tiny: see the README's "The tiny plan" for the measurements behind each number. Three cells: the S = 0
    # control and S~85 % at t64 (the "more experts" step), S~85 % at t96 (the "more parameters" step); the
    # t64 S~85 % cell over 3 seeds. t96 S = 0 is left out: it learns slowest per token (4.50 nats at 0.7M)
    # and costs as much as a t64 cell's three seeds' worth of evaluation time.
    "tiny": Plan(data="tiny", ladder="tiny", block_size=128, batch_size=4, lr=2e-3, warmup_steps=50,
                 stable_steps=1500, branch_steps=[900, 1200, 1500], decay_steps=140, eval_tokens=4096,
                 cells=(("t64", "S=0%"), ("t64", "S~85%"), ("t96", "S~85%")),
                 tasks=("generated", "qa_wikidata", "dyck_languages", "cs_algorithms", "operators",
                        "repeat_copy_logic"), shots=(0, 2, 8), seeds=2, max_items=12, bootstrap=40,
                 probe_tokens=4096, repeat=("t64", "S~85%"), train_seeds=3, eval_interval=750),
    "small": Plan(data="small", ladder="small", block_size=1024, batch_size=32, lr=2e-3, warmup_steps=50,
                  stable_steps=600, branch_steps=[100, 300, 600], decay_steps=100, eval_tokens=32768,
                  seeds=5, max_items=100, bootstrap=1000, probe_tokens=32768, repeat=("s128", "S~85%"),
                  train_seeds=3, eval_interval=150),
    "medium": Plan(data="small", ladder="medium", block_size=1024, batch_size=64, lr=2e-3, warmup_steps=100,
                   stable_steps=4000, branch_steps=[500, 1000, 2000, 4000], decay_steps=400, eval_tokens=65536,
                   shots=(0, 1, 2, 4, 8, 16, 32), seeds=10, max_items=200, bootstrap=2000, probe_tokens=65536,
                   repeat=("s256", "S~85%"), train_seeds=3, eval_interval=500),
    "paper": Plan(data="small", ladder="paper", block_size=4096, batch_size=256, lr=1e-3, warmup_steps=2000,
                  stable_steps=196_075, branch_steps=[10_000, 20_000, 50_000, 100_000, 150_000, 196_075],
                  decay_steps=9537, eval_tokens=1 << 20, shots=(0, 1, 2, 4, 8, 16, 32), seeds=10,
                  max_items=None, bootstrap=2000, probe_tokens=1 << 20),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=float))
    os.replace(tmp, path)


def fmt_time(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


# ----------------------------------------------------------------------------------------
# Stages

def stage_data(plan: Plan, data_dir: str | None = None):
    import data
    if data_dir is None:
        data.prepare(plan.data)
        data_dir = data.default_data_dir(plan.data)
    d = data.TokenData(data_dir)
    log(f"data: {plan.data} preset ({d.dir}), vocab {d.vocab_size}, {len(d.sources)} sources, "
        f"domains {sorted(set(d.domains.values()))}")
    return d, d.manifest


def stage_ladder(plan: Plan, data, out: Path) -> list[dict]:
    """Baseline and matched SMELT configs per cell (budget.ladder_cells, the function `python budget.py
    --ladder` prints), at the data's vocabulary and measured document length. Writes ladder.json."""
    block = budget.PRESETS[plan.ladder]["block"]
    if plan.block_size != block:
        raise ValueError(f"Plan: block_size={plan.block_size} differs from budget.PRESETS[{plan.ladder!r}]'s "
                         f"{block}: the ladder is matched at that context")
    ctx = budget.preset_doc_length(plan.ladder, data)
    cells = budget.ladder_cells(plan.ladder, ctx, vocab_size=data.vocab_size)
    scales = list(dict.fromkeys(c["scale"] for c in cells))[:plan.scales]
    cells = [c for c in cells if c["scale"] in scales
             and (plan.cells is None or (c["scale"], c["sparsity_label"]) in {tuple(x) for x in plan.cells})]
    if not cells:
        raise ValueError(f"Plan: no ladder cell left after scales={plan.scales}, cells={plan.cells}")
    log(f"ladder: {plan.ladder}, FLOPs without the head at the measured document length {ctx:.1f} "
        f"(block {block})")
    for c in cells:
        m = c["match"]
        log(f"ladder {c['scale']} {c['sparsity_label']}: SMELT d_model {c['smelt']['d_model']}, "
            f"{c['smelt']['n_experts']} experts; F {m['flops_ratio']:.3f}  N {m['params_ratio']:.3f}  "
            f"KV {m['kv_ratio']:.3f}" + ("" if m["within_tolerance"] else "  (outside SMELT's tolerances)"))
    write_json(out / "ladder.json", cells)
    return cells


def cell_key(scale: str, label: str) -> str:
    """A file-name-safe id of one grid cell: ("t64", "S~85%") -> "t64_S85", ("t64", "S=0%") -> "t64_S0"."""
    return f"{scale}_{label.replace('~', '').replace('=', '').replace('%', '')}"


@dataclass(frozen=True)
class Run:
    cell: dict
    arch: str        # "baseline" | "smelt"
    seed: int
    dir: Path

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def key(self) -> str:
        return cell_key(self.cell["scale"], self.cell["sparsity_label"])


def run_name(scale: str, label: str, arch: str, seed: int = 0) -> str:
    return f"{cell_key(scale, label)}_{arch}" + (f"_seed{seed}" if seed else "")


def plan_runs(out: Path, ladder: list[dict], plan: Plan | None = None) -> list[Run]:
    """Every run of the plan: each cell's Baseline and SMELT at seed 0, and the repeated cell's at seeds
    1 .. train_seeds-1. Both models of a cell and seed see identical batches (the batch order is a pure
    function of the seed)."""
    runs = []
    for cell in ladder:
        repeat = plan is not None and plan.repeat is not None and \
            (cell["scale"], cell["sparsity_label"]) == tuple(plan.repeat)
        for seed in range(plan.train_seeds if repeat else 1):
            for arch in ("baseline", "smelt"):
                runs.append(Run(cell, arch, seed, out / "runs" / run_name(cell["scale"], cell["sparsity_label"],
                                                                          arch, seed)))
    return runs


def run_dirs(out: Path, ladder: list[dict]) -> list[tuple[dict, str, Path]]:
    """(cell, arch, run dir) of every cell's seed-0 Baseline and SMELT (the matched pairs)."""
    return [(r.cell, r.arch, r.dir) for r in plan_runs(out, ladder)]


def pool_run(fn, jobs_list: list, jobs: int, cost=None, on_done=None) -> list:
    """[fn(j) for j in jobs_list], `jobs` at a time in spawned worker processes (largest `cost` first, so
    the workers finish together), calling on_done(k, job, result) as each finishes. Small models on a
    CPU use one core each far better than two cores share one small matmul, so each worker runs with
    one intra-op thread."""
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
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                             initargs=(os.getpid(),)) as pool:
        futures = {pool.submit(fn, jobs_list[i]): i for i in order}
        for k, f in enumerate(as_completed(futures), 1):
            i = futures[f]
            done[i] = f.result()
            if on_done:
                on_done(k, jobs_list[i], done[i])
    return [done[i] for i in range(len(jobs_list))]


def pool_map(fn, jobs_list: list, jobs: int, cost=None) -> list:
    """pool_run without progress callbacks (kept for scripts)."""
    return pool_run(fn, jobs_list, jobs, cost)


def _worker_init(parent: int) -> None:
    """pool_map's worker setup: one intra-op thread, and die with the parent (a killed reproduce.py must not
    leave workers writing its runs). Linux: PR_SET_PDEATHSIG = SIGKILL via prctl; elsewhere (and as a
    backstop) a daemon thread that exits the worker once its parent pid changes (checked every second)."""
    import signal
    import sys
    import threading
    torch.set_num_threads(1)
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


def _train_one(job: tuple) -> list[dict]:
    """One run: (model config dict, train config dict, data dir, run dir, meta)."""
    import data as data_mod
    import train
    cfg, tc, data_dir, run, meta = job
    return train.train(ModelConfig.from_dict(cfg), train.TrainConfig(**tc), data_mod.TokenData(data_dir), run, meta)


def train_config(plan: Plan, seed: int = 0):
    import train
    return train.TrainConfig(lr=plan.lr, warmup_steps=plan.warmup_steps, stable_steps=plan.stable_steps,
                             branch_steps=list(plan.branch_steps), decay_steps=plan.decay_steps,
                             batch_size=plan.batch_size, block_size=plan.block_size, eval_tokens=plan.eval_tokens,
                             eval_interval=plan.eval_interval, log_interval=max(1, plan.stable_steps // 8),
                             seed=seed)


def run_tokens(plan: Plan) -> int:
    """Tokens one run trains on: the stable phase and every decay branch."""
    return (plan.stable_steps + len(set(plan.branch_steps)) * plan.decay_steps) * plan.batch_size * plan.block_size


def plan_cost(plan: Plan, ladder: list[dict], train_tokens: int | None = None) -> dict:
    """What the plan's training costs, from budget.run_cost: per run and in total (GPU minutes at budget's
    stated MFU on one H200; the CPU figures are measured, see the README)."""
    rows = []
    tokens = run_tokens(plan)
    for r in plan_runs(Path("."), ladder, plan):
        cfg = ModelConfig.from_dict(r.cell[r.arch])
        c = budget.run_cost(cfg, r.cell["ctx_len"], tokens)
        final = (max(plan.branch_steps) + plan.decay_steps) * plan.batch_size * plan.block_size
        rows.append({"run": r.name, **c, "tpp_final": final / (c["F"] / 6),
                     "tokens_per_param_final": final / budget.count_params(cfg)["blocks"]})
    return {"runs": rows, "tokens_per_run": tokens, "train_tokens": train_tokens,
            "epochs_per_run": tokens / train_tokens if train_tokens else None,
            "total_flops": sum(r["flops_with_head"] for r in rows),
            "gpu_minutes": sum(r["gpu_minutes"] for r in rows), "mfu": budget.ASSUMED_MFU,
            "peak_flops": budget.H200_PEAK_FLOPS}


def log_plan_cost(cost: dict) -> None:
    tpp = [r["tpp_final"] for r in cost["runs"]]
    tpn = [r["tokens_per_param_final"] for r in cost["runs"]]
    ep = f" ({cost['epochs_per_run']:.2f} epochs of the training stream)" if cost.get("epochs_per_run") else ""
    log(f"plan: {len(cost['runs'])} runs x {cost['tokens_per_run'] / 1e6:.2f}M tokens{ep}; longest endpoint "
        f"{min(tpp):.3g}-{max(tpp):.3g} tokens per dense-equivalent parameter (TPP), {min(tpn):.3g}-{max(tpn):.3g} "
        f"tokens per total parameter; {cost['total_flops']:.3g} FLOPs in all = {cost['gpu_minutes']:.1f} min on "
        f"one H200 at an assumed {100 * cost['mfu']:.0f} % MFU")


def check_disk(plan: Plan, ladder: list[dict], out: Path, jobs: int) -> dict:
    """Print what training will keep on disk (train.plan_disk_estimate) and refuse, before any training,
    when the free space at `out` (plus what earlier invocations already wrote to out/runs) cannot hold it."""
    import shutil
    import train
    cfgs = [ModelConfig.from_dict(r.cell[r.arch]) for r in plan_runs(out, ladder, plan)]
    est = train.plan_disk_estimate(cfgs, train_config(plan), jobs)
    done = sum(f.stat().st_size for f in (out / "runs").rglob("*") if f.is_file()) if (out / "runs").exists() else 0
    free, fmt = shutil.disk_usage(out).free, train.format_bytes
    need = max(0, est["peak"] - done)
    log(f"disk: the {est['runs']} runs keep {fmt(est['final'])} when finished and up to {fmt(est['peak'])} while "
        f"training ({fmt(done)} already written); {fmt(free)} free at {out}")
    if need > free:
        raise SystemExit(f"reproduce: not enough disk at {out}: training needs up to {fmt(need)} more and "
                         f"{fmt(free)} is free; free space or pass --out-dir on a larger disk")
    return est


def run_time_proxy(cfg: ModelConfig, ctx: float) -> float:
    """A run's relative training time, to start the longest runs first (the workers then finish together)
    and for the ETA: FLOPs per token (head included: the hardware runs it) times 1 + (executed / stored
    layers - 1) / 2. The second factor is the work FLOP counts leave out (norms, residual adds, RoPE, the
    MoE gather and scatter), which grows with layer visits: a tiny SMELT step costs 1.2-1.45x its
    Baseline's at 0.91-0.94x the FLOPs (measured, tiny plan); FLOPs alone started SMELT's runs last and
    left one core idle for the last ~2 minutes of the tiny job."""
    import loop as looping
    attn, _ = looping.executed_visits(cfg.n_layer, cfg.loop)
    return budget.flops_per_token(cfg, ctx, include_head=True) * (1 + (attn / cfg.n_layer - 1) / 2)


def stage_train(plan: Plan, ladder: list[dict], data, out: Path, jobs: int) -> list[dict]:
    runs = plan_runs(out, ladder, plan)
    todo = []
    for r in runs:
        meta = {"arch": r.arch, "scale": r.cell["scale"], "sparsity_label": r.cell["sparsity_label"],
                "seed": r.seed, "run": r.name,
                "control": budget.dense_control(ModelConfig.from_dict(r.cell["baseline"])).to_dict()}
        tc = train_config(plan, r.seed)
        tc.flops_ctx = r.cell["ctx_len"]     # F at the document length the ladder was matched at
        todo.append((r.cell[r.arch], asdict(tc), str(data.dir), r.dir, meta))
    cost = lambda job: run_time_proxy(ModelConfig.from_dict(job[0]), plan.block_size)
    total = sum(cost(j) for j in todo)
    t0, state = time.time(), {"cost": 0.0}
    log(f"train: {len(todo)} runs, {jobs} at a time")

    def on_done(k, job, rows):
        state["cost"] += cost(job)
        el = time.time() - t0
        final = max(rows, key=lambda r: r["D"])
        eta = el * (total - state["cost"]) / max(state["cost"], 1e-9)
        log(f"train: run {k}/{len(todo)} done: {job[3].name} val {final['val_loss']:.3f} | elapsed "
            f"{fmt_time(el)}, training ETA {fmt_time(eta)}")

    rows = [r for run_rows in pool_run(_train_one, todo, jobs, cost, on_done=on_done) for r in run_rows]
    import train
    train.atomic_write_text(out / "results.jsonl", "".join(train.jsonl_line(r) for r in rows))
    return rows


def _eval_one(job: tuple) -> dict:
    """Evaluate one endpoint and cache it as OUT/eval/ID.json: (endpoint path, data dir, plan, cache path, tag)."""
    import data as data_mod
    import eval as ev
    path, data_dir, plan, cache, tag = job
    rec = ev.evaluate_endpoint(path, tasks=plan.tasks, shots=plan.shots, seeds=plan.seeds, max_items=plan.max_items,
                               val_tokens_per_source=plan.eval_tokens, data=data_mod.TokenData(data_dir),
                               log=lambda m: None)
    write_json(Path(cache), rec)
    return rec


def stage_eval(plan: Plan, ladder: list[dict], data, out: Path, jobs: int) -> dict:
    """SMELT 5 on every branch endpoint of every run: validation by source / domain / length, the few-shot
    sweep; then the grid analysis (wins.downstream_report: win counts, Appendix C's above-chance averages
    and one-sided permutation tests over seeds, Section 5.3's three length families, the Eq. 6 calibration
    on every Baseline endpoint, the downstream claims with intervals) and its figures."""
    import eval as ev
    import eval_plots
    import wins
    (out / "eval").mkdir(exist_ok=True)
    eps = [e for r in plan_runs(out, ladder, plan) for e in ev.run_endpoints(r.dir)]
    records, todo = {}, []
    for e in eps:
        key = f"{Path(e['run']).name}@{e['branch_step']}"
        cache = out / "eval" / f"{key.replace('@', '_b')}.json"
        if cache.exists():
            records[key] = json.loads(cache.read_text())
        else:
            todo.append((key, (e["path"], str(data.dir), plan, str(cache), key)))
    t0 = time.time()
    log(f"eval: {len(eps)} endpoints ({len(eps) - len(todo)} done before), {len(todo)} to evaluate, {jobs} at a time")

    def on_done(k, job, rec):
        el = time.time() - t0
        log(f"eval: endpoint {k}/{len(todo)} done: {job[4]} ({rec.get('seconds', 0):.1f} s) | elapsed {fmt_time(el)}, "
            f"ETA {fmt_time(el / k * (len(todo) - k))}")

    res = pool_run(_eval_one, [j for _, j in todo], jobs, lambda j: Path(j[0]).stat().st_size, on_done=on_done)
    for (key, _), rec in zip(todo, res):
        records[key] = rec
    recs = list(records.values())
    report = wins.downstream_report(recs, n_boot=plan.bootstrap * 10, unit="run")
    figs = eval_plots.plot_downstream(report, recs, out / "figures")
    summary = {"report": report, "figures": figs, "n_endpoints": len(recs),
               "runs": {k: {"arch": v["arch"], "scale": v["scale"], "sparsity_label": v["sparsity_label"],
                            "seed": v.get("seed"), "branch_step": v.get("branch_step"),
                            "val_loss": v["val"]["loss"] if v.get("val") else None, "summary": v["summary"]}
                        for k, v in sorted(records.items())}}
    write_json(out / "eval_summary.json", summary)
    return summary


def stage_scaling(plan: Plan, rows: list[dict], out: Path) -> dict:
    import scaling
    try:
        return scaling.analyse(rows, str(out / "scaling"), n_boot=plan.bootstrap, n_jobs=2)
    except (ValueError, RuntimeError) as e:
        log(f"scaling fits failed: {e}")
        return {"error": str(e)}


def stage_probes(plan: Plan, ladder: list[dict], data, out: Path) -> dict:
    """SMELT 6 on every matched pair (probes.probe_pairs), one held-out sample over all domains."""
    import probes
    path = out / "probes.json"
    if path.exists():
        return json.loads(path.read_text())
    runs = plan_runs(out, ladder, plan)
    pairs = [(b.key + (f"_seed{b.seed}" if b.seed else ""), str(b.dir), str(s.dir))
             for b, s in zip(runs[::2], runs[1::2])]            # every matched pair, seed replicates included
    log(f"probes: {len(pairs)} matched pairs, {plan.probe_tokens} held-out tokens over every domain")
    res = probes.probe_pairs(pairs, data, plan.probe_tokens, plan.block_size, log=log)
    largest = cell_key(ladder[-1]["scale"], ladder[-1]["sparsity_label"])   # the per-pair figures: largest cell
    res["figures"] = probes.plot_pairs(res, str(out / "figures" / "probes"), detail=[largest])
    write_json(path, res)
    return res


# ----------------------------------------------------------------------------------------
# Report



def _md_table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _sci(x: float) -> str:
    """1.2e+06 -> '1.2e6' (compact powers for prose)."""
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"


def _iv(d: dict | None, nd: int = 3) -> str:
    """An Interval dict as 'mean [lo, hi]' (or 'mean (no interval)')."""
    if not d:
        return "n/a"
    import stats
    return stats.Interval(**d).fmt(nd)


def _section_summary(plan_name: str, summary: dict) -> list[str]:
    st = ", ".join(f"{k} {v:.1f}" for k, v in summary["stage_minutes"].items())
    return [f"# looped-moe reproduction report: preset `{plan_name}`", "",
            "<!-- summary: the block the README quotes -->",
            f"> **Run summary.** Preset `{plan_name}`, commit `{summary['commit']}`"
            + (" (with uncommitted changes)" if summary["dirty"] else "") + f", {summary['date']}, "
            f"{summary['machine']} ({summary['cpu']}), Python {summary['python']}, torch {summary['torch']}: "
            f"**{summary['minutes']:.1f} minutes** for this invocation (stages, minutes: {st}; stages an earlier "
            f"invocation finished are read back, not redone).", "",
            "Every number below was measured by this pipeline and is read from its JSON files (`ladder.json`, "
            "`results.jsonl`, `training_summary.json`, `eval_summary.json`, `scaling/`, `probes.json`). "
            "A comparison is stated as a paired difference with a 95 % interval; a claim is **reproduced** only "
            "when its whole interval lies on the paper's side, **contradicted** when it lies wholly on the other "
            "side, and **not resolved** otherwise.", ""]


def _section_plan(plan: Plan, ladder: list[dict], rows: list[dict], cost: dict) -> list[str]:
    n_runs = len(cost["runs"])
    params = [budget.count_params(ModelConfig.from_dict(c[a]))["blocks"] for c in ladder for a in ("baseline", "smelt")]
    active = [budget.count_params(ModelConfig.from_dict(c[a]))["active"] for c in ladder for a in ("baseline", "smelt")]
    D = sorted({r["D"] for r in rows})
    L = ["## Plan and scale", "",
         f"{len(ladder)} cells x {{Baseline, SMELT}}, the cell {plan.repeat[0]} {plan.repeat[1]} over "
         f"{plan.train_seeds} training seeds: {n_runs} runs, each {plan.stable_steps} stable steps of "
         f"{plan.batch_size} x {plan.block_size} tokens with decay branches at steps "
         f"{', '.join(map(str, plan.branch_steps))} ({plan.decay_steps} steps each): "
         f"{cost['tokens_per_run'] / 1e6:.2f}M training tokens per run." if plan.repeat else
         f"{len(ladder)} cells x {{Baseline, SMELT}}: {n_runs} runs.",
         "",
         f"Models here hold {_sci(min(params))}-{_sci(max(params))} non-embedding parameters "
         f"({_sci(min(active))}-{_sci(max(active))} active) and their endpoints saw "
         + (f"{_sci(D[0])}-{_sci(D[-1])} tokens" if D else "no tokens")
         + "; the paper's hold 1e8-5e10 parameters and saw 1e10-2e11 tokens. A claim not reproduced here "
         "is not evidence against the paper, and one reproduced here is weak evidence for it.", ""]
    return L


def _section_ladder(ladder: list[dict]) -> list[str]:
    ctx = ladder[0]["ctx_len"] if ladder else float("nan")
    L = ["## Budget-matched ladder (SMELT 3.2)", "",
         f"FLOPs per token without the output head (SMELT's convention) at the measured document length "
         f"{ctx:.1f} tokens; the head-inclusive ratio is reported beside it, not matched on. Tolerances: F 4 %, "
         f"N 1 %, KV 4 % (SMELT Table 3.2).", ""]
    rows = []
    for c in ladder:
        m, b, s = c["match"], c["baseline"], c["smelt"]
        rows.append([c["scale"], c["sparsity_label"], f"{b['d_model']} -> {s['d_model']}",
                     f"{b['n_experts']} -> {s['n_experts']}", f"{m['flops_ratio']:.3f}",
                     f"{m['flops_ratio_other_head']:.3f}", f"{m['params_ratio']:.3f}", f"{m['kv_ratio']:.3f}",
                     "yes" if m["within_tolerance"] else "**no**"])
    return L + _md_table(["scale", "S label", "d_model (Base -> SMELT)", "experts", "F ratio", "F ratio with head",
                          "N ratio", "KV ratio", "within tol."], rows) + [""]


def _section_training(ts: dict, rows: list[dict], ladder: list[dict]) -> list[str]:
    lr = ts["learned"]
    fin = finals(rows)
    order = {cell_key(c["scale"], c["sparsity_label"]): i for i, c in enumerate(ladder)}
    L = ["## Did the models learn?", "",
         f"The training stream's unigram entropy is **{lr['entropy']:.3f} nats**: a model that learned only token "
         f"frequencies sits there. The target is every model at least 1.5 nats below it "
         f"(<= {lr['entropy'] - 1.5:.3f}). Final models (longest branch): the smallest margin is "
         f"**{lr['min_margin_final']:.3f} nats** ({'met' if lr['all_final'] else '**not met**'}); over all "
         f"{lr['endpoints']} branch endpoints, {lr['below']} are 1.5 nats below (smallest margin "
         f"{lr['min_margin']:.3f})."
         + (f" On this validation set (the same tokens every model is scored on) the unigram model fitted on the "
            f"training stream scores {lr['unigram_val_loss']:.3f}." if lr.get("unigram_val_loss") else ""), ""]
    trows = []
    for name, r in sorted(fin.items(), key=lambda kv: (order.get(cell_key(kv[1]["scale"], kv[1]["sparsity_label"]),
                                                                 99), kv[1].get("seed", 0), kv[1]["arch"])):
        trows.append([name, f"{r['D'] / 1e6:.2f}M", f"{r['val_loss']:.3f}", f"{lr['entropy'] - r['val_loss']:.2f}"])
    L += _md_table(["run", "tokens", "final val loss", "below entropy by"], trows) + [""]
    L += ["![learning curves](figures/curves.png)", ""]
    L += ["## SMELT vs its matched Baseline: validation loss (SMELT 4.1)", ""]
    rep = ts.get("repeat")
    if rep:
        L += [f"**Noise first.** The cell {rep['cell']} was trained over {rep['seeds']} seeds (both models of a seed "
              f"see identical batches). SMELT - Baseline final validation loss, paired over seeds: "
              f"**{_iv(rep['diff'], 4)}** nats ({rep['verdict']}); the Baseline's own seed-to-seed sd is "
              + (f"{rep['baseline_seed_sd']:.4f}." if rep.get("baseline_seed_sd") is not None else "n/a."), ""]
    crow = [[c["scale"], c["sparsity_label"], f"{100 * c['S']:.1f} %", f"{c['baseline']:.4f}", f"{c['smelt']:.4f}",
             _iv(c["diff"], 4), c["verdict"]] for c in ts["cells"]]
    L += _md_table(["scale", "S label", "S (Baseline, measured)", "Baseline", "SMELT",
                    "SMELT - Baseline [95 %]", "SMELT lower?"], crow)
    L += ["", "Seed-0 runs per cell; a cell's interval uses the seed-to-seed sd of the paired difference measured "
          "in the repeated cell (one seed per other cell: the interval assumes the same seed noise there).", ""]
    return L


def _claim_rows(ts: dict, scal: dict, prb: dict, ev_sum: dict) -> list[list[str]]:
    rows = []
    c = ts["cells"]
    rows.append(["SMELT has lower validation loss than its matched Baseline in every cell (Sec. 4.1)", "16 / 16",
                 f"{ts['cells_reproduced']} of {len(c)} cells lower, {ts['cells_contradicted']} higher "
                 f"(95 % intervals)", ts["all_cells_verdict"]])
    if ts.get("repeat"):
        r = ts["repeat"]
        rows.append([f"SMELT - Baseline < 0, paired over {r['seeds']} seeds in {r['cell']}",
                     "-0.019 / -0.022 nats at 200M, S~85 / 95 % (Table 3.3, one seed each)", _iv(r["diff"], 4),
                     r["verdict"]])
    rows.append(_ce_gain_claim(scal))
    for c in probe_claims(prb):
        iv = c["interval"].fmt(3) if c["interval"] else "no pair has it"
        tr = f"; over pairs {c['across_pairs'].fmt(3)}" if c.get("across_pairs") else ""
        rows.append([f"{c['what']} {c['direction']} {c['value']:g} ({c['figure']})", c["paper"], iv + tr,
                     c["verdict"]])
    for cl in (ev_sum.get("report") or {}).get("claims", []):
        iv = _iv(cl["interval"], 3) if cl.get("interval") else "no interval"
        rows.append([cl["claim"] + (f" ({cl['n']} {cl['unit']}s)" if cl.get("n") else ""), cl["paper"],
                     iv + (f"; {cl['why']}" if cl.get("why") else ""), cl["verdict"]])
    return rows


def _ce_gain_claim(scal: dict) -> list[str]:
    """CE gain > 0 at budgets inside the data: reproduced when every non-extrapolated cell's bootstrap interval
    is above 0, contradicted when one is wholly below, else not resolved (also: no identified fit)."""
    import stats
    claim, paper = "CE gain of SMELT over Baseline > 0 (Sec. 4.3)", "+6.8 % to +23.5 % (Table 4.3)"
    g = scal.get("gains", {}) if isinstance(scal, dict) else {}
    if "error" in scal or not g.get("available"):
        why = scal.get("error") or "; ".join(g.get("why", [])) or "no gains"
        short = why if len(why) < 160 else why[:157] + "..."
        return [claim, paper, f"no number: {short}", "not resolved"]
    inside = [c for c in g.get("cells", []) if not c.get("extrapolated")]
    if not inside:
        return [claim, paper, "every budget extrapolated (see the scaling tables)", "not resolved"]
    vs = [stats.verdict(stats.Interval(**c["interval"]) if c.get("interval") else None, ">", 0.0) for c in inside]
    text = "; ".join(f"{c['sparsity_label']} at {c['budget']:.2g}: {c['text']}" for c in inside)
    verdict = ("reproduced" if all(v == "reproduced" for v in vs) else
               "contradicted" if "contradicted" in vs else "not resolved")
    return [claim, paper, text, verdict]


def _section_scaling(scal: dict, out: Path) -> list[str]:
    L = ["## Scaling fits and compute-efficiency gain (SMELT 4)", ""]
    if "error" in scal:
        return L + [f"Not available: {scal['error']}", ""]
    fits = scal.get("fits", {})
    ok = [a for a, f in fits.items() if f.get("identified")]
    L += [f"Separate surfaces L(F, S, D) (Eq. 2) per architecture; identified: "
          f"{', '.join(ok) if ok else 'none'} of {', '.join(fits)}. A fit that fails `scaling.identify`'s checks "
          f"prints \"not identified (why)\" and no CE gain, TPP, per-source or quartile number.", ""]
    tables = out / "scaling" / (scal.get("tables_md") or "tables.md")
    if tables.exists():
        L += [re.sub(r"^(#{2,}) ", r"#\1 ", tables.read_text(), flags=re.M), ""]   # nest under this section
    for png in scal.get("figures", []):
        p = Path(png)
        p = p if p.is_absolute() else out / "scaling" / p
        if p.exists():
            L += [f"![{p.stem}]({p.relative_to(out)})", ""]
    return L


def _section_downstream(ev_sum: dict, out: Path) -> list[str]:
    L = ["## Downstream (SMELT 5)", ""]
    rep = ev_sum.get("report")
    if not rep:
        return L + ["Not evaluated (stage skipped).", ""]
    L += [f"Every branch endpoint of every run is evaluated ({rep['n_endpoints']} endpoints, {rep['n_pairs']} matched "
          "Baseline / SMELT endpoint pairs): validation loss by source, domain and document length, and the "
          "few-shot sweep (real BIG-bench tasks and generated tasks reported apart; centred accuracy against "
          "DCLM v2 random baselines; gold-completion loss on the answer tokens).", ""]
    wins = rep.get("wins", {}).get("metrics", {})
    if wins:
        L += ["**Win counts** (matched endpoint pairs where SMELT is better; ties are not wins):", ""]
        L += _md_table(["metric", "SMELT wins", "per cell", "paper"],
                       [[m["what"], f"{m['wins']} / {m['n']}" + (f" ({m['ties']} ties)" if m["ties"] else ""),
                         ", ".join(f"{c} {v['wins']}/{v['n']}" for c, v in m["by_cell"].items()),
                         m["paper"] or "n/a (our generated tasks)"]
                        for m in wins.values()])
        L += [""]
    icl = rep.get("icl", {})
    if icl.get("note"):
        L += [f"**Shot sweep (Appendix C).** {icl['note']}", ""]
    fams = rep.get("families", {})
    if fams:
        L += ["**Gain by document length (SMELT 5.3, Fig. 20a).** Long/short ratio of each family's normalised "
              "loss gain (four longest usable buckets over four shortest), with a bootstrap interval over "
              "contrasts:", ""]
        L += _md_table(["family", "contrasts", "long / short", "paper"],
                       [[name, f['n_contrasts'], _iv(f.get("long_short"), 2) if f.get("long_short") else
                         f"n/a ({f.get('why') or 'no contrast'})", f.get("paper")] for name, f in fams.items()])
        L += [""]
    cal = rep.get("calibration", {})
    if cal.get("error"):
        L += [f"**Calibration (Eq. 6-7):** not identified ({cal['error']}).", ""]
    else:
        for name, c in cal.get("metrics", {}).items():
            if not name.startswith("task/") and not c.get("identified"):
                L += [f"**Calibration of {name} (Eq. 6):** not identified ({c.get('why')}).", ""]
    figs = ev_sum.get("figures", {})
    for name, p in (figs.get("figures") or {}).items():
        if p:
            L += [f"![{name}]({Path(p).relative_to(out)})", ""]
    for note in figs.get("notes", []):
        if not note.startswith("Calibration"):   # said above
            L += [f"- {note}"]
    return L + [""]


def probe_claims(prb: dict) -> list[dict]:
    """probes.claims with a verdict that needs both intervals: held-out sampling (bootstrap over document
    groups, the mean over pairs) and training (a t-interval over the pairs, seed replicates included)."""
    import probes
    import stats
    if not prb.get("pairs"):
        return []
    out = []
    for c in probes.claims(prb):
        v1 = stats.verdict(c["interval"], c["direction"], c["value"])
        v2 = stats.verdict(c.get("across_pairs"), c["direction"], c["value"])
        c["verdict"] = v1 if v1 == v2 else "not resolved"
        out.append(c)
    return out


def _section_probes(prb: dict, out: Path) -> list[str]:
    L = ["## Probes of the second visit (SMELT 6)", ""]
    if not prb.get("pairs"):
        return L + ["Not run (stage skipped).", ""]
    cl = probe_claims(prb)
    L += [f"Every matched pair ({len(prb['pairs'])}, seed replicates included) on one held-out sample of "
          f"{prb['sample']['tokens']} tokens ({prb['sample']['units']} document groups) drawn equally from the "
          f"domains {', '.join(prb['sample']['domains'])}. Each quantity: its mean over pairs "
          "with a bootstrap interval over held-out document groups, and a t-interval over the pairs (the "
          "training noise: seeds and cells). A verdict needs both intervals to agree.", ""]
    rows = []
    for c in cl:
        if c["interval"] is None:
            rows.append([f"{c['what']} ({c['figure']})", "n/a", "n/a", "n/a", c["paper"], c["verdict"]])
            continue
        rows.append([f"{c['what']} ({c['figure']})", c["interval"].fmt(3),
                     c["across_pairs"].fmt(3) if c.get("across_pairs") else "n/a",
                     c["weakest"].fmt(3) if c.get("weakest") else "n/a", c["paper"], c["verdict"]])
    L += _md_table(["quantity", "mean over pairs [held-out interval]", "over pairs [t-interval]", "weakest pair",
                    "paper", "verdict"], rows) + [""]
    for p in prb.get("figures", []):
        p = Path(p)
        if p.exists():
            L += [f"![{p.stem}]({p.relative_to(out)})"]
    return L + [""]


def write_report(plan_name: str, plan: Plan, out: Path, ladder, rows, ev_sum, scal, prb, summary: dict,
                 ts: dict, cost: dict) -> Path:
    L = _section_summary(plan_name, summary)
    L += _section_plan(plan, ladder, rows, cost)
    L += _section_ladder(ladder)
    L += _section_training(ts, rows, ladder)
    L += _section_scaling(scal, out)
    L += _section_downstream(ev_sum, out)
    L += _section_probes(prb, out)
    L += ["## Claims: reproduced, contradicted or not resolved", ""]
    L += _md_table(["paper claim", "paper", "this run (95 % interval)", "verdict"], _claim_rows(ts, scal, prb, ev_sum))
    L += [""]
    path = out / "REPORT.md"
    path.write_text("\n".join(L))
    return path


def budget_machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def read_jsonl(path: Path) -> list[dict]:
    """A run's hashed JSON-lines file (train.read_jsonl: each row checked), or [] when absent."""
    import train
    return train.read_jsonl(path) if path.exists() else []


def plot_curves(out: Path, ladder: list[dict], entropy: float | None = None, plan: Plan | None = None) -> Path:
    """Learning curves from each seed-0 run's metrics.jsonl and results rows: the stable run's train CE
    (mean over each logging window) solid, every decay branch thinner from its fork point, validation loss
    during training dashed, each branch endpoint's validation loss a marker; one panel per cell, one legend."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter
    n = len(ladder)
    cols = min(n, 4)
    rows_ = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(3.6 * cols, 3.0 * rows_ + 0.6), squeeze=False, sharey=True)
    colors = {"baseline": "tab:blue", "smelt": "tab:red"}
    lo, hi = math.inf, -math.inf
    for ax, cell in zip(axes.flat, ladder):
        for r in plan_runs(out, [cell]):
            ms = read_jsonl(r.dir / "metrics.jsonl")
            c = colors[r.arch]
            # a row logged for a validation step between two log intervals averages only a few batches:
            # too noisy to draw as train CE (its validation loss is still drawn)
            full = max((m.get("ce_steps", 1) for m in ms), default=1)
            ms_ce = [m for m in ms if m.get("ce_steps", full) >= full / 4]
            for branch in sorted({m["branch"] for m in ms}, key=lambda b: -1 if b is None else b):
                pts = [(m["tokens"], m.get("ce_mean", m["ce"])) for m in ms_ce if m["branch"] == branch]
                if branch is not None:   # start the branch at its fork point on the stable curve
                    before = [m for m in ms_ce if m["branch"] is None and m["step"] <= branch]
                    fork = [(m["tokens"], m.get("ce_mean", m["ce"])) for m in before[-1:]]
                    pts = fork + pts
                if pts:
                    ax.plot(*zip(*pts), color=c, lw=1.4 if branch is None else 0.9, alpha=1.0 if branch is None
                            else 0.75)
                    lo, hi = min(lo, *(p[1] for p in pts)), max(hi, *(p[1] for p in pts))
            val = [(m["tokens"], m["val_loss"]) for m in ms if m["branch"] is None and "val_loss" in m]
            if val:
                ax.plot(*zip(*val), color=c, ls="--", lw=1.0, marker=".", ms=4)
            ends = [(x["D"], x["val_loss"]) for x in read_jsonl(r.dir / "results.jsonl")]
            if ends:
                ax.plot(*zip(*ends), ls="none", marker="o", ms=5, mfc="white", mec=c, mew=1.3)
                lo = min(lo, *(e[1] for e in ends))
        if entropy is not None:
            ax.axhline(entropy, color="0.45", ls=":", lw=1)
            ax.axhline(entropy - 1.5, color="0.7", ls=":", lw=1)
        ax.set_title(f"{cell['scale']}  {cell['sparsity_label']}", fontsize=9)
        ax.set_xlabel("training tokens (millions)", fontsize=8)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1e6:g}"))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("loss (nats/token)", fontsize=8)
    if math.isfinite(lo):
        top = hi if entropy is None else max(min(hi, entropy + 1.0), entropy + 0.2)
        axes[0, 0].set_ylim(lo - 0.1, top)
    handles = [Line2D([], [], color="tab:blue", lw=1.4, label="Baseline"),
               Line2D([], [], color="tab:red", lw=1.4, label="SMELT"),
               Line2D([], [], color="k", lw=1.4, label="train CE, stable (window mean)"),
               Line2D([], [], color="k", lw=0.9, alpha=0.75, label="train CE, decay branches"),
               Line2D([], [], color="k", ls="--", marker=".", label="validation, stable"),
               Line2D([], [], color="k", ls="none", marker="o", mfc="white", label="validation, branch endpoints")]
    if entropy is not None:
        handles += [Line2D([], [], color="0.45", ls=":", label=f"unigram entropy {entropy:.2f}"),
                    Line2D([], [], color="0.7", ls=":", label="entropy - 1.5 nats")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.09 if rows_ == 1 else 0.05, 1, 1))
    (out / "figures").mkdir(exist_ok=True)
    path = out / "figures" / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finals(rows: list[dict]) -> dict[str, dict]:
    """{run name: its longest branch's results row}."""
    out = {}
    for r in rows:
        name = r.get("run") or run_name(r["scale"], r["sparsity_label"], r["arch"], r.get("seed", 0))
        if name not in out or r["D"] > out[name]["D"]:
            out[name] = r
    return out


def training_summary(plan: Plan, ladder: list[dict], rows: list[dict], entropy: float) -> dict:
    """The training claims, with their noise: did every model learn (each endpoint's validation loss vs the
    corpus's unigram entropy); SMELT - Baseline final validation loss, paired over seeds in the repeated
    cell (t-interval) and per cell at seed 0 with the seed noise measured in the repeated cell."""
    import stats
    fin = finals(rows)
    learned = {"entropy": entropy, "required_margin": 1.5, "endpoints": len(rows),
               "min_margin": min((entropy - r["val_loss"] for r in rows), default=None),
               "min_margin_final": min((entropy - r["val_loss"] for r in fin.values()), default=None),
               "below": sum(entropy - r["val_loss"] >= 1.5 for r in rows)}
    learned["all_final"] = learned["min_margin_final"] is not None and learned["min_margin_final"] >= 1.5
    learned["all_endpoints"] = learned["min_margin"] is not None and learned["min_margin"] >= 1.5
    out = {"learned": learned, "cells": [], "repeat": None}
    noise_sd, noise_n = None, 0
    if plan.repeat:
        key = cell_key(*plan.repeat)
        seeds = sorted({r.get("seed", 0) for r in fin.values() if r["scale"] == plan.repeat[0]
                        and r["sparsity_label"] == plan.repeat[1]})
        pairs = [(fin.get(run_name(*plan.repeat, "baseline", s)), fin.get(run_name(*plan.repeat, "smelt", s)))
                 for s in seeds]
        pairs = [(b, m) for b, m in pairs if b and m]
        if pairs:
            base, smelt = [b["val_loss"] for b, _ in pairs], [m["val_loss"] for _, m in pairs]
            iv = stats.paired_difference(base, smelt)
            d = np.array(smelt) - np.array(base)
            noise_sd, noise_n = (float(d.std(ddof=1)), len(d)) if len(d) > 1 else (None, len(d))
            out["repeat"] = {"cell": key, "seeds": len(pairs), "baseline": base, "smelt": smelt,
                             "diff": iv.to_dict(), "verdict": stats.verdict(iv, "<"),
                             "baseline_seed_sd": float(np.std(base, ddof=1)) if len(base) > 1 else None}
    for cell in ladder:
        b = fin.get(run_name(cell["scale"], cell["sparsity_label"], "baseline"))
        m = fin.get(run_name(cell["scale"], cell["sparsity_label"], "smelt"))
        if not (b and m):
            continue
        d = m["val_loss"] - b["val_loss"]
        if noise_sd is not None:   # one seed: the seed-to-seed sd of the paired difference from the repeated cell
            half = stats.t_quantile(0.975, noise_n - 1) * noise_sd
            iv = stats.Interval(d, d - half, d + half, 1, 0.95, f"seed sd of {noise_n} seeds in the repeated cell")
        else:
            iv = stats.Interval(d, math.nan, math.nan, 1)
        out["cells"].append({"scale": cell["scale"], "sparsity_label": cell["sparsity_label"], "S": b["S"],
                             "S_smelt": m["S"], "baseline": b["val_loss"], "smelt": m["val_loss"],
                             "diff": iv.to_dict(), "verdict": stats.verdict(iv, "<")})
    v = [c["verdict"] for c in out["cells"]]
    out["cells_reproduced"], out["cells_contradicted"] = v.count("reproduced"), v.count("contradicted")
    out["all_cells_verdict"] = ("reproduced" if v and all(x == "reproduced" for x in v) else
                                "contradicted" if "contradicted" in v else "not resolved")
    return out


def run_summary(preset: str, stage_s: dict, wall: float) -> dict:
    """Where and when this report was made: the block the README quotes."""
    import platform
    import subprocess
    import sys
    root = Path(__file__).resolve().parent

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   "")
    except OSError:
        pass
    return {"preset": preset, "commit": git("rev-parse", "--short=12", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": budget_machine(),
            "cpu": cpu or platform.processor(), "python": sys.version.split()[0], "torch": torch.__version__,
            "minutes": round(wall / 60, 2), "stage_minutes": {k: round(v / 60, 2) for k, v in stage_s.items()}}


def build_parser() -> argparse.ArgumentParser:
    ap = cli.parser(__doc__)
    ap.add_argument("--preset", default="tiny", choices=list(PLANS), help="size of the reproduction")
    cli.add_out_dir(ap, "output directory (default: runs/reproduce_PRESET)")
    ap.add_argument("--data-dir", default=None, metavar="DIR",
                    help="read the data from a pack made by `python data.py --preset PRESET --pack DIR` "
                         "(for a machine without network: nothing is downloaded; default: prepare the preset's)")
    ap.add_argument("--jobs", type=cli.positive_int, default=None,
                    help="runs trained at once (default: 2 on a CPU with >= 2 cores, one thread each; 1 on CUDA)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["eval", "scaling", "probes"],
                    help="stages to leave out")
    ap.add_argument("--plan-only", action="store_true",
                    help="print the ladder and what training it costs (tokens, TPP, FLOPs, GPU minutes), then stop")
    return ap


def main(argv=None) -> Path:
    args = build_parser().parse_args(argv)
    plan = PLANS[args.preset]
    if args.data_dir:   # the pack becomes this process's cache root (spawned workers inherit it)
        import data
        data.use_pack(args.data_dir, plan.data)
    out = Path(args.out_dir or f"runs/reproduce_{args.preset}")
    out.mkdir(parents=True, exist_ok=True)
    t0, stage_s = time.time(), {}
    torch.manual_seed(0)
    log(f"reproduce: preset {args.preset} -> {out}")

    def timed(name, fn, *a):
        t = time.time()
        r = fn(*a)
        stage_s[name] = stage_s.get(name, 0.0) + time.time() - t
        return r

    data, _ = timed("data", stage_data, plan)
    ladder = timed("ladder", stage_ladder, plan, data, out)
    cost = plan_cost(plan, ladder, len(data.train))
    log_plan_cost(cost)
    write_json(out / "plan.json", {"preset": args.preset, **asdict(plan), "cost": cost})
    if args.plan_only:
        return out / "plan.json"
    import data as data_mod
    entropy = data_mod.unigram_entropy(data)
    unigram_val = data_mod.unigram_val_loss(data, plan.block_size, plan.eval_tokens)
    log(f"data: unigram entropy of the training stream {entropy:.3f} nats (the target: every model "
        f"<= {entropy - 1.5:.3f}); the unigram model scores {unigram_val:.3f} on the validation set")
    jobs = args.jobs or (1 if torch.cuda.is_available() else min(2, os.cpu_count() or 1))
    check_disk(plan, ladder, out, jobs)
    rows = timed("train", stage_train, plan, ladder, data, out, jobs)
    train_sum = training_summary(plan, ladder, rows, entropy)
    train_sum["learned"]["unigram_val_loss"] = unigram_val
    write_json(out / "training_summary.json", train_sum)
    plot_curves(out, ladder, entropy, plan)
    ev_sum = timed("eval", stage_eval, plan, ladder, data, out, jobs) if "eval" not in args.skip else {}
    scal = timed("scaling", stage_scaling, plan, rows, out) if "scaling" not in args.skip else {"error": "skipped"}
    prb = timed("probes", stage_probes, plan, ladder, data, out) if "probes" not in args.skip else {}
    summary = run_summary(args.preset, stage_s, time.time() - t0)
    write_json(out / "summary.json", summary)
    report = write_report(args.preset, plan, out, ladder, rows, ev_sum, scal, prb, summary, train_sum, cost)
    log(f"done in {(time.time() - t0) / 60:.1f} min: {report}")
    return report


if __name__ == "__main__":
    main()
