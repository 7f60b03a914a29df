"""Fault cases of issue 26 for the pipeline's own files, its out dir and its command lines.

Each case damages one thing and expects a refusal naming the file / path / flag (or a damaged cache
recomputed, never trusted):
  * corruption: data manifest edits (eot_id, a source marked skipped, a domain, flipped bytes, an old
    unhashed manifest, an empty corpus), PACK.json edits, a truncated / edited ladder.json, an eval
    cache whose loss was lowered by 1;
  * disk: a file as the out dir, a read-only out dir, missing parents, no temp file left by data.py;
  * concurrency: two reproduce.py on one out dir;
  * cli: contradictory flags; kills: a pool worker killed mid-job names its runs;
  * a finished smoke out dir copied elsewhere re-runs from cache and renders the same report.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import re
import time
from pathlib import Path

import pytest

import checks
import configs
import data as data_mod
from lab import corpus
import reproduce
from checks import JSONFileError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A private copy of the prepared smoke dataset (hashed manifest)."""
    corpus.prepare("smoke")
    d = tmp_path_factory.mktemp("data") / "smoke"
    shutil.copytree(data_mod.default_data_dir("smoke"), d)
    return d


@pytest.fixture
def data_copy(data_dir, tmp_path):
    d = tmp_path / "smoke"
    shutil.copytree(data_dir, d)
    return d


def _edit_manifest(d: Path, edit, rehash: bool = False) -> None:
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    if rehash:
        checks.write_json(d / "manifest.json", m)
    else:
        (d / "manifest.json").write_text(json.dumps(m, indent=1))


def _first(m: dict) -> str:
    return next(n for n, r in m["sources"].items() if r["status"] == "ok")


MANIFEST_EDITS = {
    "eot_id": lambda m: m.update(eot_id=m["eot_id"] - 1),
    "skipped": lambda m: m["sources"][_first(m)].update(status="skipped"),
    "domain": lambda m: m["sources"][_first(m)].update(domain="law"),
    "vocab_size": lambda m: m.update(vocab_size=70000),
}


@pytest.mark.fault("corruption")
@pytest.mark.parametrize("what", sorted(MANIFEST_EDITS))
def test_an_edited_manifest_is_refused_naming_it(data_copy, what):
    _edit_manifest(data_copy, MANIFEST_EDITS[what])
    with pytest.raises(JSONFileError, match=rf"{data_copy / 'manifest.json'}: content differs from its sha256"):
        data_mod.TokenData(data_copy)


@pytest.mark.fault("corruption")
@pytest.mark.parametrize("what,why", [("eot_id", "eot_id"), ("vocab_size", "dtype 'uint16' does not fit"),
                                      ("skipped", "domains_present"), ("domain", "domains_present")])
def test_a_rehashed_but_inconsistent_manifest_is_refused(data_copy, what, why):
    edit = {**MANIFEST_EDITS, "eot_id": lambda m: m.update(eot_id=m["vocab_size"])}[what]
    if what == "skipped":   # a source dropped from validation but its domain still listed
        edit = lambda m: [r.update(status="skipped") for r in m["sources"].values() if r["domain"] == "math"]
    _edit_manifest(data_copy, edit, rehash=True)
    with pytest.raises(JSONFileError, match=rf"manifest.json: .*{why}"):
        data_mod.TokenData(data_copy)


@pytest.mark.fault("corruption")
@pytest.mark.parametrize("frac", [0.1, 0.35, 0.6, 0.9])
def test_a_flipped_byte_in_the_manifest_blames_the_manifest_not_a_shard(data_copy, frac):
    p = data_copy / "manifest.json"
    b = bytearray(p.read_bytes())
    i = int(len(b) * frac)
    b[i] = ord("7") if b[i] != ord("7") else ord("3")
    p.write_bytes(bytes(b))
    with pytest.raises(JSONFileError, match=str(p)) as e:
        data_mod.TokenData(data_copy)
    assert "rebuild the dataset" in str(e.value)


@pytest.mark.fault("corruption")
def test_an_old_unhashed_manifest_is_refused_and_the_cache_rebuilt(data_copy, capsys):
    _edit_manifest(data_copy, lambda m: m.pop("sha256"))
    with pytest.raises(JSONFileError, match="no sha256 .*delete it"):
        data_mod.TokenData(data_copy)
    corpus.prepare("smoke", out_dir=str(data_copy))          # a damaged cache: recomputed, never trusted
    assert "no sha256" in capsys.readouterr().out
    assert data_mod.TokenData(data_copy).vocab_size == configs.DATA_PRESETS["smoke"].vocab_size


@pytest.mark.fault("corruption")
def test_an_empty_corpus_is_refused_by_name(data_copy):
    (data_copy / "train.bin").write_bytes(b"")
    _edit_manifest(data_copy, lambda m: (m.update(train_tokens=0), m["files"]["train.bin"].update(
        bytes=0, sha256=checks.sha256_of(data_copy / "train.bin"))), rehash=True)
    with pytest.raises(JSONFileError, match=r"\['train.bin'\] empty \(an empty corpus\)"):
        data_mod.TokenData(data_copy)


@pytest.mark.fault("corruption")
def test_an_edited_pack_is_refused_naming_pack_json(tmp_path):
    dest = tmp_path / "pack"
    corpus.pack("smoke", dest)
    info = json.loads((dest / "PACK.json").read_text())
    (dest / "PACK.json").write_text(json.dumps({**info, "dataset": "data/tiny-v2"}))
    with pytest.raises(JSONFileError, match=r"PACK.json: content differs from its sha256.*build the pack again"):
        corpus.use_pack(dest, "smoke")


@pytest.mark.fault("disk")
def test_data_refuses_a_file_as_out_dir_and_leaves_no_temp_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(checks.OutDirError, match=rf"data dir {f} is a file"):
        corpus.prepare("smoke", out_dir=str(f))
    out = tmp_path / "d"
    (out / "train.bin").mkdir(parents=True)                    # the final rename fails mid-prepare
    with pytest.raises(OSError):
        corpus.prepare("smoke", out_dir=str(out))
    assert not [p.name for p in out.rglob("*.tmp*")]


@pytest.mark.fault("disk")
def test_out_dir_checks_name_the_path(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for bad, why in [(f, "is a file"), (f / "sub", f"{f} is a file"), (Path("/sys/looped_moe_out"), "not writable"),
                     (tmp_path / "big", "needs 1048576.0 MiB")]:
        with pytest.raises(checks.OutDirError, match=why):
            checks.check_out_dir(bad, need_bytes=1 << 40 if bad.name == "big" else 0)
    assert checks.check_out_dir(tmp_path / "a" / "b" / "c").is_dir()   # missing parents are made


@pytest.mark.fault("disk")
@pytest.mark.parametrize("bad", ["file", "/sys/looped_moe_out"])
def test_reproduce_refuses_a_bad_out_dir_before_any_work(tmp_path, bad, capsys, monkeypatch):
    out = tmp_path / bad if bad == "file" else Path(bad)
    if bad == "file":
        out.write_text("x")

    def no_work(*a, **k):
        raise AssertionError("the data stage started before the out dir was refused")
    monkeypatch.setattr(reproduce, "stage_data", no_work)
    with pytest.raises(SystemExit) as e:
        checks.run_main(reproduce.main, ["--preset", "smoke", "--out-dir", str(out)], prog="reproduce.py")
    cap = capsys.readouterr()
    assert e.value.code == 2 and "ladder" not in cap.out
    assert re.fullmatch(rf"reproduce.py: error: out dir {out} (is a file|is not writable).*\n", cap.err)


@pytest.mark.fault("concurrency")
def test_a_second_reproduce_on_one_out_dir_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import checks
        with checks.run_lock({str(tmp_path)!r}, "reproduce.py"):
            print("locked", flush=True)
            time.sleep(120)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        p = subprocess.run([sys.executable, "reproduce.py", "--preset", "smoke", "--out-dir", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.strip().splitlines() == [
            f"reproduce.py: error: run directory {tmp_path} is in use by another reproduce.py (pid {holder.pid} holds "
            f"{tmp_path / '.lock'}); wait for it to finish or use another directory"]
        assert not (tmp_path / "ladder.json").exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.fault("cli")
@pytest.mark.parametrize("argv,why", [(["--plan-only", "--skip", "eval"], "--plan-only trains nothing: --skip"),
                                      (["--plan-only", "--jobs", "2"], "--plan-only trains nothing: --jobs"),
                                      (["--data-dir", "/nonexistent/pack"], "--data-dir /nonexistent/pack: no such")])
def test_contradictory_reproduce_flags_are_refused(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        reproduce.parse_args(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


@pytest.mark.fault("cli")
def test_data_pack_with_out_dir_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        corpus.main(["--preset", "smoke", "--out-dir", str(tmp_path / "d"), "--pack", str(tmp_path / "p")])
    assert e.value.code == 2 and "--pack copies the preset's dataset" in capsys.readouterr().err
    assert not (tmp_path / "d").exists() and not (tmp_path / "p").exists()


@pytest.mark.fault("kills")
def test_a_killed_pool_worker_names_the_unfinished_runs():
    with pytest.raises(RuntimeError, match=r"worker process died .* one of run_3, run_4"):
        reproduce.pool_run(os._exit, [3, 4], 2, name=lambda j: f"run_{j}")


# ----------------------------------------------------------------------------------------
# A finished smoke out dir: damaged caches, and the whole folder moved

@pytest.fixture(scope="module")
def smoke(smoke_copy):
    return smoke_copy   # the session's smoke reproduction (conftest), this module's copy


def _body(report: Path) -> str:
    """REPORT.md without its run summary block (times and date differ between invocations)."""
    return "\n".join(line for line in report.read_text().splitlines() if not line.startswith("> "))


@pytest.mark.fault("corruption")
@pytest.mark.parametrize("fault", ["truncate", "edit"])
def test_a_damaged_ladder_json_is_named(smoke, tmp_path, fault):
    d = tmp_path / "l"
    d.mkdir()
    text = (smoke / "ladder.json").read_text()
    (d / "ladder.json").write_text(text[:len(text) // 2] if fault == "truncate" else text.replace('"S=0%"', '"S=1%"', 1))
    why = "not valid JSON" if fault == "truncate" else "content differs from its sha256"
    with pytest.raises(JSONFileError, match=rf"{d / 'ladder.json'}.*{why}"):
        reproduce.read_ladder(d)
    assert reproduce.read_ladder(smoke)[0]["sparsity_label"] == "S=0%"


@pytest.mark.fault("corruption")
def test_an_eval_cache_lowered_by_one_is_recomputed(smoke, capsys):
    cache = sorted((smoke / "eval").glob("*.json"))[0]
    rec = json.loads(cache.read_text())
    cache.write_text(json.dumps({**rec, "val": {**rec["val"], "loss": rec["val"]["loss"] - 1}}))
    plan = configs.PLANS["smoke"]
    data = data_mod.TokenData(data_mod.default_data_dir("smoke"))
    summary = reproduce.stage_eval(plan, reproduce.read_ladder(smoke), data, smoke, 1)
    assert f"{cache}: content differs from its sha256" in capsys.readouterr().out
    again = checks.read_hashed_json(cache)
    assert again["val"]["loss"] == pytest.approx(rec["val"]["loss"], rel=1e-9)
    key = "@".join(cache.stem.rsplit("_b", 1))
    assert summary["runs"][key]["val_loss"] == again["val"]["loss"]


def test_a_moved_out_dir_reruns_from_cache_with_the_same_report(smoke, tmp_path, capsys):
    moved = tmp_path / "elsewhere" / "out"
    shutil.copytree(smoke, moved)
    for p in [*moved.glob("*.json"), *moved.glob("eval/*.json"), moved / "REPORT.md"]:
        assert str(smoke) not in p.read_text(), p                # nothing inside names the old place
    runs = {p: p.read_bytes() for p in (moved / "runs").rglob("*") if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    reproduce.main(["--preset", "smoke", "--out-dir", str(moved)])
    assert " 0 to evaluate" in capsys.readouterr().out             # nothing evaluated again,
    assert {p: p.read_bytes() for p in runs} == runs               # nor trained (every checkpoint as it was)
    assert _body(moved / "REPORT.md") == _body(smoke / "REPORT.md")
