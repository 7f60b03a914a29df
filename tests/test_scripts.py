"""The experiment scripts run end to end on the smoke preset and write the JSON they promise.

A representative subset runs in-process through main(argv) with --steps 4 (span sweep, adapters,
PLT with the RMS ratio, the How-to-Loop fixed-compute schedules, decode latency with a 4-token
prompt); every script answers --help; one script runs as `python scripts/NAME.py` from the repo root
to check the sys.path plumbing. The rest (depth / loop-count sweeps, ladder, downstream, probes) share
common.py with these and are run by hand: `python scripts/NAME.py --preset smoke --steps 4`.
How-to-Loop's pure pieces (no 1/r scale in its configs, the fixed-compute token share, bits per byte,
the no-loop curve and its inversion) are pinned against hand-computed cases without training.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import budget
import checks
from loop import SMELT
from model import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["span_sweep", "depth_sweep", "loop_count_sweep", "scaling_ladder", "downstream", "probe_runs",
           "howto_schedules", "howto_adapters", "howto_plt", "decode_latency"]
pytestmark = pytest.mark.usefixtures("scripts_importable")   # scripts/ on sys.path for this module only


@pytest.fixture(autouse=True)
def _keep_threads():
    """The smoke preset pins torch to one thread; give the rest of the session its own setting back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def run(name: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / name
    result = importlib.import_module(name).main(["--preset", "smoke", "--out-dir", str(out), *extra])
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["script"] == name and on_disk["preset"] == "smoke"
    assert (out / "table.md").read_text().startswith("|")
    assert on_disk["rows"] == json.loads(json.dumps(result["rows"], default=float))
    return on_disk


def finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(name).main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--preset" in text and "--out-dir" in text
    assert ("--steps" in text) == (name != "decode_latency")      # decode_latency trains nothing


def test_runs_from_repo_root():
    p = subprocess.run([sys.executable, "scripts/span_sweep.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Table 3.3" in p.stdout


def test_span_sweep(tmp_path):
    r = run("span_sweep", tmp_path, "--steps", "4")
    spans = [row["span"] for row in r["rows"]]
    L = r["rows"][0]["n_layer"]
    assert spans == list(range(0, L + 1, 2)) and spans[-1] == L      # 0 (Baseline) .. full stack
    assert r["steps"] == 4 and r["train"]["stable_steps"] == 4
    for row in r["rows"]:
        assert finite(row["val_loss"], row["flops_ratio"], row["params_ratio"], row["kv_ratio"])
        assert row["effective_layers"] == L + row["span"]              # two passes over the span
        if row["span"]:                                               # matched to the Baseline (SMELT 3.2)
            assert abs(row["flops_ratio"] - 1) < 0.1 and abs(row["params_ratio"] - 1) < 0.05
    assert all(Path(f).is_file() for f in r["figures"])


def check_howto(r: dict) -> None:
    """What every How-to-Loop script's output carries: no 1/r scale, bpb on the loss's own text, the curve."""
    bpt = r["bytes_per_token"]
    assert bpt["tokens"] > 0 and bpt["bytes_per_token"] == pytest.approx(bpt["bytes"] / bpt["tokens"])
    noloop = r["rows"][0]
    assert noloop["loops"] == 1 and noloop["val_tokens"] == bpt["tokens"]    # the same held-out targets
    for row in r["rows"]:
        assert row["residual_scale"] is False
        assert row["bpb"] == pytest.approx(row["val_loss"] / math.log(2) / bpt["bytes_per_token"])
        if row["loops"] > 1:   # a multiplier, or no multiplier and the reason
            assert (finite(row["tokens_multiplier"], row["flops_multiplier"])
                    or (row["tokens_multiplier"] is None and row["note"].startswith("not identified (")))
    curve = r["noloop_curve"]
    assert [p["tokens"] for p in curve["points"]] == sorted(p["tokens"] for p in curve["points"])
    assert len(curve["points"]) >= 4 and curve["points"][-1]["val_loss"] == noloop["val_loss"]
    assert curve["identified"] or curve["why"]


def test_howto_adapters(tmp_path):
    r = run("howto_adapters", tmp_path, "--steps", "4", "--loops", "2")
    rows = {(row["loops"], row["adapter"]): row for row in r["rows"]}
    assert set(rows) == {(1, "-"), (2, "none"), (2, "lora"), (2, "matrix"), (2, "softmax")}
    assert rows[(2, "none")]["adapter_params"] == 0
    assert 0 < rows[(2, "lora")]["adapter_params"] < rows[(2, "matrix")]["adapter_params"]   # + the L x L mixing
    for row in r["rows"]:
        assert finite(row["val_loss"], row["overhead_pct"])
    check_howto(r)


def test_howto_plt(tmp_path):
    from lab import stats
    variants = ["no_loop", "sequential", "unshifted", "plt_add", "plt_add_kv", "plt_norm_gate"]
    r = run("howto_plt", tmp_path, "--steps", "4", "--variants", *variants, "--ratio-tokens", "128")
    rows = {row["variant"]: row for row in r["rows"]}
    assert list(rows) == variants
    assert rows["plt_add_kv"]["kv_ratio"] < rows["plt_add"]["kv_ratio"] == rows["sequential"]["kv_ratio"]
    for v, row in rows.items():
        assert finite(row["val_loss"], *row["rms_ratio"])
        assert len(row["rms_ratio"]) == row["loops"] and all(x > 0 for x in row["rms_ratio"])
        for x, iv, verdict in zip(row["rms_ratio"], row["rms_ratio_interval"], row["rms_ratio_verdict"]):
            assert iv["lo"] <= x == iv["mean"] <= iv["hi"] and iv["n"] > 1 and verdict in stats.VERDICTS
    check_howto(r)


def test_howto_schedules_fixed_compute(tmp_path):
    r = run("howto_schedules", tmp_path, "--steps", "4", "--designs", "full_stack", "--budgets", "compute", "flops")
    noloop, compute, matched = r["rows"]
    assert (compute["budget"], compute["protocol"]) == ("compute", "How-to-Loop")
    assert (matched["budget"], matched["protocol"]) == ("flops_matched (ours)", "extension (ours)")
    # How-to-Loop keeps the model and trains it on fewer tokens, at the no-loop run's training compute
    for k in ("d_model", "n_layer", "blocks", "d_ff"):
        assert compute[k] == noloop[k]
    assert compute["tokens"] < noloop["tokens"] and compute["loops"] == 2
    steps = noloop["tokens"] / (noloop["stable_steps"] + r["train"]["decay_steps"])    # tokens per step
    assert compute["tokens"] == (compute["stable_steps"] + r["train"]["decay_steps"]) * steps
    half_step = 0.5 * steps * compute["flops_h2l"] / (noloop["flops_h2l"] * noloop["tokens"])
    assert abs(compute["compute_ratio"] - 1) <= half_step
    # our extension narrows the model instead and keeps the tokens
    assert matched["d_model"] < noloop["d_model"] and matched["tokens"] == noloop["tokens"]
    check_howto(r)


# -- How-to-Loop's pure pieces ---------------------------------------------------------------

def _dense(n_layer: int = 6):
    from model import ModelConfig
    import common
    return ModelConfig(vocab_size=64, block_size=16, n_layer=n_layer, d_model=16, n_head=2, n_kv_head=1,
                       head_dim=8, d_ff=32, loop=common.howto_loop())


def test_howto_configs_have_no_residual_scale():
    import common
    import howto_adapters
    import howto_plt
    import howto_schedules
    from loop import plan
    base = _dense()
    cfgs = [replace_loop(base, f(base.n_layer, r)) for f in howto_schedules.DESIGNS.values() for r in (2, 4)]
    cfgs += [c for _, _, c in howto_adapters.configs(base, [2, 4], ["none", "lora", "matrix", "softmax"], 2)]
    cfgs += [howto_plt.variant_config(base, v, 2, 4) for v in howto_plt.VARIANTS if howto_plt.VARIANTS[v] is not None]
    assert len(cfgs) == 10 + 8 + 6
    for c in cfgs:
        assert c.loop.active and c.loop.residual_scale is False
        assert all(v.attn_scale == v.mlp_scale == 1.0 for v in plan(c.n_layer, c.loop))   # no 1/r anywhere
    assert howto_plt.variant_config(base, "no_loop", 2, 4).loop.residual_scale is False
    with pytest.raises(ValueError, match="residual_scale"):
        common.howto_loop(start=0, length=2, n_loops=2, residual_scale=True)


def replace_loop(cfg, loop):
    from dataclasses import replace
    return replace(cfg, loop=loop)


def test_compute_share_steps_equalises_training_compute():
    from common import compute_share_steps
    # two loops costing exactly 2x per token: half the tokens (30 + 6 steps -> 18 = 12 stable + 6 decay)
    assert compute_share_steps(30, 6, 1.0, 2.0) == 12
    # How-to-Loop's accounting charges the head once: 2 loops at 1.8x get 20 of 36 steps, compute exactly equal
    assert compute_share_steps(30, 6, 1.0, 1.8) == 14 and (14 + 6) * 1.8 == pytest.approx(36)
    # otherwise compute matches to within half a step
    for ratio in (1.3, 1.45, 1.7, 3.4):
        total = compute_share_steps(60, 8, 1.0, ratio) + 8
        assert abs(total * ratio - 68) <= 0.5 * ratio
    assert compute_share_steps(30, 6, 2.0, 2.0) == 30                              # same cost: same run
    with pytest.raises(ValueError, match="no stable step"):
        compute_share_steps(4, 6, 1.0, 4.0)
    with pytest.raises(ValueError, match="flops_run"):
        compute_share_steps(30, 6, 1.0, 0.0)


class _OneDocData:
    """A held-out set of one source holding one known text, in TokenData's interface."""

    def __init__(self, text: str, vocab: int = 512):
        import data as tokenizer
        self.vocab_size, self.eot = vocab, vocab - 1
        self.sources, self.domains = ["s"], {"s": "code"}
        self._tok = tokenizer.get_tokenizer(vocab)
        self.ids = [self.eot] + self._tok.encode_ordinary(text) + [self.eot]

    def tokenizer(self):
        return self._tok

    def val_batches(self, source, batch_size, block_size, max_tokens=None):
        row = torch.tensor(self.ids)
        yield row[None, :-1], row[None, 1:], torch.zeros(1, len(self.ids) - 1, dtype=torch.long)


def test_bits_per_byte_hand_computed():
    from common import bits_per_byte, val_bytes_per_token
    d = _OneDocData("hello world, héllo")          # 19 UTF-8 bytes (é is two)
    n_text = len(d.ids) - 2
    got = val_bytes_per_token(d, 64, 1024)
    # targets: the text's tokens + the closing <|endoftext|> (0 bytes: a separator, not text)
    assert (got["bytes"], got["tokens"]) == (19, n_text + 1)
    assert got["bytes_per_token"] == pytest.approx(19 / (n_text + 1))
    assert got["by_domain"] == {"code": 19 / (n_text + 1)}
    # 2 ln 2 nats per token at 2 bytes per token = 1 bit per byte; total bits over total bytes
    assert bits_per_byte(2 * math.log(2), 2.0) == pytest.approx(1.0)
    nats = 3.1
    assert bits_per_byte(nats, got["bytes_per_token"]) == pytest.approx(nats * (n_text + 1) / math.log(2) / 19)
    with pytest.raises(ValueError, match="bytes_per_token"):
        bits_per_byte(1.0, 0.0)


def test_noloop_curve_inversion_and_not_identified():
    from common import efficiency, fit_noloop_curve, tokens_to_reach
    E, A, alpha, ref = 2.0, 3.0, 0.5, 16000.0
    curve = lambda D: E + A * (np.asarray(D) / ref) ** -alpha
    D = [1000, 2000, 4000, 8000, 16000]
    fit = fit_noloop_curve(D, curve(D))
    assert fit["identified"] and fit["why"] is None
    assert (fit["E"], fit["A"], fit["alpha"]) == pytest.approx((E, A, alpha), rel=1e-4)
    got, why = tokens_to_reach(fit, float(curve(5000)))
    assert why is None and got == pytest.approx(5000, rel=1e-4)
    # a looped run at 2,500 tokens and 1.6x the no-loop FLOPs per token that reaches the no-loop loss at 5,000:
    # 2x the tokens, 2 / 1.6 = 1.25x the FLOPs (25 % more no-loop compute)
    eff = efficiency(fit, float(curve(5000)), 2500, 1.6, 1.0)
    assert eff["tokens_multiplier"] == pytest.approx(2.0, rel=1e-4)
    assert eff["flops_multiplier"] == pytest.approx(1.25, rel=1e-4)
    assert eff["flops_extra_pct"] == pytest.approx(25, abs=0.01)
    assert eff["note"] is None
    assert efficiency(fit, float(curve(32000)), 8000, 1.0, 1.0)["note"].startswith("extrapolated: x2.00 beyond")
    # not identified: too few points, too narrow a range, non-monotone, a loss below the floor
    for d, l, why in [(D[:3], curve(D[:3]), "3 distinct token counts"),
                      ([1000, 1100, 1200, 1300], curve([1000, 1100, 1200, 1300]), "tokens span only"),
                      (D, np.array([5.0, 4.0, 4.2, 3.5, 3.0]), "non-monotone")]:
        bad = fit_noloop_curve(d, l)
        assert not bad["identified"] and why in bad["why"] and bad["alpha"] is None
        eff = efficiency(bad, 3.0, 1000, 2.0, 1.0)
        assert eff["tokens_multiplier"] is None and eff["flops_multiplier"] is None
        assert eff["note"] == f"not identified ({bad['why']})"
    assert tokens_to_reach(fit, 1.9) == (None, "not identified (loss 1.9000 at or below the fitted no-loop floor "
                                         "E = 2.0000)")
    with pytest.raises(ValueError, match="tokens must be positive"):
        fit_noloop_curve([0, 1, 2, 3], [4, 3, 2, 1])


def test_decode_latency(tmp_path):
    r = run("decode_latency", tmp_path, "--new-tokens", "2", "--prompt", "4")
    rows = {row["model"]: row for row in r["rows"]}
    assert {"unlooped", "sequential_2loop", "plt_2loop", "plt_2loop_kv_shared"} <= set(rows)
    for name in ("unlooped", "sequential_2loop", "plt_2loop"):
        assert finite(rows[name]["ms_per_token"]) and rows[name]["ms_per_token"] > 0
    assert rows["sequential_2loop"]["kv_bytes_per_token"] > rows["unlooped"]["kv_bytes_per_token"]
    assert rows["plt_2loop_kv_shared"]["kv_bytes_per_token"] < rows["plt_2loop"]["kv_bytes_per_token"]
    assert finite(r["plt_ratio"], r["sequential_ratio"])


def test_grid_power_reads_the_preset_shape_and_the_fits_decide(tmp_path):
    """The small plan's shape as scripts/grid_power.py reads it, its fits identified at low noise where the
    earlier shape's are not (seeded: the same datasets every run), and --boot's analysis decides the CE gain at
    noise 0.002 as simulate-and-analyse should."""
    import grid_power
    shape = grid_power.preset_shape("small")
    assert shape["n_scales"] == 4 and shape["sparsities"] == [0.85, 0.95, 0.97] and 4.5 < shape["F_span"] < 5.5
    assert shape["horizons"] == [75 / 490, 160 / 490, 295 / 490, 1.0]
    paper = ["--preset", "small", "--prior", "paper"]          # Table 4.3's surfaces on the shape: the geometric proxy
    new = grid_power.main([*paper, "--out-dir", str(tmp_path / "new"), "--noise", "0.005", "--seeds", "3"])
    old = grid_power.main([*paper, "--out-dir", str(tmp_path / "old"), "--noise", "0.005", "--seeds", "3",
                           "--n-scales", "3", "--sparsities", "0.85", "0.95", "--F-span", "2.92",
                           "--horizons", "140", "280", "490"])
    assert (new["rows"][0]["identified"], old["rows"][0]["identified"]) == (3, 0)
    assert json.loads((tmp_path / "new" / "results.json").read_text())["shape"]["D_span"] == pytest.approx(490 / 75)
    boot = grid_power.main([*paper, "--out-dir", str(tmp_path / "boot"), "--noise", "0.002", "--seeds",
                            "1", "--boot", "12"])["rows"][0]
    assert (boot["reproduced"], boot["not_resolved"], boot["contradicted"]) == (1, 0, 0)   # seeded: decided
    with pytest.raises(checks.UserError, match="below 1"):
        grid_power.main([*paper, "--out-dir", str(tmp_path / "bad"), "--sparsities", "0.85", "95"])
    with pytest.raises(SystemExit):                              # the shape flags belong to the paper prior
        grid_power.main(["--preset", "small", "--out-dir", str(tmp_path / "bad"), "--F-span", "3"])


def test_plan_design_counts_the_fitted_grid_and_checks_the_data_rules_first():
    """reproduce's plan line: the tiny plan's fitted grid (5 S~85 % cells x 3 endpoints, the control left out),
    each architecture's F span, and design_power's data-rule check, which names what a grid lacks without
    simulating; a grid that passes it is simulated (the count is seeded)."""
    import budget
    import configs
    import reproduce
    from lab import scaling_analysis
    plan = configs.PLANS["tiny"]
    ladder = reproduce.plan_cells(plan, budget.ladder_cells("tiny", 120.9, arms=plan.arms))
    shape = scaling_analysis.design_shape(plan, ladder)
    assert (shape["n_cells"], shape["points"], shape["sparsities"]) == (5, 15, [0.85])
    assert shape["D_span"] == pytest.approx(1200 / 300) and 3.0 < shape["F_span"] < 3.6
    assert shape["C_span"] == pytest.approx(shape["F_span"] * shape["D_span"])
    short = dict(shape, points=8, D_span=1.5, C_span=4.0)
    why = scaling_analysis.design_power(short)["why"]
    assert why == ["too few points: 8 distinct for 5 coefficients (< 2 per coefficient)",   # scaling.identify's words
                   "compute range: compute spans only 4x (< 10x)", "D range: D spans only 1.5x (< 2x)"]
    two = dict(shape, sparsities=[0.85, 0.9])             # b free (6 coefficients): 1 - S spans 1.5x, just enough
    assert scaling_analysis.design_power(dict(two, points=11), seeds=0)["why"] == [
        "too few points: 11 distinct for 6 coefficients (< 2 per coefficient)"]
    assert "sparsity range" in scaling_analysis.design_power(dict(two, sparsities=[0.85, 0.88]), seeds=0)["why"][0]
    wide = dict(shape, n_scales=4, sparsities=[0.85, 0.95, 0.97], F_span=5.0, horizons=[0.15, 0.33, 0.6, 1.0],
                D_span=1 / 0.15, C_span=5 / 0.15, points=48)
    p = scaling_analysis.design_power(wide, noise=0.003, seeds=2, prior="paper")
    assert p["why"] == [] and p["datasets"] == 2 and p["identified"] == 2 and "Table 4.3" in p["prior"]


def test_design_power_draws_a_measured_prior_at_the_plans_own_points(tmp_path):
    """The measured prior: surfaces fitted from a run's rows (save_prior keeps one that is not identified, with its
    reasons) are drawn at the plan's own F, S per cell and D per endpoint with their measured log-noise. A noise-free
    prior drawn on a grid of its own points refits identified every time; on a grid too narrow in F it does not."""
    import budget
    import configs
    import reproduce
    import scaling
    from lab import scaling_analysis
    plan = configs.PLANS["fits"]
    ladder = reproduce.plan_cells(plan, budget.ladder_cells("fits", 120.9, arms=plan.arms))
    shape = scaling_analysis.design_shape(plan, ladder)
    assert shape["cells"] == [f"{c['scale']}/S~85%" for c in ladder] and len(shape["D"]) == 4
    assert shape["D"][-1] == (3420 + 180) * 4 * 128 and shape["F_span"] == pytest.approx(9.48, abs=0.05)
    truth = {"baseline": scaling.Coeffs(E=3.0, A=40.0, K=5000.0, a=0.4, b=0.0, c=0.66),
             "smelt": scaling.Coeffs(E=3.3, A=3e5, K=8000.0, a=1.0, b=0.0, c=0.70)}
    rows = [dict(arch=a, scale=cell.split("/")[0], sparsity_label="S~85%", F=float(F), S=float(S), D=float(D),
                 val_loss=float(L))
            for a, p in scaling_analysis.prior_points(shape, {"surfaces": {a: (co, 0.0) for a, co in truth.items()}}
                                                      ).items()
            for F, S, D, L, cell in zip(p.F, p.S, p.D, p.L, p.cell)]
    path = tmp_path / "prior.json"
    saved = scaling_analysis.save_prior(path, rows, "a test")
    assert saved["baseline"]["a"] == pytest.approx(0.4, rel=1e-3) and saved["baseline"]["log_noise"] < 1e-6
    assert saved["baseline"]["pinned"] == saved["smelt"]["pinned"] == ["b"]   # one sparsity: b is the pin, 0
    p = scaling_analysis.design_power(shape, noise=0.002, seeds=3, prior=path)
    assert p["identified_by_arch"] == {"baseline": 3, "smelt": 3} and p["prior"] == "measured: a test"
    assert p["unforecast"] is None
    varied = scaling_analysis.design_power(dict(shape, sparsities=[0.85, 0.95, 0.97]), seeds=3, prior=path)
    assert varied["identified_by_arch"] == {} and varied["datasets"] == 0   # a b it never measured: no forecast
    assert "the measured baseline and smelt pinned b" in varied["unforecast"] and "3 sparsities" in varied["unforecast"]
    narrow = dict(shape, F={a: [f[0], f[0] * 1.0001] * 3 for a, f in shape["F"].items()})
    assert scaling_analysis.design_power(narrow, noise=0.002, seeds=2, prior=path)["identified"] == 0
    same_F = [dict(r, F=1e6 * (1 + 1e-4 * (i % 2))) for i, r in enumerate(rows)]   # F cannot be separated
    assert scaling_analysis.save_prior(path, same_F, "one F")["baseline"]["why"]       # kept, with its reasons


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit; on a GPU the script runs for minutes")
def test_gpu_check_script_refuses_clearly_without_a_gpu(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path),
                            "PATH": str(Path(sys.executable).parent) + ":" + os.environ.get("PATH", "")},
                       timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr


# A document length each preset's data can have (budget's tests sweep the range).
DOC_LENGTH = {"smoke": 62.7, "tiny": 120.4, "small": 800.0}


@pytest.mark.parametrize("preset", ["smoke", "tiny", "small"])
def test_depth_sweep_matches_every_depth_to_the_reference(preset):
    """Every default depth's Baseline and looped model meet the reference's FLOPs, parameters and KV within
    SMELT's tolerances (small's P = 8 pair and P = 9 looped model excepted: no head_dim multiple of 16 meets
    their KV), with
    sane widths; at the reference depth the pair is the ladder's."""
    import depth_sweep
    ctx, search = DOC_LENGTH[preset], budget.preset_search(preset)
    cells = [c for c in budget.ladder_cells(preset, ctx) if "85" in c["sparsity_label"]]
    cell = max(cells, key=lambda c: (c["baseline"]["n_layer"], -cells.index(c)))   # the script's default: the deepest
    ref = ModelConfig.from_dict(cell["baseline"])
    F, N, KV = budget.flops_per_token(ref, ctx), budget.count_params(ref)["blocks"], budget.kv_bytes_per_token(ref, 2, ctx)
    unmatched = set()
    for P in sorted({max(2, round(ref.n_layer * f)) for f in depth_sweep.DEPTH_FACTORS[preset]}):
        base, looped = depth_sweep.depth_pair(ref, P, ctx, search)
        if P == ref.n_layer:
            assert base == ref and looped.to_dict() == cell["smelt"]
        assert base.n_layer == looped.n_layer == P and not base.loop.active and looped.loop == SMELT.at(P)
        for arch, cfg in (("baseline", base), ("looped", looped)):
            ratios = (budget.flops_per_token(cfg, ctx) / F, budget.count_params(cfg)["blocks"] / N,
                      budget.kv_bytes_per_token(cfg, 2, ctx) / KV)
            if not budget.within_tolerance(*ratios):
                unmatched.add((P, arch))
            assert cfg.d_ff >= cfg.d_model / 4 and cfg.n_experts <= 4 * ref.n_experts, cfg   # no 200 experts of width 4
    assert unmatched == ({(8, "baseline"), (8, "looped"), (9, "looped")} if preset == "small" else set())


def test_script_matches_are_the_ladders(tmp_path):
    """Experiment.match starts from the preset ladder's search options: a script's SMELT of a cell is the
    ladder's SMELT of that cell."""
    import common
    exp = common.Experiment("match_check", common.parser("").parse_args(["--preset", "smoke", "--out-dir", str(tmp_path)]))
    cells = budget.ladder_cells("smoke", exp.ctx, vocab_size=exp.load_data().vocab_size)
    assert cells
    for (scale, label, base), cell in zip(exp.cells(), cells):
        smelt, rep = exp.match(base, SMELT.at(base.n_layer))
        want = replace(ModelConfig.from_dict(cell["smelt"]), block_size=base.block_size)
        assert smelt == want, (scale, label)
