"""scripts/device-plane: chunks carried one per call are kept outside the repository until all have
come, then extracted into the cache layout scripts/control-plane uses, with the wheels installed.

Most streams here are made by the test (tarfile, lzma); `pack` itself runs against a cache of
stand-in binaries and a local wheel directory (pip's PIP_NO_INDEX and PIP_FIND_LINKS), so it
needs no registry."""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import uuid
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
DEVICE_PLANE = REPO / "scripts" / "device-plane"
CONTROL_PLANE = REPO / "scripts" / "control-plane"
BINS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "etcd", "kwok", "kubectl", "helm",
        "hollow-node", "cdi-validate")


def plane_k8s_dir() -> str:
    """k8s/<version> under the cache: where scripts/control-plane keeps the release it builds and
    starts (`env`'s K8S_VERSION, which MIG_OPERATOR_K8S_VERSION picks), so where `build` looks."""
    env = subprocess.run([str(CONTROL_PLANE), "env"], capture_output=True, text=True, timeout=60, check=True)
    settings = dict(line.split("=", 1) for line in env.stdout.splitlines() if "=" in line)
    return f"k8s/{settings['K8S_VERSION']}"


K8S = plane_k8s_dir()


def tool_hash(tool: str) -> str:
    """The fingerprint `scripts/control-plane build` keeps of tools/<tool>: its *.go, go.mod and go.sum
    in C-locale order, concatenated."""
    files = sorted((p for p in (REPO / "tools" / tool).iterdir()
                    if p.is_file() and (p.suffix == ".go" or p.name in ("go.mod", "go.sum"))),
                   key=lambda p: ("./" + p.name).encode())
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


def wheel(name: str = "devplane-probe", version: str = "1.0", module: str = "devplane_probe") -> bytes:
    """A minimal pure-Python wheel of distribution ``name`` holding ``module`` (ANSWER = 42)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as whl:
        whl.writestr(f"{module}.py", "ANSWER = 42\n")
        info = f"{wheel_name(name)}-{version}.dist-info"
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    return buf.getvalue()


def wheel_name(name: str) -> str:
    """A distribution's name as a wheel's file name spells it (PEP 427: normalised, - as _)."""
    return canonicalize_name(name).replace("-", "_")


def stream() -> bytes:
    """What `pack` puts in its xz stream: the cache's k8s/<version> (bin/, kwok-stages/) and wheels/."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        def add(name: str, data: bytes, mode: int = 0o644) -> None:
            entry = tarfile.TarInfo(name)
            entry.size, entry.mode = len(data), mode
            tar.addfile(entry, io.BytesIO(data))
        for name in BINS:
            add(f"{K8S}/bin/{name}", f"#!/bin/sh\necho {name}\n".encode(), 0o755)
        for tool in ("hollow-node", "cdi-validate"):
            add(f"{K8S}/bin/{tool}.source-sha256", (tool_hash(tool) + "\n").encode())
        add(f"{K8S}/kwok-stages/node/fast/node-initialize.yaml", b"kind: Stage\n")
        add("wheels/devplane_probe-1.0-py3-none-any.whl", wheel())
    return lzma.compress(raw.getvalue())


@pytest.fixture
def chunks(tmp_path: Path) -> tuple[list[tuple[str, bytes]], str]:
    data = stream()
    size = len(data) // 3 + 1
    parts = [(f"plane.tar.xz.{i:02d}", data[i * size:(i + 1) * size]) for i in range(3)]
    manifest = "".join(f"{hashlib.sha256(body).hexdigest()}  {name}\n" for name, body in parts)
    return parts, manifest


def unpack(call_dir: Path, cache: Path) -> subprocess.CompletedProcess:
    # GO=false: should `build` find anything missing it fails at once instead of compiling.
    env = dict(os.environ, MIG_OPERATOR_CACHE=str(cache), PYTHON=sys.executable, GO="/bin/false")
    return subprocess.run([str(DEVICE_PLANE), "unpack", str(call_dir)], capture_output=True, text=True,
                          env=env, timeout=300)


def one_call(tmp_path: Path, n: int, manifest: str, *parts: tuple[str, bytes]) -> Path:
    """What one call brings: MANIFEST and the chunks it carries, in a fresh copy of the repository."""
    call = tmp_path / f"call{n}" / ".device-plane"
    call.mkdir(parents=True)
    (call / "MANIFEST").write_text(manifest)
    for name, body in parts:
        (call / name).write_bytes(body)
    return call


def test_chunks_from_separate_calls_become_the_cache_and_a_site(tmp_path: Path, chunks):
    parts, manifest = chunks
    cache = tmp_path / "cache"
    first = unpack(one_call(tmp_path, 0, manifest, parts[0]), cache)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().splitlines()[-1] == "MISSING=plane.tar.xz.01 plane.tar.xz.02"
    assert not (cache / K8S).exists()
    second = unpack(one_call(tmp_path, 1, manifest, parts[2]), cache)  # out of order
    assert second.stdout.strip().splitlines()[-1] == "MISSING=plane.tar.xz.01"
    last = unpack(one_call(tmp_path, 2, manifest, parts[1]), cache)
    assert last.returncode == 0, last.stderr
    site = cache / "device-plane" / "site"
    assert last.stdout.strip().splitlines()[-1] == f"PYTHONPATH={site}"
    for name in BINS:
        assert os.access(cache / K8S / "bin" / name, os.X_OK), name
    assert "already cached" in last.stderr  # scripts/control-plane build found everything
    probe = subprocess.run([sys.executable, "-c", "import devplane_probe; print(devplane_probe.ANSWER)"],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(site)))
    assert probe.stdout.strip() == "42", probe.stderr
    assert not (cache / "device-plane" / "spool").exists() and not (cache / "wheels").exists()


def test_a_chunk_that_does_not_match_its_manifest_is_refused(tmp_path: Path, chunks):
    parts, manifest = chunks
    name, body = parts[1]
    result = unpack(one_call(tmp_path, 0, manifest, (name, body[:-1] + bytes([body[-1] ^ 1]))), tmp_path / "cache")
    assert result.returncode == 1
    assert f"{name} does not match" in result.stderr
    assert not (tmp_path / "cache" / "device-plane" / "spool" / name).exists()


def test_unpack_without_a_manifest_and_pack_outside_an_ignored_path_are_usage_errors(tmp_path: Path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = unpack(empty, tmp_path / "cache")
    assert result.returncode == 2 and "MANIFEST" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    packed = subprocess.run([str(DEVICE_PLANE), "pack", str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=60)
    assert packed.returncode == 2 and "not an ignored path" in packed.stderr
    assert len(packed.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# ---- pack ------------------------------------------------------------------------------------------

PACKED_BINS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "etcd", "kwok", "kubectl")
# The device machine's interpreter and platform, as pack asks pip for them (scripts/device-plane).
TARGET = {"python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
          "os_name": "posix", "platform_machine": "x86_64"}


def packed_requirements() -> list[Requirement]:
    """What pack must fetch: pyproject's runtime dependencies and pytest, markers evaluated for the target."""
    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"] + ["pytest"]
    reqs = [Requirement(text) for text in listed]
    assert any(r.marker for r in reqs), "no requirement with an environment marker left to pack"
    return [r for r in reqs if r.marker is None or r.marker.evaluate(TARGET)]


def satisfying_version(req: Requirement) -> str:
    """The lowest bound a requirement names (or 1.0 when it names none), checked against it."""
    bounds = [spec.version for spec in req.specifier if spec.operator in (">=", "==", "~=")]
    version = max(bounds, key=lambda v: tuple(int(p) for p in v.split("."))) if bounds else "1.0"
    assert req.specifier.contains(version), f"{req}: no version picked (got {version})"
    return version


def test_pack_fetches_requirements_with_environment_markers_and_unpack_installs_them(tmp_path: Path):
    """pack with a requirement such as ``uvloop>=0.19; sys_platform != 'win32'`` (a marker with
    spaces and !=): every requirement's wheel, from a local wheel directory, is in the stream, and
    unpack installs them where each module imports."""
    reqs = packed_requirements()
    links = tmp_path / "links"
    links.mkdir()
    modules = {}
    for req in reqs:
        version = satisfying_version(req)
        modules[canonicalize_name(req.name)] = f"packed_{wheel_name(req.name)}"
        (links / f"{wheel_name(req.name)}-{version}-py3-none-any.whl").write_bytes(
            wheel(req.name, version, modules[canonicalize_name(req.name)]))
    cache = tmp_path / "cache"
    bin_dir = cache / K8S / "bin"
    bin_dir.mkdir(parents=True)
    for name in PACKED_BINS:
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name}\n")
        (bin_dir / name).chmod(0o755)
    for tool in ("hollow-node", "cdi-validate"):
        (bin_dir / f"{tool}.source-sha256").write_text(tool_hash(tool) + "\n")
    (cache / K8S / "kwok-stages" / "node").mkdir(parents=True)
    (cache / K8S / "kwok-stages" / "node" / "stage.yaml").write_text("kind: Stage\n")

    spool = REPO / ".device-plane"
    spool_existed = spool.exists()
    out = spool / f"test-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, MIG_OPERATOR_CACHE=str(cache), PYTHON=sys.executable, PIP_NO_INDEX="1",
               PIP_FIND_LINKS=str(links), PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        packed = subprocess.run([str(DEVICE_PLANE), "pack", str(out)], capture_output=True, text=True, env=env,
                                timeout=600)
        assert packed.returncode == 0, packed.stderr
        manifest = (out / "MANIFEST").read_text()
        names = [line.split()[1] for line in manifest.splitlines()]
        data = b"".join((out / name).read_bytes() for name in names)
        call = one_call(tmp_path, 0, manifest, *((name, (out / name).read_bytes()) for name in names))
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if not spool_existed:
            shutil.rmtree(spool, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data))) as tar:
        members = tar.getnames()
    wheels = {canonicalize_name(Path(m).name.split("-")[0]) for m in members if m.startswith("wheels/")}
    assert wheels == set(modules)
    assert "uvloop" in wheels  # the requirement with a marker
    assert {f"{K8S}/bin/{name}" for name in PACKED_BINS} <= set(members)

    target = tmp_path / "device-cache"
    unpacked = unpack(call, target)
    assert unpacked.returncode == 0, unpacked.stderr
    site = unpacked.stdout.strip().splitlines()[-1].removeprefix("PYTHONPATH=")
    probe = subprocess.run([sys.executable, "-c", f"import {', '.join(modules.values())}"],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=site))
    assert probe.returncode == 0, probe.stderr
