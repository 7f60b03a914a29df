"""The claims list (issue 23.6): paper quotes with sections, three-state verdicts, the new claims' rules."""
import json

import numpy as np
from pathlib import Path

import pytest

from lab import probe_claims
from lab import report
from lab import stats
from lab import downstream_claims


def test_percentiles_with_failures_and_welch():
    x = np.random.default_rng(0).normal(size=(100, 2))
    assert np.allclose(stats.percentiles_with_failures(x, 0), np.percentile(x, [2.5, 97.5], axis=0))
    lo, hi = stats.percentiles_with_failures(x, 2)
    assert np.allclose(lo, np.percentile(np.r_[x, -1e9 * np.ones((2, 2))], 2.5, axis=0))
    assert np.allclose(hi, np.percentile(np.r_[x, 1e9 * np.ones((2, 2))], 97.5, axis=0))
    assert np.isinf(stats.percentiles_with_failures(x, 5)[0]).all()
    with pytest.raises(ValueError, match="n_failed"):
        stats.percentiles_with_failures(x, -1)
    from scipy.stats import ttest_ind
    a, b = [1.0, 1.2, 0.9, 1.1], [1.5, 1.9, 1.4]
    iv, ref = stats.welch_difference(a, b), ttest_ind(b, a, equal_var=False).confidence_interval()
    assert (iv.lo, iv.hi) == pytest.approx((ref.low, ref.high)) and iv.mean == pytest.approx(np.mean(b) - np.mean(a))
    assert not stats.welch_difference([1.0], b).resolved
    assert [stats.all_of(v) for v in (["reproduced"] * 2, ["reproduced", "contradicted"], ["reproduced", "not resolved"],
                                      [])] == ["reproduced", "contradicted", "not resolved", "not resolved"]


def _entry(point, lo, hi, share=0.0, **kw):
    return {"point": point, "interval": stats.Interval(point, lo, hi, 12, 0.95, "cell bootstrap").to_dict(),
            "interval_why": None, "failed_share": share, **kw}


def _scal():
    return {"gains": {"available": True, "why": [], "cells": []}, "sparsity": {"S~85%": 0.85, "S~95%": 0.95},
            "budget_rule": "in-window", "derived": {
                "gamma_diff": _entry(0.01, 0.002, 0.02), "a_diff": _entry(0.02, 0.01, 0.03),
                "c_diff": _entry(0.04, -0.01, 0.09, 0.01),
                "growth/S~85%": _entry(8.0, 2.0, 14.0, **{"from": 1e15, "to": 1e16}),
                "growth/S~95%": _entry(-8.0, -14.0, -2.0, **{"from": 1e15, "to": 1e16}),
                "tpp_ratio/S~85%": _entry(0.98, 0.95, 1.01), "tpp_ratio/S~95%": _entry(1.03, 0.97, 1.05)},
            "subsets": {"val_loss_by_domain": {"gains": {d: {"S~85%": {"gain": g}, "S~95%": {"gain": g}}
                                                         for d, g in (("code", 0.1), ("web", 0.2))}}}}


def test_scaling_claims_quote_the_paper_and_combine_their_parts():
    rows = {r[0].split(" (")[0].split(":")[0]: r for r in report._scaling_claims(_scal())}
    gamma = rows["gamma_SMELT > gamma_Baseline, with both a and c larger"]
    assert gamma[3] == "not resolved" and "0.3892" in gamma[1] and "(Sec. 4.3" in gamma[1]   # c straddles 0
    assert "1.0 % of draws failed" in gamma[2]
    assert rows["CE gain grows with compute"][3] == "contradicted"        # one column's growth wholly below 0
    assert rows["TPP of SMELT within 6 % of the Baseline's"][3] == "reproduced"
    wide = _scal()
    wide["derived"]["tpp_ratio/S~95%"] = _entry(1.10, 1.07, 1.2)       # wholly outside: contradicted
    assert {r[0].split(":")[0]: r for r in report._scaling_claims(wide)}[
        "TPP of SMELT within 6 % of the Baseline's"][3] == "contradicted"
    code = rows["code has the largest per-domain CE gain"]
    assert code[3] == "not resolved" and "web +20.0 %, code +10.0 %" in code[2] and "Code leads at 20.4%" in code[1]
    none = report._scaling_claims({"error": "no rows"})
    assert all(r[3] == "not resolved" and "not resolved at this scale: no rows" in r[2] for r in none[:3])


def test_claims_table_rows(tmp_path):
    ts = {"cells": [], "cells_reproduced": 0, "cells_contradicted": 0, "all_cells_verdict": "not resolved"}
    diff = stats.Interval(-0.2, -0.3, -0.1, 6, 0.95, "t").to_dict()
    items = stats.Interval(-0.2, -0.35, 0.02, 12, 0.95, "item bootstrap").to_dict()
    ev = {"report": {"claims": [{"claim": "gen", "paper": None, "interval": None, "verdict": "not resolved",
                                 "why": "x"},
                                {"claim": "real", "paper": "p", "interval": diff, "items_interval": items,
                                 "both_interval": {**diff, "lo": -0.4, "hi": 0.01}, "n": 6,
                                 "unit": "matched run pair", "verdict": "not resolved", "why": None}]}}
    rows = report._claim_rows(ts, _scal(), [], ev, None, tmp_path)
    assert next(r for r in rows if r[0].startswith("real"))[2] == ("-0.200 [-0.300, -0.100]; over the items -0.200 "
                                                                    "[-0.350, +0.020]; both noises -0.200 [-0.400, +0.010]")
    assert all(r[3] in stats.VERDICTS for r in rows) and all("|" not in c for r in rows for c in r)
    ce = next(r for r in rows if r[0].startswith("CE gain of SMELT"))
    assert "6.8-18.0 %" in ce[1] and "Extrapolated beyond the fitted compute window" in ce[1] and "23.5" in ce[1]
    assert next(r for r in rows if r[0] == "gen")[1] == "none: the paper has no generated tasks"
    abl = rows[-3:]
    assert all(r[3] == "not resolved" and "not resolved: run `python scripts/" in r[2] for r in abl)
    (tmp_path / "loop_count_sweep").mkdir()
    (tmp_path / "loop_count_sweep" / "results.json").write_text(json.dumps({"best_loops": 3}))
    (tmp_path / "depth_sweep").mkdir()
    (tmp_path / "depth_sweep" / "results.json").write_text(json.dumps(
        {"best_physical_depth": {"baseline": 4, "looped": 4}}))
    abl = {r[0]: r[3] for r in report._ablation_claims(tmp_path)}
    assert abl["two visits give the lowest validation loss"] == "contradicted"
    assert abl["the looped model's best physical depth equals the Baseline's"] == "reproduced"


def _task(by_k, origin="bigbench", p=None, k_test=8):
    """by_k: {k: (gain, k_counts)} (one cell above chance) or (gain, k_counts, {cell above chance: its gain})."""
    return {"origin": origin, "by_k": {str(k): {"gain": v[0], "k_counts": v[1], "baseline_by_seed": [0.1, 0.2],
                                               "smelt_by_seed": [0.2 + v[0], 0.3 + v[0]],
                                               "gain_by_cell": v[2] if len(v) > 2 else {"c": v[0]}}
                                       for k, v in by_k.items()},
            "test": {"k": k_test, "p": p, "p_min": 0.25 if p is not None else None}}


def test_icl_claims_skip_k_that_prompts_do_not_fit():
    icl = {"a": _task({0: (0.01, True), 2: (0.03, True), 8: (0.5, False)}, p=0.25),
           "b": _task({0: (0.00, True), 2: (0.02, True), 8: (-0.4, False)}, p=0.25),
           "c": _task({0: (0.02, True), 2: (0.05, True), 8: (0.0, True)}, p=0.25),
           "gen_x": _task({0: (0.0, True), 2: (0.9, True)}, origin="generated")}
    out = []
    downstream_claims.icl_claims(icl, lambda cid, *a, **kw: out.append((cid, a, kw)))
    got = {cid: (a, kw) for cid, a, kw in out}
    (text, paper, direction, value, iv, n, unit, *why), _ = got["icl gap grows"]
    assert n == 3 and iv.mean == pytest.approx(np.mean([0.02, 0.02, 0.03])) and "0.9 pp at k=0" in paper
    assert got["dyck gain"][0][4] is None                       # no dyck_languages task here
    (*_, tested, _u, why), kw = got["icl significant"]
    assert tested == 1 and "cannot go below 0.25" in why and kw["verdict"] == "not resolved"


def test_icl_gap_growth_compares_the_same_cells_at_both_k():
    """A cell above chance at k = 0 only (gain 0.10 there) is left out of that task's growth: over the shared cell
    the gap grows by 0.02, where the two k's means over different cells (0.05, then 0.02) would read -0.03; a task
    sharing no cell above chance between the two k gives no growth."""
    icl = {"a": _task({0: (0.05, True, {"c1": 0.0, "c2": 0.10}), 2: (0.02, True, {"c1": 0.02})}),
           "b": _task({0: (0.05, True, {"c2": 0.05}), 2: (0.02, True, {"c1": 0.02})}),
           "c": _task({0: (0.01, True), 2: (0.04, True)})}
    out = []
    downstream_claims.icl_claims(icl, lambda cid, *a, **kw: out.append((cid, a, kw)))
    (_, _, _, _, iv, n, _, why), _ = next((a, kw) for cid, a, kw in out if cid == "icl gap grows")
    assert n == 2 and iv.mean == pytest.approx((0.02 + 0.03) / 2)
    assert why == "left out, no cell above chance at both k: b"


def test_icl_gap_growth_averages_over_every_shared_cell():
    """A task with two cells above chance at both k grows by the mean of its cells' growths: (0.02 + 0.10) / 2."""
    icl = {"a": _task({0: (0.05, True, {"c1": 0.0, "c2": 0.10}), 2: (0.11, True, {"c1": 0.02, "c2": 0.20})})}
    out = []
    downstream_claims.icl_claims(icl, lambda cid, *a, **kw: out.append((cid, a, kw)))
    (_, _, _, _, iv, n, _, why), _ = next((a, kw) for cid, a, kw in out if cid == "icl gap grows")
    assert n == 1 and iv.mean == pytest.approx(0.06) and why is None


def test_icl_claims_refuse_a_sweep_without_per_cell_gains():
    """A shot sweep from before gain_by_cell cannot give the growth over shared cells: a clear error, not every task
    "left out" as if no cell were above chance."""
    t = _task({0: (0.01, True), 2: (0.03, True)})
    del t["by_k"]["2"]["gain_by_cell"]
    with pytest.raises(ValueError, match="task a's shot sweep has no gain_by_cell"):
        downstream_claims.icl_claims({"a": t}, lambda *a, **kw: None)


def test_demonstrations_that_fit_read_per_task_and_k():
    rec = lambda short: {"tasks": {"t": {"fit": {"8": {"share_short": short, "share_cut": short,
                                                       "demos_kept": 8 * (1 - short)}}}}}
    got = downstream_claims._demos_kept([{"baseline": rec(0.9), "smelt": rec(0.7)}], "t", 8)
    assert got["share_short"] == pytest.approx(0.8) and got["demos_kept"] == pytest.approx(1.6) and not got["k_counts"]
    assert downstream_claims._demos_kept([{"baseline": rec(0.1), "smelt": rec(0.2)}], "t", 8)["k_counts"]
    old = [{"baseline": {"tasks": {"t": {}}}, "smelt": {"tasks": {"t": {}}}}]       # an eval.json without "fit"
    assert downstream_claims._demos_kept(old, "t", 8) == {"demos_kept": None, "share_short": None, "share_cut": None,
                                                          "k_counts": True}


def _probe_pair(overlap, n_experts, width, rng):
    units = 20
    smelt = {"units": {"keys": list(range(units)), "quantities": {"expert_overlap": {
        "sum": (overlap + 0.05 * rng.standard_normal((units, 1))).tolist(), "count": [1.0] * units}}},
             "config": {"top_k": 2, "n_experts": n_experts}}
    return {"smelt": smelt, "baseline": {"config": {"d_model": width, "n_layers": 4}}}


def test_expert_overlap_falls_as_sparsity_rises():
    rng = np.random.default_rng(0)
    res = {"pairs": {"s_S0": _probe_pair(1.9, 2, 64, rng), "s_S85": _probe_pair(1.2, 16, 64, rng),
                     "m_S85": _probe_pair(1.0, 16, 96, rng), "m_S95": _probe_pair(0.6, 48, 96, rng)}}
    o = probe_claims.overlap_by_sparsity(res, n_draws=200)
    assert o["n_scales"] == 2 and o["interval"].mean == pytest.approx(((1.2 - 1.9) + (0.6 - 1.0)) / 4, abs=0.02)
    row = report._overlap_claim(res)
    assert row[3] == "reproduced" and "Sec. 6.1" in row[1]
    one = {"pairs": {"s_S85": _probe_pair(1.2, 16, 64, rng)}}
    assert probe_claims.overlap_by_sparsity(one)["interval"] is None
    assert report._overlap_claim(one)[3] == "not resolved"


def _const_probe_result():
    """One pair, 10 units, every unit the same hand-set value of each Section 6 sum (count 1), and a 10-prompt Dyck study."""
    one = {"ratio_update": [[1.0, 2.0]], "ratio_attn_write": [[1.0, 3.0]], "ratio_mlp_write": [[1.0, 1.5]],
           "ratio_attn_norm": [[1.0, 1.2]], "ratio_mlp_norm": [[1.0, 1.6]], "ucos_same": [0.5], "ucos_other": [0.2],
           "cos_Q": [0.9], "cos_K": [0.8], "cos_V": [0.6], "cos_X": [0.7], "top8_same": [0.6], "top8_control": [0.3],
           "expert_overlap": [1.0], "sink": [[0.4, 0.1]]}
    U = 10                                               # stats.MIN_BOOTSTRAP_UNITS: a bootstrap decides from 10
    smelt = {"units": {"keys": list(range(U)), "quantities": {
        k: {"sum": [v] * U, "count": [1.0] * U} for k, v in one.items()}},
        "config": {"top_k": 2, "n_experts": 8}, "per_visit": {"L1.v1": {"visit": 1}, "L1.v2": {"visit": 2}}}
    dyck = {"visits": [1, 2], "prompt_keys": [[k, i] for k in (1, 2) for i in range(5)],   # 10 prompts
            "mass": {"bos": [[0.6, 0.0], [0.5, 0.1], [0.7, 0.2]] * 3 + [[0.6, 0.1]],
                     "demo": [[0.2, 0.8], [0.3, 0.9], [0.1, 0.4]] * 3 + [[0.2, 0.7]]}}
    return {"pairs": {"p": {"smelt": smelt, "baseline": {}, "dyck": dyck}}}


def test_probe_claims_directions_and_values_on_hand_set_sums():
    """Each Section 6 claim's quantity (ratio v2/v1, gaps same - other, K - V, overlap - k^2/n, sink and Dyck
    visit 2 - visit 1) and its paper direction, from constant hand-set unit sums."""
    want = {"update_ratio": (">", 1.0, 2.0), "attn_write_ratio": (">", 1.0, 3.0), "moe_write_ratio": (">", 1.0, 1.5),
            "norm_ratio": (">", 1.0, 1.4), "update_cosine": (">", 0.0, 0.3), "q_stabler_than_v": (">", 0.0, 0.3),
            "k_stabler_than_v": (">", 0.0, 0.2), "q_keeps_input": (">", 0.0, 0.2), "k_keeps_input": (">", 0.0, 0.1),
            "v_below_input": ("<", 0.0, -0.1), "top8_overlap": (">", 0.0, 0.3), "expert_overlap": (">", 0.0, 0.5),
            "sink_shrinks": ("<", 0.0, -0.3), "dyck_bos_falls": ("<", 0.0, -0.5), "dyck_demo_rises": (">", 0.0, 0.5)}
    cs = {c["id"]: c for c in probe_claims.claims(_const_probe_result(), n_draws=20)}
    assert set(cs) == set(want)
    for cid, (direction, value, mean) in want.items():
        c = cs[cid]
        assert (c["direction"], c["value"]) == (direction, value), cid
        assert c["interval"].mean == pytest.approx(mean), cid
        assert stats.verdict(c["interval"], direction, value) == "reproduced", cid
        assert c["verdict"] == "not resolved", cid          # one pair: no interval of the training noise
    assert cs["expert_overlap"]["parts"] == pytest.approx({"expert_frac": 0.5, "expert_random_frac": 0.25})
    assert cs["update_cosine"]["parts"] == pytest.approx({"ucos_same": 0.5, "ucos_other": 0.2})


def test_cosine_gap_claims_name_their_stages_quote_their_figure_and_hold_in_every_cell():
    """The five Fig. 25 gaps (probe_claims._cos_gap): each a claim of every cell, its text naming the input as "the
    input X", its two sides as parts (hand-set cos_Q .9, K .8, V .6, X .7), and the quote it tests."""
    cs = {c["id"]: c for c in probe_claims.claims(_const_probe_result(), n_draws=20)}
    want = {"q_stabler_than_v": ("Q", "V", probe_claims.Q_K_V), "k_stabler_than_v": ("K", "V", probe_claims.Q_K_V),
            "q_keeps_input": ("Q", "X", probe_claims.Q_K_X), "k_keeps_input": ("K", "X", probe_claims.Q_K_X),
            "v_below_input": ("V", "X", probe_claims.V_X)}
    cos = {"Q": 0.9, "K": 0.8, "V": 0.6, "X": 0.7}
    every = dict(probe_claims.claimed())
    for cid, (a, b, paper) in want.items():
        c = cs[cid]
        assert every[f"cos_{a}_minus_{b}"].every_cell, cid
        assert c["what"] == f"cross-visit cosine of {a} minus that of {'the input X' if b == 'X' else b}", cid
        assert c["paper"] == paper and c["figure"] == "Fig. 25", cid
        assert c["parts"] == pytest.approx({f"cos_{a}": cos[a], f"cos_{b}": cos[b]}), cid


def test_expert_overlap_by_sparsity_groups_real_configs_by_width_and_depth():
    """Two scales of the same width but different depth (ModelConfig.to_dict keys) are two scales, not one."""
    from model import ModelConfig

    def pair(overlap, n_experts, n_layer):
        smelt = {"units": {"keys": list(range(4)), "quantities": {"expert_overlap": {
            "sum": [[overlap]] * 4, "count": [1.0] * 4}}}, "config": {"top_k": 2, "n_experts": n_experts}}
        base = ModelConfig(vocab_size=64, block_size=32, n_layer=n_layer, d_model=64, n_head=4, n_kv_head=2, d_ff=64)
        return {"smelt": smelt, "baseline": {"config": base.to_dict()}}
    res = {"pairs": {"a_S0": pair(1.9, 2, 4), "a_S85": pair(1.2, 16, 4), "b_S85": pair(1.0, 16, 6),
                     "b_S95": pair(0.6, 48, 6)}}
    o = probe_claims.overlap_by_sparsity(res, n_draws=20)
    assert o["n_scales"] == 2
    assert o["interval"].mean == pytest.approx(((1.2 - 1.9) + (0.6 - 1.0)) / 2 / 2)


def test_icl_significant_needs_a_strict_majority():
    """"most tasks significant" is 2 * significant > tested: 1 of 2 is not most (not resolved), 2 of 3 is."""
    def verdict_of(ps):
        icl = {f"t{i}": _task({0: (0.0, True), 8: (0.1, True)}, p=p) for i, p in enumerate(ps)}
        out = []
        downstream_claims.icl_claims(icl, lambda cid, *a, **kw: out.append((cid, a, kw)))
        [(a, kw)] = [(a, kw) for cid, a, kw in out if cid == "icl significant"]
        return a[5], a[7], kw["verdict"]
    tested, why, v = verdict_of([0.01, 0.2])
    assert (tested, v) == (2, "not resolved") and why.startswith("1 of 2 tasks significant")
    assert verdict_of([0.01, 0.02, 0.2])[::2] == (3, "reproduced")
    assert verdict_of([0.01, 0.02, 0.2, 0.3])[::2] == (4, "not resolved")


def _summary_rows():
    """Results rows of a two-cell grid: each run's branch at D=100 sits 0.5 nats above its final one at D=200;
    the repeated cell m64 S~85% has seeds 0-2 and a Baseline seed 3 without its SMELT."""
    finals = {("m48", "S=0%", "baseline", 0): 3.7, ("m48", "S=0%", "smelt", 0): 3.0,
              ("m64", "S~85%", "baseline", 0): 3.0, ("m64", "S~85%", "smelt", 0): 2.9,
              ("m64", "S~85%", "baseline", 1): 3.1, ("m64", "S~85%", "smelt", 1): 2.95,
              ("m64", "S~85%", "baseline", 2): 3.2, ("m64", "S~85%", "smelt", 2): 3.15,
              ("m64", "S~85%", "baseline", 3): 3.3}
    return [{"scale": s, "sparsity_label": lab, "arch": a, "seed": seed, "D": D, "S": 0.5, "F": 1e6,
             "val_loss": v + (0.5 if D == 100 else 0.0)} for (s, lab, a, seed), v in finals.items() for D in (200, 100)]


def test_training_summary_pairs_final_losses_and_carries_the_seed_noise():
    """SMELT - Baseline at each run's longest branch: paired over the repeated cell's seeds (a Baseline without
    its SMELT left out), and per cell at seed 0 with a t-interval from the seed-to-seed sd of the paired
    difference (n - 1 degrees of freedom); "learned" margins are the entropy minus each loss."""
    import configs
    ladder = [{"scale": "m48", "sparsity_label": "S=0%"}, {"scale": "m64", "sparsity_label": "S~85%"}]
    ts = report.training_summary(configs.PLANS["smoke"], ladder, _summary_rows(), entropy=5.0)
    rep = ts["repeat"]
    assert (rep["seeds"], rep["baseline"], rep["smelt"]) == (3, [3.0, 3.1, 3.2], [2.9, 2.95, 3.15])
    iv = stats.paired_difference([3.0, 3.1, 3.2], [2.9, 2.95, 3.15])
    assert rep["diff"]["mean"] == pytest.approx(-0.1) and (rep["diff"]["lo"], rep["diff"]["hi"]) == (iv.lo, iv.hi)
    half = stats.t_quantile(0.975, 2) * np.std([-0.1, -0.15, -0.05], ddof=1)
    cells = {c["scale"]: c for c in ts["cells"]}
    assert cells["m48"]["diff"]["mean"] == pytest.approx(-0.7)
    assert (cells["m48"]["diff"]["lo"], cells["m48"]["diff"]["hi"]) == pytest.approx((-0.7 - half, -0.7 + half))
    assert cells["m48"]["verdict"] == "reproduced" and cells["m64"]["verdict"] == "not resolved"
    assert (cells["m48"]["baseline"], cells["m48"]["smelt"]) == (3.7, 3.0)
    assert (ts["cells_reproduced"], ts["cells_contradicted"], ts["all_cells_verdict"]) == (1, 0, "not resolved")
    lr = ts["learned"]
    assert lr["min_margin_final"] == pytest.approx(1.3) and lr["min_margin"] == pytest.approx(0.8)
    assert not lr["all_final"] and not lr["all_endpoints"] and lr["below"] == 12 and lr["endpoints"] == 18


def test_probe_verdict_needs_both_intervals():
    """A probe claim is reproduced only when the held-out interval and the across-pairs interval agree."""
    from lab import probe_claims
    below, straddles = stats.Interval(-0.3, -0.5, -0.1, 8), stats.Interval(-0.1, -0.4, 0.2, 3)
    claim = lambda a: {"interval": below, "across_pairs": a}
    assert [probe_claims._verdict(claim(a), "<", 0.0) for a in (below, straddles, None)] == [
        "reproduced", "not resolved", "not resolved"]


def test_ce_gain_claim_reads_only_the_in_window_budgets():
    """An extrapolated budget neither decides the CE gain verdict nor appears in its text."""
    cell = lambda lab, lo, hi, ext: {"sparsity_label": lab, "budget": 1e16, "text": f"{lab} text", "extrapolated": ext,
                                     "interval": stats.Interval((lo + hi) / 2, lo, hi, 100).to_dict()}
    scal = {"gains": {"available": True, "cells": [cell("S~85%", 0.02, 0.08, False), cell("S~95%", -0.3, -0.1, True)]}}
    row = report._ce_gain_claim(scal)
    assert row[3] == "reproduced" and "S~85% text" in row[2] and "S~95%" not in row[2]
    scal["gains"]["cells"][1]["extrapolated"] = False
    assert report._ce_gain_claim(scal)[3] == "contradicted"
    few = stats.Interval(0.05, 0.02, 0.08, 6, 0.95, "cell bootstrap (refit)").to_dict()   # medium's 6 fitted cells
    scal = {"gains": {"available": True, "cells": [{**cell("S~85%", 0.02, 0.08, False), "interval": few}]}}
    row = report._ce_gain_claim(scal)
    assert row[3] == "not resolved" and "a cell bootstrap over 6 cells decides nothing" in row[2]


def test_tpp_claim_needs_the_whole_interval_inside_six_percent():
    """A TPP ratio interval wholly below 0.94 contradicts "within 6 %", as one wholly above 1.06 does."""
    low = _scal()
    low["derived"]["tpp_ratio/S~95%"] = _entry(0.92, 0.91, 0.93)
    assert {r[0].split(":")[0]: r for r in report._scaling_claims(low)}[
        "TPP of SMELT within 6 % of the Baseline's"][3] == "contradicted"


def test_code_claim_reads_the_middle_sparsity_column():
    """The per-domain gains are read at the middle of the sparsity columns (S~95% of three), not the first."""
    scal = _scal()
    scal["sparsity"] = {"S~85%": 0.85, "S~95%": 0.95, "S~97%": 0.97}
    scal["subsets"]["val_loss_by_domain"]["gains"] = {d: {"S~85%": {"gain": g1}, "S~95%": {"gain": g2},
                                                         "S~97%": {"gain": g1}}
                                                     for d, g1, g2 in (("code", 0.1, 0.3), ("web", 0.2, 0.05))}
    assert "(S~95%: code +30.0 %, web +5.0 %)" in report._code_claim(scal)


def test_loop_count_and_figure_links(tmp_path):
    """loop_count is None when the matched SMELTs differ in r; a figure link is relative to the out dir, None
    for an absent file, and a file outside the out dir is refused by name."""
    cell = lambda r: {"smelt": {"loop": {"n_loops": r}}}
    assert report.loop_count([cell(2), cell(3)]) is None and report.loop_count([cell(2), cell(2)]) == 2
    (tmp_path / "out" / "figures").mkdir(parents=True)
    (tmp_path / "out" / "figures" / "a.png").write_bytes(b"png")
    (tmp_path / "b.png").write_bytes(b"png")
    out = tmp_path / "out"
    assert report.figure_link("figures/a.png", out) == "figures/a.png"
    assert report.figure_link(out / "figures" / "a.png", out) == "figures/a.png"
    assert report.figure_link("figures/missing.png", out) is None
    with pytest.raises(ValueError, match=r"b\.png lies outside the out dir"):
        report.figure_link(tmp_path / "b.png", out)


def test_probe_figures_are_linked_with_a_relative_out_dir(tmp_path, monkeypatch):
    """The default run's out dir is relative (runs/reproduce_tiny): the probe stage's figure paths, which
    include it, still become REPORT.md links relative to the out dir."""
    monkeypatch.chdir(tmp_path)
    out = Path("runs") / "reproduce_tiny"
    (out / "figures" / "probes").mkdir(parents=True)
    (out / "figures" / "probes" / "fig23_grid.png").write_bytes(b"png")
    prb = {"pairs": {"t64_S85": {}}, "sample": {"tokens": 8, "units": 2, "domains": ["code"]},
           "figures": [str(out / "figures" / "probes" / "fig23_grid.png")]}
    assert "![fig23_grid](figures/probes/fig23_grid.png)" in report._section_probes(prb, [], out)


def test_span_sweep_winner_is_50_percent_in_every_sparsity(tmp_path):
    """Table 3.3's claim: the lowest validation loss at 50 % span for each sparsity label of the sweep."""
    def verdict(best_by_label):
        rows = [{"sparsity_label": lab, "span_pct": s, "val_loss": 3.0 - 0.1 * (s == best)}
                for lab, best in best_by_label.items() for s in (25, 50, 75)]
        (tmp_path / "span_sweep").mkdir(exist_ok=True)
        (tmp_path / "span_sweep" / "results.json").write_text(json.dumps({"rows": rows, "best_span": best_by_label}))
        return {r[0]: r[3] for r in report._ablation_claims(tmp_path)}[
            "the lowest validation loss at 50 % span, every sparsity"]
    assert verdict({"S~85%": 50, "S~95%": 50}) == "reproduced"
    assert verdict({"S~85%": 50, "S~95%": 25}) == "contradicted"


def test_slope_interval_matches_scipy_linregress():
    """stats.slope_interval: the OLS slope and its t-interval on n - 2 degrees of freedom, as scipy's linregress."""
    from scipy.stats import linregress
    x, y = [4.9, 5.3, 5.6, 5.9], [0.08, 0.05, 0.06, 0.02]
    iv, ref = stats.slope_interval(x, y), linregress(x, y)
    half = stats.t_quantile(0.975, 2) * ref.stderr
    assert iv.mean == pytest.approx(ref.slope) and (iv.lo, iv.hi) == pytest.approx((ref.slope - half, ref.slope + half))
    assert not stats.slope_interval([1, 2], [0.1, 0.3]).resolved                      # two points: a slope, no interval
    with pytest.raises(ValueError, match="x spread"):
        stats.slope_interval([1, 1, 1], [0.1, 0.2, 0.3])


def _pair_rows(gaps: dict, F=(2e6, 2.06e6), S=(0.83, 0.84)):
    """Results rows of matched pairs {(scale, seed): [SMELT - Baseline at D = 1e5, 2e5, 4e5]}, Baseline at 4.0."""
    rows = []
    for (scale, seed), gs in gaps.items():
        for D, g in zip((1e5, 2e5, 4e5), gs):
            for arch, f, s, v in (("baseline", F[0], S[0], 4.0), ("smelt", F[1], S[1], 4.0 + g)):
                rows.append({"scale": scale, "sparsity_label": "S~85%", "arch": arch, "seed": seed, "D": D, "F": f,
                             "S": s, "val_loss": v})
    return rows


def test_the_law_at_our_scale_gives_smelt_higher_and_the_verdict_is_read_against_it():
    """Table 4.3's surfaces at a tiny pair's F, S and D: SMELT higher (the data term, below D* ~ 1.6e10), so a
    measured SMELT-higher gap is 'reproduced' against the law here while 'contradicted' against the paper's own
    scale; the claims row says it is not a contradiction. The gap falling with D is the law's direction too."""
    import configs
    rows = _pair_rows({("t40", 0): [0.09, 0.07, 0.05], ("t40", 1): [0.08, 0.07, 0.04], ("t40", 2): [0.10, 0.06, 0.05],
                       ("t48", 0): [0.07, 0.06, 0.03]})
    law = report.law_for_pair(rows[4], rows[5])
    assert law["direction"] == ">" and law["gap"] > 0
    import scaling
    assert scaling.PAPER_CROSSOVER_D == pytest.approx(1.62e10, rel=0.01)
    big = {**rows[4], "F": 2e9, "D": 1e11}, {**rows[5], "F": 2e9, "D": 1e11}           # the paper's scale: SMELT lower
    assert report.law_for_pair(*big)["direction"] == "<"
    plan = configs.Plan(data="tiny", ladder="tiny", block_size=128, batch_size=4, lr=1e-3, warmup_steps=1,
                        stable_steps=10, branch_steps=[10], decay_steps=1, eval_tokens=1, repeat=("t40", "S~85%"),
                        train_seeds=3)
    ladder = [{"scale": "t40", "sparsity_label": "S~85%"}, {"scale": "t48", "sparsity_label": "S~85%"}]
    ts = report.training_summary(plan, ladder, rows, entropy=6.0)
    rep = ts["repeat"]
    assert rep["verdict"] == "contradicted" and rep["verdict_here"] == "reproduced"
    assert ts["cells_law_higher"] == 2 and ts["over_cells"]["law_direction"] == ">"
    gd = ts["gap_vs_D"]
    assert len(gd["pairs"]) == 4 and gd["law_direction"] == "<" and gd["verdict"] == "reproduced"
    assert all(p["law_slope"] < 0 for p in gd["pairs"])
    rows_ = report._claim_rows(ts, {"error": "skipped"}, [], {}, None, None)
    assert all(len(r) == 5 for r in rows_)
    head = next(r for r in rows_ if r[0].startswith("SMELT - Baseline < 0, paired"))
    assert head[3] == "contradicted" and "not a contradiction" in head[4] and "**reproduced**" in head[4]
    gap = next(r for r in rows_ if r[0].startswith("SMELT - Baseline falls as D grows"))
    assert gap[3] == "reproduced" and "falling" in gap[4]
    ce = next(r for r in rows_ if r[0].startswith("CE gain of SMELT"))
    assert ce[4].startswith("n/a")                                       # no budgets without a scaling stage
