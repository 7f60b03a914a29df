"""Shared plumbing of the experiment scripts: CLI, data, training one config, tables, JSON, plots.

Every script in scripts/ is a thin composition of the library modules; what they all need lives
here and nowhere else:
  * `parser(doc)`    the common CLI (checks.py): --preset {smoke,tiny,small}, --out-dir, --steps, --seed,
                     --jobs, --threads; sizes from configs.SCRIPT_PRESETS / SWEEP_STEPS / SWEEP_EVAL_TOKENS.
  * `Experiment`     one script run: the preset's plan (configs.PLANS), its data, the TrainConfig of
                     one sweep point, preset Baselines (`base`, `dense_base`), `match`, `budgets`,
                     `train_all` (`jobs` at a time) and `finish` (results.json + table.md + print).
  * `pair_runs`, `load_trained`  the (Baseline, looped) runs that downstream.py / probe_runs.py read.
  * How to Loop (the howto_* scripts): `howto_loop` (no 1/r residual scale), `howto_flops` (its FLOP
                     accounting, head included), the fixed-compute plan (`compute_share_steps`), the
                     no-loop reference curve (`fit_noloop_curve`, `tokens_to_reach`, `efficiency`), bits
                     per byte (`val_bytes_per_token`, `bits_per_byte`) and `howto_report`.
  * `format_table`, `plot_lines`, `plot_bars`, `plot_compute_axis`  tables and figures (plots.py).
A sweep point trains SWEEP_STEPS stable steps (shorter than reproduce.py's stable phase) with one
decay branch at its end; every config of a script sees identical batches (same seed and step).
Why the sizes are what they are, and each helper in full: docs/scripts.md. Read first: reproduce.py
(the stages the scripts reuse) and the script of the experiment you care about.
"""
from __future__ import annotations

import argparse
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

import numpy as np  # noqa: E402

import budget  # noqa: E402
import checks  # noqa: E402
import configs  # noqa: E402
import loop as looping  # noqa: E402
from lab import plots  # noqa: E402
import reproduce  # noqa: E402
from lab import stats  # noqa: E402
import train as trainer  # noqa: E402
from loop import LoopConfig  # noqa: E402
from model import ModelConfig  # noqa: E402

def parser(doc: str, training: bool = True) -> argparse.ArgumentParser:
    """The arguments every script takes; scripts add their own. training=False leaves out the flags
    that only mean something to a script that trains (--steps, --seed, --jobs)."""
    ap = checks.parser(doc)
    ap.add_argument("--preset", default="tiny", choices=configs.SCRIPT_PRESETS,
                    help="smoke: seconds on any CPU; tiny: minutes on 2 CPU cores; small: one GPU"
                         + (" (a medium-length sweep: --preset small --steps N)" if training else ""))
    checks.add_out_dir(ap, "output directory (default: runs/scripts/NAME_PRESET[_sSTEPS])")
    if training:
        ap.add_argument("--steps", type=checks.positive_int, default=None,
                        help="stable training steps per run (default: smoke 30, tiny 40, small 600)")
        ap.add_argument("--seed", type=checks.nonneg_int, default=0, help="initialisation and data-order seed")
        ap.add_argument("--jobs", type=checks.positive_int, default=None,
                        help="runs trained at once, one thread each (default: 2 on a CPU with >= 2 cores for tiny, "
                             "else 1; small runs on one CUDA device one at a time)")
    else:
        ap.set_defaults(steps=None, seed=0, jobs=None)
    ap.add_argument("--threads", type=checks.positive_int, default=None,
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
    plan: configs.Plan = field(init=False)
    steps: int = field(init=False)
    data: object = field(init=False, default=None)
    tc: trainer.TrainConfig = field(init=False)
    t0: float = field(default_factory=time.time)

    def __post_init__(self):
        a = self.args
        if a.steps is not None and a.steps < 1:
            raise checks.UserError(f"--steps must be >= 1, got {a.steps}")
        self.plan = configs.PLANS[a.preset]
        self.steps = a.steps or configs.SWEEP_STEPS[a.preset]
        suffix = f"_s{a.steps}" if a.steps else ""
        self.out = Path(a.out_dir or ROOT / "runs" / "scripts" / f"{self.name}_{a.preset}{suffix}")
        self.out.mkdir(parents=True, exist_ok=True)
        p, frac = self.plan, self.steps / self.plan.stable_steps
        self.tc = trainer.TrainConfig(
            lr=p.lr, warmup_steps=max(1, round(p.warmup_steps * frac)), stable_steps=self.steps,
            decay_steps=max(1, round(p.decay_steps * frac)), batch_size=p.batch_size, block_size=p.block_size,
            eval_tokens=configs.SWEEP_EVAL_TOKENS[a.preset], log_interval=max(1, self.steps // 4), seed=a.seed)
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
    def ctx(self) -> float:
        """Document length for SMELT FLOPs in matching: the measured document length of the prepared data
        at the plan's context (budget.preset_doc_length), as reproduce.stage_ladder uses."""
        if getattr(self, "_ctx", None) is None:
            self._ctx = budget.preset_doc_length(self.plan.ladder, self.load_data())
        return self._ctx

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
        raise checks.UserError(f"no cell ({scale}, {label}) in preset {self.args.preset}: scales {scales}, labels {labels}")

    def dense_base(self, scale: str | None = None) -> ModelConfig:
        """How-to-Loop's setting: a dense model. The preset scale (default the first, cheapest) with a dense
        SwiGLU of the MoE's active width top_k * d_ff, unlooped (its LoopConfig is `howto_loop()`: no
        1/r residual scale, so every config derived from it with replace(loop=...) starts from the same)."""
        scale = scale or self.cells()[0][0]
        _, _, c = self.base(scale, self.cells()[0][1])
        return replace(c, n_experts=0, d_ff=c.top_k * c.d_ff, loop=howto_loop())

    def match(self, base: ModelConfig, loop, **search) -> tuple[ModelConfig, dict]:
        """budget.match at the training context with the preset ladder's search options (budget.preset_search;
        `search` adds or overrides), so a script's SMELT is the ladder's; the report (not a warning) says
        when tolerance is missed."""
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
               "effective_layers": len(looping.plan(cfg.n_layer, cfg.loop)),
               "residual_scale": bool(cfg.loop.residual_scale and cfg.loop.active)}
        if ref is not None:
            r = self.budgets(ref)
            out.update(flops_ratio=out["flops"] / r["flops"], flops_h2l_ratio=out["flops_h2l"] / r["flops_h2l"],
                       params_ratio=out["blocks"] / r["blocks"], kv_ratio=out["kv_bytes"] / r["kv_bytes"])
        return out

    # -- How-to-Loop training plans ------------------------------------------------------
    def curve_tc(self) -> trainer.TrainConfig:
        """The no-loop reference run's TrainConfig: decay branches at CURVE_FRACTIONS of the stable phase, so
        one run gives the (tokens, loss) points of the fitted no-loop curve; its last branch is the plain run."""
        return replace(self.tc, branch_steps=curve_branches(self.steps))

    def compute_tc(self, cfg: ModelConfig, ref: ModelConfig) -> trainer.TrainConfig:
        """How-to-Loop's fixed training compute: cfg (same model, looped) trained on the token share
        howto_flops(ref) / howto_flops(cfg) of ref's run (compute_share_steps), decay branch unchanged."""
        # How-to-Loop counts attention at the full context (its convention), not at the document length
        stable = compute_share_steps(self.steps, self.tc.decay_steps, howto_flops(ref, self.plan.block_size),
                                     howto_flops(cfg, self.plan.block_size))
        return replace(self.tc, stable_steps=stable, branch_steps=[])

    # -- training ------------------------------------------------------------------------
    def train(self, name: str, cfg: ModelConfig, **meta) -> dict:
        """Train one config; see train_all."""
        return self.train_all([(name, cfg, meta)])[0]

    def train_all(self, specs: list[tuple]) -> list[dict]:
        """Train every (name, config, meta[, TrainConfig]) (stable phase + its decay branches; default the
        script's TrainConfig: one branch) in OUT/runs/NAME, `jobs` at a time; return each run's final numbers
        (its longest branch) in order, with every branch's (tokens, loss) under "branches". meta goes into
        train.py's results rows ("arch", "scale", "sparsity_label", "control": the ModelConfig S is measured
        against). A finished run is not retrained (train.train returns its rows), so a script can be re-run
        on the same OUT."""
        data = self.load_data()
        jobs = [(spec[1].to_dict(), spec[3] if len(spec) > 3 else self.tc, str(data.dir),
                 str(self.out / "runs" / spec[0]), {"arch": spec[0], **spec[2]}, 1 if self.jobs > 1 else 0)
                for spec in specs]
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
        for spec, job, rows in zip(specs, jobs, per_run):
            name, last = spec[0], max(rows, key=lambda r: r["D"])
            log(f"{name}: val loss {last['val_loss']:.4f}")
            out.append({"run": name, "run_dir": job[3], "val_loss": last["val_loss"], "tokens": last["D"],
                        "F": last["F"], "S": last["S"], "N": last["N"], "wall_s": last["wall_s"],
                        "val_tokens": last.get("val_tokens"), "stable_steps": job[1].stable_steps,
                        "val_loss_by_domain": last["val_loss_by_domain"],
                        "branches": [{"branch_step": r["branch_step"], "tokens": r["D"], "val_loss": r["val_loss"]}
                                     for r in sorted(rows, key=lambda r: r["D"])]})
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


def plot_lines(path: Path, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str, title: str,
               xlog: bool = False, ylog: bool = False) -> str:
    """One line per series {label: (xs, ys)}; returns the path written."""
    plt = plots.pyplot()
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
    return plots.save(fig, path, dpi=110)


def plot_bars(path: Path, labels: list[str], values: list[float], ylabel: str, title: str) -> str:
    """A bar per label, y-axis zoomed to the values' range (losses differ in the second decimal)."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 0.7 * len(labels) + 1.5), 3.5))
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    lo, hi = min(values), max(values)
    pad = 0.1 * (hi - lo) or 0.01 * abs(hi) or 0.01
    ax.set_ylim(lo - pad, hi + pad)
    ax.set(ylabel=ylabel, title=title)
    return plots.save(fig, path, dpi=110)


# ----------------------------------------------------------------------------------------
# Trained runs: loading, and the (Baseline, looped) pair of the analysis scripts

def load_trained(run_dir: str | Path, device: str | None = None):
    """(GPT, meta) of a finished run: eval.load_model on the RUN_DIR/ckpt.pt that train.py exports."""
    import eval as ev
    return ev.load_model(run_dir, device or ("cuda" if torch.cuda.is_available() else "cpu"))


def add_pair_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", nargs=2, metavar=("BASELINE", "LOOPED"),
                    help="two trained run directories (config.json + checkpoints) to analyse "
                         "(default: train the preset's Baseline and its matched SMELT here)")
    ap.add_argument("--ladder", default=None,
                    help="a scaling_ladder.py / reproduce.py output directory: use its last cell's pair "
                         "(default: see --runs)")


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
    scale, label, base = exp.base()
    smelt, _ = exp.match(base, budget.smelt_loop(base.n_layer))
    cell = {"scale": scale, "sparsity_label": label, "control": budget.dense_control(base)}
    b, s = exp.train_all([("baseline", base, {**cell, "arch": "baseline"}),
                          ("smelt", smelt, {**cell, "arch": "smelt"})])
    return Path(b["run_dir"]), Path(s["run_dir"])


# ----------------------------------------------------------------------------------------
# How to Loop: its loop configs, its compute accounting, bits per byte, the fitted no-loop curve

# The paper's reported ranges, printed beside what we measure.
PAPER_RMS_RATIO = (10.0, 600.0)        # state RMS / embedding RMS, "roughly 10 to 600 times larger"
PAPER_TOKEN_MULTIPLIER = (1.3, 3.3)    # tokens a no-loop model needs to match two loops (1B)
PAPER_FLOPS_EXTRA_PCT = (6.0, 37.0)    # extra no-loop FLOPs to match two loops on half the tokens (100M-1B)
CURVE_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)   # no-loop decay branches, as fractions of the stable phase
ALPHA_BOUNDS = (0.02, 3.0)             # data exponent search range of the no-loop curve fit


def howto_loop(**fields) -> LoopConfig:
    """A How-to-Loop LoopConfig. The paper has no 1/r residual scale (that is SMELT's Eq. 8-9), so every
    schedule / adapter / PLT config of the howto_* scripts is built here with residual_scale=False."""
    if "residual_scale" in fields:
        raise ValueError("howto_loop: residual_scale is fixed to False (How-to-Loop has no 1/r scale)")
    return LoopConfig(residual_scale=False, **fields)


def howto_flops(cfg: ModelConfig, ctx: float) -> float:
    """Training FLOPs per token as How-to-Loop counts them (its Fig. 1): budget's "howtoloop" convention with
    the output head, which runs once per token whatever the loop count (two loops cost 1.45-1.8x, not 2x)."""
    return budget.flops_per_token(cfg, ctx, convention="howtoloop", include_head=True)


def curve_branches(stable_steps: int) -> list[int]:
    """Decay-branch steps of the no-loop reference run: CURVE_FRACTIONS of the stable phase (distinct, >= 1)."""
    return sorted({max(1, round(f * stable_steps)) for f in CURVE_FRACTIONS})


def compute_share_steps(stable_steps: int, decay_steps: int, flops_ref: float, flops_run: float) -> int:
    """Stable steps of How-to-Loop's fixed-compute run: the same model looped (flops_run FLOPs per token)
    trained on the token share flops_ref / flops_run of a reference run (flops_ref per token, stable_steps +
    decay_steps steps of the same batch), so both spend the same training compute ("two loops on half the
    tokens"; with the head charged once, a bit more than half). The decay branch keeps its length; the total
    is rounded to whole steps, so compute matches to within half a step's FLOPs."""
    for name, v in (("stable_steps", stable_steps), ("decay_steps", decay_steps)):
        if not (isinstance(v, int) and v >= 1):
            raise ValueError(f"compute_share_steps: {name} must be an int >= 1, got {v!r}")
    for name, v in (("flops_ref", flops_ref), ("flops_run", flops_run)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"compute_share_steps: {name} must be a positive number, got {v!r}")
    share = flops_ref / flops_run
    stable = round((stable_steps + decay_steps) * share) - decay_steps
    if stable < 1:
        raise ValueError(f"compute_share_steps: a token share of {share:.3f} of {stable_steps + decay_steps} steps "
                         f"leaves no stable step before the {decay_steps}-step decay; train longer (--steps)")
    return stable


def token_byte_lengths(tokenizer, vocab_size: int, eot: int) -> np.ndarray:
    """(vocab_size,) UTF-8 bytes of each token id's text; <|endoftext|> is a separator, not text: 0 bytes."""
    lens = np.array([len(tokenizer.decode_single_token_bytes(i)) for i in range(vocab_size)], dtype=np.int64)
    lens[eot] = 0
    return lens


def val_bytes_per_token(data, block_size: int, max_tokens: int) -> dict:
    """Bytes per token of exactly the held-out targets train.evaluate scores (data.val_batches of every source,
    capped at max_tokens per source, targets != -1): {"bytes_per_token", "bytes", "tokens", "by_domain"}.

    corpus.measure_bytes_per_token reports the whole validation text per domain re-tokenised at other
    vocabularies (a tokenizer study); bits per byte needs the bytes of the very tokens the loss averages.
    Predicting <|endoftext|> costs loss but covers no text (0 bytes), as in the usual bpb convention.
    """
    lens = token_byte_lengths(data.tokenizer(), data.vocab_size, data.eot)
    per: dict[str, list[int]] = {}
    for src in data.sources:
        b = n = 0
        for _, tgt, _ in data.val_batches(src, 64, block_size, max_tokens):
            t = tgt[tgt != -1].numpy()
            b, n = b + int(lens[t].sum()), n + t.size
        acc = per.setdefault(data.domains[src], [0, 0])
        acc[0] += b
        acc[1] += n
    B, N = sum(b for b, _ in per.values()), sum(n for _, n in per.values())
    if B == 0 or N == 0:
        raise ValueError(f"val_bytes_per_token: the validation text holds {N} target tokens and {B} bytes "
                         f"(block_size={block_size}, max_tokens={max_tokens}): nothing to measure")
    return {"bytes_per_token": B / N, "bytes": B, "tokens": N,
            "by_domain": {d: b / n for d, (b, n) in per.items() if n}}


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    """Bits per byte from a token-averaged cross-entropy in nats and the bytes per token of the same text:
    nats/token / ln 2 / (bytes/token), i.e. total bits / total bytes."""
    if not (math.isfinite(bytes_per_token) and bytes_per_token > 0):
        raise ValueError(f"bits_per_byte: bytes_per_token must be a positive number, got {bytes_per_token!r}")
    if not math.isfinite(nats_per_token):
        raise ValueError(f"bits_per_byte: nats_per_token must be finite, got {nats_per_token!r}")
    return nats_per_token / math.log(2) / bytes_per_token


def fit_noloop_curve(tokens, losses, min_points: int = 4, min_span: float = 2.0,
                     alpha_bounds: tuple[float, float] = ALPHA_BOUNDS) -> dict:
    """L(D) = E + A (D / D_ref)^-alpha fitted to the no-loop runs (D_ref = the largest D), least squares.

    For each alpha (a log grid over alpha_bounds, then a bounded refinement) E and A are linear least
    squares with E >= 0; alpha minimises the squared error. The fit is *identified* only if these stated
    checks pass (the project's rule for fits: point count, the data's range, exponents off their bounds and
    of the right sign); otherwise "why" says which failed and no coefficients are returned:
      * at least `min_points` distinct token counts (more points than the 3 coefficients);
      * the largest D at least `min_span` times the smallest;
      * loss strictly falls as D grows (a non-monotone set has no decreasing curve to invert);
      * A > 0 and alpha > 0, with alpha not within 2 % (in log) of either bound.
    Returns {"identified", "why", "E", "A", "alpha", "D_ref", "D_min", "D_max", "n", "rmse"}.
    """
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
    if n_distinct < min_points:
        out["why"] = f"{n_distinct} distinct token counts for 3 coefficients (need >= {min_points})"
        return out
    if D[-1] / D[0] < min_span:
        out["why"] = f"tokens span only x{D[-1] / D[0]:.2f} (need >= x{min_span:g})"
        return out
    rises = [(i, i + 1) for i in range(D.size - 1) if not L[i + 1] < L[i]]
    if rises:
        i, j = rises[0]
        out["why"] = (f"non-monotone: loss {L[i]:.4f} at D={D[i]:.3g} -> {L[j]:.4f} at D={D[j]:.3g} "
                      f"({len(rises)} of {D.size - 1} steps do not fall)")
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
    out.update(E=E, A=A, alpha=alpha, D_ref=ref, rmse=math.sqrt(sse / D.size))
    near = 0.02
    if not A > 0:
        out["why"] = "amplitude A <= 0: the fitted loss does not fall with tokens"   # no estimate printed
    elif not alpha > 0:
        out["why"] = "data exponent alpha <= 0"
    elif math.log(alpha / lo) < near or math.log(hi / alpha) < near:
        out["why"] = f"data exponent alpha at its search bound [{lo:g}, {hi:g}]"
    else:
        out["identified"] = True
        return out
    out.update(E=None, A=None, alpha=None)
    return out


def tokens_to_reach(fit: dict, loss: float) -> tuple[float | None, str | None]:
    """(D, None): the tokens the fitted no-loop curve needs to reach `loss`, D = D_ref (A / (loss - E))^(1/alpha);
    or (None, "not identified (why)") when the fit is not identified or the loss lies at or below its floor E."""
    if not fit.get("identified"):
        return None, f"not identified ({fit.get('why')})"
    E, A, alpha, ref = fit["E"], fit["A"], fit["alpha"], fit["D_ref"]
    if not loss > E:
        return None, f"not identified (loss {loss:.4f} at or below the fitted no-loop floor E = {E:.4f})"
    return ref * (A / (loss - E)) ** (1.0 / alpha), None


def efficiency(fit: dict, loss: float, tokens: float, flops_run: float, flops_noloop: float) -> dict:
    """How-to-Loop's efficiency multipliers of one looped run against the fitted no-loop curve.

    tokens_multiplier = D_noloop(loss) / tokens (the paper: a no-loop 1B model needs 1.3-3.3x the tokens of
    two loops); flops_multiplier = flops_noloop * D_noloop(loss) / (flops_run * tokens), the no-loop
    compute that reaches the same loss over the run's compute (the paper: 1.06-1.37 for two loops on half
    the tokens). With one no-loop width the loss-vs-FLOPs curve is the loss-vs-tokens curve with its axis
    scaled by flops_noloop, so one fit serves both. "note" says when D_noloop lies outside the fitted data
    (extrapolated) or, with no multipliers, why ("not identified (why)").
    """
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
    """The claim "lo < quantity < hi" by stats.verdict on both sides: reproduced when the interval lies inside,
    contradicted when it lies wholly outside on either side, not resolved otherwise."""
    v = (stats.verdict(iv, ">", lo), stats.verdict(iv, "<", hi))
    if "contradicted" in v:
        return "contradicted"
    return "reproduced" if v == ("reproduced", "reproduced") else "not resolved"


def howto_report(exp: Experiment, rows: list[dict], noloop: dict) -> dict:
    """Bits per byte and efficiency multipliers for every row of a How-to-Loop script (in place).

    noloop: the no-loop reference row, trained with exp.curve_tc() (several decay branches). Every row gets
    "bpb" (bits_per_byte of its val_loss on the held-out text's bytes per token) and "compute" (How-to-Loop
    FLOPs per token x tokens, and its ratio to the no-loop run's); every looped row the multipliers of
    `efficiency`. Returns the summary {"bytes_per_token", "noloop_curve": fit + its points, "paper_ranges"}.
    """
    data = exp.load_data()
    bpt = val_bytes_per_token(data, exp.tc.block_size, exp.tc.eval_tokens)
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
    """Validation loss against training FLOPs: the no-loop runs (points), their fitted curve (a line, when
    identified) and each looped series {label: (compute, loss)} (markers)."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
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
