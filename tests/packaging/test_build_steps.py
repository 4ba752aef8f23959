"""The Dockerfile's build steps, run outside Docker (no container engine here): build the shim from a copy
of what the build context holds, build the wheel, install it into a clean virtual environment, start
the command line. Plus hadolint and the Dockerfile's own promises (pinned base, non-root, one image).

The commands are the Dockerfile's: each test first finds its command in the Dockerfile, so the two
cannot drift apart silently. The wheel's dependencies come from PyPI (pip's cache makes reruns fast).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
HADOLINT = Path(sys.executable).parent / "hadolint"

# The Dockerfile's commands, as it writes them.
SHIM_BUILD = "make -C shim libgpuslice.so"
WHEEL_BUILD = "pip wheel --no-deps --wheel-dir /wheels ."
VENV = "python -m venv /opt/mig-operator"
INSTALL = "/opt/mig-operator/bin/pip install /wheels/mig_operator-*.whl"
SMOKE = ("mig-operator --help", "mig-operator controller --help", "mig-operator agent --help")


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions (keyword, rest), continuation lines joined, comments dropped."""
    joined, out = "", []
    for line in DOCKERFILE.read_text().splitlines():
        if not joined and (not line.strip() or line.lstrip().startswith("#")):
            continue
        joined += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = joined.strip().partition(" ")
            out.append((keyword.upper(), " ".join(rest.split())))
            joined = ""
    return out


def run_commands() -> str:
    return " && ".join(rest for keyword, rest in instructions() if keyword == "RUN")


def context_files() -> list[Path]:
    """What `docker build .` sends, by .dockerignore's rules (last match wins, `!` re-includes)."""
    rules = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    # An allow-list: everything is excluded first, so only what a `!` rule names can be sent.
    assert rules[0] == "*", ".dockerignore should start by excluding everything"
    roots = {rule[1:].split("/")[0] for rule in rules if rule.startswith("!")}
    candidates = [p for root in roots for p in ([REPO_ROOT / root] if (REPO_ROOT / root).is_file()
                                                  else (REPO_ROOT / root).rglob("*"))]
    chosen = []
    for path in sorted(candidates):
        rel = path.relative_to(REPO_ROOT).as_posix()
        if path.is_dir() or rel.startswith(".git/"):
            continue
        included = True
        for rule in rules:
            negate, pattern = rule.startswith("!"), rule.lstrip("!").rstrip("/")
            pattern = pattern.removeprefix("**/")
            parts = rel.split("/")
            hit = any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)) or any(
                fnmatch.fnmatch(part, pattern) for part in parts if rule.startswith(("**/", "!**/")))
            if hit:
                included = negate
        if included:
            chosen.append(path)
    return chosen


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the build context, as the builder would receive it."""
    root = tmp_path_factory.mktemp("context")
    for path in context_files():
        target = root / path.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return root


def sh(command: list[str] | str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            shell=isinstance(command, str), env={**os.environ, **(env or {})})
    assert result.returncode == 0, (
        f"{command} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def test_the_build_context_holds_the_sources_and_nothing_built_or_secret() -> None:
    names = {p.relative_to(REPO_ROOT).as_posix() for p in context_files()}
    assert "pyproject.toml" in names and "mig_operator/cli/main.py" in names and "shim/Makefile" in names
    assert any(n.startswith("mig_operator/kube/agent/") for n in names)
    leaked = [n for n in names if n.startswith((".venv/", "tests/", "shim/build/", ".git/", "docs/"))
              or n.endswith((".so", ".pyc", ".o"))]
    assert not leaked


def test_hadolint_passes() -> None:
    result = subprocess.run([str(HADOLINT), str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_base_is_pinned_by_digest_and_the_image_runs_as_non_root() -> None:
    steps = instructions()
    args = dict(rest.split("=", 1) for keyword, rest in steps if keyword == "ARG")
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", args["PYTHON_IMAGE"])
    stages = [rest for keyword, rest in steps if keyword == "FROM"]
    assert stages and all(stage.split()[0] == "${PYTHON_IMAGE}" for stage in stages)
    final = steps[max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM"):]
    users = [rest for keyword, rest in final if keyword == "USER"]
    assert users and not users[-1].startswith(("0", "root"))
    assert ("ENTRYPOINT", '["mig-operator"]') in final
    # The same file serves the chart's init container: it copies it from here.
    assert "/usr/local/lib/mig-operator/libgpuslice.so" in " ".join(rest for _, rest in final)
    chart_agent = (REPO_ROOT / "helm" / "mig-operator" / "templates" / "agent.yaml").read_text()
    assert "/usr/local/lib/mig-operator/libgpuslice.so" in chart_agent


def test_the_shim_builds_from_the_build_context(context: Path) -> None:
    assert SHIM_BUILD in run_commands()
    sh(SHIM_BUILD, context)
    library = context / "shim" / "libgpuslice.so"
    assert library.read_bytes()[:4] == b"\x7fELF"
    exported = sh(["nm", "-D", "--defined-only", str(library)], context)
    for symbol in ("cuMemAlloc_v2", "cuGetProcAddress", "nvmlDeviceGetMemoryInfo", "dlsym"):
        assert re.search(rf"\b{symbol}\b", exported), f"{symbol} is not exported"


def test_the_wheel_installs_into_a_clean_venv_and_the_command_line_starts(context: Path,
                                                                            tmp_path: Path) -> None:
    commands = run_commands()
    for step in (WHEEL_BUILD, VENV, INSTALL, *SMOKE):
        assert step in commands, f"the Dockerfile no longer runs {step!r}"
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    python = shutil.which("python3.11") or sys.executable
    pip_env = {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    sh(WHEEL_BUILD.replace("/wheels", str(wheels)).replace("pip ", f"{python} -m pip ", 1), context, env=pip_env)
    [wheel] = wheels.glob("mig_operator-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packaged = set(archive.namelist())
    sources = {p.relative_to(context).as_posix() for p in (context / "mig_operator").rglob("*.py")}
    assert sources <= packaged, f"not in the wheel: {sorted(sources - packaged)}"
    # Quicker than the image's steps, same result: no pip inside the venv (this pip installs into it)
    # and no bytecode compilation.
    sh([python, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    sh([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-compile",
        str(wheel)], tmp_path, env=pip_env)
    for smoke in SMOKE:
        out = sh([str(venv / "bin" / "mig-operator"), *smoke.split()[1:]], tmp_path)
        assert "usage: mig-operator" in out
    # Every running part imports in the clean environment (nothing only the dev venv has).
    sh([str(venv / "bin" / "python"), "-c", "import mig_operator.kube.controller.main, mig_operator.kube.agent.main,"
        " mig_operator.kube.webhook.server, mig_operator.gpu.nvml, prometheus_client, pynvml"], tmp_path)
