"""reproduce.py: the smoke preset runs every stage end to end, the report says only what its data resolve,
and a re-run skips finished work."""
import json
import math
import re
from pathlib import Path

import pytest

import checks
import configs
import reproduce
from lab import costs, stats


@pytest.fixture(scope="module")
def smoke(smoke_copy):
    """The smoke reproduction (conftest's, run once per session), this module's copy."""
    return smoke_copy, smoke_copy / "REPORT.md"


def test_smoke_reproduction_end_to_end(smoke):
    out, report = smoke
    text = report.read_text()
    for section in ("Run summary", "Budget-matched ladder", "Did the models learn", "SMELT vs its matched Baseline",
                    "Scaling", "Downstream", "Probes of the second visit", "Claims"):
        assert section in text, section
    ladder = reproduce.read_ladder(out)
    assert len(ladder) == 4 and {c["sparsity_label"] for c in ladder} == {"S=0%", "S~85%"}
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    plan = configs.PLANS["smoke"]
    n_runs = 2 * len(ladder) + 2 * (plan.train_seeds - 1)
    assert len(rows) == n_runs * len(plan.branch_steps)
    assert {r["arch"] for r in rows} == {"baseline", "smelt"}
    # learned: half a nat below the uniform loss, log 512 = 6.24 (untrained, these 10 models score 6.20-6.30;
    # trained, the 30 endpoints measured 3.99-5.24)
    uniform = math.log(configs.DATA_PRESETS[plan.data].vocab_size)
    assert all(r["val_loss"] < uniform - 0.5 for r in rows), sorted(r["val_loss"] for r in rows)
    # F is SMELT's (no head) at the document length the ladder was matched at
    assert all(r["F"] < r["F_with_head"] and r["F_ctx"] == pytest.approx(ladder[0]["ctx_len"]) for r in rows)
    assert (out / "probes.json").exists() and (out / "figures" / "curves.png").stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["preset"] == "smoke" and summary["minutes"] > 0 and summary["commit"]


def test_report_states_noise_and_verdicts(smoke):
    out, report = smoke
    text = report.read_text()
    ts = json.loads((out / "training_summary.json").read_text())
    rep = ts["repeat"]
    assert rep["seeds"] == configs.PLANS["smoke"].train_seeds
    iv = stats.paired_difference(rep["baseline"], rep["smelt"])
    assert rep["diff"]["mean"] == pytest.approx(iv.mean) and rep["verdict"] == stats.verdict(iv, "<")
    # every claims row: a verdict against the paper's own scale, then the law at this scale with its verdict or n/a
    claims = text.split("## Claims")[1].splitlines()
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in claims
            if line.startswith("| ") and not line.startswith("| paper claim")]
    assert rows and all(len(r) == 5 and r[3] in stats.VERDICTS for r in rows)
    here = [re.search(r"\*\*(reproduced|contradicted|not resolved)\*\*", r[4]) for r in rows]
    assert all(m or r[4].startswith("n/a") for m, r in zip(here, rows))
    head = next(r for r in rows if r[0].startswith("SMELT - Baseline < 0, paired"))
    assert ("SMELT higher" in head[4]) == (ts["repeat"]["law"]["direction"] == ">")
    # no number a degenerate fit produced: nothing with more than 8 digits
    body = "\n".join(line for line in text.splitlines() if not line.startswith("> **Run summary"))  # commit hash
    assert not re.search(r"\d{9,}", body), re.findall(r"\S*\d{9,}\S*", body)[:5]


def test_rerun_skips_finished_work(smoke):
    out, _ = smoke
    rows = (out / "results.jsonl").read_text()
    # every checkpoint, endpoint and eval cache is left as it was: nothing is trained or evaluated again
    work = {p: p.stat().st_mtime_ns for p in [*(out / "runs").rglob("*.pt"), *(out / "eval").glob("*.json")]}
    assert any(p.suffix == ".pt" for p in work) and any(p.suffix == ".json" for p in work)
    reproduce.main(["--preset", "smoke", "--out-dir", str(out), "--skip", "scaling"])
    assert (out / "results.jsonl").read_text() == rows
    assert {p: p.stat().st_mtime_ns for p in work} == work


def test_a_third_arm_is_one_entry_and_follows_through_every_stage(tmp_path, monkeypatch):
    """An arm added to a plan (here How to Loop's last-half span beside SMELT) is matched to the same Baselines,
    trained, paired with them by cell, seed and name, fitted, evaluated, probed and reported under its own
    heading, with its own colour, with no other edit; the first arm's files stay where they were."""
    from dataclasses import replace

    from lab import plots
    from loop import SMELT, LoopSpec
    plan = replace(configs.PLANS["smoke"], cells=(("m48", "S~85%"),), repeat=None,
                   arms={"smelt": SMELT, "last": LoopSpec(placement="last")})
    monkeypatch.setitem(configs.PLANS, "smoke", plan)
    out = tmp_path / "out"
    reproduce.main(["--preset", "smoke", "--out-dir", str(out)])
    (cell,) = reproduce.read_ladder(out)
    assert configs.cell_arms(cell) == ["baseline", "smelt", "last"]
    assert cell["last"]["loop"]["start"] == 2 and cell["smelt"]["loop"]["start"] == 1   # 4 layers: last half
    assert cell["match"]["last"]["within_tolerance"]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["arch"] for r in rows} == {"baseline", "smelt", "last"}
    final = {r["arch"]: r["val_loss"] for r in rows if r["branch_step"] == max(plan.branch_steps)}
    probed = {}
    for arm, where in (("smelt", out), ("last", out / "arms" / "last")):
        ts = json.loads((where / "training_summary.json").read_text())
        (c,) = ts["cells"]
        assert ts["arm"] == arm and (c["baseline"], c["smelt"]) == (final["baseline"], final[arm])   # by name
        assert (where / "eval_summary.json").exists() and (where / "scaling").is_dir()
        probed[arm] = json.loads((where / "probes.json").read_text())["pairs"]["m48_S85"]
    assert probed["last"]["baseline"]["summary"] == probed["smelt"]["baseline"]["summary"]   # one Baseline run
    assert probed["last"]["smelt"]["summary"] != probed["smelt"]["smelt"]["summary"]         # each its own arm
    text = (out / "REPORT.md").read_text()
    assert text.count("\n## Claims: reproduced") == 1 and "# Arm `last` against the Baseline" in text
    assert "### Claims: reproduced" in text.split("# Arm `last`")[1]          # its sections nested under it
    assert "cells x {Baseline, SMELT, last}" in text
    colors = plots.arm_colors(configs.cell_arms(cell))
    assert len(set(colors.values())) == 3 and colors["smelt"] == plots.ARM_COLORS["smelt"]


def test_loop_knobs_flow_from_the_plan(tmp_path, monkeypatch):
    """The loop knobs come from one setting, the run plan's LoopSpec (or the loop options): the default plan
    passes SMELT's to budget.ladder_cells, another is passed on whole, and the report's labels read r from
    the matched configs."""
    from dataclasses import replace

    import budget
    from lab import report
    from loop import SMELT, LoopSpec
    plan = configs.PLANS["smoke"]
    assert plan.loop == SMELT
    seen = {}

    def fake_cells(preset, ctx, vocab_size=None, **kw):
        seen.update(kw)
        raise RuntimeError("stop")
    monkeypatch.setattr(budget, "ladder_cells", fake_cells)
    monkeypatch.setattr(budget, "preset_doc_length", lambda preset, data=None: 32.0)
    data = type("D", (), {"vocab_size": 512})()
    with pytest.raises(RuntimeError, match="stop"):
        reproduce.stage_ladder(replace(plan, arms={"smelt": LoopSpec(n_loops=3, placement="last")}), data, tmp_path)
    assert seen == {"arms": {"smelt": LoopSpec(n_loops=3, placement="last")}}
    assert reproduce.build_parser().parse_args(["--loops", "3"]).n_loops == 3
    assert report.visits_label(2) == "the second visit"
    assert "visit v+1 vs v" in report.visits_label(3) and "2-3" in report.visits_label(3)
    cell = {"smelt": {"loop": {"n_loops": 3}}, "last": {"loop": {"n_loops": 2}}}
    assert report.loop_count([cell, cell]) == 3 and report.loop_count([]) is None
    assert report.loop_count([cell], "last") == 2
    with pytest.raises(ValueError, match="arms must map names other than 'baseline'"):
        replace(plan, arms={"baseline": SMELT})
    with pytest.raises(ValueError, match="same n_shared_experts"):
        replace(plan, arms={"smelt": SMELT, "shared": LoopSpec(n_shared_experts=1)})


def test_a_nanogpt_data_dir_trains_end_to_end_and_is_recorded(tmp_path, monkeypatch, capsys):
    """--data-dir with nanoGPT's train.bin / val.bin (uint32, one separator id, a foreign tokenizer) trains the plan
    where the files are: the eval stage is skipped with one line saying why and the probes run without the Dyck case
    study (its prompts are text); plan.json names the directory and every run's config.json the sha256 of its
    files; lab.evaluate on one of its runs reports the validation loss and skips the tasks, saying why."""
    from dataclasses import replace

    import numpy as np

    import checkpoint
    import data
    from lab import corpus
    corpus.prepare("smoke")
    td = data.TokenData(data.default_data_dir("smoke"))
    d = tmp_path / "bin"
    d.mkdir()
    np.asarray(td.train).astype(np.uint32).tofile(d / "train.bin")
    np.concatenate([td._val[s] for s in td.sources]).astype(np.uint32).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 512, "eot_id": 511, "dtype": "uint32",
                                             "tokenizer": "someone-elses-bpe"}))
    monkeypatch.setitem(configs.PLANS, "smoke", replace(configs.PLANS["smoke"], cells=(("m48", "S~85%"),),
                                                        repeat=None))
    out = tmp_path / "out"
    reproduce.main(["--preset", "smoke", "--data-dir", str(d), "--out-dir", str(out), "--skip", "scaling"])
    logged = capsys.readouterr().out
    assert "tokenizer 'someone-elses-bpe' is not this project's 'gpt2_512'" in logged
    assert "stage eval is skipped (the probes run without the Dyck case study)" in logged
    assert "(nanogpt-bin, train.bin sha256" in logged
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["arch"] for r in rows} == {"baseline", "smelt"} and all(math.isfinite(r["val_loss"]) for r in rows)
    assert not (out / "eval_summary.json").exists()
    probes = json.loads((out / "probes.json").read_text())
    assert list(probes["pairs"]) == ["m48_S85"] and "dyck" not in probes["pairs"]["m48_S85"]
    from lab import evaluate
    evaluate.main(["--run", str(out / "runs" / "m48_S85_smelt"), "--val-tokens", "256", "--out-dir", str(tmp_path)])
    assert "the few-shot tasks are skipped: trained on 'someone-elses-bpe' tokens" in capsys.readouterr().out
    res = evaluate.read_eval(tmp_path / "eval.json")
    assert res["tasks"] == {} and "'someone-elses-bpe' tokens" in res["tasks_skipped"]
    assert math.isfinite(res["val"]["loss"])
    assert json.loads((out / "plan.json").read_text())["data"] == str(d.resolve())
    assert json.loads((out / "summary.json").read_text())["corpus"]["preset"] == "nanogpt-bin"   # and REPORT.md
    sha = checkpoint.data_fingerprint(data.TokenData(d))
    for cfg in (out / "runs").rglob("config.json"):
        run = json.loads(cfg.read_text())
        assert (run["data_dir"], run["data_sha256"]) == (str(d.resolve()), sha), cfg


def _fake_cells():
    """Four ladder cells as budget.ladder_cells returns them, with only the fields stage_ladder reads."""
    match = {"flops_ratio": 1.0, "params_ratio": 1.0, "kv_ratio": 1.0, "within_tolerance": True}
    return [{"scale": s, "sparsity_label": lab, "match": {"smelt": match}, "smelt": {"d_model": 32, "n_experts": 2}}
            for s in ("m48", "m64") for lab in ("S=0%", "S~85%")]


def test_stage_ladder_keeps_the_plans_scales_and_cells(tmp_path, monkeypatch):
    """plan.scales keeps the first N scales, plan.cells only the named (scale, label) cells, and ladder.json holds
    exactly what is kept; a plan whose block differs from its ladder's is refused before any matching."""
    from dataclasses import replace

    import budget
    monkeypatch.setattr(budget, "ladder_cells", lambda preset, ctx, vocab_size=None, **kw: _fake_cells())
    monkeypatch.setattr(budget, "preset_doc_length", lambda preset, data=None: 32.0)
    data = type("D", (), {"vocab_size": 512})()
    plan = configs.PLANS["smoke"]
    key = lambda cells: [(c["scale"], c["sparsity_label"]) for c in cells]
    assert key(reproduce.stage_ladder(replace(plan, scales=1), data, tmp_path)) == [("m48", "S=0%"), ("m48", "S~85%")]
    cells = reproduce.stage_ladder(replace(plan, cells=(("m64", "S~85%"), ("m48", "S=0%"))), data, tmp_path)
    assert key(cells) == [("m48", "S=0%"), ("m64", "S~85%")] and key(reproduce.read_ladder(tmp_path)) == key(cells)
    with pytest.raises(ValueError, match="no ladder cell left"):
        reproduce.stage_ladder(replace(plan, scales=1, cells=(("m64", "S~85%"),)), data, tmp_path)
    with pytest.raises(ValueError, match=r"block_size=32 differs from configs.LADDERS\['smoke'\]'s 64"):
        reproduce.stage_ladder(replace(plan, block_size=32), data, tmp_path)


def test_curves_draw_each_segments_last_row_but_not_short_validation_rows():
    """train_plots.ce_rows: a few-step row logged for a mid-interval validation is not drawn as train CE; the
    last row of a short decay branch is (small: 25 decay steps against a 58-step log interval)."""
    from lab import train_plots
    ms = [{"branch": None, "step": 58, "ce_steps": 58}, {"branch": None, "step": 60, "ce_steps": 2},
          {"branch": None, "step": 116, "ce_steps": 56}, {"branch": 100, "step": 116, "ce_steps": 16},
          {"branch": 100, "step": 125, "ce_steps": 9}]
    assert [(m["branch"], m["step"]) for m in train_plots.ce_rows(ms)] == [(None, 58), (None, 116), (100, 116),
                                                                           (100, 125)]
    assert train_plots.ce_rows(ms[:2]) == ms[:2]    # the stable run's last row, however short
    fork = [{"branch": None, "step": 58, "ce_steps": 58}, {"branch": None, "step": 60, "ce_steps": 2},
            {"branch": 60, "step": 70, "ce_steps": 10}, {"branch": None, "step": 116, "ce_steps": 56}]
    assert train_plots.ce_rows(fork) == fork         # step 60: a fork point on the stable run, however short


def test_run_tokens_count_the_stable_phase_and_every_branch():
    plan = configs.PLANS["smoke"]
    assert reproduce.run_tokens(plan) == (30 + 3 * 6) * 8 * 64


def test_pool_run_starts_the_costliest_first_and_returns_results_in_job_order():
    """Results line up with the jobs as given, whatever order they ran in (largest cost first)."""
    seen = []
    got = reproduce.pool_run(lambda j: 10 * j, [1, 3, 2], 1, cost=lambda j: j,
                             on_done=lambda k, job, res: seen.append((k, job, res)))
    assert got == [10, 30, 20] and seen == [(1, 3, 30), (2, 2, 20), (3, 1, 10)]


def test_disk_check_counts_what_earlier_invocations_wrote(tmp_path, monkeypatch):
    """Training needs the estimated peak minus what out/runs already holds: a re-run that fits once earlier
    runs are counted goes ahead, one that does not is refused before any training, naming both sizes."""
    import shutil
    from collections import namedtuple

    from toys import tiny_model
    cfg = tiny_model().to_dict()
    ladder = [{"scale": "m48", "sparsity_label": "S=0%", "baseline": cfg, "smelt": cfg, "match": {"smelt": {}}}]
    est = {"runs": 2, "final": 800, "peak": 1000}
    monkeypatch.setattr(costs, "plan_disk_estimate", lambda cfgs, tc, jobs: est)
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "ckpt.pt").write_bytes(b"x" * 300)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10_000, 0, 750))
    assert reproduce.check_disk(configs.PLANS["smoke"], ladder, tmp_path, 1)["peak"] == 1000   # 700 more, 750 free
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10_000, 0, 650))
    with pytest.raises(checks.UserError, match="not enough disk"):
        reproduce.check_disk(configs.PLANS["smoke"], ladder, tmp_path, 1)


def test_default_out_dir_names_another_loop_count(tmp_path, monkeypatch):
    """Loop options other than SMELT's name the default out dir (runs/reproduce_PRESET_r3_last), so those runs
    never mix with the preset's own; options equal to the plan's are the preset's out dir."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(reproduce, "_pipeline", lambda args, plan, out: (out, plan.loop.n_loops))
    assert reproduce.main(["--preset", "smoke"]) == (Path("runs/reproduce_smoke"), 2)
    assert reproduce.main(["--preset", "smoke", "--loops", "2"]) == (Path("runs/reproduce_smoke"), 2)
    assert reproduce.main(["--preset", "smoke", "--loops", "3"]) == (Path("runs/reproduce_smoke_r3"), 3)
    assert reproduce.main(["--preset", "smoke", "--loops", "3", "--placement", "last"]) == (
        Path("runs/reproduce_smoke_r3_last"), 3)


def test_damaged_json_during_the_pipeline_is_one_line(tmp_path, monkeypatch, capsys):
    """A JSONFileError (a damaged ladder.json, a hand-edited cache) ends reproduce.py with one line naming the
    file, not a traceback."""
    from checks import JSONFileError

    def damaged(args, plan, out):
        raise JSONFileError(f"{out / 'ladder.json'}: content differs from its sha256 (edited or corrupt)")
    monkeypatch.setattr(reproduce, "_pipeline", damaged)
    with pytest.raises(SystemExit) as e:
        checks.run_main(reproduce.main, ["--preset", "smoke", "--out-dir", str(tmp_path)], prog="reproduce.py")
    assert e.value.code == 2
    assert capsys.readouterr().err == f"reproduce.py: error: {tmp_path / 'ladder.json'}: content differs from its " \
                                      f"sha256 (edited or corrupt)\n"


def test_probes_stage_names_every_matched_pair_with_its_seed(tmp_path, monkeypatch):
    """Each matched pair is (cell key, with _seedN for seed replicates; Baseline dir; SMELT dir)."""
    from lab import probe_pairs
    seen = []

    def stop(pairs, *a, **kw):
        seen.extend(pairs)
        raise RuntimeError("stop")
    monkeypatch.setattr(probe_pairs, "probe_pairs", stop)
    ladder = [{"scale": "m48", "sparsity_label": "S=0%", "match": {"smelt": {}}},
              {"scale": "m64", "sparsity_label": "S~85%", "match": {"smelt": {}}}]
    with pytest.raises(RuntimeError, match="stop"):
        reproduce.stage_probes(configs.PLANS["smoke"], ladder, None, tmp_path)
    runs = tmp_path / "runs"
    assert seen == [(k, str(runs / f"{cell}_baseline{seed}"), str(runs / f"{cell}_smelt{seed}"))
                    for k, cell, seed in (("m48_S0", "m48_S0", ""), ("m64_S85", "m64_S85", ""),
                                          ("m64_S85_seed1", "m64_S85", "_seed1"))]
