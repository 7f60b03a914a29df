"""SMELT Section 5: downstream comparison of a looped run and its Baseline, at every branch endpoint.

  python scripts/downstream.py --preset smoke|tiny|small [--runs BASELINE LOOPED | --ladder DIR] [--steps N]

The pair (common.pair_runs): --runs, --ladder's last cell, or the preset's Baseline and matched SMELT
trained here. Every decay branch is scored by evaluate.evaluate_endpoint and the endpoints are paired by
downstream_claims.downstream_report: wins (5.1), the shot sweep (Appendix C), the loss gain by length (5.3)
and the claims. Writes eval_endpoints.json, results.json, table.md and figures. In full: docs/scripts.md.
"""
from __future__ import annotations

import common  # noqa: I001  (puts the repo root on sys.path)

import checks
import eval as ev
import reproduce
from lab import downstream_claims, eval_plots, evaluate, stats, tasks


def build_parser():
    ap = common.parser(__doc__)
    common.add_pair_args(ap)
    ap.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                    choices=["all", "real", "generated", *tasks.REAL_TASKS, *tasks.GENERATED_TASKS],
                    help="eval tasks or groups (default: the plan's)")
    ap.add_argument("--shots", type=checks.nonneg_int, nargs="+", default=None,
                    help="shot counts k (default: the plan's)")
    ap.add_argument("--seeds", type=checks.positive_int, default=None, help="demonstration seeds (default: the plan's)")
    ap.add_argument("--max-items", type=checks.positive_int, default=None, help="items per task (default: the plan's)")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("downstream", args)
    p = exp.plan
    runs = dict(zip(("baseline", "smelt"), common.pair_runs(exp)))
    kw = dict(tasks=args.tasks or p.tasks, shots=args.shots or p.shots, seeds=args.seeds or p.seeds,
              max_items=args.max_items or p.max_items, val_tokens_per_source=exp.tc.eval_tokens, log=common.log)
    recs = []
    for arch, run in runs.items():
        eps = ev.run_endpoints(run) if (run / "results.jsonl").is_file() else [{"path": run}]
        common.log(f"evaluate {arch}: {run} ({len(eps)} endpoints)")
        recs += [{**evaluate.evaluate_endpoint(e["path"], **kw), "arch": arch} for e in eps]
    # the two runs are the pair by construction: give them one cell and seed if their metadata differ
    for key, default in (("scale", "pair"), ("sparsity_label", "-"), ("seed", None)):
        if len({str(r.get(key)) for r in recs}) != 1 or recs[0].get(key) is None:
            for r in recs:
                r[key] = default
    reproduce.write_json(exp.out / "eval_endpoints.json", recs)
    rep = downstream_claims.downstream_report(recs)
    rows = []
    for task, t in rep["icl"].items():
        for k in t["ks"]:
            r = t["by_k"][str(k)]
            rows.append({"task": task, "k": k, "chance": t["chance"], "baseline_acc": r["baseline_all_cells"],
                         "looped_acc": r["smelt_all_cells"], "gain": r["smelt_all_cells"] - r["baseline_all_cells"],
                         "p": t["test"]["p"] if k == t["max_k"] else None,
                         "note": "" if r["cells_above"] else "at or below chance"})
    win_rows = [{"metric": m, "wins": f"{w['wins']} / {w['n']}", "paper": w["paper"] or "-"}
                for m, w in rep["wins"]["metrics"].items()]
    print("\nWins of the looped run over its Baseline, matched endpoint pairs\n" + common.format_table(
        win_rows, [("metric", "metric", ""), ("looped better", "wins", ""), ("paper", "paper", "")]))
    claims = [{**c, "iv": stats.Interval(**c["interval"]).fmt(3) if c["interval"] else "-"} for c in rep["claims"]]
    print("\nClaims (interval over matched pairs; verdict by stats.verdict)\n" + common.format_table(
        claims, [("claim", "claim", ""), ("this run", "iv", ""), ("paper", "paper", ""), ("verdict", "verdict", ""),
                 ("why", "why", "")]))
    fam = rep["families"]["SMELT vs Baseline"]
    if fam["shape"]:
        print("\nNormalised loss gain by document length (gain / mean gain)\n" + common.format_table(
            [{"bucket": int(b), "shape": v} for b, v in sorted(fam["shape"].items(), key=lambda kv: int(kv[0]))],
            [("<= tokens", "bucket", "d"), ("shape", "shape", ".2f")]))
    figs = eval_plots.plot_downstream(rep, recs, exp.out)
    for note in figs["notes"]:
        common.log(note)
    return exp.finish({"runs": {k: str(v) for k, v in runs.items()}, "rows": rows, "wins": rep["wins"],
                       "claims": rep["claims"], "families": rep["families"], "icl": rep["icl"],
                       "calibration": {k: v for k, v in rep["calibration"].items() if k != "metrics"},
                       "figures": [f for f in figs["figures"].values() if f], "notes": figs["notes"]}, [
        ("task", "task", ""), ("k", "k", "d"), ("chance", "chance", ".3f"), ("Baseline acc", "baseline_acc", ".3f"),
        ("looped acc", "looped_acc", ".3f"), ("gain", "gain", "+.3f"), ("p (seeds, one-sided)", "p", ".3f"),
        ("", "note", "")])


if __name__ == "__main__":
    checks.run_main(main)
