"""The simulator must answer as NVML does, since the agent's tests and the demo trust it."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mig_operator.core.placement.profiles import CATALOG, get_model
from mig_operator.gpu import open_backend, sim_state
from mig_operator.gpu.inventory import describe
from mig_operator.gpu.protocol import GpuBackend, GpuError
from mig_operator.gpu.simulated import SimulatedBackend, gpu_uuid

MIG_MODELS = sorted(name for name, model in CATALOG.items() if model.mig_capable)
NO_MIG_MODELS = sorted(name for name, model in CATALOG.items() if not model.mig_capable)


def _error(excinfo: pytest.ExceptionInfo[GpuError]) -> str:
    return excinfo.value.name


@pytest.mark.parametrize("model_name", MIG_MODELS)
def test_only_legal_placements_are_accepted(model_name: str) -> None:
    model = get_model(model_name)
    for profile in model.profiles:
        legal = {p.start for p in profile.placements}
        for start in range(model.memory_slots + 1):
            sim = SimulatedBackend(model_name)
            if start in legal:
                made = sim.create_instance(0, profile.id, start)
                assert (made.profile, made.start, made.size) == (profile.name, start, profile.size)
            else:
                with pytest.raises(GpuError) as bad:
                    sim.create_instance(0, profile.id, start)
                assert _error(bad) == "INVALID_ARGUMENT" and bad.value.code == 2
                assert f"start {start}" in str(bad.value)


def test_unknown_profile_and_gpu_are_invalid_arguments() -> None:
    sim = SimulatedBackend("h200-141gb")
    with pytest.raises(GpuError) as bad_profile:
        sim.create_instance(0, 99, 0)
    with pytest.raises(GpuError) as bad_gpu:
        sim.instances(1)
    assert _error(bad_profile) == _error(bad_gpu) == "INVALID_ARGUMENT"


def test_overlap_is_insufficient_resources_not_already_exists() -> None:
    sim = SimulatedBackend("h200-141gb")
    sim.create_instance(0, 19, 5)  # 1g at slot 5
    with pytest.raises(GpuError) as overlap:
        sim.create_instance(0, 9, 4)  # 3g over slots 4-7
    assert _error(overlap) == "INSUFFICIENT_RESOURCES" and overlap.value.code == 23
    assert not overlap.value.transient
    with pytest.raises(GpuError):
        sim.create_instance(0, 19, 5)  # the very same placement again
    sim.create_instance(0, 9, 0)  # the other half is still free
    assert sorted(i.start for i in sim.instances(0)) == [0, 5]


def test_max_instances_of_a_profile() -> None:
    sim = SimulatedBackend("h100-80gb")
    sim.create_instance(0, 20, 0)  # 1g.10gb+me: one per GPU
    with pytest.raises(GpuError) as second:
        sim.create_instance(0, 20, 3)
    assert _error(second) == "INSUFFICIENT_RESOURCES" and "maximum of 1" in str(second.value)
    for start in range(1, 7):
        sim.create_instance(0, 19, start)
    assert len(sim.instances(0)) == 7


def test_destroying_a_used_instance_is_in_use_and_retryable() -> None:
    sim = SimulatedBackend("h200-141gb")
    made = sim.create_instance(0, 14, 2)
    sim.set_in_use(0, made.gi_id, True)
    assert sim.instances(0)[0].in_use
    with pytest.raises(GpuError) as busy:
        sim.destroy_instance(0, made.gi_id)
    assert _error(busy) == "IN_USE" and busy.value.code == 19 and busy.value.transient
    assert "placement 2:2" in str(busy.value) and "GPU 0" in str(busy.value)
    sim.set_in_use(0, made.gi_id, False)
    sim.destroy_instance(0, made.gi_id)
    assert sim.instances(0) == []
    with pytest.raises(GpuError) as gone:
        sim.destroy_instance(0, made.gi_id)
    assert _error(gone) == "NOT_FOUND"


def test_mig_mode_off_is_not_supported_until_enabled() -> None:
    sim = SimulatedBackend("h200-141gb", count=2, mig_enabled=False)
    assert [g.mig_enabled for g in sim.gpus()] == [False, False]
    assert sim.model(0).profiles  # profiles answer with MIG disabled, as on the real H200
    for call in (lambda: sim.instances(0), lambda: sim.create_instance(0, 19, 0)):
        with pytest.raises(GpuError) as off:
            call()
        assert _error(off) == "NOT_SUPPORTED"
    sim.set_mig_mode(0, True)
    assert [g.mig_enabled for g in sim.gpus()] == [True, False]
    made = sim.create_instance(0, 19, 0)
    with pytest.raises(GpuError) as busy:
        sim.set_mig_mode(0, False)  # instances exist: the GPU is not idle
    assert _error(busy) == "IN_USE"
    sim.destroy_instance(0, made.gi_id)
    sim.set_mig_mode(0, False)
    assert not sim.gpus()[0].mig_enabled


def test_gi_ids_follow_the_hardware_numbering_and_ci_is_zero() -> None:
    sim = SimulatedBackend("h100-80gb")
    ids = {(i.start, i.size): (i.gi_id, i.ci_id) for i in (
        sim.create_instance(0, 9, 4), sim.create_instance(0, 14, 0), sim.create_instance(0, 19, 2),
        sim.create_instance(0, 19, 3),
    )}
    # nvidia-smi on A100/H100: 3g at 4:4 is GI 2, 2g at 0:2 GI 3, 1g at slot n is GI 7+n.
    assert ids == {(4, 4): (2, 0), (0, 2): (3, 0), (2, 1): (9, 0), (3, 1): (10, 0)}
    assert [i.gi_id for i in sim.instances(0)] == [2, 3, 9, 10]


def test_state_persists_across_backend_objects(tmp_path: Path) -> None:
    state = str(tmp_path / "sim.json")
    first = SimulatedBackend("h200-141gb", count=2, state_file=state)
    made = first.create_instance(1, 15, 6)
    first.set_in_use(1, made.gi_id, True)
    first.close()
    second = SimulatedBackend("h200-141gb", count=2, state_file=state)
    assert second.instances(1) == [made.__class__(**{**made.__dict__, "in_use": True})]
    assert second.instances(0) == []
    # The first object sees what the second does: every operation reads the file afresh.
    second.set_in_use(1, made.gi_id, False)
    second.destroy_instance(1, made.gi_id)
    assert first.instances(1) == []
    data = json.loads(Path(state).read_text())
    assert data["model"] == "h200-141gb" and len(data["gpus"]) == 2
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".simstate-")]  # no temp file left


def test_another_backends_change_is_seen_through_the_cache(tmp_path: Path) -> None:
    state = str(tmp_path / "sim.json")
    a = SimulatedBackend("h200-141gb", state_file=state)
    assert a.instances(0) == [] and a.instances(0) == []  # a's cache now holds the file's bytes
    b = SimulatedBackend("h200-141gb", state_file=state)
    made = b.create_instance(0, 19, 3)
    assert a.instances(0) == [made]
    b.inject_fault("instances", "TIMEOUT")
    with pytest.raises(GpuError) as injected:
        a.instances(0)
    assert _error(injected) == "TIMEOUT"
    # Recreated: a file of the same size (generation 1 becomes 2), likely within the same mtime tick.
    size = os.path.getsize(state)
    b.destroy_instance(0, made.gi_id)
    remade = b.create_instance(0, 19, 3)
    assert os.path.getsize(state) == size and remade.device_uuid != made.device_uuid
    assert a.instances(0) == [remade]


def _counting_decode(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the state file's decodes (the field-by-field check every parse of the file runs)."""
    calls: list[int] = []
    real = sim_state._decode

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_state, "_decode", counted)
    return calls


def test_the_state_file_is_decoded_only_when_its_bytes_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = str(tmp_path / "sim.json")
    a = SimulatedBackend("h200-141gb", count=2, state_file=state)
    made = a.create_instance(1, 15, 2)
    decodes = _counting_decode(monkeypatch)
    inode = os.stat(state).st_ino
    for _ in range(3):
        assert a.instances(1) == [made] and [g.index for g in a.gpus()] == [0, 1]
    assert decodes == [] and os.stat(state).st_ino == inode  # neither decoded nor rewritten
    a.set_in_use(1, made.gi_id, True)  # a's own write: the bytes it wrote are those it holds
    assert a.instances(1)[0].in_use and decodes == []
    b = SimulatedBackend("h200-141gb", count=2, state_file=state)  # decodes once, at start
    b.create_instance(0, 19, 0)
    del decodes[:]
    assert [i.gi_id for i in a.instances(0)] == [7] and len(decodes) == 1
    assert [i.gi_id for i in a.instances(0)] == [7] and len(decodes) == 1


def test_a_state_not_saved_is_not_served_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = str(tmp_path / "sim.json")
    sim = SimulatedBackend("h200-141gb", state_file=state)
    assert sim.instances(0) == []
    before = Path(state).read_bytes()
    real_write = sim_state.write_atomically

    def full_disk(*args: object, **kwargs: object) -> None:
        monkeypatch.setattr(sim_state, "write_atomically", real_write)  # this once
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sim_state, "write_atomically", full_disk)
    with pytest.raises(GpuError, match="No space left on device"):
        sim.create_instance(0, 19, 0)
    assert Path(state).read_bytes() == before and sim.instances(0) == []  # the file's state, not memory's
    # An operation that fails otherwise than with a GpuError after changing the state: not saved either.
    with monkeypatch.context() as patched:
        patched.setattr(SimulatedBackend, "_record", lambda *_: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            sim.create_instance(0, 19, 1)
    assert Path(state).read_bytes() == before and sim.instances(0) == []
    assert [i.start for i in SimulatedBackend("h200-141gb", state_file=state).instances(0)] == []


def test_a_foreign_state_file_is_refused(tmp_path: Path) -> None:
    state = str(tmp_path / "sim.json")
    SimulatedBackend("h200-141gb", state_file=state)
    for model, count in (("a30-24gb", 1), ("h200-141gb", 2)):
        with pytest.raises(GpuError) as foreign:
            SimulatedBackend(model, count=count, state_file=state)
        assert foreign.value.name == "INVALID_ARGUMENT"
        assert "holds 1 GPU(s) of 'h200-141gb'" in str(foreign.value) and "use another file" in str(foreign.value)


def _create_in_child(state: str, start: int) -> None:
    SimulatedBackend("h200-141gb", state_file=state).create_instance(0, 19, start)


def test_processes_sharing_a_state_file_lose_no_instance(tmp_path: Path) -> None:
    state = str(tmp_path / "sim.json")
    SimulatedBackend("h200-141gb", state_file=state, latency_s=0.02)
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=_create_in_child, args=(state, s)) for s in range(7)]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    assert [c.exitcode for c in children] == [0] * 7
    assert sorted(i.start for i in SimulatedBackend("h200-141gb", state_file=state).instances(0)) == list(range(7))


def test_uuids_are_stable_and_a_recreated_instance_gets_a_new_one(tmp_path: Path) -> None:
    a, b = SimulatedBackend("h200-141gb", count=2), SimulatedBackend("h200-141gb", count=2)
    assert [g.uuid for g in a.gpus()] == [g.uuid for g in b.gpus()] == [gpu_uuid("h200-141gb", i) for i in (0, 1)]
    assert a.gpus()[0].uuid != a.gpus()[1].uuid
    assert a.gpus()[0].uuid != SimulatedBackend("h100-80gb").gpus()[0].uuid
    first = a.create_instance(0, 5, 0)
    assert first.device_uuid == b.create_instance(0, 5, 0).device_uuid  # same history, same UUID
    assert a.instances(0)[0].device_uuid == first.device_uuid  # listing repeats it
    a.destroy_instance(0, first.gi_id)
    again = a.create_instance(0, 5, 0)
    assert again.gi_id == first.gi_id and again.device_uuid != first.device_uuid
    # The creation counter is part of the persisted state, so a restart cannot reissue a UUID.
    state = str(tmp_path / "s.json")
    one = SimulatedBackend("h200-141gb", state_file=state)
    old = one.create_instance(0, 0, 0)
    one.destroy_instance(0, old.gi_id)
    assert SimulatedBackend("h200-141gb", state_file=state).create_instance(0, 0, 0).device_uuid != old.device_uuid


def test_injected_faults_fire_the_asked_number_of_times() -> None:
    sim = SimulatedBackend("h200-141gb")
    sim.inject_fault("create_instance", "INSUFFICIENT_RESOURCES", times=2)
    for _ in range(2):
        with pytest.raises(GpuError) as fault:
            sim.create_instance(0, 19, 0)
        assert _error(fault) == "INSUFFICIENT_RESOURCES" and "injected" in str(fault.value)
    made = sim.create_instance(0, 19, 0)
    sim.inject_fault("destroy_instance", "TIMEOUT")
    with pytest.raises(GpuError) as timeout:
        sim.destroy_instance(0, made.gi_id)
    assert timeout.value.transient and timeout.value.code == 10
    sim.destroy_instance(0, made.gi_id)
    with pytest.raises(ValueError):
        sim.inject_fault("explode", "IN_USE")
    with pytest.raises(ValueError):
        sim.inject_fault("create_instance", "NOT_AN_ERROR")


def test_a_failed_compute_instance_leaves_no_gpu_instance(tmp_path: Path) -> None:
    sim = SimulatedBackend("h200-141gb", state_file=str(tmp_path / "s.json"))
    sim.inject_fault("create_compute_instance", "INSUFFICIENT_RESOURCES")
    with pytest.raises(GpuError):
        sim.create_instance(0, 9, 0)
    assert sim.instances(0) == []
    assert sim.create_instance(0, 9, 0).start == 0  # the placement is free again


def test_gpu_error_vocabulary() -> None:
    err = GpuError(19, "destroy GPU instance 3 on GPU 0")
    assert (err.name, err.code, err.transient) == ("IN_USE", 19, True)
    assert GpuError("GPU_IS_LOST", "x").transient is False  # needs a reset, which we never do
    copy = pickle.loads(pickle.dumps(GpuError("NOT_FOUND", "find GI 4")))
    assert (copy.name, copy.code, copy.message) == ("NOT_FOUND", 6, "find GI 4")
    with pytest.raises(ValueError):
        GpuError("NOPE", "x")


@pytest.mark.parametrize(
    ("spec", "model", "count"),
    [("sim:h200-141gb", "h200-141gb", 1), ("sim:h200-141gbx2", "h200-141gb", 2), ("sim:a30-24gbx8", "a30-24gb", 8)],
)
def test_open_backend_specs(spec: str, model: str, count: int, tmp_path: Path) -> None:
    backend = open_backend(spec, state_file=str(tmp_path / "s.json"))
    assert isinstance(backend, GpuBackend)
    gpus = backend.gpus()
    assert len(gpus) == count and backend.model(count - 1).name == model
    assert (tmp_path / "s.json").exists()


@pytest.mark.parametrize("spec", ["", "sim:", "sim:h300-1gb", "sim:h200-141gbx0", "sim:h200-141gbx99", "cuda",
                                  "SIM:h200-141gb", "sim:h200-141gb x2"])
def test_open_backend_rejects_bad_specs_with_an_example(spec: str) -> None:
    with pytest.raises(ValueError) as bad:
        open_backend(spec)
    message = str(bad.value)
    assert repr(spec) in message and "sim:h200-141gbx2" in message and "\n" not in message


def test_describe_lists_every_catalog_profile_and_instance() -> None:
    sim = SimulatedBackend("a30-24gb")
    sim.create_instance(0, 5, 2)
    [gpu] = describe(sim)["gpus"]
    model = get_model("a30-24gb")
    assert [(p["name"], p["id"], p["memory_mib"]) for p in gpu["profiles"]] == [
        (p.name, p.id, p.memory_mib) for p in model.profiles
    ]
    assert gpu["profiles"][2]["placements"] == [[0, 2], [2, 2]]
    assert [(i["profile"], i["start"], i["size"], i["gi_id"]) for i in gpu["instances"]] == [("2g.12gb", 2, 2, 2)]


# ---- property: random create/destroy sequences against a brute-force slot model ----------------------

_OPS = st.lists(
    st.tuples(st.sampled_from(["create", "half", "complete", "destroy", "busy"]), st.integers(0, 40),
              st.integers(0, 8)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(model_name=st.sampled_from(MIG_MODELS), ops=_OPS)
def test_random_sequences_agree_with_a_slot_model(model_name: str, ops: list[tuple[str, int, int]]) -> None:
    model = get_model(model_name)
    sim = SimulatedBackend(model_name)
    compute = max(p.slices for p in model.profiles)
    # Oracle: gi_id -> (profile, start, busy, has its compute instance), checked slot by slot, not by masks.
    held: dict[int, tuple[int, int, bool, bool]] = {}
    for kind, pick, start in ops:
        if kind in ("create", "half"):
            profile = model.profiles[pick % len(model.profiles)]
            used = [s for pid, st_, _b, _c in held.values()
                    for s in range(st_, st_ + model.profile_by_id(pid).size)]
            wanted = list(range(start, start + profile.size))
            if start not in {p.start for p in profile.placements}:
                expected = "INVALID_ARGUMENT"
            elif set(used) & set(wanted):
                expected = "INSUFFICIENT_RESOURCES"
            elif sum(1 for pid, _s, _b, _c in held.values() if pid == profile.id) >= profile.max_instances:
                expected = "INSUFFICIENT_RESOURCES"
            elif sum(model.profile_by_id(pid).slices for pid, _s, _b, _c in held.values()) + profile.slices > compute:
                expected = "INSUFFICIENT_RESOURCES"
            else:
                expected = "ok"
            make = sim.create_instance if kind == "create" else sim.create_half_instance
            try:
                made = make(0, profile.id, start)
                outcome = "ok"
                held[made.gi_id] = (profile.id, start, False, kind == "create")
                assert made.complete == (kind == "create")
            except GpuError as exc:
                outcome = exc.name
            assert outcome == expected, (profile.name, start, held)
        elif held:
            gi_id = sorted(held)[pick % len(held)]
            pid, st_, busy, complete = held[gi_id]
            if kind == "busy":
                try:
                    sim.set_in_use(0, gi_id, not busy)
                    held[gi_id] = (pid, st_, not busy, complete)
                    assert complete or busy
                except GpuError as exc:
                    assert not complete and exc.name == "INVALID_ARGUMENT"
                continue
            if kind == "complete":
                done = sim.create_compute_instance(0, gi_id)
                assert done.complete and (done.gi_id, done.start) == (gi_id, st_)
                held[gi_id] = (pid, st_, busy, True)
                continue
            try:
                sim.destroy_instance(0, gi_id)
                assert not busy
                del held[gi_id]
            except GpuError as exc:
                assert busy and exc.name == "IN_USE"
        listed = sim.instances(0)
        slots = [s for i in listed for s in range(i.start, i.start + i.size)]
        assert len(slots) == len(set(slots)), "instances overlap"
        assert all(0 <= s < model.memory_slots for s in slots)
        assert {i.gi_id: (i.profile_id, i.start, i.in_use, i.complete) for i in listed} == held
        assert all((i.ci_id == 0) == i.complete and (i.device_uuid != "") == i.complete for i in listed)
        uuids = [i.device_uuid for i in listed if i.complete]
        assert len(set(uuids)) == len(uuids)
