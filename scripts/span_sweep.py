"""SMELT Table 3.3: which layers to loop. Validation loss against the length of the looped span.

  python scripts/span_sweep.py --preset smoke|tiny|small [--scale S] [--sparsity LABEL ...] [--steps N]

Physical depth L fixed (the preset Baseline's), two passes over a contiguous span of 0 (the Baseline),
2, 4, ... up to L layers, placed by --placement (default SMELT's loop.middle_span), each matched to the
Baseline's FLOPs, parameters and KV cache (budget.match). Writes OUT/results.json (one row per sparsity
and span), a table and span_sweep.png. In full: docs/scripts.md.
"""
from __future__ import annotations

import common  # noqa: I001  (puts the repo root on sys.path)

from dataclasses import replace

import checks
import configs
from loop import add_loop_args, loop_spec


def build_parser():
    ap = common.parser(__doc__, scale="(default: the deepest)")
    ap.add_argument("--sparsity", nargs="+", default=None,
                    help="sparsity labels, or 'all' (default: the preset's ~85 %% column)")
    add_loop_args(ap, without=("span_fraction",))   # r, placement, ...: SMELT's unless given
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("span_sweep", args)
    spec = loop_spec(args)
    labels = args.sparsity or [None]
    if labels == ["all"]:
        labels = list(dict.fromkeys(lab for _, lab, _ in exp.cells()))
    for label in labels:
        cell = exp.base(args.scale, label)
        scale, lab, base = cell
        L = base.n_layer
        for m in sorted(set(range(0, L + 1, 2)) | {L}):   # 0, 2, 4, ... up to L (L itself when odd)
            loop = replace(spec, span_fraction=m / L).at(L) if m else None
            exp.add_matched(f"{configs.cell_key(scale, lab)}_span{m}", cell, loop,
                            {"scale": scale, "sparsity_label": lab, "span": m, "span_pct": 100 * m / L,
                             "looped_layers": f"{loop.start + 1}-{loop.start + loop.length}" if m else "-"})
    rows = exp.train_rows()
    by_label: dict[str, list[dict]] = {}
    for r in rows:
        by_label.setdefault(r["sparsity_label"], []).append(r)
    series = {lab: ([r["span_pct"] for r in rs], [r["val_loss"] for r in rs]) for lab, rs in by_label.items()}
    fig = common.plot_lines(exp.out / "span_sweep.png", series, "looped span (% of layers)", "validation loss",
                            f"Loop-span sweep ({spec.n_loops} passes, matched budgets)")
    best = {lab: min(rs, key=lambda r: r["val_loss"])["span"] for lab, rs in by_label.items()}
    return exp.finish({"rows": rows, "best_span": best, "figures": [fig]}, [
        ("S", "sparsity_label", ""), ("looped layers", "looped_layers", ""), ("span %", "span_pct", ".0f"),
        ("effective", "effective_layers", "d"), ("D", "d_model", "d"), ("E", "n_experts", "d"),
        ("F ratio", "flops_ratio", ".3f"), ("N ratio", "params_ratio", ".3f"), ("KV ratio", "kv_ratio", ".3f"),
        ("val loss", "val_loss", ".4f")])


if __name__ == "__main__":
    checks.run_main(main)
