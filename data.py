"""The training data: token budgets per domain, packing into contexts, validation sets, packs.

SMELT (Section 3.1, "Data" and "Evaluation") packs documents into fixed contexts with
segment-level attention masks (one segment per document) and reports validation loss per
held-out source, grouped into domains. `prepare` turns corpus.py's documents into that:
- Balance: each domain gets the same token budget, split evenly over its present sources (a
  small source's leftover passes to the next); every 10th document of a source is held out
  for validation, up to the preset's cap. A missing source is skipped; the manifest records
  which domains are present.
- Packing: each document is [EOT] + tokens (EOT doubles as BOS), concatenated into one uint16
  stream (uint32 above 65536 ids); a context is block_size+1 tokens: idx = chunk[:-1],
  targets = chunk[1:], doc_ids = a new segment id at every EOT.
- Order: batch k is a pure function of (seed, k): each epoch draws a seeded permutation of the
  context slots and a phase shift, so a resumed run continues exactly; with DDP, rank r takes
  rows [r*B, (r+1)*B) of the global batch.
- Cache: `manifest.json` (written last, carrying its own sha256) records sources, licences, sizes
  and every shard's sha256: re-running is a no-op, an edited manifest or a corrupt shard is named. `pack` copies a
  dataset and its BPE files into one folder (< 64 MiB) that `use_pack` reads with no network.
- Measures: the effective document length SMELT's FLOPs use, the unigram floor, bytes/token.
- `SyntheticData`: Zipf documents with TokenData's interface and no files (tests, benchmarks).
Sizes, timings and measured figures: docs/data.md.

Read first: tokenizer.py, corpus.py. Read next: model.py (the decoder these batches feed).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import numpy as np
import tiktoken
import torch

import cli
from lab import corpus
import configs
from checks import BadFileError, JSONFileError, UserError
from lab.corpus import FORMAT_VERSION
from runfiles import atomic_write_bytes, check_out_dir, read_json, sha256_of, write_json
from lab.tokenizer import (GPT2_VOCAB, cache_root, fetch_gpt2_files, get_tokenizer, gpt2_files,
                       needs_bpe_files)


class CorruptDataError(UserError, RuntimeError):
    """A prepared file does not match the sha256 recorded in manifest.json."""




def default_data_dir(preset: str, vocab_size: int | None = None) -> str:
    """The prepared dataset's directory; versioned by format and (non-default) vocabulary."""
    vocab = vocab_size or configs.data_preset(preset).vocab_size
    suffix = "" if vocab == configs.DATA_PRESETS[preset].vocab_size else f"-vocab{vocab}"
    return str(cache_root() / "data" / f"{preset}-v{FORMAT_VERSION}{suffix}")




# ----------------------------------------------------------------------------- prepare
def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


MANIFEST_KEYS = ("format_version", "vocab_size", "eot_id", "dtype", "sources", "files", "domains_present",
                 "train_tokens", "spec")


def read_manifest(data_dir: str | Path) -> dict:
    """DIR/manifest.json, its own sha256 checked (so an edit is caught before any shard is blamed), then
    field by field; JSONFileError naming the file and what to do."""
    path = Path(data_dir) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"no manifest.json in {path.parent}: prepare it with `python data.py --preset ... "
                                f"--out-dir {path.parent}`")
    try:
        m = read_json(path, MANIFEST_KEYS)
        _check_manifest(m)
    except JSONFileError as e:
        raise JSONFileError(f"{e}; rebuild the dataset with `python data.py --force ...`") from None
    return m


def _check_manifest(m: dict) -> None:
    """The manifest's fields agree with each other (a hand-edited, re-hashed manifest is still refused)."""
    def bad(why):
        raise JSONFileError(f"manifest.json: {why}")
    v, eot, files = m["vocab_size"], m["eot_id"], m["files"]
    if not (isinstance(v, int) and v >= 2 and isinstance(eot, int) and 0 <= eot < v):
        bad(f"eot_id {eot!r} must be an int in [0, vocab_size={v!r})")
    if m["dtype"] != ("uint16" if v <= 1 << 16 else "uint32"):
        bad(f"dtype {m['dtype']!r} does not fit vocab_size {v}")
    if not isinstance(m["sources"], dict) or any(r.get("status") not in ("ok", "skipped") or not r.get("domain")
                                                 for r in m["sources"].values()):
        bad("every source needs a domain and status 'ok' or 'skipped'")
    ok = [n for n, r in m["sources"].items() if r["status"] == "ok"]
    if sorted({m["sources"][n]["domain"] for n in ok}) != sorted(m["domains_present"]):
        bad(f"domains_present {m['domains_present']} differs from the domains of its present sources")
    need = ["train.bin", "train_docs.npy"] + [f"val/{n}{x}" for n in ok for x in (".bin", ".docs.npy")]
    missing = [f for f in need if f not in files]
    if missing:
        bad(f"files lacks {missing}")
    empty = [f for f in need if f.endswith(".bin") and not files[f].get("bytes")]
    if empty or not m["train_tokens"]:
        bad(f"{empty or ['train.bin']} empty (an empty corpus): nothing to train or validate on")


def verify(data_dir: str | Path, manifest: dict | None = None) -> dict:
    """Check every file listed in manifest.json against its sha256; returns the manifest."""
    d = Path(data_dir)
    manifest = manifest if manifest is not None else read_manifest(d)
    for rel, meta in manifest["files"].items():
        p = d / rel
        if not p.exists() or p.stat().st_size != meta["bytes"] or sha256_of(p) != meta["sha256"]:
            raise CorruptDataError(f"{p} is missing or corrupt (sha256 differs from manifest.json); "
                                   f"re-run prepare with force=True (`python data.py --force ...`)")
    return manifest


def prepare(preset: str, out_dir: str | None = None, vocab_size: int | None = None, force: bool = False,
            cache_dir: str | None = None) -> dict:
    """Build (or reuse) the preset's dataset in out_dir; returns its manifest."""
    cfg = configs.data_preset(preset)
    vocab = vocab_size or cfg.vocab_size
    out = Path(out_dir or default_data_dir(preset, vocab))
    cache = Path(cache_dir) if cache_dir else cache_root()
    sources = [s for s in corpus.SOURCES if not cfg.offline or s.packages[0] in ("stdlib", "generated")]
    spec = {"format_version": FORMAT_VERSION, "preset": preset, **asdict(cfg), "vocab_size": vocab,
            "max_doc_chars": corpus.MAX_DOC_CHARS, "sources": [asdict(s) for s in sources]}
    spec = json.loads(json.dumps(spec))  # as it reads back from manifest.json (tuples -> lists)
    cached = None if force else _cached(out, spec)
    if cached is not None:
        return cached
    itemsize = 2 if vocab <= 1 << 16 else 4   # the shards: every domain's tokens once, plus their index
    check_out_dir(out, 2 * itemsize * cfg.tokens_per_domain * len({s.domain for s in sources}), "data dir")
    t0 = time.time()
    (out / "manifest.json").unlink(missing_ok=True)  # the manifest is written last: no manifest, no dataset
    shutil.rmtree(out / "val", ignore_errors=True)
    enc = get_tokenizer(vocab, str(cache))
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    fetcher = corpus.Fetcher(cache, sources)
    report: dict[str, dict] = {}
    train: list[tuple[int, np.ndarray]] = []  # (source index, document tokens)
    remaining = {d: cfg.tokens_per_domain for d in dict.fromkeys(s.domain for s in sources)}
    available: dict[int, tuple[list[corpus.Doc], dict]] = {}
    for k, src in enumerate(sources):  # first fetch everything, so a missing source's budget is shared out
        try:
            available[k] = corpus.source_docs(src, fetcher)
        except corpus.SourceUnavailable as e:
            print(f"skip {src.domain}/{src.name}: {e}", flush=True)
            report[src.name] = {"domain": src.domain, "status": "skipped", "reason": str(e)}
    for k, (docs, info) in available.items():
        src, t1 = sources[k], time.time()
        left = sum(sources[i].domain == src.domain for i in available if i >= k)
        val, kept, n_tokens, n_bytes = _split_source(src.name, docs, remaining[src.domain] // left, enc, dtype,
                                                     cfg.val_tokens_per_source)
        train += [(k, doc) for doc in kept]
        if not val or not kept:
            print(f"[{k + 1}/{len(sources)}] skip {src.domain}/{src.name}: too few documents ({len(docs)})")
            report[src.name] = {"domain": src.domain, "status": "skipped", "reason": "too few documents"}
            continue
        remaining[src.domain] -= n_tokens
        atomic_write_bytes(out / "val" / f"{src.name}.bin", np.concatenate(val).tobytes())
        atomic_write_bytes(out / "val" / f"{src.name}.docs.npy", _npy(np.cumsum([0] + [len(p) for p in val[:-1]])))
        n_val_tokens, n_train = sum(len(v) for v in val), len(kept)
        report[src.name] = {"domain": src.domain, "status": "ok", **info, "documents_available": len(docs),
                            "train_docs": n_train, "val_docs": len(val), "train_tokens": n_tokens - n_val_tokens,
                            "val_tokens": n_val_tokens, "text_bytes": n_bytes,
                            "bytes_per_token": round(n_bytes / max(n_tokens - n_train - len(val), 1), 3)}  # EOT excluded
        print(f"[{k + 1}/{len(sources)}] {src.domain}/{src.name}: {len(val)} val + {n_train} train docs, "
              f"{n_tokens:,} tokens, {report[src.name]['bytes_per_token']} B/tok ({time.time() - t1:.1f}s)", flush=True)
    if not train:
        raise RuntimeError("no source could be read: see the skip messages above")
    return _write_dataset(out, preset, vocab, enc.eot_token, dtype, sources, report, train, spec, t0)


def _cached(out: Path, spec: dict) -> dict | None:
    """The manifest of a valid dataset already in `out` built from this spec, else None."""
    if not (out / "manifest.json").exists():
        return None
    try:
        manifest = read_manifest(out)
    except JSONFileError as e:   # a damaged or old manifest: the dataset is rebuilt
        print(f"{e}\nrebuilding {out}")
        manifest = {}
    if manifest.get("spec") == spec:
        try:
            verify(out, manifest)
            print(f"{out}: cached dataset is valid, nothing to do (force=True rebuilds it)")
            return manifest
        except CorruptDataError as e:
            print(f"{e}\nrebuilding {out}")
    return None


def _split_source(name: str, docs: list[corpus.Doc], budget: int, enc: tiktoken.Encoding, dtype,
                  val_cap: int) -> tuple[list[np.ndarray], list[np.ndarray], int, int]:
    """Tokenise a source's documents in a seeded order until `budget` tokens: (val, train, tokens, text bytes).

    Every 10th document is held out, with all its parts (corpus.clean splits a long one), while the held-out
    tokens are below val_cap; parts of a held-out document past the cap are dropped, never trained on.
    """
    eot = enc.eot_token
    val: list[np.ndarray] = []
    train: list[np.ndarray] = []
    n_val_tokens = n_tokens = n_bytes = 0
    for j, i in enumerate(np.random.default_rng(_seed(name)).permutation(len(docs))):
        if n_tokens >= budget and train:
            break                     # lazily: documents past the budget are never read
        held = j % 10 == 0 and n_val_tokens < val_cap
        for text in corpus.clean(docs[i]()):
            full = n_val_tokens >= val_cap if held else (n_tokens >= budget and bool(train))
            if full:   # held out: the rest is dropped, never trained on; training: the budget is reached
                break
            part = np.array([eot] + enc.encode_ordinary(text), dtype=dtype)
            n_tokens += len(part)
            n_bytes += len(text.encode())
            (val if held else train).append(part)
            n_val_tokens += len(part) if held else 0
    return val, train, n_tokens, n_bytes


def _write_dataset(out: Path, preset: str, vocab: int, eot: int, dtype, sources: list[corpus.Source],
                   report: dict[str, dict], train: list[tuple[int, np.ndarray]], spec: dict, t0: float) -> dict:
    """Write the interleaved train stream, its document index and (last) manifest.json; returns the manifest."""
    order = np.random.default_rng(_seed(preset)).permutation(len(train))  # interleave documents of all sources
    stream = np.concatenate([train[i][1] for i in order])
    starts = np.cumsum([0] + [len(train[i][1]) for i in order[:-1]])
    atomic_write_bytes(out / "train.bin", stream.tobytes())
    atomic_write_bytes(out / "train_docs.npy", _npy(np.stack([starts, [train[i][0] for i in order]], 1)))
    ok = {n: r for n, r in report.items() if r["status"] == "ok"}
    domains = sorted({r["domain"] for r in ok.values()})
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.suffix in (".bin", ".npy")
                   and (p.parent == out or p.name.split(".")[0] in ok))
    per_domain = {d: sum(r["train_tokens"] + r["val_tokens"] for r in ok.values() if r["domain"] == d) for d in domains}
    bytes_all = sum(r["text_bytes"] for r in ok.values())
    manifest = {
        "format_version": FORMAT_VERSION, "preset": preset, "vocab_size": vocab, "eot_id": eot,
        "dtype": np.dtype(dtype).name, "tokenizer": f"GPT-2 BPE, first {vocab - 1} ranks + <|endoftext|> = {eot}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "prepare_seconds": round(time.time() - t0, 1),
        "domains_present": domains, "domains_missing": sorted({s.domain for s in sources} - set(domains)),
        "tokens_per_domain": per_domain, "train_tokens": int(len(stream)),
        "bytes_per_token": round(bytes_all / max(sum(per_domain.values()) - sum(r["train_docs"] + r["val_docs"]
                                                                              for r in ok.values()), 1), 3),
        "sources": report, "files": {f: {"sha256": sha256_of(out / f), "bytes": (out / f).stat().st_size} for f in files},
        "spec": spec,
    }
    write_json(out / "manifest.json", manifest)
    print(f"{out}: {len(ok)}/{len(sources)} sources, domains {domains}, {sum(per_domain.values()):,} tokens, "
          f"{manifest['bytes_per_token']} B/tok, {manifest['prepare_seconds']}s")
    return manifest


def _npy(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(a, dtype=np.int64))
    return buf.getvalue()


# ----------------------------------------------------------------------------- offline packs
PACK_LIMIT = 64 << 20   # what travels with a working tree to a machine without network


def pack(preset: str, dest: str | Path, vocab_size: int | None = None) -> dict:
    """Copy everything a machine without network needs for `preset` into one folder (< 64 MiB).

    The folder is laid out as a cache root (`$LOOPED_MOE_CACHE`): data/<preset>-v<format>/ (the
    prepared dataset: manifest, token shards, validation sets) and, when the vocabulary needs
    them, tiktoken/ (GPT-2's BPE files under tiktoken's cache names), plus PACK.json listing
    every file with its sha256. `use_pack(dest)` (reproduce.py --data-dir) points the cache at
    it, so data.prepare finds the dataset ready and get_tokenizer its files: nothing is fetched.
    The dataset is prepared first (from the cache, or downloaded on this machine).
    """
    dest = Path(dest)
    check_out_dir(dest, 0, "pack dir")
    if any(dest.iterdir()) and not (dest / "PACK.json").exists():
        raise FileExistsError(f"{dest} is a non-empty folder without PACK.json: give a new or an existing pack folder")
    vocab = vocab_size or configs.data_preset(preset).vocab_size
    prepare(preset, vocab_size=vocab)
    root, src = cache_root(), Path(default_data_dir(preset, vocab))
    files = {src.relative_to(root) / "manifest.json": src / "manifest.json"}
    files |= {src.relative_to(root) / rel: src / rel for rel in read_manifest(src)["files"]}
    if needs_bpe_files(vocab):
        fetch_gpt2_files(root)
        files |= {Path("tiktoken") / p.name: p for p in gpt2_files(root / "tiktoken").values()}
    total = sum(p.stat().st_size for p in files.values())
    if total > PACK_LIMIT:
        raise ValueError(f"pack for preset {preset!r} would hold {total / 2**20:.1f} MiB, over the "
                         f"{PACK_LIMIT >> 20} MiB a machine without network can receive")
    (dest / "PACK.json").unlink(missing_ok=True)     # written last: no PACK.json, no pack
    shutil.rmtree(dest / "data", ignore_errors=True)
    shutil.rmtree(dest / "tiktoken", ignore_errors=True)
    for rel, p in files.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest / rel)
    info = {"format_version": FORMAT_VERSION, "preset": preset, "vocab_size": vocab,
            "dataset": src.relative_to(root).as_posix(), "bytes": total, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "files": {rel.as_posix(): {"sha256": sha256_of(dest / rel), "bytes": (dest / rel).stat().st_size}
                      for rel in sorted(files)}}
    write_json(dest / "PACK.json", info)
    print(f"{dest}: {len(files)} files, {total / 2**20:.1f} MiB (preset {preset}, vocab {vocab}); "
          f"use it with `python reproduce.py --preset ... --data-dir {dest}`")
    return info


def use_pack(pack_dir: str | Path, preset: str | None = None) -> Path:
    """Check a pack (every file against PACK.json) and make it this process's cache root.

    Sets $LOOPED_MOE_CACHE (child processes inherit it), so data.prepare(preset) reuses the
    packed dataset and get_tokenizer reads the packed BPE files. Returns the dataset directory.
    """
    d = Path(pack_dir).resolve()
    if not (d / "PACK.json").exists():
        raise FileNotFoundError(f"{d} is not a data pack (no PACK.json): build one with "
                                f"`python data.py --preset {preset or 'PRESET'} --pack {pack_dir}`")
    try:
        info = read_json(d / "PACK.json", ("format_version", "preset", "dataset", "files"))
    except JSONFileError as e:
        raise JSONFileError(f"{e}; build the pack again with `python data.py --preset {preset or 'PRESET'} "
                            f"--pack DIR`") from None
    if preset is not None and info["preset"] != preset:
        raise BadFileError(f"data pack {d} holds preset {info['preset']!r}, this run needs {preset!r}: "
                           f"build it with `python data.py --preset {preset} --pack DIR`")
    if info["format_version"] != FORMAT_VERSION:
        raise BadFileError(f"data pack {d} has format version {info['format_version']}, this code reads "
                           f"{FORMAT_VERSION}: rebuild it with `python data.py --preset {info['preset']} --pack DIR`")
    files = info["files"]
    if not (isinstance(files, dict) and all(isinstance(m, dict) and isinstance(m.get("bytes"), int) and
                                            isinstance(m.get("sha256"), str) for m in files.values())):
        raise BadFileError(f"{d / 'PACK.json'}: 'files' must map each path to its 'bytes' and 'sha256': copy the "
                           f"pack again")
    for rel, meta in files.items():
        p = d / rel
        if not p.exists() or p.stat().st_size != meta["bytes"] or sha256_of(p) != meta["sha256"]:
            raise CorruptDataError(f"{p} is missing or corrupt (sha256 differs from {d / 'PACK.json'}); copy the pack again")
    os.environ["LOOPED_MOE_CACHE"] = str(d)
    return d / info["dataset"]


# ----------------------------------------------------------------------------- reading batches
class TokenData:
    """A prepared dataset (hashes checked on open): deterministic training batches, per-source validation."""

    def __init__(self, data_dir: str | Path, verify_hashes: bool = True):
        self.dir = Path(data_dir)
        self.manifest = verify(self.dir) if verify_hashes else read_manifest(self.dir)
        m = self.manifest
        self.vocab_size: int = m["vocab_size"]
        self.eot: int = m["eot_id"]
        ok = {n: r for n, r in m["sources"].items() if r["status"] == "ok"}
        self.sources: list[str] = list(ok)
        self.domains: dict[str, str] = {n: r["domain"] for n, r in ok.items()}
        self.train = np.memmap(self.dir / "train.bin", dtype=m["dtype"], mode="r")
        self._val = {s: np.memmap(self.dir / "val" / f"{s}.bin", dtype=m["dtype"], mode="r") for s in self.sources}
        self._val_starts = {s: np.load(self.dir / "val" / f"{s}.docs.npy") for s in self.sources}
        self._order: dict[tuple, tuple[np.ndarray, int]] = {}  # last epoch's (permutation, shift), recomputable

    def tokenizer(self) -> tiktoken.Encoding:
        return get_tokenizer(self.vocab_size)

    def _batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T+1) token rows -> idx, targets, doc_ids (segment ids 0, 1, ... starting at each EOT)."""
        idx, targets = rows[:, :-1], rows[:, 1:]
        doc_ids = np.cumsum(idx == self.eot, axis=1)
        doc_ids -= doc_ids[:, :1]
        return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in (idx, targets, doc_ids))

    def _epoch(self, seed: int, epoch: int, n_ctx: int, block_size: int) -> tuple[np.ndarray, int]:
        key = (seed, epoch, n_ctx, block_size)
        if key not in self._order:
            rng = np.random.default_rng([seed, epoch])
            shift = int(rng.integers(block_size))  # a new phase each epoch: contexts start at shift + j*T
            self._order = {key: (rng.permutation(n_ctx), shift)}
        return self._order[key]

    def contexts_per_epoch(self, block_size: int) -> int:
        return (len(self.train) - block_size) // block_size

    def train_offsets(self, step: int, batch_size: int, block_size: int, seed: int = 0, rank: int = 0,
                      world_size: int = 1) -> np.ndarray:
        """Start positions in the train stream of this rank's rows of batch `step` (see train_batch)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        n_ctx = self.contexts_per_epoch(block_size)
        if n_ctx < 1:
            raise ValueError(f"train stream has {len(self.train)} tokens: too short for block_size={block_size}")
        g = step * batch_size * world_size + rank * batch_size + np.arange(batch_size)  # global row numbers
        epoch, slot = np.divmod(g, n_ctx)
        starts = np.empty(batch_size, dtype=np.int64)
        for e in np.unique(epoch):
            perm, shift = self._epoch(seed, int(e), n_ctx, block_size)
            starts[epoch == e] = shift + perm[slot[epoch == e]] * block_size
        return starts

    def train_batch(self, step: int, batch_size: int, block_size: int, seed: int = 0, rank: int = 0,
                    world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batch `step` for this rank: batch_size rows (per rank) of block_size tokens, int64 (B, T) each.

        A pure function of (seed, step) for a fixed global batch (world_size * batch_size) and
        block_size; rank r gets rows [r*B, (r+1)*B) of the global batch, so the ranks together see
        exactly what one process with batch_size * world_size sees.
        """
        starts = self.train_offsets(step, batch_size, block_size, seed, rank, world_size)
        return self._batch(np.stack([self.train[s:s + block_size + 1] for s in starts]))

    def val_doc_lengths(self, source: str) -> np.ndarray:
        """Token count (with its EOT) of every held-out document of a source, in stream order."""
        return np.diff(np.append(self._val_starts[source], len(self._val[source])))

    def val_slots(self, source: str, block_size: int, max_tokens: int | None = None) -> np.ndarray:
        """Which contexts val_batches reads: slot k covers tokens [k*T, (k+1)*T] of the held-out stream."""
        if source not in self._val:
            raise KeyError(f"unknown source {source!r}; present: {self.sources}")
        total = (len(self._val[source]) - 1) // block_size
        n_ctx = total if max_tokens is None else min(total, max(1, max_tokens // block_size))
        return (np.unique(np.linspace(0, total - 1, n_ctx).round().astype(np.int64)) if n_ctx < total
                else np.arange(total))

    def val_batches(self, source: str, batch_size: int, block_size: int, max_tokens: int | None = None,
                    doc_lengths: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
        """The source's fixed validation contexts (non-overlapping, in stream order): idx, targets, doc_ids.

        max_tokens below the source's held-out stream takes that many tokens' worth of contexts spread
        evenly over the whole stream (a systematic sample), not its first contexts: a source's first
        documents are not typical of it (measured: docs/data.md).
        With doc_lengths=True a fourth (B, T) tensor gives the length of each position's document,
        for bucketing loss by document length. A trailing partial context is dropped.
        """
        slots = self.val_slots(source, block_size, max_tokens)   # checks the source
        stream, T = self._val[source], block_size
        lengths = self.val_doc_lengths(source)
        for b in range(0, len(slots), batch_size):
            starts = slots[b:b + batch_size] * T
            batch = self._batch(np.stack([stream[s:s + T + 1] for s in starts]))
            if doc_lengths:
                doc = np.searchsorted(self._val_starts[source], starts[:, None] + np.arange(T), side="right") - 1
                batch = (*batch, torch.from_numpy(lengths[doc].astype(np.int64)))
            yield batch


# ----------------------------------------------------------------------------- a corpus-free stand-in
class SyntheticData:
    """Documents of Zipf-distributed tokens (learnable unigram statistics), no files.

    train_batch(step, batch_size, ...) is a pure function of (seed, step); batch_size is per rank
    and rank r gets rows [r*B, (r+1)*B) of the global batch, as in data.TokenData. The last token
    of each document has target -1 (ignored). Sources differ in their Zipf exponent.
    """

    def __init__(self, vocab_size: int = 256, mean_doc_len: int = 24, n_sources: int = 2):
        self.vocab_size, self.mean_doc_len = vocab_size, mean_doc_len
        self.sources = [f"synthetic{i}" for i in range(n_sources)]
        self.domains = {s: ("code", "prose")[i % 2] for i, s in enumerate(self.sources)}
        self.manifest = {"preset": "synthetic", "vocab_size": vocab_size}

    def _rows(self, gen: torch.Generator, n: int, T: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = 1.0 / torch.arange(1, self.vocab_size + 1, dtype=torch.float64) ** alpha
        tok = torch.multinomial(probs, n * (T + 1), replacement=True, generator=gen).view(n, T + 1)
        doc = (torch.rand(n, T, generator=gen) < 1.0 / self.mean_doc_len).long().cumsum(1)
        tgt = tok[:, 1:].clone()
        tgt[:, :-1][doc[:, 1:] != doc[:, :-1]] = -1
        return tok[:, :-1].contiguous(), tgt, doc - doc[:, :1]

    def train_batch(self, step: int, batch_size: int, block_size: int, seed: int = 0, rank: int = 0,
                    world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not (batch_size > 0 and block_size > 0):
            raise ValueError(f"SyntheticData.train_batch: batch_size and block_size must be > 0, got "
                             f"{batch_size} and {block_size}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        rows = self._rows(gen, batch_size * world_size, block_size, 1.1)
        return tuple(t[rank * batch_size:(rank + 1) * batch_size] for t in rows)

    def val_batches(self, source: str, batch_size: int, block_size: int,
                    max_tokens: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        i = self.sources.index(source)
        gen = torch.Generator().manual_seed(10**9 + i)
        n_ctx = max(1, (max_tokens or 4096) // block_size)
        idx, tgt, doc = self._rows(gen, n_ctx, block_size, 0.9 + 0.4 * i)
        for b in range(0, n_ctx, batch_size):
            yield idx[b:b + batch_size], tgt[b:b + batch_size], doc[b:b + batch_size]


# ----------------------------------------------------------------------------- measures
def effective_doc_length(doc_ids: torch.Tensor) -> float:
    """2 x (mean keys a token sees under a causal document mask) - 1: the document length L that
    budget.flops_per_token charges the same attention FLOPs for (exactly L for documents of length L)."""
    B, T = doc_ids.shape
    pos = torch.arange(T).expand(B, T)
    new = torch.ones(B, T, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(new, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return 2.0 * float((pos - start + 1).double().mean()) - 1.0


def unigram_entropy(data) -> float:
    """Entropy in nats of the unigram (token frequency) distribution of a TokenData's training stream.

    The floor a model reaches by learning token frequencies alone: a model whose validation loss is
    not well below it has learned nothing of context (the tiny corpus's figure: docs/data.md).
    """
    counts = train_token_counts(data)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def train_token_counts(data) -> np.ndarray:
    """(vocab_size,) float64 count of every token id in a TokenData's training stream."""
    return np.bincount(np.asarray(data.train), minlength=data.vocab_size).astype(np.float64)


def unigram_val_loss(data, block_size: int, max_tokens: int | None = None) -> float:
    """The validation loss (token-weighted over sources, exactly the tokens train.evaluate scores) of the
    unigram model fitted on the training stream: what a model that learned only token frequencies
    would score on this validation measure (add-one smoothing for ids the training stream lacks)."""
    counts = train_token_counts(data) + 1.0
    nll = -np.log(counts / counts.sum())
    sums = {}
    for src in data.sources:
        s, n = 0.0, 0
        for _, tgt, _ in data.val_batches(src, 64, block_size, max_tokens):
            t = tgt[tgt >= 0].numpy()
            s, n = s + float(nll[t].sum()), n + int(t.size)
        sums[src] = (s, n)
    return token_weighted(sums, data.domains)["loss"]


DOC_LENGTH_CONTEXTS = 256   # training contexts the document length is measured on (batch 0, seed 0)


def measured_doc_length(data, block_size: int, n_contexts: int = DOC_LENGTH_CONTEXTS) -> float:
    """The effective document length of `data`'s packed training contexts of `block_size` tokens.

    SMELT 3.2 measures FLOPs "at the document length": with segment masks a token attends only
    inside its document, so attention costs what documents of this length cost. Measured on one
    fixed sample (batch 0 of seed 0, `n_contexts` rows), so the ladder (budget.py), the main job and
    every run's results rows (train.py) use the same number for the same data and block size,
    whatever a run's own seed or batch size.
    """
    return effective_doc_length(data.train_batch(0, n_contexts, block_size, seed=0)[2])


def token_weighted(sums: dict[str, tuple[float, int]], domains: dict[str, str]) -> dict:
    """Validation loss from per-source (summed loss, target tokens), weighted by tokens.

    The one aggregation train.evaluate and eval.val_loss_report share. Returns {"loss",
    "tokens", "by_source", "by_domain"}; a source with no tokens is left out of every mean
    (no NaN entries in results), and "loss" is NaN only when no source had a token.
    """
    missing = sorted(set(sums) - set(domains))
    if missing:
        raise ValueError(f"token_weighted: sources {missing} have no domain in the dataset's manifest")
    counted = {s: (float(l), int(n)) for s, (l, n) in sums.items() if n}
    by_domain: dict[str, list] = {}
    for s, (l, n) in counted.items():
        acc = by_domain.setdefault(domains[s], [0.0, 0])
        acc[0] += l
        acc[1] += n
    total_l, total_n = sum(l for l, _ in counted.values()), sum(n for _, n in counted.values())
    return {"loss": total_l / total_n if total_n else float("nan"), "tokens": total_n,
            "by_source": {s: l / n for s, (l, n) in counted.items()},
            "by_domain": {d: l / n for d, (l, n) in by_domain.items()}}


def measure_bytes_per_token(data_dir: str, vocab_sizes: list[int]) -> dict[str, dict[int, float]]:
    """Bytes per token of each domain's validation text under several truncated GPT-2 vocabularies."""
    data = TokenData(data_dir)
    enc = get_tokenizer(data.vocab_size)
    texts: dict[str, list[str]] = {}
    for s in data.sources:
        stream, starts = data._val[s], data._val_starts[s]
        ends = np.append(starts[1:], len(stream))
        texts.setdefault(data.domains[s], []).extend(enc.decode(stream[a + 1:b].tolist()) for a, b in zip(starts, ends))
    texts["all"] = [t for d in list(texts) for t in texts[d]]
    out: dict[str, dict[int, float]] = {d: {} for d in texts}
    for v in vocab_sizes:
        tok = get_tokenizer(v)
        for d, ts in texts.items():
            out[d][v] = round(sum(len(t.encode()) for t in ts) / sum(len(x) for x in tok.encode_ordinary_batch(ts)), 3)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = cli.parser("Prepare the offline corpus (see the module docstring).")
    ap.add_argument("--preset", choices=sorted(configs.DATA_PRESETS), default="tiny",
                    help="corpus size and vocabulary (the medium and paper reproductions use the small corpus)")
    cli.add_out_dir(ap, "output directory (default: <cache>/data/<preset>-v<format>)")
    ap.add_argument("--vocab-size", type=cli.int_range(257, GPT2_VOCAB), default=None,
                    help="truncated GPT-2 vocabulary (default: the preset's)")
    ap.add_argument("--force", action="store_true", help="rebuild even if a valid cached dataset exists")
    ap.add_argument("--measure", type=_vocab_list, default=[], help="after preparing, report bytes/token per "
                    "domain for these comma-separated vocab sizes, e.g. 4096,8192,16384,50257 (default: none)")
    ap.add_argument("--pack", default=None, metavar="DIR",
                    help="also copy the dataset and BPE files into DIR (one folder < 64 MiB) for a machine "
                         "without network: `python reproduce.py --data-dir DIR` reads it (default: no pack)")
    return ap


def _vocab_list(text: str) -> list[int]:
    """--measure: comma-separated vocabulary sizes, each in [257, 50257]."""
    check = cli.int_range(257, GPT2_VOCAB)
    return [check(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.pack and args.out_dir:   # a pack copies the cache's dataset, never --out-dir's
        ap.error("--pack copies the preset's dataset from the cache: it cannot be combined with --out-dir")
    manifest = prepare(args.preset, args.out_dir, args.vocab_size, args.force)
    for domain, n in manifest["tokens_per_domain"].items():
        print(f"  {domain:10s} {n:>11,} tokens")
    if args.measure:
        out = args.out_dir or default_data_dir(args.preset, args.vocab_size)
        for domain, row in measure_bytes_per_token(out, args.measure).items():
            print(f"  {domain:10s} bytes/token " + "  ".join(f"{v}: {b}" for v, b in row.items()))
    if args.pack:
        pack(args.preset, args.pack, args.vocab_size)


if __name__ == "__main__":
    cli.run_main(main)
