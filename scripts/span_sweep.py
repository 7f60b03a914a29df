"""SMELT Table 3.3: which layers to loop. Validation loss against the length of the looped span.

  python scripts/span_sweep.py --preset smoke|tiny|small [--scale S] [--sparsity LABEL ...] [--steps N]

Physical depth L fixed (the preset Baseline's), two passes; the looped segment is contiguous,
of length 0 (the Baseline), 2, 4, ... up to L (full-stack looping), placed by --placement (default
SMELT's rule, loop.middle_span: floor((L - m) / 2) layers before it). Every looped config is matched to the
Baseline on FLOPs, parameters and KV cache with budget.match, and every run trains on the same
batches. Writes OUT/results.json (one row per sparsity and span), a table and span_sweep.png.
"""
from __future__ import annotations

import common  # noqa: I001  (puts the repo root on sys.path)

from dataclasses import replace

import budget
import checks
import configs
from loop import add_loop_args, loop_spec


def spans(n_layer: int) -> list[int]:
    """0, 2, 4, ... up to n_layer (n_layer itself included when odd)."""
    return sorted(set(range(0, n_layer + 1, 2)) | {n_layer})


def build_parser():
    ap = common.parser(__doc__)
    ap.add_argument("--scale", default=None, help="preset scale (default: the deepest)")
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
    specs, info = [], []
    for label in labels:
        scale, lab, base = exp.base(args.scale, label)
        control = budget.dense_control(base)
        L = base.n_layer
        for m in spans(L):
            if m == 0:
                cfg, rep = base, {"within_tolerance": True}
            else:
                cfg, rep = exp.match(base, replace(spec, span_fraction=m / L).at(L))
            specs.append((f"{configs.cell_key(scale, lab)}_span{m}", cfg,
                          {"control": control, "scale": scale, "sparsity_label": lab,
                           "arch": "baseline" if m == 0 else "looped"}))
            info.append({"scale": scale, "sparsity_label": lab, "span": m, "span_pct": 100 * m / L,
                         "looped_layers": f"{cfg.loop.start + 1}-{cfg.loop.start + cfg.loop.length}" if m else "-",
                         **exp.budgets(cfg, base), "within_tolerance": rep["within_tolerance"]})
    rows = [{**i, **r} for i, r in zip(info, exp.train_all(specs))]
    series = {lab: ([r["span_pct"] for r in rows if r["sparsity_label"] == lab],
                    [r["val_loss"] for r in rows if r["sparsity_label"] == lab])
              for lab in dict.fromkeys(r["sparsity_label"] for r in rows)}
    fig = common.plot_lines(exp.out / "span_sweep.png", series, "looped span (% of layers)", "validation loss",
                            f"Loop-span sweep ({spec.n_loops} passes, matched budgets)")
    best = {lab: min((r for r in rows if r["sparsity_label"] == lab), key=lambda r: r["val_loss"])["span"]
            for lab in series}
    return exp.finish({"rows": rows, "best_span": best, "figures": [fig]}, [
        ("S", "sparsity_label", ""), ("looped layers", "looped_layers", ""), ("span %", "span_pct", ".0f"),
        ("effective", "effective_layers", "d"), ("D", "d_model", "d"), ("E", "n_experts", "d"),
        ("F ratio", "flops_ratio", ".3f"), ("N ratio", "params_ratio", ".3f"), ("KV ratio", "kv_ratio", ".3f"),
        ("val loss", "val_loss", ".4f")])


if __name__ == "__main__":
    checks.run_main(main)
