"""budget.py: counts against the real modules, FLOPs against torch's counter, the papers' numbers, matching."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import budget
import checks
import configs
from loop import SMELT, LoopConfig, LoopSpec, middle_span
from model import GPT, ModelConfig

LOOPS = {
    "none": LoopConfig(),
    "mid_x2": LoopConfig(1, 2, 2),
    "lora_x3": LoopConfig(1, 2, 3, adapter="lora"),
    "matrix_x3": LoopConfig(1, 2, 3, adapter="matrix"),
    "softmax_per_layer": LoopConfig(1, 2, 2, adapter="softmax", schedule="per_layer"),
    "attn_only_lora": LoopConfig(1, 2, 2, part="attn", adapter="lora"),
    "mlp_only": LoopConfig(1, 3, 3, part="mlp"),
    "plt_add_full": LoopConfig(0, 4, 2, parallel=True, inject="add"),
    "plt_norm_half": LoopConfig(1, 2, 3, parallel=True, inject="norm_half"),
    "plt_gate_window_lora": LoopConfig(1, 2, 3, parallel=True, inject="norm_gate", kv_window=4, adapter="lora"),
}


def small(n_experts=0, loop=LoopConfig(), tied=False, **kw):
    return ModelConfig(vocab_size=50, block_size=16, n_layer=4, d_model=32, n_head=4, n_kv_head=2, head_dim=10,
                       d_ff=24, n_experts=n_experts, top_k=2, loop=loop, tie_embeddings=tied, **kw)


def paper_cfg(H, L, F, hd, nh, E, loop=LoopConfig()):
    return ModelConfig(vocab_size=128_256, block_size=4096, n_layer=L, d_model=H, n_head=nh, n_kv_head=2,
                       head_dim=hd, d_ff=F, n_experts=E, top_k=8, loop=loop)


# ---------------------------------------------------------------------------------------- counts

@pytest.mark.parametrize("loop", LOOPS, ids=str)
@pytest.mark.parametrize("n_experts", [0, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_counts_equal_module_parameters_and_kv_equals_cache(loop, n_experts, tied):
    cfg = small(n_experts, LOOPS[loop], tied)
    model = GPT(cfg)
    c = budget.count_params(cfg)
    assert set(c) == {"blocks", "active", "embedding", "head"}
    assert sum(p.numel() for p in model.parameters()) == c["blocks"] + c["embedding"] + c["head"]
    assert c["embedding"] == model.tok_emb.weight.numel()
    assert c["head"] == (0 if tied else model.lm_head.weight.numel())
    B, T = 2, 12
    assert model.new_cache(B, T).nbytes() == pytest.approx(budget.kv_bytes_per_token(cfg, 4, ctx_len=T) * B * T)
    if not n_experts:
        assert c["active"] == c["blocks"]


def test_kv_window_needs_ctx_len_and_unlooped_kv_is_an_int():
    with pytest.raises(ValueError, match="ctx_len"):
        budget.kv_bytes_per_token(small(loop=LOOPS["plt_gate_window_lora"]))
    assert isinstance(budget.kv_bytes_per_token(small(4, LOOPS["mid_x2"])), int)


def test_flops_agree_with_torch_flop_counter():
    """Dense models: torch counts every matmul of forward + backward. It sees the attention matmuls over
    all T keys (the mask is applied after), not the causal T/2, and no norm gains or M mixing rows."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matmuls: one thread is faster on a shared 2-core machine
    try:
        for loop in ("none", "mid_x2", "matrix_x3", "attn_only_lora", "mlp_only"):
            cfg = small(loop=LOOPS[loop], attn_backend="math")
            model = GPT(cfg)
            B, T = 2, 16
            idx = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
            with FlopCounterMode(display=False) as fc:
                model(idx, idx)[1].backward()
            p = budget.plan_of(cfg)
            norms = (p.attn_visits + p.mlp_visits + 1) * cfg.d_model
            mixing = cfg.loop.adapter in ("matrix", "softmax")
            rows = (p.adapter_attn_visits * 4 + p.adapter_mlp_visits * 3) * p.n_loops if mixing else 0
            q = cfg.n_head * cfg.hd
            expected = budget.flops_per_token(cfg, T, include_head=True) - 6 * norms - 6 * rows + 12 * q * (T - T / 2) * p.attn_visits
            assert fc.get_total_flops() / (B * T) == pytest.approx(expected, rel=1e-12), loop
    finally:
        torch.set_num_threads(threads)


def test_identities():
    base = small(8)
    looped = replace(base, loop=LOOPS["mid_x2"])
    cb, cl = budget.count_params(base), budget.count_params(looped)
    assert cb == cl                                            # a loop stores no new weights
    T = 16
    Fb, Fl = budget.flops_per_token(base, T, include_head=True), budget.flops_per_token(looped, T, include_head=True)
    layer = (cb["active"] - base.d_model) / base.n_layer      # one layer's active weights (less norm_f)
    extra_attn = 6 * base.n_head * base.hd * T                 # 12 * q * T/2
    assert Fl - Fb == pytest.approx(2 * (6 * layer + extra_attn))  # two extra visits
    assert Fb == pytest.approx(6 * (cb["active"] + base.vocab_size * base.d_model) + base.n_layer * extra_attn)
    assert budget.kv_bytes_per_token(looped) == budget.kv_bytes_per_token(base) * 6 // 4
    f3 = budget.flops_per_token(replace(base, loop=LoopConfig(1, 2, 3)), T, include_head=True)
    assert Fb < Fl < f3                                        # FLOPs grow with executed visits
    # the pool changes stored weights; active changes only by the router's rows
    big = replace(base, n_experts=16)
    cbig = budget.count_params(big)
    assert cbig["blocks"] - cb["blocks"] == base.n_layer * 8 * base.d_model * (1 + 3 * base.d_ff)
    assert cbig["active"] - cb["active"] == base.n_layer * 8 * base.d_model
    # tying removes the head's weights but not its FLOPs
    assert budget.flops_per_token(replace(base, tie_embeddings=True), T, include_head=True) == Fb
    # SMELT's convention (the default) leaves the head out; How-to-Loop's counts it
    assert budget.flops_per_token(base, T) == Fb - 6 * base.vocab_size * base.d_model
    assert budget.flops_per_token(base, T, convention="howtoloop") > budget.flops_per_token(
        base, T, convention="howtoloop", include_head=False)
    with pytest.raises(ValueError, match="include_head"):
        budget.flops_per_token(base, T, include_head="no")


# ---------------------------------------------------------------------------------------- How to Loop

def htl(n_layer, d, mlp, q, kv, loop=LoopConfig()):
    return ModelConfig(vocab_size=128_256, block_size=8192, n_layer=n_layer, d_model=d, n_head=q, n_kv_head=kv,
                       head_dim=128, d_ff=mlp, loop=loop)


def htl_non_embedding(cfg):
    b = budget.param_breakdown(cfg)
    return b["blocks"] - b["norms"] + b["head"]                # its example counts no norm gains


def test_how_to_loop_numbers():
    one_b = htl(16, 2048, 5632, 16, 2)
    N = htl_non_embedding(one_b)
    assert N == 967_311_360                                     # Table 1, "1B"
    two = replace(one_b, loop=LoopConfig(0, 16, 2))            # full-stack, two loops
    assert htl_non_embedding(two) == N
    C2 = budget.flops_per_token(two, 8192, convention="howtoloop") * 80 * N
    C1 = budget.flops_per_token(one_b, 8192, convention="howtoloop") * 160 * N
    assert f"{C2:.2e}" == "1.07e+21" and f"{C1:.2e}" == "1.19e+21"
    assert budget.kv_bytes_per_token(one_b) == 16 * 1024        # 16 KiB per token per loop (bf16)
    assert budget.kv_bytes_per_token(two) * 8192 == 256 * 2**20


@pytest.mark.parametrize("loops,percent", [(2, "1.1%"), (4, "2.1%"), (8, "4.3%")])
def test_how_to_loop_adapter_overhead(loops, percent):
    base = htl(10, 1280, 3584, 10, 1)
    lora = replace(base, loop=LoopConfig(0, 10, loops, adapter="lora", adapter_rank=8))
    extra = budget.count_params(lora)["blocks"] - budget.count_params(base)["blocks"]
    assert f"{extra / htl_non_embedding(base):.1%}" == percent


# ---------------------------------------------------------------------------------------- SMELT

def test_sparsity_eq1_and_appendix_a_200m_baselines():
    assert budget.sparsity(1.0, 10.0, 1.0, 1.0) == pytest.approx(0.9)
    assert budget.sparsity(2.0, 10.0, 1.0, 1.0) == pytest.approx(0.8)
    published = {8: (0.207, 0.21, 0.0), 64: (0.207, 1.32, 84.3), 192: (0.209, 3.87, 94.6), 336: (0.212, 6.74, 96.9)}
    for E, (active, total, S) in published.items():
        cfg = paper_cfg(1280, 12, 432, 128, 10, E)
        c = budget.count_params(cfg)
        assert round(c["active"] / 1e9, 3) == active and round(c["blocks"] / 1e9, 2) == total
        s = budget.config_sparsity(cfg, configs.PAPER_DOC_LEN, include_head=False)
        assert round(100 * s, 1) == S
    ctl = budget.dense_control(paper_cfg(1280, 12, 432, 128, 10, 192, LoopConfig(4, 6, 2)))
    assert ctl.n_experts == 8 and ctl.top_k == 8 and not ctl.loop.active and ctl.d_model == 1280


# The paper's own SMELT configs (H and experts published; expert width and heads solved from its
# parameter columns) reproduce its published ratios under our accounting at PAPER_DOC_LEN. The doc
# length was read off the 200M example; the 600M and 1.6B rows are independent checks.
PAPER_PAIRS = [  # Baseline (H, L, F, hd, n_head, E), SMELT (...), published (active B, total B, F, KV)
    ((1280, 12, 432, 128, 10, 192), (1056, 12, 352, 88, 12, 288), (0.142, 3.89, 1.029, 1.031)),
    ((1792, 20, 600, 128, 14, 192), (1512, 20, 472, 84, 18, 288), (0.453, 12.44, 1.024, 0.984)),
    ((2304, 30, 768, 128, 18, 64), (1848, 30, 640, 84, 22, 96), (1.081, 10.45, 1.000, 0.984)),
    ((2304, 30, 768, 128, 18, 336), (1848, 30, 640, 84, 22, 504), (1.103, 53.90, 1.008, 0.984)),
]


def test_200m_example_leaves_the_head_out():
    """SMELT 3.2's example: Baseline 200M S~95% at 1.33e9 FLOPs/token, SMELT (H 1056, 288 experts) +2.9 %.
    Without the head our count gives both; a 1280 x 128,256 head alone would add 0.99e9 (+74 %)."""
    B = paper_cfg(1280, 12, 432, 128, 10, 192)
    S = paper_cfg(1056, 12, 352, 88, 12, 288, loop=SMELT.at(12))
    ctx = configs.PAPER_DOC_LEN
    assert round(budget.flops_per_token(B, ctx) / 1e9, 2) == 1.33          # default: no head
    assert round(100 * (budget.flops_per_token(S, ctx) / budget.flops_per_token(B, ctx) - 1), 1) == 2.9
    head = budget.flops_per_token(B, ctx, include_head=True) - budget.flops_per_token(B, ctx)
    assert head == 6 * 1280 * configs.PAPER_VOCAB and head / 1.33e9 > 0.7   # no room for it in 1.33e9


@pytest.mark.parametrize("base,smelt,pub", PAPER_PAIRS)
def test_paper_configs_reproduce_published_ratios(base, smelt, pub):
    B = paper_cfg(*base)
    S = paper_cfg(*smelt, loop=SMELT.at(base[1]))
    c = budget.count_params(S)
    ctx = configs.PAPER_DOC_LEN
    F = budget.flops_per_token(S, ctx, include_head=False) / budget.flops_per_token(B, ctx, include_head=False)
    assert round(c["active"] / 1e9, 3) == pub[0] and round(c["blocks"] / 1e9, 2) == pub[1]
    assert abs(F - pub[2]) < 0.001
    assert round(budget.kv_bytes_per_token(S) / budget.kv_bytes_per_token(B), 3) == pub[3]


# ---------------------------------------------------------------------------------------- matching

def assert_matched(base, loop, cfg, rep):
    assert rep["within_tolerance"], rep["message"]
    assert abs(rep["flops_ratio"] - 1) <= 0.04 and abs(rep["params_ratio"] - 1) <= 0.01 and abs(rep["kv_ratio"] - 1) <= 0.04
    assert rep["flops_ratio"] >= 1 - 1e-9        # never less compute than the Baseline (issue 23.1)
    assert budget.within_tolerance(rep["flops_ratio"], rep["params_ratio"], rep["kv_ratio"])
    assert cfg.n_layer == base.n_layer and cfg.top_k == base.top_k and cfg.loop == loop
    assert cfg.vocab_size == base.vocab_size and cfg.d_model <= base.d_model


# Document lengths the presets' data can have (the tiny corpus measures 120 at block 128): the ladder
# is matched at the measured one, so every cell must match within SMELT's tolerances across the range.
# tiny from 64: at 40 the t40 and t56 S = 0 controls find no match (docs/configs.md); its corpus measures 120.9
DOC_LENGTHS = {"smoke": (32, 48, 62.7, 64), "tiny": (64, 96, 120.4, 128), "small": (200, 400, 600, 800, 1024)}


@pytest.mark.parametrize("preset", ["smoke", "tiny", "small"])
def test_match_presets_within_tolerance_and_buildable(preset):
    for ctx in DOC_LENGTHS[preset]:
        for cell in budget.ladder_cells(preset, ctx):
            base, cfg, rep = (ModelConfig.from_dict(cell["baseline"]), ModelConfig.from_dict(cell["smelt"]),
                              cell["match"]["smelt"])
            assert cfg.loop == SMELT.at(base.n_layer) and cfg.loop.length >= 2
            assert_matched(base, cfg.loop, cfg, rep)
            assert not rep["include_head"] and rep["ctx_len"] == ctx        # SMELT's F: no head, at the doc length
            F = budget.flops_per_token(cfg, ctx, include_head=False) / budget.flops_per_token(base, ctx, include_head=False)
            assert F == pytest.approx(rep["flops_ratio"]) and 1 - 1e-9 <= F <= 1.04
            assert cfg.n_experts > base.n_experts                   # narrower, more experts (SMELT 3.2)
            assert cfg.hd >= 16 and base.hd >= 16                    # CUDA flex attention's minimum
            assert rep["params_ratio"] == budget.count_params(cfg)["blocks"] / budget.count_params(base)["blocks"]
    for scale, label, base in budget.preset_baselines(preset):
        if preset == "tiny":
            model = GPT(base)
            c = budget.count_params(base)
            assert sum(p.numel() for p in model.parameters()) == c["blocks"] + c["embedding"] + c["head"]


# Fixed document lengths (no corpus needed): tiny's measured one, and one from small's tested range. At 200, 512
# and from 768 up one small cell still moves further (docs/budget.md, "The matcher moves smoothly").
SMOOTH_CTX = {"tiny": 120.4, "small": 600}


def _one_step(a: ModelConfig, b: ModelConfig, o: dict) -> bool:
    """b is a neighbour of a: d_model one step; n_kv_head one head, the KV width one head_dim; n_head one group,
    the query width one group of heads; d_ff one step or 10 % (what a d_model or expert step rebalances);
    n_experts within one multiple or 3 % of the count that keeps a's expert pool at b's expert size."""
    def per_expert(c):
        return budget.count_params(replace(c, n_experts=c.n_experts + 1))["blocks"] - budget.count_params(c)["blocks"]
    head, group = max(a.hd, b.hd), max(a.n_kv_head, b.n_kv_head)
    pool = a.n_experts * per_expert(a) / per_expert(b)
    return (abs(b.d_model - a.d_model) <= o["d_multiple"]
            and abs(b.n_kv_head - a.n_kv_head) <= 1 and abs(b.n_kv_head * b.hd - a.n_kv_head * a.hd) <= head
            and abs(b.n_head - a.n_head) <= group and abs(b.n_head * b.hd - a.n_head * a.hd) <= group * head
            and abs(b.d_ff - a.d_ff) <= max(o["ff_multiple"], 0.10 * a.d_ff)
            and abs(b.n_experts - pool) <= max(o["expert_multiple"], 0.03 * a.n_experts))


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_match_moves_smoothly(preset, monkeypatch):
    """issue 53.3: scaling one of the Baseline's F, blocks or KV by +-0.5 % in what `match` reads (budget._counts)
    moves every sparse cell's matched geometry by at most one step (_one_step). The old rule (least bucketed
    mismatch first) moved d_ff 36 / 24 experts to d_ff 10 / 82 on a 0.25 % change. Not the S = 0 % controls:
    with 3-16 experts N's +-1 % holds only at isolated grid points (t40: the only geometries with a neighbour
    within tolerance under every perturbation have d_ff 10 of the Baseline's 80; docs/budget.md)."""
    ctx, search, counts, scale = SMOOTH_CTX[preset], budget.preset_search(preset), budget._counts, {}
    monkeypatch.setattr(budget, "_counts", lambda cfg, c, o: tuple(
        x * s for x, s in zip(counts(cfg, c, o), scale.get(id(cfg), (1, 1, 1)))))
    moved = []
    for scale_name, label, base in budget.preset_baselines(preset):
        if label == configs.CONTROL_LABEL:
            continue
        loop, o = SMELT.at(base.n_layer), budget._search_options(base, search)
        cfg, rep = budget.match(base, loop, ctx, **search)
        assert rep["within_tolerance"], (scale_name, label, rep["message"])
        for term in range(3):
            for f in (0.995, 1.005):
                scale[id(base)] = tuple(f if i == term else 1 for i in range(3))
                other, _ = budget.match(base, loop, ctx, **search)
                scale.clear()
                if not _one_step(cfg, other, o):   # (d_model, n_head, n_kv_head, head_dim, d_ff, n_experts)
                    moved.append((scale_name, label, ("F", "N", "KV")[term], f, *(
                        (c.d_model, c.n_head, c.n_kv_head, c.hd, c.d_ff, c.n_experts) for c in (cfg, other))))
    assert not moved, moved


def test_tolerance_check_is_one_sided_in_flops():
    """One check (budget.within_tolerance) for matcher, ladder and results: F in [1, 1.04], N +-1 %, KV +-4 %."""
    assert budget.tolerance_bands() == {"flops": (1.0, 1.04), "params": (0.99, 1.01), "kv": (0.96, 1.04)}
    assert budget.within_tolerance(1.0, 1.0, 1.0) and budget.within_tolerance(1.04, 0.99, 0.96)
    for bad in ((0.999, 1.0, 1.0), (1.041, 1.0, 1.0), (1.02, 1.011, 1.0), (1.02, 1.0, 0.959)):
        assert not budget.within_tolerance(*bad), bad
    assert budget.mismatch(1.02, 1.0, 1.0) == 0.0 and budget.mismatch(1.0, 1.0, 1.02) == pytest.approx(1.0)
    grid = budget.mismatch(np.array([0.98, 1.02, 1.05]), np.ones(3), np.ones(3))
    assert grid == pytest.approx([budget.mismatch(f, 1, 1) for f in (0.98, 1.02, 1.05)])
    assert budget.within_tolerance(1.0, 1.0, 1.05, {"kv": 0.06}) and not budget.within_tolerance(1.0, 1.0, 1.05)


@pytest.mark.parametrize("preset", ["smoke", "tiny", "small", "paper"])
def test_ladder_table_uses_the_shared_check(preset):
    """The ladder table's ok column is budget.within_tolerance of its printed ratios, and every cell of the
    smoke, tiny, small and paper ladders gives SMELT at least its Baseline's F (at the results' doc length)."""
    # data is not prepared on a fresh machine: the measured document lengths of smoke / tiny data, and one from small's
    # tested range (the paper preset has its own fixed length)
    ctx = {"smoke": 62.7, "tiny": 120.4, "small": 800}.get(preset)
    table = budget.ladder(preset, ctx)
    rows = [r for r in table if r["arch"] == "SMELT"]
    for base, r in zip(table[0::2], table[1::2]):            # (Baseline, SMELT) per cell
        assert r["within_tolerance"] == budget.within_tolerance(r["flops_ratio"], r["params_ratio"], r["kv_ratio"])
        assert r["within_tolerance"] and 1.0 <= r["flops_ratio"] <= 1.04, r
        assert r["flops_ratio"] == pytest.approx(r["flops"] / base["flops"], rel=1e-12)      # F without the head
        assert r["flops_ratio_with_head"] == pytest.approx(r["flops_with_head"] / base["flops_with_head"], rel=1e-12)


def test_small_ladder_is_8_aligned():
    """issue 24.2: d_model, d_ff and head_dim multiples of 8 (torch._grouped_mm's "auto", flex tiles), still matched."""
    for ctx in DOC_LENGTHS["small"]:
        for cell in budget.ladder_cells("small", ctx):
            for cfg in (cell["baseline"], cell["smelt"]):
                assert all(cfg[k] % 8 == 0 for k in ("d_model", "d_ff", "head_dim")), cfg
            assert cell["match"]["smelt"]["within_tolerance"] and cell["smelt"]["top_k"] == 8
    assert all(ladder["top_k"] == 8 for ladder in (configs.LADDERS[p] for p in ("small", "medium", "paper")))


def test_paper_ladder_uses_the_published_smelt_geometry():
    """The paper preset's sparse cells are Appendix A's SMELT models (configs.PAPER_SMELT): published H and
    experts, and the published F and KV ratios to the printed digits; its S=0% cells are matched."""
    rows = budget.ladder("paper")
    cells = budget.ladder_cells("paper", configs.PAPER_DOC_LEN)
    for cell, row in zip(cells, rows[1::2]):
        published = (cell["scale"], cell["sparsity_label"]) in configs.PAPER_SMELT
        assert cell["match"]["smelt"]["source"] == ("published" if published else "matched")
        assert published == (cell["sparsity_label"] != configs.CONTROL_LABEL)
        if published:
            assert (row["d_model"], row["n_experts"]) == (row["paper_d_model"], row["paper_n_experts"])
            assert abs(row["flops_ratio"] - row["paper_flops_ratio"]) < 0.0015
            assert round(row["kv_ratio"], 3) == row["paper_kv_ratio"]
    other = budget.ladder_cells("paper", configs.PAPER_DOC_LEN, arms={"r3": LoopSpec(n_loops=3)})   # r = 3: matched
    assert {c["match"]["r3"]["source"] for c in other} == {"matched"}


def test_plan_epochs():
    """configs.plan_epochs: (stable + decay) x batch x block over the training stream (branches share the decay
    data); the small plan reads no token twice while >= 85 % of its planned tokens reach the training stream
    (corpus.prepare holds the rest out for validation; measured: tiny 88 %, small 94 %)."""
    plan = configs.Plan(data="tiny", ladder="tiny", block_size=128, batch_size=4, lr=1e-3, warmup_steps=1,
                        stable_steps=90, branch_steps=[30, 90], decay_steps=10, eval_tokens=64)
    assert configs.plan_epochs(plan, 100 * 4 * 128) == 1.0 and configs.plan_epochs(plan, 400 * 128) == 1.0
    assert configs.plan_epochs(plan) == 100 * 4 * 128 / (5 * configs.DATA_PRESETS["tiny"].tokens_per_domain)
    small = configs.PLANS["small"]
    assert configs.plan_epochs(small, int(0.85 * configs.DATA_PRESETS["small"].planned_tokens)) < 1
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="train_tokens"):
            configs.plan_epochs(plan, bad)


def test_small_plan_is_shaped_to_decide_its_scaling_claims():
    """The small grid's fits can decide (README, "The small grid"): >= 10 fitted cells per architecture (a cell
    bootstrap over fewer decides nothing), every scale in every sparse column, >= 4 endpoints over D >= 6x
    (the earlier 6 cells and 3 endpoints over 3.5x were seldom identified: scripts/grid_power.py), S = 0 controls."""
    from lab import stats
    plan = configs.PLANS["small"]
    cells = {(c["scale"], c["sparsity_label"]) for c in budget.ladder_cells("small", 1024.0)}
    kept = set(plan.cells or cells)                     # Plan.cells None: the whole ladder
    assert kept <= cells and plan.repeat in kept
    fitted = [c for c in kept if c[1] != configs.CONTROL_LABEL]
    assert len(fitted) >= stats.MIN_BOOTSTRAP_UNITS
    assert len(fitted) == len({s for s, _ in fitted}) * len({lab for _, lab in fitted})   # a full grid
    assert any(lab == configs.CONTROL_LABEL for _, lab in kept)
    ends = [b + plan.decay_steps for b in plan.branch_steps]
    assert len(ends) >= 4 and ends[-1] / ends[0] >= 6
    assert plan.branch_steps[0] >= plan.warmup_steps and plan.branch_steps[-1] == plan.stable_steps


def test_presets_have_s0_control_cells():
    for preset in ("smoke", "tiny", "small", "paper"):
        cells = budget.preset_baselines(preset)
        scales = {s for s, _, _ in cells}
        for scale in scales:   # every scale has its S = 0 control: every expert active, S measured 0
            ctl = [b for s, lab, b in cells if s == scale and lab == configs.CONTROL_LABEL]
            assert len(ctl) == 1 and ctl[0].n_experts == ctl[0].top_k
            assert budget.config_sparsity(ctl[0], 64) == pytest.approx(0.0, abs=1e-12)


def test_ladder_and_main_job_share_one_builder(tmp_path):
    """budget.py --ladder P and the main job build the ladder with the same function at the same measured
    document length, so they print the same configs (issue: d_model 80 vs 84 when they differed)."""
    import data as data_mod
    from lab import corpus
    import reproduce
    corpus.prepare("smoke")
    d = data_mod.TokenData(data_mod.default_data_dir("smoke"))
    ctx = budget.preset_doc_length("smoke", d)
    assert ctx == data_mod.measured_doc_length(d, configs.LADDERS["smoke"]["block"]) and 1 < ctx <= 64
    rows = budget.ladder("smoke")
    cells = reproduce.stage_ladder(configs.PLANS["smoke"], d, tmp_path)
    smelts = [r for r in rows if r["arch"] == "SMELT"]
    assert len(cells) == len(smelts)
    for cell, row in zip(cells, smelts):
        assert cell["smelt"]["d_model"] == row["d_model"] and cell["smelt"]["n_experts"] == row["n_experts"]
        assert cell["ctx_len"] == pytest.approx(row["ctx_len"])
    assert budget.preset_doc_length("paper") == configs.PAPER_DOC_LEN


def test_paper_ladder_every_cell_within_tolerance():
    rows = budget.ladder("paper")
    assert len(rows) == 32
    for base, smelt in zip(rows[::2], rows[1::2]):
        assert round(100 * base["S"], 1) == base["paper_S"]         # the rebuilt Baselines are the paper's
        assert smelt["within_tolerance"]
        assert abs(smelt["S"] - base["S"]) < 0.02 or base["paper_S"] == 0.0
        assert 0.85 < smelt["d_model"] / smelt["paper_d_model"] < 1.1
    text = budget.format_ladder(rows)
    assert "1.6B" in text and "NO" not in text


@pytest.mark.parametrize("loop", [LoopConfig(4, 6, 3), LoopConfig(0, 12, 2), LoopConfig(4, 6, 2, adapter="matrix"),
                                  LoopConfig(4, 6, 2, parallel=True, kv_window=64), LoopConfig(4, 6, 2, part="attn")])
def test_match_other_loop_specs_200m(loop):
    base = paper_cfg(1280, 12, 432, 128, 10, 192)
    cfg, rep = budget.match(base, loop, configs.PAPER_DOC_LEN, include_head=False)
    assert_matched(base, loop, cfg, rep)


def test_match_with_head_and_howtoloop_convention():
    base = paper_cfg(2304, 30, 768, 128, 18, 64)
    for conv in budget.CONVENTIONS:
        cfg, rep = budget.match(base, SMELT.at(30), 4096, convention=conv)
        assert_matched(base, cfg.loop, cfg, rep)


def test_match_warns_when_nothing_fits():
    dense = ModelConfig(vocab_size=4096, block_size=256, n_layer=4, d_model=64, n_head=4, n_kv_head=2, head_dim=16, d_ff=128)
    with pytest.warns(RuntimeWarning, match="no candidate within tolerance"):
        cfg, rep = budget.match(dense, LoopConfig(1, 2, 2), 256)
    assert not rep["within_tolerance"] and "no candidate" in rep["message"]
    base = budget.preset_baselines("tiny")[0][2]
    with pytest.warns(RuntimeWarning):
        _, rep = budget.match(base, LoopConfig(1, 2, 2), 100, tolerances={"params": 1e-9})
    assert not rep["within_tolerance"]


def test_bad_inputs_raise_clear_errors():
    base = budget.preset_baselines("tiny")[0][2]
    loop = SMELT.at(base.n_layer)
    for ctx in (0, -5, None, "256", 10_000, float("nan")):
        with pytest.raises(ValueError, match="ctx_len"):
            budget.match(base, loop, ctx)
    with pytest.raises(ValueError, match="ctx_len"):
        budget.flops_per_token(base, 0)
    with pytest.raises(ValueError, match="unknown search option"):
        budget.match(base, loop, 100, d_multiplier=8)
    with pytest.raises(ValueError, match="LoopConfig"):
        budget.match(base, {"start": 1}, 100)
    with pytest.raises(ValueError, match="span"):
        budget.match(base, LoopConfig(3, 4, 2), 100)
    with pytest.raises(ValueError, match="tolerances"):
        budget.match(base, loop, 100, tolerances={"flops": 0})
    with pytest.raises(ValueError, match="d_range"):
        budget.match(base, loop, 100, d_range=(0.9, 0.5))
    with pytest.raises(ValueError, match="convention"):
        budget.flops_per_token(base, 64, convention="kaplan")
    with pytest.raises(ValueError, match="ModelConfig"):
        budget.count_params({"d_model": 64})
    with pytest.raises(ValueError, match="bytes_per_elem"):
        budget.kv_bytes_per_token(base, 0)
    with pytest.raises(ValueError, match="N0"):
        budget.sparsity(1.0, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="preset"):
        budget.preset_baselines("huge")


def test_presets_sparsity_labels_and_spans():
    for preset in ("tiny", "small"):
        for scale, label, base in budget.preset_baselines(preset):
            s = budget.config_sparsity(base, DOC_LENGTHS[preset][-2])
            assert abs(100 * s - float(label[2:-1])) < 3.0, (scale, label, s)
            start, length = middle_span(base.n_layer)
            assert length >= 2 and start >= 1


def test_cli(capsys, tmp_path):
    out = tmp_path / "ladder_tiny.json"
    budget.main(["--ladder", "tiny", "--ctx-len", "120", "--out-dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert "SMELT" in text and "10/10 cells within tolerance" in text and "document length 120.0 (given)" in text
    assert len(json.loads(out.read_text())) == 20
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(budget.preset_baselines("tiny")[0][2].to_json())
    budget.main(["--config", str(cfg_file)])
    assert "flops_per_token" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- one count per sub-layer

def _group_of(name: str) -> str:
    """param_breakdown's group of a GPT parameter, read off its module path."""
    if name.startswith("tok_emb."):
        return "embedding"
    if name.startswith("lm_head."):
        return "head"
    if "adapters" in name:
        return "adapters"
    if "kv_gate" in name:
        return "kv_gates"
    if name.startswith("plt."):
        return "plt"
    if "norm" in name:
        return "norms"
    return {"attn": "attention", "mlp": "ffn"}[name.split(".")[2]]


SPREAD = {   # dense, MoE, looped, shared experts, GQA / MHA / MQA, tied and untied heads, adapters, PLT
    "dense_gqa": small(),
    "dense_mha_tied": replace(small(tied=True), n_kv_head=4),
    "moe": small(4),
    "moe_mqa_looped": replace(small(4, LOOPS["mid_x2"]), n_kv_head=1),
    "moe_shared": small(4, n_shared_experts=1),
    "moe_shared2_looped_tied": small(6, LOOPS["lora_x3"], True, n_shared_experts=2),
    "dense_matrix_adapters": small(loop=LOOPS["matrix_x3"]),
    "dense_softmax_per_layer": small(loop=LOOPS["softmax_per_layer"], tied=True),
    "moe_shared_plt_window": small(4, LOOPS["plt_gate_window_lora"], n_shared_experts=1),
    "dense_plt_half": small(loop=LOOPS["plt_norm_half"]),
}


@pytest.mark.parametrize("name", SPREAD)
def test_count_params_equals_the_built_model_group_by_group(name):
    cfg = SPREAD[name]
    model = GPT(cfg)
    built = {}
    for n, p in model.named_parameters():
        built[_group_of(n)] = built.get(_group_of(n), 0) + p.numel()
    b, c = budget.param_breakdown(cfg), budget.count_params(cfg)
    for g in ("attention", "ffn", "norms", "adapters", "kv_gates", "plt", "embedding", "head"):
        assert b[g] == built.get(g, 0), g
    assert c["embedding"] == built["embedding"] and c["head"] == built.get("head", 0)
    assert c["blocks"] == sum(v for g, v in built.items() if g not in ("embedding", "head"))
    idle = sum(p.numel() // cfg.n_experts * (cfg.n_experts - cfg.top_k) for n, p in model.named_parameters()
               if n.endswith((".mlp.w_in", ".mlp.w_out")))       # the routed experts a token skips
    assert c["active"] == c["blocks"] - idle


def test_shared_experts_are_counted_active_and_executed():
    base = small(4, LOOPS["mid_x2"])
    shared = replace(base, n_shared_experts=2)
    cb, cs = budget.count_params(base), budget.count_params(shared)
    one = 3 * base.d_model * base.d_ff                              # one dense SwiGLU of the expert width
    assert cs["blocks"] - cb["blocks"] == cs["active"] - cb["active"] == base.n_layer * 2 * one
    mlp_visits = budget.plan_of(base).mlp_visits
    for conv in budget.CONVENTIONS:
        for head in (True, False):
            assert (budget.flops_per_token(shared, 12, conv, head) - budget.flops_per_token(base, 12, conv, head)
                    == 6 * mlp_visits * 2 * one)
    assert budget.kv_bytes_per_token(shared) == budget.kv_bytes_per_token(base)
    assert budget.dense_control(shared).n_shared_experts == 2        # S is measured with the shared experts kept
    with pytest.raises(ValueError, match="n_shared_experts"):
        small(n_shared_experts=1)                                   # dense: no routed experts to sit beside
    with pytest.raises(ValueError, match="n_shared_experts"):
        small(4, n_shared_experts=-1)


def test_match_keeps_the_shared_experts():
    base = replace(budget.preset_baselines("tiny")[-1][2], n_shared_experts=1)
    loop = SMELT.at(base.n_layer)
    cfg, rep = budget.match(base, loop, 100, **configs.LADDERS["tiny"]["search"])
    assert cfg.n_shared_experts == 1
    assert_matched(base, loop, cfg, rep)
    assert rep["params_ratio"] == budget.count_params(cfg)["blocks"] / budget.count_params(base)["blocks"]
    GPT(cfg)


def test_loop_spec_places_the_span():
    assert SMELT.at(8) == LoopSpec(2, 0.5, "middle").at(8) == LoopConfig(2, 4, 2)
    assert LoopSpec(n_loops=3, span_fraction=0.75).at(8) == LoopConfig(1, 6, 3)
    assert LoopSpec(placement="first").at(8) == LoopConfig(0, 4, 2)
    assert LoopSpec(placement="last", part="attn", adapter="lora").at(5) == LoopConfig(2, 3, 2, part="attn",
                                                                                       adapter="lora")
    assert SMELT.tag() == "" and LoopSpec(n_loops=3, placement="last", n_shared_experts=1).tag() == "_r3_last_shared1"
    for bad in (dict(n_loops=0), dict(n_loops=2.5), dict(span_fraction=1.5), dict(placement="end"),
                dict(part="ffn"), dict(adapter="dora"), dict(n_shared_experts=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LoopSpec(**bad)


def test_ladder_knobs_flow_from_the_caller():
    default = budget.ladder_cells("smoke", 40)
    explicit = budget.ladder_cells("smoke", 40, arms={"smelt": LoopSpec(2, 0.5, "middle", "both", "none", 0)})
    for a, b in zip(default, explicit):
        assert a["baseline"] == b["baseline"] and a["smelt"] == b["smelt"]
    spec = LoopSpec(n_loops=3, span_fraction=0.75, placement="last", n_shared_experts=1)
    for cell in budget.ladder_cells("smoke", 40, arms={"smelt": spec}):
        base, cfg = ModelConfig.from_dict(cell["baseline"]), ModelConfig.from_dict(cell["smelt"])
        assert cfg.loop == spec.at(base.n_layer) == LoopConfig(1, 3, 3)
        assert base.n_shared_experts == cfg.n_shared_experts == 1
    rows = budget.ladder("smoke", 40, spec=LoopSpec(n_loops=3, span_fraction=0.75))
    assert {r["loop"] for r in rows if r["arch"] == "SMELT"} == {"1-3 x3"}


def test_cli_loop_knobs(capsys):
    budget.main(["--ladder", "smoke", "--ctx-len", "40", "--loops", "3", "--span-fraction", "0.5",
                 "--placement", "last", "--shared-experts", "1"])
    assert "3-4 x3" in capsys.readouterr().out
    for flag, value in (("--span-fraction", "1.5"), ("--loops", "0"), ("--shared-experts", "-1"),
                        ("--placement", "end")):
        with pytest.raises(SystemExit):
            budget.build_parser().parse_args([flag, value])
        assert flag in capsys.readouterr().err
    with pytest.raises(checks.UserError, match="n_loops"):   # a value the types pass but LoopSpec refuses
        budget.main(["--ladder", "smoke", "--loops", "65"])


def test_match_target_matches_another_configs_budgets():
    """target=ref: the budgets matched are ref's, the depth and the search centre base_cfg's; target=base_cfg
    is the default match; the report's ratios recount against ref through the scalar path."""
    ref = budget.preset_baselines("tiny")[-1][2]
    loop = SMELT.at(ref.n_layer)
    search = budget.preset_search("tiny")
    assert budget.match(ref, loop, 100, target=ref, **search)[0] == budget.match(ref, loop, 100, **search)[0]
    center = replace(ref, n_layer=ref.n_layer + 1, d_model=ref.d_model - 8)
    cfg, rep = budget.match(center, LoopConfig(), 100, target=ref, d_range=(0.75, 1.25), hd_range=(0.5, 2.5),
                            n_kv_heads=(1, 2, 3, 4), **search)
    assert cfg.n_layer == ref.n_layer + 1 and not cfg.loop.active and rep["within_tolerance"], rep["message"]
    assert rep["flops_ratio"] == pytest.approx(budget.flops_per_token(cfg, 100) / budget.flops_per_token(ref, 100))
    assert rep["params_ratio"] == pytest.approx(budget.count_params(cfg)["blocks"] / budget.count_params(ref)["blocks"])
    assert rep["kv_ratio"] == pytest.approx(budget.kv_bytes_per_token(cfg, 2, 100) / budget.kv_bytes_per_token(ref, 2, 100))
    with pytest.raises(ValueError, match="expected a model.ModelConfig, got dict"):
        budget.match(center, LoopConfig(), 100, target=ref.to_dict())


def test_plt_kv_window_flops_by_hand():
    """PLT KV sharing (kv_window w) adds, on each span layer's later loop, a per-head gate (n_head x D) and
    attention over w window keys: mean min(t, w) over t in (0, ctx] = w - w^2 / (2 ctx) for w < ctx."""
    base = small(loop=LoopConfig(1, 2, 2, parallel=True))
    win = small(loop=LoopConfig(1, 2, 2, parallel=True, kv_window=4))
    ctx, q = 16, base.n_head * base.hd
    window_visits = 2                                     # layers 1 and 2, loop 2 each
    keys = 4 - 4 ** 2 / (2 * ctx)
    extra = window_visits * (6 * base.n_head * base.d_model + 12 * q * keys)
    assert budget.flops_per_token(win, ctx) - budget.flops_per_token(base, ctx) == pytest.approx(extra, rel=1e-12)
    assert budget.count_params(win)["blocks"] - budget.count_params(base)["blocks"] == 2 * base.n_head * base.d_model


def test_plan_runs_names_every_run_and_repeats_one_cell():
    """Each cell's Baseline then SMELT at seed 0, and the repeated cell (its scale and label both) again at seeds
    1 .. train_seeds-1, each in OUT/runs/<cell key>_<arch>[_seedN]; without a plan (or a repeat) one seed each."""
    from pathlib import Path
    ladder = [{"scale": s, "sparsity_label": lab, "match": {"smelt": {}}}
              for s, lab in (("t64", "S=0%"), ("t64", "S~85%"), ("t96", "S~85%"))]
    plan = replace(configs.PLANS["tiny"], repeat=("t64", "S~85%"), train_seeds=3)
    runs = configs.plan_runs(Path("out"), ladder, plan)
    want = ["t64_S0_baseline", "t64_S0_smelt", "t64_S85_baseline", "t64_S85_smelt", "t64_S85_baseline_seed1",
            "t64_S85_smelt_seed1", "t64_S85_baseline_seed2", "t64_S85_smelt_seed2", "t96_S85_baseline", "t96_S85_smelt"]
    assert [r.name for r in runs] == want and all(r.dir == Path("out") / "runs" / r.name for r in runs)
    assert [(r.arch, r.seed, r.key) for r in runs[4:6]] == [("baseline", 1, "t64_S85"), ("smelt", 1, "t64_S85")]
    one = [n for n in want if "seed" not in n]
    assert [r.name for r in configs.plan_runs(Path("out"), ladder)] == one
    assert [r.name for r in configs.plan_runs(Path("out"), ladder, replace(plan, repeat=None))] == one
    assert configs.run_dirs(Path("out"), ladder)[1] == (ladder[0], "smelt", Path("out/runs/t64_S0_smelt"))
    three = [{**c, "match": {"smelt": {}, "last": {}}} for c in ladder[:1]]   # arms in the cell's order, by name
    assert [r.name for r in configs.plan_runs(Path("out"), three)] == ["t64_S0_baseline", "t64_S0_smelt", "t64_S0_last"]


def test_presets_are_consistent():
    """Each plan trains at its ladder's context and names a data preset; a data preset's planned tokens are
    its domains' (smoke fills two); an unknown data preset is refused by name."""
    for name, plan in configs.PLANS.items():
        assert plan.block_size == configs.LADDERS[plan.ladder]["block"], name
        assert plan.data in configs.DATA_PRESETS, name
    assert configs.DATA_PRESETS["smoke"].planned_tokens == 2 * 150_000
    assert configs.DATA_PRESETS["tiny"].planned_tokens == 5 * 1_000_000
    with pytest.raises(ValueError, match=r"preset must be one of \['small', 'smoke', 'tiny'\], got 'huge'"):
        configs.data_preset("huge")
