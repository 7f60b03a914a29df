"""SMELT Section 6: what the second visit computes. probes.probe on a looped run and its Baseline.

  python scripts/probe_runs.py --preset smoke|tiny|small [--runs BASELINE LOOPED | --ladder DIR] [--tokens N]

The pair as in downstream.py (--runs, --ladder's last cell, or the preset's Baseline and matched
SMELT trained here). probes.probe captures every (layer, visit) on held-out tokens of the run's own
data (every source in turn, --tokens in all, default the plan's probe_tokens) and reduces them to
the Section 6 measurements: expert-set overlap between visits against random routing, update /
residual norms and their visit-2 / visit-1 ratios, cross-visit cosines of updates and of X, Q, K,
V, PV, O, attended-token overlap and attention-sink mass; then the Dyck case study on the looped
run. Figures from probes.plot_probes (with the Baseline beside the looped run) and plot_dyck.
Writes probes_baseline.json, probes_looped.json, results.json (summary side by side), figures/.
"""
from __future__ import annotations

import itertools

import common  # noqa: I001  (puts the repo root on sys.path)

import data as data_mod
import probes
import reproduce

PAPER = {   # SMELT Section 6, read off its text (all 16 cells unless noted)
    "ratio_update": "1.2-3.5 (6.2)", "ratio_attn_write": "1.2-3.5 (6.2)", "ratio_mlp_write": "1.2-3.5 (6.2)",
    "ratio_norm": "> 1 (6.2)", "update_cosine_cross_visit": "0.42-0.65, mean 0.56 (1.6B)",
    "update_cosine_other": "mean 0.16 (1.6B)", "cos_X": "0.84-0.93", "cos_Q": "0.89-0.93", "cos_K": "0.89-0.93",
    "cos_V": "0.65-0.74", "cos_PV": "0.56-0.69", "cos_O": "0.49-0.64", "attn_top8": "0.56-0.66",
    "attn_top8_control": "0.28-0.34", "expert_overlap": "2-3 of 8 at S~97 %, far above random (6.1)",
    "sink_mass": "falls on visit 2 (6.4)"}


def held_out(meta: dict, batch_size: int, block_size: int, tokens: int):
    """Validation batches of every source of the run's data, tokens / n_sources from each."""
    d = data_mod.TokenData(meta["data_dir"])
    per = max(block_size, tokens // len(d.sources))
    return itertools.chain.from_iterable(d.val_batches(s, batch_size, block_size, per) for s in d.sources)


def main(argv=None) -> dict:
    ap = common.parser(__doc__)
    common.add_pair_args(ap)
    ap.add_argument("--tokens", type=int, default=None, help="held-out tokens to probe (default: the plan's)")
    ap.add_argument("--batch-size", type=int, default=4,
                    help="probe batch (memory ~ visits x B x heads x T^2 x 4 bytes for attention maps)")
    ap.add_argument("--dyck-seqs", type=int, default=16, help="Dyck strings in the case study")
    args = ap.parse_args(argv)
    exp = common.Experiment("probe_runs", args)
    tokens = args.tokens or exp.plan.probe_tokens
    runs = dict(zip(("baseline", "looped"), common.pair_runs(exp)))
    res, figs = {}, []
    (exp.out / "figures").mkdir(exist_ok=True)
    for name, run in runs.items():
        model, meta = common.load_trained(run)
        common.log(f"probe {name}: {run} ({len(model.plan)} visits, {tokens} tokens)")
        res[name] = probes.probe(model, held_out(meta, args.batch_size, model.cfg.block_size, tokens), tokens)
        res[name]["run"] = str(run)
        if name == "looped":
            res["dyck"] = probes.dyck_case_study(model, n_seqs=args.dyck_seqs)
            figs.append(probes.plot_dyck(res["dyck"], str(exp.out / "figures" / "fig27_dyck.png")))
        reproduce.write_json(exp.out / f"probes_{name}.json", res[name])
    figs += probes.plot_probes(res["looped"], str(exp.out / "figures"), baseline=res["baseline"])
    sb, sl = res["baseline"]["summary"], res["looped"]["summary"]
    rows = [{"quantity": k, "baseline": sb.get(k), "looped": v, "paper": PAPER.get(k, "")}
            for k, v in sl.items() if v is None or isinstance(v, (int, float))]
    hists = [d["expert_overlap"] for d in res["looped"]["cross_visit"].values() if "expert_overlap" in d]
    if hists:
        rows.append({"quantity": "expert_overlap_random (k^2/n)", "looped": hists[0]["random_mean"], "paper": ""})
    return exp.finish({"runs": {k: str(v) for k, v in runs.items()}, "tokens": tokens, "rows": rows,
                       "dyck_summary": {k: v for k, v in res["dyck"].items() if not isinstance(v, (dict, list))},
                       "figures": figs}, [
        ("quantity", "quantity", ""), ("Baseline", "baseline", ".4f"), ("looped", "looped", ".4f"),
        ("paper", "paper", "")])


if __name__ == "__main__":
    main()
