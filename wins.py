"""The grid: SMELT against its matched Baseline over many endpoints, each comparison with an interval.

What this file implements (SMELT Sections 5.1, 5.3 and Appendix C), from a list of endpoint
evaluations (eval.evaluate_endpoint outputs):
* `matched_pairs`: the Baseline and SMELT endpoints of one cell, training seed and branch step.
* `win_counts`: SMELT 5.1's counts ("Completion 96/96") per metric, per cell, per endpoint.
* `icl_sweep`: Appendix C: per task and k, accuracy averaged within cells, then over the cells
  where both models are above chance; the one-sided paired permutation test over demonstration
  seeds at the largest k (`stats.permutation_test`).
* `length_families`: SMELT 5.3 / Fig. 20a: SMELT vs Baseline, more experts, more parameters: the
  normalised gain by document length (eval.normalised_shape) and the long/short ratio with a
  bootstrap interval over contrasts.
* `downstream_claims`: each claim an interval decided by `stats.verdict` (paired differences,
  calibration residuals and their growth with scale, the length tilt, the shot-sweep claims of
  `icl_claims` at the k that prompts fit: eval's "fit"); `downstream_report` runs all of the above.

Pairs and units: matched pairs are (scale, sparsity label, training seed, branch step); the
permutation test pairs demonstration seeds. Why, and the unit="run" option: docs/wins.md.
Read before: eval.py, calibration.py. Figures: eval_plots.plot_downstream.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Sequence

import numpy as np

import stats
from calibration import calibration_report
from eval import endpoint_id, long_short_ratio, normalised_shape
from tasks import centred_accuracy, chance_of


def _check_grid(records: Sequence[dict]) -> None:
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
    _check_grid(records)
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


def _scale_rank(records: Sequence[dict]) -> dict[str, float]:
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
    scale_rank, sparse_rank = (_scale_rank(recs), _sparsity_rank(recs)) if recs else ({}, {})
    base = {k: v for k, v in runs.items() if k[0] == "baseline"}
    contrasts: dict = {f: [] for f in PAPER_LONG_SHORT}
    for (arch, sc, lab, sd) in base:
        if ("smelt", sc, lab, sd) in runs:
            contrasts["SMELT vs Baseline"].append((("baseline", sc, lab, sd), ("smelt", sc, lab, sd)))
    for fam, group_of, rank in (("more experts", lambda k: (k[1], k[3]), lambda k: sparse_rank[k[2]]),
                                ("more parameters", lambda k: (k[2], k[3]), lambda k: scale_rank[k[1]])):
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
    _check_grid(recs)
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


# the paper's words for the shot-sweep claims (Sec. 5.3) and the calibration growth (Sec. 5.1)
PAPER_ICL_GAP = "\"0.9 pp at k=0 and widens to 1.9 pp once demonstrations are provided (k=1)\" (Sec. 5.3, Fig. 20b)"
PAPER_DYCK = "\"SMELT reaches 29.8% at k=32 vs. the Baseline’s 26.4%\" (Sec. 5.3, Fig. 20c)"
PAPER_SIGNIFICANT = ("\"the 14 of these 16 tasks where SMELT’s max-shot gain is significant (p<0.05, paired "
                     "permutation test)\" (Sec. 5.3, App. C)")
PAPER_RESIDUAL_POSITIVE = "\"The mean residual \\bar{\\delta} is positive on every benchmark at every scale\" (Sec. 5.1, Fig. 16)"
PAPER_RESIDUAL_GROWS = ("\"\\bar{\\delta} increases monotonically with model scale on DCLM Completion and DCLM Core\" "
                        "(Sec. 5.1, Fig. 16)")


def icl_claims(icl: dict, claim) -> None:
    """SMELT 5.3's shot-sweep claims over the real (BIG-bench) tasks, counting only a k at which most prompts
    keep k demonstrations (`_demos_kept`): the gap grows from k = 0 to the smallest such k > 0 (per task over
    the cells above chance at both k; t-interval over tasks), SMELT ahead on dyck_languages at its largest such
    k (t-interval over items, paired), and the share of tasks whose max-shot permutation test gives p < 0.05."""
    real = {n: t for n, t in icl.items() if t["origin"] == "bigbench"}
    grow, no_shared, sig, tested, p_min = [], [], 0, 0, []
    for n, t in real.items():
        ks = [int(k) for k, r in t["by_k"].items() if r["k_counts"] and r["gain"] is not None]
        if 0 in ks and any(k > 0 for k in ks):           # over the cells above chance at both k: the same cells
            rows = [t["by_k"][str(k)] for k in (0, min(k for k in ks if k > 0))]
            if any("gain_by_cell" not in r for r in rows):
                raise ValueError(f"icl_claims: task {n}'s shot sweep has no gain_by_cell (an icl_sweep result from "
                                 f"before 2026-12-03): run wins.icl_sweep on its records again")
            g0, g1 = (r["gain_by_cell"] for r in rows)
            if both := sorted(set(g0) & set(g1)):
                grow.append(float(np.mean([g1[c] - g0[c] for c in both])))
            else:
                no_shared.append(n)
        test = t["test"]
        if test["p"] is not None and t["by_k"][str(test["k"])]["k_counts"]:
            tested += 1
            sig += test["p"] < 0.05
            p_min.append(test["p_min"])
    iv = stats.mean_interval(grow) if grow else None
    claim("icl gap grows", "SMELT - Baseline accuracy gap at the smallest k > 0 minus at k = 0 > 0", PAPER_ICL_GAP,
          ">", 0.0, iv, len(grow), "task", "; ".join(filter(None, [
              None if grow else "no real task above chance in one cell at both k = 0 and a k > 0 that most prompts fit",
              f"left out, no cell above chance at both k: {', '.join(no_shared)}" if no_shared else None])) or None)
    d = real.get("dyck_languages")
    ks = [int(k) for k, r in (d or {}).get("by_k", {}).items() if r["k_counts"] and r["baseline_by_seed"]]
    unit = "paired item"   # each item's accuracy averaged over demonstration seeds and matched pairs
    if ks:   # a benchmark difference: its noise is the items' (the paper's 29.8 vs 26.4 % is over its test items)
        r = d["by_k"][str(max(ks))]
        b, s = r.get("baseline_by_item"), r.get("smelt_by_item")
        claim("dyck gain", f"SMELT - Baseline accuracy on dyck_languages at k = {max(ks)} > 0 (each item averaged "
              f"over demonstration seeds and matched pairs)", PAPER_DYCK, ">", 0.0,
              stats.paired_difference(b, s) if b else None, len(b or []), unit,
              None if b else "the endpoints scored different dyck_languages items: no paired interval")
    else:
        claim("dyck gain", "SMELT - Baseline accuracy on dyck_languages > 0", PAPER_DYCK, ">", 0.0, None, 0,
              unit, "dyck_languages not above chance (or cut) at any k in this run")
    floor = min(p_min, default=1.0)
    why = (f"{sig} of {tested} tasks significant" + (f"; with these seeds p cannot go below {floor:.3g}"
                                                      if floor >= 0.05 else "") if tested else
           "no real task tested at a k most of its prompts hold")
    # a count, not an interval: reproduced when most tested tasks are significant; too few seeds (or no
    # significant majority) leaves it not resolved, since a test that cannot reject is no evidence against
    claim("icl significant", "most tasks' max-shot gain significant (p < 0.05)", PAPER_SIGNIFICANT, ">", 0.5, None,
          tested, "task", why, verdict="reproduced" if tested and 2 * sig > tested else "not resolved")


def _item_draws(recs: list[dict], origin: str, key: str, n_boot: int, seed: int) -> tuple[np.ndarray, int] | str:
    """Each endpoint's summary `key` of `origin` (eval.summarise: "core" or "completion" at each task's headline k)
    recomputed on items resampled with replacement, the same draw of every task's items for every endpoint:
    (draws x endpoints, the fewest items of a task; row 0 the items as scored), or why there is none."""
    src, field = ("bigbench" if origin == "real" else "generated"), ("per_item" if key == "core" else "gold_nll_by_item")
    rng, parts, n_min = np.random.default_rng(seed), [], None
    names = sorted({n for r in recs for n, t in r.get("tasks", {}).items() if t["origin"] == src})
    for name in names:
        ts = [r.get("tasks", {}).get(name) for r in recs]
        by_k = [t["by_k"].get(str(t["headline_k"])) if t else None for t in ts]
        kind = next(t["kind"] for t in ts if t)
        if (key == "completion" and kind != "gen") or all(b is None for b in by_k):
            continue                                          # eval.summarise leaves these out too
        if any(b is None or b.get(field) is None or (key == "completion" and b.get("gold_tokens_by_item") is None)
               or b["items"] != by_k[0]["items"] for b in by_k):
            return f"{name}: the endpoints lack per-item results ({field}) on the same items"
        n = len(by_k[0]["items"])
        idx = np.vstack([np.arange(n), rng.integers(0, n, (n_boot, n))])
        n_min = min(n_min or n, n)
        if key == "core":
            parts.append(centred_accuracy(np.array([b["per_item"] for b in by_k])[:, idx].mean(-1).T, ts[0]["rho"]))
        else:
            parts.append((np.array([b["gold_nll_by_item"] for b in by_k])[:, idx].sum(-1).T,
                          np.array([b["gold_tokens_by_item"] for b in by_k])[:, idx].sum(-1).T))
    if not parts:
        return f"no {origin} task with per-item results"
    out = np.mean(parts, axis=0) if key == "core" else sum(p[0] for p in parts) / np.maximum(sum(p[1] for p in parts), 1)
    return out, n_min


def _item_noise(units: list[list[tuple]], origin: str, key: str, iv: stats.Interval, n_boot: int = 1000,
                seed: int = 0) -> dict:
    """The item sample's noise in a paired difference whose t-interval `iv` is over run pairs (every pair scores
    the same items, so `iv` holds training noise only). Items are resampled (models fixed; each unit's endpoint
    pairs averaged, then the units): "items", the percentile interval; "both", `iv` widened by the draws'
    variance (t quantile over the units, the two noises added), which decides the claim. {"why"} without
    per-item results; "inconsistent" when the items as scored do not give the records' summaries."""
    if n_boot < 2:
        return {"items": None, "both": None, "why": f"n_boot = {n_boot}: no item bootstrap"}
    flat = [p for u in units for p in u]
    recs = [b for b, _ in flat] + [s for _, s in flat]                   # every Baseline, then every SMELT
    got = _item_draws(recs, origin, key, n_boot, seed)
    if isinstance(got, str):
        return {"items": None, "both": None, "why": got}
    draws, n_items = got
    if not np.allclose(draws[0], [r["summary"][origin][key] for r in recs], rtol=1e-9, atol=1e-12):
        return {"items": None, "both": None, "inconsistent": True,
                "why": f"the per-item results do not add up to the endpoints' {origin} {key} (a record edited?)"}
    d = draws[1:, len(flat):] - draws[1:, :len(flat)]                     # SMELT - Baseline per endpoint pair
    ends = np.cumsum([0] + [len(u) for u in units])
    means = np.stack([d[:, a:b].mean(1) for a, b in zip(ends[:-1], ends[1:])], axis=1).mean(1)
    lo, hi = np.percentile(means, [50 * (1 - iv.level), 50 * (1 + iv.level)])
    items = stats.Interval(iv.mean, float(lo), float(hi), n_items, iv.level, "item bootstrap")
    both = None
    if iv.resolved:
        q = stats.t_quantile(0.5 + iv.level / 2, iv.n - 1)
        half = q * math.sqrt(((iv.hi - iv.lo) / (2 * q)) ** 2 + float(means.std(ddof=1)) ** 2)
        both = stats.Interval(iv.mean, iv.mean - half, iv.mean + half, iv.n, iv.level, "t, item noise added")
    return {"items": items, "both": both, "why": None}


def _noise_verdict(noise: dict, direction: str, why: str | None) -> tuple[str | None, str | None]:
    """(why, verdict) of a downstream difference from _item_noise: the interval of both noises decides; a task of
    too few items, or records whose items do not give their summary, decide nothing; without per-item results
    the t-verdict stands (verdict None) and why says what its interval holds."""
    join = lambda *w: "; ".join(filter(None, w))
    items = noise["items"]
    if items is not None and items.few_units:                 # the items' variance is not estimable
        return join(why, f"a task of {items.n} items: too few for the item bootstrap (docs/wins.md)"), "not resolved"
    if items is not None:
        return why, stats.verdict(noise["both"], direction, 0.0)
    if noise.get("inconsistent"):
        return join(why, noise["why"]), "not resolved"
    return join(why, f"no item bootstrap ({noise['why']}): the interval holds training noise only"), None


def downstream_claims(records: Sequence[dict], calibration: dict | None = None, families: dict | None = None,
                      unit: str = "run", icl: dict | None = None, n_boot: int = 1000) -> list[dict]:
    """The main job's downstream claims, each an interval decided by stats.verdict (SMELT 5.1, 5.3).

    For each origin (real BIG-bench tasks, generated tasks): SMELT - Baseline gold-completion loss
    (claim < 0) and centred accuracy (claim > 0), as stats.paired_difference over the matched pairs.
    unit="run" (default) first averages each run pair's endpoints (cell, seed), so the units are
    independent trainings; unit="endpoint" pairs every matched endpoint (cell, seed, branch), whose
    interval counts the endpoints of one run (one trajectory) as if they were independent. Every pair scores
    the same items, so that interval holds training noise only; where the records carry per-item results
    (tasks.evaluate_task), _item_noise adds "items_interval" (n_boot item resamples) and "both_interval"
    (the two noises added), which gives the verdict; without them "why" says so.
    calibration (calibration_report): the mean Eq. 7 residual of every identified metric, with its
    t-interval over SMELT runs (each run's endpoints averaged: they share a trajectory; claim > 0); a
    metric whose fit is not identified is listed with verdict "not resolved" and why. families
    (length_families): SMELT's long/short ratio > 1 (not resolved below stats.MIN_BOOTSTRAP_UNITS contrasts).
    Returns [{"id", "claim", "paper", "direction", "value", "interval" (Interval dict | None),
    "verdict", "n", "unit", "why"}], the differences also "items_interval" and "both_interval" (dict | None).
    """
    if unit not in ("endpoint", "run"):
        raise ValueError(f"unit must be 'endpoint' or 'run', got {unit!r}")
    pairs = matched_pairs(records)
    claims = []

    def claim(cid, text, paper, direction, value, iv, n, unit_, why=None, verdict=None):
        claims.append({"id": cid, "claim": text, "paper": paper, "direction": direction, "value": value,
                       "interval": iv.to_dict() if iv is not None else None,
                       "verdict": verdict or stats.verdict(iv, direction, value), "n": n, "unit": unit_, "why": why})

    for origin, src in (("real", "BIG-bench tasks"), ("generated", "generated tasks")):
        for key, direction, what, paper in (("completion", "<", "gold-completion loss", WIN_METRICS[1][3]),
                                            ("core", ">", "centred accuracy", WIN_METRICS[2][3])):
            paper = paper if origin == "real" else None          # the paper has no generated tasks
            metric = f"{origin} {key}"
            units = defaultdict(list)
            for p in pairs:
                if metric_value(p["baseline"], metric) is not None and metric_value(p["smelt"], metric) is not None:
                    units[(p["cell"], p["seed"]) if unit == "run" else len(units)].append((p["baseline"], p["smelt"]))
            if not units:
                continue
            b = [float(np.mean([metric_value(x, metric) for x, _ in u])) for u in units.values()]
            s = [float(np.mean([metric_value(y, metric) for _, y in u])) for u in units.values()]
            iv = stats.paired_difference(b, s)
            why, verdict = (None if iv.resolved else f"{len(b)} pair(s) without spread: no interval"), None
            noise = _item_noise(list(units.values()), origin, key, iv, n_boot)
            why, verdict = _noise_verdict(noise, direction, why)
            if key == "core" and max(b + s) <= 0:   # centred accuracies below chance rank nothing
                why, verdict = "both models at or below chance (centred accuracy <= 0) in every pair", "not resolved"
            claim(f"{metric} difference", f"SMELT - Baseline {what}, {src} {direction} 0", paper, direction, 0.0, iv,
                  len(b), "matched endpoint pair" if unit == "endpoint" else "matched run pair", why, verdict)
            claims[-1].update({f"{k}_interval": noise[k].to_dict() if noise[k] is not None else None
                               for k in ("items", "both")})
    if calibration is not None and calibration.get("error"):
        claim("calibration residual", "calibration residual (Eq. 7) of SMELT > 0",
              PAPER_RESIDUAL_POSITIVE, ">", 0.0, None, 0, "SMELT endpoint",
              f"calibration not available: {calibration['error']}")
    if calibration is not None:
        for name, c in calibration.get("metrics", {}).items():
            if name.startswith("task/"):
                continue
            text = f"calibration residual (Eq. 7) of SMELT on {name} > 0"
            paper = PAPER_RESIDUAL_POSITIVE
            if not c.get("identified"):
                claim(f"{name} residual", text, paper, ">", 0.0, None, 0, "SMELT endpoint",
                      f"calibration not identified: {c.get('why')}")
                continue
            runs = _run_means(records, c["residuals"], c.get("inside"))
            iv = stats.mean_interval([v for _, v in runs.values()]) if runs else None
            claim(f"{name} residual", text, paper, ">", 0.0, iv, len(runs), "SMELT run",
                  _residual_why(c, iv, "too few SMELT runs for an interval"))
    if calibration is not None:
        _residual_growth(records, calibration, claim)
    if icl is not None:
        icl_claims(icl, claim)
    if families is not None and "SMELT vs Baseline" in families:
        f = families["SMELT vs Baseline"]
        iv = stats.Interval(**f["long_short"]) if f.get("long_short") else None
        why = f.get("why")
        if iv is not None and f.get("n_negative", 0) * 2 > f["n_contrasts"]:
            # SMELT worse on average: the ratio then describes a deficit, not a gain (docs/wins.md): no verdict
            why, iv = (f"SMELT's mean gain is negative in {f['n_negative']} of {f['n_contrasts']} contrasts: the "
                       f"normalised shape describes a loss, not a gain (ratio {stats.Interval(**f['long_short']).fmt(2)})"), None
        if iv is not None and iv.resolved and iv.few_units:   # not resolved (stats.verdict); the interval is kept
            why = (f"{iv.n} contrasts: a percentile bootstrap over fewer than {stats.MIN_BOOTSTRAP_UNITS} units "
                   f"covers the truth less often than it says (docs/wins.md)")
        claim("length tilt", "SMELT's gain tilts to long documents: long/short ratio > 1",
              "1.52: \"SMELT’s gain on the four longest buckets is 1.52× its gain on the four shortest; the two controls "
              "stay flat (0.98 and 0.88)\" (Sec. 5.3, Fig. 20a)", ">", 1.0, iv, f["n_contrasts"],
              "SMELT/Baseline run pair", why)
    return claims


def _run_means(records: Sequence[dict], residuals: Sequence[float], inside: Sequence[bool] | None = None) -> dict:
    """{(scale, sparsity label, seed): (scale, mean residual)}: the SMELT endpoints' Eq. 7 residuals (in the order of
    the SMELT endpoints in `records`, as downstream_report hands them to calibration_report) averaged per run, the
    independent unit: the branches of one run share its stable phase.  `inside` (calibrate's): only endpoints
    within the Baseline loss range count; beyond it the residual measures the sigmoid's extrapolation."""
    smelt = [r for r in records if r["arch"] == "smelt"]
    by = defaultdict(list)
    for r, v, keep in zip(smelt, residuals, inside if inside is not None else [True] * len(residuals)):
        if keep:
            by[(r.get("scale") or r.get("run", "?"), r.get("sparsity_label"), r.get("seed", 0))].append(v)
    return {k: (str(k[0]), float(np.mean(v))) for k, v in by.items()}


def _residual_why(c: dict, iv: stats.Interval | None, too_few: str) -> str | None:
    """A residual claim's why: `too_few` when it has no interval, then how many SMELT endpoints of calibration `c`
    lie outside the Baseline loss range and were left out (None when neither applies)."""
    n = len(c.get("inside") or []) - sum(c.get("inside") or [])
    outside = (f"{n} of {len(c['inside'])} SMELT endpoints lie outside the Baseline loss range and are left out "
               f"(their residual would measure the sigmoid's extrapolation)") if n else None
    return "; ".join(filter(None, [too_few if iv is None or not iv.resolved else None, outside])) or None


def _residual_growth(records: Sequence[dict], calibration: dict, claim) -> None:
    """SMELT 5.1: the mean Eq. 7 residual grows with scale, per identified real metric: the largest scale's
    SMELT runs' mean residuals minus the smallest's (Welch interval over runs; claim > 0)."""
    groups = [str(r.get("scale") or r.get("run", "?")) for r in records if r["arch"] == "smelt"]
    rank = _scale_rank(records)
    for name in ("completion", "core"):
        c = calibration.get("metrics", {}).get(name)
        if c is None:
            continue
        text = f"calibration residual of SMELT on {name}: largest scale minus smallest > 0"
        scales = sorted(set(groups), key=lambda g: rank.get(g, 0))
        if not c.get("identified") or len(scales) < 2:
            claim(f"{name} residual growth", text, PAPER_RESIDUAL_GROWS, ">", 0.0, None, 0, "SMELT endpoint",
                  f"calibration not identified: {c.get('why')}" if not c.get("identified") else "one scale")
            continue
        by = defaultdict(list)
        for g, v in _run_means(records, c["residuals"], c.get("inside")).values():
            by[g].append(v)
        n = len(by[scales[0]]) + len(by[scales[-1]])
        iv = stats.welch_difference(by[scales[0]], by[scales[-1]]) if by[scales[0]] and by[scales[-1]] else None
        claim(f"{name} residual growth", f"{text} ({scales[-1]} vs {scales[0]})", PAPER_RESIDUAL_GROWS, ">", 0.0,
              iv, n, "SMELT run", _residual_why(c, iv, "too few SMELT runs per scale for an interval"))


def downstream_report(records: Sequence[dict], margin: float = 0.0, n_boot: int = 2000, n_perm: int = 10000,
                      unit: str = "run") -> dict:
    """Everything SMELT Section 5 reports from a grid's endpoint evaluations (evaluate_endpoint outputs).

    Returns {"n_endpoints", "n_pairs", "wins" (win_counts), "icl" (icl_sweep), "families"
    (length_families), "calibration" (calibration_report on every Baseline endpoint against every
    SMELT endpoint; {"error"} when the endpoints lack validation), "claims" (downstream_claims)}.
    """
    recs = list(records)
    _check_grid(recs)
    base = [r for r in recs if r["arch"] == "baseline"]
    smelt = [r for r in recs if r["arch"] == "smelt"]
    try:
        cal = calibration_report(base, smelt)
    except ValueError as e:
        cal = {"error": str(e), "metrics": {}}
    fams = length_families(recs, n_boot)
    icl = icl_sweep(recs, margin, n_perm)
    return {"n_endpoints": len(recs), "n_pairs": len(matched_pairs(recs)), "wins": win_counts(recs),
            "icl": icl, "families": fams, "calibration": cal,
            "claims": downstream_claims(recs, cal, fams, unit, icl, n_boot)}
