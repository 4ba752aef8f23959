"""Test helpers shared by several suites (tests/fake_kubelet.py) are imported by their module name, and
the tests' spread over pytest-xdist workers."""

import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

TESTS_DIR = Path(__file__).resolve().parent


# The order tests are handed to workers in: the long-waiting folders first, so that the short ones fill
# the end of the run rather than one long test trailing alone.
FOLDER_ORDER = ("e2e", "node", "packaging", "helm")
# Groups handed out before the rest of their folder: one worker runs each whole, for minutes (its own
# control plane with a node autoscaler).
FIRST_GROUPS = ("karpenter",)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (its own hook of this name)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """How `make test` spreads tests over pytest-xdist workers (``--dist loadgroup``).

    An e2e test has a harness of its own on its worker's private control plane, so each goes to any
    worker, except files that mark a group because their tests share a module-scoped fixture. The
    node suite starts one real kubelet and containerd on this machine: one worker runs it all. Every
    other file stays on one worker, so its module fixtures are made once.
    """
    def rank(item: pytest.Item) -> tuple[int, int]:
        folder = Path(item.path).resolve().relative_to(TESTS_DIR).parts[0]
        group = item.get_closest_marker("xdist_group")
        first = group is not None and bool(group.args) and group.args[0] in FIRST_GROUPS
        return (FOLDER_ORDER.index(folder) if folder in FOLDER_ORDER else len(FOLDER_ORDER), 0 if first else 1)

    items.sort(key=rank)  # stable: each file's tests stay together and in order
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        folder = Path(item.path).resolve().relative_to(TESTS_DIR).parts[0]
        if folder == "e2e":
            continue
        group = "real-node" if folder == "node" else str(Path(item.path).relative_to(TESTS_DIR))
        item.add_marker(pytest.mark.xdist_group(group))


# Seconds spent per test folder (setup, call and teardown summed; under xdist, over all workers).
_FOLDER_SECONDS: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    parts = report.nodeid.split("::")[0].split("/")
    _FOLDER_SECONDS[parts[1] if parts[0] == "tests" and len(parts) > 2 else parts[-1]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FOLDER_SECONDS:
        spent = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in
                          sorted(_FOLDER_SECONDS.items(), key=lambda kv: -kv[1]))
        terminalreporter.write_line(f"time per folder (summed over workers): {spent}")
