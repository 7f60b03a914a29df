"""The README's reading promise (DESIGN.md's size rules), checked: every module (the root's, lab/ and scripts/) at
most 700 lines, its docstring a screen (at most 25 lines), no function over 100 lines and no class over
300, a chain of module-level imports between root modules at most 7 modules long, and every root module
named in the README, so a new file is placed in the reading order rather than found by accident."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted([*ROOT.glob("*.py"), *(ROOT / "lab").glob("*.py"), *(ROOT / "scripts").glob("*.py")])
MAX_LINES, MAX_DOC_LINES, MAX_FUNCTION_LINES, MAX_CLASS_LINES, MAX_IMPORT_CHAIN = 700, 25, 100, 300, 7


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
    big = [(c.name, c.end_lineno - c.lineno + 1) for c in ast.walk(tree)
           if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno + 1 > MAX_CLASS_LINES]
    assert not big, f"{path.name}: classes over {MAX_CLASS_LINES} lines: {big}"


def _module_imports(path: Path, names: set) -> set:
    """The root modules `path` imports at module level (a function-level import is read only when called)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return (out & names) - {path.stem}


def test_import_chains_are_short():
    """The longest chain of module-level imports between root modules (a -> b: a imports b) has at most
    MAX_IMPORT_CHAIN modules, and there is no cycle."""
    roots = {p.stem: p for p in MODULES if p.parent == ROOT}
    deps = {m: _module_imports(p, set(roots)) for m, p in roots.items()}

    def longest(m: str, seen: tuple = ()) -> tuple:
        assert m not in seen, f"import cycle: {' -> '.join(seen + (m,))}"
        return (m,) + max((longest(d, seen + (m,)) for d in deps[m]), key=len, default=())
    worst = max((longest(m) for m in roots), key=len)
    assert len(worst) <= MAX_IMPORT_CHAIN, f"import chain of {len(worst)} modules: {' -> '.join(worst)}"


def test_every_root_module_is_named_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in MODULES if p.parent == ROOT and p.name != "conftest.py" and f"`{p.name}`" not in readme]
    assert not missing, f"modules the README never names: {missing}"


def test_the_root_shows_the_concepts():
    """At most 14 modules at the root (conftest.py aside); the machinery sits in lab/, flat (no sub-packages)."""
    root = [p.name for p in ROOT.glob("*.py") if p.name != "conftest.py"]
    assert len(root) <= 14, f"{len(root)} modules at the root: {sorted(root)}"
    nested = [str(p.relative_to(ROOT)) for p in (ROOT / "lab").rglob("*.py") if p.parent != ROOT / "lab"]
    assert not nested, f"lab/ is flat: {nested}"


@pytest.mark.parametrize("path", [p for p in MODULES if p.parent == ROOT and p.name != "reproduce.py"], ids=lambda p: p.name)
def test_root_modules_do_not_import_lab_at_module_level(path):
    """Concepts never import the machinery at import time (a main() may); reproduce.py, the pipeline that
    composes them with lab/, is the one root module exempt."""
    found = [node.lineno for node in ast.parse(path.read_text()).body
             if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "lab" for a in node.names))
             or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lab")]
    assert not found, f"{path.name} imports lab at module level, lines {found}"
