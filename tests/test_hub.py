"""lab/hub.py: hub parquet datasets -> a TokenData directory, on parquet files the tests write.

Everything after the download runs here: `build(..., files=...)` reads local files through the path a
download feeds (the two network calls in `_hub_fetcher` are the only lines left out). Needs pyarrow
(requirements-hub.txt); without it the parquet tests skip and the argument checks still run.
"""
import math
import sys

import pytest

import data
from lab import corpus, hub

VOCAB = 512   # written out in data.py: no BPE download


class Killed(Exception):
    """Stands for the process being killed mid-build."""


@pytest.fixture
def pq():
    return pytest.importorskip("pyarrow.parquet")


def _texts(n: int, topic: str) -> list:
    return [f"{topic} note {i}: " + " ".join(f"the {topic} of item {i * j % 97} is {j}." for j in range(1 + i % 7))
            for i in range(n)]


def _write(pq, path, texts, column="text", rows_per_group=50):
    import pyarrow as pa
    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), path, row_group_size=rows_per_group)
    return path


def _expected_tokens(texts) -> int:
    """[EOT] + tokens of every cleaned piece, counted independently of hub.py."""
    enc = data.get_tokenizer(VOCAB)
    return sum(1 + len(enc.encode_ordinary(p)) for t in texts if isinstance(t, str) for p in corpus.clean(t))


@pytest.fixture
def two_sets(pq, tmp_path, monkeypatch):
    """fineweb-edu as two parquet files (web, with a null row), finemath as one (math); BATCH_ROWS small, so
    each file is several parts."""
    monkeypatch.setattr(hub, "BATCH_ROWS", 64)
    web = _texts(300, "web")
    web[7] = None   # a null row is no document
    math_ = _texts(200, "math")
    files = {"fineweb-edu": [_write(pq, tmp_path / "a.parquet", web[:170]), _write(pq, tmp_path / "b.parquet", web[170:])],
             "finemath": [_write(pq, tmp_path / "m.parquet", math_)]}
    return files, {"fineweb-edu": web, "finemath": math_}


def test_build_from_local_parquet_is_a_token_data_dir(two_sets, tmp_path):
    files, texts = two_sets
    m = hub.build(tmp_path / "out", list(files), tokens=10**7, vocab_size=VOCAB, val_tokens=10**6, files=files)
    d = data.TokenData(tmp_path / "out")   # hashes checked on open
    assert d.sources == ["fineweb-edu", "finemath"] and d.domains == {"fineweb-edu": "web", "finemath": "math"}
    assert d.vocab_size == VOCAB and not (tmp_path / "out" / "parts").exists()   # the resume cache is gone
    for name, domain in d.domains.items():   # the budget exceeds the files: every document, every token
        r, docs = m["sources"][name], sum(isinstance(t, str) for t in texts[name])
        assert r["train_tokens"] + r["val_tokens"] == m["tokens_per_domain"][domain] == _expected_tokens(texts[name])
        assert r["val_docs"] == math.ceil(docs / 10) and r["train_docs"] == docs - r["val_docs"]
        assert r["val_tokens"] == len(d._val[name]) and r["files_read"] == [p.name for p in files[name]]
        assert r["version"].startswith("main: ") and r["origin"].startswith("huggingface:")
        batches = list(d.val_batches(name, 4, 32))
        assert batches and batches[0][0].shape[1] == 32
    assert m["train_tokens"] == len(d.train) == sum(r["train_tokens"] for r in m["sources"].values())
    idx, tgt, doc = d.train_batch(0, 4, 32)
    assert idx.shape == tgt.shape == doc.shape == (4, 32) and int(idx.max()) < VOCAB
    assert int((d.train == d.eot).sum()) == sum(r["train_docs"] for r in m["sources"].values())   # one EOT a document


def test_the_budget_is_met_to_within_a_document(pq, tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "BATCH_ROWS", 32)
    texts = _texts(400, "web")
    files = {"fineweb-edu": [_write(pq, tmp_path / "a.parquet", texts)]}
    m = hub.build(tmp_path / "out", ["fineweb-edu"], tokens=3000, vocab_size=VOCAB, val_tokens=300, files=files)
    r = m["sources"]["fineweb-edu"]
    longest = max(_expected_tokens([t]) for t in texts)
    assert 3000 <= r["train_tokens"] + r["val_tokens"] < 3000 + longest
    assert 300 <= r["val_tokens"] < 300 + longest and r["train_docs"] < 400   # stopped early, validation capped
    data.TokenData(tmp_path / "out")


def test_an_interrupted_build_resumes_and_a_built_one_is_left_alone(two_sets, tmp_path, monkeypatch, capsys):
    files, _ = two_sets
    args = dict(tokens=10**7, vocab_size=VOCAB, val_tokens=500, files=files)
    real, calls, kill_at = hub._tokenize, [], [0]

    def tokenize(*a):
        calls.append(1)
        if len(calls) == kill_at[0]:
            raise Killed   # killed after kill_at - 1 parts
        return real(*a)
    monkeypatch.setattr(hub, "_tokenize", tokenize)
    whole = hub.build(tmp_path / "whole", list(files), **args)
    n_parts, kill_at[0] = len(calls), 4
    assert n_parts > 4
    calls.clear()
    with pytest.raises(Killed):
        hub.build(tmp_path / "out", list(files), **args)
    assert len(list((tmp_path / "out" / "parts").rglob("*.npz"))) == 3 and not (tmp_path / "out" / "manifest.json").exists()
    calls.clear()
    kill_at[0] = 0
    m = hub.build(tmp_path / "out", list(files), **args)
    assert len(calls) == n_parts - 3   # only the parts not done before were tokenised
    assert m["files"]["train.bin"] == whole["files"]["train.bin"]   # the same bytes as the uninterrupted build
    assert all(m["files"][f] == whole["files"][f] for f in whole["files"])
    calls.clear()
    before = (tmp_path / "out" / "manifest.json").stat().st_mtime_ns
    again = hub.build(tmp_path / "out", list(files), **args)
    assert not calls and again == m and (tmp_path / "out" / "manifest.json").stat().st_mtime_ns == before
    assert "nothing to do" in capsys.readouterr().out


def test_bad_names_and_specs_are_refused_by_name(tmp_path):
    with pytest.raises(hub.HubError, match="'fineweb'.*fineweb-edu"):
        hub.build(tmp_path / "out", ["fineweb"])
    with pytest.raises(hub.HubError, match="may hold only"):
        hub.parse_dataset("my.set=org/repo:*.parquet:text:web")
    with pytest.raises(hub.HubError, match="each once"):
        hub.build(tmp_path / "out", ["finemath", "finemath"])
    name, ds = hub.parse_dataset("HuggingFaceTB/finemath:finemath-3plus/*.parquet:text:math")
    assert name == "finemath" and ds.domain == "math" and ds.revision == "main"
    assert hub.parse_dataset("m3=HuggingFaceTB/finemath:finemath-3plus/*.parquet:text:math:refs/convert/parquet")[0] == "m3"
    with pytest.raises(SystemExit) as e:   # the command line: argparse's one line, exit 2
        hub.main(["--dataset", "no-such-set", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and not (tmp_path / "out").exists()


def test_a_missing_column_is_refused_by_name(pq, tmp_path):
    files = {"fineweb-edu": [_write(pq, tmp_path / "a.parquet", _texts(20, "web"), column="body")]}
    with pytest.raises(hub.HubError, match="a.parquet: dataset 'fineweb-edu' has no column 'text'.*body"):
        hub.build(tmp_path / "out", ["fineweb-edu"], vocab_size=VOCAB, files=files)
    files = {"x": [_write(pq, tmp_path / "b.parquet", _texts(20, "web"))]}
    with pytest.raises(hub.HubError, match="column 'id' of dataset 'x' holds int64, not text"):
        hub.build(tmp_path / "out2", ["x=org/x:*.parquet:id:web"], vocab_size=VOCAB, files=files)


def test_a_missing_extra_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)   # as if pyarrow were not installed
    with pytest.raises(hub.HubError, match="pip install -r requirements-hub.txt"):
        hub.build(tmp_path / "out", ["fineweb-edu"], vocab_size=VOCAB, files={"fineweb-edu": []})


def test_the_command_line_through_a_stand_in_hub(pq, tmp_path, monkeypatch, capsys):
    """`python -m lab.hub` end to end with huggingface_hub replaced by local files: the listing is filtered by
    the pattern and read in sorted order, a file is fetched once; only the real HTTP is left untested."""
    import shutil
    import types
    src = {"sample/10BT/001_00000.parquet": _write(pq, tmp_path / "1.parquet", _texts(120, "late")),
           "sample/10BT/000_00000.parquet": _write(pq, tmp_path / "0.parquet", _texts(150, "web")),
           "data/CC-MAIN-2024-10/train-00000-of-00020.parquet": tmp_path / "0.parquet", "README.md": None}
    got = []

    def download(repo, filename, *, repo_type, revision, local_dir):
        assert (repo, repo_type, revision) == ("HuggingFaceFW/fineweb-edu", "dataset", "main")
        got.append(filename)
        (local_dir / filename).parent.mkdir(parents=True, exist_ok=True)
        return shutil.copy(src[filename], local_dir / filename)
    fake = types.SimpleNamespace(list_repo_files=lambda repo, repo_type, revision: list(src), hf_hub_download=download)
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    out = tmp_path / "out"
    argv = ["--dataset", "fineweb-edu", "--out", str(out), "--tokens", "1500", "--vocab-size", str(VOCAB),
            "--val-tokens", "200", "--download-dir", str(tmp_path / "dl")]
    hub.main(argv)
    assert got == ["sample/10BT/000_00000.parquet"]   # the budget ends inside the first file in sorted order
    m = data.TokenData(out).manifest
    assert m["sources"]["fineweb-edu"]["files_read"] == got and "web" in capsys.readouterr().out
    hub.main(argv)   # built: nothing fetched, nothing done
    assert got == ["sample/10BT/000_00000.parquet"] and "nothing to do" in capsys.readouterr().out
