"""libgpuslice against a hostile process (issue 24), on a real GPU.

Each case is an attack measured on an H200 before the fix; NVML's per-process footprint, read from
this (unshimmed) process while the attacker holds everything, must never exceed the limit plus one
256 MiB block:

  (a) module globals: CuPy RawModules with 1 GiB ``__device__`` arrays, then allocations (5126 MiB
      under a 2 GiB limit before); the same images through cuLibraryLoadData;
  (b) two processes of one slice, each pointing CDMO_SHIM_DIR (and CDMO_SLICE) somewhere else (3596
      MiB before: each had its own ledger);
  (c) a ledger that cannot be used (no directory, or one this uid cannot write): before, each process
      fell back to a limit of its own; now every allocation is refused;
  (d) two pods sharing one claim: each "pod" is a private mount namespace with its own /dev/shm, the
      CDI spec's mounts applied (the shim read-only, the claim's ledger directory read-write at the
      path the shim has built in, the limit file and /etc/ld.so.preload read-only from the files the
      agent writes) and only the spec's environment, which no longer preloads the shim: the preload
      file does.  Before, the ledger lived in /dev/shm, one per pod.  A mount's destination missing
      on this host is made empty first and removed afterwards (test_fraction_path.placeholders): an
      empty /etc/ld.so.preload preloads nothing, and the slice's one is bound over it only inside
      the pods' namespaces.

Needs root (the ledger path, user switching, mount namespaces); skipped without a GPU.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from test_shim_gpu import FILL, LEDGER, WORK, MiB, Workload, fill, footprint, log, shim_env
from test_shim_gpu import fresh_ledger as fresh_ledger  # autouse: each test starts with an empty ledger
from test_shim_gpu import shim as shim  # the fixture: the library built on this machine

MODULES = WORK / "modules.py"
LIMIT = 2 << 30
BLOCK = 256 * MiB  # the bound: never above the limit plus one 256 MiB block
REPO = Path(__file__).resolve().parents[2]


def _held(w: Workload, done_phase: str = "done") -> tuple[dict, int]:
    done = w.read(done_phase)
    return done, footprint(w.pid)


def test_a_module_globals_are_charged(gpu: str, shim: Path, tmp_path: Path) -> None:
    env = shim_env(shim, tmp_path, "gputest/modules", LIMIT)
    w = Workload([sys.executable, str(MODULES), "attack", "4", "1024", "64"], env)
    try:
        w.read("ready")
        ctx = footprint(w.pid)
        w.go()
        done, held = _held(w)
    finally:
        stderr = w.finish()
    rec = {"test": "hostile-a-cupy-modules", "limit": LIMIT, "footprint_before": ctx, "footprint_held": held,
           **done}
    log(rec)
    assert held <= LIMIT + BLOCK, f"footprint {held / MiB:.0f} MiB over the limit: {rec}\n{stderr[-2000:]}"
    assert 1 <= done["modules_loaded"] < 4, rec
    assert all("CUDA_ERROR_OUT_OF_MEMORY" in e for e in done["module_errors"]), rec
    assert done["error"], f"the allocations never ran out: {rec}"


def test_a_library_globals_are_charged(gpu: str, shim: Path, tmp_path: Path) -> None:
    env = shim_env(shim, tmp_path, "gputest/libraries", LIMIT)
    w = Workload([sys.executable, str(MODULES), "libattack", "4", "1024"], env)
    try:
        w.read("ready")
        ctx = footprint(w.pid)
        w.go()
        done, held = _held(w)
    finally:
        stderr = w.finish()
    rec = {"test": "hostile-a-libraries", "limit": LIMIT, "footprint_before": ctx, "footprint_held": held, **done}
    log(rec)
    assert held <= LIMIT + BLOCK, f"footprint {held / MiB:.0f} MiB over the limit: {rec}\n{stderr[-2000:]}"
    assert done["modules_loaded"] == 1 and done["rcs"][1:] == [2, 2, 2], rec  # 2: CUDA_ERROR_OUT_OF_MEMORY


def test_b_no_variable_chooses_another_ledger(gpu: str, shim: Path, tmp_path: Path) -> None:
    envs = [shim_env(shim, tmp_path, f"gputest/own-{i}", LIMIT,
                     {"CDMO_SHIM_DIR": str(tmp_path / f"ledger-{i}"), "TMPDIR": str(tmp_path / f"ledger-{i}")})
            for i in (0, 1)]
    for i in (0, 1):
        (tmp_path / f"ledger-{i}").mkdir()
    a, b = fill("torch", envs[0]), fill("torch", envs[1])
    try:
        a.read("ready"), b.read("ready")
        a.go(), b.go()
        ra, rb = a.read("done"), b.read("done")
        fa, fb = footprint(a.pid), footprint(b.pid)
    finally:
        a.finish(), b.finish()
    rec = {"test": "hostile-b-own-dirs", "limit": LIMIT, "footprints": [fa, fb], "sum": fa + fb,
           "allocated": [ra["allocated"]["0"], rb["allocated"]["0"]],
           "ledger_files": sorted(p.name for p in LEDGER.iterdir()),
           "files_where_the_variables_point": sorted(str(p) for i in (0, 1)
                                                     for p in (tmp_path / f"ledger-{i}").iterdir())}
    log(rec)
    assert fa + fb <= LIMIT + BLOCK, f"together {(fa + fb) / MiB:.0f} MiB: {rec}"
    assert not rec["files_where_the_variables_point"], rec
    assert len(rec["ledger_files"]) == 1, rec


def _closed(shim_lib: Path, tmp_path: Path, name: str, wrapper: list[str] = ()) -> dict:  # type: ignore[assignment]
    env = shim_env(shim_lib, tmp_path, f"gputest/{name}", LIMIT)
    w = Workload([*wrapper, sys.executable, str(FILL), "torch", "16", "16384"], env)
    try:
        ready = w.read("ready")
        ctx = footprint(w.pid)
        w.go()
        done = w.read("done")
        held = footprint(w.pid)
    finally:
        stderr = w.finish()
    said = [ln for ln in stderr.splitlines() if "libgpuslice" in ln]
    rec = {"test": f"hostile-c-{name}", "limit": LIMIT, "footprint_before": ctx, "footprint_held": held,
           "allocated": done["allocated"]["0"], "error": done["error"]["0"], "ready": ready["info"]["0"],
           "shim_said": said}
    log(rec)
    assert rec["allocated"] == 0 and rec["error"], f"an allocation got through: {rec}"
    assert held <= ctx + 2 * MiB, rec
    assert len(said) == 1 and "every allocation of device memory is refused" in said[0], said
    return rec


def test_c_no_ledger_directory_refuses_everything(gpu: str, shim: Path, tmp_path: Path) -> None:
    LEDGER.rmdir()  # the claim's mount is missing
    rec = _closed(shim, tmp_path, "no-dir")
    assert "No such file or directory" in rec["shim_said"][0]


def test_c_a_ledger_that_cannot_be_written_refuses_everything(gpu: str, shim: Path, tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare")
    # A read-only file system over the ledger directory: not even root can create the ledger file.
    script = f"mount -t tmpfs -o ro tmpfs {shlex.quote(str(LEDGER))} && exec \"$@\""
    rec = _closed(shim, tmp_path, "read-only-dir",
                  ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"])
    assert "Read-only file system" in rec["shim_said"][0]


def _pod_script(spec: dict, argv: list[str], image_env: dict[str, str]) -> str:
    """A stand-in runtime for one pod: a private mount namespace with its own /dev/shm, the CDI spec's
    mounts applied as bind mounts with their options over destinations made beforehand
    (``placeholders``), /etc/ld.so.preload last as a runtime has every mount in place before the
    process starts, then exactly the spec's environment (plus what the image would give: PATH, HOME)."""
    edits = spec["devices"][0]["containerEdits"]
    q = shlex.quote
    lines = ["set -e", "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm"]
    for m in sorted(edits["mounts"], key=lambda m: m["containerPath"] == "/etc/ld.so.preload"):
        src, dst, opts = m["hostPath"], m["containerPath"], [o for o in m["options"] if o != "bind"]
        lines += [f"mount --bind {q(src)} {q(dst)}", f"mount -o {q(','.join(['remount', 'bind', *opts]))} {q(dst)}"]
    env = [*(f"{k}={v}" for k, v in image_env.items()), *edits["env"]]
    lines.append("exec env -i " + " ".join(q(e) for e in env) + " " + " ".join(q(a) for a in argv))
    return "\n".join(lines)


def test_d_two_pods_sharing_one_claim_share_one_limit(gpu: str, shim: Path, tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare")
    sys.path.insert(0, str(REPO))
    from test_fraction_path import placeholders

    from mig_operator.core.node.cdi import DeviceNode, SliceDevice, ledger_dir, limit_dir, slice_spec
    from mig_operator.core.node.environment import shim_files
    from mig_operator.kube.agent.kubelet.files import make_ledger_dir, write_limit_dir

    uid = "d4c3b2a1-0000-4000-8000-000000000024"
    shim_dir = tmp_path / "shim"
    shim_dir.mkdir()
    shutil.copy(shim, shim_dir / "libgpuslice.so")
    ledgers, limits = tmp_path / "ledgers", tmp_path / "limits"
    spec = slice_spec(SliceDevice(uid, "team-a", "shared", "fraction", "GPU-x", LIMIT,
                                  (DeviceNode("/dev/nvidiactl", 195, 255),), str(shim_dir), str(ledgers),
                                  str(limits)))
    host_ledger = Path(ledger_dir(str(ledgers), uid))
    make_ledger_dir(str(host_ledger))  # as the agent's kubelet plugin makes them at prepare
    write_limit_dir(limit_dir(str(limits), uid), shim_files(LIMIT))
    assert "LD_PRELOAD" not in str(spec["devices"][0]["containerEdits"]["env"])
    made = placeholders([{"source": m["hostPath"], "destination": m["containerPath"]}
                         for m in spec["devices"][0]["containerEdits"]["mounts"]])
    image_env = {k: os.environ[k] for k in ("PATH", "LD_LIBRARY_PATH", "HOME", "LANG") if k in os.environ}
    image_env.update({"PYTHONUNBUFFERED": "1", "SHIM_TEST_TMP": str(tmp_path)})
    argv = [sys.executable, str(FILL), "torch", "16", "16384"]
    pods = []
    try:
        for _ in range(2):
            script = _pod_script(spec, argv, image_env)
            pods.append(Workload(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                 {**os.environ, "SHIM_TEST_TMP": str(tmp_path)}))
        for p in pods:
            p.read("ready")
        for p in pods:
            p.go()
        done = [p.read("done") for p in pods]
        prints = [footprint(p.pid) for p in pods]
        files = sorted(f.name for f in host_ledger.iterdir())
    finally:
        errs = [p.finish() for p in pods]
        for p in made:  # deepest first
            if p.is_dir():
                p.rmdir()
            else:
                p.unlink()
    rec = {"test": "hostile-d-two-pods-one-claim", "limit": LIMIT, "footprints": prints, "sum": sum(prints),
           "allocated": [d["allocated"]["0"] for d in done], "totals_seen": [d["info"]["0"]["total"] for d in done],
           "ledger_files": files, "mounts": spec["devices"][0]["containerEdits"]["mounts"]}
    log(rec)
    assert sum(prints) <= LIMIT + BLOCK, f"together {sum(prints) / MiB:.0f} MiB: {rec}\n{errs[0][-1500:]}"
    assert all(d["error"]["0"] for d in done), rec
    assert rec["totals_seen"] == [LIMIT, LIMIT], rec
    assert len(files) == 1 and files[0].startswith("gpu-"), rec  # one ledger, in the claim's directory
