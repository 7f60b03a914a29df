"""How to Loop, Definition 2: Parallel Loop Transformer variants against sequential looping and no loop.

  python scripts/howto_plt.py --preset smoke|tiny|small [--loops 2] [--variants ...] [--kv-window W]

Dense base, full-stack span, r loops, the same stored weights throughout (PLT gates excepted):
  no_loop         the base unlooped
  sequential      ordinary full-stack looping
  unshifted       the paper's unshifted control: loop l >= 2 takes e_n + h^(l-1)_n (sequential decode)
  plt_add         original PLT, raw shift: e_n + h^(l-1)_(n-1)
  plt_add_kv      plt_add with KV sharing: later loops read loop 1's cache + a gated window of W
  plt_norm_half   RMSNorm(e) and RMSNorm(h) mixed 1/2-1/2
  plt_norm_gate   the paper's fix: separate RMSNorms and the low-rank sigmoid gate
After training, the state-to-embedding RMS ratio per loop on held-out data: e = the span's input
on loop 1 (capture[(start, 0)]["x"], here the token embedding), h^(l) = the span's output on loop l
(capture[(last, l)]: "x" + "attn_write" + "mlp_write"), ratio = RMS(h^(l)) / RMS(e) per token,
averaged over tokens (the paper saw 10-600x). Writes results.json, a table, howto_plt.png (loss per variant) and
howto_plt_rms_ratio.png (the ratio per loop).
"""
from __future__ import annotations

from dataclasses import replace

import torch

import common  # noqa: I001  (puts the repo root on sys.path)

import probes
from loop import LoopConfig

LOOPS = {"smoke": [2], "tiny": [2], "small": [2, 4]}
VARIANTS = {   # LoopConfig fields on top of full-stack looping; None: no loop
    "no_loop": None,
    "sequential": {},
    "unshifted": dict(parallel=True, shift=False, inject="add"),
    "plt_add": dict(parallel=True, inject="add"),
    "plt_add_kv": dict(parallel=True, inject="add", kv_window=-1),   # -1: --kv-window
    "plt_norm_half": dict(parallel=True, inject="norm_half"),
    "plt_norm_gate": dict(parallel=True, inject="norm_gate"),
}


@torch.no_grad()
def state_ratio(model, data, block_size: int, batch_size: int, tokens_per_source: int) -> list[float]:
    """Token-averaged RMS(h^(l)) / RMS(e) for l = 1..r (r = 1 for an unlooped model: the stack's output)."""
    lc, model = model.cfg.loop, model.eval()
    start, last = (lc.start, lc.start + lc.length - 1) if lc.active else (0, model.cfg.n_layer - 1)
    r = lc.n_loops if lc.active else 1
    sums, n = torch.zeros(r, dtype=torch.float64), 0
    device = next(model.parameters()).device
    for src in data.sources:
        for idx, _, doc in data.val_batches(src, batch_size, block_size, tokens_per_source):
            cap: dict = {}
            model.run(idx.to(device), doc_ids=doc.to(device), capture=cap)
            e = probes.token_rms(cap[(start, 0)]["x"])
            for l in range(r):
                c = cap[(last, l)]
                sums[l] += (probes.token_rms(c["x"] + c["attn_write"] + c["mlp_write"]) / e).double().sum().cpu()
            n += idx.numel()
    return (sums / n).tolist()


def main(argv=None) -> dict:
    ap = common.parser(__doc__)
    ap.add_argument("--loops", type=int, nargs="+", default=None, help="loop counts (default: 2; small 2 4)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="variants to run")
    ap.add_argument("--kv-window", type=int, default=None, help="KV-sharing window W (default: block_size / 4)")
    ap.add_argument("--ratio-tokens", type=int, default=1024, help="held-out tokens per source for the RMS ratio")
    ap.add_argument("--scale", default=None, help="preset scale of the dense base (default: the first)")
    args = ap.parse_args(argv)
    exp = common.Experiment("howto_plt", args)
    base = exp.dense_base(args.scale)
    window = args.kv_window or max(1, exp.plan.block_size // 4)
    specs, info = [], []
    for r in args.loops or LOOPS[args.preset]:
        for v in args.variants:
            if VARIANTS[v] is None:
                if any(i["variant"] == v for i in info):
                    continue
                cfg = base
            else:
                kw = {k: (window if k == "kv_window" else x) for k, x in VARIANTS[v].items()}
                cfg = replace(base, loop=LoopConfig(start=0, length=base.n_layer, n_loops=r, **kw))
            specs.append((v if VARIANTS[v] is None else f"{v}_x{r}", cfg, {"arch": v}))
            info.append({"variant": v, "loops": 1 if VARIANTS[v] is None else r, **exp.budgets(cfg, base)})
    rows = [{**i, **r} for i, r in zip(info, exp.train_all(specs))]
    data = exp.load_data()
    for row in rows:
        model, _ = common.load_trained(row["run_dir"])
        row["rms_ratio"] = state_ratio(model, data, exp.plan.block_size, exp.plan.batch_size, args.ratio_tokens)
        row["rms_ratio_last"] = row["rms_ratio"][-1]
        row["rms_ratio_str"] = " / ".join(f"{x:.1f}" for x in row["rms_ratio"])
    figs = [common.plot_bars(exp.out / "howto_plt.png", [f"{r['variant']} x{r['loops']}" for r in rows],
                             [r["val_loss"] for r in rows], "validation loss", "PLT variants vs sequential looping"),
            common.plot_lines(exp.out / "howto_plt_rms_ratio.png",
                              {f"{r['variant']} x{r['loops']}": (list(range(1, r["loops"] + 1)), r["rms_ratio"])
                               for r in rows if r["loops"] > 1},
                              "loop l", "RMS(h^(l)) / RMS(e)", "State-to-embedding ratio (held-out)", ylog=True)]
    return exp.finish({"base": base.to_dict(), "kv_window": window, "rows": rows, "figures": figs}, [
        ("variant", "variant", ""), ("loops", "loops", "d"), ("params", "blocks", ",d"),
        ("F ratio", "flops_ratio", ".3f"), ("KV ratio", "kv_ratio", ".3f"), ("val loss", "val_loss", ".4f"),
        ("RMS(h)/RMS(e) per loop", "rms_ratio_str", "")])


if __name__ == "__main__":
    main()
