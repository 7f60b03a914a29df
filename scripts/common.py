"""Shared plumbing of the experiment scripts: CLI, data, training one config, tables, JSON, plots.

Every script in scripts/ is a thin composition of the library modules; what they all need lives
here and nowhere else:

  * `parser(doc)`      the common CLI: --preset {smoke,tiny,small}, --out DIR, --steps N, --seed,
                       --jobs, --threads.
  * `Experiment`       one script run: the preset's plan (reproduce.PLANS: lr, batch, context, warmup),
                       the prepared data (reproduce.stage_data), the training config for one sweep
                       point, and helpers: `base` (a preset Baseline from budget.preset_baselines),
                       `dense_base` (its dense twin, for the How-to-Loop experiments), `match`
                       (budget.match without warning noise), `budgets` (parameters, FLOPs, KV and their
                       ratios to a reference), `train_all` (train.train every config, `jobs` at a time,
                       and return final validation losses), `finish` (results.json + table.md + print).
  * `pair_runs`        the (Baseline, looped) run directories that downstream.py and probe_runs.py
                       analyse: given with --runs, taken from a scaling_ladder / reproduce output
                       with --ladder, or trained here.
  * `load_trained`     a trained GPT from a run directory (eval.load_model).

Training length per sweep point (SWEEP_STEPS) is shorter than reproduce.py's stable phase: a sweep
trains many configs, and each script should take seconds on smoke and a couple of minutes on tiny
(2 CPU cores). Every config of a script sees identical batches (same seed, same step -> same batch).
One decay branch per run, at the end of the stable phase, decaying over the plan's share of steps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import budget  # noqa: E402
import loop as looping  # noqa: E402
import reproduce  # noqa: E402
import train as trainer  # noqa: E402
from model import ModelConfig  # noqa: E402

PRESETS = ("smoke", "tiny", "small")
SWEEP_STEPS = {"smoke": 30, "tiny": 40, "small": 600}          # stable steps of one sweep point
EVAL_TOKENS = {"smoke": 1024, "tiny": 1024, "small": 16384}    # validation tokens per source


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every script takes; scripts add their own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=PRESETS,
                    help="smoke: seconds on any CPU; tiny: minutes on 2 CPU cores; small: one GPU (default tiny)")
    ap.add_argument("--out", default=None, help="output directory (default runs/scripts/NAME_PRESET[_sSTEPS])")
    ap.add_argument("--steps", type=int, default=None,
                    help="stable training steps per run (default: smoke 30, tiny 40, small 600)")
    ap.add_argument("--seed", type=int, default=0, help="initialisation and data-order seed")
    ap.add_argument("--jobs", type=int, default=None,
                    help="runs trained at once, one thread each (default: 2 on a CPU with >= 2 cores for tiny, "
                         "else 1; small runs on one CUDA device one at a time)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 for smoke, whose tiny matmuls only lose to thread "
                         "synchronisation, most of all on a shared CPU; torch's default otherwise)")
    return ap


def log(msg: str) -> None:
    reproduce.log(msg)


@dataclass
class Experiment:
    name: str
    args: argparse.Namespace
    out: Path = field(init=False)
    plan: reproduce.Plan = field(init=False)
    steps: int = field(init=False)
    data: object = field(init=False, default=None)
    tc: trainer.TrainConfig = field(init=False)
    t0: float = field(default_factory=time.time)

    def __post_init__(self):
        a = self.args
        if a.steps is not None and a.steps < 1:
            raise SystemExit(f"--steps must be >= 1, got {a.steps}")
        self.plan = reproduce.PLANS[a.preset]
        self.steps = a.steps or SWEEP_STEPS[a.preset]
        suffix = f"_s{a.steps}" if a.steps else ""
        self.out = Path(a.out or ROOT / "runs" / "scripts" / f"{self.name}_{a.preset}{suffix}")
        self.out.mkdir(parents=True, exist_ok=True)
        p, frac = self.plan, self.steps / self.plan.stable_steps
        self.tc = trainer.TrainConfig(
            lr=p.lr, warmup_steps=max(1, round(p.warmup_steps * frac)), stable_steps=self.steps,
            decay_steps=max(1, round(p.decay_steps * frac)), batch_size=p.batch_size, block_size=p.block_size,
            eval_tokens=EVAL_TOKENS[a.preset], log_interval=max(1, self.steps // 4), seed=a.seed)
        cpus = 1 if torch.cuda.is_available() else min(2, os.cpu_count() or 1)
        self.jobs = a.jobs or (cpus if a.preset == "tiny" else 1)
        threads = a.threads or (1 if a.preset == "smoke" else None)
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(a.seed)
        log(f"{self.name}: preset {a.preset} -> {self.out}")

    # -- data and configs ----------------------------------------------------------------
    def load_data(self):
        """The preset's prepared corpus (built on first use; smoke downloads nothing)."""
        if self.data is None:
            self.data, _ = reproduce.stage_data(self.plan)
        return self.data

    @property
    def ctx(self) -> int:
        """Document length for FLOPs in matching: the training context, as reproduce.stage_ladder uses."""
        return self.plan.block_size

    def cells(self) -> list[tuple[str, str, ModelConfig]]:
        vocab = self.load_data().vocab_size
        return [(s, lab, replace(c, vocab_size=vocab, block_size=self.plan.block_size))
                for s, lab, c in budget.preset_baselines(self.plan.ladder)]

    def base(self, scale: str | None = None, label: str | None = None) -> tuple[str, str, ModelConfig]:
        """A preset Baseline: default the deepest scale (most span/depth points) at S~85 % (the paper's
        ablation sparsity) or the first sparsity label when the preset has no 85 % column."""
        cells = self.cells()
        scales = list(dict.fromkeys(s for s, _, _ in cells))
        labels = list(dict.fromkeys(lab for _, lab, _ in cells))
        if scale is None:
            scale = max(scales, key=lambda s: (next(c.n_layer for t, _, c in cells if t == s), -scales.index(s)))
        if label is None:
            label = next((lab for lab in labels if "85" in lab), labels[0])
        for s, lab, c in cells:
            if s == scale and lab == label:
                return s, lab, c
        raise SystemExit(f"no cell ({scale}, {label}) in preset {self.args.preset}: scales {scales}, labels {labels}")

    def dense_base(self, scale: str | None = None) -> ModelConfig:
        """How-to-Loop's setting: a dense model. The preset scale (default the first, cheapest) with a dense
        SwiGLU of the MoE's active width top_k * d_ff, unlooped."""
        scale = scale or self.cells()[0][0]
        _, _, c = self.base(scale, self.cells()[0][1])
        return replace(c, n_experts=0, d_ff=c.top_k * c.d_ff)

    def match(self, base: ModelConfig, loop, **search) -> tuple[ModelConfig, dict]:
        """budget.match at the training context; the report (not a warning) says when tolerance is missed."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return budget.match(base, loop, self.ctx, **search)

    def budgets(self, cfg: ModelConfig, ref: ModelConfig | None = None) -> dict:
        """Stored / active parameters, FLOPs and KV bytes per token of cfg, and the ratios to ref."""
        c = budget.count_params(cfg)
        out = {"blocks": c["blocks"], "active": c["active"], "flops": budget.flops_per_token(cfg, self.ctx),
               "kv_bytes": budget.kv_bytes_per_token(cfg, 2, self.ctx), "d_model": cfg.d_model,
               "n_layer": cfg.n_layer, "n_experts": cfg.n_experts, "d_ff": cfg.d_ff,
               "effective_layers": len(looping.plan(cfg.n_layer, cfg.loop))}
        if ref is not None:
            r = self.budgets(ref)
            out.update(flops_ratio=out["flops"] / r["flops"], params_ratio=out["blocks"] / r["blocks"],
                       kv_ratio=out["kv_bytes"] / r["kv_bytes"])
        return out

    # -- training ------------------------------------------------------------------------
    def train(self, name: str, cfg: ModelConfig, **meta) -> dict:
        """Train one config; see train_all."""
        return self.train_all([(name, cfg, meta)])[0]

    def train_all(self, specs: list[tuple[str, ModelConfig, dict]]) -> list[dict]:
        """Train every (name, config, meta) (stable phase + one decay branch) in OUT/runs/NAME, `jobs` at a
        time; return each run's final numbers in order. meta goes into train.py's results rows ("arch",
        "scale", "sparsity_label", "control": the ModelConfig S is measured against). A finished run is
        not retrained (train.train returns its rows), so a script can be re-run on the same OUT."""
        data = self.load_data()
        jobs = [(cfg.to_dict(), self.tc, str(data.dir), str(self.out / "runs" / name),
                 {"arch": name, **meta}, 1 if self.jobs > 1 else 0) for name, cfg, meta in specs]
        t0 = time.time()
        if self.jobs > 1 and len(jobs) > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor
            log(f"training {len(jobs)} runs, {self.jobs} at a time")
            with ProcessPoolExecutor(self.jobs, mp_context=mp.get_context("spawn")) as pool:
                per_run = list(pool.map(_train_job, jobs))
        else:
            per_run = [_train_job(job, data) for job in jobs]
        out = []
        for (name, _, _), job, rows in zip(specs, jobs, per_run):
            last = max(rows, key=lambda r: r["D"])
            log(f"{name}: val loss {last['val_loss']:.4f}")
            out.append({"run": name, "run_dir": job[3], "val_loss": last["val_loss"], "tokens": last["D"],
                        "F": last["F"], "S": last["S"], "N": last["N"], "wall_s": last["wall_s"],
                        "val_loss_by_domain": last["val_loss_by_domain"]})
        log(f"trained {len(jobs)} run(s) in {time.time() - t0:.1f} s")
        return out

    # -- output --------------------------------------------------------------------------
    def finish(self, result: dict, columns: list[tuple[str, str, str]], rows_key: str = "rows",
               trained: bool = True) -> dict:
        """Write OUT/results.json (with the settings and wall time) and print the rows as a table."""
        head = {"script": self.name, "preset": self.args.preset}
        if trained:
            keys = ("lr", "warmup_steps", "stable_steps", "decay_steps", "batch_size", "block_size", "eval_tokens",
                    "seed")
            head.update(steps=self.steps, train={k: getattr(self.tc, k) for k in keys})
        result = {**head, **result, "wall_s": time.time() - self.t0}
        reproduce.write_json(self.out / "results.json", result)
        table = format_table(result[rows_key], columns)
        (self.out / "table.md").write_text(table + "\n")
        print(f"\n{self.name} ({self.args.preset}" + (f", {self.steps} steps per run" if trained else "")
              + f")\n{table}\n")
        log(f"wrote {self.out / 'results.json'} in {result['wall_s']:.1f} s")
        return result


def _train_job(job: tuple, data=None) -> list[dict]:
    """One run (in this process or a spawned worker): train.train's results rows."""
    cfg, tc, data_dir, run, meta, threads = job
    if threads:
        torch.set_num_threads(threads)
    if data is None:
        import data as data_mod
        data = data_mod.TokenData(data_dir)
    return trainer.train(ModelConfig.from_dict(cfg), tc, data, run, meta)


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table; columns are (header, key, format spec); missing values print as '-'."""
    def cell(r, key, fmt):
        v = r.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return format(v, fmt) if fmt else str(v)
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, k, f) for _, k, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_lines(path: Path, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, title: str,
               xlog: bool = False, ylog: bool = False) -> str:
    """One line per series {label: (xs, ys)}; returns the path written."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, "o-", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if xlog:
        ax.set_xscale("log", base=2)
    elif all(float(x).is_integer() for xs, _ in series.values() for x in xs):
        from matplotlib.ticker import MaxNLocator
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylog:
        ax.set_yscale("log")
    if len(series) > 1:
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_bars(path: Path, labels: list[str], values: list[float], ylabel: str, title: str) -> str:
    """A bar per label, y-axis zoomed to the values' range (losses differ in the second decimal)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 0.7 * len(labels) + 1.5), 3.5))
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    lo, hi = min(values), max(values)
    pad = 0.1 * (hi - lo) or 0.01 * abs(hi) or 0.01
    ax.set_ylim(lo - pad, hi + pad)
    ax.set(ylabel=ylabel, title=title)
    return _save(fig, path)


def _save(fig, path: Path) -> str:
    plt = _pyplot()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ----------------------------------------------------------------------------------------
# Trained runs: loading, and the (Baseline, looped) pair of the analysis scripts

def load_trained(run_dir: str | Path, device: str | None = None):
    """(GPT, meta) of a finished run: eval.load_model on the RUN_DIR/ckpt.pt that train.py exports."""
    import eval as ev
    return ev.load_model(run_dir, device or ("cuda" if torch.cuda.is_available() else "cpu"))


def add_pair_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", nargs=2, metavar=("BASELINE", "LOOPED"),
                    help="two trained run directories (config.json + checkpoints) to analyse")
    ap.add_argument("--ladder", default=None,
                    help="a scaling_ladder.py / reproduce.py output directory: use its last cell's pair")


def pair_runs(exp: Experiment) -> tuple[Path, Path]:
    """(Baseline, looped) run directories: --runs, --ladder's last cell, or the preset's pair trained here."""
    a = exp.args
    if a.runs:
        return Path(a.runs[0]), Path(a.runs[1])
    if a.ladder:
        ladder = json.loads((Path(a.ladder) / "ladder.json").read_text())
        (_, _, b), (_, _, s) = reproduce.run_dirs(Path(a.ladder), ladder[-1:])
        return b, s
    scale, label, base = exp.base()
    smelt, _ = exp.match(base, budget.smelt_loop(base.n_layer))
    cell = {"scale": scale, "sparsity_label": label, "control": budget.dense_control(base)}
    b, s = exp.train_all([("baseline", base, {**cell, "arch": "baseline"}),
                          ("smelt", smelt, {**cell, "arch": "smelt"})])
    return Path(b["run_dir"]), Path(s["run_dir"])
