"""SMELT Section 6 on every matched (Baseline, SMELT) pair: one held-out sample, its checks, its file, the CLI.

`probe_pairs` runs probes.probe on both models of every pair over one held-out sample, and the Dyck case study
(dyck_probe.py) on the SMELT model, then states the claims (probe_claims.py); before any model runs,
`check_pairs` refuses (naming both runs and why) a pair that the runs' own configs say is not matched.
`save_result` / `load_result`: probes.json, hashed, its figure paths relative to its folder. CLI:
`python -m lab.probe_pairs --pair NAME BASELINE SMELT [...]`. Choices: docs/probes.md. Read before: probes.py.
Read next: probe_claims.py, probe_plots.py.
"""
from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import budget
import checks
from lab import dyck_probe, probe_claims, probe_plots, stats
from model import ModelConfig
from probes import held_out_sample, probe

RESULT_KEYS = ("sample", "pairs", "claims", "figures")   # what a cached probes.json must hold


def _is_path(run) -> bool:
    return isinstance(run, (str, os.PathLike))


def describe(run) -> str:
    """How an error names one side of a pair: its path, or the model object's architecture."""
    return str(run) if _is_path(run) else f"<{type(run).__name__} object>"


def run_meta(run) -> dict:
    """The config of one run: a GPT's {"model": cfg}, a run directory's config.json, an endpoint file's meta.
    A missing run, or a run directory without config.json or ckpt.pt, is a ValueError naming it."""
    if not _is_path(run):
        return {"model": run.cfg.to_dict()}
    p = Path(run)
    if not p.exists():
        raise ValueError(f"{p} not found: give a run directory (config.json + ckpt.pt) or an endpoint file")
    if p.is_dir():
        for name in ("config.json", "ckpt.pt"):
            if not (p / name).is_file():
                raise ValueError(f"{p} has no {name}: not a finished run directory (train.py writes both)")
        meta = checks.read_json(p / "config.json", ("model",))
        checks.config_from(ModelConfig, meta["model"], p / "config.json")   # field by field, naming the file
        return meta
    from eval import load_model   # one loader for endpoint and checkpoint files
    return load_model(p, "cpu")[1]


def _shared(m: dict) -> dict:
    """The fields both runs of a matched pair record alike (None where a run does not record one)."""
    cell, train = m.get("meta") or {}, m.get("train") or {}
    return {"cell": (cell["scale"], cell.get("sparsity_label")) if "scale" in cell else None,
            "data_dir": os.path.normpath(str(m["data_dir"])) if m.get("data_dir") else None,
            "vocab_size": m["model"].get("vocab_size"), "seed": train.get("seed"),
            "training block_size": train.get("block_size"), "branch_step": m.get("branch_step")}   # endpoints


def pair_problem(base, smelt, base_meta: dict, smelt_meta: dict) -> str | None:
    """Why (base, smelt) is not a matched (Baseline, SMELT) pair, or None when it is."""
    if base is smelt or (_is_path(base) and _is_path(smelt) and os.path.realpath(base) == os.path.realpath(smelt)):
        return "it is one run twice"
    looped = tuple(ModelConfig.from_dict(m["model"]).loop.active for m in (base_meta, smelt_meta))
    roles = {(True, False): "swapped: the Baseline is looped and the SMELT run is not (give the Baseline first)",
             (False, False): "two Baselines: neither run is looped", (True, True): "two SMELT runs: both are looped"}
    if looped in roles:
        return roles[looped]
    a, b = _shared(base_meta), _shared(smelt_meta)
    diff = [f"{k} {a[k]} vs {b[k]}" for k in a if a[k] is not None and b[k] is not None and a[k] != b[k]]
    return f"they differ in {'; '.join(diff)}" if diff else None


def check_pairs(pairs: Sequence) -> list[tuple[dict, dict]]:
    """(Baseline config, SMELT config) of every (name, baseline, smelt); ValueError naming the pair, both
    runs and why, for a malformed or duplicate pair or one that is not matched (`pair_problem`)."""
    if not pairs:
        raise ValueError("probe_pairs: no pairs given")
    metas, names = [], set()
    for p in pairs:
        if not isinstance(p, (tuple, list)) or len(p) != 3 or not isinstance(p[0], str) or not p[0]:
            raise ValueError(f"probe_pairs: each pair is (name, baseline, smelt) with a non-empty name, got {p!r}")
        name, base, smelt = p
        if name in names:
            raise ValueError(f"probe_pairs: pair name {name!r} is given twice (names must be unique)")
        names.add(name)
        bm, sm = run_meta(base), run_meta(smelt)
        why = pair_problem(base, smelt, bm, sm)
        if why:
            raise ValueError(f"pair {name!r}: {describe(base)} (Baseline) and {describe(smelt)} (SMELT) are not a "
                             f"matched pair: {why}")
        metas.append((bm, sm))
    return metas


def check_fit(pairs: Sequence, metas: list[tuple[dict, dict]], data, block_size: int) -> None:
    """ValueError when block_size exceeds a pair's model context or the data's vocabulary is not the pair's."""
    for (name, _, _), m in zip(pairs, metas):
        ctx, vocab = min(x["model"]["block_size"] for x in m), m[0]["model"]["vocab_size"]
        if block_size > ctx:
            raise ValueError(f"block_size {block_size} exceeds pair {name!r}'s model context ({ctx} tokens)")
        if getattr(data, "vocab_size", None) not in (None, vocab):
            raise ValueError(f"the data's vocabulary ({data.vocab_size} tokens) is not pair {name!r}'s ({vocab}): "
                             f"probe on the data the pair was trained on")


def save_result(path: str | os.PathLike, res: dict) -> None:
    """probes.json: hashed (checks.write_json), its figure paths relative to its own folder."""
    root, rel = Path(path).parent.resolve(), []
    for f in res.get("figures", []):
        p = Path(f).resolve()
        if not p.is_relative_to(root):
            raise ValueError(f"{path}: figure {f} lies outside {root}: write the figures inside the out dir")
        rel.append(p.relative_to(root).as_posix())
    checks.write_json(path, {**res, "figures": rel})


def load_result(path: str | os.PathLike) -> dict | None:
    """probes.json as `save_result` wrote it, figures resolved against its folder; None (recompute it) when it is
    absent, damaged or unhashed (checks.read_cache names it), or names a figure that is not there."""
    res = checks.read_cache(path, RESULT_KEYS)
    if res is None:
        return None
    root, figs = Path(path).parent, res["figures"]
    bad = ([f for f in figs if not isinstance(f, str) or Path(f).is_absolute() or not (root / f).is_file()]
           if isinstance(figs, list) else [figs])
    if bad:
        print(f"{path}: figure {bad[0]!r} is missing or not a path inside {root}; recomputing it", flush=True)
        return None
    return {**res, "figures": [str(root / f) for f in figs]}


def probe_pairs(pairs: Sequence[tuple], data, tokens: int, block_size: int, batch_size: int = 8,
                dyck: bool = True, dyck_items: int = 8, dyck_ks: Sequence[int] = dyck_probe.DYCK_KS,
                dyck_block_size: int | None = None, seed: int = 0,
                attn_topk: Sequence[int] = (1, 8), device: str | None = None, n_draws: int = 1000,
                log: Callable[[str], None] | None = print) -> dict:
    """SMELT Section 6 on every matched pair (name, baseline, smelt), each a GPT or a run directory / endpoint
    file (loaded one at a time), over one held-out sample; the SMELT model also runs the Dyck case study at
    dyck_block_size (default block_size; a k whose prompts do not fit is in "skipped_k", never truncated).
    JSON-able: "sample", "pairs" {name: {"baseline", "smelt", "dyck", "seconds"}}, "aggregate", "claims",
    "pair_intervals", "seconds"; figures: `probe_plots.plot_pairs`."""
    checks.need_ints("probe_pairs", tokens=tokens, block_size=block_size, batch_size=batch_size,
                     dyck_items=dyck_items, dyck_ks=list(dyck_ks), n_draws=n_draws, attn_topk=list(attn_topk))
    metas = check_pairs(pairs)
    check_fit(pairs, metas, data, block_size)   # before any model runs
    device = checks.resolve_device(device)
    rows = min(batch_size, max(1, tokens // block_size))   # the sample's contexts bound a batch's rows
    for (_, *runs), ms in zip(pairs, metas):   # each model still to load, with its batch, before any model runs
        for m in (m for run, m in zip(runs, ms) if _is_path(run)):
            budget.refuse_oversized(ModelConfig.from_dict(m["model"]), device, rows, block_size, "probing",
                                    train=False)
    from eval import load_model   # one loader for run directories and endpoint files
    log, t0 = log or (lambda m: None), time.time()
    sample = held_out_sample(data, tokens, block_size)
    desc = sample.describe()
    log(f"probes: {len(pairs)} pairs on {desc['tokens']} held-out tokens ({desc['contexts']} contexts, "
        f"{desc['units']} document groups, domains {', '.join(desc['domains'])})")
    enc = data.tokenizer() if dyck else None
    out: dict = {"sample": desc, "pairs": {}, "order": [p[0] for p in pairs]}
    dyck_prompts = functools.cache(lambda blk: dyck_probe.dyck_prompts(enc, blk, dyck_ks, dyck_items, seed=seed))
    for i, (name, base, smelt) in enumerate(pairs):
        t1 = time.time()
        entry: dict = {}
        for arch, m in (("baseline", base), ("smelt", smelt)):
            model = load_model(m, device)[0] if _is_path(m) else m
            entry[arch] = probe(model, sample.batches(batch_size), attn_topk=attn_topk, units=sample.units)
            if arch == "smelt" and dyck:
                blk = min(model.cfg.block_size, dyck_block_size or block_size)   # no unseen distances
                entry["dyck"] = dyck_probe.dyck_case_study(model, enc, prompts=dyck_prompts(blk))
            del model
        entry["seconds"] = round(time.time() - t1, 2)
        out["pairs"][name] = entry
        s, last = entry["smelt"]["summary"], max(d["visit"] for d in entry["smelt"]["per_visit"].values())
        log(f"probes {i + 1}/{len(pairs)} {name}: update ratio {_f(s.get('ratio_update'))}, top-8 overlap "
            f"{_f(s.get('attn_top8'))} (control {_f(s.get('attn_top8_control'))}), sink in span "
            f"{_f(s.get('sink_mass_span_v1'))} -> {_f(s.get(f'sink_mass_span_v{last}'))} ({entry['seconds']:.1f}s, "
            f"eta {(time.time() - t0) / (i + 1) * (len(pairs) - i - 1):.0f}s)")
    out["aggregate"] = probe_claims.aggregate(out)
    cells = probe_claims._cells(out)                                 # shared: every bootstrap draws the same units
    out["claims"] = [probe_claims.claim_json(c) for c in probe_claims.claims(out, n_draws, seed, _cells_of=cells)]
    out["pair_intervals"] = probe_claims.panel_intervals(out, n_draws, seed, cells)
    out["n_draws"] = n_draws
    out["seconds"] = round(time.time() - t0, 2)
    log(f"probes: done in {out['seconds']:.0f}s")
    return out


def _f(x, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def build_parser() -> argparse.ArgumentParser:
    ap = checks.parser("SMELT Section 6 probes on matched (Baseline, SMELT) pairs.")
    ap.add_argument("--pair", nargs=3, action="append", required=True, metavar=("NAME", "BASELINE", "SMELT"),
                    help="a matched pair: a name and two run directories or endpoint files (repeatable)")
    ap.add_argument("--data-dir", default=None, help="prepared data directory (default: the SMELT run's data_dir)")
    ap.add_argument("--tokens", type=checks.positive_int, default=4096,
                    help="held-out tokens, split equally over the domains")
    ap.add_argument("--block-size", type=checks.nonneg_int, default=0,
                    help="context length (0: the first SMELT model's)")
    ap.add_argument("--batch-size", type=checks.positive_int, default=8,
                    help="probe batch (memory ~ visits x B x heads x T^2 x 4 bytes for attention maps)")
    ap.add_argument("--dyck-items", type=checks.positive_int, default=8, help="Dyck query items (each at every k)")
    ap.add_argument("--no-dyck", action="store_true", help="skip the Dyck case study")
    ap.add_argument("--seed", type=checks.nonneg_int, default=0, help="Dyck prompt seed and bootstrap seed")
    ap.add_argument("--draws", type=checks.positive_int, default=1000, help="bootstrap draws per interval")
    checks.add_device(ap)
    checks.add_out_dir(ap, "output directory (default: probes/ beside the first SMELT run)")
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    import data as data_mod
    device = checks.resolve_device(args.device)
    pairs = [tuple(p) for p in args.pair]
    try:                                                             # every bad value refused before any work
        metas = check_pairs(pairs)
        meta = metas[0][1]                                           # the first SMELT run's config
        data_dir = args.data_dir or meta.get("data_dir")
        if not data_dir:
            raise ValueError("--data-dir is needed: the SMELT run's config.json names no data_dir")
        block = args.block_size or (meta.get("train") or {}).get("block_size") or meta["model"]["block_size"]
        check_fit(pairs, metas, None, block)   # the block against the models' context first, then --tokens against it
        if args.tokens < block:
            raise ValueError(f"--tokens {args.tokens} is less than one {block}-token context")
        out = args.out_dir or os.path.join(os.path.dirname(os.path.normpath(args.pair[0][2])) or ".", "probes")
        checks.check_out_dir(out, what="output directory")
        data = data_mod.TokenData(data_dir)
        check_fit(pairs, metas, data, block)
        if not args.no_dyck and (foreign := data_mod.foreign_tokenizer(data_dir)):
            print(f"probes: the Dyck case study is skipped: {data_dir}'s tokens are in {foreign!r}, which its "
                  f"prompts cannot be encoded in")
            args.no_dyck = True
    except (ValueError, OSError, checks.UserError) as e:
        ap.error(str(e))
    res = probe_pairs(pairs, data, args.tokens, block, args.batch_size, dyck=not args.no_dyck,
                      dyck_items=args.dyck_items, seed=args.seed, device=device, n_draws=args.draws)
    res["figures"] = probe_plots.plot_pairs(res, out, n_draws=args.draws)
    save_result(os.path.join(out, "probes.json"), res)
    for c in res["claims"]:
        iv = c["interval"]
        shown = "n/a" if iv is None else stats.Interval(**iv).fmt()
        print(f"{c['id']:18s} {c['direction']} {c['value']:g}: {shown}  {c['verdict']}  (paper: {c['paper']})")
    print(f"wrote {os.path.join(out, 'probes.json')} and {len(res['figures'])} figures", flush=True)
    return res


if __name__ == "__main__":
    checks.run_main(main)
