"""The grid: SMELT against its matched Baseline over many endpoints, each comparison with an interval.

What this file implements (SMELT Sections 5.1, 5.3 and Appendix C), from a list of endpoint
evaluations (evaluate.evaluate_endpoint outputs):
* `matched_pairs`: the Baseline and SMELT endpoints of one cell, training seed and branch step.
* `win_counts`: SMELT 5.1's counts ("Completion 96/96") per metric, per cell, per endpoint.
* `icl_sweep`: Appendix C: per task and k, accuracy averaged within cells, then over the cells
  where both models are above chance; the one-sided paired permutation test over demonstration
  seeds at the largest k (`stats.permutation_test`).
* `length_families`: SMELT 5.3 / Fig. 20a: SMELT vs Baseline, more experts, more parameters: the
  normalised gain by document length (validation.normalised_shape) and the long/short ratio with a
  bootstrap interval over contrasts.

Pairs and units: matched pairs are (scale, sparsity label, training seed, branch step); the
permutation test pairs demonstration seeds. Why, and the unit="run" option: docs/wins.md.
Read before: eval.py (the records), tasks.py. Read next: downstream_claims.py (the claims and their verdicts, and
`downstream_report`, which runs all of the above). Figures: eval_plots.plot_downstream.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Sequence

import numpy as np

from lab import stats
from checks import endpoint_id
from lab.tasks import chance_of
from eval import long_short_ratio, normalised_shape


def check_grid(records: Sequence[dict]) -> None:
    """Refuse, naming the endpoint, a record without the arch / scale / sparsity_label the grid is keyed by."""
    for r in records:
        missing = [k for k in ("arch", "scale", "sparsity_label") if r.get(k) is None]
        if missing:
            raise ValueError(f"endpoint {endpoint_id(r)} has no {', '.join(missing)}: the grid analysis needs each "
                             f"run's arch, scale and sparsity_label (train.py's meta / config.json 'meta')")


def matched_pairs(records: Sequence[dict]) -> list[dict]:
    """Baseline and SMELT endpoints of the same cell, training seed and branch step (SMELT's matched pairs).

    Returns [{"cell", "scale", "sparsity_label", "seed", "branch_step", "baseline", "smelt"}], sorted.
    Records of other archs are ignored; two endpoints with the same key are an error.
    """
    check_grid(records)
    by_key: dict = {}
    for r in records:
        if r["arch"] not in ("baseline", "smelt"):
            continue
        key = (r["scale"], r["sparsity_label"], r.get("seed"), r.get("branch_step"), r["arch"])
        if key in by_key:
            raise ValueError(f"two endpoints for {key}: {endpoint_id(by_key[key])} and {endpoint_id(r)}")
        by_key[key] = r
    pairs = []
    for (sc, lab, seed, b, arch), r in by_key.items():
        if arch == "baseline" and (sc, lab, seed, b, "smelt") in by_key:
            pairs.append({"cell": f"{sc} {lab}", "scale": sc, "sparsity_label": lab, "seed": seed, "branch_step": b,
                          "baseline": r, "smelt": by_key[(sc, lab, seed, b, "smelt")]})
    return sorted(pairs, key=lambda p: (p["cell"], str(p["seed"]), p["branch_step"] or 0))


def metric_value(rec: dict, metric: str) -> float | None:
    """'val_loss', or '<origin> core' / '<origin> completion' (origin: real | generated) of one endpoint."""
    if metric == "val_loss":
        return rec["val"]["loss"] if rec.get("val") else None
    origin, key = metric.split(" ")
    v = rec.get("summary", {}).get(origin, {}).get(key)
    return None if v is None or not np.isfinite(v) else float(v)


# (metric, what, lower is better, the paper's count)
WIN_METRICS = (("val_loss", "validation loss", True,
                "\"At comparable measured compute, SMELT reaches lower loss in every cell\" (Sec. 4.1, Fig. 8)"),
               ("real completion", "gold-completion loss, BIG-bench tasks (DCLM Completion)", True,
                "96 / 96: \"SMELT wins on DCLM Completion in 96 of 96 matched pairs\" (Sec. 5.1)"),
               ("real core", "centred accuracy, BIG-bench tasks (DCLM Core)", False,
                "83 / 96: \"on DCLM Core in 83 of 96\" (Sec. 5.1)"),
               ("generated completion", "gold-completion loss, generated tasks", True, None),
               ("generated core", "centred accuracy, generated tasks", False, None))


def win_counts(records: Sequence[dict]) -> dict:
    """SMELT 5.1's win counts: of the matched endpoint pairs, how many SMELT is better on, per metric.

    Returns {"n_pairs", "metrics": {metric: {"what", "lower_is_better", "paper", "wins", "ties", "n",
    "by_cell": {cell: {"wins", "ties", "n"}}, "by_endpoint": [{"cell", "seed", "branch_step",
    "baseline", "smelt", "delta" (SMELT - Baseline), "win"}]}}}. Ties are not wins.
    """
    pairs = matched_pairs(records)
    out: dict = {"n_pairs": len(pairs), "metrics": {}}
    for metric, what, lower, paper in WIN_METRICS:
        rows, cells = [], defaultdict(lambda: {"wins": 0, "ties": 0, "n": 0})
        for p in pairs:
            b, s = metric_value(p["baseline"], metric), metric_value(p["smelt"], metric)
            if b is None or s is None:
                continue
            win, tie = (s < b if lower else s > b), s == b
            rows.append({"cell": p["cell"], "seed": p["seed"], "branch_step": p["branch_step"], "baseline": b,
                         "smelt": s, "delta": s - b, "win": win})
            c = cells[p["cell"]]
            c["wins"], c["ties"], c["n"] = c["wins"] + win, c["ties"] + tie, c["n"] + 1
        if rows:
            out["metrics"][metric] = {"what": what, "lower_is_better": lower, "paper": paper,
                                      "wins": sum(r["win"] for r in rows), "ties": sum(r["delta"] == 0 for r in rows),
                                      "n": len(rows), "by_cell": dict(cells), "by_endpoint": rows}
    return out


def _by_item(pairs: list[dict], name: str, k: int, among: list) -> tuple | None:
    """(baseline, SMELT) per-item accuracy of task `name` at k (mean over seeds, each cell's pairs, then the cells
    `among`), or None when the endpoints did not score the same items."""
    rs = [p[a]["tasks"][name]["by_k"][str(k)] for p in pairs if p["cell"] in among for a in ("baseline", "smelt")]
    if any(r.get("items") != rs[0].get("items") or r.get("per_item") is None for r in rs):
        return None
    return tuple(np.mean([np.mean([p[a]["tasks"][name]["by_k"][str(k)]["per_item"] for p in pairs if p["cell"] == c],
                                  axis=0) for c in among], axis=0).tolist() for a in ("baseline", "smelt"))


def icl_sweep(records: Sequence[dict], margin: float = 0.0, n_perm: int = 10000) -> dict:
    """SMELT Appendix C: per task and k, accuracy averaged within each (scale, sparsity) cell, then over
    the cells where both architectures are above chance; the one-sided permutation test at the max k.

    Within a cell the matched endpoint pairs (all branches and seeds of the cell) are averaged, per
    demonstration seed. A cell counts at (task, k) when both architectures' cell means exceed the
    task's chance (chance_of) by more than `margin`. The test (stats.permutation_test,
    alternative="greater": SMELT > Baseline) pairs the per-seed accuracies at the task's largest k
    shared by every endpoint, pooled over the cells above chance, and per cell. With n seeds an exact
    test cannot give p below 2^-n ("p_min"): 2 seeds never reach p < 0.05.
    Returns {task: {"origin", "kind", "chance", "ks", "by_k": {k: {"baseline", "smelt", "gain",
    "cells_above", "cells", "gain_by_cell" (cells above chance), "baseline_by_seed", "smelt_by_seed",
    "baseline_by_item", "smelt_by_item" (over the cells above chance; None if the endpoints' items differ), "baseline_all_cells",
    "smelt_all_cells" (the mean over every cell, at chance or not: for tables, never averaged into
    the curve)}}, "max_k", "test": {"k", "p", "p_min", "seeds", "gain", "cells_above", "why"},
    "by_cell": {cell: {"above", "baseline", "smelt", "gain", "p"}}, "note"}}; means are None where no
    cell is above chance, and "note" says so.
    """
    pairs = matched_pairs(records)
    if not pairs:
        return {}
    names = [n for n in pairs[0]["baseline"]["tasks"]
             if all(n in p[a]["tasks"] for p in pairs for a in ("baseline", "smelt"))]
    out = {}
    for name in names:
        t0 = pairs[0]["baseline"]["tasks"][name]
        chance = chance_of(t0)
        ks = sorted(set.intersection(*(set(int(k) for k in p[a]["tasks"][name]["by_k"])
                                       for p in pairs for a in ("baseline", "smelt"))))
        cells = sorted({p["cell"] for p in pairs})

        def cell_seeds(k: int) -> dict:
            """{cell: (baseline per-seed accuracy, SMELT per-seed accuracy)}, averaged over the cell's pairs."""
            got = {}
            for c in cells:
                ps = [p for p in pairs if p["cell"] == c]
                arr = {a: [p[a]["tasks"][name]["by_k"][str(k)]["acc_by_seed"] for p in ps]
                       for a in ("baseline", "smelt")}
                n = min(len(x) for v in arr.values() for x in v)
                got[c] = tuple(np.mean([x[:n] for x in arr[a]], axis=0) for a in ("baseline", "smelt"))
            return got

        entry = {"origin": t0["origin"], "kind": t0["kind"], "chance": chance, "ks": ks, "by_k": {}}
        for k in ks:
            cs = cell_seeds(k)
            above = [c for c, (b, s) in cs.items() if b.mean() > chance + margin and s.mean() > chance + margin]
            row = {"cells_above": len(above), "cells": len(cells), "baseline": None, "smelt": None, "gain": None,
                   "gain_by_cell": {c: float(cs[c][1].mean() - cs[c][0].mean()) for c in above},
                   **_demos_kept(pairs, name, k),
                   "baseline_by_seed": None, "smelt_by_seed": None, "baseline_by_item": None, "smelt_by_item": None,
                   "baseline_all_cells": float(np.mean([b.mean() for b, _ in cs.values()])),
                   "smelt_all_cells": float(np.mean([s.mean() for _, s in cs.values()]))}
            if above:
                n = min(len(cs[c][0]) for c in above)
                b = np.mean([cs[c][0][:n] for c in above], axis=0)
                s = np.mean([cs[c][1][:n] for c in above], axis=0)
                row.update(baseline=float(b.mean()), smelt=float(s.mean()), gain=float(s.mean() - b.mean()),
                           baseline_by_seed=b.tolist(), smelt_by_seed=s.tolist())
                row["baseline_by_item"], row["smelt_by_item"] = _by_item(pairs, name, k, above) or (None, None)
            entry["by_k"][str(k)] = row
        K = max(ks) if ks else None
        entry["max_k"] = K
        test = {"k": K, "p": None, "p_min": None, "seeds": 0, "gain": None, "cells_above": 0, "why": None}
        entry["by_cell"] = {}
        if K is not None:
            top = entry["by_k"][str(K)]
            cs = cell_seeds(K)
            for c, (b, s) in cs.items():
                ok = b.mean() > chance + margin and s.mean() > chance + margin
                entry["by_cell"][c] = {"above": bool(ok), "baseline": float(b.mean()), "smelt": float(s.mean()),
                                       "gain": float(s.mean() - b.mean()),
                                       "p": stats.permutation_test(s, b, n_perm, alternative="greater")
                                       if len(b) > 1 else None}
            test.update(cells_above=top["cells_above"], gain=top["gain"])
            if top["baseline_by_seed"] is None:
                test["why"] = f"no cell has both models above chance ({chance:.3g}) at k={K}"
            elif len(top["baseline_by_seed"]) < 2:
                test["why"] = f"one seed at k={K}: a paired test over seeds needs at least 2"
            else:
                n = len(top["baseline_by_seed"])
                test.update(seeds=n, p_min=2.0 ** -n if n <= 16 else 1 / (n_perm + 1),
                            p=stats.permutation_test(top["smelt_by_seed"], top["baseline_by_seed"], n_perm,
                                                     alternative="greater"))
        entry["test"] = test
        if not any(r["cells_above"] for r in entry["by_k"].values()):
            entry["note"] = (f"{name}: no cell has both models above chance ({chance:.3g}) at any k "
                             f"({', '.join(map(str, ks))}); nothing to average or draw")
        out[name] = entry
    return out


def label_percent(label: str) -> float:
    """The percentage a sparsity label names ('S~85%' -> 85.0), else nan."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*%", str(label))
    return float(m.group(1)) if m else float("nan")


def _natural(s: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(s)))


def scale_rank(records: Sequence[dict]) -> dict[str, float]:
    """Each scale's rank by its Baselines' active parameters (budget.count_params); by name when unknown."""
    import budget
    from model import ModelConfig
    act = defaultdict(list)
    for r in records:
        if r["arch"] == "baseline" and isinstance(r.get("model"), dict):
            act[r["scale"]].append(budget.count_params(ModelConfig.from_dict(r["model"]))["active"])
    scales = {r["scale"] for r in records}
    if all(act.get(s) for s in scales):
        return {s: float(np.median(act[s])) for s in scales}
    return {s: i for i, s in enumerate(sorted(scales, key=_natural))}


def _sparsity_rank(records: Sequence[dict]) -> dict[str, float]:
    """Each sparsity label's rank: the percentage it names ('S=0%' -> 0, 'S~85%' -> 85), else its experts."""
    labels = {r["sparsity_label"] for r in records}
    if all(math.isfinite(label_percent(lab)) for lab in labels):
        return {lab: label_percent(lab) for lab in labels}
    experts = defaultdict(list)
    for r in records:
        experts[r["sparsity_label"]].append((r.get("model") or {}).get("n_experts", 0))
    return {lab: float(np.median(experts[lab])) for lab in labels}


# the long/short ratio of each family in SMELT Fig. 20a
PAPER_LONG_SHORT = {"SMELT vs Baseline": 1.52, "more experts": 0.88, "more parameters": 0.98}


def _runs_and_contrasts(recs: Sequence[dict]) -> tuple[dict, dict]:
    """The runs of the grid ({(arch, scale, sparsity label, seed): endpoints by branch step}) and each
    family's contrasts [(ref run key, new run key)], in PAPER_LONG_SHORT's order."""
    runs: dict = defaultdict(list)
    for r in recs:
        runs[(r["arch"], r["scale"], r["sparsity_label"], r.get("seed"))].append(r)
    for v in runs.values():
        v.sort(key=lambda r: r.get("branch_step") or 0)
    scale_rk, sparse_rk = (scale_rank(recs), _sparsity_rank(recs)) if recs else ({}, {})
    base = {k: v for k, v in runs.items() if k[0] == "baseline"}
    contrasts: dict = {f: [] for f in PAPER_LONG_SHORT}
    for (arch, sc, lab, sd) in base:
        if ("smelt", sc, lab, sd) in runs:
            contrasts["SMELT vs Baseline"].append((("baseline", sc, lab, sd), ("smelt", sc, lab, sd)))
    for fam, group_of, rank in (("more experts", lambda k: (k[1], k[3]), lambda k: sparse_rk[k[2]]),
                                ("more parameters", lambda k: (k[2], k[3]), lambda k: scale_rk[k[1]])):
        groups = defaultdict(list)
        for k in base:
            groups[group_of(k)].append(k)
        for g, ks in sorted(groups.items(), key=lambda kv: str(kv[0])):
            ks = sorted(ks, key=rank)
            contrasts[fam] += list(zip(ks[:-1], ks[1:]))
    return runs, contrasts


def _run_id(k) -> str:
    return f"{k[0]} {k[1]} {k[2]}" + (f" seed {k[3]}" if k[3] is not None else "")


def _kept(r: dict, other: dict, min_tokens: int, dropped: dict) -> dict[int, float]:
    """r's loss by bucket over the buckets with >= min_tokens tokens in both endpoints (the others
    go into `dropped`: {bucket: tokens})."""
    tok = lambda e: {int(b): int(n) for b, n in (e["val"].get("tokens_by_length") or {}).items()}
    ta, tb = tok(r), tok(other)
    out = {}
    for b, v in r["val"]["by_length"].items():
        n = min(ta.get(int(b), min_tokens), tb.get(int(b), min_tokens))
        if n >= min_tokens:
            out[int(b)] = float(v)
        else:
            dropped[int(b)] = n
    return out


def _family(fam: str, cons: list, runs: dict, n_boot: int, seed: int, min_tokens: int) -> dict:
    """One family of length_families: its contrasts' mean shapes, their mean and the bootstrapped ratio."""
    dropped: dict = {}
    shapes, rows, n_pairs, n_bad, n_neg = [], [], 0, 0, 0
    for ref_k, new_k in cons:
        ref, new = runs[ref_k], runs[new_k]
        if len(ref) == len(new):
            eps = list(zip(ref, new))
        else:
            nb = {r.get("branch_step"): r for r in new}
            eps = [(r, nb[r.get("branch_step")]) for r in ref if r.get("branch_step") in nb]
        losses = [(_kept(a, b, min_tokens, dropped), _kept(b, a, min_tokens, dropped)) for a, b in eps]
        sh = [normalised_shape(la, lb) for la, lb in losses]
        good = [x for x in sh if x and all(np.isfinite(v) for v in x.values())]
        n_pairs, n_bad = n_pairs + len(good), n_bad + len(sh) - len(good)
        gain = float(np.mean([np.mean([la[k] - lb[k] for k in set(la) & set(lb)]) for la, lb in losses]))
        if not good:
            continue
        buckets = sorted(set.intersection(*(set(x) for x in good)))
        mean = {b: float(np.mean([x[b] for x in good])) for b in buckets}
        shapes.append(mean)
        n_neg += gain < 0
        rows.append({"ref": _run_id(ref_k), "new": _run_id(new_k), "long_short": long_short_ratio(mean),
                     "mean_gain": gain, "n_pairs": len(good)})
    entry = {"paper": PAPER_LONG_SHORT[fam], "shape": {}, "long_short": None, "n_contrasts": len(shapes),
             "n_endpoint_pairs": n_pairs, "n_degenerate": n_bad, "n_negative": n_neg,
             "buckets_dropped": dict(sorted(dropped.items())), "contrasts": rows, "why": None}
    if not shapes:
        entry["why"] = ("no contrast in the grid" if not cons else
                        "every contrast's mean gain is zero: no shape")
        return entry
    buckets = sorted(set.intersection(*(set(x) for x in shapes)))

    def ratio(ix, shapes=shapes, buckets=buckets) -> float:
        sel = [shapes[int(i)] for i in ix]
        return long_short_ratio({b: float(np.mean([x[b] for x in sel])) for b in buckets})
    entry["shape"] = {b: float(np.mean([x[b] for x in shapes])) for b in buckets}
    if len(buckets) < 2:
        entry["why"] = f"{len(buckets)} document-length bucket in common: no long/short ratio"
    elif not math.isfinite(ratio(range(len(shapes)))):
        entry["why"] = "the shorter buckets' mean gain is zero: no long/short ratio"
    else:
        iv = stats.bootstrap_interval(np.arange(len(shapes)), ratio, n_boot, seed=seed)
        if not (math.isfinite(iv.lo) and math.isfinite(iv.hi)) and len(shapes) > 1:
            iv = stats.Interval(iv.mean, math.nan, math.nan, iv.n, iv.level, iv.method)
            entry["why"] = "a resampled long/short ratio is undefined: no interval"
        entry["long_short"] = iv.to_dict()
        if len(shapes) < 2:
            entry["why"] = "one contrast: no interval"
    return entry


def length_families(records: Sequence[dict], n_boot: int = 2000, seed: int = 0, min_tokens: int = 1000) -> dict:
    """SMELT 5.3 / Fig. 20a: the three families of contrasts in loss by document length.

      SMELT vs Baseline  each SMELT run against its matched Baseline (same cell and seed);
      more experts       consecutive sparsity levels within the Baseline at the same scale
                         (S=0% -> S~85% -> ...: the levels the grid has, ordered by the label's %);
      more parameters    consecutive scales within the Baseline at the same sparsity label
                         (ordered by the Baselines' active parameters).
    A contrast (ref run -> new run, same seed) pairs their endpoints branch by branch (by branch
    order when both runs have as many endpoints, else by equal branch step), normalises each
    endpoint pair's per-bucket gain (ref loss - new loss) by its mean (normalised_shape) and averages
    the pairs' shapes. A family averages its contrasts' shapes; its long/short ratio
    (long_short_ratio of the mean shape) gets a percentile bootstrap interval over contrasts
    (stats.bootstrap_interval: contrasts resampled, the ratio recomputed). Endpoint pairs whose mean
    gain is zero have no shape and are left out (counted). Records need "val" with "by_length".
    Buckets holding fewer than `min_tokens` validation tokens ("tokens_by_length") are left out
    (why: docs/wins.md). A contrast whose mean gain is negative (the "new" model is worse)
    normalises a loss, not a gain; they are counted ("n_negative").
    Returns {family: {"paper", "shape": {bucket: mean}, "long_short": Interval dict | None,
    "n_contrasts", "n_endpoint_pairs", "n_degenerate", "n_negative", "buckets_dropped": {bucket:
    tokens}, "contrasts": [{"ref", "new", "long_short", "mean_gain", "n_pairs"}], "why"}}.
    """
    recs = [r for r in records if r.get("val") and r["val"].get("by_length")]
    check_grid(recs)
    runs, contrasts = _runs_and_contrasts(recs)
    return {fam: _family(fam, cons, runs, n_boot, seed, min_tokens) for fam, cons in contrasts.items()}


def _demos_kept(pairs: list[dict], name: str, k: int) -> dict:
    """The endpoints' mean of eval.py's per-(task, k) FIT_FIELDS (task record "fit": "demos_kept", "share_short"
    = prompts holding fewer than k demonstrations, "share_cut"); None where an endpoint lacks them (an older
    eval.json).  "k_counts": False when most prompts hold fewer than k demonstrations (not a k-shot result)."""
    got = {}
    for f in ("demos_kept", "share_short", "share_cut"):
        v = [p[a]["tasks"][name].get("fit", {}).get(str(k), {}).get(f) for p in pairs for a in ("baseline", "smelt")]
        got[f] = float(np.mean(v)) if v and all(x is not None for x in v) else None
    got["k_counts"] = got["share_short"] is None or got["share_short"] <= 0.5
    return got
