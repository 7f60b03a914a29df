"""The teaching notebooks in notebooks/: each one executes without an error, and each is stored clean.

Every notebook runs top to bottom in a fresh python3 kernel with cwd = notebooks/ (their first code
cell puts the repository root on sys.path), 180 s per cell at most. The notebooks use tiny shapes
and each takes well under a minute on a 2-core CPU; notebooks 04 and 06 train a smoke-size model
on `data.prepare("smoke")` (offline, cached under .cache/) in a scratch directory.

Skipped only when the notebook tooling (nbformat, nbclient, ipykernel) is not installed.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 180


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
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
