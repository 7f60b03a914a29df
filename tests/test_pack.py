"""corpus.pack / reproduce.py --data-dir: everything a machine without network needs, in one folder.

The round trip runs the smoke preset's data, ladder and training stages in a subprocess whose
network namespace is cut (`unshare -n`, or `unshare -rn` without root), reading only the pack;
it skips cleanly where unshare is not permitted. The small preset's pack is not built here
(its corpus downloads hundreds of MB); its size limit is checked by corpus.pack itself.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab import corpus
import data

ROOT = Path(__file__).resolve().parents[1]


def _no_network_prefix() -> list[str] | None:
    for cmd in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            if subprocess.run(cmd + ["true"], capture_output=True, timeout=30).returncode == 0:
                return cmd
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


OFFLINE_RUN = r"""
import json, socket, sys
from dataclasses import replace
try:
    socket.create_connection(("pypi.org", 443), timeout=3)
    sys.exit("the network is reachable: this check would prove nothing")
except OSError:
    pass
import configs
import reproduce
configs.PLANS["smoke"] = replace(configs.PLANS["smoke"], warmup_steps=1, stable_steps=4, branch_steps=[4],
                                 decay_steps=2, eval_tokens=256, scales=1)
reproduce.main(["--preset", "smoke", "--out-dir", sys.argv[1], "--data-dir", sys.argv[2], "--jobs", "1",
                "--skip", "eval", "scaling", "probes"])
"""


def test_smoke_pack_trains_with_the_network_cut(tmp_path, monkeypatch):
    prefix = _no_network_prefix()
    if prefix is None:
        pytest.skip("unshare cannot cut the network here (needs root or unprivileged user namespaces)")
    monkeypatch.setenv("LOOPED_MOE_CACHE", str(tmp_path / "cache"))
    info = corpus.pack("smoke", tmp_path / "pack")
    assert 0 < info["bytes"] < corpus.PACK_LIMIT
    assert info["dataset"] == f"data/smoke-v{data.FORMAT_VERSION}" and not any(f.startswith("tiktoken/") for f in info["files"])
    env = {**os.environ, "LOOPED_MOE_CACHE": str(tmp_path / "empty"), "OMP_NUM_THREADS": "1"}   # only the pack
    r = subprocess.run(prefix + [sys.executable, "-c", OFFLINE_RUN, str(tmp_path / "out"), str(tmp_path / "pack")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["arch"] for r in rows} == {"baseline", "smelt"}    # 2 cells x 2 archs, one branch
    run_cfg = json.loads(next((tmp_path / "out" / "runs").glob("*/config.json")).read_text())
    assert run_cfg["data_dir"].startswith(str((tmp_path / "pack").resolve()))
    assert not (tmp_path / "empty").exists()     # nothing was fetched into the (empty) default cache


def test_pack_carries_the_bpe_files_a_larger_vocabulary_needs(tmp_path, monkeypatch):
    """With a vocabulary past the merges tokenizer.py writes out, the pack holds GPT-2's BPE files and a
    process pointed at the pack builds the tokenizer from them (the network is not used)."""
    have = data.gpt2_files(data.cache_root() / "tiktoken")
    if not all(p.exists() for p in have.values()):
        pytest.skip("the GPT-2 BPE files are not in this machine's cache (fetching them needs PyPI)")
    cache = tmp_path / "cache"
    for p in have.values():
        (cache / "tiktoken").mkdir(parents=True, exist_ok=True)
        shutil.copy(p, cache / "tiktoken" / p.name)
    monkeypatch.setenv("LOOPED_MOE_CACHE", str(cache))
    info = corpus.pack("smoke", tmp_path / "pack", vocab_size=1024)
    assert sum(f.startswith("tiktoken/") for f in info["files"]) == 2
    shutil.rmtree(cache)                                    # the pack alone from here on
    monkeypatch.setenv("LOOPED_MOE_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match="holds preset 'smoke'"):
        corpus.use_pack(tmp_path / "pack", "small")
    d = data.TokenData(corpus.use_pack(tmp_path / "pack", "smoke"))
    enc = data.get_tokenizer(d.vocab_size)
    assert d.vocab_size == 1024 and enc.decode(enc.encode("def f(x): return x")) == "def f(x): return x"
    assert not (tmp_path / "elsewhere").exists()


def test_pack_errors_name_the_problem(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPED_MOE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="not a data pack"):
        corpus.use_pack(tmp_path)
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="without PACK.json"):
        corpus.pack("smoke", tmp_path / "stuff")
    corpus.pack("smoke", tmp_path / "pack")
    shard = tmp_path / "pack" / "data" / f"smoke-v{data.FORMAT_VERSION}" / "train.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(data.CorruptDataError, match="train.bin"):
        corpus.use_pack(tmp_path / "pack")
