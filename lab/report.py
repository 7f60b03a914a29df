"""REPORT.md: the reproduction's claims, verdict tables and markdown, read from the run's JSON (nothing here trains).

`training_summary`: did every model learn, and an arm - Baseline loss per cell with its seed noise (SMELT 4.1).
`_claim_rows`: every claim of the paper as reproduced / contradicted / not resolved by its 95 % interval.
`write_report`: REPORT.md's sections, the comparisons once per looped arm (`Compared`); their prose and the paper's
quotes are report_text.md's blocks. In a comparison the looped arm has the role the paper gives SMELT.
`run_summary`: where and when the report was made.
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
from typing import NamedTuple

import numpy as np
import torch

import configs
from lab import probe_claims, stats
from lab.scaling_report import failed_text
from scaling import PAPER_BASELINE, PAPER_CROSSOVER_D, PAPER_SMELT, law_gap

_parts = re.split(r"^@@ (\S+)\n", Path(__file__).with_name("report_text.md").read_text(encoding="utf-8"), flags=re.M)
TEXT = {name: body.rstrip("\n") for name, body in zip(_parts[1::2], _parts[2::2])}   # report_text.md's blocks


def _text(name: str, **fields) -> list[str]:
    """Block `name` filled in as REPORT.md lines; a paragraph that comes out empty (an optional sentence) is dropped."""
    paras = (p.format(**fields).rstrip("\n") for p in TEXT[name].split("\n\n"))
    return [line for p in paras if p for line in (*p.split("\n"), "")]


def _skipped(name: str, why: str, **fields) -> list[str]:
    """Block `name`'s heading with `why` in place of its body: the stage was skipped or failed."""
    return [TEXT[name].split("\n", 1)[0].format(**fields), "", why, ""]


def finals(rows: list[dict]) -> dict[str, dict]:
    """{run name: its longest branch's results row}."""
    out = {}
    for r in rows:
        name = r.get("run") or configs.run_name(r["scale"], r["sparsity_label"], r["arch"], r.get("seed", 0))
        if name not in out or r["D"] > out[name]["D"]:
            out[name] = r
    return out


def law_for_pair(b: dict, m: dict) -> dict:
    """Table 4.3's SMELT - Baseline loss at a pair's own F, S (a control's clipped at 0) and tokens D, and the
    direction it gives; the law is extrapolated decades below its window, so only the sign is read."""
    g = float(law_gap(PAPER_SMELT, PAPER_BASELINE, m["F"], max(m["S"], 0.0), b["F"], max(b["S"], 0.0), b["D"]))
    return {"gap": g, "direction": ">" if g > 0 else "<"}


class Compared(NamedTuple):
    """One looped arm against the Baseline: what each comparing stage of reproduce.py returned."""
    ts: dict        # training_summary
    ev_sum: dict    # stage_eval ({} when skipped)
    scal: dict      # stage_scaling ({"error"} when skipped or failed)
    prb: dict       # stage_probes ({} when skipped)
    pclaims: list   # probe_claims.claims(prb)


def gap_vs_tokens(rows: list[dict], arm: str = "smelt") -> dict:
    """SMELT - Baseline validation loss against log10 D per matched run pair (the endpoints both have): each pair's
    slope per decade with its OLS interval and the law's; the mean over pairs with its t-interval (SMELT 4.3:
    below the crossover the law's gap is positive and falls as D grows)."""
    runs: dict = {}
    for r in rows:
        runs.setdefault((r["scale"], r["sparsity_label"], r.get("seed", 0), r["arch"]), {})[float(r["D"])] = r
    pairs = []
    for (scale, lab, seed, arch), b in sorted(runs.items()):
        m = runs.get((scale, lab, seed, arm))
        Ds = sorted(set(b) & set(m or {}))
        if arch != "baseline" or len(Ds) < 2:
            continue
        x = np.log10(Ds)
        gap = [m[D]["val_loss"] - b[D]["val_loss"] for D in Ds]
        law = [law_for_pair(b[D], m[D])["gap"] for D in Ds]
        pairs.append({"cell": configs.cell_key(scale, lab), "seed": seed, "D": Ds, "gap": gap,
                      "slope": stats.slope_interval(x, gap).to_dict(), "law_slope": stats.slope_interval(x, law).mean})
    out = {"pairs": pairs, "mean": None, "verdict": "not resolved", "law_direction": None}
    if pairs:
        iv = stats.mean_interval([p["slope"]["mean"] for p in pairs])
        law_dir = "<" if np.mean([p["law_slope"] for p in pairs]) < 0 else ">"
        out.update(mean=iv.to_dict(), verdict=stats.verdict(iv, "<"), law_direction=law_dir,
                   verdict_here=stats.verdict(iv, law_dir))
    return out


def training_summary(plan: configs.Plan, ladder: list[dict], rows: list[dict], entropy: float,
                     arm: str = "smelt") -> dict:
    """The training claims with their noise: did every model learn (validation loss vs unigram entropy); `arm` -
    Baseline final loss, paired over the repeated cell's seeds and per cell at seed 0 with that cell's seed noise
    (the arm's values under the key "smelt", its role)."""
    fin = finals(rows)
    margins = [entropy - r["val_loss"] for r in rows]
    least_final = min((entropy - r["val_loss"] for r in fin.values()), default=None)
    learned = {"entropy": entropy, "required_margin": 1.5, "endpoints": len(rows),
               "min_margin": min(margins, default=None), "min_margin_final": least_final,
               "below": sum(m >= 1.5 for m in margins), "all_final": least_final is not None and least_final >= 1.5,
               "all_endpoints": bool(margins) and min(margins) >= 1.5}
    out = {"arm": arm, "learned": learned, "cells": [], "repeat": None}
    noise_sd, noise_n = None, 0
    if plan.repeat:
        seeds = sorted({r.get("seed", 0) for r in fin.values()
                        if (r["scale"], r["sparsity_label"]) == tuple(plan.repeat)})
        pairs = [(fin.get(configs.run_name(*plan.repeat, "baseline", s)),
                  fin.get(configs.run_name(*plan.repeat, arm, s))) for s in seeds]
        pairs = [(b, m) for b, m in pairs if b and m]
        if pairs:
            base, smelt = [b["val_loss"] for b, _ in pairs], [m["val_loss"] for _, m in pairs]
            iv = stats.paired_difference(base, smelt)
            d = np.array(smelt) - np.array(base)
            noise_sd, noise_n = (float(d.std(ddof=1)) if len(d) > 1 else None), len(d)
            law = law_for_pair(*pairs[0])
            out["repeat"] = {"cell": configs.cell_key(*plan.repeat), "seeds": len(pairs), "baseline": base,
                             "smelt": smelt, "diff": iv.to_dict(), "verdict": stats.verdict(iv, "<"),
                             "baseline_seed_sd": float(np.std(base, ddof=1)) if len(base) > 1 else None,
                             "law": law, "verdict_here": stats.verdict(iv, law["direction"])}
    for cell in ladder:
        b, m = (fin.get(configs.run_name(cell["scale"], cell["sparsity_label"], a)) for a in (configs.BASELINE, arm))
        if not (b and m):
            continue
        d = m["val_loss"] - b["val_loss"]
        if noise_sd is not None:   # one seed: the seed-to-seed sd of the paired difference from the repeated cell
            half = stats.t_quantile(0.975, noise_n - 1) * noise_sd
            iv = stats.Interval(d, d - half, d + half, 1, 0.95, f"seed sd of {noise_n} seeds in the repeated cell")
        else:
            iv = stats.Interval(d, math.nan, math.nan, 1)
        law = law_for_pair(b, m)
        out["cells"].append({"scale": cell["scale"], "sparsity_label": cell["sparsity_label"], "S": b["S"],
                             "S_smelt": m["S"], "baseline": b["val_loss"], "smelt": m["val_loss"],
                             "diff": iv.to_dict(), "verdict": stats.verdict(iv, "<"), "law": law,
                             "verdict_here": stats.verdict(iv, law["direction"])})
    v = [c["verdict"] for c in out["cells"]]
    out["cells_reproduced"], out["cells_contradicted"] = v.count("reproduced"), v.count("contradicted")
    out["all_cells_verdict"] = stats.all_of(v)
    here = [c["verdict_here"] for c in out["cells"]]
    out["cells_law_higher"] = sum(c["law"]["direction"] == ">" for c in out["cells"])
    out["cells_here"] = {"reproduced": here.count("reproduced"), "contradicted": here.count("contradicted"),
                         "verdict": stats.all_of(here)}
    if len(out["cells"]) >= 2:   # every cell's seed-0 pair as one unit: the mean gap over cells, with a t-interval
        iv = stats.paired_difference([c["baseline"] for c in out["cells"]], [c["smelt"] for c in out["cells"]])
        law_dir = ">" if 2 * out["cells_law_higher"] > len(out["cells"]) else "<"
        out["over_cells"] = {"diff": iv.to_dict(), "verdict": stats.verdict(iv, "<"), "law_direction": law_dir,
                             "verdict_here": stats.verdict(iv, law_dir)}
    out["gap_vs_D"] = gap_vs_tokens(rows, arm)
    return out


# Tables 3.3-3.5's ablations: {script (its out dir under the run's): the winner's check on its results.json}
ABLATIONS = {
    "span_sweep": lambda r: all(min((x for x in r["rows"] if x["sparsity_label"] == lab),
                                    key=lambda x: x["val_loss"])["span_pct"] == 50 for lab in r["best_span"]),
    "depth_sweep": lambda r: r["best_physical_depth"]["looped"] == r["best_physical_depth"]["baseline"],
    "loop_count_sweep": lambda r: r["best_loops"] == 2,
}


def _claim(name: str, result: str, verdict: str, here: str | None = None, **fields) -> list[str]:
    """A claims-table row: report_text.md's claim.<name> (claim, paper's words), this run's result and verdict, and
    `here`: what Table 4.3's law gives at this run's scale with the verdict read against it (None: not a loss claim)."""
    what, paper = TEXT[f"claim.{name}"].split("\n")
    return [what.format(**fields), paper, result, verdict, NOT_LOSS if here is None else here]


def _short(why: str, n: int = 160) -> str:   # the claims table's reasons; the full text is in the stage's JSON
    return why if len(why) < n else why[:n - 3] + "..."


NOT_LOSS = "n/a (Eq. 2 predicts validation loss, not this)"
NO_TERM = "n/a (Eq. 2 has no span, depth or loop-count term)"
SCALE_FREE = "the same: Eq. 2's coefficients do not depend on the scale they are read at"


def _gap_here(direction: str | None, verdict: str) -> str:
    """The at-our-scale cell of a SMELT - Baseline loss claim: the sign Table 4.3 gives here, the verdict against it."""
    if direction is None:
        return "n/a (no matched pair)"
    said = "higher" if direction == ">" else "lower"
    why = f" (the paper: SMELT's data term is higher below D ~{_sci(PAPER_CROSSOVER_D)} tokens, Sec. 4.3)" \
        if said == "higher" else ""
    outcome = {"reproduced": f"SMELT measured {said}, as predicted here" +
                             ("; not a contradiction of the paper" if said == "higher" else ""),
               "contradicted": "SMELT measured the other way: against the law at this scale",
               "not resolved": "the interval straddles 0"}[verdict]
    return f"Table 4.3's law gives SMELT {said} at this F, S, D{why}: {outcome} (**{verdict}**)"


def _claim_rows(ts: dict, scal: dict, pclaims: list[dict], ev_sum: dict, prb: dict | None = None,
                out: Path | None = None) -> list[list[str]]:
    ch, n = ts.get("cells_here") or {}, len(ts["cells"])
    rows = [_claim("lower", f"{ts['cells_reproduced']} of {n} cells lower, {ts['cells_contradicted']} "
                            "higher (95 % intervals)", ts["all_cells_verdict"],
                   f"Table 4.3's law gives SMELT higher in {ts.get('cells_law_higher', 0)} of {n} cells at their F, S, "
                   f"D; against it {ch.get('reproduced', 0)} agree, {ch.get('contradicted', 0)} disagree "
                   f"(**{ch.get('verdict', 'not resolved')}**)")]
    if ts.get("over_cells"):
        o = ts["over_cells"]
        rows.append(_claim("mean", _iv(o["diff"], 4), o["verdict"], _gap_here(o["law_direction"], o["verdict_here"]),
                           n=n))
    if ts.get("repeat"):
        r = ts["repeat"]
        rows.append(_claim("repeat", _iv(r["diff"], 4), r["verdict"], _gap_here(r["law"]["direction"],
                                                                                 r["verdict_here"]),
                           seeds=r["seeds"], cell=r["cell"]))
    if ts.get("gap_vs_D", {}).get("mean"):
        gd = ts["gap_vs_D"]
        said = "falling" if gd["law_direction"] == "<" else "rising"
        rows.append(_claim("gap_d", f"{_iv(gd['mean'], 4)} nats per decade of D", gd["verdict"],
                           f"Table 4.3's law gives the gap {said} as D grows here: **{gd['verdict_here']}**",
                           n=len(gd["pairs"])))
    rows += [_ce_gain_claim(scal), *_scaling_claims(scal)]
    if prb and prb.get("pairs"):
        rows.append(_overlap_claim(prb))
    for c in pclaims:
        iv = c["interval"].fmt(3) if c["interval"] else "no pair has it"
        tr = f"; over pairs {c['across_pairs'].fmt(3)}" if c.get("across_pairs") else ""
        rows.append([f"{c['what']} {c['direction']} {c['value']:g} ({c['figure']})", c["paper"], iv + tr, c["verdict"],
                     NOT_LOSS])
    for cl in (ev_sum.get("report") or {}).get("claims", []):
        iv = _iv(cl["interval"], 3) if cl.get("interval") else "no interval"
        if cl.get("items_interval"):   # the same difference over the items, both noises (downstream_claims._item_noise)
            iv += f"; over the items {_iv(cl['items_interval'], 3)}; both noises {_iv(cl.get('both_interval'), 3)}"
        rows.append([cl["claim"] + (f" ({cl['n']} {cl['unit']}s)" if cl.get("n") else ""),
                     cl["paper"] or "none: the paper has no generated tasks",
                     iv + (f"; {cl['why']}" if cl.get("why") else ""), cl["verdict"], NOT_LOSS])
    return rows + _ablation_claims(out)


def _derived_text(d: dict | None, nd: int = 3) -> str:
    """A scaling_analysis derived entry as 'point [lo, hi] (x % of draws failed)' or 'point (no interval: why)'."""
    if not d:
        return "n/a"
    if d.get("interval") is None:
        return f"{d['point']:+.{nd}f} (no interval: {d.get('interval_why') or 'no bootstrap'})"
    return stats.Interval(**d["interval"]).fmt(nd) + failed_text(d.get("failed_share"))


def _scaling_claims(scal: dict) -> list[list[str]]:
    """SMELT 4.3 / 5.2's further claims from scaling_analysis's `derived` entries and per-domain gains."""
    der, law = scal.get("derived") or {}, scal.get("law_here") or {}
    why = "not resolved at this scale: " + _short(scal.get("error") or "; ".join(scal.get("gains", {}).get("why", []))
                                                  or "no pair bootstrap (two identified surfaces and n_boot > 0)")
    verdict = lambda d, direction, value=0.0: stats.verdict(_interval(d.get("interval")), direction, value)
    parts = [(k, der.get(f"{k}_diff")) for k in ("gamma", "a", "c")]
    grow = {k.split("/", 1)[1]: d for k, d in der.items() if k.startswith("growth/")}
    tpp = {k.split("/", 1)[1]: d for k, d in der.items() if k.startswith("tpp_ratio/")}
    v_gamma = stats.all_of([verdict(d, ">") for _, d in parts]) if der else "not resolved"
    v_grow = stats.all_of([verdict(d, ">") for d in grow.values()])
    law_grow, law_tpp = law.get("growth_pp") or {}, law.get("tpp_ratio") or {}
    side = lambda x, mid: ">" if x > mid else "<"                          # the side of `mid` the law gives
    here_grow = stats.all_of([verdict(d, side(law_grow.get(lab, 0.0), 0.0)) for lab, d in grow.items()])
    here_tpp = stats.all_of([verdict(d, side(law_tpp.get(lab, 1.0), 1.0), 1.0) for lab, d in tpp.items()])
    grow_here = ("n/a (fewer than two budgets)" if not law_grow else "Table 4.3's law gives " + ", ".join(
        f"{lab} {v:+.0f}" for lab, v in law_grow.items()) + f" pp per decade at these budgets: **{here_grow}**")
    tpp_here = ("n/a (no budget)" if not law_tpp else "Table 4.3's law gives a ratio of " + ", ".join(
        f"{lab} {v:.3f}" for lab, v in law_tpp.items()) + f" at this budget; the side of 1 against it: **{here_tpp}**")
    dk, dc, cross = der.get("log10K_diff"), der.get("c_diff"), der.get("log10_crossover")
    v_data = stats.all_of([verdict(dk, ">"), verdict(dc, ">")]) if dk else "not resolved"
    v_cross = (stats.all_of([verdict(cross, ">", math.log10(PAPER_CROSSOVER_D) - 1),
                             verdict(cross, "<", math.log10(PAPER_CROSSOVER_D) + 1)]) if cross else "not resolved")
    return [_claim("gamma", "; ".join(f"{k} diff {_derived_text(d, 4)}" for k, d in parts) if der else why, v_gamma,
                   f"{SCALE_FREE} (**{v_gamma}**)"),
            _claim("data_term", f"log10 K diff {_derived_text(dk, 3)}; c diff {_derived_text(dc, 4)}" if dk else why,
                   v_data, f"{SCALE_FREE} (**{v_data}**)"),
            _claim("crossover", f"log10 D* {_derived_text(cross, 2)} (paper: {math.log10(PAPER_CROSSOVER_D):.2f})"
                   if cross else why, v_cross, f"{SCALE_FREE}; D* is a property of the two surfaces (**{v_cross}**)",
                   paper_D=_sci(PAPER_CROSSOVER_D)),
            _claim("growth", "; ".join(f"{lab} ({d['from']:.2g} to {d['to']:.2g}): {_derived_text(d, 1)} pp"
                                       for lab, d in grow.items()) if grow else
                   (why if not der else "not resolved at this scale: fewer than two in-window budgets"), v_grow,
                   grow_here),
            _claim("tpp", "; ".join(f"{lab}: {_derived_text(d, 3)}" for lab, d in tpp.items()) if tpp else why,
                   stats.all_of([v for d in tpp.values() for v in (verdict(d, ">", 0.94), verdict(d, "<", 1.06))]),
                   tpp_here),
            _claim("code", _code_claim(scal), "not resolved", "n/a (per-domain intercept refits carry no interval)")]


def _code_claim(scal: dict) -> str:
    """The per-domain gains at the middle sparsity column (point estimates: they carry no interval)."""
    dom = (scal.get("subsets") or {}).get("val_loss_by_domain", {}).get("gains", {})
    labs = list(scal.get("sparsity", {}))
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
            iv.fmt(3) if iv else f"not resolved at this scale: {o['why']}", stats.verdict(iv, "<"), NOT_LOSS]


def _ablation_claims(out: Path | None) -> list[list[str]]:
    """Tables 3.3-3.5's winners as the sweep scripts found them, read from OUT/<script>/results.json;
    one run per configuration (as in the paper), so a winner is a point, stated as such."""
    rows = []
    for name, won in ABLATIONS.items():
        if out is None or not (path := Path(out) / name / "results.json").exists():
            rows.append(_claim(name, f"not resolved: run `python scripts/{name}.py --out-dir OUT/{name}` (not part "
                                     "of reproduce.py)", "not resolved", NO_TERM))
        else:
            ok = won(json.loads(path.read_text()))
            rows.append(_claim(name, f"{'same' if ok else 'another'} winner in {name}/results.json (one run per "
                                     "configuration: no interval)", "reproduced" if ok else "contradicted", NO_TERM))
    return rows


def _ce_gain_claim(scal: dict) -> list[str]:
    """CE gain > 0 at budgets inside the data: reproduced when every non-extrapolated cell's bootstrap interval
    is above 0, contradicted when one is wholly below, else not resolved (also: no identified fit); beside it, the
    sign Table 4.3's law gives at these budgets and the verdict read against it."""
    g, law = scal.get("gains", {}), (scal.get("law_here") or {}).get("gain") or {}
    vals = [v for gs in law.values() for v in gs]
    law_dir = ">" if vals and min(vals) > 0 else "<" if vals and max(vals) < 0 else None
    law_text = (f"Table 4.3's law gives {100 * min(vals):+.0f} to {100 * max(vals):+.0f} % at these budgets"
                if vals else "n/a (no budget inside the data)")
    inside = [c for c in g.get("cells", []) if not c.get("extrapolated")]
    if "error" in scal or not g.get("available"):
        why = _short(scal.get("error") or "; ".join(g.get("why", [])) or "no gains")
        return _claim("ce_gain", f"no number: {why}", "not resolved", f"{law_text} (**not resolved**)")
    if not inside:
        return _claim("ce_gain", "every budget extrapolated (see the scaling tables)", "not resolved",
                      f"{law_text} (**not resolved**)")
    ivs = [_interval(c.get("interval")) for c in inside]
    text = "; ".join(f"{c['sparsity_label']} at {c['budget']:.2g}: {c['text']}" for c in inside)
    few = next((iv.n for iv in ivs if iv is not None and iv.few_units), None)
    text += (f"; a cell bootstrap over {few} cells decides nothing (fewer than {stats.MIN_BOOTSTRAP_UNITS} units: "
             f"too narrow, docs/wins.md)" if few else "")
    here = stats.all_of([stats.verdict(iv, law_dir, 0.0) for iv in ivs]) if law_dir else "not resolved"
    return _claim("ce_gain", text + f" (budgets: {scal.get('budget_rule', 'n/a')})",
                  stats.all_of([stats.verdict(iv, ">", 0.0) for iv in ivs]), f"{law_text} (**{here}**)")


def _rows(rows: list[list]) -> str:
    """A markdown table's rows (its header is report_text.md's)."""
    return "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in rows)


def _sci(x: float) -> str:
    """1.2e+06 -> '1.2e6' (compact powers for prose)."""
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"


def _interval(d: dict | None) -> stats.Interval | None:
    return stats.Interval(**d) if d else None


def _iv(d: dict | None, nd: int = 3) -> str:
    """An Interval dict as 'mean [lo, hi]' (or 'mean (no interval)'; 'n/a' for none)."""
    return stats.Interval(**d).fmt(nd) if d else "n/a"


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


def _figures(paths, out: Path, base: Path | None = None, sep: tuple = ("",)) -> list[str]:
    """Image lines of the `paths` that exist ((name, path) pairs, or paths named by their stem), each then `sep`."""
    pairs = [p if isinstance(p, tuple) else (Path(p).stem, p) for p in paths]
    links = [(name, p and figure_link(p, out, base)) for name, p in pairs]
    return [line for name, link in links if link for line in (f"![{name}]({link})", *sep)]


def loop_count(ladder: list[dict], arm: str = "smelt") -> int | None:
    """r, the loop count of the ladder's matched `arm` models (None when they differ or the ladder is empty)."""
    rs = {c[arm]["loop"]["n_loops"] for c in ladder}
    return rs.pop() if len(rs) == 1 else None


def visits_label(r: int | None) -> str:
    """What the probes compare at loop count r: visit v+1 against visit v of each looped layer."""
    if r == 2:
        return "the second visit"
    return f"visits 2-{r} (visit v+1 vs v)" if r else "later visits (visit v+1 vs v)"


def _section_plan(plan: configs.Plan, ladder: list[dict], rows: list[dict], cost: dict) -> list[str]:
    import budget   # here, not at the top: rendering markdown needs no model code
    from loop import SMELT
    from model import ModelConfig
    counts = [budget.count_params(ModelConfig.from_dict(c[a])) for c in ladder for a in configs.cell_arms(c)]
    span = lambda v: f"{_sci(min(v))}-{_sci(max(v))}"
    D = {r["D"] for r in rows}
    runs = TEXT["plan.repeat" if plan.repeat else "plan.runs"].format_map({
        **vars(plan), "n_cells": len(ladder), "n_runs": len(cost["runs"]),
        "arms": ", ".join(configs.arm_label(a) for a in (configs.BASELINE, *plan.arms)),
        "branches": ", ".join(map(str, plan.branch_steps)), "tokens": cost["tokens_per_run"] / 1e6})
    changed = ", ".join(f"{k} {v}" for k, v in vars(plan.loop).items() if getattr(SMELT, k) != v)
    first = configs.arm_label(next(iter(plan.arms)))
    return _text("plan", runs=runs,
                 decay=f"Decay data: {configs.decay_freshness(cost['epochs_per_run'])}." if cost.get("epochs_per_run")
                 else "", params=span([n["blocks"] for n in counts]), active=span([n["active"] for n in counts]),
                 tokens=f"{span(D)} tokens" if D else "no tokens",
                 loop=f"Loop: not SMELT's ({changed}; loop.LoopSpec): every {first} column below is this looped "
                 f"model." if plan.loop != SMELT else "")


def _section_ladder(ladder: list[dict]) -> list[str]:
    many = any(len(c["match"]) > 1 for c in ladder)   # more than one looped arm: name it beside the scale
    return _text("ladder", ctx=ladder[0]["ctx_len"] if ladder else float("nan"), rows=_rows(
        [c["scale"] + (f" ({configs.arm_label(a)})" if many else ""), c["sparsity_label"],
         f"{c['baseline']['d_model']} -> {c[a]['d_model']}", f"{c['baseline']['n_experts']} -> {c[a]['n_experts']}",
         *(f"{m[k]:.3f}" for k in ("flops_ratio", "flops_ratio_other_head", "params_ratio", "kv_ratio")),
         "yes" if m["within_tolerance"] else "**no**"] for c in ladder for a, m in c["match"].items()))


def _section_learned(ts: dict, rows: list[dict], ladder: list[dict]) -> list[str]:
    """Did every model of every arm learn: the unigram target and the final loss of each run."""
    lr = ts["learned"]
    order = {configs.cell_key(c["scale"], c["sparsity_label"]): i for i, c in enumerate(ladder)}
    rank = lambda r: (order.get(configs.cell_key(r["scale"], r["sparsity_label"]), 99), r.get("seed", 0), r["arch"])
    unigram = (f" On this validation set (the same tokens every model is scored on) the unigram model fitted on the "
               f"training stream scores {lr['unigram_val_loss']:.3f}." if lr.get("unigram_val_loss") else "")
    fin = sorted(finals(rows).items(), key=lambda kv: rank(kv[1]))   # ladder order, then seed, then arch
    return _text("training", **lr, target=lr["entropy"] - 1.5, met="met" if lr["all_final"] else "**not met**",
                 unigram=unigram, runs=_rows([name, f"{r['D'] / 1e6:.2f}M", f"{r['val_loss']:.3f}",
                                              f"{lr['entropy'] - r['val_loss']:.2f}"] for name, r in fin))


def _section_training(ts: dict, rows: list[dict]) -> list[str]:
    """One arm against the Baseline: seed noise, the per-cell table, the law here and the gap against D."""
    rep = ts.get("repeat")
    noise = TEXT["training.noise"].format_map({
        **rep, "diff": _iv(rep["diff"], 4), "sd": "n/a" if rep.get("baseline_seed_sd") is None
        else f"{rep['baseline_seed_sd']:.4f}", "here": _gap_here(rep["law"]["direction"], rep["verdict_here"]) + "."})\
        if rep else ""
    said = lambda law: "SMELT higher" if law["direction"] == ">" else "SMELT lower"
    oc, gd, D = ts.get("over_cells"), ts.get("gap_vs_D") or {}, [r["D"] for r in rows]
    over = (f" Over the {len(ts['cells'])} cells, each cell's seed-0 pair one unit, SMELT - Baseline is "
            f"**{_iv(oc['diff'], 4)}** nats ({oc['verdict']}; against the law here: {oc['verdict_here']})." if oc else "")
    return _text("training.pair", noise=noise, over_cells=over, crossover=_sci(PAPER_CROSSOVER_D),
                 tokens=f"{_sci(min(D))}-{_sci(max(D))}" if D else "none",
                 cells=_rows([c["scale"], c["sparsity_label"], f"{100 * c['S']:.1f} %", f"{c['baseline']:.4f}",
                              f"{c['smelt']:.4f}", _iv(c["diff"], 4), c["verdict"], said(c["law"]), c["verdict_here"]]
                             for c in ts["cells"]),
                 gap_rows=_rows([p["cell"] + (f" seed {p['seed']}" if p["seed"] else ""),
                                 ", ".join(f"{d / 1e6:.2f}M" for d in p["D"]), ", ".join(f"{g:+.3f}" for g in p["gap"]),
                                 _iv(p["slope"], 4), f"{p['law_slope']:+.3g} (sign only)"] for p in gd.get("pairs", [])),
                 gap_n=len(gd.get("pairs", [])), gap_mean=_iv(gd.get("mean"), 4),
                 gap_verdict=gd.get("verdict", "not resolved"))


def _section_scaling(scal: dict, out: Path, where: Path | None = None) -> list[str]:
    if "error" in scal:
        return _skipped("scaling", f"Not available: {scal['error']}")
    fits = scal.get("fits", {})
    L = _text("scaling", identified=", ".join(a for a, f in fits.items() if f.get("identified")) or "none",
              fits=", ".join(fits))
    where = where or out   # the arm's folder (configs.arm_dir)
    tables = where / "scaling" / (scal.get("tables_md") or "tables.md")
    if tables.exists():
        L += [re.sub(r"^(#{2,}) ", r"#\1 ", tables.read_text(), flags=re.M), ""]   # nest under this section
    return L + _figures(scal.get("figures", []), out, base=where / "scaling")


def _section_downstream(ev_sum: dict, out: Path) -> list[str]:
    rep = ev_sum.get("report")
    if not rep:
        return _skipped("downstream", "Not evaluated (stage skipped).")
    L = _text("downstream", **rep)
    wins, icl, fams, cal = (rep.get(k, {}) for k in ("wins", "icl", "families", "calibration"))
    if wins.get("metrics"):
        L += _text("downstream.wins", rows=_rows(
            [m["what"], f"{m['wins']} / {m['n']}" + (f" ({m['ties']} ties)" if m["ties"] else ""),
             ", ".join(f"{c} {v['wins']}/{v['n']}" for c, v in m["by_cell"].items()),
             m["paper"] or "none: the paper has no generated tasks"] for m in wins["metrics"].values()))
    if icl.get("note"):
        L += [f"**Shot sweep (Appendix C).** {icl['note']}", ""]
    if fams:
        L += _text("downstream.length", rows=_rows(
            [name, f["n_contrasts"], _iv(f.get("long_short"), 2) if f.get("long_short") else
             f"n/a ({f.get('why') or 'no contrast'})", f.get("paper")] for name, f in fams.items()))
    if cal.get("error"):
        L += [f"**Calibration (Eq. 6-7):** not identified ({cal['error']}).", ""]
    for name, c in ({} if cal.get("error") else cal.get("metrics", {})).items():
        if not name.startswith("task/") and not c.get("identified"):
            L += [f"**Calibration of {name} (Eq. 6):** not identified ({c.get('why')}).", ""]
    figs = ev_sum.get("figures", {})
    L += _figures((figs.get("figures") or {}).items(), out)
    return L + [f"- {note}" for note in figs.get("notes", []) if not note.startswith("Calibration")] + [""]


def _section_probes(prb: dict, cl: list[dict], out: Path, r: int | None = 2) -> list[str]:
    if not prb.get("pairs"):
        return _skipped("probes", "Not run (stage skipped).", visits=visits_label(r))
    na = lambda iv: iv.fmt(3) if iv else "n/a"   # no interval: no across-pairs or weakest-pair column either
    rows = [[f"{c['what']} ({c['figure']})", na(c["interval"]), na(c["interval"] and c.get("across_pairs")),
             na(c["interval"] and c.get("weakest")), c["paper"], c["verdict"]] for c in cl]
    s = prb["sample"]
    L = _text("probes", visits=visits_label(r), n_pairs=len(prb["pairs"]), tokens=s["tokens"], units=s["units"],
              domains=", ".join(s["domains"]), rows=_rows(rows))
    # probe figure paths are as the stage made them (under out, from the working directory), not out-relative
    return L + _figures(prb.get("figures", []), out, base=Path.cwd(), sep=()) + [""]


def _section_arm(arm: str, c: Compared, plan: configs.Plan, out: Path, ladder, rows) -> list[str]:
    """Every comparison of one looped arm with the Baseline, over the pair's own runs."""
    rows = [r for r in rows if r["arch"] in (configs.BASELINE, arm)]
    pclaims = list(c.pclaims) if c.prb.get("pairs") else []
    return (_section_training(c.ts, rows) + _section_scaling(c.scal, out, configs.arm_dir(out, plan, arm))
            + _section_downstream(c.ev_sum, out)
            + _section_probes(c.prb, pclaims, out, loop_count(ladder, arm))
            + _text("claims", rows=_rows(_claim_rows(c.ts, c.scal, pclaims, c.ev_sum, c.prb, out)),
                    crossover=_sci(PAPER_CROSSOVER_D)))


def write_report(plan_name: str, plan: configs.Plan, out: Path, ladder, rows, compared: dict[str, Compared],
                 summary: dict, cost: dict) -> Path:
    """REPORT.md from the stages' results: the runs once, then each looped arm's comparison (`compared`, by name;
    the first arm's as the report's own sections, every other one under its own heading, one level down)."""
    L = _text("summary", **{**summary, "plan_name": plan_name,
                            "dirty": " (with uncommitted changes)" if summary["dirty"] else "",
                            "stages": ", ".join(f"{k} {v:.1f}" for k, v in summary["stage_minutes"].items())})
    first = next(iter(compared.values()))
    L += _section_plan(plan, ladder, rows, cost) + _section_ladder(ladder) + _section_learned(first.ts, rows, ladder)
    for k, (arm, c) in enumerate(compared.items()):
        part = _section_arm(arm, c, plan, out, ladder, rows)
        if k:   # another arm: its heading, then its sections nested under it
            L += _text("arm", arm=arm, spec=plan.arms[arm]) + [re.sub(r"^(#{1,5}) ", r"#\1 ", x) for x in part]
        else:
            L += part
    path = out / "REPORT.md"
    path.write_text("\n".join(L))
    return path


def budget_machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def run_summary(preset: str, stage_s: dict, wall: float, manifest: dict) -> dict:
    """Where and when this report was made, and on which corpus (the data manifest's fingerprint): the block
    the README quotes."""
    from lab.corpus import fingerprint
    root = Path(__file__).resolve().parents[1]

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    return {"preset": preset, "corpus": fingerprint(manifest),
            "commit": git("rev-parse", "--short=12", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": budget_machine(),
            "cpu": cpu or platform.processor(), "python": sys.version.split()[0], "torch": torch.__version__,
            "minutes": round(wall / 60, 2), "stage_minutes": {k: round(v / 60, 2) for k, v in stage_s.items()}}
