"""How to Loop: which part of a dense transformer to loop, at fixed stored weights and at fixed FLOPs.

  python scripts/howto_schedules.py --preset smoke|tiny|small [--loops 2 4] [--designs ...] [--scale S]

Designs (loop.LoopConfig): full_stack (the whole stack r times, block schedule), per_layer (each
layer r times in a row: the same evaluations in another order), middle_third (loop.middle_third:
floor(B/3) unique blocks each side, the centre r times), attn_only / mlp_only (full stack, only
that sub-layer repeats). Two budgets, as in the paper:
  weights  the base config itself with the loop added: same stored weights, r-fold FLOPs in the loop.
  flops    budget.match of the loop to the base's per-token training FLOPs (parameters and KV left
           free: a dense model has no experts to restore them), i.e. a narrower model.
Dense models (the base is the preset's scale with a dense SwiGLU of the MoE's active width); the
no-loop base is the reference row. Writes results.json, a table and howto_schedules.png.
"""
from __future__ import annotations

from dataclasses import replace

import common  # noqa: I001  (puts the repo root on sys.path)

from loop import LoopConfig, middle_third

LOOPS = {"smoke": [2], "tiny": [2, 4], "small": [2, 4, 8]}
DESIGNS = {
    "full_stack": lambda L, r: LoopConfig(start=0, length=L, n_loops=r),
    "per_layer": lambda L, r: LoopConfig(start=0, length=L, n_loops=r, schedule="per_layer"),
    "middle_third": lambda L, r: LoopConfig(*middle_third(L), n_loops=r),
    "attn_only": lambda L, r: LoopConfig(start=0, length=L, n_loops=r, part="attn"),
    "mlp_only": lambda L, r: LoopConfig(start=0, length=L, n_loops=r, part="mlp"),
}
# match at fixed FLOPs only: loose parameter / KV tolerances, and room to narrow by up to 4x
FLOPS_ONLY = dict(tolerances={"params": 1e9, "kv": 1e9}, d_range=(0.25, 1.0))


def main(argv=None) -> dict:
    ap = common.parser(__doc__)
    ap.add_argument("--loops", type=int, nargs="+", default=None, help="loop counts (default: smoke 2, tiny 2 4, "
                    "small 2 4 8)")
    ap.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=list(DESIGNS), help="designs to run")
    ap.add_argument("--budgets", nargs="+", default=["weights", "flops"], choices=["weights", "flops"],
                    help="fixed stored weights and/or fixed training FLOPs")
    ap.add_argument("--scale", default=None, help="preset scale of the dense base (default: the first)")
    args = ap.parse_args(argv)
    exp = common.Experiment("howto_schedules", args)
    base = exp.dense_base(args.scale)
    L = base.n_layer
    specs, info = [("no_loop", base, {"arch": "no_loop"})], [{"budget": "-", "design": "no_loop", "loops": 1,
                                                              **exp.budgets(base, base)}]
    for r in args.loops or LOOPS[args.preset]:
        for design in args.designs:
            lc = DESIGNS[design](L, r)
            for b in args.budgets:
                cfg = replace(base, loop=lc) if b == "weights" else exp.match(base, lc, **FLOPS_ONLY)[0]
                specs.append((f"{design}_x{r}_{b}", cfg, {"arch": design}))
                info.append({"budget": b, "design": design, "loops": r,
                             "span": f"{lc.start + 1}-{lc.start + lc.length}", **exp.budgets(cfg, base)})
    rows = [{**i, **r} for i, r in zip(info, exp.train_all(specs))]
    figs = []
    for b in args.budgets:
        series = {d: ([1] + [r["loops"] for r in rows if r["design"] == d and r["budget"] == b],
                      [rows[0]["val_loss"]] + [r["val_loss"] for r in rows if r["design"] == d and r["budget"] == b])
                  for d in args.designs}
        figs.append(common.plot_lines(exp.out / f"howto_schedules_{b}.png", series, "loops", "validation loss",
                                      f"Loop designs at fixed {'stored weights' if b == 'weights' else 'FLOPs'}",
                                      xlog=True))
    return exp.finish({"base": base.to_dict(), "rows": rows, "figures": figs}, [
        ("budget", "budget", ""), ("design", "design", ""), ("loops", "loops", "d"), ("span", "span", ""),
        ("effective", "effective_layers", "d"), ("D", "d_model", "d"), ("params", "blocks", ",d"),
        ("F ratio", "flops_ratio", ".3f"), ("N ratio", "params_ratio", ".3f"), ("KV ratio", "kv_ratio", ".3f"),
        ("val loss", "val_loss", ".4f")])


if __name__ == "__main__":
    main()
