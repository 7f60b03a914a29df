"""What probes.py reads and writes: the matched-pair check, the probes.json cache, the output folder.

`check_pairs` refuses, before any model runs, a pair that is not a matched (Baseline, SMELT) pair by
the runs' own configs (config.json of a run directory, the meta of an endpoint file, a GPT's config):
one run twice, a swapped pair, two Baselines or two SMELT runs, or runs of different cells, data,
vocabularies, seeds, training contexts or branch steps; the error names both runs and why.
`save_result` / `load_result` write and read probes.json hashed (runfiles.write_json / read_cache: a
truncated or edited file is named and recomputed, never trusted) with its figure paths relative to
its own folder, so a copied out dir re-runs. `check_out_dir` refuses a file or unwritable folder.
The choices are in docs/probes.md. Read next: probes.py.
"""
from __future__ import annotations

import numbers
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import checks
import runfiles
from model import ModelConfig

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


def positive_ints(where: str, **values) -> None:
    """ValueError naming the first value that is not a positive integer (a sequence: every element)."""
    for name, v in values.items():
        for x in (v if isinstance(v, (tuple, list)) else [v]):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
                raise ValueError(f"{where}: {name} must be a positive integer (or a non-empty list of them), "
                                 f"got {v!r}")
        if isinstance(v, (tuple, list)) and not v:
            raise ValueError(f"{where}: {name} must not be empty")


def check_out_dir(out: str | os.PathLike) -> None:
    """Make `out` and try a write there; ValueError naming it when it is a file or cannot be written."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ValueError(f"output directory {p} is a file, not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ValueError(f"output directory {p} cannot be written: {e.strerror or e}") from None


def save_result(path: str | os.PathLike, res: dict) -> None:
    """probes.json: hashed (runfiles.write_json), its figure paths relative to its own folder."""
    root, rel = Path(path).parent.resolve(), []
    for f in res.get("figures", []):
        p = Path(f).resolve()
        if not p.is_relative_to(root):
            raise ValueError(f"{path}: figure {f} lies outside {root}: write the figures inside the out dir")
        rel.append(p.relative_to(root).as_posix())
    runfiles.write_json(path, {**res, "figures": rel})


def load_result(path: str | os.PathLike) -> dict | None:
    """probes.json as `save_result` wrote it, figures resolved against its folder; None (recompute it) when it is
    absent, damaged or unhashed (runfiles.read_cache names it), or names a figure that is not there."""
    res = runfiles.read_cache(path, RESULT_KEYS)
    if res is None:
        return None
    root, figs = Path(path).parent, res["figures"]
    bad = ([f for f in figs if not isinstance(f, str) or Path(f).is_absolute() or not (root / f).is_file()]
           if isinstance(figs, list) else [figs])
    if bad:
        print(f"{path}: figure {bad[0]!r} is missing or not a path inside {root}; recomputing it", flush=True)
        return None
    return {**res, "figures": [str(root / f) for f in figs]}
