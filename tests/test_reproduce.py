"""reproduce.py: the smoke preset runs every stage end to end, the report says only what its data resolve,
and a re-run skips finished work."""
import json
import re

import pytest

import configs
import reproduce
import stats


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    report = reproduce.main(["--preset", "smoke", "--out-dir", str(out)])
    return out, report


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
    assert all(r["val_loss"] < 6.3 for r in rows)          # below the uniform 512-token loss: it learned
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
    # every claims row ends in one of the three verdicts
    claims = text.split("## Claims")[1].splitlines()
    verdict_rows = [line for line in claims if line.startswith("| ") and not line.startswith("| paper claim")]
    assert verdict_rows and all(line.rstrip(" |").rsplit("| ", 1)[-1].strip() in stats.VERDICTS
                                for line in verdict_rows)
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


def test_loop_knobs_flow_from_the_plan(tmp_path, monkeypatch):
    """r, the span and shared experts come from one setting, the run plan (or --loops): the default plan
    passes no knob to budget.ladder_cells (the SMELT ladder as before), another r is passed on, and the
    report's labels read r from the matched configs."""
    from dataclasses import replace

    import budget
    import report
    plan = configs.PLANS["smoke"]
    assert (plan.n_loops, plan.span_fraction, plan.n_shared_experts) == (2, 0.5, 0)
    assert reproduce.loop_knobs(plan) == {}
    assert reproduce.loop_knobs(replace(plan, n_loops=3, n_shared_experts=1)) == {"n_loops": 3, "n_shared_experts": 1}
    seen = {}

    def fake_cells(preset, ctx, vocab_size=None, **kw):
        seen.update(kw)
        raise RuntimeError("stop")
    monkeypatch.setattr(budget, "ladder_cells", fake_cells)
    monkeypatch.setattr(budget, "preset_doc_length", lambda preset, data=None: 32.0)
    data = type("D", (), {"vocab_size": 512})()
    with pytest.raises(RuntimeError, match="stop"):
        reproduce.stage_ladder(replace(plan, n_loops=3), data, tmp_path)
    assert seen == {"n_loops": 3}
    assert reproduce.build_parser().parse_args(["--loops", "3"]).loops == 3
    assert report.visits_label(2) == "the second visit"
    assert "visit v+1 vs v" in report.visits_label(3) and "2-3" in report.visits_label(3)
    cell = {"smelt": {"loop": {"n_loops": 3}}}
    assert report.loop_count([cell, cell]) == 3 and report.loop_count([]) is None
