"""Fault cases for the files a user hands the commands (issue 37): a malformed JSON file, a wrong type and a
misspelt field, for every command that takes such a file; a run another process holds; a run already finished.
Each refusal is one line on stderr with exit status 2, naming the flag or the file, before any work starts;
a bug in the code keeps its traceback and asks for a report. The commands run as their `__main__` does."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import budget
import checks
from lab import evaluate
from data import FORMAT_VERSION
from lab import probe_pairs
import reproduce
import train as T
from test_faults import _probe_run
from toys import tiny_model

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("malformed", "wrong_type", "misspelt")


def model_text(fault: str) -> str:
    """A ModelConfig JSON with one fault, as a user might write it."""
    good = tiny_model().to_dict()
    return {"malformed": '{"d_model": 64,,}',
            "wrong_type": json.dumps({**good, "d_model": "wide"}),
            "misspelt": json.dumps({**{k: v for k, v in good.items() if k != "d_model"}, "d_modle": 64})}[fault]


WORDS = {"malformed": ["not valid JSON", "fix the file"], "wrong_type": ["d_model must be an int", "'wide'"],
         "misspelt": ["unknown key(s) ['d_modle']", "did you mean 'd_model'?"]}


def refused(main, argv, prog, capsys, *words) -> str:
    """Run main as its `__main__` does; it must end with exit status 2 and one line holding every word."""
    with pytest.raises(SystemExit) as e:
        checks.run_main(main, argv, prog=prog)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    # argparse names the program as sys.argv[0] (pytest's here), run_main as `prog`
    assert re.match(r"\S+: error: ", err) and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.fixture
def forbid(monkeypatch):
    """forbid(module, name): the named work function fails the test if the command reaches it."""
    def _forbid(module, name):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail(f"{name} ran before the bad input was refused"))
    return _forbid


@pytest.mark.fault("cli")
@pytest.mark.parametrize("fault", FAULTS)
def test_budget_config_file(tmp_path, capsys, fault):
    f = tmp_path / "bad.json"
    f.write_text(model_text(fault))
    refused(budget.main, ["--config", str(f)], "budget.py", capsys, "--config", str(f), *WORDS[fault])


@pytest.mark.fault("cli")
@pytest.mark.parametrize("fault", FAULTS)
def test_train_model_json(tmp_path, capsys, forbid, fault):
    f = tmp_path / "bad.json"
    f.write_text(model_text(fault))
    forbid(T, "Trainer")
    refused(T.main, ["--model-json", str(f), "--data", "synthetic", "--out-dir", str(tmp_path / "run")], "train.py",
            capsys, "--model-json", str(f), *WORDS[fault])
    assert not (tmp_path / "run").exists()


@pytest.mark.fault("cli")
@pytest.mark.parametrize("fault", FAULTS)
def test_eval_run_config(tmp_path, capsys, forbid, fault):
    run = tmp_path / "run"
    run.mkdir()
    text = model_text(fault)
    (run / "config.json").write_text(text if fault == "malformed" else f'{{"model": {text}}}')
    forbid(evaluate, "evaluate_endpoint")
    refused(evaluate.main, ["--run", str(run)], "evaluate.py", capsys, "--run", str(run / "config.json"), *WORDS[fault])


@pytest.mark.fault("cli")
@pytest.mark.parametrize("fault,text,words", [
    ("malformed", '{"tasks": {', ["not valid JSON"]),
    ("wrong_type", '{"tasks": [], "summary": {}}', ["'tasks' and 'summary' objects"]),
    ("misspelt", '{"task": {}, "summary": {}}', ["'tasks' and 'summary' objects"])])
def test_eval_compare_and_baselines_files(tmp_path, capsys, forbid, fault, text, words):
    from test_eval import save_run
    save_run(tmp_path / "run")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "eval.json").write_text(text)
    forbid(evaluate, "evaluate_endpoint")
    for flag in ("--compare", "--baselines"):
        refused(evaluate.main, ["--run", str(tmp_path / "run"), flag, str(tmp_path / "other")], "evaluate.py", capsys,
                str(tmp_path / "other" / "eval.json"), *words)


@pytest.mark.fault("cli")
@pytest.mark.parametrize("fault", FAULTS)
def test_probes_pair_config(tmp_path, capsys, forbid, fault):
    b, s = _probe_run(tmp_path, "b", looped=False), _probe_run(tmp_path, "s")
    text = model_text(fault)
    Path(s, "config.json").write_text(text if fault == "malformed" else
                                      json.dumps({**json.loads(Path(b, "config.json").read_text()),
                                                  "model": json.loads(text)}))
    forbid(probe_pairs, "probe_pairs")
    refused(probe_pairs.main, ["--pair", "cell", b, s, "--out-dir", str(tmp_path / "out")], "probe_pairs.py", capsys,
            str(Path(s, "config.json")), *[w for w in WORDS[fault] if w != "fix the file"])


@pytest.mark.fault("cli")
@pytest.mark.parametrize("fault", FAULTS)
def test_scripts_runs_config(tmp_path, capsys, fault):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import downstream
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    b, s = _probe_run(tmp_path, "b", looped=False), _probe_run(tmp_path, "s")
    text = model_text(fault)
    Path(s, "config.json").write_text(text if fault == "malformed" else f'{{"model": {text}}}')
    refused(downstream.main, ["--runs", b, s, "--out-dir", str(tmp_path / "out")], "downstream.py", capsys,
            "--runs", str(Path(s, "config.json")), *WORDS[fault])


@pytest.mark.fault("cli")
@pytest.mark.parametrize("fault", FAULTS)
def test_scaling_results_file(tmp_path, capsys, forbid, fault):
    from lab import scaling_analysis
    good = {"arch": "Baseline", "scale": "t64", "sparsity_label": "S~85%", "F": 1e6, "S": 0.85, "D": 1e5,
            "val_loss": 4.0}
    row = {"malformed": None, "wrong_type": {**good, "F": "big"},
           "misspelt": {**{k: v for k, v in good.items() if k != "val_loss"}, "val_los": 4.0}}[fault]
    f = tmp_path / "results.jsonl"
    f.write_text('{"arch": "Baseline",\n' if row is None else checks.jsonl_line(row))   # hashed as train.py writes
    forbid(scaling_analysis, "analyse")
    words = {"malformed": ["not valid JSON"], "wrong_type": ["F = 'big' is not a finite number"],
             "misspelt": ["missing key(s) ['val_loss']"]}[fault]
    refused(scaling_analysis.main, ["--results", str(f), "--out-dir", str(tmp_path / "out")], "scaling_analysis.py", capsys,
            "--results", str(f), *words)


@pytest.mark.fault("cli")
@pytest.mark.parametrize("fault,text,words", [
    ("malformed", '{"format_version": 1,', ["not valid JSON", "build the pack again"]),
    ("wrong_type", '{"format_version": FORMAT, "preset": "smoke", "dataset": "d", "files": "all"}',
     ["'files' must map each path"]),
    ("misspelt", '{"format_version": FORMAT, "preset": "smoke", "datset": "d", "files": {}}',
     ["missing key(s) ['dataset']"])])
def test_reproduce_data_dir_pack(tmp_path, capsys, forbid, fault, text, words):
    (tmp_path / "pack").mkdir()
    if fault == "malformed":
        (tmp_path / "pack" / "PACK.json").write_text(text)
    else:   # hashed, as data.py writes it: the fault is in a field, not a hand edit
        checks.write_json(tmp_path / "pack" / "PACK.json", json.loads(text.replace("FORMAT", str(FORMAT_VERSION))))
    forbid(reproduce, "_pipeline")
    refused(reproduce.main, ["--preset", "smoke", "--data-dir", str(tmp_path / "pack"), "--out-dir",
                             str(tmp_path / "out")], "reproduce.py", capsys, "PACK.json", *words)


@pytest.mark.fault("cli")
def test_train_data_dir_manifest(tmp_path, capsys, forbid):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text('{"files": {')
    forbid(T, "Trainer")
    refused(T.main, ["--preset", "smoke-dense", "--data-dir", str(tmp_path / "data"), "--out-dir",
                     str(tmp_path / "run")], "train.py", capsys, str(tmp_path / "data" / "manifest.json"),
            "not valid JSON")
    refused(T.main, ["--preset", "smoke-dense", "--data-dir", str(tmp_path / "none"), "--out-dir",
                     str(tmp_path / "run")], "train.py", capsys, "no manifest.json in", str(tmp_path / "none"))


@pytest.mark.fault("cli")
def test_a_deliberate_edit_is_restamped_damage_is_not(tmp_path, capsys):
    """A hand-edited ladder.json is refused naming `python -m checks restamp FILE`; restamped, it reads back marked
    edited (date, previous sha256); a file that does not parse, or has no hash, is still refused by name."""
    f = tmp_path / "ladder.json"
    checks.write_json(f, {"cells": [{"d_ff": 64}]})
    old = json.loads(f.read_text())["sha256"]
    f.write_text(f.read_text().replace('"d_ff": 64', '"d_ff": 96'))
    with pytest.raises(checks.JSONFileError, match=re.escape(f"edited it on purpose: python -m checks restamp {f}")):
        reproduce.read_ladder(tmp_path)
    p = subprocess.run([sys.executable, "-m", "checks", "restamp", str(f)], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 0 and p.stdout == f'{f}: restamped, edit recorded under "edited"\n', p.stderr
    assert reproduce.read_ladder(tmp_path) == [{"d_ff": 96}]
    (edit,) = checks.read_hashed_json(f)["edited"]
    assert edit["previous_sha256"] == old and edit["date"][:4].isdigit()
    checks.run_main(checks.main, ["restamp", str(f)], prog="checks.py")
    assert "unchanged (its sha256 matches), not restamped" in capsys.readouterr().out
    with pytest.raises(checks.JSONFileError, match=r"missing key\(s\) \['x'\]"):   # the reader's keys still count
        checks.read_hashed_json(f, ("cells", "x"))
    (tmp_path / "torn.json").write_text('{"cells": [')
    (tmp_path / "bare.json").write_text('{"cells": []}')
    refused(checks.main, ["restamp", str(tmp_path / "torn.json")], "checks.py", capsys, "torn.json", "not valid JSON")
    refused(checks.main, ["restamp", str(tmp_path / "bare.json")], "checks.py", capsys, "bare.json",
            "missing key(s) ['sha256']")


@pytest.mark.fault("cli")
def test_a_locked_run_is_refused_naming_its_holder(tmp_path, capsys, monkeypatch):
    """train.py on a run directory another trainer holds, and reproduce.py on a held out dir: refused at once
    (no waiting), one line naming the holder's pid and its lock file."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = tmp_path / "run"
    run.mkdir()
    with checks.run_lock(run):   # a second open file description conflicts with this one, as another process's
        refused(T.main, ["--preset", "smoke-dense", "--data", "synthetic", "--out-dir", str(run)], "train.py",
                capsys, f"pid {os.getpid()}", str(run / ".lock"), "wait for it to finish")
        refused(reproduce.main, ["--preset", "smoke", "--out-dir", str(run)], "reproduce.py", capsys,
                f"pid {os.getpid()}", str(run / ".lock"))
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.fault("cli")
def test_a_finished_run_says_it_trained_nothing(finished, capsys):
    from toys import tiny_train
    rows, run = finished
    tc = tiny_train()
    argv = ["--model-json", str(run / "model.json"), "--data", "synthetic", "--vocab-size", "64", "--out-dir", str(run)]
    (run / "model.json").write_text(tiny_model().to_json())
    for k, v in (("lr", tc.lr), ("warmup-steps", tc.warmup_steps), ("stable-steps", tc.stable_steps),
                 ("decay-steps", tc.decay_steps), ("batch-size", tc.batch_size), ("block-size", tc.block_size),
                 ("log-interval", tc.log_interval), ("eval-tokens", tc.eval_tokens),
                 ("ckpt-interval", tc.ckpt_interval), ("flops-ctx", tc.flops_ctx), ("device", tc.device)):
        argv += [f"--{k}", str(v)]
    before = (run / "results.jsonl").read_text()
    assert checks.run_main(T.main, [*argv, "--branch-steps", *map(str, tc.branch_steps)], prog="train.py") == rows
    out = capsys.readouterr().out
    assert f"{run}: every branch {tc.branch_steps} is already trained, so this command trained nothing" in out
    assert f"the rows are in {run / 'results.jsonl'}" in out
    assert (run / "results.jsonl").read_text() == before


@pytest.mark.fault("cli")
def test_a_bug_keeps_its_traceback_and_asks_for_a_report(capsys):
    def buggy(argv):
        raise KeyError("oops")
    with pytest.raises(SystemExit) as e:
        checks.run_main(buggy, [], prog="x.py")
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" in err and "KeyError: 'oops'" in err
    assert err.rstrip().splitlines()[-1].startswith("x.py: this is a bug in looped-moe")


@pytest.mark.fault("cli")
def test_a_full_disk_is_one_line(capsys):
    def full(argv):
        raise OSError(28, "No space left on device", "/tmp/out/ckpt.pt")
    with pytest.raises(SystemExit) as e:
        checks.run_main(full, [], prog="x.py")
    assert e.value.code == 2
    assert capsys.readouterr().err == ("x.py: error: no space left on the device: /tmp/out/ckpt.pt: free some "
                                       "space, or pass --out-dir on a disk with room\n")


@pytest.mark.fault("cli")
def test_the_real_entry_point_is_one_line(tmp_path):
    """The `__main__` path as a user runs it, in a new process: budget.py --config on a malformed file."""
    f = tmp_path / "bad.json"
    f.write_text('{"d_model": 64,,}')
    p = subprocess.run([sys.executable, str(ROOT / "budget.py"), "--config", str(f)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == f"budget.py: error: --config {f}:1:16: not valid JSON: Expecting property name enclosed in " \
                       f"double quotes: fix the file\n"


ENTRY_POINTS = ["reproduce.py", "train.py", "lab/evaluate.py", "lab/probe_pairs.py", "budget.py", "lab/scaling_analysis.py", "lab/corpus.py", "lab/bench.py",
                *sorted(f"scripts/{p.name}" for p in (ROOT / "scripts").glob("*.py") if p.name != "common.py")]


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_every_entry_point_runs_through_run_main(path):
    tail = (ROOT / path).read_text().split('if __name__ == "__main__":')[-1]
    assert "checks.run_main(main)" in tail, f"{path}: its __main__ must call checks.run_main(main)"
