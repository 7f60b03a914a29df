"""SMELT Section 6: what the second visit computes, on every matched pair (probe_pairs.probe_pairs, probe_claims).

  python scripts/probe_runs.py --preset smoke|tiny|small [--runs BASELINE LOOPED | --ladder DIR] [--tokens N]

The pairs: --runs (one), --ladder (every cell of a scaling_ladder / reproduce output), or the preset's
Baseline and matched SMELT trained here; each Section 6 claim with a 95 % bootstrap interval over document
groups and a verdict. Writes probes.json, results.json (one row per claim), table.md and figures/.
In full: docs/scripts.md.
"""
from __future__ import annotations

from pathlib import Path

import common  # noqa: I001  (puts the repo root on sys.path)

import checks
import configs
import reproduce
from lab import probe_pairs, probe_plots


def build_parser():
    ap = common.parser(__doc__)
    common.add_pair_args(ap)
    ap.add_argument("--tokens", type=checks.positive_int, default=None,
                    help="held-out tokens to probe (default: the plan's)")
    ap.add_argument("--batch-size", type=checks.positive_int, default=8,
                    help="probe batch (memory ~ visits x B x heads x T^2 x 4 bytes for attention maps)")
    ap.add_argument("--dyck-items", type=checks.positive_int, default=8,
                    help="Dyck query items, each at k = 1, 2, 4, 8")
    ap.add_argument("--draws", type=checks.positive_int, default=1000, help="bootstrap draws per interval")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("probe_runs", args)
    tokens = args.tokens or exp.plan.probe_tokens
    if args.ladder and not args.runs:   # every ladder cell's (name, Baseline run, SMELT run)
        dirs = configs.run_dirs(Path(args.ladder), reproduce.read_ladder(args.ladder))
        pairs = [(configs.cell_key(c["scale"], c["sparsity_label"]), str(b), str(s))
                 for (c, _, b), (_, _, s) in zip(dirs[::2], dirs[1::2])]
    else:
        pairs = [("pair", *map(str, common.pair_runs(exp)))]
    res = probe_pairs.probe_pairs(pairs, exp.load_data(), tokens, exp.plan.block_size, args.batch_size,
                             dyck_items=args.dyck_items, seed=args.seed, n_draws=args.draws, log=common.log)
    res["figures"] = probe_plots.plot_pairs(res, str(exp.out / "figures"))
    probe_pairs.save_result(exp.out / "probes.json", res)
    rows = [{"claim": c["id"], "figure": c["figure"], "claim_is": f"{c['direction']} {c['value']:g}",
             **{k: (c["interval"] or {}).get(k) for k in ("mean", "lo", "hi")},
             "verdict": c["verdict"], "paper": c["paper"]} for c in res["claims"]]
    return exp.finish({"pairs": {n: [b, s] for n, b, s in pairs}, "tokens": res["sample"]["tokens"],
                       "sample": res["sample"], "rows": rows, "figures": res["figures"]}, [
        ("claim", "claim", ""), ("fig.", "figure", ""), ("claim is", "claim_is", ""), ("mean", "mean", ".4f"),
        ("lo", "lo", ".4f"), ("hi", "hi", ".4f"), ("verdict", "verdict", ""), ("paper", "paper", "")])


if __name__ == "__main__":
    checks.run_main(main)
