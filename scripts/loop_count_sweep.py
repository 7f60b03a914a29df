"""SMELT Table 3.5: how many passes over the looped span. 1 (the Baseline), 2, 3, 4 visits.

  python scripts/loop_count_sweep.py --preset smoke|tiny|small [--loops 1 2 3 4] [--scale S] [--sparsity LABEL]

Middle half of the Baseline's depth (SMELT's span), physical depth fixed; each loop count is matched
to the Baseline's FLOPs, parameters and KV cache (budget.match), so more visits mean a thinner model
with more experts. Writes results.json, a table and loop_count_sweep.png.
"""
from __future__ import annotations

import common  # noqa: I001  (puts the repo root on sys.path)

import checks
from loop import LoopSpec


def build_parser():
    ap = common.parser(__doc__, scale="(default: the deepest)")
    ap.add_argument("--loops", type=checks.positive_int, nargs="+", default=[1, 2, 3, 4],
                    help="visits of the span (1 = Baseline)")
    ap.add_argument("--sparsity", default=None, help="sparsity label (default: the ~85 %% column)")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("loop_count_sweep", args)
    cell = exp.base(args.scale, args.sparsity)
    scale, label, base = cell
    for r in args.loops:
        loop = LoopSpec(n_loops=r).at(base.n_layer)   # SMELT's middle half, r passes
        exp.add_matched(f"loops{r}", cell, loop if r > 1 else None, {"loops": r})
    rows = exp.train_rows()
    fig = common.plot_lines(exp.out / "loop_count_sweep.png", {label: ([r["loops"] for r in rows],
                                                                       [r["val_loss"] for r in rows])},
                            "visits of the middle half", "validation loss", f"Loop-count sweep ({scale}, matched)")
    best = min(rows, key=lambda r: r["val_loss"])["loops"]
    return exp.finish({"base": base.to_dict(), "rows": rows, "best_loops": best, "figures": [fig]}, [
        ("visits", "loops", "d"), ("effective", "effective_layers", "d"), ("D", "d_model", "d"),
        ("E", "n_experts", "d"), ("F ratio", "flops_ratio", ".3f"), ("N ratio", "params_ratio", ".3f"),
        ("KV ratio", "kv_ratio", ".3f"), ("val loss", "val_loss", ".4f")])


if __name__ == "__main__":
    checks.run_main(main)
