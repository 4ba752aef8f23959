"""Compute shares through MPS on a real GPU, through the agent and its CDI specs (issue 26).

The node agent on its NVML backend realises fraction slices of one GPU with compute shares 0.25
and 0.75, then (a GPU's shares sum to at most 1) 0.5 and 0.5: the first one starts the GPU's MPS
control daemon (``gpu/mps.py``: NVIDIA's
``nvidia-cuda-mps-control``, its own pipe, log and shm directories, in a mount namespace whose
``/dev/shm`` is its shm directory). The kubelet's calls prepare a claim of each; the official CDI
library applies each slice's spec to an OCI spec, and busy PyTorch processes
(``bench/mps_share.py worker``) run in the stand-in container of ``test_fraction_path.py`` (a
private mount namespace, the spec's device nodes and mounts, ``env -i`` with the spec's environment).

Checked against numbers worked out here, not by the code under test: each spec's MPS variables
(25 -> ``25``, 8 GiB -> ``0=8192M``) and mounts; the split of two busy processes' combined
throughput within 3 points of 25/75 and 50/50, a CUDA graph's replays held like launches; the
shim's limit still holding under MPS; the daemon stopped once the last slice is gone. Reported:
one process alone at 0.25 against the whole GPU, and a latency-sensitive process's p99 beside
training at 0.75 against alone (``bench/mps_latency.py``'s paired rounds, in the slices' containers).
The MPS daemon is stopped at the end whatever happens. Needs what test_fraction_path
needs (root, unshare, cdi-validate); skipped without a GPU.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from test_fraction_path import (  # noqa: F401 (fixtures)
    IMAGE_VARIABLES,
    LIMIT_IN_CONTAINER,
    NAMESPACE,
    NODE,
    PRELOAD_IN_CONTAINER,
    ApiDouble,
    NoEvents,
    allocated_claim,
    apply_cdi,
    bound_fraction,
    cdi_validate,
    container_script,
    container_tools,
    placeholders,
    shim_library,
    short_dir,
)

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "mps_share.py"
LATENCY = REPO / "bench" / "mps_latency.py"
GIB = 2**30
SECONDS = 8.0
GRANTED = 8 * GIB
# name, UID, compute share, and the active-thread percentage worked out by hand
SLICES = (("quarter", "b1e2c3d4-0001-4a5b-8c6d-7e8f9a0b1c2d", 0.25, "25"),
          ("three-quarters", "b1e2c3d4-0002-4a5b-8c6d-7e8f9a0b1c2d", 0.75, "75"),
          ("half-a", "b1e2c3d4-0003-4a5b-8c6d-7e8f9a0b1c2d", 0.5, "50"),
          ("half-b", "b1e2c3d4-0004-4a5b-8c6d-7e8f9a0b1c2d", 0.5, "50"))
PINNED = "0=8192M"  # 8 GiB in MiB, for the container's only device (ordinal 0)

sys.path.insert(0, str(REPO / "bench"))


STARTED: list[subprocess.Popen] = []  # every worker, killed at the end if still there


def container_launch(oci: dict, stderr_dir: Path, program: Path = BENCH) -> Any:
    """A launcher for ``bench.mps_share.run_together`` (or ``bench.mps_latency.section`` with its
    ``program``): the worker as the OCI spec's process in the stand-in container; ``env`` changes the
    spec's environment (an empty value removes a variable)."""
    def launch(env: Mapping[str, str], args: Sequence[str]) -> subprocess.Popen:
        spec = copy.deepcopy(oci)
        variables = dict(v.split("=", 1) for v in spec["process"]["env"])
        for key, value in env.items():
            if value:
                variables[key] = value
            else:
                variables.pop(key, None)
        spec["process"]["env"] = [f"{k}={v}" for k, v in variables.items()]
        spec["process"]["args"] = [sys.executable, str(program), *args]
        log = open(stderr_dir / f"{args[1]}-{len(list(stderr_dir.iterdir()))}.stderr", "w")  # noqa: SIM115
        proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", container_script(spec)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        STARTED.append(proc)
        return proc
    return launch


def without_mount(oci: dict, destination: str) -> dict:
    spec = copy.deepcopy(oci)
    spec["mounts"] = [m for m in spec.get("mounts") or [] if m["destination"] != destination]
    return spec


def with_mount_source(oci: dict, destination: str, source: Path) -> dict:
    spec = copy.deepcopy(oci)
    [mount] = [m for m in spec["mounts"] if m["destination"] == destination]
    mount["source"] = str(source)
    return spec


def test_compute_shares_split_the_gpu_through_the_agents_mps_daemon(
        gpu: str, cdi_validate: Path, container_tools: None, shim_library: Path, short_dir: Path) -> None:  # noqa: F811
    from agent_events import event
    from mps_latency import Plan, compare, section
    from mps_share import host_launch, run_together, split

    from mig_operator.core.books.slice_claim import claim_path as resource_claim_path
    from mig_operator.core.node.cdi import spec_file_name
    from mig_operator.gpu import open_backend
    from mig_operator.gpu.mps import mps_for_backend
    from mig_operator.kube.agent.agent import NodeAgent
    from mig_operator.kube.agent.context import AgentSettings
    from mig_operator.kube.agent.kubelet.settings import PluginSettings
    from mig_operator.kube.agent.kubelet.transport import KubeletPlugin
    from mig_operator.kube.agent.record import RecordStore
    from mig_operator.kube.common.client import gpunode_path, slice_path

    backend = open_backend("nvml")
    serving = [g for g in backend.gpus() if not g.mig_enabled]
    if not serving:
        backend.close()
        pytest.skip("every GPU here is in MIG mode; compute shares need one that is not")
    target = serving[0]
    node_shim = short_dir / "node-lib" / "shim" / "libgpuslice.so"
    node_shim.parent.mkdir(parents=True)
    node_shim.write_bytes(shim_library.read_bytes())
    settings = PluginSettings(registry_dir=str(short_dir / "reg"), plugin_dir=str(short_dir / "plug"),
                              cdi_dir=str(short_dir / "cdi"), shim_host_dir=str(node_shim.parent), nvidia_cdi_dirs=())
    (short_dir / "reg").mkdir()
    mps = mps_for_backend("nvml", settings.mps_host_dir)
    dirs = mps.dirs(target.uuid)
    assert dirs.root == f"{short_dir}/node-lib/mps/{target.uuid}"
    image_env = [f"{k}={os.environ[k]}" for k in IMAGE_VARIABLES if k in os.environ]
    logs = short_dir / "logs"
    logs.mkdir()
    out: dict[str, Any] = {"gpu": gpu, "uuid": target.uuid}
    # The whole GPU to one plain process, before any daemon: what the shares are measured against.
    out["alone_plain"] = run_together({"a": (host_launch(logs), {"CUDA_VISIBLE_DEVICES": target.uuid}, "matmul")},
                                      SECONDS)["a"]
    api = ApiDouble()
    specs: dict[str, dict] = {}
    ocis: dict[str, dict] = {}
    made: list[Path] = []

    async def scenario() -> None:
        store = RecordStore(str(short_dir / "owners.json"))
        agent = NodeAgent(AgentSettings(NODE, publish_delay_s=0.0, heartbeat_s=3600), backend, store, api,
                          NoEvents(), mps)  # type: ignore[arg-type]
        await agent.start()
        plugin = KubeletPlugin(agent, settings)
        assert await plugin.start()
        from fake_kubelet import FakeKubelet

        kubelet = FakeKubelet(settings.registration_socket, namespace=NAMESPACE, timeout_s=30)
        try:
            await kubelet.register()
            assert not mps.running(target.uuid)
            claims = {name: (f"claim-{uid}", name) for name, uid, _, _ in SLICES}

            async def realise_and_prepare(name: str, uid: str, share: float) -> None:
                body = bound_fraction(name, uid, target.index, GRANTED)
                body["spec"]["compute"] = share
                body["status"]["compute"] = str(share)
                api.objects[slice_path(NAMESPACE, name)] = body
                await event(agent, copy.deepcopy(body))
                st = api.objects[slice_path(NAMESPACE, name)]["status"]
                assert st["phase"] == "Ready", st
                api.objects[resource_claim_path(NAMESPACE, name)] = allocated_claim(claims[name][0], name, uid)
                answer = (await kubelet.prepare(claims[name])).claims[claims[name][0]]
                assert answer.error == "", answer.error
                specs[name] = json.loads((short_dir / "cdi" / spec_file_name(uid)).read_text())
                base = {"ociVersion": "1.2.0", "root": {"path": "rootfs"}, "linux": {},
                        "process": {"cwd": "/", "env": image_env, "args": ["true"]}}
                workdir = short_dir / name
                workdir.mkdir()
                _, ocis[name] = apply_cdi(cdi_validate, short_dir / "cdi", list(answer.devices[0].cdi_device_ids),
                                          base, workdir)

            # The first share starts the GPU's daemon; a client of it runs (so an MPS server does) while
            # the larger shares come, and the daemon's ceiling is raised on that running server too.
            name, uid, share, _ = SLICES[0]
            await realise_and_prepare(name, uid, share)
            assert mps.running(target.uuid)
            made.extend(placeholders(ocis["quarter"].get("mounts") or []))
            holder = container_launch(ocis["quarter"], logs)({}, ["worker", "small", "1"])
            assert holder.stdout is not None and holder.stdin is not None
            assert json.loads(holder.stdout.readline())["phase"] == "ready"
            out["servers_while_realising"] = mps.servers(target.uuid)
            name, uid, share, _ = SLICES[1]
            await realise_and_prepare(name, uid, share)
            holder.stdin.write("go\n")
            holder.stdin.close()
            assert holder.wait(60) == 0
            await agent.publish()
            conditions = {c["type"]: c for c in api.objects[gpunode_path(NODE)]["status"]["conditions"]}
            assert conditions["MPSReady"]["status"] == "True", conditions
            await asyncio.to_thread(measure_quarters)

            async def release(names: list[str]) -> None:
                assert all(not a.error for a in (await kubelet.unprepare(*(claims[n] for n in names))).claims.values())
                for name in names:
                    await event(agent, api.objects[slice_path(NAMESPACE, name)], deleted=True)
                await agent.publish()

            # The GPU's shares sum to at most 1: the halves come once the quarters are gone, and with
            # them the GPU's daemon, stopped with the last share and started again with the next.
            await release(["quarter", "three-quarters"])
            out["running_between"] = mps.running(target.uuid)
            for name, uid, share, _ in SLICES[2:]:
                await realise_and_prepare(name, uid, share)
            await asyncio.to_thread(measure_halves)
            await release(["half-a", "half-b"])
            out["running_after_last"] = mps.running(target.uuid)
            conditions = {c["type"]: c for c in api.objects[gpunode_path(NODE)]["status"]["conditions"]}
            out["condition_after_last"] = conditions["MPSReady"]
        finally:
            await kubelet.close()
            await plugin.stop()
            await agent.stop()

    def measure_halves() -> None:
        ha, hb = container_launch(ocis["half-a"], logs), container_launch(ocis["half-b"], logs)
        out["pair_50_50"] = run_together({"a": (ha, {}, "matmul"), "b": (hb, {}, "matmul")}, SECONDS)

    def measure_quarters() -> None:
        q, t = container_launch(ocis["quarter"], logs), container_launch(ocis["three-quarters"], logs)
        out["alone_0.25"] = run_together({"q": (q, {}, "matmul")}, SECONDS)["q"]
        out["pair_25_75"] = run_together({"q": (q, {}, "matmul"), "t": (t, {}, "matmul")}, SECONDS)
        out["graph_25_75"] = run_together({"q": (q, {}, "graph"), "t": (t, {}, "matmul")}, SECONDS)
        # The latency process at 0.25 alone and beside training at 0.75, in alternating paired rounds.
        plan, raw = Plan(rounds=6, phase_seconds=1.0, max_steps=3000), {}
        out["latency"] = section(target.uuid, (container_launch(ocis["quarter"], logs, LATENCY), {}),
                                 (container_launch(ocis["three-quarters"], logs, LATENCY), {}), plan, raw)
        out["latency_summary"] = compare(out["latency"], raw, plan.rounds)
        # Memory: the spec as it is; MPS alone (no shim: the spec without its /etc/ld.so.preload); the
        # client asking MPS for more; the shim's limit set below MPS's (does the shim still hold under
        # MPS?), its limit file holding 2 GiB.
        out["fill_spec"] = run_together({"q": (q, {}, "fill")}, SECONDS)["q"]
        no_shim = container_launch(without_mount(ocis["quarter"], PRELOAD_IN_CONTAINER), logs)
        out["fill_mps_only"] = run_together({"q": (no_shim, {}, "fill")}, SECONDS)["q"]
        out["fill_asks_more"] = run_together({"q": (q, {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=65536M"}, "fill")},
                                             SECONDS)["q"]
        two_gib = short_dir / "limit-2GiB"
        two_gib.write_text(f"{2 * GIB}\n")
        shim_2g = container_launch(with_mount_source(ocis["quarter"], LIMIT_IN_CONTAINER, two_gib), logs)
        out["fill_shim_2g"] = run_together({"q": (shim_2g, {}, "fill")}, SECONDS)["q"]

    try:
        asyncio.run(scenario())
    finally:
        for proc in STARTED:  # a worker left by a failure keeps the MPS server, and so the daemon, busy
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for path in made:
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink()
        mps.stop(target.uuid)  # whatever happened above
        backend.close()
        target_out = os.environ.get("MPS_SHARE_OUT")
        if target_out:
            Path(target_out).write_text(json.dumps({**out, "specs": specs}, indent=1, default=str) + "\n")

    alone = out["alone_plain"]["rate"]
    report = {
        "alone_plain_it_s": round(alone, 1),
        "alone_0.25_of_gpu_pct": round(100 * out["alone_0.25"]["rate"] / alone, 1),
        "pair_25_75_split_pct": round(split(out["pair_25_75"], "q", "t"), 2),
        "pair_50_50_split_pct": round(split(out["pair_50_50"], "a", "b"), 2),
        "graph_25_75_split_pct": round(split(out["graph_25_75"], "q", "t"), 2),
        "latency_p99_beside_vs_alone_pct": {k: {f: out["latency_summary"][k][f] for f in (
            "alone_p99_us_median", "beside_p99_us_median", "p99_beside_vs_alone_pct_median", "interval_pct")}
            for k in ("eager_wall", "graph_wall")},
        "fill_mib": {k: out[k]["allocated"] >> 20 for k in
                     ("fill_spec", "fill_mps_only", "fill_asks_more", "fill_shim_2g")},
    }
    print(json.dumps(report, indent=1))
    for name, _, _, threads in SLICES:
        [device] = specs[name]["devices"]
        env = dict(v.split("=", 1) for v in device["containerEdits"]["env"])
        assert (env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
                env["CUDA_MPS_PIPE_DIRECTORY"]) == (threads, PINNED, "/tmp/nvidia-mps")
        assert "LD_PRELOAD" not in env
        mounts = {m["containerPath"]: m["hostPath"] for m in device["containerEdits"]["mounts"]}
        assert (mounts["/tmp/nvidia-mps"], mounts["/dev/shm"]) == (dirs.pipe, dirs.shm)
        assert {"/usr/local/lib/cdmo/libgpuslice.so", LIMIT_IN_CONTAINER, PRELOAD_IN_CONTAINER} <= set(mounts)
    assert abs(report["pair_25_75_split_pct"] - 25) <= 3, report
    assert abs(report["pair_50_50_split_pct"] - 50) <= 3, report
    assert abs(report["graph_25_75_split_pct"] - 25) <= 3, report
    # Memory: never more than the slice's 8 GiB, asked for more or not; the shim set lower holds.
    for key in ("fill_spec", "fill_mps_only", "fill_asks_more"):
        assert 0 < out[key]["allocated"] <= GRANTED, (key, out[key])
    assert 0 < out["fill_shim_2g"]["allocated"] <= 2 * GIB, out["fill_shim_2g"]
    assert out["servers_while_realising"], "no MPS server ran while the larger shares were realised"
    assert out["running_between"] is False and out["running_after_last"] is False
    assert out["condition_after_last"]["reason"] == "NoComputeShares"
