"""Render the teaching notebooks with their outputs, so a reader sees every figure without running anything.

  python scripts/render_notebooks.py                 # all of them (about 2 minutes on 2 CPU cores)
  python scripts/render_notebooks.py 02_moe_routing_and_grouped_mm   # one
  python scripts/render_notebooks.py --check         # stale or missing copies, and why (nothing runs; exit 1 if any)

Each notebook (stored without outputs) runs in a fresh kernel (cwd notebooks/); its copy, figures at 60 dpi,
goes to notebooks/rendered/ with the sha256 of its cells and of the project modules it imports, which
--check compares with the files (the tests do not: a stale copy blocks no edit). Re-render a copy when
the numbers or figures it shows change.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import checks  # noqa: E402

NB_DIR = ROOT / "notebooks"
RENDERED = NB_DIR / "rendered"
CELL_TIMEOUT_S = 300
DPI = 60
KEY = "looped_moe"   # the rendered copy's metadata entry


def source_sha256(nb) -> str:
    """sha256 of what a notebook says: its cells' types and sources, in order (outputs and metadata ignored)."""
    cells = [[c["cell_type"], c["source"]] for c in nb["cells"]]   # nbformat.read joins each source into a str
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()


def modules_sha256(nb) -> dict:
    """{PATH.py: sha256} of the project's modules (root and lab/) the notebook's code cells import directly
    (what it shows moves with them; modules those import are not followed)."""
    import ast
    names = set()
    for c in (c for c in nb["cells"] if c["cell_type"] == "code"):
        try:
            tree = ast.parse("\n".join(ln for ln in c["source"].splitlines() if not ln.lstrip().startswith(("%", "!"))))
        except SyntaxError:
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                names |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                names |= {f"{n.module}.{a.name}" for a in n.names} | {n.module}   # `from lab import x`: lab/x.py
    paths = {m.replace(".", "/") + ".py" for m in names}
    return {f: checks.sha256_of(ROOT / f) for f in sorted(paths) if (ROOT / f).is_file()}


def stale(path: Path, out_dir: Path = RENDERED) -> str | None:
    """Why NAME.ipynb's rendered copy is out of date (the notebook or a module it imports changed), or None."""
    import nbformat
    copy = out_dir / path.name
    if not copy.is_file():
        return f"{copy.relative_to(ROOT) if copy.is_relative_to(ROOT) else copy} is missing"
    src, meta = nbformat.read(str(path), as_version=4), nbformat.read(str(copy), as_version=4).metadata.get(KEY, {})
    if meta.get("source_sha256") != source_sha256(src):
        return f"{copy.name} was rendered from another version of {path.name}"
    old, new = meta.get("modules_sha256"), modules_sha256(src)
    changed = sorted(m for m in new if (old or {}).get(m) != new[m])
    return f"{copy.name} was rendered before a change to {', '.join(changed)}" if changed else None


def render(path: Path, out_dir: Path = RENDERED) -> Path:
    """Execute notebooks/NAME.ipynb in a fresh kernel and write the copy with its outputs to out_dir/NAME.ipynb."""
    import matplotlib
    import nbclient
    import nbformat
    import torch
    nb = nbformat.read(str(path), as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        rc = Path(tmp) / "matplotlibrc"
        rc.write_text(f"figure.dpi: {DPI}\nsavefig.dpi: {DPI}\n")
        env = {"MATPLOTLIBRC": str(rc), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        with mock.patch.dict(os.environ, env):   # the kernel inherits this process's environment
            nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False,
                                    record_timing=False, resources={"metadata": {"path": str(NB_DIR)}}).execute()
    nb.metadata[KEY] = {
        "source": f"notebooks/{path.name}", "source_sha256": source_sha256(nb), "modules_sha256": modules_sha256(nb),
        "rendered_by": "python scripts/render_notebooks.py",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "matplotlib": matplotlib.__version__}}
    text = nbformat.writes(nb)   # written as nbformat.write would: with a final newline
    checks.atomic_write_bytes(out_dir / path.name, (text if text.endswith("\n") else text + "\n").encode())
    return out_dir / path.name


def build_parser():
    ap = checks.parser(__doc__)
    ap.add_argument("names", nargs="*", metavar="NOTEBOOK",
                    help="notebooks to render, by file name or stem (default: every notebooks/*.ipynb)")
    checks.add_out_dir(ap, "where the rendered copies go", default=str(RENDERED.relative_to(ROOT)))
    ap.add_argument("--check", action="store_true",
                    help="execute nothing: list the copies that are missing or stale and why, exit 1 if any")
    return ap


def main(argv=None) -> list[Path]:
    ap = build_parser()
    args = ap.parse_args(argv)
    out_dir = ROOT / args.out_dir   # an absolute --out-dir replaces ROOT
    every = sorted(NB_DIR.glob("*.ipynb"))
    by_name = {p.name: p for p in every} | {p.stem: p for p in every}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        ap.error(f"no notebook {unknown}; notebooks: {[p.stem for p in every]}")
    paths = [by_name[n] for n in args.names] or every
    if args.check:
        problems = [why for p in paths if (why := stale(p, out_dir))]
        if problems:
            print("\n".join(problems))
            raise SystemExit(f"{len(problems)} rendered notebook(s) out of date: if what they show changed, "
                             f"run python scripts/render_notebooks.py")
        print(f"all {len(paths)} rendered notebooks are current")
        return []
    import nbclient
    written, failed = [], []
    for p in paths:
        print(f"rendering {p.name} ...", flush=True)
        try:
            written.append(render(p, out_dir))
        except nbclient.exceptions.CellExecutionError as e:   # keep going: report every broken notebook
            failed.append(p.name)
            print(f"  FAILED, its copy is unchanged: {e.ename}: {e.evalue}", flush=True)
            continue
        print(f"  wrote {written[-1].relative_to(ROOT) if written[-1].is_relative_to(ROOT) else written[-1]} "
              f"({written[-1].stat().st_size / 1024:.0f} KiB)", flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} notebook(s) failed to run: {', '.join(failed)} "
                         f"(run them in Jupyter, or `python -m pytest tests/test_notebooks.py`, for the traceback)")
    return written


if __name__ == "__main__":
    checks.run_main(main)
