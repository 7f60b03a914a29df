"""train.py's results rows -> the scaling fits' data (SMELT Section 4.3): read, check, average, split.

* `read_results`, `check_rows`: the rows a fit needs, each bad one named before any fitting.
* `seed_means`: a cell's training-seed replicates averaged into one row per endpoint, so the
  repeated cell (configs.Plan.repeat) weighs as one cell in the fits and the cell bootstrap.
* `split_control`: the S = 0 control cells (scaling.CONTROL_LABEL) left out of the fits (SMELT 4.3).
* `to_points`, `subset_points`: rows -> scaling.Points, whole-validation or per source / domain.

Read next: scaling_analysis.py (the fits and the bootstrap built on these).
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import numpy as np

from scaling import CONTROL_LABEL, S_ROUNDING, Points, check_points


REQUIRED_KEYS = ("arch", "scale", "sparsity_label", "F", "S", "D", "val_loss")


def read_results(path: str) -> list[dict]:
    """train.py's results rows: each row's hash checked and the keys this module needs present
    (runfiles.read_jsonl, the one reader of JSON-lines files); a bad line is a ValueError naming it."""
    import runfiles
    try:
        return runfiles.read_jsonl(path, REQUIRED_KEYS)
    except runfiles.CheckpointError as e:
        raise ValueError(str(e)) from None


def check_rows(rows: Sequence[dict]) -> None:
    """Every row a dict with REQUIRED_KEYS, F, D, val_loss finite and > 0, S finite in [0, 1) (control
    cells: [-0.5, 1));
    the error names the row (index, arch, scale, sparsity label) and the field."""
    if not isinstance(rows, (list, tuple)) or not rows:
        raise ValueError("rows must be a non-empty list of results rows (dicts)")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"rows[{i}] is not a dict: {type(r).__name__}")
        missing = [k for k in REQUIRED_KEYS if k not in r]
        if missing:
            raise ValueError(f"rows[{i}] misses keys {missing}")
        where = f"rows[{i}] ({r['arch']} {r['scale']} {r['sparsity_label']})"
        for k in ("F", "S", "D", "val_loss"):
            v = r[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}: {k} = {v!r} is not a finite number")
        for k in ("F", "D", "val_loss"):
            if r[k] <= 0:
                raise ValueError(f"{where}: {k} = {r[k]!r} must be > 0")
        # a control cell's looped model may measure S slightly below 0 (matching moves its FLOPs by up to
        # 4 %); control rows are fitted only with include_dense, at S clipped to 0 (split_control)
        lo = -0.5 if r["sparsity_label"] == CONTROL_LABEL else -S_ROUNDING
        if not lo <= r["S"] < 1:
            raise ValueError(f"{where}: S = {r['S']!r} must lie in [{0 if lo > -0.5 else lo}, 1) (a fraction)")


def cell_id(row: dict) -> str:
    return f"{row['scale']}/{row['sparsity_label']}"


def to_points(rows: Sequence[dict], losses: Sequence[float] | None = None) -> Points:
    """Rows -> Points; `losses` overrides row["val_loss"] (per-subset fits)."""
    L = [r["val_loss"] for r in rows] if losses is None else losses
    cell = np.array([cell_id(r) for r in rows])
    F, S, D, L = check_points([r["F"] for r in rows], [r["S"] for r in rows], [r["D"] for r in rows], L)
    return Points(F, S, D, L, cell)


def subset_points(rows: Sequence[dict], key: str) -> dict[str, Points]:
    """Per-subset Points from row[key] = {subset: loss} ("val_loss_by_source" / "_by_domain")."""
    by: dict[str, list] = defaultdict(list)
    for r in rows:
        for name, value in (r.get(key) or {}).items():
            by[name].append((r, value))
    return {name: to_points([r for r, _ in rv], [v for _, v in rv]) for name, rv in sorted(by.items())}


def seed_means(rows: Sequence[dict]) -> list[dict]:
    """One row per (arch, cell, D): replicates (rows of one cell and endpoint, e.g. the repeated cell's
    training seeds) averaged: val_loss and every "val_loss_by_*" subset loss; "n_seeds" / "seeds" say
    what was averaged.  Replicates must share F and S (the same model) and report the same subsets; a row
    alone passes unchanged."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["arch"], cell_id(r), float(r["D"]))].append(r)
    out = []
    for (arch, cell, D), rs in groups.items():
        if len(rs) == 1:
            out.append(rs[0])
            continue
        for k in ("F", "S"):
            v = [float(r[k]) for r in rs]
            if max(v) - min(v) > 1e-6 * max(1.0, abs(max(v))):
                raise ValueError(f"{arch} {cell} at D = {D:g}: {len(rs)} rows differ in {k} ({min(v):g} .. "
                                 f"{max(v):g}), so they are not replicates of one model")
        m = {**rs[0], "val_loss": float(np.mean([r["val_loss"] for r in rs])), "n_seeds": len(rs),
             "seeds": [r.get("seed") for r in rs]}
        for k in sorted({k for r in rs for k in r if k.startswith("val_loss_by_")}):
            names = [sorted((r.get(k) or {}).keys()) for r in rs]
            if any(n != names[0] for n in names):     # a mean over fewer seeds than val_loss's would mix the two
                raise ValueError(f"{arch} {cell} at D = {D:g}: its {len(rs)} replicates report different {k} "
                                 f"subsets, so their means would rest on different seeds")
            m[k] = {n: float(np.mean([r[k][n] for r in rs])) for n in names[0]}
        out.append(m)
    return out


def split_control(rows: Sequence[dict], include_dense: bool = False) -> tuple[list[dict], list[dict]]:
    """(rows to fit, control rows left out): the control is every row whose sparsity_label is
    CONTROL_LABEL, for both architectures, whatever S it measures (SMELT 4.3).  include_dense
    keeps them in the fit (and returns no control rows), a looped control's S below 0 clipped to 0."""
    control = [r for r in rows if r["sparsity_label"] == CONTROL_LABEL]
    if include_dense:
        return [{**r, "S": max(float(r["S"]), 0.0)} if r["sparsity_label"] == CONTROL_LABEL else r for r in rows], []
    return [r for r in rows if r["sparsity_label"] != CONTROL_LABEL], control
