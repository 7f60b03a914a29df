"""REPORT.md: the reproduction's claims, verdict tables and markdown, read from the run's JSON.

reproduce.py runs the stages and hands their JSON here; nothing in this file trains or measures.
`training_summary`: did every model learn, and SMELT - Baseline loss per cell with its seed noise (SMELT 4.1).
`_claim_rows`: every claim of the paper as reproduced / contradicted / not resolved by its 95 % interval.
`write_report`: run summary, plan, ladder (SMELT 3.2), training, scaling (4), downstream (5), probes (6),
claims. `run_summary`: where and when the report was made.
Read first: reproduce.py (the stages), stats.py (intervals and verdicts).
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import configs
from lab import probe_claims, stats


# -------------------------------------------------------- claims: training summary, probe verdicts, claims table

def finals(rows: list[dict]) -> dict[str, dict]:
    """{run name: its longest branch's results row}."""
    out = {}
    for r in rows:
        name = r.get("run") or configs.run_name(r["scale"], r["sparsity_label"], r["arch"], r.get("seed", 0))
        if name not in out or r["D"] > out[name]["D"]:
            out[name] = r
    return out


def training_summary(plan: configs.Plan, ladder: list[dict], rows: list[dict], entropy: float) -> dict:
    """The training claims, with their noise: did every model learn (each endpoint's validation loss vs the
    corpus's unigram entropy); SMELT - Baseline final validation loss, paired over seeds in the repeated
    cell (t-interval) and per cell at seed 0 with the seed noise measured in the repeated cell."""
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
        key = configs.cell_key(*plan.repeat)
        seeds = sorted({r.get("seed", 0) for r in fin.values() if r["scale"] == plan.repeat[0]
                        and r["sparsity_label"] == plan.repeat[1]})
        pairs = [(fin.get(configs.run_name(*plan.repeat, "baseline", s)),
                  fin.get(configs.run_name(*plan.repeat, "smelt", s))) for s in seeds]
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
        b = fin.get(configs.run_name(cell["scale"], cell["sparsity_label"], "baseline"))
        m = fin.get(configs.run_name(cell["scale"], cell["sparsity_label"], "smelt"))
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
    out["all_cells_verdict"] = stats.all_of(v)
    return out


# The paper's words for the claims this file states (SMELT, quoted with their section)
PAPER = {
    "lower": "\"At comparable measured compute, SMELT reaches lower loss in every cell\" (Sec. 4.1, Fig. 8)",
    "repeat": "Table 3.3 (Sec. 3.3, 200M, one run each): val. loss 1.9445 unlooped vs 1.9257 at 50 % span (S~85 %), "
              "1.8735 vs 1.8517 (S~95 %)",
    "ce_gain": "\"At C=10^{20}, SMELT saves 6.8–10.0% of training compute across sparsity levels. At C=10^{21}, the "
               "range widens to 14.7–18.0%\" (Sec. 4.3, Table 4.3): in the fitted window 6.8-18.0 %; the 1e22 column "
               "(19.6–23.5 %) is \"Extrapolated beyond the fitted compute window\"",
    "gamma": "\"SMELT’s capacity exponent a is 0.3892 vs. the Baseline’s 0.3703, and its data exponent c is 0.7011 "
             "vs. 0.6594. Both are larger\"; \"gamma_base=0.237 and gamma_SMELT=0.250\" (Sec. 4.3, Table 4.3)",
    "growth": "\"the additive increment from 10^{20} to 10^{21} is ~8 pp in each column\" (Sec. 4.3, Table 4.3)",
    "tpp": "\"SMELT’s TPP point estimate is within 6% of the Baseline’s at every sparsity\" (Sec. 4.3, Table 4.3)",
    "code": "\"Code leads at 20.4%; Finance and Math/ follow at 16.8% and 16.6%\" (Sec. 5.2, C = 1e21, S~95 %)",
}
# (script = its out dir under the run's, the claim, the paper's words, the winner's check on results.json)
ABLATIONS = (
    ("span_sweep", "the lowest validation loss at 50 % span, every sparsity",
     "\"Validation loss reaches its minimum near 50% span for both sparsity levels\" (Sec. 3.3, Table 3.3)",
     lambda r: all(min((x for x in r["rows"] if x["sparsity_label"] == lab), key=lambda x: x["val_loss"])["span_pct"]
                   == 50 for lab in r["best_span"])),
    ("depth_sweep", "the looped model's best physical depth equals the Baseline's",
     "\"the Baseline peaks at physical 12, while the Looped Transformer peaks at 12/18 (physical 12, executed 18)\" "
     "(Sec. 3.4, Table 3.4)", lambda r: r["best_physical_depth"]["looped"] == r["best_physical_depth"]["baseline"]),
    ("loop_count_sweep", "two visits give the lowest validation loss",
     "\"Two visits win on all three metrics\" (Sec. 3.5, Table 3.5)", lambda r: r["best_loops"] == 2),
)


def _short(why: str, n: int = 160) -> str:   # the claims table's reasons; the full text is in the stage's JSON
    return why if len(why) < n else why[:n - 3] + "..."


def _claim_rows(ts: dict, scal: dict, pclaims: list[dict], ev_sum: dict, prb: dict | None = None,
                out: Path | None = None) -> list[list[str]]:
    rows = []
    c = ts["cells"]
    rows.append(["SMELT has lower validation loss than its matched Baseline in every cell (Sec. 4.1)", PAPER["lower"],
                 f"{ts['cells_reproduced']} of {len(c)} cells lower, {ts['cells_contradicted']} higher "
                 f"(95 % intervals)", ts["all_cells_verdict"]])
    if ts.get("repeat"):
        r = ts["repeat"]
        rows.append([f"SMELT - Baseline < 0, paired over {r['seeds']} seeds in {r['cell']}", PAPER["repeat"],
                     _iv(r["diff"], 4), r["verdict"]])
    rows.append(_ce_gain_claim(scal))
    rows += _scaling_claims(scal)
    if prb and prb.get("pairs"):
        rows.append(_overlap_claim(prb))
    for c in pclaims:
        iv = c["interval"].fmt(3) if c["interval"] else "no pair has it"
        tr = f"; over pairs {c['across_pairs'].fmt(3)}" if c.get("across_pairs") else ""
        rows.append([f"{c['what']} {c['direction']} {c['value']:g} ({c['figure']})", c["paper"], iv + tr,
                     c["verdict"]])
    for cl in (ev_sum.get("report") or {}).get("claims", []):
        iv = _iv(cl["interval"], 3) if cl.get("interval") else "no interval"
        if cl.get("items_interval"):   # the same difference over the item sample, and both noises (downstream_claims._item_noise)
            iv += f"; over the items {_iv(cl['items_interval'], 3)}; both noises {_iv(cl.get('both_interval'), 3)}"
        rows.append([cl["claim"] + (f" ({cl['n']} {cl['unit']}s)" if cl.get("n") else ""),
                     cl["paper"] or "none: the paper has no generated tasks",
                     iv + (f"; {cl['why']}" if cl.get("why") else ""), cl["verdict"]])
    return rows + _ablation_claims(out)


def _derived_text(d: dict | None, nd: int = 3, scale: float = 1.0) -> str:
    """A scaling_analysis derived entry as 'point [lo, hi] (x % of draws failed)' or 'point (no interval: why)'."""
    if not d:
        return "n/a"
    iv = d.get("interval")
    fail = f" ({100 * d['failed_share']:.1f} % of draws failed)" if d.get("failed_share") is not None else ""
    if iv is None:
        return f"{d['point'] * scale:+.{nd}f} (no interval: {d.get('interval_why') or 'no bootstrap'})"
    return stats.Interval(**iv).fmt(nd, scale) + fail


def _scaling_claims(scal: dict) -> list[list[str]]:
    """SMELT 4.3 / 5.2's further claims from scaling_analysis's `derived` entries and per-domain gains."""
    der = scal.get("derived") or {} if isinstance(scal, dict) else {}
    why = "not resolved at this scale: " + _short(scal.get("error") or "; ".join(scal.get("gains", {}).get("why", []))
                                                  or "no pair bootstrap (two identified surfaces and n_boot > 0)")
    verdict = lambda d, direction, value=0.0: stats.verdict(_interval(d.get("interval")), direction, value)
    rows = []
    parts = [(k, der.get(f"{k}_diff")) for k in ("gamma", "a", "c")]
    rows.append(["gamma_SMELT > gamma_Baseline, with both a and c larger (Sec. 4.3)", PAPER["gamma"],
                 "; ".join(f"{k} diff {_derived_text(d, 4)}" for k, d in parts) if der else why,
                 stats.all_of([verdict(d, ">") for _, d in parts]) if der else "not resolved"])
    grow = {k.split("/", 1)[1]: d for k, d in der.items() if k.startswith("growth/")}
    rows.append(["CE gain grows with compute: pp per decade > 0 between the first and last in-window budget",
                 PAPER["growth"], "; ".join(f"{lab} ({d['from']:.2g} to {d['to']:.2g}): {_derived_text(d, 1)} pp"
                                            for lab, d in grow.items()) if grow else
                 (why if not der else "not resolved at this scale: fewer than two in-window budgets"),
                 stats.all_of([verdict(d, ">") for d in grow.values()])])
    tpp = {k.split("/", 1)[1]: d for k, d in der.items() if k.startswith("tpp_ratio/")}
    rows.append(["TPP of SMELT within 6 % of the Baseline's: TPP ratio inside (0.94, 1.06)", PAPER["tpp"],
                 "; ".join(f"{lab}: {_derived_text(d, 3)}" for lab, d in tpp.items()) if tpp else why,
                 stats.all_of([v for d in tpp.values() for v in (verdict(d, ">", 0.94), verdict(d, "<", 1.06))])])
    rows.append(["code has the largest per-domain CE gain (Sec. 5.2)", PAPER["code"], _code_claim(scal),
                 "not resolved"])
    return rows


def _code_claim(scal: dict) -> str:
    """The per-domain gains at the middle sparsity column (point estimates: they carry no interval)."""
    dom = (scal.get("subsets") or {}).get("val_loss_by_domain", {}).get("gains", {}) if isinstance(scal, dict) else {}
    labs = list(scal.get("sparsity", {})) if isinstance(scal, dict) else []
    if not dom or not labs:
        return "not resolved at this scale: no per-domain CE gain (needs two identified surfaces)"
    lab = labs[len(labs) // 2]
    g = sorted(((n, v[lab]["gain"]) for n, v in dom.items() if v[lab]["gain"] is not None), key=lambda x: -x[1])
    text = ", ".join(f"{n} {100 * v:+.1f} %" for n, v in g)
    return (f"not resolved at this scale: per-domain gains are intercept refits without a bootstrap interval "
            f"({lab}: {text})")


def _overlap_claim(prb: dict) -> list[str]:
    """SMELT 6.1: expert overlap / k at the largest pool minus the smallest, per scale (probe_claims)."""
    o = probe_claims.overlap_by_sparsity(prb)
    iv = o["interval"]
    return ["expert overlap falls as sparsity rises: overlap / k at the largest pool minus the smallest, mean over "
            f"scales < 0 ({o['n_scales']} scales)", probe_claims.OVERLAP_FALLS,
            iv.fmt(3) if iv else f"not resolved at this scale: {o['why']}", stats.verdict(iv, "<")]


def _ablation_claims(out: Path | None) -> list[list[str]]:
    """Tables 3.3-3.5's winners as the sweep scripts found them, read from OUT/<script>/results.json;
    one run per configuration (as in the paper), so a winner is a point, stated as such."""
    rows = []
    for name, what, paper, won in ABLATIONS:
        if out is None or not (path := Path(out) / name / "results.json").exists():
            rows.append([what, paper, f"not resolved: run `python scripts/{name}.py --out-dir OUT/{name}` "
                                      "(not part of reproduce.py)", "not resolved"])
            continue
        ok = won(json.loads(path.read_text()))
        rows.append([what, paper, f"{'same' if ok else 'another'} winner in {name}/results.json (one run per "
                                  "configuration: no interval)", "reproduced" if ok else "contradicted"])
    return rows


def _ce_gain_claim(scal: dict) -> list[str]:
    """CE gain > 0 at budgets inside the data: reproduced when every non-extrapolated cell's bootstrap interval
    is above 0, contradicted when one is wholly below, else not resolved (also: no identified fit)."""
    claim, paper = "CE gain of SMELT over Baseline > 0 at the in-window budgets (Sec. 4.3)", PAPER["ce_gain"]
    g = scal.get("gains", {}) if isinstance(scal, dict) else {}
    if "error" in scal or not g.get("available"):
        return [claim, paper, f"no number: {_short(scal.get('error') or '; '.join(g.get('why', [])) or 'no gains')}",
                "not resolved"]
    inside = [c for c in g.get("cells", []) if not c.get("extrapolated")]
    if not inside:
        return [claim, paper, "every budget extrapolated (see the scaling tables)", "not resolved"]
    ivs = [_interval(c.get("interval")) for c in inside]
    text = "; ".join(f"{c['sparsity_label']} at {c['budget']:.2g}: {c['text']}" for c in inside)
    few = next((iv.n for iv in ivs if iv is not None and iv.few_units), None)
    text += (f"; a cell bootstrap over {few} cells decides nothing (fewer than {stats.MIN_BOOTSTRAP_UNITS} units: "
             f"too narrow, docs/wins.md)" if few else "")
    return [claim, paper, text + f" (budgets: {scal.get('budget_rule', 'n/a')})",
            stats.all_of([stats.verdict(iv, ">", 0.0) for iv in ivs])]


# ---------------------------------------------------------------------------------------- markdown

def _md_table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _sci(x: float) -> str:
    """1.2e+06 -> '1.2e6' (compact powers for prose)."""
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"


def _interval(d: dict | None) -> stats.Interval | None:
    return stats.Interval(**d) if d else None


def _iv(d: dict | None, nd: int = 3) -> str:
    """An Interval dict as 'mean [lo, hi]' (or 'mean (no interval)'; 'n/a' for none)."""
    return stats.Interval(**d).fmt(nd) if d else "n/a"


# ---------------------------------------------------------------------------------------- REPORT.md's sections

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


def _section_plan(plan: configs.Plan, ladder: list[dict], rows: list[dict], cost: dict) -> list[str]:
    import budget   # here, not at the top: rendering markdown needs no model code
    from model import ModelConfig
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
         "", *([f"Decay data: {configs.decay_freshness(cost['epochs_per_run'])}.", ""] if cost.get("epochs_per_run") else []),
         f"Models here hold {_sci(min(params))}-{_sci(max(params))} non-embedding parameters "
         f"({_sci(min(active))}-{_sci(max(active))} active) and their endpoints saw "
         + (f"{_sci(D[0])}-{_sci(D[-1])} tokens" if D else "no tokens")
         + "; the paper's hold 1e8-5e10 parameters and saw 1e10-2e11 tokens. A claim not reproduced here "
         "is not evidence against the paper, and one reproduced here is weak evidence for it.", ""]
    from loop import SMELT
    if plan.loop != SMELT:   # a researcher's variant: every "SMELT" below is this looped model
        changed = ", ".join(f"{k} {v}" for k, v in vars(plan.loop).items() if getattr(SMELT, k) != v)
        L += [f"Loop: not SMELT's ({changed}; loop.LoopSpec): every SMELT column below is this looped model.", ""]
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
    order = {configs.cell_key(c["scale"], c["sparsity_label"]): i for i, c in enumerate(ladder)}
    L = ["## Did the models learn?", "",
         f"The training stream's unigram entropy is **{lr['entropy']:.3f} nats**: a model that learned only token "
         f"frequencies sits there. The target is every model at least 1.5 nats below it "
         f"(<= {lr['entropy'] - 1.5:.3f}). Final models (longest branch): the smallest margin is "
         f"**{lr['min_margin_final']:.3f} nats** ({'met' if lr['all_final'] else '**not met**'}); over all "
         f"{lr['endpoints']} branch endpoints, {lr['below']} are 1.5 nats below (smallest margin "
         f"{lr['min_margin']:.3f})."
         + (f" On this validation set (the same tokens every model is scored on) the unigram model fitted on the "
            f"training stream scores {lr['unigram_val_loss']:.3f}." if lr.get("unigram_val_loss") else ""), ""]
    rank = lambda r: (order.get(configs.cell_key(r["scale"], r["sparsity_label"]), 99), r.get("seed", 0), r["arch"])
    trows = [[name, f"{r['D'] / 1e6:.2f}M", f"{r['val_loss']:.3f}", f"{lr['entropy'] - r['val_loss']:.2f}"]
             for name, r in sorted(fin.items(), key=lambda kv: rank(kv[1]))]   # ladder order, then seed, then arch
    L += _md_table(["run", "tokens", "final val loss", "below entropy by"], trows) + [""]
    L += ["![learning curves](figures/curves.png)", "",
          "## SMELT vs its matched Baseline: validation loss (SMELT 4.1)", ""]
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
        link = figure_link(png, out, base=out / "scaling")
        if link:
            L += [f"![{Path(png).stem}]({link})", ""]
    return L


def figure_link(path: str | Path, out: Path, base: Path | None = None) -> str | None:
    """A figure's link relative to the out dir (REPORT.md's folder), or None when the file is absent. A relative
    `path` is taken from `base` (default: the out dir); an absolute one outside the out dir is refused by name."""
    p = Path(path)
    p = p if p.is_absolute() else (base or out) / p
    try:
        rel = p.resolve().relative_to(Path(out).resolve())
    except ValueError:
        raise ValueError(f"figure {p} lies outside the out dir {out} (the out dir was moved?): delete the JSON "
                         f"that names it to recompute it") from None
    return rel.as_posix() if p.exists() else None


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
                         m["paper"] or "none: the paper has no generated tasks"]
                        for m in wins.values()]) + [""]
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
                         f"n/a ({f.get('why') or 'no contrast'})", f.get("paper")] for name, f in fams.items()]) + [""]
    cal = rep.get("calibration", {})
    if cal.get("error"):
        L += [f"**Calibration (Eq. 6-7):** not identified ({cal['error']}).", ""]
    else:
        for name, c in cal.get("metrics", {}).items():
            if not name.startswith("task/") and not c.get("identified"):
                L += [f"**Calibration of {name} (Eq. 6):** not identified ({c.get('why')}).", ""]
    figs = ev_sum.get("figures", {})
    for name, p in (figs.get("figures") or {}).items():
        link = figure_link(p, out) if p else None
        if link:
            L += [f"![{name}]({link})", ""]
    for note in figs.get("notes", []):
        if not note.startswith("Calibration"):   # said above
            L += [f"- {note}"]
    return L + [""]


def loop_count(ladder: list[dict]) -> int | None:
    """r, the loop count of the ladder's matched SMELTs (None when they differ or the ladder is empty)."""
    rs = {c["smelt"]["loop"]["n_loops"] for c in ladder}
    return rs.pop() if len(rs) == 1 else None


def visits_label(r: int | None) -> str:
    """What the probes compare at loop count r: visit v+1 against visit v of each looped layer."""
    if r == 2:
        return "the second visit"
    return f"visits 2-{r} (visit v+1 vs v)" if r else "later visits (visit v+1 vs v)"


def _section_probes(prb: dict, cl: list[dict], out: Path, r: int | None = 2) -> list[str]:
    L = [f"## Probes of {visits_label(r)} (SMELT 6)", ""]
    if not prb.get("pairs"):
        return L + ["Not run (stage skipped).", ""]
    L += [f"Every matched pair ({len(prb['pairs'])}, seed replicates included) on one held-out sample of "
          f"{prb['sample']['tokens']} tokens ({prb['sample']['units']} document groups) drawn equally from the "
          f"domains {', '.join(prb['sample']['domains'])}. Each quantity: its mean over pairs "
          "with a bootstrap interval over held-out document groups, and a t-interval over the pairs (the "
          "training noise: seeds and cells). A verdict needs both intervals to agree; a claim the paper makes of "
          "every cell is reproduced only when its weakest pair is too.", ""]
    na = lambda iv: iv.fmt(3) if iv else "n/a"   # no interval: no across-pairs or weakest-pair column either
    rows = [[f"{c['what']} ({c['figure']})", na(c["interval"]), na(c["interval"] and c.get("across_pairs")),
             na(c["interval"] and c.get("weakest")), c["paper"], c["verdict"]] for c in cl]
    L += _md_table(["quantity", "mean over pairs [held-out interval]", "over pairs [t-interval]", "weakest pair",
                    "paper", "verdict"], rows) + [""]
    for p in prb.get("figures", []):
        link = figure_link(p, out)
        if link:
            L += [f"![{Path(p).stem}]({link})"]
    return L + [""]


def write_report(plan_name: str, plan: configs.Plan, out: Path, ladder, rows, ev_sum, scal, prb, summary: dict,
                 ts: dict, cost: dict, pclaims: list[dict] = ()) -> Path:
    """REPORT.md from the stages' results; pclaims: probe_claims.claims(prb) ([] without probes)."""
    pclaims = list(pclaims) if prb.get("pairs") else []
    L = _section_summary(plan_name, summary)
    L += _section_plan(plan, ladder, rows, cost)
    L += _section_ladder(ladder)
    L += _section_training(ts, rows, ladder)
    L += _section_scaling(scal, out)
    L += _section_downstream(ev_sum, out)
    L += _section_probes(prb, pclaims, out, loop_count(ladder))
    L += ["## Claims: reproduced, contradicted or not resolved", "",
          *_md_table(["paper claim", "paper (its words, section)", "this run (95 % interval)", "verdict"],
                     _claim_rows(ts, scal, pclaims, ev_sum, prb, out)), ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(L))
    return path


# ---------------------------------------------------------------------------------------- where and when

def budget_machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def run_summary(preset: str, stage_s: dict, wall: float) -> dict:
    """Where and when this report was made: the block the README quotes."""
    root = Path(__file__).resolve().parents[1]

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
