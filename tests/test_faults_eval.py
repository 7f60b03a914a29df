"""Fault cases for eval.py and tasks.py (issue 26.9, 26.10): bad output locations, damaged eval JSON and task
files, bad API values, each refused before any evaluation with one line naming the path or the field."""
import json
import os

import pytest

import checks
from lab import evaluate
from lab import tasks
from test_eval import CharTok, Successor, save_run


@pytest.fixture
def no_work(monkeypatch):
    """evaluate.main's checks must come before the evaluation: evaluate_endpoint fails the test if reached."""
    def boom(*a, **kw):
        raise AssertionError("the evaluation ran before the bad input was refused")
    monkeypatch.setattr(evaluate, "evaluate_endpoint", boom)


def _refused(argv, capsys, *words):
    with pytest.raises(SystemExit) as e:
        evaluate.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and all(w in err for w in words), err
    return err


@pytest.mark.fault("cli")
def test_out_dir_that_is_a_file_is_refused_first(tmp_path, capsys, no_work):
    save_run(tmp_path / "run")
    (tmp_path / "f").write_text("x")
    _refused(["--run", str(tmp_path / "run"), "--out-dir", str(tmp_path / "f")], capsys, str(tmp_path / "f"), "is a file")
    _refused(["--run", str(tmp_path / "run"), "--out-dir", str(tmp_path / "f" / "sub")], capsys,
             str(tmp_path / "f" / "sub"), "is a file, not a directory")


@pytest.mark.fault("cli")
def test_missing_run_and_compare_files_are_refused_first(tmp_path, capsys, no_work):
    save_run(tmp_path / "run")
    _refused(["--run", str(tmp_path / "nope")], capsys, str(tmp_path / "nope"), "not found")
    (tmp_path / "other").mkdir()
    _refused(["--run", str(tmp_path / "run"), "--compare", str(tmp_path / "other")], capsys,
             str(tmp_path / "other" / "eval.json"), "not found")
    _refused(["--run", str(tmp_path / "run"), "--baselines", str(tmp_path / "other")] * 1, capsys,
             str(tmp_path / "other" / "eval.json"))


@pytest.mark.fault("disk")
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory: the probe-file case covers it")
def test_read_only_run_dir_is_refused_first(tmp_path, capsys, no_work):
    save_run(tmp_path / "run")
    os.chmod(tmp_path / "run", 0o500)
    try:
        _refused(["--run", str(tmp_path / "run")], capsys, str(tmp_path / "run"), "is not writable")
    finally:
        os.chmod(tmp_path / "run", 0o700)


@pytest.mark.fault("disk")
def test_unwritable_or_full_out_dir_is_refused(tmp_path, monkeypatch):
    def deny(*a, **kw):
        raise PermissionError(13, "Permission denied")
    with monkeypatch.context() as m:   # what a read-only directory does to the probe file
        m.setattr(checks.Path, "write_bytes", deny)
        with pytest.raises(checks.OutDirError, match=f"{tmp_path} is not writable \\(Permission denied\\)"):
            evaluate.check_out_dir(tmp_path, 16 << 20)
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 20})())
    with pytest.raises(checks.OutDirError, match="needs 16.0 MiB, 1.0 MiB free"):
        evaluate.check_out_dir(tmp_path, 16 << 20)
    assert not list(tmp_path.iterdir())                                  # the probe file is gone


def _eval_json(tmp_path, name="other"):
    save_run(tmp_path / name, vocab_size=512, block_size=128)
    evaluate.main(["--run", str(tmp_path / name), "--tasks", "gen_copy", "--shots", "0", "1", "--seeds", "2",
             "--max-items", "2", "--val-tokens", "0"])
    return tmp_path / name / "eval.json"


def _edited(obj: dict) -> dict:
    obj["tasks"]["gen_copy"]["by_k"]["1"]["acc"] += 0.5       # still valid JSON, its hash kept
    return obj


@pytest.mark.fault("corruption")
def test_damaged_compare_files_are_named(tmp_path, capsys, monkeypatch):
    path = _eval_json(tmp_path)
    good = path.read_text()
    assert evaluate.read_eval(path.parent)["tasks"]["gen_copy"]["by_k"]["1"]["seeds"] == 2      # hash-checked, fields fine
    save_run(tmp_path / "run")
    monkeypatch.setattr(evaluate, "evaluate_endpoint", lambda *a, **kw: pytest.fail("evaluated before the check"))
    cases = {"truncated": (good[:len(good) // 2], "truncated"),
             "edited": (json.dumps(_edited(json.loads(good))), "differs from its sha256"),
             "not JSON": ("\x00\x01", "not valid JSON")}
    for why, (text, words) in cases.items():
        path.write_text(text)
        _refused(["--run", str(tmp_path / "run"), "--compare", str(path.parent)], capsys, str(path), words)
    obj = json.loads(good)
    obj.pop(checks.ROW_HASH)
    obj["tasks"]["gen_copy"]["by_k"]["1"]["acc_by_seed"] = ["x"]      # an unhashed file: its fields are checked
    path.write_text(json.dumps(obj))
    _refused(["--run", str(tmp_path / "run"), "--compare", str(path.parent)], capsys, str(path),
             "task 'gen_copy' k=1 needs")
    with pytest.raises(checks.JSONFileError, match="'val' must be null"):
        evaluate.check_eval_record({"tasks": {}, "summary": {}, "val": {"loss": "low"}}, "x.json")


@pytest.mark.fault("corruption")
def test_damaged_task_files_are_named(tmp_path):
    good = (tasks.TASK_DIR / "operators.json").read_text()
    bad = {"truncated": (good[:100], "truncated"),
           "no examples": (json.dumps({"name": "operators"}), "needs a non-empty 'examples' list"),
           "no name": (json.dumps({"examples": [{"input": "a", "target": "b"}]}), "and a string 'name'"),
           "bad example": (json.dumps({"name": "operators",
                                       "examples": [{"input": "a", "target": "b"}, {"input": 3, "target": "c"}]}),
                           "example 1 needs a string 'input'")}
    for why, (text, words) in bad.items():
        (tmp_path / "operators.json").write_text(text)
        with pytest.raises(checks.JSONFileError, match=words) as e:
            tasks.load_bigbench("operators", tmp_path)
        assert str(tmp_path / "operators.json") in str(e.value)
    mc = json.loads((tasks.TASK_DIR / "language_identification.json").read_text())
    mc["examples"][5].pop("target_scores")
    (tmp_path / "language_identification.json").write_text(json.dumps(mc))
    with pytest.raises(checks.JSONFileError, match="example 5 needs .*'target_scores' object;"):
        tasks.load_bigbench("language_identification", tmp_path)


@pytest.mark.fault("api")
def test_an_unknown_generated_task_is_named_even_with_no_items():
    with pytest.raises(KeyError, match="unknown generated task 'gen_x'"):
        tasks.generate_task("gen_x", n_items=0)


@pytest.mark.fault("api")
@pytest.mark.parametrize("kw, field", [(dict(k=-1), "k"), (dict(k=2.0), "k"), (dict(k=True), "k"),
                                       (dict(k=1, seeds=0), "seeds"), (dict(k=0, max_items=0), "max_items"),
                                       (dict(k=0, block_size=2), "block_size"),
                                       (dict(k=0, batch_tokens=0), "batch_tokens")])
def test_evaluate_task_refuses_bad_values_by_name(kw, field):
    t = tasks.generate_task("gen_copy", 10)
    with pytest.raises(ValueError, match=f"evaluate_task: {field} must be an integer >= "):
        tasks.evaluate_task(Successor(), CharTok(), t, block_size=kw.pop("block_size", 64), **kw)
    t.kind = "qa"
    with pytest.raises(ValueError, match="kind must be 'mc' or 'gen'"):
        tasks.evaluate_task(Successor(), CharTok(), t, 0, block_size=64)


@pytest.mark.fault("api")
@pytest.mark.parametrize("kw, words", [(dict(shots=[0, -1]), "shots must be an integer >= 0"),
                                       (dict(shots=[]), "shots must be a non-empty list"),
                                       (dict(seeds=0), "seeds must be"), (dict(max_items=0), "max_items must be"),
                                       (dict(batch_size=0), "batch_size must be"),
                                       (dict(val_tokens_per_source=-5), "val_tokens_per_source must be")])
def test_evaluate_endpoint_refuses_bad_values_before_loading(tmp_path, kw, words):
    with pytest.raises(ValueError, match=f"evaluate_endpoint: {words}"):      # checked before the (missing) model loads
        evaluate.evaluate_endpoint(tmp_path / "no_such_run", **kw)
    with pytest.raises(KeyError, match="unknown task 'gen_cpy'"):
        evaluate.evaluate_endpoint(tmp_path / "no_such_run", tasks=["gen_cpy"])
