"""Every preset in one place: model ladders, data presets, run plans, smoke models, script sizes.

A preset is a name for a size (DESIGN.md's table: smoke | tiny | small | medium | paper). What each
size means lives here as plain tables, so the code that uses them reads like its idea:
  * LADDERS       the Baseline grid of each run size (scales x expert pools, SMELT Appendix A for
                  `paper`) and budget.match's search options; budget.ladder_cells matches a SMELT to
                  each Baseline (SMELT 3.2); budget.preset_baselines builds their ModelConfigs.
  * DATA_PRESETS  the corpus sizes corpus.prepare builds (smoke | tiny | small).
  * PLANS         what reproduce.py trains and evaluates per run size (WSD schedule, SMELT 3.1;
                  eval sizes; seeds), and the loop knobs the ladder is matched with: r = n_loops,
                  span_fraction (loop.middle_span), n_shared_experts; later stages read r from the runs.
  * SMOKE_MODELS  the three smoke models of `python train.py --preset` (train.preset_model).
  * SCRIPT_PRESETS, SWEEP_STEPS, SWEEP_EVAL_TOKENS  the sizes of the experiment scripts in scripts/.
  * plan_runs     what a plan expands to: every run (cell, arch, seed) and its directory, named by
                  cell_key / run_name; reproduce.py trains them, report.py and train_plots.py read them.
Plain tables that import nothing of the project, so any module may read them. Why each number is:
docs/configs.md and the README's "The tiny plan". Read next: budget.py (the ladders matched),
reproduce.py (the plans run).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


# ----------------------------------------------------------------------------------------
# Model ladders (SMELT Appendix A): the Baselines budget.ladder_cells matches a SMELT to

# Appendix A's Baselines, rebuilt. The paper gives H, L, pool sizes, active/total parameters and S;
# expert width and head geometry are solved from those columns (they reproduce every published
# active/total count to the printed digits): (scale, H, L, expert d_ff, head_dim, n_head; n_kv_head = 2).
PAPER_SCALES = [("100M", 672, 10, 544, 112, 6), ("200M", 1280, 12, 432, 128, 10),
                ("600M", 1792, 20, 600, 128, 14), ("1.6B", 2304, 30, 768, 128, 18)]
PAPER_POOLS = [("S=0%", 8), ("S~85%", 64), ("S~95%", 192), ("S~97%", 336)]
PAPER_VOCAB = 128_256   # not stated by the paper; irrelevant to the ratios (head excluded, see below)
# Document length at which our FLOPs reproduce the paper's 200M example (Baseline 1.33e9 FLOPs/token,
# SMELT +2.9 %): packed 4096-token contexts with segment masks, attention at the document length.
PAPER_DOC_LEN = 833
# Published (SMELT Appendix A) for comparison only: Baseline S, SMELT H, experts, F ratio, KV ratio.
PAPER_PUBLISHED = {
    "100M": [(0.0, 576, 16, 1.081, 1.018), (86.0, 576, 96, 1.024, 0.964), (95.2, 576, 288, 1.031, 0.964), (97.2, 576, 504, 1.039, 0.964)],
    "200M": [(0.0, 1056, 16, 1.039, 1.031), (84.3, 1056, 96, 1.021, 1.031), (94.6, 1056, 288, 1.029, 1.031), (96.9, 1056, 504, 1.037, 1.031)],
    "600M": [(0.0, 1408, 16, 1.046, 1.031), (84.5, 1408, 96, 1.007, 1.031), (94.7, 1512, 288, 1.024, 0.984), (96.9, 1512, 504, 1.031, 0.984)],
    "1.6B": [(0.0, 1848, 16, 1.022, 0.984), (84.5, 1848, 96, 1.000, 0.984), (94.7, 1848, 288, 1.004, 0.984), (96.9, 1848, 504, 1.008, 0.984)],
}

# Appendix A's SMELT geometry of the sparse cells, the paper preset's SMELT models (budget.ladder_cells uses them
# instead of matching): H and experts published, (n_head, head_dim, d_ff) solved from the published active and
# total parameters, F and KV ratios (each reproduced to the printed digits; n_kv_head 2 as the Baselines).
# The S=0% rows have no such solution under our accounting (and 100M's F 1.081 lies outside [1, 1.04]):
# those cells are matched. (scale, label) -> (d_model, n_head, n_kv_head, head_dim, d_ff, n_experts)
PAPER_SMELT = {(s, lab): (H, nh, 2, hd, ff, E) for s, H, nh, hd, ff, pools in [
    ("100M", 576, 8, 72, 424, (96, 288, 504)), ("200M", 1056, 12, 88, 352, (96, 288, 504)),
    ("1.6B", 1848, 22, 84, 640, (96, 288, 504))] for lab, E in zip(("S~85%", "S~95%", "S~97%"), pools)}
PAPER_SMELT.update({("600M", "S~85%"): (1408, 16, 2, 88, 520, 96), ("600M", "S~95%"): (1512, 18, 2, 84, 472, 288),
                    ("600M", "S~97%"): (1512, 18, 2, 84, 472, 504)})

# Our ladders (S labels: the Baseline's measured S, head excluded, at the data's document length).
# tiny: a 2-core CPU (vocab 4096 = the data module's tiny tokenizer, 128-token contexts, top-2 of
# 2 experts (the S = 0 control: every expert active) or 16 experts of width 2D -> S ~ 85 %);
# small / medium: one GPU (top-8 of experts of width D/2: 8 / 64 / 192 -> S = 0 / ~85 / ~95 %, small also
# 336 -> S~97 %, the paper's four pools). Every depth gives a
# middle-half span of >= 2 layers; every head_dim is >= 16 (CUDA flex attention's minimum).
#               (scale, d_model, n_layer, n_head, n_kv_head, head_dim, d_ff)
TINY_SCALES = [("t64", 64, 4, 4, 2, 16, 128), ("t96", 96, 4, 6, 2, 16, 192)]
SMALL_SCALES = [("s96", 96, 4, 4, 2, 24, 48), ("s128", 128, 4, 6, 2, 24, 64), ("s160", 160, 6, 6, 2, 24, 80),
                ("s192", 192, 6, 8, 2, 24, 96)]
MEDIUM_SCALES = [("s256", 256, 6, 4, 2, 64, 128), ("s384", 384, 8, 6, 2, 64, 192), ("s512", 512, 8, 8, 2, 64, 256)]
# small / medium: top-8 as the paper (SMELT 3.1) of experts of width D/2: the same active parameters and S
# labels as the earlier top-4 of 4 / 32 / 96 experts of width D
GPU_POOLS = [("S=0%", 8), ("S~85%", 64), ("S~95%", 192)]
SMOKE_SCALES = [("m48", 48, 4, 2, 2, 24, 48), ("m64", 64, 4, 4, 2, 16, 64)]
CONTROL_LABEL = "S=0%"   # the sparsity label of the S = 0 control cells (a property of the cell, SMELT 3.1)
# With few experts (the S = 0 cells: 2 -> 3-5 at tiny, 8 -> 11-17 at small) one expert is a large share
# of the parameters, and the default +-25 % d_ff / query bands leave some cells outside SMELT's
# tolerances (F in [1, 1.04]) at some document lengths. +-50 % bands (and, at CPU widths, 2-aligned
# d_model / d_ff, +-100 % bands: at +-50 % t64 and m48 S=0% find no F >= 1) match every cell at every
# document length from 32 to 64 (smoke), 40 to 128 (tiny) and 200 to 1024 (small) (tested); shape
# closeness to the Baseline breaks ties.
WIDE_SEARCH = dict(ff_band=0.5, q_band=0.5)
TINY_SEARCH = dict(ff_band=1.0, q_band=1.0, ff_multiple=2, d_multiple=2)
# GPU presets: d_model, d_ff and head_dim in multiples of 8 (torch._grouped_mm's "auto" path, flex tiles: no padding)
GPU_SEARCH = dict(WIDE_SEARCH, d_multiple=8, ff_multiple=8, head_dim_multiple=8)
LADDERS = {  # pools (label, experts), top_k, vocab, block_size, data preset whose document length F is measured at,
             # budget.match search options
    "smoke": dict(scales=SMOKE_SCALES, pools=[(CONTROL_LABEL, 2), ("S~85%", 16)], top_k=2, vocab=512, block=64,
                  data="smoke", search=TINY_SEARCH),
    "tiny": dict(scales=TINY_SCALES, pools=[(CONTROL_LABEL, 2), ("S~85%", 16)], top_k=2, vocab=4096, block=128,
                 data="tiny", search=TINY_SEARCH),
    # small: d 96-192 so that every run's four fp32 endpoints (and ckpt.pt, their copy) keep 20 GB in all (26.5 at the peak)
    # and a run's 18.5M tokens (16.1M of them distinct: under one pass over the small corpus) give
    # 3.5-18 tokens per dense-equivalent parameter at the final endpoints; the paper's four pools, so that
    # 4 scales x 3 sparse columns = 12 cells per architecture are fitted, as in the paper (SMALL_CELLS);
    # medium: d 256-512 (3.4B parameters over its runs: 67 GB of endpoints kept, 98.5 at the peak)
    "small": dict(scales=SMALL_SCALES, pools=PAPER_POOLS, top_k=8, vocab=16384, block=1024, data="small",
                  search=GPU_SEARCH),
    "medium": dict(scales=MEDIUM_SCALES, pools=GPU_POOLS, top_k=8, vocab=16384, block=1024, data="small",
                   search=GPU_SEARCH),
    # the paper's grid at the paper's document length (its own data is internal): see PAPER_DOC_LEN
    "paper": dict(scales=[(s, H, L, nh, 2, hd, F) for s, H, L, F, hd, nh in PAPER_SCALES], pools=PAPER_POOLS,
                  top_k=8, vocab=PAPER_VOCAB, block=4096, data=None, smelt=PAPER_SMELT),
}


# ----------------------------------------------------------------------------------------
# Data presets: the corpus sizes corpus.prepare builds

@dataclass(frozen=True)
class DataPreset:
    vocab_size: int
    tokens_per_domain: int      # train + validation tokens aimed for in each domain
    val_tokens_per_source: int  # held-out tokens per source (whole documents, at most 1/10 of them)
    offline: bool               # only sources that need no download (stdlib, generated)
    domains: int = 5            # domains it fills (offline: code and math only)

    @property
    def planned_tokens(self) -> int:
        """Train + validation tokens aimed for; the training stream differs (measured: smoke 300,347 as
        whole documents overshoot, tiny 4.46M of 5M as validation is held out)."""
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


# ----------------------------------------------------------------------------------------
# Run plans: what reproduce.py trains and evaluates at each run size

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
    n_loops: int = 2                # r: passes of every SMELT over its looped span (SMELT: 2)
    span_fraction: float = 0.5      # looped share of the stack, placed in the middle (loop.middle_span)
    n_shared_experts: int = 0       # always-active experts beside the routed ones (0: none, as in SMELT)


# small: every sparse cell (12 per architecture: a cell bootstrap needs >= 10, stats.MIN_BOOTSTRAP_UNITS) and the
# S = 0 control at two consecutive scales (a control at all four costs 4 more runs, ~4 min by the cost model)
SMALL_CELLS = tuple((scale, label) for scale, *_ in SMALL_SCALES for label, _ in PAPER_POOLS
                    if label != CONTROL_LABEL or scale in ("s96", "s128"))

PLANS = {
    "smoke": Plan(data="smoke", ladder="smoke", block_size=64, batch_size=8, lr=3e-3, warmup_steps=5,
                  stable_steps=30, branch_steps=[10, 20, 30], decay_steps=6, eval_tokens=2048,
                  tasks=("gen_copy", "gen_kv"), shots=(0, 2), seeds=2, max_items=8, bootstrap=20, probe_tokens=1024,
                  repeat=("m64", "S~85%"), train_seeds=2),
    # tiny: see the README's "The tiny plan" for the measurements behind each number. Three cells: the S = 0
    # control and S~85 % at t64 (the "more experts" step), S~85 % at t96 (the "more parameters" step); the
    # t64 S~85 % cell over 3 seeds. t96 S = 0 is left out: see docs/configs.md.
    "tiny": Plan(data="tiny", ladder="tiny", block_size=128, batch_size=4, lr=2e-3, warmup_steps=50,
                 stable_steps=1500, branch_steps=[900, 1200, 1500], decay_steps=140, eval_tokens=4096,
                 cells=(("t64", "S=0%"), ("t64", "S~85%"), ("t96", "S~85%")),
                 tasks=("generated", "qa_wikidata", "dyck_languages", "cs_algorithms", "operators",
                        "repeat_copy_logic"), shots=(0, 2, 8), seeds=2, max_items=12, bootstrap=40,
                 probe_tokens=4096, repeat=("t64", "S~85%"), train_seeds=3, eval_interval=750),
    # small: no repeated data (SMELT 3.1): the stable phase and the decay window every branch shares read
    # (465 + 25) x 32 x 1024 = 16.1M tokens, 0.80 of the planned 20M, 0.96 of the 16.7M measured (plan_epochs);
    # four endpoints spanning D 6.5x (the first at the end of warmup) and 12 sparse cells: scripts/grid_power.py
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
    """Passes over its data's training stream that one run of `plan` reads: the stable phase, then the
    decay window every branch reads after it (train.py: data step stable_steps + k, fresh data), i.e.
    (stable_steps + decay_steps) x batch_size x block_size tokens / train_tokens (default: the data
    preset's planned_tokens; pass the prepared data's manifest "train_tokens" for the measured figure)."""
    total = data_preset(plan.data).planned_tokens if train_tokens is None else train_tokens
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise ValueError(f"plan_epochs: train_tokens must be a positive int, got {train_tokens!r}")
    return (plan.stable_steps + plan.decay_steps) * plan.batch_size * plan.block_size / total


def decay_freshness(epochs: float) -> str:
    """Whether a run's decay branches see fresh data (SMELT 3.1: data not seen in the stable phase), from
    plan_epochs: they do while the stable phase and the shared decay window fit one epoch."""
    if epochs <= 1:
        return f"fresh: one run reads {epochs:.2f} epochs of the training stream, so no decay branch repeats data"
    return (f"not fresh: one run reads {epochs:.2f} epochs of the training stream, so its decay window repeats data "
            f"the stable phase trained on (SMELT 3.1 decays on data not seen in the stable phase)")


# ----------------------------------------------------------------------------------------
# A plan's runs: which runs it trains, named and placed how (reproduce.py, report.py, train_plots.py)

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



# ----------------------------------------------------------------------------------------
# Smoke models (`python train.py --preset NAME`) and the experiment scripts' sizes

SMOKE_MODEL_BASE = dict(block_size=64, n_layer=4, d_model=32, n_head=2, n_kv_head=1, d_ff=32)
SMOKE_MODELS = {   # train.preset_model: SMOKE_MODEL_BASE with these fields; n_loops: the middle half looped
    "smoke-dense": dict(d_ff=64),
    "smoke-moe": dict(n_experts=4, top_k=2),
    "smoke-smelt": dict(n_experts=4, top_k=2, n_loops=2),   # smelt: middle half looped twice
}


SCRIPT_PRESETS = ("smoke", "tiny", "small")
SWEEP_STEPS = {"smoke": 30, "tiny": 40, "small": 600}          # stable steps of one sweep point
SWEEP_EVAL_TOKENS = {"smoke": 1024, "tiny": 1024, "small": 16384}    # validation tokens per source
