"""The test folders can be named together in one pytest command, in any order.

The folders are not packages: pytest (prepend import mode) puts each test file's folder on
sys.path and imports its modules by their bare names, so all folders share one namespace of
top-level modules. Every folder's conftest.py is a module named ``conftest``, and which one that
name holds depends on the order the folders were loaded in; so nothing may import ``conftest``, and
no two other modules may share a name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(path: Path) -> set[str]:
    """The top-level names of the modules ``path`` imports (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_imports_a_conftest():
    importers = [str(p.relative_to(REPO)) for p in python_files() if "conftest" in imported_modules(p)]
    assert not importers, (
        f"{importers} import conftest, which is whichever folder's conftest.py was loaded last; "
        "put what they share in a module of its own (e.g. tests/e2e/cluster.py) and import that")


def test_no_two_modules_share_a_name():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in python_files():
        if path.name not in ("conftest.py", "__init__.py"):
            by_name[path.stem].append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}


def test_the_folders_collect_together_whichever_comes_first():
    folders = sorted(str(p.relative_to(REPO)) for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    assert {"tests/e2e", "tests/helm", "tests/unit"} <= set(folders), folders
    # -m "not e2e" deselects only after every module was imported, which is what is checked here;
    # it keeps tests/node from building the real node at collection.
    for order in (folders, folders[::-1]):
        result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                 "-m", "not e2e", *order], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"pytest --collect-only {' '.join(order)}:\n{result.stdout[-4000:]}"
