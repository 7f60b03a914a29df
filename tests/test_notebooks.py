"""The teaching notebooks in notebooks/: each one executes without an error, each is stored clean,
and each has a current rendered copy with its figures in notebooks/rendered/.

Every notebook runs top to bottom in a fresh python3 kernel with cwd = notebooks/ (their first code
cell puts the repository root on sys.path), 180 s per cell at most. The notebooks use tiny shapes
and each takes well under a minute on a 2-core CPU; notebooks 04 and 06 train a smoke-size model
on `corpus.prepare("smoke")` (offline, cached under .cache/) in a scratch directory.

The rendered copies (scripts/render_notebooks.py) are checked without executing anything: each is a
copy of its notebook (its cells hash to what it recorded), every code cell ran, none failed, and each
shows at least one figure. A copy older than its notebook or the modules it imports is no failure
here (an edit is never blocked on a re-render): `python scripts/render_notebooks.py --check` lists them.

Skipped only when the notebook tooling (nbformat, nbclient, ipykernel) is not installed.
"""
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
RENDERED = NB_DIR / "rendered"
CELL_TIMEOUT_S = 180
RENDER = "python scripts/render_notebooks.py"
RENDERED_MAX_BYTES = 3 << 20   # all copies together: figures at 60 dpi keep them near 1 MB


def _tooling():
    """(nbformat, nbclient) or a skip naming what is missing."""
    missing = []
    mods = {}
    for name in ("nbformat", "nbclient", "ipykernel"):
        try:
            mods[name] = __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        pytest.skip(f"notebook tooling not installed: {', '.join(missing)} (pip install -r requirements-test.txt)")
    return mods["nbformat"], mods["nbclient"]


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert len(names) >= 7, names
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", n) for n in names), names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean(path):
    """No outputs or execution counts in the repository; the modules come from the repo root; no model code."""
    nbformat, _ = _tooling()
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "a notebook without code"
    for c in code:
        assert not c.outputs and c.execution_count is None, f"outputs not stripped in {path.name}"
    assert 'sys.path.insert(0, "..")' in code[0].source, "the first code cell must put the repo root on sys.path"
    for c in code:   # notebooks import the modules; they define no layers of their own
        assert not re.search(r"class\s+\w+\s*\([^)]*(nn\.)?Module\)", c.source), f"model code in {path.name}"
    assert any(c.cell_type == "markdown" for c in nb.cells)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path):
    nbformat, nbclient = _tooling()
    nb = nbformat.read(str(path), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False,
                                     resources={"metadata": {"path": str(NB_DIR)}})
    env = dict(os.environ)
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
    finally:   # older ipykernel / debugpy set PYDEVD_* variables in this process: put the environment back
        os.environ.clear()
        os.environ.update(env)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"


def test_rendered_copies_match_the_notebooks():
    """One rendered copy per notebook, nothing else in notebooks/rendered/, and small."""
    copies = sorted(p.name for p in RENDERED.glob("*.ipynb"))
    assert copies == [p.name for p in NOTEBOOKS], f"rendered {copies} vs notebooks {[p.name for p in NOTEBOOKS]}: run {RENDER}"
    total = sum(p.stat().st_size for p in RENDERED.iterdir())
    assert total < RENDERED_MAX_BYTES, f"notebooks/rendered holds {total / 2**20:.1f} MiB: keep figures at low dpi"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_rendered_copy_ran_and_shows_figures(path, monkeypatch):
    """The copy exists, is its notebook's rendering (not a hand edit) and ran cleanly; whether it is current
    is render_notebooks.py --check's question, not a test's."""
    nbformat, _ = _tooling()
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import render_notebooks
    copy = RENDERED / path.name
    assert copy.is_file(), f"no rendered copy of {path.name}: run {RENDER} {path.stem}"
    out = nbformat.read(str(copy), as_version=4)
    meta = out.metadata.get(render_notebooks.KEY, {})
    assert meta.get("source") == f"notebooks/{path.name}", f"{copy.name} is not a rendering of {path.name}"
    assert meta.get("source_sha256") == render_notebooks.source_sha256(out), f"{copy.name} was edited after rendering"
    assert meta.get("modules_sha256"), f"{copy.name} records no module it imports"
    code = [c for c in out.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{copy.name}: a code cell was not executed"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], f"{copy.name} holds an error"
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert figures, f"{copy.name} shows no figure"


def test_check_names_each_stale_copy_and_why(tmp_path, monkeypatch, capsys):
    """A copy is stale once its notebook or a module it imports changed (its recorded hashes no longer match):
    --check names it and why, and exits non-zero."""
    nbformat, _ = _tooling()
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import render_notebooks
    path = NOTEBOOKS[0]
    copy = nbformat.read(str(path), as_version=4)   # a copy "rendered" from the files as they are now
    mods = render_notebooks.modules_sha256(copy)
    name = sorted(mods)[0]
    copy.metadata[render_notebooks.KEY] = {"source_sha256": render_notebooks.source_sha256(copy), "modules_sha256": mods}
    nbformat.write(copy, str(tmp_path / path.name))
    assert render_notebooks.stale(path, tmp_path) is None
    copy.metadata[render_notebooks.KEY]["modules_sha256"][name] = "0" * 64     # as if rendered from another version
    nbformat.write(copy, str(tmp_path / path.name))
    assert render_notebooks.stale(path, tmp_path) == f"{path.name} was rendered before a change to {name}"
    copy.metadata[render_notebooks.KEY]["source_sha256"] = "0" * 64           # and from another notebook version
    nbformat.write(copy, str(tmp_path / path.name))
    with pytest.raises(SystemExit, match="rendered notebook"):
        render_notebooks.main(["--check", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"{path.name} was rendered from another version of {path.name}" in out
    assert f"{NOTEBOOKS[1].name} is missing" in out   # every other copy: none in tmp_path
