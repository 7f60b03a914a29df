"""Standard data (issue 54): public parquet datasets from the Hugging Face hub -> the corpus's shards and manifest.

`python -m lab.hub --dataset fineweb-edu [finemath codeparrot ...] --out-dir DIR [--tokens N] [--vocab-size V]`
downloads parquet shards of each dataset (a name in DATASETS, or REPO:PATTERN:COLUMN:DOMAIN[:REVISION]),
tokenises its documents with the project's tokenizer and writes what `data.TokenData(DIR)` reads, through
lab/corpus.py's own writer: each dataset one source and one domain (so the per-domain analysis reports it),
every 10th document held out for validation (whole documents, up to --val-tokens per dataset), the training
documents interleaved into train.bin, manifest.json (hashed) written last. --tokens is shared equally.
Needs the optional extra: `pip install -r requirements-hub.txt` (huggingface_hub, pyarrow).

Resumable: a parquet file already in --download-dir is not downloaded again (hf_hub_download's local_dir
check); each batch of BATCH_ROWS rows is tokenised once into DIR/parts/ (removed when the manifest is
written), so an interrupted build resumes at the first batch it had not finished; a valid DIR built from
the same datasets, files, budget and vocabulary is left as it is (--force rebuilds it).
The two calls in `_hub_fetcher` are the only lines that touch the network and the only ones the tests do
not run: tests/test_hub.py builds from parquet files it writes (`build(..., files=...)`), the same path.
Notes and the datasets' terms: docs/data.md ("Standard data from the hub").
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import itertools
import json
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

import checks
from checks import UserError, atomic_write_bytes
from data import FORMAT_VERSION, GPT2_VOCAB, CorruptDataError, cache_root, get_tokenizer, read_manifest, verify
from lab import corpus

BATCH_ROWS = 2048  # rows tokenised, and cached in DIR/parts, at a time: the unit an interrupted build resumes at


class HubError(UserError, ValueError):
    """A bad dataset name or spec, a missing column or extra: one line naming it."""


@dataclass(frozen=True)
class HubDataset:
    repo: str              # the hub dataset's repo id
    pattern: str           # its parquet files, an fnmatch pattern over the repo's paths (read in sorted order)
    column: str            # the text column
    domain: str            # the domain the per-domain analysis reports it under
    revision: str = "main"  # branch or commit; the hub's own parquet conversion lives on refs/convert/parquet
    licence: str = "see the dataset card"


# Checked against the hub's file listings and dataset cards (docs/data.md); each file holds 1e5-1e6 documents.
DATASETS = {
    "fineweb-edu": HubDataset("HuggingFaceFW/fineweb-edu", "sample/10BT/*.parquet", "text", "web",
                              licence="ODC-By 1.0 (and CommonCrawl's terms of use)"),
    "finemath": HubDataset("HuggingFaceTB/finemath", "finemath-4plus/*.parquet", "text", "math",
                           licence="ODC-By 1.0 (and CommonCrawl's terms of use)"),
    "codeparrot": HubDataset("codeparrot/codeparrot-clean-valid", "default/train/*.parquet", "content", "code",
                             revision="refs/convert/parquet", licence="each file's own (its `license` column)"),
}
_NAME = re.compile(r"[A-Za-z0-9_-]+")  # source names become file names; no dot (the manifest splits at one)


def parse_dataset(text: str) -> tuple[str, HubDataset]:
    """A DATASETS name, or [NAME=]REPO:PATTERN:COLUMN:DOMAIN[:REVISION] -> (source name, dataset)."""
    if text in DATASETS:
        return text, DATASETS[text]
    name, _, spec = text.partition("=") if "=" in text.split(":")[0] else ("", "", text)
    fields = spec.split(":")
    if len(fields) not in (4, 5) or not all(fields):
        raise HubError(f"dataset {text!r} is neither one of {sorted(DATASETS)} nor "
                       f"[NAME=]REPO:PATTERN:COLUMN:DOMAIN[:REVISION], e.g. HuggingFaceTB/finemath:finemath-3plus/*.parquet:text:math")
    name = name or fields[0].rsplit("/", 1)[-1].lower()
    if not _NAME.fullmatch(name) or not _NAME.fullmatch(fields[3]):
        raise HubError(f"dataset {text!r}: its name {name!r} and domain {fields[3]!r} may hold only letters, "
                       f"digits, '-' and '_' (give NAME=... for another name)")
    return name, HubDataset(*fields)


def _require(*modules: str) -> list:
    """The optional extra's modules, imported only when used; a missing one ends in one line naming the extra."""
    import importlib
    try:
        return [importlib.import_module(m) for m in modules]
    except ImportError as e:
        raise HubError(f"lab.hub needs the optional extra: pip install -r requirements-hub.txt "
                       f"(missing: {e.name})") from None


Fetch = Callable[[int], "tuple[Path, str] | None"]  # file i of a dataset -> (local parquet path, its name), None past the last


def _hub_fetcher(ds: HubDataset, download_dir: Path) -> Fetch:
    """Fetch from the hub: the file listing once, then each parquet file as it is needed (kept in download_dir)."""
    hf, = _require("huggingface_hub")
    names: list[str] = []

    def fetch(i: int):
        if not names:   # the network, 1 of 2: which files the pattern names
            names.extend(sorted(f for f in hf.list_repo_files(ds.repo, repo_type="dataset", revision=ds.revision)
                                if fnmatch.fnmatch(f, ds.pattern)))
            if not names:
                raise HubError(f"no file of {ds.repo}@{ds.revision} matches {ds.pattern!r}: fix the dataset's PATTERN")
        if i >= len(names):
            return None
        local = download_dir / ds.repo / re.sub(r"[^\w.-]+", "-", ds.revision)   # the network, 2 of 2 (skipped when there)
        return Path(hf.hf_hub_download(ds.repo, names[i], repo_type="dataset", revision=ds.revision,
                                       local_dir=local)), names[i]
    return fetch


def _local_fetcher(paths: list) -> Fetch:
    """Fetch from parquet files already on disk (the tests; files downloaded by other means)."""
    paths = [Path(p) for p in paths]
    return lambda i: (paths[i], paths[i].name) if i < len(paths) else None


def _tokenize(texts: list, enc, dtype) -> dict:
    """One batch of rows -> its pieces ([EOT] + tokens of each corpus.clean part), their document and bytes."""
    docs = [corpus.clean(t) if isinstance(t, str) else [] for t in texts]   # a null row is no document
    flat = [p for parts in docs for p in parts]
    toks = enc.encode_ordinary_batch(flat) if flat else []
    return {"tokens": np.concatenate([np.array([enc.eot_token] + t, dtype=dtype) for t in toks]) if flat
            else np.zeros(0, dtype), "lengths": np.array([len(t) + 1 for t in toks], dtype=np.int64),
            "doc": np.array([d for d, parts in enumerate(docs) for _ in parts], dtype=np.int64),
            "bytes": np.array([len(p.encode()) for p in flat], dtype=np.int64), "rows": np.int64(len(texts))}


def _save(path: Path, part: dict) -> None:
    buf = io.BytesIO()
    np.savez(buf, **part)
    atomic_write_bytes(path, buf.getvalue())   # atomic: a part on disk is always whole


def _parts(name: str, ds: HubDataset, fetch: Fetch, parts_dir: Path, enc, dtype) -> Iterator[dict]:
    """Every batch of the dataset's rows, tokenised, in file order: read from parts_dir when done before."""
    for i in itertools.count():
        batches = None   # the file's batches, opened only when a part is missing
        for k in itertools.count():
            path = parts_dir / f"{i:05d}-{k:05d}.npz"
            if path.exists():
                with np.load(path) as z:
                    part = {key: z[key] for key in z.files}
            else:
                if batches is None:
                    got = fetch(i)
                    if got is None:
                        return
                    batches = _batches(name, ds, *got)
                    for _ in range(k):   # the parts already done: skipped (decoded, not tokenised)
                        next(batches)
                texts, file, last = next(batches)
                part = {**_tokenize(texts, enc, dtype), "parquet": np.array(file), "last": np.array(last)}
                _save(path, part)
            yield part
            if part["last"]:
                break


def _batches(name: str, ds: HubDataset, path: Path, file: str) -> Iterator[tuple[list, str, bool]]:
    """(texts, file name, is the file's last batch) for each BATCH_ROWS rows of one parquet file."""
    pq, = _require("pyarrow.parquet")
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if ds.column not in names:
        raise HubError(f"{file}: dataset {name!r} has no column {ds.column!r} (its columns: {', '.join(names)}): "
                       f"fix the dataset's COLUMN")
    kind = pf.schema_arrow.field(ds.column).type
    if str(kind) not in ("string", "large_string", "string_view"):
        raise HubError(f"{file}: column {ds.column!r} of dataset {name!r} holds {kind}, not text: fix the dataset's COLUMN")
    it = pf.iter_batches(batch_size=BATCH_ROWS, columns=[ds.column])
    nxt = next(it, None)
    if nxt is None:
        yield [], file, True   # an empty file: one empty part
    while nxt is not None:   # one batch ahead, so the last one is known as the last
        cur, nxt = nxt, next(it, None)
        yield cur.column(0).to_pylist(), file, nxt is None


def _take(name: str, parts: Iterator[dict], budget: int, val_cap: int, bar) -> tuple[list, list, dict]:
    """Documents in file order until `budget` tokens (validation included): every 10th held out, with all its
    pieces, while the held-out tokens are below val_cap (as corpus._split_source); -> val, train, counts."""
    val, train, files = [], [], []
    n = {"tokens": 0, "val_tokens": 0, "bytes": 0, "val_docs": 0, "train_docs": 0, "rows": 0}
    j = -1
    for part in parts:
        n["rows"] += int(part["rows"])
        files += [str(part["parquet"])] if not files or files[-1] != str(part["parquet"]) else []
        ends, doc = np.cumsum(part["lengths"]), part["doc"]
        firsts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]]) if len(doc) else doc   # each document's first piece
        for a, b in zip(firsts, [*firsts[1:], len(doc)]):
            if n["tokens"] >= budget and train:
                return val, train, {**n, "files": files}
            j += 1
            held = j % 10 == 0 and n["val_tokens"] < val_cap
            n["val_docs" if held else "train_docs"] += 1
            for p in range(a, b):
                if (n["val_tokens"] >= val_cap) if held else (n["tokens"] >= budget and train):
                    break   # held out: the rest is dropped, never trained on; training: the budget is reached
                piece = part["tokens"][ends[p] - part["lengths"][p]:ends[p]]
                (val if held else train).append(piece)
                n["tokens"] += len(piece)
                n["val_tokens"] += len(piece) if held else 0
                n["bytes"] += int(part["bytes"][p])
                bar.update(len(piece))
    print(f"{name}: every file read, {n['tokens']:,} of the {budget:,} tokens asked for", flush=True)
    return val, train, {**n, "files": files}


def _valid(out: Path, spec: dict) -> dict | None:
    """The manifest of a valid dataset in `out` built from this spec, else None (then it is rebuilt)."""
    if not (out / "manifest.json").exists():
        return None
    try:
        manifest = read_manifest(out)
        if manifest.get("spec") == spec:
            verify(out, manifest)
            print(f"{out}: already built from these datasets, nothing to do (--force rebuilds it)")
            return manifest
    except (checks.JSONFileError, CorruptDataError) as e:
        print(f"{e}\nrebuilding {out}")
    return None


def build(out: str | Path, datasets: list[str], tokens: int = 20_000_000, vocab_size: int = 16384,
          val_tokens: int = 32_768, files: dict[str, list] | None = None, download_dir: str | Path | None = None,
          force: bool = False) -> dict:
    """Build (or reuse) a TokenData directory `out` from hub datasets (names or specs, see parse_dataset);
    files={name: [parquet paths]} reads local files instead of downloading. Returns the manifest."""
    named = dict(parse_dataset(d) for d in datasets)
    if len(named) != len(datasets) or not named:
        raise HubError(f"datasets {datasets}: give at least one, each once")
    if files is not None and set(files) != set(named):
        raise HubError(f"files= must name the parquet files of exactly the datasets {sorted(named)}; got {sorted(files)}")
    if not (257 <= vocab_size <= GPT2_VOCAB and tokens >= 2 * len(named) and val_tokens >= 1):
        raise HubError(f"vocab_size {vocab_size} must lie in [257, {GPT2_VOCAB}], tokens {tokens} be at least 2 per "
                       f"dataset and val_tokens {val_tokens} at least 1")
    _require("pyarrow.parquet")
    out = Path(out)
    preset = "hub:" + "+".join(named)
    spec = json.loads(json.dumps({
        "format_version": FORMAT_VERSION, "preset": preset, "builder": "lab.hub", "tokens": tokens,
        "vocab_size": vocab_size, "val_tokens_per_source": val_tokens, "max_doc_chars": corpus.MAX_DOC_CHARS,
        "batch_rows": BATCH_ROWS, "datasets": {n: asdict(ds) for n, ds in named.items()},
        "local_files": {n: [Path(p).name for p in ps] for n, ps in files.items()} if files is not None else None}))
    if not force and (cached := _valid(out, spec)) is not None:
        return cached
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    checks.check_out_dir(out, 2 * 2 * np.dtype(dtype).itemsize * tokens, "data dir")   # shards + parts
    t0 = time.time()
    (out / "manifest.json").unlink(missing_ok=True)   # the manifest is written last: no manifest, no dataset
    shutil.rmtree(out / "val", ignore_errors=True)
    if force:
        shutil.rmtree(out / "parts", ignore_errors=True)
    enc = get_tokenizer(vocab_size)
    download_dir = Path(download_dir) if download_dir else cache_root() / "hub"
    report, train, budget = {}, [], tokens // len(named)
    for k, (name, ds) in enumerate(named.items()):
        key = hashlib.sha256(json.dumps([asdict(ds), vocab_size, corpus.MAX_DOC_CHARS, BATCH_ROWS,
                                         spec["local_files"]]).encode()).hexdigest()[:12]
        fetch = _local_fetcher(files[name]) if files is not None else _hub_fetcher(ds, download_dir)
        with tqdm(total=budget, unit="tok", unit_scale=True, desc=f"{name} ({ds.domain})") as bar:
            val, kept, n = _take(name, _parts(name, ds, fetch, out / "parts" / f"{name}-{key}", enc, dtype),
                                 budget, val_tokens, bar)
        if not val or not kept:
            raise HubError(f"dataset {name!r} gave {n['val_docs']} validation and {n['train_docs']} training "
                           f"documents: it needs at least one of each (more files, or another PATTERN)")
        corpus.write_val(out, name, val)
        train += [(k, doc) for doc in kept]
        fs = n["files"]
        report[name] = {"domain": ds.domain, "status": "ok", "origin": f"huggingface:{ds.repo} {ds.pattern}",
                        "licence": ds.licence, "version": f"{ds.revision}: {fs[0]}" + (f" .. {fs[-1]}" if len(fs) > 1 else ""),
                        "files_read": fs, "rows_read": n["rows"], "train_docs": n["train_docs"],
                        "val_docs": n["val_docs"], "train_tokens": n["tokens"] - n["val_tokens"],
                        "val_tokens": n["val_tokens"], "text_bytes": n["bytes"],
                        "bytes_per_token": round(n["bytes"] / max(n["tokens"] - len(val) - len(kept), 1), 3)}
    manifest = corpus.write_dataset(out, preset, vocab_size, enc.eot_token, dtype, list(named.values()), report,
                                    train, spec, t0)
    shutil.rmtree(out / "parts", ignore_errors=True)   # the dataset is whole: the resume cache goes
    return manifest


def _dataset_arg(text: str) -> str:
    try:
        parse_dataset(text)
    except HubError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = checks.parser(__doc__)
    table = "; ".join(f"{n} = {d.repo}{'' if d.revision == 'main' else '@' + d.revision} {d.pattern} column "
                      f"{d.column!r}, domain {d.domain}" for n, d in DATASETS.items())
    ap.add_argument("--dataset", nargs="+", type=_dataset_arg, default=["fineweb-edu"], metavar="NAME|SPEC",
                    help=f"datasets, each one source and domain: a name ({table}) or "
                         "[NAME=]REPO:PATTERN:COLUMN:DOMAIN[:REVISION] (default: fineweb-edu)")
    checks.add_out_dir(ap, "the dataset directory to write, what data.TokenData(DIR) and train.py --data-dir read "
                           "(no default: give one)")
    ap.add_argument("--out", dest="out_dir", help=argparse.SUPPRESS)   # the same, as issue 54 spells it
    ap.add_argument("--tokens", type=checks.positive_int, default=20_000_000,
                    help="train + validation tokens in all, shared equally by the datasets (default: 20M)")
    ap.add_argument("--vocab-size", type=checks.int_range(257, GPT2_VOCAB), default=16384,
                    help="truncated GPT-2 vocabulary (default: 16384, the small preset's)")
    ap.add_argument("--val-tokens", type=checks.positive_int, default=32_768,
                    help="held-out tokens per dataset, whole documents (default: 32768, the small preset's)")
    ap.add_argument("--download-dir", default=None, metavar="DIR",
                    help="where the parquet files are kept (default: <cache>/hub)")
    ap.add_argument("--force", action="store_true", help="rebuild even if DIR holds this dataset already")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    a = ap.parse_args(argv)
    if not a.out_dir:
        ap.error("--out-dir DIR is required: the dataset directory to write")
    m = build(a.out_dir, a.dataset, a.tokens, a.vocab_size, a.val_tokens, download_dir=a.download_dir, force=a.force)
    for domain, n in m["tokens_per_domain"].items():
        print(f"  {domain:10s} {n:>11,} tokens")


if __name__ == "__main__":
    checks.run_main(main)
