"""SMELT Section 5: downstream comparison of a looped run and its Baseline.

  python scripts/downstream.py --preset smoke|tiny|small [--runs BASELINE LOOPED | --ladder DIR] [--steps N]

The pair: two run directories (--runs), the last cell of a scaling_ladder.py / reproduce.py output
(--ladder), or, by default, the preset's Baseline and its matched SMELT trained here. Each run goes
through eval.evaluate_run (validation loss overall, per source, per domain and per document-length
bucket on the run's own data; the few-shot shot sweep, tasks / shots / seeds / items from
reproduce.PLANS), then eval.compare: per task and k, the accuracy gain of the looped run and the
paired sign-flip permutation test's p-value; the normalised length shape of its loss gain
(SMELT 5.3) and the long/short ratio. Writes eval_baseline.json, eval_looped.json, results.json,
tables, shot_sweep.png and length_shape.png.
"""
from __future__ import annotations

import common  # noqa: I001  (puts the repo root on sys.path)

import eval as ev
import reproduce


def main(argv=None) -> dict:
    ap = common.parser(__doc__)
    common.add_pair_args(ap)
    ap.add_argument("--tasks", nargs="+", default=None, help="eval tasks or groups (default: the plan's)")
    ap.add_argument("--shots", type=int, nargs="+", default=None, help="shot counts k (default: the plan's)")
    ap.add_argument("--seeds", type=int, default=None, help="demonstration seeds (default: the plan's)")
    ap.add_argument("--max-items", type=int, default=None, help="items per task (default: the plan's)")
    args = ap.parse_args(argv)
    exp = common.Experiment("downstream", args)
    p = exp.plan
    runs = dict(zip(("baseline", "looped"), common.pair_runs(exp)))
    res = {}
    for name, run in runs.items():
        common.log(f"evaluate {name}: {run}")
        res[name] = ev.evaluate_run(run, tasks=args.tasks or p.tasks, shots=args.shots or p.shots,
                                    seeds=args.seeds or p.seeds, max_items=args.max_items or p.max_items,
                                    val_tokens_per_source=exp.tc.eval_tokens, log=lambda m: None)
        reproduce.write_json(exp.out / f"eval_{name}.json", res[name])
    b, s = res["baseline"], res["looped"]
    cmp = ev.compare(b, s)
    rows = []
    for task, by_k in cmp["tasks"].items():
        for k, c in sorted(by_k.items(), key=lambda kv: int(kv[0])):
            rows.append({"task": task, "k": int(k), "baseline_acc": b["tasks"][task]["by_k"][k]["acc"],
                         "looped_acc": s["tasks"][task]["by_k"][k]["acc"], "gain": c["gain"], "p": c["p"]})
    domains = [{"domain": d, "baseline": b["val"]["by_domain"][d], "looped": s["val"]["by_domain"].get(d),
                "delta": s["val"]["by_domain"].get(d, float("nan")) - b["val"]["by_domain"][d]}
               for d in sorted(b["val"]["by_domain"])] if b.get("val") and s.get("val") else []
    shape = cmp.get("length_shape", {})
    lengths = [{"bucket": int(k), "baseline": b["val"]["by_length"][k], "looped": s["val"]["by_length"][k],
                "gain": b["val"]["by_length"][k] - s["val"]["by_length"][k], "shape": shape.get(int(k))}
               for k in sorted(b["val"]["by_length"], key=int) if k in s["val"]["by_length"]] if domains else []
    print("\nValidation loss by domain\n" + common.format_table(domains, [
        ("domain", "domain", ""), ("Baseline", "baseline", ".4f"), ("looped", "looped", ".4f"),
        ("looped - Baseline", "delta", "+.4f")]))
    print("\nValidation loss by document length (gain = Baseline - looped; shape = gain / mean gain)\n"
          + common.format_table(lengths, [("<= tokens", "bucket", "d"), ("Baseline", "baseline", ".4f"),
                                          ("looped", "looped", ".4f"), ("gain", "gain", "+.4f"),
                                          ("shape", "shape", ".2f")]))
    figs = [str(exp.out / "shot_sweep.png")]
    ev.plot_shot_sweep(s, figs[0], other=b)
    if lengths:
        figs.append(common.plot_lines(exp.out / "length_shape.png", {"looped vs Baseline": (
            [r["bucket"] for r in lengths], [r["shape"] for r in lengths])}, "document length bucket (tokens)",
            "normalised loss gain", "Length shape of the gain (SMELT 5.3)", xlog=True))
    summary = {name: {"val_loss": r["val"]["loss"] if r.get("val") else None, "summary": r["summary"]}
               for name, r in res.items()}
    return exp.finish({"runs": {k: str(v) for k, v in runs.items()}, "summary": summary, "rows": rows,
                       "by_domain": domains, "by_length": lengths, "long_short": cmp.get("long_short"),
                       "compare": cmp, "figures": figs}, [
        ("task", "task", ""), ("k", "k", "d"), ("Baseline acc", "baseline_acc", ".3f"),
        ("looped acc", "looped_acc", ".3f"), ("gain", "gain", "+.3f"), ("p (permutation)", "p", ".3f")])


if __name__ == "__main__":
    main()
