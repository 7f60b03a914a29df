"""The grid: SMELT against its matched Baseline over many endpoints, each claim an interval with a verdict.

SMELT 5.1, 5.3 and App. C from endpoint evaluations (evaluate.evaluate_endpoint): `matched_pairs` and `win_counts`
(Sec. 5.1's "Completion 96/96"); `icl_sweep` (App. C's shot sweep, a permutation test over demonstration seeds at
the largest k); `length_families` (Fig. 20a's gain by document length); `downstream_claims` (SMELT - Baseline per
task origin with the item sample's noise, the Eq. 7 residuals and their growth with scale, the length tilt,
`icl_claims`); `downstream_report` runs them all. Why each unit and rule: docs/wins.md.
Read before: eval.py, tasks.py, calibration.py, stats.py. Read next: report.py, eval_plots.plot_downstream.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from lab import stats
from checks import endpoint_id
from lab.calibration import calibration_report
from lab.tasks import centred_accuracy, chance_of
from eval import long_short_ratio, normalised_shape

ARMS = ("baseline", "smelt")   # the roles of a pair: the reference and the looped arm ("smelt" by default)


def as_pair(records: Sequence[dict], arm: str) -> list[dict]:
    """The Baseline's and `arm`'s records, `arm` in the looped role ("smelt"): how reproduce.py reads any arm."""
    return [r if r["arch"] in ARMS else {**r, "arch": ARMS[1], "arm": arm} for r in records
            if r["arch"] in (ARMS[0], arm)]


def check_grid(records: Sequence[dict]) -> None:
    """Refuse, naming the endpoint, a record without the arch / scale / sparsity_label the grid is keyed by."""
    for r in records:
        if missing := [k for k in ("arch", "scale", "sparsity_label") if r.get(k) is None]:
            raise ValueError(f"endpoint {endpoint_id(r)} has no {', '.join(missing)}: the grid analysis needs each "
                             f"run's arch, scale and sparsity_label (train.py's meta / config.json 'meta')")


def matched_pairs(records: Sequence[dict]) -> list[dict]:
    """SMELT's matched pairs (same cell, seed, branch step), sorted; other archs ignored, a duplicate an error."""
    check_grid(records)
    by_key: dict = defaultdict(dict)
    for r in records:
        if r["arch"] in ARMS:
            key = (r["scale"], r["sparsity_label"], r.get("seed"), r.get("branch_step"))
            arms = by_key[key]
            if r["arch"] in arms:
                raise ValueError(f"two endpoints for {(*key, r['arch'])}: {endpoint_id(arms[r['arch']])} and "
                                 f"{endpoint_id(r)}")
            arms[r["arch"]] = r
    pairs = [{"cell": f"{sc} {lab}", "scale": sc, "sparsity_label": lab, "seed": seed, "branch_step": b,
              "baseline": arms["baseline"], "smelt": arms["smelt"]}
             for (sc, lab, seed, b), arms in by_key.items() if len(arms) == 2]
    return sorted(pairs, key=lambda p: (p["cell"], str(p["seed"]), p["branch_step"] or 0))


def metric_value(rec: dict, metric: str) -> float | None:
    """'val_loss', or '<origin> core' / '<origin> completion' (origin: real | generated) of one endpoint."""
    if metric == "val_loss":
        return rec["val"]["loss"] if rec.get("val") else None
    origin, key = metric.split(" ")
    v = rec.get("summary", {}).get(origin, {}).get(key)
    return None if v is None or not np.isfinite(v) else float(v)


def _metric_pairs(pairs: list[dict], metric: str):
    """(pair, Baseline value, SMELT value) for each pair whose two endpoints have `metric`."""
    for p in pairs:
        b, s = metric_value(p["baseline"], metric), metric_value(p["smelt"], metric)
        if b is not None and s is not None:
            yield p, b, s


# the paper's words, with section, for each claim it makes (docs/wins.md)
PAPER = json.loads(Path(__file__).with_name("downstream_quotes.json").read_text(encoding="utf-8"))
# (metric, what, lower is better, the paper's count)
WIN_METRICS = (("val_loss", "validation loss", True, PAPER["val_loss"]),
               ("real completion", "gold-completion loss, BIG-bench tasks (DCLM Completion)", True,
                PAPER["real completion"]),
               ("real core", "centred accuracy, BIG-bench tasks (DCLM Core)", False, PAPER["real core"]),
               ("generated completion", "gold-completion loss, generated tasks", True, None),
               ("generated core", "centred accuracy, generated tasks", False, None))


def win_counts(records: Sequence[dict]) -> dict:
    """SMELT 5.1's win counts: of the matched endpoint pairs, how many SMELT is better on, per metric (ties are not
    wins); "by_cell" and "by_endpoint" ("delta" = SMELT - Baseline) break each count down."""
    pairs = matched_pairs(records)
    out: dict = {"n_pairs": len(pairs), "metrics": {}}
    for metric, what, lower, paper in WIN_METRICS:
        rows, cells = [], defaultdict(lambda: {"wins": 0, "ties": 0, "n": 0})
        for p, b, s in _metric_pairs(pairs, metric):
            win = s < b if lower else s > b
            rows.append({"cell": p["cell"], "seed": p["seed"], "branch_step": p["branch_step"], "baseline": b,
                         "smelt": s, "delta": s - b, "win": win})
            c = cells[p["cell"]]
            c["wins"], c["ties"], c["n"] = c["wins"] + win, c["ties"] + (s == b), c["n"] + 1
        if rows:
            out["metrics"][metric] = {"what": what, "lower_is_better": lower, "paper": paper,
                                      "wins": sum(r["win"] for r in rows), "ties": sum(r["delta"] == 0 for r in rows),
                                      "n": len(rows), "by_cell": dict(cells), "by_endpoint": rows}
    return out


def _by_item(pairs: list[dict], name: str, k: int, among: list) -> tuple | None:
    """(baseline, SMELT) per-item accuracy of task `name` at k (mean over seeds, each cell's pairs, then the cells
    `among`), or None when the endpoints did not score the same items."""
    rs = [p[a]["tasks"][name]["by_k"][str(k)] for p in pairs if p["cell"] in among for a in ARMS]
    if any(r.get("items") != rs[0].get("items") or r.get("per_item") is None for r in rs):
        return None
    return tuple(np.mean([np.mean([p[a]["tasks"][name]["by_k"][str(k)]["per_item"] for p in pairs if p["cell"] == c],
                                  axis=0) for c in among], axis=0).tolist() for a in ARMS)


def _cell_seeds(pairs: list[dict], cells: list[str], name: str, k: int) -> dict:
    """{cell: (Baseline per-seed accuracy, SMELT per-seed accuracy)}, averaged over the cell's pairs."""
    got = {}
    for c in cells:
        arr = {a: [p[a]["tasks"][name]["by_k"][str(k)]["acc_by_seed"] for p in pairs if p["cell"] == c] for a in ARMS}
        n = min(len(x) for v in arr.values() for x in v)
        got[c] = tuple(np.mean([x[:n] for x in arr[a]], axis=0) for a in ARMS)
    return got


def _demos_kept(pairs: list[dict], name: str, k: int) -> dict:
    """The endpoints' mean of eval.py's per-(task, k) FIT_FIELDS (task record "fit"); None where an endpoint lacks
    them (an older eval.json). "k_counts": False when most prompts hold fewer than k demonstrations."""
    got = {}
    for f in ("demos_kept", "share_short", "share_cut"):
        v = [p[a]["tasks"][name].get("fit", {}).get(str(k), {}).get(f) for p in pairs for a in ARMS]
        got[f] = float(np.mean(v)) if v and all(x is not None for x in v) else None
    got["k_counts"] = got["share_short"] is None or got["share_short"] <= 0.5
    return got


def icl_sweep(records: Sequence[dict], margin: float = 0.0, n_perm: int = 10000) -> dict:
    """SMELT App. C: per task and k, accuracy averaged within each cell (per demonstration seed), then over the
    cells where both models beat chance by more than `margin` ("*_all_cells": every cell). "test": the one-sided
    paired permutation test over seeds at the largest k, pooled over those cells; n seeds cannot give p < 2^-n."""
    pairs = matched_pairs(records)
    if not pairs:
        return {}
    names = [n for n in pairs[0]["baseline"]["tasks"] if all(n in p[a]["tasks"] for p in pairs for a in ARMS)]
    cells = sorted({p["cell"] for p in pairs})
    out = {}
    for name in names:
        t0 = pairs[0]["baseline"]["tasks"][name]
        chance = chance_of(t0)
        above = lambda b, s: b.mean() > chance + margin and s.mean() > chance + margin
        ks = sorted(set.intersection(*(set(int(k) for k in p[a]["tasks"][name]["by_k"]) for p in pairs for a in ARMS)))
        seeds = {k: _cell_seeds(pairs, cells, name, k) for k in ks}
        entry = {"origin": t0["origin"], "kind": t0["kind"], "chance": chance, "ks": ks, "by_k": {}}
        for k, cs in seeds.items():
            up = [c for c, (b, s) in cs.items() if above(b, s)]
            row = {"cells_above": len(up), "cells": len(cells), "baseline": None, "smelt": None, "gain": None,
                   "gain_by_cell": {c: float(cs[c][1].mean() - cs[c][0].mean()) for c in up},
                   **_demos_kept(pairs, name, k),
                   "baseline_by_seed": None, "smelt_by_seed": None, "baseline_by_item": None, "smelt_by_item": None,
                   "baseline_all_cells": float(np.mean([b.mean() for b, _ in cs.values()])),
                   "smelt_all_cells": float(np.mean([s.mean() for _, s in cs.values()]))}
            if up:
                n = min(len(cs[c][0]) for c in up)
                b, s = (np.mean([cs[c][i][:n] for c in up], axis=0) for i in (0, 1))
                row.update(baseline=float(b.mean()), smelt=float(s.mean()), gain=float(s.mean() - b.mean()),
                           baseline_by_seed=b.tolist(), smelt_by_seed=s.tolist())
                row["baseline_by_item"], row["smelt_by_item"] = _by_item(pairs, name, k, up) or (None, None)
            entry["by_k"][str(k)] = row
        K = entry["max_k"] = max(ks) if ks else None
        test = {"k": K, "p": None, "p_min": None, "seeds": 0, "gain": None, "cells_above": 0, "why": None}
        entry["by_cell"] = {}
        if K is not None:
            top = entry["by_k"][str(K)]
            for c, (b, s) in seeds[K].items():
                entry["by_cell"][c] = {"above": bool(above(b, s)), "baseline": float(b.mean()),
                                       "smelt": float(s.mean()), "gain": float(s.mean() - b.mean()),
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
    natural = lambda s: tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(s)))
    return {s: i for i, s in enumerate(sorted(scales, key=natural))}


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


def _kept(r: dict, other: dict, min_tokens: int, dropped: dict) -> dict[int, float]:
    """r's loss by bucket where both endpoints hold >= min_tokens tokens; the other buckets go into `dropped`."""
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


def _mean_shape(shapes: list[dict], buckets: list | None = None) -> dict:
    """The mean of shapes ({bucket: value}) over `buckets` (default: the buckets they all have, sorted)."""
    if buckets is None:
        buckets = sorted(set.intersection(*(set(x) for x in shapes)))
    return {b: float(np.mean([x[b] for x in shapes])) for b in buckets}


def _family(fam: str, cons: list, runs: dict, n_boot: int, seed: int, min_tokens: int) -> dict:
    """One family of length_families: its contrasts' mean shapes, their mean and the bootstrapped ratio."""
    dropped: dict = {}
    run_id = lambda k: f"{k[0]} {k[1]} {k[2]}" + (f" seed {k[3]}" if k[3] is not None else "")
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
        mean = _mean_shape(good)
        shapes.append(mean)
        n_neg += gain < 0
        rows.append({"ref": run_id(ref_k), "new": run_id(new_k), "long_short": long_short_ratio(mean),
                     "mean_gain": gain, "n_pairs": len(good)})
    entry = {"paper": PAPER_LONG_SHORT[fam], "shape": {}, "long_short": None, "n_contrasts": len(shapes),
             "n_endpoint_pairs": n_pairs, "n_degenerate": n_bad, "n_negative": n_neg,
             "buckets_dropped": dict(sorted(dropped.items())), "contrasts": rows, "why": None}
    if not shapes:
        entry["why"] = "every contrast's mean gain is zero: no shape" if cons else "no contrast in the grid"
        return entry
    entry["shape"] = _mean_shape(shapes)
    buckets = list(entry["shape"])
    ratio = lambda ix: long_short_ratio(_mean_shape([shapes[int(i)] for i in ix], buckets))
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
    """SMELT 5.3 / Fig. 20a's families of same-seed contrasts in loss by document length (SMELT vs Baseline, and
    the Baseline's next sparsity / scale), each with its mean shape and bootstrapped long/short ratio; buckets
    under `min_tokens` tokens are left out (docs/wins.md)."""
    recs = [r for r in records if r.get("val") and r["val"].get("by_length")]
    check_grid(recs)
    runs, contrasts = _runs_and_contrasts(recs)
    return {fam: _family(fam, cons, runs, n_boot, seed, min_tokens) for fam, cons in contrasts.items()}


def icl_claims(icl: dict, claim) -> None:
    """SMELT 5.3's shot-sweep claims over the real tasks, at the k's most prompts fit: the gap grows from k = 0
    to the smallest k > 0, SMELT ahead on dyck_languages (paired over items), most max-shot tests at p < 0.05."""
    real = {n: t for n, t in icl.items() if t["origin"] == "bigbench"}
    grow, no_shared, sig, tested, p_min = [], [], 0, 0, []
    for n, t in real.items():
        ks = [int(k) for k, r in t["by_k"].items() if r["k_counts"] and r["gain"] is not None]
        if 0 in ks and any(k > 0 for k in ks):           # over the cells above chance at both k: the same cells
            rows = [t["by_k"][str(k)] for k in (0, min(k for k in ks if k > 0))]
            if any("gain_by_cell" not in r for r in rows):
                raise ValueError(f"icl_claims: task {n}'s shot sweep has no gain_by_cell (an icl_sweep result from "
                                 f"before 2026-12-03): run downstream_claims.icl_sweep on its records again")
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
    why = "; ".join(filter(None, [
        None if grow else "no real task above chance in one cell at both k = 0 and a k > 0 that most prompts fit",
        f"left out, no cell above chance at both k: {', '.join(no_shared)}" if no_shared else None])) or None
    claim("icl gap grows", "SMELT - Baseline accuracy gap at the smallest k > 0 minus at k = 0 > 0",
          PAPER["icl gap grows"], ">", 0.0, stats.mean_interval(grow) if grow else None, len(grow), "task", why)
    # a benchmark difference: its noise is the items' (the paper's 29.8 vs 26.4 % is over its test items)
    by_k = real.get("dyck_languages", {}).get("by_k", {})
    ks = [int(k) for k, r in by_k.items() if r["k_counts"] and r["baseline_by_seed"]]
    r = by_k[str(max(ks))] if ks else {}
    b, s = r.get("baseline_by_item"), r.get("smelt_by_item")
    why = ("the endpoints scored different dyck_languages items: no paired interval" if ks else
           "dyck_languages not above chance (or cut) at any k in this run")
    claim("dyck gain", f"SMELT - Baseline accuracy on dyck_languages at k = {max(ks)} > 0 (each item averaged over "
          f"demonstration seeds and matched pairs)" if ks else "SMELT - Baseline accuracy on dyck_languages > 0",
          PAPER["dyck gain"], ">", 0.0, stats.paired_difference(b, s) if b else None, len(b or []), "paired item",
          None if b else why)
    floor = min(p_min, default=1.0)
    why = (f"{sig} of {tested} tasks significant" + (f"; with these seeds p cannot go below {floor:.3g}"
                                                      if floor >= 0.05 else "") if tested else
           "no real task tested at a k most of its prompts hold")
    # a count, not an interval: a test that cannot reject (too few seeds) is no evidence against
    claim("icl significant", "most tasks' max-shot gain significant (p < 0.05)", PAPER["icl significant"], ">", 0.5,
          None, tested, "task", why, verdict="reproduced" if tested and 2 * sig > tested else "not resolved")


def _item_draws(recs: list[dict], origin: str, key: str, n_boot: int, seed: int) -> tuple[np.ndarray, int] | str:
    """Each endpoint's summary `key` of `origin` (eval.summarise: "core" or "completion" at each task's headline k)
    recomputed on items resampled with replacement, the same draw of every task's items for every endpoint:
    (draws x endpoints, the fewest items of a task; row 0 the items as scored), or why there is none."""
    src = "bigbench" if origin == "real" else "generated"
    field = "per_item" if key == "core" else "gold_nll_by_item"
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
    if key == "core":
        return np.mean(parts, axis=0), n_min
    return sum(p[0] for p in parts) / np.maximum(sum(p[1] for p in parts), 1), n_min


def _item_noise(units: list[list[tuple]], origin: str, key: str, iv: stats.Interval, n_boot: int = 1000,
                seed: int = 0) -> dict:
    """The item sample's noise in a paired difference whose t-interval `iv` over run pairs holds training noise
    only: "items", the percentile interval over item resamples; "both", `iv` widened by their variance, which
    decides the claim; "why" / "inconsistent" when there is none (docs/wins.md)."""
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
    """(why, verdict) from _item_noise: the interval of both noises decides; too few items or inconsistent
    records decide nothing; without per-item results the t-verdict stands (verdict None)."""
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
    """SMELT 5.1 and 5.3's downstream claims: per origin, SMELT - Baseline gold-completion loss and centred accuracy
    over run (or endpoint) pairs with _item_noise's intervals; Eq. 7 residuals and their growth; the length tilt;
    icl_claims."""
    if unit not in ("endpoint", "run"):
        raise ValueError(f"unit must be 'endpoint' or 'run', got {unit!r}")
    pairs = matched_pairs(records)
    claims = []

    def claim(cid, text, paper, direction, value, iv, n, unit_, why=None, verdict=None):
        claims.append({"id": cid, "claim": text, "paper": paper, "direction": direction, "value": value,
                       "interval": iv.to_dict() if iv is not None else None,
                       "verdict": verdict or stats.verdict(iv, direction, value), "n": n, "unit": unit_, "why": why})

    for origin, src in (("real", "BIG-bench tasks"), ("generated", "generated tasks")):
        for key, direction, what in (("completion", "<", "gold-completion loss"), ("core", ">", "centred accuracy")):
            metric = f"{origin} {key}"
            paper = PAPER.get(metric)          # None for the generated tasks: the paper has none
            units, vals = defaultdict(list), defaultdict(list)
            for p, b, s in _metric_pairs(pairs, metric):
                u = (p["cell"], p["seed"]) if unit == "run" else len(units)
                units[u].append((p["baseline"], p["smelt"]))
                vals[u].append((b, s))
            if not units:
                continue
            b, s = ([float(np.mean([x[i] for x in v])) for v in vals.values()] for i in (0, 1))
            iv = stats.paired_difference(b, s)
            noise = _item_noise(list(units.values()), origin, key, iv, n_boot)
            why, verdict = _noise_verdict(noise, direction,
                                          None if iv.resolved else f"{len(b)} pair(s) without spread: no interval")
            if key == "core" and max(b + s) <= 0:   # centred accuracies below chance rank nothing
                why, verdict = "both models at or below chance (centred accuracy <= 0) in every pair", "not resolved"
            claim(f"{metric} difference", f"SMELT - Baseline {what}, {src} {direction} 0", paper, direction, 0.0, iv,
                  len(b), "matched endpoint pair" if unit == "endpoint" else "matched run pair", why, verdict)
            claims[-1].update({f"{k}_interval": noise[k].to_dict() if noise[k] is not None else None
                               for k in ("items", "both")})
    if calibration is not None:
        if calibration.get("error"):
            claim("calibration residual", "calibration residual (Eq. 7) of SMELT > 0", PAPER["residual"], ">", 0.0,
                  None, 0, "SMELT endpoint", f"calibration not available: {calibration['error']}")
        for name, c in calibration.get("metrics", {}).items():
            if name.startswith("task/"):
                continue
            if c.get("identified"):
                runs = [v for _, v in _run_means(records, c["residuals"], c.get("inside")).values()]
                iv = stats.mean_interval(runs) if runs else None
                got = (iv, len(runs), "SMELT run", _residual_why(c, iv, "too few SMELT runs for an interval"))
            else:
                got = (None, 0, "SMELT endpoint", f"calibration not identified: {c.get('why')}")
            claim(f"{name} residual", f"calibration residual (Eq. 7) of SMELT on {name} > 0", PAPER["residual"],
                  ">", 0.0, *got)
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
                       f"normalised shape describes a loss, not a gain (ratio {iv.fmt(2)})"), None
        if iv is not None and iv.resolved and iv.few_units:   # not resolved (stats.verdict); the interval is kept
            why = (f"{iv.n} contrasts: a percentile bootstrap over fewer than {stats.MIN_BOOTSTRAP_UNITS} units "
                   f"covers the truth less often than it says (docs/wins.md)")
        claim("length tilt", "SMELT's gain tilts to long documents: long/short ratio > 1",
              PAPER["length tilt"], ">", 1.0, iv, f["n_contrasts"], "SMELT/Baseline run pair", why)
    return claims


def _run_means(records: Sequence[dict], residuals: Sequence[float], inside: Sequence[bool] | None = None) -> dict:
    """{(scale, sparsity label, seed): (scale, mean residual)}: SMELT's Eq. 7 residuals (in records' order)
    averaged per run, over the endpoints `inside` the Baseline loss range (beyond it they measure extrapolation)."""
    smelt = [r for r in records if r["arch"] == "smelt"]
    by = defaultdict(list)
    for r, v, keep in zip(smelt, residuals, inside if inside is not None else [True] * len(residuals)):
        if keep:
            by[(r.get("scale") or r.get("run", "?"), r.get("sparsity_label"), r.get("seed", 0))].append(v)
    return {k: (str(k[0]), float(np.mean(v))) for k, v in by.items()}


def _residual_why(c: dict, iv: stats.Interval | None, too_few: str) -> str | None:
    """A residual claim's why: `too_few` without an interval, then the SMELT endpoints left out of range."""
    n = len(c.get("inside") or []) - sum(c.get("inside") or [])
    outside = (f"{n} of {len(c['inside'])} SMELT endpoints lie outside the Baseline loss range and are left out "
               f"(their residual would measure the sigmoid's extrapolation)") if n else None
    return "; ".join(filter(None, [too_few if iv is None or not iv.resolved else None, outside])) or None


def _residual_growth(records: Sequence[dict], calibration: dict, claim) -> None:
    """SMELT 5.1: the mean Eq. 7 residual grows with scale, per identified real metric: the largest scale's
    SMELT runs' mean residuals minus the smallest's (Welch interval over runs; claim > 0)."""
    groups = {str(r.get("scale") or r.get("run", "?")) for r in records if r["arch"] == "smelt"}
    rank = scale_rank(records)
    scales = sorted(groups, key=lambda g: rank.get(g, 0))
    for name in ("completion", "core"):
        c = calibration.get("metrics", {}).get(name)
        if c is None:
            continue
        text = f"calibration residual of SMELT on {name}: largest scale minus smallest > 0"
        if not c.get("identified") or len(scales) < 2:
            claim(f"{name} residual growth", text, PAPER["residual growth"], ">", 0.0, None, 0, "SMELT endpoint",
                  f"calibration not identified: {c.get('why')}" if not c.get("identified") else "one scale")
            continue
        by = defaultdict(list)
        for g, v in _run_means(records, c["residuals"], c.get("inside")).values():
            by[g].append(v)
        lo, hi = by[scales[0]], by[scales[-1]]
        iv = stats.welch_difference(lo, hi) if lo and hi else None
        claim(f"{name} residual growth", f"{text} ({scales[-1]} vs {scales[0]})", PAPER["residual growth"], ">", 0.0,
              iv, len(lo) + len(hi), "SMELT run", _residual_why(c, iv, "too few SMELT runs per scale for an interval"))


def downstream_report(records: Sequence[dict], margin: float = 0.0, n_boot: int = 2000, n_perm: int = 10000,
                      unit: str = "run") -> dict:
    """Everything SMELT Section 5 reports from a grid's endpoint evaluations: wins, icl (sweep), families,
    calibration (every Baseline against every SMELT endpoint; {"error"} without validation) and claims."""
    recs = list(records)
    check_grid(recs)
    try:
        cal = calibration_report(*([r for r in recs if r["arch"] == a] for a in ARMS))
    except ValueError as e:
        cal = {"error": str(e), "metrics": {}}
    fams = length_families(recs, n_boot)
    icl = icl_sweep(recs, margin, n_perm)
    return {"n_endpoints": len(recs), "n_pairs": len(matched_pairs(recs)), "wins": win_counts(recs),
            "icl": icl, "families": fams, "calibration": cal,
            "claims": downstream_claims(recs, cal, fams, unit, icl, n_boot)}
