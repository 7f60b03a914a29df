"""How to Loop, Definition 2: Parallel Loop Transformer variants against sequential looping and no loop.

  python scripts/howto_plt.py --preset smoke|tiny|small [--loops 2] [--variants ...] [--kv-window W]

Each variant of VARIANTS over the full stack (common.howto_loop: no 1/r residual scale); after training
the state-to-embedding ratio RMS(h^(l)_n) / RMS(e_n) per loop on held-out data, against the paper's
10-600x, and multipliers from the no-loop curve (common.howto_report). Writes results.json, a table,
howto_plt.png and howto_plt_rms_ratio.png. The variants and the ratio: docs/scripts.md, "howto_plt.py".
"""
from __future__ import annotations

from dataclasses import replace

import torch

import common  # noqa: I001  (puts the repo root on sys.path)

import checks
import probes
from lab import stats
from model import GPT

LOOPS = {"smoke": [2], "tiny": [2], "small": [2, 4]}
VARIANTS = {   # LoopConfig fields on top of full-stack looping; None: no loop; kv_window -1: --kv-window
    "no_loop": None, "sequential": {}, "unshifted": dict(parallel=True, shift=False, inject="add"),
    "plt_add": dict(parallel=True, inject="add"), "plt_add_kv": dict(parallel=True, inject="add", kv_window=-1),
    "plt_norm_half": dict(parallel=True, inject="norm_half"), "plt_norm_gate": dict(parallel=True, inject="norm_gate")}


def variant_config(base, variant: str, r: int, window: int):
    """The ModelConfig of one variant at r loops (How-to-Loop's loop: no 1/r residual scale); base for no_loop."""
    if VARIANTS[variant] is None:
        return base
    kw = {k: (window if k == "kv_window" else x) for k, x in VARIANTS[variant].items()}
    return replace(base, loop=common.howto_loop(start=0, length=base.n_layer, n_loops=r, **kw))


@torch.no_grad()
def state_ratio(model, data, block_size: int, batch_size: int, tokens_per_source: int) -> list[stats.Interval]:
    """Per loop l = 1..r (r = 1 for an unlooped model: the stack's output): the mean over held-out tokens of
    RMS(h^(l)_n) / RMS(e_n), with its t-interval over tokens."""
    lc, model = model.cfg.loop, model.eval()
    start, last, r = (lc.start, lc.start + lc.length - 1, lc.n_loops) if lc.active else (0, model.cfg.n_layer - 1, 1)
    per_token: list[list[torch.Tensor]] = [[] for _ in range(r)]
    device = next(model.parameters()).device
    for src in data.sources:
        for idx, _, doc in data.val_batches(src, batch_size, block_size, tokens_per_source):
            cap: dict = {}
            model.run(idx.to(device), doc_ids=doc.to(device), capture=cap)
            e = probes.token_rms(cap[(start, 0)]["x"].float())
            for l in range(r):
                c = cap[(last, l)]
                h = (c["x"] + c["attn_write"] + c["mlp_write"]).float()
                per_token[l].append((probes.token_rms(h) / e).flatten().double().cpu())
    return [stats.mean_interval(torch.cat(x).numpy()) for x in per_token]


def build_parser():
    ap = common.parser(__doc__, scale="of the dense base (default: the first)")
    ap.add_argument("--loops", type=checks.positive_int, nargs="+", default=None,
                    help="loop counts (default: 2; small 2 4)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="variants to run (no_loop, the reference of the fitted no-loop curve, always runs)")
    ap.add_argument("--kv-window", type=checks.positive_int, default=None,
                    help="KV-sharing window W (default: block_size / 4)")
    ap.add_argument("--ratio-tokens", type=checks.positive_int, default=1024,
                    help="held-out tokens per source for the RMS ratio")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    exp = common.Experiment("howto_plt", args)
    base = exp.noloop_run(args.scale, variant="no_loop", loops=1)   # always runs: the no-loop curve's reference
    window = args.kv_window or max(1, exp.plan.block_size // 4)
    for r in args.loops or LOOPS[args.preset]:
        for v in [v for v in args.variants if VARIANTS[v] is not None]:
            exp.add(f"{v}_x{r}", variant_config(base, v, r, window), {"arch": v}, {"variant": v, "loops": r}, base)
    rows = exp.train_rows()
    report = common.howto_report(exp, rows, rows[0])
    data = exp.load_data()
    lo, hi = common.PAPER_RMS_RATIO
    for row, ((_, cfg, _, _), _) in zip(rows, exp.queue):   # each row with its queued (spec, row)
        torch.manual_seed(args.seed)          # as train.py initialises: the same model before any step
        init = state_ratio(GPT(cfg), data, exp.plan.block_size, exp.plan.batch_size, args.ratio_tokens)
        row["rms_ratio_init"] = [iv.mean for iv in init]
        model, _ = common.load_trained(row["run_dir"])
        ivs = state_ratio(model, data, exp.plan.block_size, exp.plan.batch_size, args.ratio_tokens)
        verdicts = [common.range_verdict(iv, lo, hi) for iv in ivs]
        row.update(rms_ratio=[iv.mean for iv in ivs], rms_ratio_interval=[iv.to_dict() for iv in ivs],
                   rms_ratio_verdict=verdicts, rms_ratio_last=ivs[-1].mean,
                   rms_ratio_str=" / ".join(f"{iv.mean:.1f} [{iv.lo:.1f}, {iv.hi:.1f}]" for iv in ivs),
                   rms_ratio_verdict_str=" / ".join(verdicts),
                   rms_ratio_init_str=" / ".join(f"{x:.1f}" for x in row["rms_ratio_init"]))
    figs = [common.plot_bars(exp.out / "howto_plt.png", [f"{r['variant']} x{r['loops']}" for r in rows],
                             [r["val_loss"] for r in rows], "validation loss", "PLT variants vs sequential looping"),
            common.plot_lines(exp.out / "howto_plt_rms_ratio.png",
                              {f"{r['variant']} x{r['loops']}": (list(range(1, r["loops"] + 1)), r["rms_ratio"])
                               for r in rows if r["loops"] > 1},
                              "loop l", "RMS(h^(l)) / RMS(e)", "State-to-embedding ratio (held-out; paper: 10-600x)",
                              ylog=True)]
    claim = {"claim": f"state RMS / embedding RMS lies in the paper's {lo:g}-{hi:g}x", "per_row": {
        f"{r['variant']} x{r['loops']}": r["rms_ratio_verdict"] for r in rows}}
    return exp.finish({"base": base.to_dict(), "kv_window": window, **report, "rms_ratio_claim": claim,
                       "rows": rows, "figures": figs}, [
        ("variant", "variant", ""), ("loops", "loops", "d"), ("params", "blocks", ",d"),
        ("F ratio", "flops_h2l_ratio", ".3f"), ("KV ratio", "kv_ratio", ".3f"), ("val loss", "val_loss", ".4f"),
        ("bpb", "bpb", ".4f"), ("tokens x", "tokens_multiplier", ".2f"), ("FLOPs x", "flops_multiplier", ".2f"),
        ("note", "note", ""), ("RMS(h)/RMS(e) per loop [95 % CI over tokens]", "rms_ratio_str", ""),
        (f"in {lo:g}-{hi:g}x?", "rms_ratio_verdict_str", ""), ("at init", "rms_ratio_init_str", "")])


if __name__ == "__main__":
    checks.run_main(main)
