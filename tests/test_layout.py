"""The README's reading promise, checked: every module (the root's and scripts/) at most 700 lines, its
docstring a screen (at most 30 lines), no function over 100 lines, and every root module named in the
README, so a new file is placed in the reading order rather than found by accident."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted([*ROOT.glob("*.py"), *(ROOT / "scripts").glob("*.py")])
MAX_LINES, MAX_DOC_LINES, MAX_FUNCTION_LINES = 700, 30, 100


def test_the_modules_are_found():
    assert {"model.py", "moe.py", "loop.py", "reproduce.py"} <= {p.name for p in MODULES}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_reads_in_one_sitting(path):
    src = path.read_text()
    tree = ast.parse(src)
    doc = ast.get_docstring(tree)
    assert doc, f"{path.name}: no module docstring"
    assert len(src.splitlines()) <= MAX_LINES, f"{path.name}: {len(src.splitlines())} lines > {MAX_LINES}"
    assert len(doc.splitlines()) <= MAX_DOC_LINES, f"{path.name}: docstring of {len(doc.splitlines())} lines"
    long = [(f.name, f.end_lineno - f.lineno + 1) for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_every_root_module_is_named_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in MODULES if p.parent == ROOT and p.name != "conftest.py" and f"`{p.name}`" not in readme]
    assert not missing, f"modules the README never names: {missing}"
