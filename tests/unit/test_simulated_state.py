"""The simulator's half-made instances, GPUs without MIG, faults and latency across processes, and its
state file: what the node agent's tests rely on when they run the agent as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mig_operator.core.placement.profiles import CATALOG, get_model
from mig_operator.gpu import open_backend
from mig_operator.gpu.inventory import describe, render_text
from mig_operator.gpu.protocol import GpuError
from mig_operator.gpu.simulated import SimulatedBackend, gpu_uuid

NO_MIG_MODELS = sorted(name for name, model in CATALOG.items() if not model.mig_capable)


def _in_child(state: str, code: str) -> str:
    """Run ``code`` in a new Python process with ``sim`` opened on ``state``; its printed output."""
    script = (
        "from mig_operator.gpu.simulated import SimulatedBackend\n"
        "from mig_operator.gpu.protocol import GpuError\n"
        f"sim = SimulatedBackend('h200-141gb', state_file={state!r})\n"
        "def attempt(call):\n"
        "    try:\n"
        "        call()\n"
        "        print('ok')\n"
        "    except GpuError as exc:\n"
        "        print(exc.name)\n" + code
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


# ---- GPUs without MIG ------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", NO_MIG_MODELS)
def test_a_gpu_without_mig_answers_as_nvml_does(model_name: str) -> None:
    model = get_model(model_name)
    sim = SimulatedBackend(model_name, count=2, mig_enabled=True)  # asking for MIG mode changes nothing
    assert [(g.product, g.memory_mib, g.mig_capable, g.mig_enabled, g.uuid) for g in sim.gpus()] == [
        (model.product, model.memory_mib, False, False, gpu_uuid(model_name, i)) for i in (0, 1)
    ]
    calls = {
        "model": lambda: sim.model(0),
        "instances": lambda: sim.instances(1),
        "create_instance": lambda: sim.create_instance(0, 19, 0),
        "create_compute_instance": lambda: sim.create_compute_instance(0, 7),
        "destroy_instance": lambda: sim.destroy_instance(0, 7),
        "set_mig_mode": lambda: sim.set_mig_mode(0, True),
    }
    for name, call in calls.items():
        with pytest.raises(GpuError) as refused:
            call()
        assert refused.value.name == "NOT_SUPPORTED", name
    with pytest.raises(GpuError) as bad_index:
        sim.model(2)
    assert bad_index.value.name == "INVALID_ARGUMENT"


def test_open_backend_and_describe_a_gpu_without_mig(tmp_path: Path) -> None:
    backend = open_backend("sim:l4-24gbx2", state_file=str(tmp_path / "s.json"))
    desc = describe(backend)
    assert [(g["product"], g["model"], g["memory_mib"], g["mig_capable"], g["profiles"], g["instances"])
            for g in desc["gpus"]] == [("NVIDIA L4", "l4-24gb", 23034, False, [], [])] * 2
    text = render_text(desc)
    assert "GPU 1: NVIDIA L4 (l4-24gb), 23034 MiB, no MIG" in text and "profile" not in text
    one = describe(open_backend("sim:l40s-48gb"))["gpus"]
    assert [(g["model"], g["memory_mib"]) for g in one] == [("l40s-48gb", 46068)]


# ---- half-made GPU instances -----------------------------------------------------------------------


def test_a_half_made_instance_is_listed_and_can_be_completed_or_destroyed() -> None:
    sim = SimulatedBackend("h100-80gb")
    half = sim.create_half_instance(0, 9, 4)
    assert (half.gi_id, half.ci_id, half.device_uuid, half.complete, half.in_use) == (2, -1, "", False, False)
    assert sim.instances(0) == [half]
    # It holds its slots: nothing else fits there.
    with pytest.raises(GpuError) as taken:
        sim.create_instance(0, 19, 5)
    assert taken.value.name == "INSUFFICIENT_RESOURCES"
    # No process can run on it.
    with pytest.raises(GpuError) as no_ci:
        sim.set_in_use(0, 2, True)
    assert no_ci.value.name == "INVALID_ARGUMENT" and "no compute instance" in str(no_ci.value)
    done = sim.create_compute_instance(0, 2)
    assert (done.gi_id, done.ci_id, done.start, done.size, done.profile) == (2, 0, 4, 4, "3g.40gb")
    assert done.complete and done.device_uuid.startswith("MIG-")
    assert sim.create_compute_instance(0, 2) == done  # a retry changes nothing
    assert sim.instances(0) == [done]
    sim.destroy_instance(0, 2)
    other = sim.create_half_instance(0, 19, 0)
    sim.destroy_instance(0, other.gi_id)  # a GI without its CI is destroyed as it is
    assert sim.instances(0) == []
    with pytest.raises(GpuError) as gone:
        sim.create_compute_instance(0, 2)
    assert gone.value.name == "NOT_FOUND"


def test_a_completed_instance_is_a_new_mig_device() -> None:
    sim = SimulatedBackend("h200-141gb")
    first = sim.create_instance(0, 14, 2)
    sim.inject_fault("destroy_gpu_instance", "TIMEOUT")
    with pytest.raises(GpuError):
        sim.destroy_instance(0, first.gi_id)
    again = sim.create_compute_instance(0, first.gi_id)
    assert again.gi_id == first.gi_id and again.device_uuid not in ("", first.device_uuid)


def test_a_failed_create_and_a_failed_rollback_leave_a_half_made_instance(tmp_path: Path) -> None:
    sim = SimulatedBackend("h200-141gb", state_file=str(tmp_path / "s.json"))
    sim.inject_fault("create_compute_instance", "INSUFFICIENT_RESOURCES")
    sim.inject_fault("destroy_gpu_instance", "UNKNOWN")
    with pytest.raises(GpuError) as failed:
        sim.create_instance(0, 9, 0)
    message = str(failed.value)
    # The error is the compute instance's, and says what was left behind.
    assert failed.value.name == "INSUFFICIENT_RESOURCES"
    assert "rollback failed too" in message and "GPU instance 1 is left without a compute instance" in message
    assert "\n" not in message
    [left] = SimulatedBackend("h200-141gb", state_file=str(tmp_path / "s.json")).instances(0)
    assert (left.gi_id, left.start, left.ci_id, left.device_uuid, left.complete) == (1, 0, -1, "", False)
    assert sim.create_compute_instance(0, 1).complete


def test_a_failed_create_with_a_good_rollback_leaves_nothing() -> None:
    sim = SimulatedBackend("h200-141gb")
    sim.inject_fault("create_compute_instance", "INSUFFICIENT_RESOURCES")
    with pytest.raises(GpuError) as failed:
        sim.create_instance(0, 9, 0)
    assert "left without" not in str(failed.value)
    assert sim.instances(0) == []


def test_a_destroy_that_stops_half_way_says_so_and_can_be_finished() -> None:
    sim = SimulatedBackend("h200-141gb")
    made = sim.create_instance(0, 19, 3)
    sim.inject_fault("destroy_gpu_instance", "IN_USE")
    with pytest.raises(GpuError) as failed:
        sim.destroy_instance(0, made.gi_id)
    assert failed.value.name == "IN_USE" and failed.value.transient
    assert f"GPU instance {made.gi_id} is left without one" in str(failed.value)
    [half] = sim.instances(0)
    assert (half.gi_id, half.ci_id, half.device_uuid) == (made.gi_id, -1, "")
    sim.destroy_instance(0, made.gi_id)
    assert sim.instances(0) == []


# ---- faults, in-use marks and latency across processes ---------------------------------------------


def test_faults_in_a_state_file_reach_another_process(tmp_path: Path) -> None:
    state = str(tmp_path / "s.json")
    sim = SimulatedBackend("h200-141gb", state_file=state)
    sim.inject_fault("create_instance", "INSUFFICIENT_RESOURCES", times=2)
    stored = json.loads(Path(state).read_text())["faults"]
    assert stored == {"create_instance": [["INSUFFICIENT_RESOURCES", 2]]}
    # The child uses one of the two; the parent sees the other; then creates go through everywhere.
    assert _in_child(state, "attempt(lambda: sim.create_instance(0, 19, 0))\n") == "INSUFFICIENT_RESOURCES\n"
    with pytest.raises(GpuError) as second:
        sim.create_instance(0, 19, 0)
    assert second.value.name == "INSUFFICIENT_RESOURCES" and "injected" in str(second.value)
    assert json.loads(Path(state).read_text())["faults"] == {}
    assert _in_child(state, "attempt(lambda: sim.create_instance(0, 19, 0))\n") == "ok\n"
    assert [i.start for i in sim.instances(0)] == [0]


def test_faults_on_reads_and_in_use_marks_reach_another_process(tmp_path: Path) -> None:
    state = str(tmp_path / "s.json")
    sim = SimulatedBackend("h200-141gb", state_file=state)
    made = sim.create_instance(0, 14, 0)
    sim.set_in_use(0, made.gi_id, True)
    sim.inject_fault("instances", "TIMEOUT")
    out = _in_child(
        state, f"attempt(lambda: sim.instances(0))\nattempt(lambda: sim.destroy_instance(0, {made.gi_id}))\n"
    )
    assert out == "TIMEOUT\nIN_USE\n"
    sim.clear_faults()
    sim.inject_fault("model", "GPU_IS_LOST")
    assert _in_child(state, "attempt(lambda: sim.model(0))\nattempt(lambda: sim.model(0))\n") == "GPU_IS_LOST\nok\n"


def test_latency_from_the_constructor_or_the_state_file(tmp_path: Path) -> None:
    state = str(tmp_path / "s.json")
    quick = SimulatedBackend("h200-141gb", state_file=state)
    quick.set_latency(0.3)
    assert json.loads(Path(state).read_text())["latency_s"] == {
        "create_compute_instance": 0.3, "create_instance": 0.3, "destroy_instance": 0.3, "set_mig_mode": 0.3}
    slow = SimulatedBackend("h200-141gb", state_file=state)  # takes the file's latency
    t0 = time.monotonic()
    made = slow.create_instance(0, 19, 0)
    assert time.monotonic() - t0 >= 0.3
    # A child process sees it too.
    timed = _in_child(state, "import time\nt0 = time.monotonic()\nsim.destroy_instance(0, 7)\n"
                             "print(time.monotonic() - t0 >= 0.3)\n")
    assert timed == "True\n" and made.gi_id == 7
    # An explicit latency overrides the file's, here per operation.
    fast = SimulatedBackend("h200-141gb", state_file=state, latency_s={"create_instance": 0.0})
    t0 = time.monotonic()
    fast.create_instance(0, 19, 1)
    assert time.monotonic() - t0 < 0.3


def test_latency_holds_up_only_its_own_gpu(tmp_path: Path) -> None:
    # 1 s per create: creates on two GPUs overlap (about 1 s), two on one GPU queue (about 2 s).
    sim = SimulatedBackend("h200-141gb", count=2, state_file=str(tmp_path / "s.json"), latency_s=1.0)

    def both(first: tuple[int, int], second: tuple[int, int]) -> float:
        t0 = time.monotonic()
        threads = [threading.Thread(target=sim.create_instance, args=(gpu, 19, start))
                   for gpu, start in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        return time.monotonic() - t0

    assert 1.0 <= both((0, 0), (1, 0)) < 1.9
    assert both((0, 1), (0, 2)) >= 2.0
    assert sorted((g, i.start) for g in (0, 1) for i in sim.instances(g)) == [(0, 0), (0, 1), (0, 2), (1, 0)]


@pytest.mark.parametrize("latency", [-1, float("nan"), float("inf"), 601, "1.5", True, {"explode": 1.0}])
def test_a_bad_latency_is_refused(latency: object) -> None:
    with pytest.raises(ValueError) as bad:
        SimulatedBackend("h200-141gb", latency_s=latency)  # type: ignore[arg-type]
    assert "latency" in str(bad.value)


def test_fault_arguments_are_checked() -> None:
    sim = SimulatedBackend("h200-141gb")
    for call in (lambda: sim.inject_fault("explode", "IN_USE"), lambda: sim.inject_fault("gpus", "NOPE"),
                 lambda: sim.inject_fault("gpus", "IN_USE", times=0)):
        with pytest.raises(ValueError):
            call()


# ---- the state file --------------------------------------------------------------------------------

_GOOD = {
    "version": 1, "model": "h200-141gb",
    "gpus": [{"mig_enabled": True, "generation": 1, "instances": [
        {"gi_id": 7, "profile_id": 19, "start": 0, "size": 1, "ci_id": 0, "generation": 1, "in_use": False}]}],
}


def _with(path: str, value: object) -> dict:
    """_GOOD with the field at ``path`` (dot-separated, list indices as numbers) set to ``value``."""
    data = json.loads(json.dumps(_GOOD))
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


_INSTANCE = "gpus.0.instances.0"
BAD_CONTENTS = {
    "not-json": b"{not json",
    "binary": bytes(range(256)),
    "utf-16": json.dumps(_GOOD).encode("utf-16"),
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "huge-int": b'{"version": ' + b"1" * 5001 + b"}",
    "top-list": b"[]",
    "no-version": json.dumps({k: v for k, v in _GOOD.items() if k != "version"}).encode(),
    "version-2": json.dumps(_with("version", 2)).encode(),
    "model-number": json.dumps(_with("model", 7)).encode(),
    "gpus-object": json.dumps(_with("gpus", {})).encode(),
    "gpu-string": json.dumps(_with("gpus.0", "x")).encode(),
    "mig-enabled-string": json.dumps(_with("gpus.0.mig_enabled", "yes")).encode(),
    "generation-negative": json.dumps(_with("gpus.0.generation", -1)).encode(),
    "instances-null": json.dumps(_with("gpus.0.instances", None)).encode(),
    "instance-missing-field": json.dumps(_with(_INSTANCE, {"gi_id": 7})).encode(),
    "instance-extra-field": json.dumps(_with(_INSTANCE + ".colour", "red")).encode(),
    "instance-string-id": json.dumps(_with(_INSTANCE + ".gi_id", "7")).encode(),
    "instance-bool-start": json.dumps(_with(_INSTANCE + ".start", False)).encode(),
    "unknown-profile": json.dumps(_with(_INSTANCE + ".profile_id", 99)).encode(),
    "illegal-start": json.dumps(_with(_INSTANCE + ".start", 7)).encode(),
    "wrong-gi-id": json.dumps(_with(_INSTANCE + ".gi_id", 3)).encode(),
    "ci-id-5": json.dumps(_with(_INSTANCE + ".ci_id", 5)).encode(),
    "busy-without-ci": json.dumps(_with(_INSTANCE, {**_GOOD["gpus"][0]["instances"][0], "ci_id": -1,
                                                      "in_use": True})).encode(),
    "future-generation": json.dumps(_with(_INSTANCE + ".generation", 9)).encode(),
    "overlap": json.dumps(_with("gpus.0.instances", [
        {"gi_id": 7, "profile_id": 19, "start": 0, "size": 1, "ci_id": 0, "generation": 1, "in_use": False},
        {"gi_id": 3, "profile_id": 14, "start": 0, "size": 2, "ci_id": 0, "generation": 1, "in_use": False},
    ])).encode(),
    "faults-list": json.dumps({**_GOOD, "faults": []}).encode(),
    "fault-op": json.dumps({**_GOOD, "faults": {"explode": [["IN_USE", 1]]}}).encode(),
    "fault-entry": json.dumps({**_GOOD, "faults": {"gpus": [["IN_USE", 0]]}}).encode(),
    "latency-negative": json.dumps({**_GOOD, "latency_s": {"create_instance": -1}}).encode(),
}


@pytest.mark.parametrize("name", sorted(BAD_CONTENTS))
def test_a_bad_state_file_is_one_line_gpu_error(name: str, tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_bytes(json.dumps(_GOOD).encode())
    sim = SimulatedBackend("h200-141gb", state_file=str(path))
    assert [i.gi_id for i in sim.instances(0)] == [7]  # the good file is accepted as it is
    path.write_bytes(BAD_CONTENTS[name])
    for call in (lambda: SimulatedBackend("h200-141gb", state_file=str(path)), sim.gpus, lambda: sim.model(0),
                 lambda: sim.create_instance(0, 19, 1)):
        with pytest.raises(GpuError) as bad:
            call()
        message = str(bad.value)
        assert bad.value.name == "UNKNOWN" and "is not usable" in message and str(path) in message
        assert "\n" not in message and len(message) < 400, message
    assert path.read_bytes() == BAD_CONTENTS[name]  # a refused file is left as it was


# The file's layout, written out by hand: other processes (and older agents) read it.
_STATE_TEXT = """{
 "version": 1,
 "model": "h200-141gb",
 "gpus": [
  {
   "mig_enabled": true,
   "generation": 3,
   "instances": [
    {
     "gi_id": 7,
     "profile_id": 19,
     "start": 0,
     "size": 1,
     "ci_id": 0,
     "generation": 1,
     "in_use": false
    },
    {
     "gi_id": 10,
     "profile_id": 19,
     "start": 3,
     "size": 1,
     "ci_id": 0,
     "generation": 2,
     "in_use": true
    },
    {
     "gi_id": 12,
     "profile_id": 19,
     "start": 5,
     "size": 1,
     "ci_id": -1,
     "generation": 3,
     "in_use": false
    }
   ]
  },
  {
   "mig_enabled": true,
   "generation": 0,
   "instances": []
  }
 ],
 "faults": {
  "destroy_instance": [
   [
    "IN_USE",
    2
   ]
  ]
 },
 "latency_s": {
  "create_instance": 1.5
 }
}"""


def test_the_state_file_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.json"
    fsyncs: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: fsyncs.append(fd) or real_fsync(fd))
    sim = SimulatedBackend("h200-141gb", count=2, state_file=str(path))
    for start in (0, 3):
        sim.create_instance(0, 19, start)
    sim.create_half_instance(0, 19, 5)
    sim.set_in_use(0, 10, True)
    sim.inject_fault("destroy_instance", "IN_USE", 2)
    sim.set_latency({"create_instance": 1.5})
    assert path.read_text() == _STATE_TEXT
    assert fsyncs == []  # the simulated MIG state is not kept across a power cut, as on hardware
    # Read back as it was written, by another backend.
    other = SimulatedBackend("h200-141gb", count=2, state_file=str(path))
    assert [(i.gi_id, i.ci_id, i.in_use) for i in other.instances(0)] == [(7, 0, False), (10, 0, True), (12, -1, False)]
    assert path.read_text() == _STATE_TEXT


def test_a_gpu_without_mig_holds_no_mig_state(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    SimulatedBackend("l4-24gb", state_file=str(path))
    data = json.loads(path.read_text())
    assert data["gpus"] == [{"mig_enabled": False, "generation": 0, "instances": []}]
    data["gpus"][0]["mig_enabled"] = True
    path.write_text(json.dumps(data))
    with pytest.raises(GpuError, match="l4-24gb has no MIG"):
        SimulatedBackend("l4-24gb", state_file=str(path))


def test_an_empty_state_file_is_a_fresh_simulator(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.touch()
    sim = SimulatedBackend("h200-141gb", state_file=str(path))
    assert json.loads(path.read_text())["gpus"] == [{"mig_enabled": True, "generation": 0, "instances": []}]
    assert sim.instances(0) == []


def test_a_state_file_must_be_a_regular_file_in_a_directory_that_exists(tmp_path: Path) -> None:
    lock = Path("/dev/null.lock")
    existed = lock.exists()
    for path in ("/dev/null", str(tmp_path)):
        with pytest.raises(ValueError) as refused:
            SimulatedBackend("h200-141gb", state_file=path)
        assert "exists and is not a regular file" in str(refused.value)
    assert lock.exists() == existed, "nothing may be created beside /dev/null"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        SimulatedBackend("h200-141gb", state_file=str(fifo))
    (tmp_path / "busy.json.lock").mkdir()
    with pytest.raises(ValueError, match="busy.json.lock' exists and is not a regular file"):
        SimulatedBackend("h200-141gb", state_file=str(tmp_path / "busy.json"))
    with pytest.raises(ValueError, match="does not exist"):
        SimulatedBackend("h200-141gb", state_file=str(tmp_path / "missing" / "s.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy.json.lock", "fifo"]


def test_a_state_file_in_a_read_only_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root, who may write anywhere; so the directory is made read-only as access() sees it.
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real_access(path, mode)
    )
    with pytest.raises(ValueError, match="is not writable"):
        SimulatedBackend("h200-141gb", state_file=str(tmp_path / "s.json"))
    assert list(tmp_path.iterdir()) == []


def test_a_long_backend_spec_is_quoted_short() -> None:
    for spec in ("sim:" + "h" * 5000, "sim:h200-141gbx" + "9" * 5000, "x" * 5000):
        with pytest.raises(ValueError) as bad:
            open_backend(spec)
        assert len(str(bad.value)) < 400 and "sim:h200-141gbx2" in str(bad.value)


def test_a_simulated_reboot_loses_every_instance_keeps_mig_mode_and_changes_the_boot_id(tmp_path: Path) -> None:
    from mig_operator.gpu.files import host_boot_id

    state = str(tmp_path / "state.json")
    sim = SimulatedBackend("h100-80gb", count=2, state_file=state)
    assert sim.boot_id() == host_boot_id()  # never rebooted: the host's boot
    sim.create_instance(0, 19, 0)
    sim.create_instance(1, 9, 4)
    sim.reboot()
    again = SimulatedBackend("h100-80gb", count=2, state_file=state)  # another process reads the file
    assert [again.instances(i) for i in (0, 1)] == [[], []]
    assert all(g.mig_enabled for g in again.gpus())
    first = again.boot_id()
    assert first != host_boot_id() and first == sim.boot_id()
    again.reboot()
    assert sim.boot_id() not in (first, host_boot_id())


def test_the_host_boot_id_is_read_from_the_kernel_file_and_unknown_without_it(tmp_path: Path) -> None:
    from mig_operator.gpu.files import host_boot_id

    f = tmp_path / "boot_id"
    f.write_text("abc-123\n")
    assert host_boot_id(str(f)) == "abc-123"
    assert host_boot_id(str(tmp_path / "missing")) == "unknown"


def test_a_state_file_with_a_boot_id_that_is_not_a_string_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    SimulatedBackend("h100-80gb", state_file=str(state)).reboot()
    data = json.loads(state.read_text())
    data["bootId"] = 7
    state.write_text(json.dumps(data))
    with pytest.raises(GpuError, match="bootId"):
        SimulatedBackend("h100-80gb", state_file=str(state))
