"""The downstream evaluation of one endpoint: the shot sweep over every task, comparisons, the CLI.

SMELT 5.1, 5.3, App. C and E: `evaluate_endpoint` is eval.py's validation report, then every task of tasks.py at
every k of the shot sweep (SHOTS, Fig. 20b-c) and `summarise` (DCLM Core and Completion, real and generated
apart); `compare` tests one endpoint against another (App. C's permutation test, the gain's length shape).
CLI: `python -m lab.evaluate --run RUN [--compare RUN2] [--baselines RUN ...]` writes eval.json and plots.
Read before: eval.py, tasks.py. Read next: calibration.py, downstream_claims.py. Notes: docs/eval.md.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np

import budget
import checks
import data as data_mod
from checks import JSONFileError, check_out_dir, endpoint_id
from eval import load_model, long_short_ratio, normalised_shape, stored_report, val_loss_report
from lab.calibration import CALIBRATION_MIN_POINTS, calibration_report
from lab.corpus import corpus_warning
from lab.eval_plots import plot_calibration, plot_shot_sweep
from lab.tasks import GENERATED_TASKS, REAL_TASKS, demos_available, evaluate_task, get_task, resolve_tasks


SHOTS = (0, 1, 2, 4, 8, 16, 32)
FIT_FIELDS = ("demos_kept", "share_short", "share_cut")   # per task and k: the demonstrations that fit


def fit_label(k: int, demos_kept: float) -> str:
    """'k=8' when every prompt keeps its k demonstrations, else e.g. 'k=8 (2.1 fit)'."""
    return f"k={k}" if demos_kept >= k else f"k={k} ({demos_kept:.1f} fit)"


def summarise(tasks: dict) -> dict:
    """Per origin: "core" (mean centred accuracy) and "completion" (micro gold-completion loss of the generation
    tasks) at each task's headline k and per k; "fit" per task and k; "not_reported": the (task, k) left out."""
    out = {}
    for origin in ("real", "generated"):
        ts = {n: t for n, t in tasks.items() if t["origin"] == ("bigbench" if origin == "real" else "generated")}
        if not ts:
            continue

        def agg(pick) -> dict:
            rs = [(t, pick(t)) for t in ts.values() if pick(t) is not None]
            gen = [r for t, r in rs if t["kind"] == "gen" and r["gold_tokens"]]
            return {"core": float(np.mean([r["centred"] for _, r in rs])) if rs else None,
                    "acc_mean": float(np.mean([r["acc"] for _, r in rs])) if rs else None,
                    "completion": (sum(r["gold_nll_sum"] for r in gen) / sum(r["gold_tokens"] for r in gen))
                    if gen else None, "n_tasks": len(rs)}
        ks = sorted({int(k) for t in ts.values() for k in t["by_k"]})
        out[origin] = {**agg(lambda t: t["by_k"].get(str(t["headline_k"]))),
                       "by_k": {str(k): agg(lambda t: t["by_k"].get(str(k))) for k in ks}}
    out["fit"] = {n: {k: {**f, "label": fit_label(int(k), f["demos_kept"]), "reported": k in t["by_k"]}
                      for k, f in t.get("fit", {}).items()} for n, t in tasks.items()}
    out["not_reported"] = [f"{n} {f['label']}" for n, fs in out["fit"].items() for f in fs.values()
                           if not f["reported"]]
    return out


def evaluate_endpoint(path: str | Path, tasks: Sequence[str] = ("all",), shots: Sequence[int] = SHOTS,
                      seeds: int = 10, max_items: int | None = 100, val: bool | dict = True,
                      val_tokens_per_source: int | None = 1 << 16, batch_size: int = 8, device: str | None = None,
                      enc=None, data=None, log=print) -> dict:
    """Evaluate one endpoint (a path load_model reads): the validation report (when data or the run's data_dir
    is readable), then the shot sweep. val: True, False, or a val_loss_report dict made elsewhere for this endpoint
    (docs/eval.md); enc / data replace the run's tokenizer / TokenData; log gets a line per stage and task."""
    t0 = time.perf_counter()
    checks.need_ints("evaluate_endpoint", seeds=seeds, batch_size=batch_size)
    checks.need_ints("evaluate_endpoint", 1, True, max_items=max_items, val_tokens_per_source=val_tokens_per_source)
    if isinstance(shots, (str, bytes)) or not shots:
        raise ValueError(f"evaluate_endpoint: shots must be a non-empty list of ints >= 0, got {shots!r}")
    checks.need_ints("evaluate_endpoint", 0, shots=list(shots))
    names = resolve_tasks([tasks] if isinstance(tasks, str) else tasks)
    device = checks.resolve_device(device)
    model, meta = load_model(path, device)
    block = model.cfg.block_size
    run_meta = meta.get("meta") or {}
    run = meta["run_dir"] or str(path)
    train_cfg = meta.get("train") or meta["checkpoint"].get("meta", {}).get("train") or {}
    result: dict = {
        "run": run, "name": Path(run).name, "endpoint": meta["endpoint"], "branch_step": meta["branch_step"],
        "step": meta["step"], "tokens": meta["tokens"],
        "arch": run_meta.get("arch", "smelt" if model.cfg.loop.active else "baseline"),
        "scale": run_meta.get("scale"), "sparsity_label": run_meta.get("sparsity_label"),
        "seed": train_cfg.get("seed"), "model": meta["model"],
        "settings": {"tasks": list(tasks), "shots": list(shots), "seeds": seeds, "max_items": max_items}}
    label = endpoint_id(result)
    given = val if isinstance(val, dict) else None
    if given is not None and not {"loss", "by_length"} <= set(given):
        raise ValueError(f"{label}: val must be True, False or a val_loss_report dict (with 'loss' and 'by_length'); "
                         f"got keys {sorted(given)}")
    val = bool(val) and given is None
    if data is None and val and meta.get("data_dir"):
        try:
            data = data_mod.TokenData(meta["data_dir"])
        except Exception as e:  # a moved or unbuilt dataset should not stop the task evaluation
            log(f"{label}: validation skipped: cannot open data_dir {meta['data_dir']!r}: {e}")
    stored = stored_report(meta["run_dir"], meta["branch_step"], data, block, val_tokens_per_source) if val else None
    if val and data and not stored:   # a validation batch will run: it must fit beside the weights
        budget.refuse_oversized(model.cfg, device, batch_size, block, "validation", train=False,
                                weight_bytes=0)   # the weights are loaded: free memory already excludes them
    result["val"] = given or stored or (val_loss_report(model, data, block, batch_size, val_tokens_per_source)
                                        if (val and data) else None)
    if result["val"] and given is None:
        log(f"{label}: val loss {result['val']['loss']:.4f} over {result['val']['tokens']} tokens "
            f"({time.perf_counter() - t0:.1f} s)")
    if enc is None and (foreign := data_mod.foreign_tokenizer(getattr(data, "dir", None) or meta.get("data_dir"))):
        result["tasks_skipped"] = (f"trained on {foreign!r} tokens (its data_dir's meta.json), which the tasks' text "
                                   f"cannot be encoded in")
        log(f"{label}: the few-shot tasks are skipped: {result['tasks_skipped']}")
        names = []
    enc = data_mod.get_tokenizer(model.cfg.vocab_size) if enc is None else enc
    result["tasks"], counts = {}, Counter()
    for i, name in enumerate(names, 1):
        t1 = time.perf_counter()
        task = get_task(name)
        entry = {"origin": task.origin, "kind": task.kind, "category": task.category, "rho": task.rho,
                 "chance": task.chance, "norm": task.norm if task.kind == "mc" else None, "by_k": {},
                 "fit": {}, "short_k": {}}
        most = demos_available(task)
        for k in shots:
            if k > most:
                log(f"{label}: {name} k={k} skipped: only {most} other items to draw demonstrations from")
                continue
            r = evaluate_task(model, enc, task, k, seeds, max_items, block, counts=counts)
            entry["fit"][str(k)] = {f: r[f] for f in FIT_FIELDS}
            if r["share_short"] > 0.5:   # most prompts hold fewer than k demonstrations: not a k-shot result
                entry["short_k"][str(k)] = r
                log(f"{label}: {name} {fit_label(k, r['demos_kept'])} left out of the sweep: "
                    f"{r['share_short']:.0%} of its prompts keep fewer than {k} demonstrations at block {block}")
            else:
                entry["by_k"][str(k)] = r
        done = [int(k) for k in entry["by_k"]]
        entry["headline_k"] = task.shots if task.shots in done else max(done, default=None)
        result["tasks"][name] = entry
        accs = "  ".join(f"k={k} {r['acc']:.3f}" for k, r in entry["by_k"].items())
        log(f"{label}: task {i}/{len(names)} {name}: acc {accs} ({time.perf_counter() - t1:.1f} s)")
    result["summary"] = summarise(result["tasks"])
    result["forward_calls"], result["scoring"] = counts["forward_calls"], dict(counts)
    result["seconds"] = time.perf_counter() - t0
    log(f"{label}: done in {result['seconds']:.1f} s; task scoring: {counts['forward_calls']} forward calls, "
        f"{counts['sequences']} sequences, {counts['tokens']} tokens ({counts['padded_tokens']} padded)")
    return result


def compare(a: dict, b: dict, n: int = 10000) -> dict:
    """Endpoint evaluation b vs a: per task and k, acc(b) - acc(a) and the one-sided paired permutation p of b > a
    over demonstration seeds (SMELT App. C; None with one seed); the length shape of b's gain."""
    from lab import stats
    out: dict = {"tasks": {}}
    for name, ta in a["tasks"].items():
        tb = b["tasks"].get(name)
        for k, ra in ta["by_k"].items():
            rb = tb["by_k"].get(k) if tb else None
            if rb is None or ra["items"] != rb["items"] or len(ra["acc_by_seed"]) != len(rb["acc_by_seed"]):
                continue
            seeds = len(ra["acc_by_seed"])
            out["tasks"].setdefault(name, {})[k] = {
                "gain": rb["acc"] - ra["acc"], "seeds": seeds,
                "p": stats.permutation_test(rb["acc_by_seed"], ra["acc_by_seed"], n, alternative="greater")
                if seeds > 1 else None}
    if a.get("val") and b.get("val"):
        shape = normalised_shape(a["val"]["by_length"], b["val"]["by_length"])
        out["length_shape"], out["long_short"] = shape, long_short_ratio(shape)
    return out


def check_eval_record(rec, where: str) -> dict:
    """An evaluate_endpoint record read back, checked field by field (a JSONFileError naming `where`)."""
    def need(ok, what: str):
        if not ok:
            raise JSONFileError(f"{where}: {what}; re-run `python -m lab.evaluate --run RUN` to rewrite it")
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    need(isinstance(rec, dict) and isinstance(rec.get("tasks"), dict) and isinstance(rec.get("summary"), dict),
         "expected an object with 'tasks' and 'summary' objects")
    val = rec.get("val")
    need(val is None or (isinstance(val, dict) and num(val.get("loss")) and isinstance(val.get("by_length"), dict)),
         "'val' must be null or an object with a numeric 'loss' and 'by_length'")
    for name, t in rec["tasks"].items():
        need(isinstance(t, dict) and isinstance(t.get("by_k"), dict), f"task {name!r} has no 'by_k' object")
        for k, r in t["by_k"].items():
            ok = isinstance(r, dict) and num(r.get("acc")) and isinstance(r.get("items"), list) and \
                isinstance(r.get("acc_by_seed"), list) and all(num(x) for x in r["acc_by_seed"])
            need(ok, f"task {name!r} k={k} needs a numeric 'acc', an 'items' list and numeric 'acc_by_seed'")
    return rec


def read_eval(path: str | Path) -> dict:
    """An eval.json (or a run directory holding one), hash-checked when it carries its hash, field-checked."""
    p = Path(path)
    p = p / "eval.json" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"{p} not found: run `python -m lab.evaluate --run {p.parent}` first")
    obj = checks.read_json(p)
    if isinstance(obj, dict) and checks.ROW_HASH in obj:
        obj = checks.read_hashed_json(p)
    return check_eval_record(obj, str(p))


def build_parser() -> argparse.ArgumentParser:
    ap = checks.parser("Evaluate a run: validation loss by source/domain/length, "
                    "few-shot shot sweep, optional comparison and loss-to-score calibration.")
    ap.add_argument("--run", required=True, help="run directory with config.json and ckpt.pt, or an endpoint / "
                                                 "checkpoint file (RUN_DIR/endpoints/branch_BBBBBBB.pt)")
    ap.add_argument("--tasks", nargs="+", default=["all"], metavar="TASK",
                    choices=["all", "real", "generated", *REAL_TASKS, *GENERATED_TASKS],
                    help=f"task names or groups real|generated|all; real: {list(REAL_TASKS)}; "
                         f"generated: {list(GENERATED_TASKS)}")
    ap.add_argument("--shots", nargs="+", type=checks.nonneg_int, default=list(SHOTS),
                    help="numbers of demonstrations k")
    ap.add_argument("--seeds", type=checks.positive_int, default=10,
                    help="demonstration seeds per k > 0 (k = 0 runs once)")
    ap.add_argument("--max-items", type=checks.nonneg_int, default=100,
                    help="items per task (a fixed shuffle); 0 = all")
    ap.add_argument("--val-tokens", type=checks.nonneg_int, default=1 << 16,
                    help="validation tokens per source; 0 = no validation")
    ap.add_argument("--batch-size", type=checks.positive_int, default=8,
                    help="validation batch size (rows of block_size)")
    checks.add_device(ap)
    checks.add_out_dir(ap, "where eval.json (for an endpoint file: NAME.eval.json) and the plots go (default: beside "
                    "--run, where reproduce.py and --compare / --baselines look for them)")
    ap.add_argument("--compare", default=None,
                    help="another run dir with eval.json: permutation tests and length shape vs it")
    ap.add_argument("--baselines", nargs="+", default=None,
                    help=f"Baseline run dirs with eval.json (>= {CALIBRATION_MIN_POINTS}): calibrate this run "
                         f"against them (SMELT Eq. 6-7)")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    device = checks.resolve_device(args.device)   # a GPU this machine lacks: one line, before any work
    if args.baselines and args.val_tokens == 0:
        ap.error("--baselines calibrates against validation loss: it needs --val-tokens > 0")
    src = Path(args.run)
    if not src.exists():
        ap.error(f"--run {src} not found: give a run directory (config.json + ckpt.pt) or an endpoint file")
    out = Path(args.out_dir) if args.out_dir else (src if src.is_dir() else src.parent)
    try:   # every location read or written, checked before the evaluation
        check_out_dir(out, 16 << 20)   # eval.json and its plots
        if (src / "config.json").is_file():   # the run's model config, field by field
            from model import ModelConfig
            checks.read_config(src / "config.json", ModelConfig, "--run", key="model")
        other = read_eval(args.compare) if args.compare else None
        base = [read_eval(d) for d in args.baselines] if args.baselines else None
    except (OSError, ValueError, checks.UserError) as e:
        ap.error(str(e))
    res = evaluate_endpoint(args.run, tasks=args.tasks, shots=args.shots, seeds=args.seeds,
                            max_items=args.max_items or None, val=args.val_tokens > 0,
                            val_tokens_per_source=args.val_tokens or None, batch_size=args.batch_size,
                            device=device)
    out_json = out / "eval.json" if src.is_dir() else out / src.with_suffix(".eval.json").name
    stem = out / ("eval" if src.is_dir() else src.stem)
    if other:
        res["compare"] = {"against": args.compare, **compare(other, res)}
    if note := corpus_warning(res["run"], *(r["run"] for r in [other, *(base or [])] if r and r.get("run"))):
        print(note)   # a comparison across corpora: recorded beside it
        res["corpus_warning"] = note
    if base:
        try:
            res["calibration"] = calibration_report(base, [res])
            if note := plot_calibration(base, [res], res["calibration"], f"{stem}_calibration.png"):
                print(note)
        except ValueError as e:   # e.g. this run's data_dir was unreadable: keep the task results
            res["calibration"] = {"error": str(e)}
            print(f"calibration skipped: {e}")
    checks.write_json(out_json, json.loads(json.dumps(res, default=float)))   # hashed: read_eval checks it
    if note := plot_shot_sweep(res, f"{stem}_shots.png", other):
        print(note)
    for origin in ("real", "generated"):
        if s := res["summary"].get(origin):
            print(f"{origin} tasks: mean centred accuracy {s['core']}, gold-completion loss {s['completion']}")
    if res["summary"]["not_reported"]:
        print(f"left out of the shot sweep (most prompts hold fewer than k demonstrations at block "
              f"{res['model']['block_size']}): {', '.join(res['summary']['not_reported'])}")
    print(f"task scoring: {res['forward_calls']} forward calls for {res['scoring'].get('sequences', 0)} sequences")
    print(f"wrote {out_json} and plots")


if __name__ == "__main__":
    checks.run_main(main)
