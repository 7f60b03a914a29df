"""How to Loop, Definition 1: per-loop adapters on a full-stack looped dense model.

  python scripts/howto_adapters.py --preset smoke|tiny|small [--loops 2 4 8] [--adapters ...] [--rank R]

Each adapter of loop.ADAPTERS on every projection at rank R, its parameter overhead, and multipliers from
the no-loop curve (common.howto_report). Writes results.json, a table and howto_adapters.png.
In full: docs/scripts.md, "howto_adapters.py".
"""
from __future__ import annotations

from dataclasses import replace

import common  # noqa: I001  (puts the repo root on sys.path)

import budget
import checks
from loop import ADAPTERS

LOOPS = {"smoke": [2, 4], "tiny": [2, 4], "small": [2, 4, 8]}


def build_parser():
    ap = common.parser(__doc__, scale="of the dense base (default: the first)")
    ap.add_argument("--loops", type=checks.positive_int, nargs="+", default=None,
                    help="loop counts (default: smoke and tiny 2 4, small 2 4 8; the paper: 2 4 8)")
    ap.add_argument("--adapters", nargs="+", default=list(ADAPTERS), choices=list(ADAPTERS), help="adapter kinds")
    ap.add_argument("--rank", type=checks.positive_int, default=None,
                    help="adapter rank (default: the paper's 8 at d_model 1280 scaled to this width, at least 1, "
                         "so the overhead stays near the paper's few per cent)")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("howto_adapters", args)
    base = exp.noloop_run(args.scale, loops=1, adapter="-", adapter_params=0, overhead_pct=0.0,
                          overhead_blocks_pct=0.0)
    rank = args.rank or max(1, round(8 * base.d_model / 1280))
    for r, kind, cfg in configs(base, args.loops or LOOPS[args.preset], args.adapters, rank):
        c0 = budget.count_params(replace(cfg, loop=replace(cfg.loop, adapter="none")))
        added = budget.count_params(cfg)["blocks"] - c0["blocks"]
        exp.add(f"x{r}_{kind}", cfg, {"arch": f"adapter_{kind}"}, {
            "loops": r, "adapter": kind, "adapter_params": added,
            "overhead_pct": 100 * added / (c0["blocks"] + c0["head"]),
            "overhead_blocks_pct": 100 * added / c0["blocks"]}, base)
    rows = exp.train_rows()
    report = common.howto_report(exp, rows, rows[0])
    for r in rows:   # the gain an adapter buys over exact sharing at the same loop count
        ref = next((x for x in rows if x["loops"] == r["loops"] and x["adapter"] == "none"), None)
        r["vs_none"] = r["val_loss"] - ref["val_loss"] if ref and r["adapter"] != "-" else None
    series = {k: ([r["loops"] for r in rows if r["adapter"] == k], [r["val_loss"] for r in rows if r["adapter"] == k])
              for k in args.adapters}
    fig = common.plot_lines(exp.out / "howto_adapters.png", series, "loops (full stack)", "validation loss",
                            f"Per-loop adapters, rank {rank}", xlog=True)
    return exp.finish({"base": base.to_dict(), "rank": rank, **report, "rows": rows, "figures": [fig]}, [
        ("loops", "loops", "d"), ("adapter", "adapter", ""), ("added params", "adapter_params", ",d"),
        ("overhead %", "overhead_pct", ".2f"), ("of blocks %", "overhead_blocks_pct", ".2f"),
        ("F ratio", "flops_h2l_ratio", ".3f"), ("val loss", "val_loss", ".4f"), ("bpb", "bpb", ".4f"),
        ("vs none", "vs_none", "+.4f"), ("tokens x", "tokens_multiplier", ".2f"),
        ("FLOPs x", "flops_multiplier", ".2f"), ("note", "note", "")])


def configs(base, loops: list[int], kinds: list[str], rank: int) -> list[tuple[int, str, object]]:
    """(r, adapter kind, config): full-stack looping of base with the adapter on all projections at `rank`."""
    return [(r, kind, replace(base, loop=common.howto_loop(start=0, length=base.n_layer, n_loops=r, adapter=kind,
                                                           adapter_rank=rank)))
            for r in loops for kind in kinds]


if __name__ == "__main__":
    checks.run_main(main)
