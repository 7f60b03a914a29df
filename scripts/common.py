"""Shared plumbing of the experiment scripts: CLI, data, training, tables, JSON, plots.

  * `parser(doc)`    the common CLI: --preset {smoke,tiny,small}, --out-dir, --steps, --seed, --jobs, --threads.
  * `Experiment`     one script run: the preset's plan and data, one sweep point's TrainConfig, preset Baselines,
                     `match`, `budgets`, the run queue (`add`, `train_rows`) and `finish` (results.json + table.md).
  * `pair_runs`, `load_trained`  the (Baseline, looped) runs that downstream.py / probe_runs.py read.
  * How to Loop (the howto_* scripts): `howto_loop`, `howto_flops`, `compute_share_steps`, the no-loop
                     reference curve (`fit_noloop_curve`, `efficiency`), bits per byte and `howto_report`.
  * `format_table`, `plot_lines`, `plot_bars`, `plot_compute_axis`  tables and figures (plots.py).
Every config of a script sees identical batches. Each helper in full: docs/scripts.md. Read first:
reproduce.py (the stages the scripts reuse).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import numpy as np  # noqa: E402

import budget  # noqa: E402
import checks  # noqa: E402
import configs  # noqa: E402
from lab import plots, stats  # noqa: E402
import reproduce  # noqa: E402
import train as trainer  # noqa: E402
from loop import SMELT, LoopConfig, plan as loop_plan  # noqa: E402
from model import ModelConfig  # noqa: E402
from reproduce import log  # noqa: E402


def parser(doc: str, training: bool = True, scale: str | None = None,
           presets: tuple = configs.SCRIPT_PRESETS) -> argparse.ArgumentParser:
    """The arguments every script takes (training=False: no --steps, --seed or --jobs; `scale`: --scale's default)."""
    ap = checks.parser(doc)
    ap.add_argument("--preset", default="tiny", choices=presets,
                    help="smoke: seconds on any CPU; tiny: minutes on 2 CPU cores; small: one GPU"
                         + (" (a medium-length sweep: --preset small --steps N)" if training else ""))
    checks.add_out_dir(ap, "output directory (default: runs/scripts/NAME_PRESET[_sSTEPS])")
    if training:
        ap.add_argument("--steps", type=checks.positive_int, default=None,
                        help="stable training steps per run (default: smoke 30, tiny 40, small 600)")
        ap.add_argument("--seed", type=checks.nonneg_int, default=0, help="initialisation and data-order seed")
        ap.add_argument("--jobs", type=checks.positive_int, default=None,
                        help="runs trained at once, one thread each (default: one per CPU core for tiny, else 1; "
                             "small runs on one CUDA device one at a time)")
    else:
        ap.set_defaults(steps=None, seed=0, jobs=None)
    ap.add_argument("--threads", type=checks.positive_int, default=None,
                    help="torch CPU threads (default: 1 for smoke, whose tiny matmuls only lose to thread "
                         "synchronisation, most of all on a shared CPU; torch's default otherwise)")
    if scale:
        ap.add_argument("--scale", default=None, help=f"preset scale {scale}")
    return ap


class Experiment:
    """One script run: its out dir, plan, data, TrainConfig and jobs (see the module docstring)."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.args, self.t0, self.data, self.queue = name, args, time.time(), None, []
        a = args
        self.plan = configs.PLANS[a.preset]
        self.steps = a.steps or configs.SWEEP_STEPS.get(a.preset, self.plan.stable_steps)   # a plan-only preset: its own
        suffix = f"_s{a.steps}" if a.steps else ""
        self.out = Path(a.out_dir or ROOT / "runs" / "scripts" / f"{self.name}_{a.preset}{suffix}")
        self.out.mkdir(parents=True, exist_ok=True)
        p, frac = self.plan, self.steps / self.plan.stable_steps
        self.tc = trainer.TrainConfig(
            lr=p.lr, warmup_steps=max(1, round(p.warmup_steps * frac)), stable_steps=self.steps,
            decay_steps=max(1, round(p.decay_steps * frac)), batch_size=p.batch_size, block_size=p.block_size,
            eval_tokens=configs.SWEEP_EVAL_TOKENS.get(a.preset, p.eval_tokens), log_interval=max(1, self.steps // 4), seed=a.seed)
        cpus = 1 if torch.cuda.is_available() else reproduce.default_jobs("cpu", os.cpu_count() or 1)
        self.jobs = a.jobs or (cpus if a.preset == "tiny" else 1)
        threads = a.threads or (1 if a.preset == "smoke" else None)
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(a.seed)
        log(f"{self.name}: preset {a.preset} -> {self.out}")

    def load_data(self):
        """The preset's prepared corpus (built on first use; smoke downloads nothing)."""
        if self.data is None:
            self.data, _ = reproduce.stage_data(self.plan)
        return self.data

    @functools.cached_property
    def ctx(self) -> float:
        """The document length matches count FLOPs at (budget.preset_doc_length, as reproduce.stage_ladder)."""
        return budget.preset_doc_length(self.plan.ladder, self.load_data())

    def cells(self) -> list[tuple[str, str, ModelConfig]]:
        vocab = self.load_data().vocab_size
        return [(s, lab, replace(c, vocab_size=vocab, block_size=self.plan.block_size))
                for s, lab, c in budget.preset_baselines(self.plan.ladder)]

    def base(self, scale: str | None = None, label: str | None = None) -> tuple[str, str, ModelConfig]:
        """A preset Baseline: default the deepest scale at S~85 % (the paper's ablation sparsity) or the first label."""
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
        raise checks.UserError(f"no cell ({scale}, {label}) in preset {self.args.preset}: "
                               f"scales {scales}, labels {labels}")

    def dense_base(self, scale: str | None = None) -> ModelConfig:
        """How-to-Loop's dense model: the scale's (default the first) with a dense SwiGLU of width top_k * d_ff."""
        scale = scale or self.cells()[0][0]
        _, _, c = self.base(scale, self.cells()[0][1])
        return replace(c, n_experts=0, d_ff=c.top_k * c.d_ff, loop=howto_loop())

    def match(self, base: ModelConfig, loop, **search) -> tuple[ModelConfig, dict]:
        """budget.match with the ladder's search options (`search` overrides): a script's SMELT is the ladder's."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return budget.match(base, loop, self.ctx, **{**budget.preset_search(self.plan.ladder), **search})

    def budgets(self, cfg: ModelConfig, ref: ModelConfig | None = None) -> dict:
        """Stored / active parameters, FLOPs and KV bytes per token of cfg, and the ratios to ref."""
        c = budget.count_params(cfg)
        out = {"blocks": c["blocks"], "active": c["active"], "flops": budget.flops_per_token(cfg, self.ctx),
               "flops_h2l": howto_flops(cfg, self.plan.block_size),
               "kv_bytes": budget.kv_bytes_per_token(cfg, 2, self.ctx), "d_model": cfg.d_model,
               "n_layer": cfg.n_layer, "n_experts": cfg.n_experts, "d_ff": cfg.d_ff,
               "effective_layers": len(loop_plan(cfg.n_layer, cfg.loop)),
               "residual_scale": bool(cfg.loop.residual_scale and cfg.loop.active)}
        if ref is not None:
            r = self.budgets(ref)
            out.update(flops_ratio=out["flops"] / r["flops"], flops_h2l_ratio=out["flops_h2l"] / r["flops_h2l"],
                       params_ratio=out["blocks"] / r["blocks"], kv_ratio=out["kv_bytes"] / r["kv_bytes"])
        return out

    def curve_tc(self) -> trainer.TrainConfig:
        """The no-loop reference run: decay branches at CURVE_FRACTIONS of the stable phase (the curve's points)."""
        return replace(self.tc, branch_steps=sorted({max(1, round(f * self.steps)) for f in CURVE_FRACTIONS}))

    def compute_tc(self, cfg: ModelConfig, ref: ModelConfig) -> trainer.TrainConfig:
        """How-to-Loop's fixed training compute (compute_share_steps), attention counted at the full context."""
        stable = compute_share_steps(self.steps, self.tc.decay_steps, howto_flops(ref, self.plan.block_size),
                                     howto_flops(cfg, self.plan.block_size))
        return replace(self.tc, stable_steps=stable, branch_steps=[])

    def noloop_run(self, scale: str | None, **row) -> ModelConfig:
        """Queue How-to-Loop's reference first: dense_base(scale) on curve_tc (its branches: the no-loop curve)."""
        base = self.dense_base(scale)
        self.add("no_loop", base, {"arch": "no_loop"}, row, base, self.curve_tc())
        return base

    def add(self, name: str, cfg: ModelConfig, meta: dict, row: dict, ref: ModelConfig,
            tc: trainer.TrainConfig | None = None) -> dict:
        """Queue a run for train_rows; its row is `row`, then cfg's budgets against ref (returned: add to its end)."""
        row.update(self.budgets(cfg, ref))
        self.queue.append(((name, cfg, meta, tc or self.tc), row))
        return row

    def add_matched(self, name: str, cell: tuple[str, str, ModelConfig], loop: LoopConfig | None, row: dict) -> None:
        """Queue cell's Baseline (loop None) or its `match` at `loop`, the row ending with within_tolerance."""
        base = cell[2]
        cfg, rep = (base, {"within_tolerance": True}) if loop is None else self.match(base, loop)
        row = self.add(name, cfg, cell_meta(cell, "baseline" if loop is None else "looped"), row, base)
        row["within_tolerance"] = rep["within_tolerance"]

    def train_rows(self) -> list[dict]:
        """train_all on the queued runs: each run's row, then its numbers."""
        specs, rows = zip(*self.queue)
        return [{**row, **r} for row, r in zip(rows, self.train_all(list(specs)))]

    def train_all(self, specs: list[tuple]) -> list[dict]:
        """Train every (name, config, meta[, TrainConfig]) in OUT/runs/NAME, `jobs` at a time (a finished run is
        not retrained); each run's longest branch's numbers, every branch under "branches"."""
        data = self.load_data()
        jobs = [(spec[1].to_dict(), asdict(spec[3] if len(spec) > 3 else self.tc), str(data.dir),
                 str(self.out / "runs" / spec[0]), {"arch": spec[0], **spec[2]}) for spec in specs]
        t0 = time.time()
        if self.jobs > 1 and len(jobs) > 1:   # reproduce's worker pool, one thread per worker
            log(f"training {len(jobs)} runs, {self.jobs} at a time")
            per_run = reproduce.pool_run(reproduce.train_one, jobs, self.jobs, name=lambda j: j[3])
        else:
            if self.jobs > 1:
                torch.set_num_threads(1)
            per_run = [trainer.train(ModelConfig.from_dict(j[0]), trainer.TrainConfig(**j[1]), data, j[3], j[4])
                       for j in jobs]
        out = []
        for spec, job, rows in zip(specs, jobs, per_run):
            name, last = spec[0], max(rows, key=lambda r: r["D"])
            log(f"{name}: val loss {last['val_loss']:.4f}")
            out.append({"run": name, "run_dir": job[3], "val_loss": last["val_loss"], "tokens": last["D"],
                        "F": last["F"], "S": last["S"], "N": last["N"], "wall_s": last["wall_s"],
                        "val_tokens": last.get("val_tokens"), "stable_steps": job[1]["stable_steps"],
                        "val_loss_by_domain": last["val_loss_by_domain"],
                        "branches": [{"branch_step": r["branch_step"], "tokens": r["D"], "val_loss": r["val_loss"]}
                                     for r in sorted(rows, key=lambda r: r["D"])]})
        log(f"trained {len(jobs)} run(s) in {time.time() - t0:.1f} s")
        return out

    def finish(self, result: dict, columns: list[tuple[str, str, str]], trained: bool = True) -> dict:
        """Write OUT/results.json (with the settings and wall time) and print the rows as a table."""
        head = {"script": self.name, "preset": self.args.preset}
        if trained:
            keys = ("lr", "warmup_steps", "stable_steps", "decay_steps", "batch_size", "block_size", "eval_tokens",
                    "seed")
            head.update(steps=self.steps, train={k: getattr(self.tc, k) for k in keys})
        result = {**head, **result, "wall_s": time.time() - self.t0}
        reproduce.write_json(self.out / "results.json", result)
        table = format_table(result["rows"], columns)
        (self.out / "table.md").write_text(table + "\n")
        print(f"\n{self.name} ({self.args.preset}" + (f", {self.steps} steps per run" if trained else "")
              + f")\n{table}\n")
        log(f"wrote {self.out / 'results.json'} in {result['wall_s']:.1f} s")
        return result


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


def plot_lines(path: Path, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, title: str,
               xlog: bool = False, ylog: bool = False) -> str:
    """One line per series {label: (xs, ys)}; returns the path written."""
    fig, ax = plots.pyplot().subplots(figsize=(5, 3.5))
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
    return plots.save(fig, path, dpi=110)


def plot_bars(path: Path, labels: list[str], values: list[float], ylabel: str, title: str) -> str:
    """A bar per label, y-axis zoomed to the values' range (losses differ in the second decimal)."""
    fig, ax = plots.pyplot().subplots(figsize=(max(4, 0.7 * len(labels) + 1.5), 3.5))
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    lo, hi = min(values), max(values)
    pad = 0.1 * (hi - lo) or 0.01 * abs(hi) or 0.01
    ax.set_ylim(lo - pad, hi + pad)
    ax.set(ylabel=ylabel, title=title)
    return plots.save(fig, path, dpi=110)


def load_trained(run_dir: str | Path, device: str | None = None):
    """(GPT, meta) of a finished run: eval.load_model on the RUN_DIR/ckpt.pt that train.py exports."""
    import eval as ev
    return ev.load_model(run_dir, checks.resolve_device(device))


def add_pair_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", nargs=2, metavar=("BASELINE", "LOOPED"),
                    help="two trained run directories (config.json + checkpoints) to analyse "
                         "(default: train the preset's Baseline and its matched SMELT here)")
    ap.add_argument("--ladder", default=None,
                    help="a scaling_ladder.py / reproduce.py output directory: use its last cell's pair "
                         "(default: see --runs)")


def cell_meta(cell: tuple[str, str, ModelConfig], arch: str) -> dict:
    """The train meta of a run in a preset cell (scale, label, Baseline): the cell and its dense control."""
    scale, label, base = cell
    return {"control": budget.dense_control(base), "scale": scale, "sparsity_label": label, "arch": arch}


def pair_runs(exp: Experiment) -> tuple[Path, Path]:
    """(Baseline, looped) run directories: --runs, --ladder's last cell, or the preset's pair trained here."""
    a = exp.args
    if a.runs:
        for run in a.runs:   # each run's model config, field by field, before any work
            if not (Path(run) / "config.json").is_file():
                raise checks.UserError(f"--runs {run}: no config.json there: give a run directory train.py wrote")
            checks.read_config(Path(run) / "config.json", ModelConfig, "--runs", key="model")
        return Path(a.runs[0]), Path(a.runs[1])
    if a.ladder:
        try:
            ladder = reproduce.read_ladder(a.ladder)
        except (OSError, checks.BadFileError) as e:
            raise checks.UserError(f"--ladder {a.ladder}: {getattr(e, 'strerror', None) or e}") from None
        (_, _, b), (_, _, s) = configs.run_dirs(Path(a.ladder), ladder[-1:])
        return b, s
    cell = exp.base()
    base = cell[2]
    smelt, _ = exp.match(base, SMELT.at(base.n_layer))
    b, s = exp.train_all([(arch, cfg, cell_meta(cell, arch)) for arch, cfg in (("baseline", base), ("smelt", smelt))])
    return Path(b["run_dir"]), Path(s["run_dir"])


# The paper's reported ranges, printed beside what we measure.
PAPER_RMS_RATIO = (10.0, 600.0)        # state RMS / embedding RMS, "roughly 10 to 600 times larger"
PAPER_TOKEN_MULTIPLIER = (1.3, 3.3)    # tokens a no-loop model needs to match two loops (1B)
PAPER_FLOPS_EXTRA_PCT = (6.0, 37.0)    # extra no-loop FLOPs to match two loops on half the tokens (100M-1B)
CURVE_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)   # no-loop decay branches, as fractions of the stable phase
ALPHA_BOUNDS = (0.02, 3.0)             # data exponent search range of the no-loop curve fit


def howto_loop(**fields) -> LoopConfig:
    """A How-to-Loop LoopConfig: residual_scale=False, as the paper has no 1/r scale (SMELT's Eq. 8-9)."""
    if "residual_scale" in fields:
        raise ValueError("howto_loop: residual_scale is fixed to False (How-to-Loop has no 1/r scale)")
    return LoopConfig(residual_scale=False, **fields)


def howto_flops(cfg: ModelConfig, ctx: float) -> float:
    """Training FLOPs per token as How-to-Loop counts them (its Fig. 1), with the head, run once per token."""
    return budget.flops_per_token(cfg, ctx, convention="howtoloop", include_head=True)


def compute_share_steps(stable_steps: int, decay_steps: int, flops_ref: float, flops_run: float) -> int:
    """Stable steps at flops_run per token that spend the compute of stable + decay steps at flops_ref."""
    checks.need_ints("compute_share_steps", stable_steps=stable_steps, decay_steps=decay_steps)
    for name, v in (("flops_ref", flops_ref), ("flops_run", flops_run)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"compute_share_steps: {name} must be a positive number, got {v!r}")
    share = flops_ref / flops_run
    stable = round((stable_steps + decay_steps) * share) - decay_steps
    if stable < 1:
        raise ValueError(f"compute_share_steps: a token share of {share:.3f} of {stable_steps + decay_steps} steps "
                         f"leaves no stable step before the {decay_steps}-step decay; train longer (--steps)")
    return stable


def val_bytes_per_token(data, block_size: int, max_tokens: int) -> dict:
    """UTF-8 bytes per token of exactly the held-out targets the validation loss averages (<|endoftext|>: 0)."""
    tok = data.tokenizer()
    lens = np.array([len(tok.decode_single_token_bytes(i)) for i in range(data.vocab_size)], dtype=np.int64)
    lens[data.eot] = 0
    per: dict[str, list[int]] = {}
    for src in data.sources:
        acc = per.setdefault(data.domains[src], [0, 0])
        for _, tgt, _ in data.val_batches(src, 64, block_size, max_tokens):
            t = tgt[tgt != -1].numpy()
            acc[0] += int(lens[t].sum())
            acc[1] += t.size
    B, N = sum(b for b, _ in per.values()), sum(n for _, n in per.values())
    if B == 0 or N == 0:
        raise ValueError(f"val_bytes_per_token: the validation text holds {N} target tokens and {B} bytes "
                         f"(block_size={block_size}, max_tokens={max_tokens}): nothing to measure")
    return {"bytes_per_token": B / N, "bytes": B, "tokens": N,
            "by_domain": {d: b / n for d, (b, n) in per.items() if n}}


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    """nats/token / ln 2 / (bytes/token) of the same text: total bits / total bytes."""
    if not (math.isfinite(bytes_per_token) and bytes_per_token > 0):
        raise ValueError(f"bits_per_byte: bytes_per_token must be a positive number, got {bytes_per_token!r}")
    if not math.isfinite(nats_per_token):
        raise ValueError(f"bits_per_byte: nats_per_token must be finite, got {nats_per_token!r}")
    return nats_per_token / math.log(2) / bytes_per_token


def fit_noloop_curve(tokens, losses, min_points: int = 4, min_span: float = 2.0,
                     alpha_bounds: tuple[float, float] = ALPHA_BOUNDS) -> dict:
    """L(D) = E + A (D / D_ref)^-alpha (D_ref: the largest D), least squares, E >= 0; unless identified (the
    rules: docs/scripts.md), "why" names the failed rule and no coefficient is returned."""
    D, L = np.asarray(tokens, dtype=float), np.asarray(losses, dtype=float)
    if D.shape != L.shape or D.ndim != 1:
        raise ValueError(f"fit_noloop_curve: tokens and losses must be equal-length 1-D, got {D.shape}, {L.shape}")
    if not (np.isfinite(D).all() and np.isfinite(L).all() and (D > 0).all()):
        raise ValueError("fit_noloop_curve: tokens must be positive and losses finite")
    order = np.argsort(D)
    D, L = D[order], L[order]
    out = {"identified": False, "why": None, "E": None, "A": None, "alpha": None, "n": int(D.size),
           "D_min": float(D.min()) if D.size else None, "D_max": float(D.max()) if D.size else None,
           "D_ref": None, "rmse": None}
    n_distinct = len(np.unique(D))
    rises = [i for i in range(D.size - 1) if not L[i + 1] < L[i]]
    if n_distinct < min_points:
        out["why"] = f"{n_distinct} distinct token counts for 3 coefficients (need >= {min_points})"
    elif D[-1] / D[0] < min_span:
        out["why"] = f"tokens span only x{D[-1] / D[0]:.2f} (need >= x{min_span:g})"
    elif rises:
        i = rises[0]
        out["why"] = (f"non-monotone: loss {L[i]:.4f} at D={D[i]:.3g} -> {L[i + 1]:.4f} at D={D[i + 1]:.3g} "
                      f"({len(rises)} of {D.size - 1} steps do not fall)")
    if out["why"]:
        return out
    ref = float(D[-1])

    def solve(alpha: float) -> tuple[float, float, float]:
        x = (D / ref) ** -alpha
        X = np.stack([np.ones_like(x), x], 1)
        (E, A), *_ = np.linalg.lstsq(X, L, rcond=None)
        if E < 0:                      # the floor is a loss: clip to 0, refit the amplitude
            E, A = 0.0, float(x @ L / (x @ x))
        return float(((E + A * x - L) ** 2).sum()), float(E), float(A)

    lo, hi = alpha_bounds
    grid = np.geomspace(lo, hi, 121)
    k = int(np.argmin([solve(a)[0] for a in grid]))
    from scipy.optimize import minimize_scalar
    res = minimize_scalar(lambda la: solve(math.exp(la))[0], method="bounded",
                          bounds=(math.log(grid[max(k - 1, 0)]), math.log(grid[min(k + 1, grid.size - 1)])))
    alpha = float(math.exp(res.x))
    sse, E, A = solve(alpha)
    out.update(D_ref=ref, rmse=math.sqrt(sse / D.size))
    if not A > 0:
        out["why"] = "amplitude A <= 0: the fitted loss does not fall with tokens"   # no estimate printed
    elif not alpha > 0:
        out["why"] = "data exponent alpha <= 0"
    elif min(math.log(alpha / lo), math.log(hi / alpha)) < 0.02:   # within 2 % (in log) of a bound
        out["why"] = f"data exponent alpha at its search bound [{lo:g}, {hi:g}]"
    else:
        out.update(identified=True, E=E, A=A, alpha=alpha)
    return out


def tokens_to_reach(fit: dict, loss: float) -> tuple[float | None, str | None]:
    """(D, None): the tokens the fitted no-loop curve needs to reach `loss`; else (None, "not identified (why)")."""
    if not fit.get("identified"):
        return None, f"not identified ({fit.get('why')})"
    E, A, alpha, ref = fit["E"], fit["A"], fit["alpha"], fit["D_ref"]
    if not loss > E:
        return None, f"not identified (loss {loss:.4f} at or below the fitted no-loop floor E = {E:.4f})"
    return ref * (A / (loss - E)) ** (1.0 / alpha), None


def efficiency(fit: dict, loss: float, tokens: float, flops_run: float, flops_noloop: float) -> dict:
    """How-to-Loop's tokens and FLOPs multipliers of one looped run against the no-loop curve, and a "note"."""
    D, why = tokens_to_reach(fit, loss)
    if D is None:
        return {"noloop_tokens": None, "tokens_multiplier": None, "flops_multiplier": None,
                "flops_extra_pct": None, "note": why}
    fm = flops_noloop * D / (flops_run * tokens)
    note = None
    if D > fit["D_max"] * (1 + 1e-9):
        note = f"extrapolated: x{D / fit['D_max']:.2f} beyond the longest no-loop run"
    elif D < fit["D_min"] * (1 - 1e-9):
        note = f"extrapolated: x{fit['D_min'] / D:.2f} below the shortest no-loop run"
    return {"noloop_tokens": D, "tokens_multiplier": D / tokens, "flops_multiplier": fm,
            "flops_extra_pct": 100.0 * (fm - 1.0), "note": note}


def range_verdict(iv: stats.Interval, lo: float, hi: float) -> str:
    """The claim "lo < quantity < hi": stats.verdict on both sides."""
    return stats.all_of([stats.verdict(iv, ">", lo), stats.verdict(iv, "<", hi)])


def howto_report(exp: Experiment, rows: list[dict], noloop: dict) -> dict:
    """Add "bpb", "compute", its ratio to noloop's and each looped row's `efficiency` to the rows; returns the
    bytes per token, the no-loop curve (fit and points) and the paper's ranges."""
    bpt = val_bytes_per_token(exp.load_data(), exp.tc.block_size, exp.tc.eval_tokens)
    if noloop.get("val_tokens") not in (None, bpt["tokens"]):
        raise RuntimeError(f"howto_report: the loss was measured on {noloop['val_tokens']} tokens, the bytes on "
                           f"{bpt['tokens']}: not the same held-out text")
    points = noloop["branches"]
    for p in points:
        p["bpb"] = bits_per_byte(p["val_loss"], bpt["bytes_per_token"])
        p["compute"] = noloop["flops_h2l"] * p["tokens"]
    fit = fit_noloop_curve([p["tokens"] for p in points], [p["val_loss"] for p in points])
    if fit["identified"]:
        log(f"no-loop curve: L(D) = {fit['E']:.3f} + {fit['A']:.3f} (D/{fit['D_ref']:.3g})^-{fit['alpha']:.3f} "
            f"over {fit['n']} runs, rmse {fit['rmse']:.4f}")
    else:
        log(f"no-loop curve: not identified ({fit['why']})")
    for r in rows:
        r["bpb"] = bits_per_byte(r["val_loss"], bpt["bytes_per_token"])
        r["compute"] = r["flops_h2l"] * r["tokens"]
        r["compute_ratio"] = r["compute"] / (noloop["flops_h2l"] * noloop["tokens"])
        if r is not noloop and r.get("loops", 1) > 1:
            r.update(efficiency(fit, r["val_loss"], r["tokens"], r["flops_h2l"], noloop["flops_h2l"]))
    paper = {"rms_ratio": PAPER_RMS_RATIO, "tokens_multiplier": PAPER_TOKEN_MULTIPLIER,
             "flops_extra_pct": PAPER_FLOPS_EXTRA_PCT}
    return {"bytes_per_token": bpt, "noloop_curve": {**fit, "points": points}, "paper_ranges": paper}


def plot_compute_axis(path: Path, curve: dict, runs: dict[str, tuple[list, list]], title: str) -> str:
    """Validation loss against training FLOPs: the no-loop points and fit, each looped series {label: (xs, ys)}."""
    fig, ax = plots.pyplot().subplots(figsize=(5.5, 3.8))
    pts = curve["points"]
    ax.plot([p["compute"] for p in pts], [p["val_loss"] for p in pts], "ks", label="no loop (decay branches)")
    if curve["identified"]:
        F0 = pts[0]["compute"] / pts[0]["tokens"]
        xs = np.geomspace(min(p["compute"] for p in pts) / 1.5, max(p["compute"] for p in pts) * 1.5, 64)
        ys = curve["E"] + curve["A"] * (xs / F0 / curve["D_ref"]) ** -curve["alpha"]
        ax.plot(xs, ys, "k--", lw=1, label=f"no-loop fit (alpha {curve['alpha']:.2f})")
    for label, (xs, ys) in runs.items():
        ax.plot(xs, ys, "o", label=label)
    ax.set_xscale("log")
    ax.set(xlabel="training FLOPs (How-to-Loop accounting, head included)", ylabel="validation loss (nats/token)",
           title=title)
    ax.legend(fontsize=6)
    return plots.save(fig, path, dpi=110)
