"""How to Loop: which part of a dense transformer to loop, at fixed stored weights and at fixed compute.

  python scripts/howto_schedules.py --preset smoke|tiny|small [--loops 2 4] [--designs ...] [--scale S]

Each design of DESIGNS at each budget of --budgets (flops is OUR EXTENSION, labelled "(ours)" in every
output), no 1/r residual scale (common.howto_loop), multipliers from the no-loop curve (common.howto_report).
Writes results.json, a table and howto_schedules_{weights,compute,flops}.png. In full: docs/scripts.md.
"""
from __future__ import annotations

from dataclasses import replace

import common  # noqa: I001  (puts the repo root on sys.path)

import checks
from loop import middle_third

LOOPS = {"smoke": [2], "tiny": [2, 4], "small": [2, 4, 8]}
DESIGNS = {
    "full_stack": lambda L, r: common.howto_loop(start=0, length=L, n_loops=r),
    "per_layer": lambda L, r: common.howto_loop(start=0, length=L, n_loops=r, schedule="per_layer"),
    "middle_third": lambda L, r: common.howto_loop(**dict(zip(("start", "length"), middle_third(L))), n_loops=r),
    "attn_only": lambda L, r: common.howto_loop(start=0, length=L, n_loops=r, part="attn"),
    "mlp_only": lambda L, r: common.howto_loop(start=0, length=L, n_loops=r, part="mlp"),
}
BUDGETS = ("weights", "compute", "flops")
LABEL = {"weights": "weights", "compute": "compute", "flops": "flops_matched (ours)"}
PROTOCOL = {"weights": "How-to-Loop", "compute": "How-to-Loop", "flops": "extension (ours)"}
# match at fixed FLOPs only: loose parameter / KV tolerances, and room to narrow by up to 4x
FLOPS_ONLY = dict(tolerances={"params": 1e9, "kv": 1e9}, d_range=(0.25, 1.0))


def build_parser():
    ap = common.parser(__doc__, scale="of the dense base (default: the first)")
    ap.add_argument("--loops", type=checks.positive_int, nargs="+",
                    help="loop counts (default: smoke 2, tiny 2 4, small 2 4 8)")
    ap.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=list(DESIGNS), help="designs to run")
    ap.add_argument("--budgets", nargs="+", default=list(BUDGETS), choices=list(BUDGETS),
                    help="weights: same model and tokens; compute: same model on the token share that equalises "
                         "training FLOPs (How-to-Loop); flops: our extension, narrowed by budget.match")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("howto_schedules", args)
    base = exp.noloop_run(args.scale, budget="-", protocol="reference", design="no_loop", loops=1, span="-")
    for r in args.loops or LOOPS[args.preset]:
        for design in args.designs:
            lc = DESIGNS[design](base.n_layer, r)
            for b in args.budgets:
                cfg = exp.match(base, lc, **FLOPS_ONLY)[0] if b == "flops" else replace(base, loop=lc)
                exp.add(f"{design}_x{r}_{b}", cfg, {"arch": design, "budget": b},
                        {"budget": LABEL[b], "protocol": PROTOCOL[b], "design": design, "loops": r,
                         "span": f"{lc.start + 1}-{lc.start + lc.length}"},
                        base, exp.compute_tc(cfg, base) if b == "compute" else None)
    rows = exp.train_rows()
    report = common.howto_report(exp, rows, rows[0])
    figs = []
    for b in args.budgets:
        per = {d: [r for r in rows if r["budget"] == LABEL[b] and r["design"] == d] for d in args.designs}
        if b == "compute":
            series = {f"{d} (x{', x'.join(str(r['loops']) for r in rs)})":
                      ([r["compute"] for r in rs], [r["val_loss"] for r in rs]) for d, rs in per.items()}
            figs.append(common.plot_compute_axis(exp.out / "howto_schedules_compute.png", report["noloop_curve"],
                                                 series, "Loop designs at fixed training compute"))
        else:   # each design's curve starts at the no-loop run (1 loop)
            series = {d: ([1] + [r["loops"] for r in rs], [rows[0]["val_loss"]] + [r["val_loss"] for r in rs])
                      for d, rs in per.items()}
            title = ("Loop designs at fixed stored weights and data" if b == "weights"
                     else "Our extension: loops narrowed to the no-loop FLOPs")
            figs.append(common.plot_lines(exp.out / f"howto_schedules_{b}.png", series, "loops", "validation loss",
                                          title, xlog=True))
    return exp.finish({"base": base.to_dict(), **report, "rows": rows, "figures": figs}, [
        ("budget", "budget", ""), ("protocol", "protocol", ""), ("design", "design", ""), ("loops", "loops", "d"),
        ("span", "span", ""), ("effective", "effective_layers", "d"), ("D", "d_model", "d"),
        ("params", "blocks", ",d"), ("tokens", "tokens", ",d"), ("F ratio", "flops_h2l_ratio", ".3f"),
        ("F ratio (budget.match)", "flops_ratio", ".3f"), ("C ratio", "compute_ratio", ".3f"),
        ("val loss", "val_loss", ".4f"), ("bpb", "bpb", ".4f"), ("tokens x", "tokens_multiplier", ".2f"),
        ("FLOPs x", "flops_multiplier", ".2f"), ("note", "note", "")])


if __name__ == "__main__":
    checks.run_main(main)
