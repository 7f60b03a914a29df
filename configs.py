"""Every preset in one place, as plain tables; a preset names a size (smoke | tiny | fits | small | medium | paper):
  * LADDERS       each size's Baseline grid (SMELT Appendix A for `paper`) and budget.match's search options;
                  budget.ladder_cells matches a SMELT to each (SMELT 3.2).
  * DATA_PRESETS  the corpus sizes corpus.prepare builds.
  * PLANS         what reproduce.py trains and evaluates (WSD schedule, SMELT 3.1) and its arms: the Baseline and
                  each looped arm by name, a loop.LoopSpec (SMELT's by default).
  * SMOKE_MODELS, SCRIPT_PRESETS, SWEEP_STEPS, SWEEP_EVAL_TOKENS  train.py's smoke models; the scripts' sizes.
  * plan_runs     every run (cell, arch, seed) of a plan and its directory (cell_key / run_name).
Why each number is: docs/configs.md. Read next: budget.py (the ladders matched), reproduce.py (the plans run).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loop import SMELT, LoopSpec

BASELINE = "baseline"   # the reference arm every looped arm is matched to and compared with


# ---- Model ladders (SMELT Appendix A): the Baselines budget.ladder_cells matches a SMELT to ------

# Appendix A's Baselines, expert width and heads solved from its columns: (scale, H, L, expert d_ff, head_dim,
# n_head; n_kv_head = 2).
PAPER_SCALES = [("100M", 672, 10, 544, 112, 6), ("200M", 1280, 12, 432, 128, 10),
                ("600M", 1792, 20, 600, 128, 14), ("1.6B", 2304, 30, 768, 128, 18)]
PAPER_POOLS = [("S=0%", 8), ("S~85%", 64), ("S~95%", 192), ("S~97%", 336)]
PAPER_VOCAB = 128_256   # not stated by the paper; irrelevant to the ratios (head excluded)
PAPER_DOC_LEN = 833     # the document length at which our FLOPs reproduce the paper's 200M example
# Published (SMELT Appendix A) for comparison only: Baseline S, SMELT H, experts, F ratio, KV ratio.
PAPER_PUBLISHED = {
    "100M": [(0.0, 576, 16, 1.081, 1.018), (86.0, 576, 96, 1.024, 0.964), (95.2, 576, 288, 1.031, 0.964), (97.2, 576, 504, 1.039, 0.964)],
    "200M": [(0.0, 1056, 16, 1.039, 1.031), (84.3, 1056, 96, 1.021, 1.031), (94.6, 1056, 288, 1.029, 1.031), (96.9, 1056, 504, 1.037, 1.031)],
    "600M": [(0.0, 1408, 16, 1.046, 1.031), (84.5, 1408, 96, 1.007, 1.031), (94.7, 1512, 288, 1.024, 0.984), (96.9, 1512, 504, 1.031, 0.984)],
    "1.6B": [(0.0, 1848, 16, 1.022, 0.984), (84.5, 1848, 96, 1.000, 0.984), (94.7, 1848, 288, 1.004, 0.984), (96.9, 1848, 504, 1.008, 0.984)],
}

# Appendix A's SMELT geometry of the sparse cells (budget.ladder_cells uses it instead of matching; the S=0% cells
# are matched): (scale, label) -> (d_model, n_head, n_kv_head, head_dim, d_ff, n_experts). docs/budget.md.
PAPER_SMELT = {(s, lab): (H, nh, 2, hd, ff, E) for s, H, nh, hd, ff, pools in [
    ("100M", 576, 8, 72, 424, (96, 288, 504)), ("200M", 1056, 12, 88, 352, (96, 288, 504)),
    ("1.6B", 1848, 22, 84, 640, (96, 288, 504))] for lab, E in zip(("S~85%", "S~95%", "S~97%"), pools)}
PAPER_SMELT.update({("600M", "S~85%"): (1408, 16, 2, 88, 520, 96), ("600M", "S~95%"): (1512, 18, 2, 84, 472, 288),
                    ("600M", "S~97%"): (1512, 18, 2, 84, 472, 504)})

# Our ladders: tiny and smoke for a CPU, small and medium for one GPU (docs/configs.md). Every depth gives a
# middle-half span of >= 2 layers; every head_dim is >= 16 (CUDA flex attention's minimum).
#               (scale, d_model, n_layer, n_head, n_kv_head, head_dim, d_ff)
TINY_SCALES = [("t40", 40, 4, 2, 2, 20, 80), ("t48", 48, 4, 2, 2, 24, 96), ("t56", 56, 4, 2, 2, 28, 112),
               ("t64", 64, 4, 4, 2, 16, 128), ("t80", 80, 4, 4, 2, 20, 160)]
# fits: tiny's shapes at both ends of a 9.8x F span (the Baseline's capacity exponent needs it: docs/plans.md); t28
# has one head of 28 (t24's SMELT match is degenerate: 101 experts of width 10), t96 two heads of 48
FITS_SCALES = [("t28", 28, 4, 1, 1, 28, 56)] + [s for s in TINY_SCALES if s[0] in ("t40", "t48", "t64", "t80")] + [
    ("t96", 96, 4, 2, 2, 48, 192)]
# small: head_dim 16 (CUDA flex attention's backward wants multiples of 16) and 3 KV heads, so that a looped model's
# 1.5x attention visits can hold the Baseline's KV cache with 2 KV heads of 16 (the queries' widths as before)
SMALL_SCALES = [("s96", 96, 4, 6, 3, 16, 48), ("s128", 128, 4, 9, 3, 16, 64), ("s160", 160, 6, 9, 3, 16, 80),
                ("s192", 192, 6, 12, 3, 16, 96)]
MEDIUM_SCALES = [("s256", 256, 6, 4, 2, 64, 128), ("s384", 384, 8, 6, 2, 64, 192), ("s512", 512, 8, 8, 2, 64, 256)]
GPU_POOLS = [("S=0%", 8), ("S~85%", 64), ("S~95%", 192)]   # top-8 of experts of width D/2, as the paper
SMOKE_SCALES = [("m48", 48, 4, 2, 2, 24, 48), ("m64", 64, 4, 4, 2, 16, 64)]
CONTROL_LABEL = "S=0%"   # the sparsity label of the S = 0 control cells (a property of the cell, SMELT 3.1)
# budget.match's bands, wider than its +-25 % default so that the few-expert S = 0 cells match within SMELT's
# tolerances at every document length tested (docs/configs.md, "Search options of the ladders")
WIDE_SEARCH = dict(ff_band=0.5, q_band=0.5)
TINY_SEARCH = dict(ff_band=1.0, q_band=1.0, ff_multiple=2, d_multiple=2)
GPU_SEARCH = dict(WIDE_SEARCH, d_multiple=8, ff_multiple=8, head_dim_multiple=16)   # aligned: no padding, flex
LADDERS = {  # pools (label, experts), top_k, vocab, block_size, data preset whose document length F is measured at,
             # budget.match search options
    "smoke": dict(scales=SMOKE_SCALES, pools=[(CONTROL_LABEL, 2), ("S~85%", 16)], top_k=2, vocab=512, block=64,
                  data="smoke", search=TINY_SEARCH),
    "tiny": dict(scales=TINY_SCALES, pools=[(CONTROL_LABEL, 2), ("S~85%", 16)], top_k=2, vocab=4096, block=128,
                 data="tiny", search=TINY_SEARCH),
    "fits": dict(scales=FITS_SCALES, pools=[("S~85%", 16)], top_k=2, vocab=4096, block=128, data="tiny",
                 search=TINY_SEARCH),
    "small": dict(scales=SMALL_SCALES, pools=PAPER_POOLS, top_k=8, vocab=16384, block=1024, data="small",
                  search=GPU_SEARCH),
    "medium": dict(scales=MEDIUM_SCALES, pools=GPU_POOLS, top_k=8, vocab=16384, block=1024, data="small",
                   search=GPU_SEARCH),
    # the paper's grid at the paper's document length (its own data is internal)
    "paper": dict(scales=[(s, H, L, nh, 2, hd, F) for s, H, L, F, hd, nh in PAPER_SCALES], pools=PAPER_POOLS,
                  top_k=8, vocab=PAPER_VOCAB, block=4096, data=None, smelt=PAPER_SMELT),
}


# ---- Data presets: the corpus sizes corpus.prepare builds ----------------------------------------

@dataclass(frozen=True)
class DataPreset:
    vocab_size: int
    tokens_per_domain: int      # train + validation tokens aimed for in each domain
    val_tokens_per_source: int  # held-out tokens per source (whole documents, at most 1/10 of them)
    offline: bool               # only sources that need no download (stdlib, generated)
    domains: int = 5            # domains it fills (offline: code and math only)

    @property
    def planned_tokens(self) -> int:
        """Train + validation tokens aimed for (the measured training stream differs: docs/configs.md)."""
        return self.tokens_per_domain * self.domains


DATA_PRESETS = {
    "smoke": DataPreset(vocab_size=512, tokens_per_domain=150_000, val_tokens_per_source=4_096, offline=True,
                        domains=2),
    "tiny": DataPreset(vocab_size=4096, tokens_per_domain=1_000_000, val_tokens_per_source=16_384, offline=False),
    # small: ~20M tokens = 40 MB of uint16 shards, so a prepared set can be carried to a GPU box.
    "small": DataPreset(vocab_size=16384, tokens_per_domain=4_000_000, val_tokens_per_source=32_768, offline=False),
}


def data_preset(name: str) -> DataPreset:
    if name not in DATA_PRESETS:
        raise ValueError(f"preset must be one of {sorted(DATA_PRESETS)}, got {name!r}")
    return DATA_PRESETS[name]


# ---- Run plans: what reproduce.py trains and evaluates at each run size --------------------------

@dataclass
class Plan:
    """Everything a preset decides besides the model ladder (which LADDERS holds)."""
    data: str                       # corpus.prepare preset
    ladder: str                     # LADDERS preset (its block size is the training context)
    block_size: int                 # training context; must equal LADDERS[ladder]["block"]
    batch_size: int
    lr: float
    warmup_steps: int
    stable_steps: int
    branch_steps: list[int]
    decay_steps: int
    eval_tokens: int                # validation tokens per source at each branch end
    tasks: tuple = ("generated", "real")
    shots: tuple = (0, 1, 2, 4, 8)   # small and up add 10, DCLM Core's k for the BIG-bench tasks (tasks.REAL_TASKS)
    seeds: int = 3                  # few-shot demonstration seeds per task and k
    max_items: int = 40
    bootstrap: int = 200
    probe_tokens: int = 8192
    scales: int | None = None       # keep only the first N scales of the ladder (None: all)
    cells: tuple | None = None      # keep only these (scale, sparsity label) cells of the ladder (None: all)
    repeat: tuple | None = None     # (scale, sparsity label) of the cell trained over `train_seeds` seeds
    train_seeds: int = 1            # training seeds of the repeated cell (every other cell: seed 0)
    eval_interval: int = 0          # validation during training every N steps (0: only at branch ends)
    log_interval: int = 0           # a metrics row every N steps (0: stable_steps // 8); a divisor of every fork
                                    # keeps each plotted window whole
    # the looped arms by name, each matched to the same Baselines and compared with them (adding one is one entry)
    arms: dict = field(default_factory=lambda: {"smelt": SMELT})

    def __post_init__(self):
        if not self.arms or BASELINE in self.arms or not all(isinstance(s, LoopSpec) for s in self.arms.values()):
            raise ValueError(f"Plan: arms must map names other than {BASELINE!r} to loop.LoopSpec, got {self.arms}")
        if len({s.n_shared_experts for s in self.arms.values()}) > 1:   # the Baseline has them too: one value
            raise ValueError("Plan: every arm must have the same n_shared_experts (the Baseline shares it)")

    @property
    def loop(self) -> LoopSpec:
        """The first arm's LoopSpec: what the sweep scripts loop and the out dir's tag names."""
        return next(iter(self.arms.values()))


# small: every sparse cell (a cell bootstrap needs >= 10) and the S = 0 control at two consecutive scales
SMALL_CELLS = tuple((scale, label) for scale, *_ in SMALL_SCALES for label, _ in PAPER_POOLS
                    if label != CONTROL_LABEL or scale in ("s96", "s128"))

PLANS = {
    "smoke": Plan(data="smoke", ladder="smoke", block_size=64, batch_size=8, lr=3e-3, warmup_steps=5,
                  stable_steps=30, branch_steps=[10, 20, 30], decay_steps=6, eval_tokens=2048,
                  tasks=("gen_copy", "gen_kv"), shots=(0, 2), seeds=2, max_items=8, bootstrap=20, probe_tokens=1024,
                  repeat=("m64", "S~85%"), train_seeds=2),
    # tiny: five S~85 % cells for the fits (F 3.4x, D 4x), the S = 0 control, the headline cell over 3 seeds; a
    # 150-step warmup (50 let one initialisation's router nearly collapse and lag 0.36 nats): docs/plans.md
    "tiny": Plan(data="tiny", ladder="tiny", block_size=128, batch_size=4, lr=2e-3, warmup_steps=150,
                 stable_steps=1140, branch_steps=[240, 600, 1140], decay_steps=60, eval_tokens=4096,
                 cells=(("t40", CONTROL_LABEL),) + tuple((s, "S~85%") for s, *_ in TINY_SCALES),
                 tasks=("generated", "qa_wikidata", "dyck_languages", "cs_algorithms", "operators",
                        "repeat_copy_logic"), shots=(0, 2, 8), seeds=2, max_items=12, bootstrap=40,
                 probe_tokens=4096, repeat=("t40", "S~85%"), train_seeds=3, log_interval=60),
    # fits: both surfaces identified on a CPU: six S~85 % cells t28-t96 (F 9.8x), 2.1M tokens per run, four endpoints
    # at 1/8, 1/4, 1/2 and all of D (D 8x); the loss is what it is for, so the downstream tasks are few: docs/plans.md
    "fits": Plan(data="tiny", ladder="fits", block_size=128, batch_size=4, lr=2e-3, warmup_steps=150,
                 stable_steps=3420, branch_steps=[270, 720, 1620, 3420], decay_steps=180, eval_tokens=4096,
                 tasks=("generated",), shots=(0, 2), seeds=2, max_items=12, bootstrap=200, probe_tokens=4096,
                 log_interval=90),
    # small: no repeated data (SMELT 3.1: plan_epochs < 1); four endpoints spanning D 6.5x (docs/configs.md)
    "small": Plan(data="small", ladder="small", block_size=1024, batch_size=32, lr=2e-3, warmup_steps=50,
                  stable_steps=465, branch_steps=[50, 135, 270, 465], decay_steps=25, eval_tokens=32768,
                  shots=(0, 1, 2, 4, 8, 10), seeds=5, max_items=100, bootstrap=1000, probe_tokens=32768,
                  cells=SMALL_CELLS, repeat=("s96", "S~85%"), train_seeds=3),   # read once: train CE is a held-out loss
    "medium": Plan(data="small", ladder="medium", block_size=1024, batch_size=64, lr=2e-3, warmup_steps=100,
                   stable_steps=4000, branch_steps=[500, 1000, 2000, 4000], decay_steps=400, eval_tokens=65536,
                   shots=(0, 1, 2, 4, 8, 10, 16, 32), seeds=10, max_items=200, bootstrap=2000, probe_tokens=65536,
                   repeat=("s256", "S~85%"), train_seeds=3, eval_interval=500),
    "paper": Plan(data="small", ladder="paper", block_size=4096, batch_size=256, lr=1e-3, warmup_steps=2000,
                  stable_steps=196_075, branch_steps=[10_000, 20_000, 50_000, 100_000, 150_000, 196_075],
                  decay_steps=9537, eval_tokens=1 << 20, shots=(0, 1, 2, 4, 8, 10, 16, 32), seeds=10,
                  max_items=None, bootstrap=2000, probe_tokens=1 << 20),
}


def plan_epochs(plan: Plan, train_tokens: int | None = None) -> float:
    """Passes over the training stream one run reads: (stable_steps + decay_steps) x batch x block tokens (the
    branches share one decay window) / train_tokens (default: the data preset's planned_tokens)."""
    total = data_preset(plan.data).planned_tokens if train_tokens is None else train_tokens
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise ValueError(f"plan_epochs: train_tokens must be a positive int, got {train_tokens!r}")
    return (plan.stable_steps + plan.decay_steps) * plan.batch_size * plan.block_size / total


def decay_freshness(epochs: float) -> str:
    """Whether the decay branches see data the stable phase did not (SMELT 3.1): while plan_epochs <= 1."""
    if epochs <= 1:
        return f"fresh: one run reads {epochs:.2f} epochs of the training stream, so no decay branch repeats data"
    return (f"not fresh: one run reads {epochs:.2f} epochs of the training stream, so its decay window repeats data "
            f"the stable phase trained on (SMELT 3.1 decays on data not seen in the stable phase)")


# ---- A plan's runs: which runs it trains, named and placed how (reproduce.py, report.py, train_plots.py) ----

def cell_key(scale: str, label: str) -> str:
    """A file-name-safe id of one grid cell: ("t64", "S~85%") -> "t64_S85", ("t64", "S=0%") -> "t64_S0"."""
    return f"{scale}_{label.replace('~', '').replace('=', '').replace('%', '')}"


def cell_arms(cell: dict) -> list[str]:
    """A ladder cell's arms: the Baseline, then each looped arm matched to it (budget.ladder_cells)."""
    return [BASELINE, *cell["match"]]


def arm_label(arm: str) -> str:
    """How the report names an arm: "baseline" -> "Baseline", "smelt" -> "SMELT", others as written."""
    return {BASELINE: "Baseline", "smelt": "SMELT"}.get(arm, arm)


@dataclass(frozen=True)
class Run:
    cell: dict
    arch: str        # an arm: "baseline" or a looped arm's name ("smelt", ...)
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


def arm_dir(out: Path, plan: Plan, arm: str) -> Path:
    """Where one looped arm's comparison with the Baseline is written: OUT for the plan's first arm, else
    OUT/arms/NAME (the same files, so a one-arm plan's folder is as before)."""
    return out if arm == next(iter(plan.arms)) else out / "arms" / arm


def plan_runs(out: Path, ladder: list[dict], plan: Plan | None = None) -> list[Run]:
    """Every run: each cell's arms (cell_arms) at seed 0, the repeated cell's also at seeds 1 .. train_seeds-1
    (every model of a cell and seed sees identical batches: the batch order is a function of the seed)."""
    rep = plan is not None and plan.repeat is not None and tuple(plan.repeat)
    return [Run(c, arch, seed, out / "runs" / run_name(c["scale"], c["sparsity_label"], arch, seed))
            for c in ladder for seed in range(plan.train_seeds if (c["scale"], c["sparsity_label"]) == rep else 1)
            for arch in cell_arms(c)]


def run_dirs(out: Path, ladder: list[dict]) -> list[tuple[dict, str, Path]]:
    """(cell, arch, run dir) of every cell's seed-0 arms (the matched Baseline first)."""
    return [(r.cell, r.arch, r.dir) for r in plan_runs(out, ladder)]


# ---- Smoke models (`python train.py --preset NAME`) and the experiment scripts' sizes ------------

SMOKE_MODEL_BASE = dict(block_size=64, n_layer=4, d_model=32, n_head=2, n_kv_head=1, d_ff=32)
SMOKE_MODELS = {   # train.preset_model: SMOKE_MODEL_BASE with these fields; n_loops: the middle half looped
    "smoke-dense": dict(d_ff=64),
    "smoke-moe": dict(n_experts=4, top_k=2),
    "smoke-smelt": dict(n_experts=4, top_k=2, n_loops=2),
}
SCRIPT_PRESETS = ("smoke", "tiny", "small")
SWEEP_STEPS = {"smoke": 30, "tiny": 40, "small": 600}          # stable steps of one sweep point
SWEEP_EVAL_TOKENS = {"smoke": 1024, "tiny": 1024, "small": 16384}    # validation tokens per source
