"""The main job: the reduced-scale SMELT reproduction, end to end, with a report.

  python reproduce.py [--preset smoke|tiny|small|medium|paper] [--out DIR]

Stages (each reads the JSON the previous one wrote; finished work is skipped on re-run):
  1. data      data.prepare(preset): the offline multi-domain corpus, tokenised and packed.
  2. ladder    budget.preset_baselines + budget.match: the Baseline / SMELT grid (scales x
               sparsities), each SMELT matched to its Baseline on FLOPs, parameters and KV cache
               (SMELT 3.2, Appendix A). Written to ladder.json with the three ratios per cell.
  3. train     train.train for every run: WSD with decay branches (SMELT 3.1); both models of a
               cell see identical token sequences. One results row per branch endpoint.
  4. eval      eval.evaluate_run on each run's final checkpoint: validation loss by source,
               domain and document length; the few-shot shot sweep; calibration (SMELT 5.1, 5.3).
  5. scaling   scaling.analyse: separate loss surfaces per architecture, CE gain and TPP with
               cell-bootstrap intervals, per-domain CE gain (SMELT 4, 5.2).
  6. probes    probes.probe on the largest SMELT run and its Baseline (SMELT 6).
  7. report    REPORT.md: every table and plot, and which of the paper's claims this run
               reproduced, numbers side by side with the paper's.

Presets. smoke: toy sizes, every stage, no download, ~2 minutes (the tests run it). tiny (the
default): the real pipeline on the offline corpus, sized for <= 15 minutes on 2 CPU cores.
small: one GPU, minutes. medium: one GPU, about an hour. paper: the Appendix A grid, for users
with the hardware (days; the configs come from budget.py's reconstruction of Appendix A).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

import budget
from model import ModelConfig


@dataclass
class Plan:
    """Everything a preset decides besides the model ladder (which budget.py owns)."""
    data: str                       # data.prepare preset
    ladder: str                     # budget.preset_baselines preset
    block_size: int
    batch_size: int
    lr: float
    warmup_steps: int
    stable_steps: int
    branch_steps: list[int]
    decay_steps: int
    eval_tokens: int                # validation tokens per source at each branch end
    tasks: tuple = ("generated", "real")
    shots: tuple = (0, 1, 2, 4, 8)
    seeds: int = 3
    max_items: int = 40
    bootstrap: int = 200
    probe_tokens: int = 8192
    scales: int | None = None       # keep only the first N scales of the ladder (None: all)


PLANS = {
    "smoke": Plan(data="smoke", ladder="smoke", block_size=64, batch_size=8, lr=3e-3, warmup_steps=5,
                  stable_steps=30, branch_steps=[10, 20, 30], decay_steps=6, eval_tokens=2048,
                  tasks=("gen_copy", "gen_kv"), shots=(0, 2), seeds=2, max_items=8, bootstrap=20, probe_tokens=1024),
    # tiny leaves out language_identification: 11 options per item made it 60 % of the eval time on CPU;
    # with shared-context scoring it still costs ~15x a generation task per run (3.2 s vs 0.22 s)
    "tiny": Plan(data="tiny", ladder="tiny", block_size=128, batch_size=8, lr=3e-3, warmup_steps=8,
                 stable_steps=64, branch_steps=[16, 32, 64], decay_steps=12, eval_tokens=1024,
                 tasks=("generated", "qa_wikidata", "dyck_languages", "cs_algorithms", "operators",
                        "repeat_copy_logic"), shots=(0, 2, 8), seeds=2, max_items=12, bootstrap=40,
                 probe_tokens=4096),
    "small": Plan(data="small", ladder="small", block_size=1024, batch_size=32, lr=2e-3, warmup_steps=50,
                  stable_steps=600, branch_steps=[150, 300, 600], decay_steps=100, eval_tokens=32768,
                  seeds=5, max_items=100, bootstrap=1000, probe_tokens=32768),
    "medium": Plan(data="small", ladder="small", block_size=1024, batch_size=64, lr=2e-3, warmup_steps=100,
                   stable_steps=4000, branch_steps=[500, 1000, 2000, 4000], decay_steps=400, eval_tokens=65536,
                   shots=(0, 1, 2, 4, 8, 16, 32), seeds=10, max_items=200, bootstrap=2000, probe_tokens=65536),
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


# ----------------------------------------------------------------------------------------
# Stages

def stage_data(plan: Plan):
    import data
    manifest = data.prepare(plan.data)
    d = data.TokenData(data.default_data_dir(plan.data))
    log(f"data: {plan.data} preset, vocab {d.vocab_size}, {len(d.sources)} sources, "
        f"domains {sorted(set(d.domains.values()))}")
    return d, manifest


def stage_ladder(plan: Plan, vocab_size: int, out: Path) -> list[dict]:
    """Baseline and matched SMELT configs per cell, at the data's vocabulary and the plan's context."""
    cells, rows = budget.preset_baselines(plan.ladder), []
    scales = list(dict.fromkeys(s for s, _, _ in cells))[:plan.scales]
    for scale, label, base in cells:
        if scale not in scales:
            continue
        base = replace(base, vocab_size=vocab_size, block_size=plan.block_size)
        smelt, report = budget.match(base, budget.smelt_loop(base.n_layer), plan.block_size)
        rows.append({"scale": scale, "sparsity_label": label, "baseline": base.to_dict(),
                     "smelt": smelt.to_dict(), "match": report})
        log(f"ladder {scale} {label}: SMELT d_model {smelt.d_model}, {smelt.n_experts} experts; "
            f"F {report['flops_ratio']:.3f}  N {report['params_ratio']:.3f}  KV {report['kv_ratio']:.3f}"
            + ("" if report["within_tolerance"] else "  (outside SMELT's tolerances)"))
    write_json(out / "ladder.json", rows)
    return rows


def pool_map(fn, jobs_list: list, jobs: int, cost=None) -> list:
    """[fn(j) for j in jobs_list], `jobs` at a time in spawned worker processes (largest `cost` first,
    so the workers finish together). Small models on a CPU use one core each far better than two
    cores share one small matmul, so each worker runs with one intra-op thread."""
    if jobs <= 1:
        return [fn(j) for j in jobs_list]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    order = sorted(range(len(jobs_list)), key=lambda i: -cost(jobs_list[i]) if cost else 0)
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=torch.set_num_threads,
                             initargs=(1,)) as pool:
        done = dict(zip(order, pool.map(fn, [jobs_list[i] for i in order])))
    return [done[i] for i in range(len(jobs_list))]


def _train_one(job: tuple) -> list[dict]:
    """One run: (model config dict, train config dict, data dir, run dir, meta)."""
    import data as data_mod
    import train
    cfg, tc, data_dir, run, meta = job
    return train.train(ModelConfig.from_dict(cfg), train.TrainConfig(**tc), data_mod.TokenData(data_dir), run, meta)


def stage_train(plan: Plan, ladder: list[dict], data, out: Path, jobs: int) -> list[dict]:
    import train
    tc = train.TrainConfig(lr=plan.lr, warmup_steps=plan.warmup_steps, stable_steps=plan.stable_steps,
                           branch_steps=list(plan.branch_steps), decay_steps=plan.decay_steps,
                           batch_size=plan.batch_size, block_size=plan.block_size, eval_tokens=plan.eval_tokens,
                           log_interval=max(1, plan.stable_steps // 4), seed=0)
    todo = []
    for cell, arch, run in run_dirs(out, ladder):
        meta = {"arch": arch, "scale": cell["scale"], "sparsity_label": cell["sparsity_label"],
                "control": budget.dense_control(ModelConfig.from_dict(cell["baseline"]))}
        todo.append((cell[arch], asdict(tc), str(data.dir), run, meta))
    log(f"train: {len(todo)} runs, {jobs} at a time")
    cost = lambda job: budget.flops_per_token(ModelConfig.from_dict(job[0]), plan.block_size)
    rows = [r for run_rows in pool_map(_train_one, todo, jobs, cost) for r in run_rows]
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, default=float) + "\n")
    return rows


def cell_key(scale: str, label: str) -> str:
    """A file-name-safe id of one grid cell: ("t64", "S~85%") -> "t64_S85"."""
    return f"{scale}_{label.replace('~', '').replace('%', '')}"


def run_dirs(out: Path, ladder: list[dict]) -> list[tuple[dict, str, Path]]:
    return [(cell, arch, out / "runs" / f"{cell_key(cell['scale'], cell['sparsity_label'])}_{arch}")
            for cell in ladder for arch in ("baseline", "smelt")]


def _eval_one(job: tuple) -> dict:
    """Evaluate one run and write RUN_DIR/eval.json: (run dir, cell, arch, data dir, plan)."""
    import data as data_mod
    import eval as ev
    run, cell, arch, data_dir, plan = job
    r = ev.evaluate_run(run, tasks=plan.tasks, shots=plan.shots, seeds=plan.seeds, max_items=plan.max_items,
                        val_tokens_per_source=plan.eval_tokens, data=data_mod.TokenData(data_dir), log=lambda m: None)
    r |= {"arch": arch, "scale": cell["scale"], "sparsity_label": cell["sparsity_label"]}
    write_json(run / "eval.json", r)
    return r


def stage_eval(plan: Plan, ladder: list[dict], data, out: Path, jobs: int) -> dict:
    import eval as ev
    results, todo = {}, []
    for cell, arch, run in run_dirs(out, ladder):
        if (run / "eval.json").exists():
            results[run.name] = json.loads((run / "eval.json").read_text())
        else:
            todo.append((run, cell, arch, str(data.dir), plan))
    log(f"eval: {len(todo)} runs, {jobs} at a time")
    for job, r in zip(todo, pool_map(_eval_one, todo, jobs, lambda j: j[1]["baseline"]["d_model"])):
        results[job[0].name] = r
    results = {run.name: results[run.name] for _, _, run in run_dirs(out, ladder)}
    base = [r for r in results.values() if r["arch"] == "baseline"]
    other = [r for r in results.values() if r["arch"] != "baseline"]
    summary = {"runs": {k: {"arch": v["arch"], "scale": v["scale"], "sparsity_label": v["sparsity_label"],
                            "val_loss": v["val"]["loss"] if v.get("val") else None,
                            "by_length": v["val"]["by_length"] if v.get("val") else None,
                            "summary": v["summary"]} for k, v in results.items()}}
    try:
        summary["calibration"] = ev.calibration_report(base, other)
    except (ValueError, RuntimeError) as e:   # too few baseline endpoints for a 4-parameter fit
        summary["calibration"] = {"error": str(e)}
        log(f"calibration skipped: {e}")
    pairs = {}
    for cell in ladder:
        key = cell_key(cell["scale"], cell["sparsity_label"])
        a, b = results.get(f"{key}_baseline"), results.get(f"{key}_smelt")
        if a and b:
            pairs[key] = ev.compare(a, b)
    summary["pairs"] = pairs
    figs = out / "figures"
    figs.mkdir(exist_ok=True)
    last = ladder[-1]
    key = cell_key(last["scale"], last["sparsity_label"])
    if f"{key}_smelt" in results:
        ev.plot_shot_sweep(results[f"{key}_smelt"], figs / "shot_sweep.png", other=results[f"{key}_baseline"])
    if "error" not in summary["calibration"]:
        ev.plot_calibration(base, other, summary["calibration"], figs / "calibration.png")
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
    import eval as ev
    import probes
    path = out / "probes.json"
    if path.exists():
        return json.loads(path.read_text())
    dirs = run_dirs(out, ladder)
    (_, _, base_dir), (_, _, smelt_dir) = dirs[-2], dirs[-1]
    res = {}
    for name, run in (("baseline", base_dir), ("smelt", smelt_dir)):
        model, _ = ev.load_model(run)
        src = data.sources[0]
        batches = data.val_batches(src, 4, plan.block_size, plan.probe_tokens)
        res[name] = probes.probe(model, batches, plan.probe_tokens)
        res[name]["run"] = str(run)
        if name == "smelt":
            res["dyck"] = probes.dyck_case_study(model, n_seqs=16)
    res["figures"] = probes.plot_probes(res["smelt"], str(out / "figures" / "probes"), baseline=res["baseline"])
    write_json(path, res)
    return res


# ----------------------------------------------------------------------------------------
# Report

# (probe summary key, what it is, the paper's figure for it)
PAPER_PROBES = [
    ("ratio_update", "visit-2 / visit-1 update norm", "1.2-3.5 in all 16 cells (Fig. 23e)"),
    ("ratio_attn_write", "visit-2 / visit-1 attention-write norm", "> 1 in all cells (Fig. 23f)"),
    ("ratio_mlp_write", "visit-2 / visit-1 MoE-write norm", "> 1 in all cells (Fig. 23g)"),
    ("update_cosine_cross_visit", "update cosine, same layer across visits", "0.42-0.65, mean 0.56 (Fig. 24)"),
    ("update_cosine_other", "update cosine, non-matching cross-visit pairs", "mean 0.16 (Fig. 24)"),
    ("cos_X", "cross-visit cosine of X", "0.84-0.93 (Fig. 25)"),
    ("cos_Q", "cross-visit cosine of Q", "0.89-0.93"),
    ("cos_K", "cross-visit cosine of K", "0.89-0.93"),
    ("cos_V", "cross-visit cosine of V", "0.65-0.74"),
    ("cos_PV", "cross-visit cosine of PV", "0.56-0.69"),
    ("cos_O", "cross-visit cosine of O", "0.49-0.64"),
    ("attn_top8", "top-8 attended-token overlap", "0.56-0.66 (Fig. 26)"),
    ("attn_top8_control", "top-8 overlap, different-head control", "0.28-0.34"),
    ("expert_overlap_frac", "expert-set overlap / k", "~1 at S=0, 2-3 of 8 at S~97% (Fig. 21)"),
]


def _fmt(x, nd=4):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def write_report(plan_name: str, plan: Plan, out: Path, ladder, rows, ev_sum, scal, prb, wall: float) -> Path:
    L = [f"# looped-moe reproduction report: preset `{plan_name}`", "",
         f"This invocation took {wall / 60:.1f} min on {budget_machine()} (stages finished by an earlier "
         f"invocation are read back, not redone). Every number below was measured by this pipeline; "
         f"see `results.jsonl`, `ladder.json`, `eval_summary.json`, `scaling/`, `probes.json`.", ""]
    L += ["## Budget-matched ladder (SMELT 3.2)", "",
          "| scale | S label | SMELT d_model | experts (Base -> SMELT) | F ratio | N ratio | KV ratio | within tol. |",
          "|---|---|---|---|---|---|---|---|"]
    for c in ladder:
        m = c["match"]
        L.append(f"| {c['scale']} | {c['sparsity_label']} | {c['smelt']['d_model']} | {c['baseline']['n_experts']} -> "
                 f"{c['smelt']['n_experts']} | {m['flops_ratio']:.3f} | {m['params_ratio']:.3f} | {m['kv_ratio']:.3f} | "
                 f"{'yes' if m['within_tolerance'] else 'no'} |")
    L += ["", "## Final validation loss per cell (longest decay branch)", "",
          "| scale | S label | S (measured) | Baseline | SMELT | SMELT - Baseline |", "|---|---|---|---|---|---|"]
    wins = 0
    finals = {}
    for r in rows:
        key = (r["scale"], r["sparsity_label"], r["arch"])
        if key not in finals or r["D"] > finals[key]["D"]:
            finals[key] = r
    cells = sorted({(s, l) for s, l, _ in finals})
    for s, l in cells:
        b, m = finals.get((s, l, "baseline")), finals.get((s, l, "smelt"))
        if b and m:
            d = m["val_loss"] - b["val_loss"]
            wins += d < 0
            L.append(f"| {s} | {l} | {b['S']:.3f} | {b['val_loss']:.4f} | {m['val_loss']:.4f} | {d:+.4f} |")
    L += ["", "![training curves](figures/curves.png)", ""]
    if "error" not in scal:
        cs = [r["C"] for r in rows]
        at_bound = [f"{arch}.{k}" for arch, co in scal.get("fits", {}).items() for k in ("a", "c")
                    if isinstance(co, dict) and (co.get(k, 1) <= 1e-6 or co.get(k, 0) >= 4 - 1e-6)]
        L += ["## Scaling fits and compute-efficiency gain (SMELT 4)", "",
              f"The runs span C = {min(cs):.2e} to {max(cs):.2e} FLOPs ({max(cs) / min(cs):.0f}x; the paper's grid "
              f"spans about 1000x)." + (f" Exponents at a bound of the fit: {', '.join(at_bound)}." if at_bound else "")
              + (" With so narrow a range the six-coefficient surfaces are poorly identified: the CE gains below "
                 "are what the fits give, not evidence either way." if max(cs) / min(cs) < 100 or at_bound else ""),
              "",
              (out / "scaling" / "tables.md").read_text() if (out / "scaling" / "tables.md").exists() else "", "",
              "![loss vs compute](scaling/loss_vs_compute.png)", "", "![CE gain](scaling/ce_gain.png)", ""]
    else:
        L += ["## Scaling fits", "", f"Not available: {scal['error']}", ""]
    L += ["## Downstream (SMELT 5)", ""]
    if ev_sum.get("runs"):
        groups = sorted({g for v in ev_sum["runs"].values() for g in v["summary"]})
        L += ["Centred accuracy (%, mean over tasks at each task's standard k; DCLM v2 random baselines) and "
              "gold-completion loss (nats/token), real BIG-bench tasks and generated tasks reported separately.", "",
              "| run | val loss | " + " | ".join(f"{g} core | {g} completion" for g in groups) + " |",
              "|---|---|" + "---|---|" * len(groups)]
        for k, v in ev_sum["runs"].items():
            cols = []
            for g in groups:
                s_ = v["summary"].get(g, {})
                cols += [_fmt(None if s_.get("core") is None else 100 * s_["core"], 2), _fmt(s_.get("completion"), 3)]
            L.append(f"| {k} | {_fmt(v['val_loss'])} | " + " | ".join(cols) + " |")
        L += ["", "![shot sweep](figures/shot_sweep.png)", ""]
        cal = ev_sum.get("calibration", {})
        if "error" in cal:
            L += [f"Calibration (SMELT Eq. 6-7): not available ({cal['error']}).", ""]
        else:
            L += ["Calibration (SMELT Eq. 6-7): residual of each SMELT run against the sigmoid fitted on Baseline "
                  "endpoints (positive = better than its validation loss predicts); full table in "
                  "`eval_summary.json`.", "", "![calibration](figures/calibration.png)", ""]
    L += ["## Probes of the second visit (SMELT 6)", ""]
    sp = prb.get("smelt", {})
    summ = sp.get("summary", {})
    sink = {}
    for v in sp.get("per_visit", {}).values():
        if v["layer"] in sp.get("looped_layers", []) and v.get("sink_mass") is not None:
            sink.setdefault(v["visit"], []).append(v["sink_mass"])
    sink = {k: sum(x) / len(x) for k, x in sink.items()}
    overlaps = [c["expert_overlap"] for c in sp.get("cross_visit", {}).values() if c.get("expert_overlap")]
    ov = sum(o["mean"] for o in overlaps) / len(overlaps) if overlaps else None
    rnd = sum(o["random_mean"] for o in overlaps) / len(overlaps) if overlaps else None
    if summ:
        L += [f"Measured on {sp.get('tokens')} held-out tokens of the largest SMELT run.", "",
              "| quantity | this run | paper (1.6B-54B models) |", "|---|---|---|"]
        L += [f"| {what} | {_fmt(summ.get(key), 3)} | {paper} |" for key, what, paper in PAPER_PROBES]
        if ov is not None:
            L.append(f"| expert overlap (count of top-k shared) | {ov:.2f} of {overlaps[0]['k']} "
                     f"(random {rnd:.2f}) | far above random (Fig. 21) |")
        if len(sink) >= 2:
            L.append(f"| attention-sink mass in the span, visit 1 -> visit 2 | {sink[0]:.3f} -> {sink[1]:.3f} | "
                     f"visit 2 below visit 1 (Fig. 30) |")
        L += ["", *[f"![{Path(p).stem}]({Path(p).relative_to(out)})" for p in prb.get("figures", [])], ""]
    L += ["## Claims: reproduced or not", "", "| paper claim | paper | this run | reproduced? |", "|---|---|---|---|"]
    yes = lambda ok: "n/a" if ok is None else ("yes" if ok else "no")
    n_cells = len(cells)
    L.append(f"| SMELT has lower validation loss than its matched Baseline in every cell | 16 / 16 (Sec. 4.1) | "
             f"{wins} / {n_cells} | {yes(wins == n_cells if n_cells else None)} |")
    gain = scal.get("ce_gain") if isinstance(scal, dict) else None
    if gain:
        c_max = max(r["C"] for r in rows)
        inside = [g for b, row in zip(scal["budgets"], gain) if b <= c_max for g in row]
        L.append(f"| CE gain of SMELT over Baseline is positive (at budgets inside the data) | +7.8 % to +23.5 % "
                 f"(Table 4.3) | {100 * min(inside):+.1f} % to {100 * max(inside):+.1f} % | {yes(min(inside) > 0)} |")
    else:
        L.append("| CE gain of SMELT over Baseline is positive | +7.8 % to +23.5 % (Table 4.3) | fit unavailable | n/a |")
    r = summ.get("ratio_update")
    L.append(f"| visit 2 writes a larger update than visit 1 | 1.2-3.5x (Sec. 6.2) | {_fmt(r, 2)}x | "
             f"{yes(None if r is None else r > 1)} |")
    L.append(f"| the visits share experts far above random routing | yes (Sec. 6.1) | {_fmt(ov, 2)} vs {_fmt(rnd, 2)} | "
             f"{yes(None if ov is None else ov > 2 * rnd)} |")
    t8, t8c = summ.get("attn_top8"), summ.get("attn_top8_control")
    L.append(f"| the visits attend to the same tokens (top-8 overlap above the other-head control) | 0.56-0.66 vs "
             f"0.28-0.34 (Sec. 6.3) | {_fmt(t8, 2)} vs {_fmt(t8c, 2)} | {yes(None if t8 is None else t8 > t8c)} |")
    qk, v_ = summ.get("cos_Q"), summ.get("cos_V")
    L.append(f"| Q stays closer across visits than V | 0.89-0.93 vs 0.65-0.74 (Sec. 6.3) | {_fmt(qk, 2)} vs "
             f"{_fmt(v_, 2)} | {yes(None if qk is None else qk > v_)} |")
    if len(sink) >= 2:
        L.append(f"| the attention sink shrinks on visit 2 | yes (Sec. 6.4) | {sink[0]:.3f} -> {sink[1]:.3f} | "
                 f"{yes(sink[1] < sink[0])} |")
    L += ["", "Scale caveat: these are models of 10^5-10^7 parameters trained on 10^5-10^7 tokens; the paper's "
          "are 10^8-10^10 parameters on 10^11 tokens. A claim not reproduced here is not evidence against the "
          "paper, and one reproduced here is weak evidence for it.", ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(L))
    return path


def budget_machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def plot_curves(out: Path, ladder: list[dict]) -> None:
    import matplotlib.pyplot as plt
    n = len(ladder)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3), squeeze=False)
    for ax, (cell) in zip(axes[0], ladder):
        for arch, color in (("baseline", "tab:blue"), ("smelt", "tab:red")):
            run = [d for c, a, d in run_dirs(out, [cell]) if a == arch][0]
            f = run / "metrics.jsonl"
            if not f.exists():
                continue
            ms = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            for branch in sorted({m["branch"] for m in ms}, key=lambda b: -1 if b is None else b):
                pts = [(m["tokens"], m["ce"]) for m in ms if m["branch"] == branch]
                if pts:   # the stable run solid, its decay branches thinner
                    ax.plot(*zip(*pts), color=color, alpha=1.0 if branch is None else 0.6,
                            lw=1.2 if branch is None else 0.8, label=arch if branch is None else None)
        ax.set_title(f"{cell['scale']} {cell['sparsity_label']}", fontsize=9)
        ax.set_xlabel("tokens")
        ax.set_ylabel("train CE")
        ax.legend(fontsize=7)
    fig.tight_layout()
    (out / "figures").mkdir(exist_ok=True)
    fig.savefig(out / "figures" / "curves.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PLANS), help="size of the reproduction (default tiny)")
    ap.add_argument("--out", default=None, help="output directory (default runs/reproduce_PRESET)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="runs trained at once (default: 2 on a CPU with >= 2 cores, one thread each; 1 on CUDA)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["eval", "scaling", "probes"],
                    help="stages to leave out")
    ap.add_argument("--data-dir", default=None, metavar="DIR",
                    help="read the data from a pack made by `python data.py --preset PRESET --pack DIR` "
                         "(for a machine without network: nothing is downloaded)")
    args = ap.parse_args(argv)
    plan = PLANS[args.preset]
    if args.data_dir:   # the pack becomes this process's cache root (spawned workers inherit it)
        import data
        data.use_pack(args.data_dir, plan.data)
    out = Path(args.out or f"runs/reproduce_{args.preset}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch.manual_seed(0)
    log(f"reproduce: preset {args.preset} -> {out}")
    write_json(out / "plan.json", {"preset": args.preset, **asdict(plan)})
    data, _ = stage_data(plan)
    ladder = stage_ladder(plan, data.vocab_size, out)
    jobs = args.jobs or (1 if torch.cuda.is_available() else min(2, os.cpu_count() or 1))
    rows = stage_train(plan, ladder, data, out, jobs)
    plot_curves(out, ladder)
    ev_sum = stage_eval(plan, ladder, data, out, jobs) if "eval" not in args.skip else {}
    scal = stage_scaling(plan, rows, out) if "scaling" not in args.skip else {"error": "skipped"}
    prb = stage_probes(plan, ladder, data, out) if "probes" not in args.skip else {}
    report = write_report(args.preset, plan, out, ladder, rows, ev_sum, scal, prb, time.time() - t0)
    log(f"done in {(time.time() - t0) / 60:.1f} min: {report}")
    return report


if __name__ == "__main__":
    main()
