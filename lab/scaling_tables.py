"""The text of the scaling analysis: tables.md and SMELT's Table 4.3 recomputed.

* `markdown`: tables.md from scaling_analysis.analyse's report: the coefficient table (numbers
  only for identified fits, else "not identified (why)"), the CE-gain table (SMELT Table 4.3,
  Eq. 5) and TPP table with their cell-bootstrap brackets, bootstrap notes, extrapolation marks
  (†) and the per-subset tables (SMELT 5.2).  No number in it has more than 8 digits.
* `paper_tables`: SMELT's CE-gain and TPP tables recomputed from the printed coefficients
  (`python scaling.py --paper`).
* Small formatters shared with scaling_analysis.py: `format_table`, `pct_text`, `tpp_text`,
  `why_text`, `why_short`.

Read first: scaling.py (the quantities) and scaling_analysis.py (the report this file prints).
"""
from __future__ import annotations

import math
from typing import Sequence

from scaling import (CONTROL_LABEL, GAIN_FLOOR, PAPER_BASELINE, PAPER_BUDGETS, PAPER_CE_GAIN_PCT, PAPER_SMELT,
                     PAPER_SPARSITIES, PAPER_TPP_1E21, ce_gain, tpp)


def format_table(title: str, row_names: Sequence[str], col_names: Sequence[str], cells) -> str:
    """A small markdown table; cells is a (rows, cols) nested list of strings."""
    lines = [f"### {title}", "", "| | " + " | ".join(col_names) + " |", "|---" * (len(col_names) + 1) + "|"]
    lines += ["| " + name + " | " + " | ".join(row) + " |" for name, row in zip(row_names, cells)]
    return "\n".join(lines) + "\n"


def pct_text(g: float | None, nd: int = 1) -> str:
    """A gain (fraction) as a signed percentage with at most 4 integer digits."""
    if g is None or g < GAIN_FLOOR:
        return "< -9999"
    return f"{100 * g:+.{nd}f}"


def failed_text(share: float | None) -> str:
    """' (2.5 % of draws failed)' beside a bootstrap interval; '' when no bootstrap ran."""
    return "" if share is None else f" ({100 * share:.1f} % of draws failed)"


def tpp_text(x: float) -> str:
    """TPP as an integer between 10 and 1e6, else 3 significant digits (never a long number)."""
    return f"{x:.0f}" if 10 <= x < 1e6 else f"{x:.3g}"


def why_text(why: Sequence[str]) -> str:
    return "not identified (" + "; ".join(why) + ")"


def why_short(why: Sequence[str]) -> str:
    """The reason keys only, for tables after the first (which prints them in full)."""
    keys = list(dict.fromkeys(w.split(":")[0] for w in why))
    return "not identified (" + ", ".join(keys) + "; details in the coefficients table)"


def paper_tables() -> str:
    """SMELT Tables 4.3 (CE gain, TPP at 1e21) recomputed from the printed coefficients."""
    cols = [f"S = {round(100 * s)} %" for s in PAPER_SPARSITIES]
    gain = [[f"{100 * ce_gain(PAPER_SMELT, PAPER_BASELINE, C, s):.1f} (paper {p:.1f})"
             for s, p in zip(PAPER_SPARSITIES, PAPER_CE_GAIN_PCT[C])] for C in PAPER_BUDGETS]
    tp = [[f"{tpp(co, 1e21, s):.0f} (paper {p})" for s, p in zip(PAPER_SPARSITIES, PAPER_TPP_1E21[arch])]
          for arch, co in (("baseline", PAPER_BASELINE), ("smelt", PAPER_SMELT))]
    note = ("Recomputed from the coefficients as printed in SMELT Table 4.3. The CE gain moves by up to\n"
            "~1 pp within the rounding of those coefficients, so entries can differ from the paper's by ~0.1 pp.\n")
    return (format_table("CE gain of SMELT over Baseline (%)", [f"C = {C:.0e}" for C in PAPER_BUDGETS], cols, gain)
            + "\n" + format_table("TPP at C = 1e21", ["Baseline", "SMELT"], cols, tp) + "\n" + note)


def markdown(report: dict, cols: dict, md_sub: list[str], target: str, ref: str) -> str:
    """tables.md: fits (coefficients only when identified), CE gain, TPP, subsets.  No number a
    degenerate fit produced; every number has at most 8 digits."""
    labs = list(cols)
    md = ["## Scaling-law fits (SMELT Eq. 2)\n"]
    ctl = (f"The {report['n_control_rows']} rows of the `{CONTROL_LABEL}` control cells are left out of the fits "
           f"(SMELT 4.3)." if report["n_control_rows"] else
           ("The control cells are included (--include-dense)." if report["include_dense"] else "There are no control cells."))
    reps = report.get("seed_means") or {}
    md.append(ctl + (f" Cells only one architecture has (left out): {', '.join(report['unmatched_cells'])}."
                     if report["unmatched_cells"] else "")
              + (" Seed replicates are averaged into one point per endpoint before fitting: "
                 + ", ".join(f"{k} ({n} seeds)" for k, n in reps.items()) + "." if reps else "") + "\n")
    rows, cells = [], []
    for a, e in report["fits"].items():
        rg = e.get("ranges")
        data = [str(e["n_points"]), "–" if rg is None else f"{rg['C'][0]:.2e} to {rg['C'][1]:.2e}"]
        rows.append(a)
        if e["identified"]:
            se = e["se"]
            exp = [f"{e[k]:.4f}" + (f" ± {se[k]:.3f}" if k in se and math.isfinite(se[k]) else
                                     " (pinned)" if k in e["fixed"] else "") for k in "abc"]
            cells.append(["identified", f"{e['E']:.4f}", f"{e['A']:.4g}", f"{e['K']:.4g}", *exp,
                          f"{e['gamma']:.3f}", f"{e['rmse_nats']:.4f}", *data])
        else:
            cells.append([why_text(e["why"]), *["–"] * 8, *data])
    md.append(format_table("Coefficients (± Gauss-Newton standard error)", rows,
                           ["status", "E", "A", "K", "a", "b", "c", "gamma", "RMSE (nats)", "points", "C range (FLOPs)"],
                           cells))
    short = {a: f"{a} {why_short(e['why'])}" for a, e in report["fits"].items() if not e["identified"]}
    g = report["gains"]
    budgets = report["budgets"]
    g_why = [short[a] for a in (target, ref) if a in short] or g["why"]
    where = report["budget_rule"]
    if g["available"]:
        by = {(c["budget"], c["sparsity_label"]): c["text"] for c in g["cells"]}
        md.append(format_table(f"CE gain of {target} over {ref} (%, at {where})",
                               [f"C = {C:.2e}" for C in budgets], [f"{l} (S = {cols[l]:.2f})" for l in labs],
                               [[by[(C, l)] for l in labs] for C in budgets]))
    else:
        md.append(f"### CE gain of {target} over {ref}\n\nNot computed: {'; '.join(g_why)}.\n")
    tp_rows, tp_cells = [], []
    for a, t in report["tpp"].items():
        tp_rows.append(a)
        tp_cells.append([c["text"] for c in t["cells"]] if t["available"] else
                        [short[a].removeprefix(a + " ") if a in short else "; ".join(t["why"])] + ["–"] * (len(labs) - 1))
    if tp_rows and labs:
        C = report["tpp_budget"]
        md.append(format_table("Compute-optimal tokens per parameter, TPP" + (f" at C = {C:.2e}" if C else ""),
                               tp_rows, labs, tp_cells))
    notes = []
    for name, b in report["bootstrap"].items():
        fails = ", ".join(f"{k} ({v})" for k, v in sorted(b["failures"].items(), key=lambda kv: -kv[1]))
        notes.append(f"Bootstrap `{name}`: {b['n_draws']} cell resamples, each refitting "
                     f"{' and '.join(b['surfaces'])}; {b['n_failed']} failed ({100 * b['failed_share']:.0f} %)"
                     + (f": {fails}" if fails else "") + ".")
    if notes:
        notes.append("Brackets are the 2.5 / 97.5 percentiles over every draw, a failed draw counted as -inf for "
                     "the lower and +inf for the upper bound (not conditional on success); a cell without brackets "
                     "has none (see interval_why in tables.json).")
    if any(c.get("extrapolated") for c in g["cells"]) or any(
            c.get("extrapolated") for t in report["tpp"].values() for c in t["cells"]):
        notes.append("† extrapolated: the budget, C_ref or a compute-optimal F* / D* lies outside the data of a "
                     "fitted surface (reasons in tables.json).")
    md += [n + "\n" for n in notes]
    if md_sub:
        md.append("### Per-subset CE gain (SMELT 5.2; intercepts refitted with the aggregate exponents)\n")
        md += md_sub
    elif not g["available"]:
        md.append(f"Per-subset and quartile gains: not computed ({'; '.join(g_why)}).\n")
    return "\n".join(md)
