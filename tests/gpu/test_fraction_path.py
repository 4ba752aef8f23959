"""The fraction path on a real GPU, through the kubelet (issue 16): the node agent on its NVML backend
realises two fraction slices, the kubelet's DRA calls (the kubelet's own protos, over the agent's
real unix sockets) prepare a ResourceClaim for each, and PyTorch started with exactly what the CDI
spec gives a container sees its limit and cannot pass it; nor can a hostile process of the same
container that drops ``LD_PRELOAD`` and raises ``CDMO_GPU_MEMORY_LIMIT`` to the whole GPU (``env -u
LD_PRELOAD CDMO_GPU_MEMORY_LIMIT=<whole GPU>``): the spec's read-only ``/etc/ld.so.preload`` loads the
shim into it all the same, and the shim reads the limit from the spec's read-only limit file.

What is real: the agent (NVML backend, read only: a GPU with MIG disabled serves fractions, nothing
is created, destroyed or reset), its owner record, its kubelet plugin and both gRPC servers, the
CDI spec it writes, the official CDI library that validates the spec and applies it to an OCI
runtime spec (``tools/cdi-validate``, the program the e2e suite uses), the shim and PyTorch. What
stands in: the API server (an in-memory double answering the agent's few calls and the ResourceClaim
GET; the GPU machine runs no control plane, the e2e suite covers the API side), the kubelet (the
calls it makes, as in tests/unit/test_kubelet_plugin.py) and the container runtime: the process runs
in a private mount namespace whose ``/dev`` holds only the OCI spec's device nodes (and the six
every runc container gets), with each OCI mount bind-mounted as its options say (``/etc/ld.so.preload``
last, as a runtime has every mount in place before the process starts), then ``env -i`` with the OCI
spec's environment and nothing else. A mount's destination missing on this host is made first, empty
(``placeholders``), and removed afterwards: an empty ``/etc/ld.so.preload`` preloads nothing, and
the slice's one is bound over it only inside the private mount namespace.

Needs root (mount namespace, mknod), ``unshare`` and ``cdi-validate`` (``$CDI_VALIDATE``, else
``scripts/control-plane env``; build it with ``scripts/control-plane build cdi-validate``); skipped
without a GPU or the validator. bench/results/fraction-gpu-run.md records its runs.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FILL = Path(__file__).resolve().parent / "shim_workloads" / "fill.py"
GIB = 2**30
CHUNK_MIB = 16
NODE = "gpu-node"
NAMESPACE = "team-a"
CLAIMS = "/apis/resource.k8s.io/v1"
DRIVER = "gpu.cdmo.io"
SHIM_IN_CONTAINER = "/usr/local/lib/cdmo/libgpuslice.so"
LEDGER_IN_CONTAINER = "/run/cdmo/ledger"  # the shim's GS_LEDGER_DIR
LIMIT_IN_CONTAINER = "/run/cdmo/limit"  # the shim's GS_LIMIT_FILE
PRELOAD_IN_CONTAINER = "/etc/ld.so.preload"  # glibc's loader preloads what it names into every process
READ_ONLY = ["ro", "nosuid", "nodev", "noexec", "bind"]
# Two slices of one GPU. Real UIDs: one starting with a letter (CDI 0.3.0 suffices) and one with a
# digit (a device name CDI accepts from 0.5.0 on), so the library checks both versions the agent writes.
SLICES = (("four", "a3f0c9d2-4b5e-4c6d-8e7f-0a1b2c3d4e5f", 4 * GIB),
          ("eight", "7c2e9b14-5d3a-4f8e-9b1c-6a7d8e9f0a1b", 8 * GIB))
# GPU_MEM_LIMIT_GB: bytes / 10**9 to two places, worked out by hand (4294967296 -> 4.29, 8589934592 -> 8.59).
LIMIT_GB = {4 * GIB: "4.29", 8 * GIB: "8.59"}
# What a container image's own environment would give; taken from this host, where PyTorch and the
# driver's libraries are found without a container. None of them is a variable the CDI spec sets.
IMAGE_VARIABLES = ("PATH", "LD_LIBRARY_PATH", "HOME", "LANG")
# The device nodes runc gives every container (its default device list), besides the CDI spec's.
RUNC_DEVICES = {"/dev/null": (1, 3), "/dev/zero": (1, 5), "/dev/full": (1, 7), "/dev/random": (1, 8),
                "/dev/urandom": (1, 9), "/dev/tty": (5, 0)}
NVIDIA_MAJOR, CTL_MINOR = 195, 255  # fixed by the NVIDIA driver: /dev/nvidiactl is 195:255, /dev/nvidiaN 195:N


class ApiDouble:
    """The API calls the agent and its plugin make, answered from memory (objects by path)."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {
            f"/api/v1/nodes/{NODE}": {"metadata": {"name": NODE, "uid": "node-uid-1", "labels": {}}}}
        self.version = 1

    def _store(self, path: str, body: dict) -> dict:
        self.version += 1
        body = copy.deepcopy(body)
        body.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.objects[path] = body
        return copy.deepcopy(body)

    @staticmethod
    def _missing(path: str) -> Exception:
        from mig_operator.kube.common.client import ApiError

        return ApiError(404, "NotFound", f"{path} not found")

    async def get(self, path: str, params: Any = None) -> dict:
        if path not in self.objects:
            raise self._missing(path)
        return copy.deepcopy(self.objects[path])

    async def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None,
                   keep: Callable[[dict], dict] | None = None) -> list:
        if path.endswith("/resourceslices"):  # one node here: the field selector holds for all of them
            found = [copy.deepcopy(o) for p, o in self.objects.items() if p.startswith(f"{path}/")]
        else:
            found = [copy.deepcopy(o) for p, o in self.objects.items() if "/gpuslices/" in p]
        return found if keep is None else [keep(o) for o in found]

    async def merge_patch(self, path: str, body: dict) -> dict:
        target = path.removesuffix("/status")
        if target not in self.objects:
            raise self._missing(path)
        merged = copy.deepcopy(self.objects[target])
        for key, value in body.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
        return self._store(target, merged)

    async def json_patch(self, path: str, ops: list) -> dict:
        raise AssertionError(f"nothing here removes a finalizer: JSON patch {ops} of {path}")

    async def create(self, path: str, body: dict) -> dict:
        from mig_operator.kube.common.client import ApiError

        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise ApiError(409, "Conflict", f"{full} exists")
        return self._store(full, body)

    async def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict:
        assert method == "PUT", f"{method} {path}"
        return self._store(path, body)

    async def delete(self, path: str) -> dict:
        return self.objects.pop(path)

    async def close(self) -> None:
        return None


class NoEvents:
    def post(self, *args: Any) -> None:
        pass

    async def drain(self) -> None:
        pass


def bound_fraction(name: str, uid: str, gpu: int, granted: int) -> dict:
    """A GpuSlice as the controller leaves it for the agent: phase Bound, mode fraction."""
    return {
        "apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid, "resourceVersion": "1",
                     "finalizers": ["cdmo.io/agent"]},
        "spec": {"memory": str(granted)},
        "status": {"phase": "Bound", "mode": "fraction", "node": NODE, "gpu": gpu, "grantedBytes": granted},
    }


def allocated_claim(claim_uid: str, name: str, device: str) -> dict:
    """A ResourceClaim as the controller writes it (controlled by its slice) and kube-scheduler leaves
    it: one result of this driver, in this node's pool."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"uid": claim_uid, "name": name, "namespace": NAMESPACE, "ownerReferences": [
                {"apiVersion": "cdmo.io/v1alpha1", "kind": "GpuSlice", "name": name, "uid": device,
                 "controller": True}]},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]}}}}


def per_process_used(pid: int) -> int | None:
    """NVML's used memory of one process, over every GPU (None when NVML does not list it)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        total = None
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    total = (total or 0) + int(proc.usedGpuMemory)
        return total
    finally:
        pynvml.nvmlShutdown()


def find_cdi_validate() -> Path | None:
    """``$CDI_VALIDATE``, else the path ``scripts/control-plane env`` names, if the binary is there."""
    named = os.environ.get("CDI_VALIDATE")
    if not named:
        try:
            env = subprocess.run([str(REPO / "scripts" / "control-plane"), "env"], capture_output=True, text=True,
                                 timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        named = next((line.split("=", 1)[1] for line in env.stdout.splitlines() if line.startswith("CDI_VALIDATE=")),
                     "")
    path = Path(named) if named else None
    return path if path is not None and path.is_file() and os.access(path, os.X_OK) else None


@pytest.fixture
def cdi_validate(gpu: str) -> Path:
    # Takes ``gpu``: without a GPU the test is skipped for that reason first.
    path = find_cdi_validate()
    if path is None:
        pytest.skip("cdi-validate is not built: run `scripts/control-plane build cdi-validate` "
                    "(or set CDI_VALIDATE=/path/to/cdi-validate)")
    return path


@pytest.fixture
def container_tools(gpu: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("the stand-in container (a private mount namespace with its own /dev) needs root")
    missing = [tool for tool in ("unshare", "mount", "mknod", "env") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the stand-in container needs {', '.join(missing)} (util-linux, coreutils)")


@pytest.fixture(scope="module")
def shim_library() -> Path:
    subprocess.run(["make", "-C", str(REPO / "shim")], check=True, capture_output=True)
    return REPO / "shim" / "libgpuslice.so"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # A unix socket path holds at most 107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="gpu-dra-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def char_device(path: str) -> tuple[int, int] | None:
    """(major, minor) of a character device on this host, None if absent or not one."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (os.major(st.st_rdev), os.minor(st.st_rdev)) if stat.S_ISCHR(st.st_mode) else None


def apply_cdi(cdi_validate: Path, cdi_dir: Path, device_ids: list[str], base: dict, workdir: Path) -> tuple[dict, dict]:
    """The official CDI library applies ``device_ids`` to the OCI spec ``base``: (its summary, the whole spec)."""
    base_path, out_path = workdir / "config.json", workdir / "config.out.json"
    base_path.write_text(json.dumps(base))
    done = subprocess.run([str(cdi_validate), "--cdi-dir", str(cdi_dir), "--oci-spec", str(base_path),
                           "--oci-out", str(out_path), *device_ids], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"cdi-validate exited {done.returncode}: {done.stderr}"
    return json.loads(done.stdout), json.loads(out_path.read_text())


def container_script(oci: dict) -> str:
    """The shell that stands in for the runtime, run in a private mount namespace: a fresh /dev with
    the OCI spec's device nodes and runc's defaults only, the spec's mounts, a report of what the
    process will see (on stderr), then the spec's process with exactly the spec's environment."""
    q = shlex.quote
    lines = ["set -e", "mount -t tmpfs -o mode=0755,nosuid tmpfs /dev"]
    for path, (major, minor) in RUNC_DEVICES.items():
        lines.append(f"mknod -m 0666 {q(path)} c {major} {minor}")
    lines += ["mkdir /dev/shm", "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm"]
    for node in oci["linux"]["devices"]:
        assert node["type"] == "c", node
        mode = format(node.get("fileMode", 0o666) & 0o7777, "04o")
        lines += [f"mkdir -p {q(os.path.dirname(node['path']))}",
                  f"mknod -m {mode} {q(node['path'])} c {node['major']} {node['minor']}"]
    # The loader's preload file last: the commands below it then run with the slice's shim loaded, as
    # every process of the container does.
    for mount in sorted(oci.get("mounts") or [], key=lambda m: m["destination"] == PRELOAD_IN_CONTAINER):
        src, dst, options = mount["source"], mount["destination"], list(mount.get("options") or [])
        kind = "--rbind" if "rbind" in options else "--bind"
        assert "bind" in options or "rbind" in options, f"only bind mounts are expected here: {mount}"
        rest = [o for o in options if o not in ("bind", "rbind")]
        lines.append(f"mount {kind} {q(src)} {q(dst)}")
        if rest:  # bind mounts take ro/nosuid/nodev only on a remount
            lines.append(f"mount -o {q(','.join(['remount', 'bind', *rest]))} {q(dst)}")
        # a file: appending nothing tells whether it is writable; a directory (the ledger): a file made in it
        probe = (f"( : >> {q(dst)} )" if not os.path.isdir(src)
                 else f"( : > {q(dst + '/.probe')} && rm {q(dst + '/.probe')} )")
        lines += [f"awk -v d={q(dst)} '$5 == d {{print \"mountinfo\", $5, $6}}' /proc/self/mountinfo >&2",
                  f"if {probe} 2>/dev/null; then echo writable {q(dst)} >&2; "
                  f"else echo readonly {q(dst)} >&2; fi",
                  # a file: the same bytes; a directory: the same inode, the host's own directory
                  (f"if cmp -s {q(src)} {q(dst)}; then echo same {q(dst)} >&2; fi" if not os.path.isdir(src) else
                   f"if [ \"$(stat -c %d:%i {q(src)})\" = \"$(stat -c %d:%i {q(dst)})\" ]; "
                   f"then echo same {q(dst)} >&2; fi")]
    lines.append("find /dev -type c -exec stat -c 'chardev %n %t %T' {} + >&2")
    process = oci["process"]
    lines.append(f"cd {q(process.get('cwd') or '/')}")
    lines.append(" ".join(["exec env -i", *(q(v) for v in process["env"]), *(q(a) for a in process["args"])]))
    return "\n".join(lines) + "\n"


@dataclass
class ContainerReport:
    """What the stand-in container reported before starting the process (parsed from its stderr)."""

    char_devices: dict[str, tuple[int, int]]
    mount_options: dict[str, list[str]]
    readonly: set[str]
    same_content: set[str]


def parse_report(text: str) -> ContainerReport:
    report = ContainerReport({}, {}, set(), set())
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if word == "chardev":
            path, major, minor = rest.split()
            report.char_devices[path] = (int(major, 16), int(minor, 16))
        elif word == "mountinfo":
            point, options = rest.split()
            report.mount_options[point] = options.split(",")
        elif word == "readonly":
            report.readonly.add(rest)
        elif word == "same":
            report.same_content.add(rest)
    return report


def placeholders(mounts: list[dict]) -> list[Path]:
    """Create what a bind mount needs at each destination on this host (an empty file, or a directory
    for a directory's mount, and its missing directories); the paths created, deepest first, to remove
    afterwards."""
    made: list[Path] = []
    for mount in mounts:
        target = Path(mount["destination"])
        missing = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
        for directory in reversed(missing):
            directory.mkdir()
            made.append(directory)
        if not target.exists():
            if os.path.isdir(mount["source"]):
                target.mkdir()
            else:
                target.touch()
            made.append(target)
    return list(reversed(made))


def process_view(pid: int) -> dict[str, Any]:
    """What a running process has, read from outside: its environment and the files it has mapped."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {"environ": dict(v.decode().split("=", 1) for v in environ if b"=" in v),
            "mapped": sorted({line.split()[-1] for line in maps if len(line.split()) >= 6})}


def run_torch_in_container(oci: dict, limit: int, workdir: Path) -> dict[str, Any]:
    """Start the OCI spec's process (fill.py torch) in the stand-in container; fill to out of memory."""
    made = placeholders(oci.get("mounts") or [])
    stderr_path = workdir / "container.stderr"
    proc = None
    try:
        with open(stderr_path, "w") as stderr:
            proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                     container_script(oci)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=stderr, text=True)
            assert proc.stdin is not None and proc.stdout is not None
            line = proc.stdout.readline()
            assert line, f"the process ended before CUDA was ready:\n{stderr_path.read_text()}"
            ready = json.loads(line)
            seen = process_view(proc.pid)  # unshare, sh and env exec: the pid is PyTorch's
            proc.stdin.write("go\n")
            proc.stdin.flush()
            done = json.loads(proc.stdout.readline())
            footprint = per_process_used(proc.pid)  # unshare and sh exec: the pid is PyTorch's
            proc.stdin.close()
            assert proc.wait(60) == 0, stderr_path.read_text()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for path in made:
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink()
    text = stderr_path.read_text()
    return {"ready": ready, "done": done, "footprint": footprint, "report": parse_report(text), "stderr": text,
            "limit": limit, **seen}


def test_agent_prepares_fraction_claims_and_torch_holds_each_limit(
        gpu: str, cdi_validate: Path, container_tools: None, shim_library: Path, short_dir: Path) -> None:
    from agent_events import event

    from mig_operator.core.books.slice_claim import claim_path as resource_claim_path
    from mig_operator.core.node.cdi import spec_file_name
    from mig_operator.gpu import open_backend
    from mig_operator.kube.agent.agent import NodeAgent
    from mig_operator.kube.agent.context import AgentSettings
    from mig_operator.kube.agent.kubelet.settings import PluginSettings
    from mig_operator.kube.agent.kubelet.transport import KubeletPlugin
    from mig_operator.kube.agent.record import RecordStore
    from mig_operator.kube.agent.resource_slice import resource_slice_path
    from mig_operator.kube.common.client import gpunode_path, slice_path

    backend = open_backend("nvml")
    serving = [g for g in backend.gpus() if not g.mig_enabled]
    if not serving:
        backend.close()
        pytest.skip(f"every GPU here is in MIG mode; the fraction path needs one that is not:\n{gpu}")
    target = serving[0]
    uvm = char_device("/dev/nvidia-uvm")
    assert uvm is not None, ("/dev/nvidia-uvm is missing: load the driver's UVM module as a GPU node does "
                             "(nvidia-modprobe -u -c=0)")
    api = ApiDouble()
    cdi_dir = short_dir / "cdi"
    # The node's library directory: the shim, and beside it the slices' ledger directories.
    node_shim = short_dir / "node-lib" / "shim" / "libgpuslice.so"
    node_shim.parent.mkdir(parents=True)
    shutil.copy(shim_library, node_shim)
    ledgers = short_dir / "node-lib" / "ledgers"
    limits = short_dir / "node-lib" / "limits"
    whole_gpu = target.memory_mib * 2**20
    settings = PluginSettings(registry_dir=str(short_dir / "reg"), plugin_dir=str(short_dir / "plug"),
                              cdi_dir=str(cdi_dir), shim_host_dir=str(node_shim.parent), nvidia_cdi_dirs=())
    (short_dir / "reg").mkdir()
    image_env = [f"{k}={os.environ[k]}" for k in IMAGE_VARIABLES if k in os.environ]
    results: list[dict[str, Any]] = []
    hostile_results: list[dict[str, Any]] = []

    async def scenario() -> None:
        store = RecordStore(str(short_dir / "owners.json"))
        agent = NodeAgent(AgentSettings(NODE, publish_delay_s=0.0, heartbeat_s=3600), backend, store,
                          api, NoEvents())  # type: ignore[arg-type]
        await agent.start()
        plugin = KubeletPlugin(agent, settings)
        assert await plugin.start()
        from fake_kubelet import FakeKubelet  # here: grpc is needed only where the test runs

        kubelet = FakeKubelet(settings.registration_socket, namespace=NAMESPACE, timeout_s=30)
        try:
            info = await kubelet.register()
            assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == \
                ("DRAPlugin", DRIVER, settings.dra_socket,
                 ["v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"])

            for name, uid, granted in SLICES:
                body = bound_fraction(name, uid, target.index, granted)
                api.objects[slice_path(NAMESPACE, name)] = body
                await event(agent, copy.deepcopy(body))
                st = api.objects[slice_path(NAMESPACE, name)]["status"]
                assert (st["phase"], st["deviceUUID"], st["grantedBytes"]) == ("Ready", target.uuid, granted), st
            await agent.publish()
            gpus = api.objects[gpunode_path(NODE)]["status"]["gpus"]
            published = next(g for g in gpus if g["index"] == target.index)
            assert published["serves"] == "fraction" and published["uuid"] == target.uuid
            devices = {d["name"]: d for d in api.objects[resource_slice_path(NODE)]["spec"]["devices"]}
            assert devices.keys() == {uid for _, uid, _ in SLICES}
            for name, uid, granted in SLICES:
                assert devices[uid]["attributes"][f"{DRIVER}/uuid"] == {"string": target.uuid}
                assert devices[uid]["attributes"][f"{DRIVER}/sliceName"] == {"string": name}
                assert devices[uid]["capacity"][f"{DRIVER}/memory"] == {"value": str(granted)}

            claims = [(f"claim-{uid}", name) for name, uid, _ in SLICES]
            for (claim_uid, name), (_, uid, _) in zip(claims, SLICES, strict=True):
                api.objects[resource_claim_path(NAMESPACE, name)] = allocated_claim(claim_uid, name, uid)
            prepared = await kubelet.prepare(*claims)
            for (claim_uid, _), (_, uid, _) in zip(claims, SLICES, strict=True):
                answer = prepared.claims[claim_uid]
                assert answer.error == ""
                [device] = answer.devices
                assert (list(device.request_names), device.pool_name, device.device_name,
                        list(device.cdi_device_ids)) == (["gpu"], NODE, uid, [f"{DRIVER}/slice={uid}"])
            assert sorted(p.name for p in cdi_dir.iterdir()) == sorted(spec_file_name(uid) for _, uid, _ in SLICES)
            assert await kubelet.prepare(*claims) == prepared  # the kubelet may ask again: same answer
            # A claim that is not the slice's own is refused, with a reason for the pod's events.
            api.objects[resource_claim_path(NAMESPACE, "copy")] = allocated_claim("claim-copy", "copy", SLICES[0][1])
            refused = (await kubelet.prepare(("claim-copy", "copy"))).claims["claim-copy"]
            assert not refused.devices and f"prepared only for that slice's own ResourceClaim {NAMESPACE}/four" \
                in refused.error

            for (claim_uid, name), (_, uid, granted) in zip(claims, SLICES, strict=True):
                spec_text = (cdi_dir / spec_file_name(uid)).read_text()
                ids = list(prepared.claims[claim_uid].devices[0].cdi_device_ids)
                base = {"ociVersion": "1.2.0", "root": {"path": "rootfs"}, "linux": {},
                        "process": {"cwd": "/", "env": image_env,
                                    "args": [sys.executable, str(FILL), "torch", str(CHUNK_MIB),
                                             str(granted * 2 >> 20)]}}
                workdir = short_dir / name
                workdir.mkdir()
                summary, oci = apply_cdi(cdi_validate, cdi_dir, ids, base, workdir)
                outcome = await asyncio.to_thread(run_torch_in_container, oci, granted, workdir)
                results.append({"name": name, "uid": uid, "granted": granted, "spec": json.loads(spec_text),
                                "summary": summary, "oci": oci, **outcome,
                                "ledger_files": sorted(p.name for p in (ledgers / uid).iterdir()),
                                "limit_files": {p.name: p.read_text() for p in (limits / uid).iterdir()}})
                if name == SLICES[0][0]:
                    # The hostile process: the same container, LD_PRELOAD dropped and the variable raised to
                    # the whole GPU, asking for twice the GPU.
                    hostile = copy.deepcopy(oci)
                    hostile["process"]["args"] = ["env", "-u", "LD_PRELOAD", f"CDMO_GPU_MEMORY_LIMIT={whole_gpu}",
                                                  sys.executable, str(FILL), "torch", str(CHUNK_MIB),
                                                  str(whole_gpu * 2 >> 20)]
                    (short_dir / "hostile").mkdir()
                    hostile_results.append(await asyncio.to_thread(run_torch_in_container, hostile, granted,
                                                                   short_dir / "hostile"))

            gone = await kubelet.unprepare(*claims)
            assert all(gone.claims[c].error == "" for c, _ in claims)
            assert list(cdi_dir.iterdir()) == []
            assert list(ledgers.iterdir()) == []  # each slice's ledger goes with its claim
            assert list(limits.iterdir()) == []  # and its limit file and ld.so.preload
            again = await kubelet.unprepare(*claims)
            assert all(again.claims[c].error == "" for c, _ in claims)
            assert json.loads((short_dir / "owners.json").read_text())["preparedClaims"] == {}
        finally:
            await kubelet.close()
            await plugin.stop()
            await agent.stop()

    try:
        asyncio.run(scenario())
    finally:
        backend.close()

    assert len(results) == len(SLICES)
    for result in results:
        name, limit = result["name"], result["granted"]
        total, free = result["ready"]["info"]["0"]["total"], result["ready"]["info"]["0"]["free"]
        got, oom = result["done"]["allocated"]["0"], result["done"]["error"]["0"]
        footprint = result["footprint"]
        print(json.dumps({"slice": name, "cdiVersion": result["spec"]["cdiVersion"], "limit": limit,
                          "mem_get_info_total": total, "mem_get_info_free": free, "allocated": got,
                          "refusal": oom, "nvml_footprint": footprint}))
        print(f"CDI spec of {name}: {json.dumps(result['spec'])}")
        print(f"cdi-validate of {name}: {json.dumps(result['summary'])}")
        print(f"container of {name}:\n{result['stderr']}")
        # The CDI spec, as the library applied it: the environment (the image's plus the slice's).
        env = dict(v.split("=", 1) for v in result["summary"]["env"])
        assert len(env) == len(result["summary"]["env"]), f"a variable set twice: {result['summary']['env']}"
        assert result["oci"]["process"]["env"] == result["summary"]["env"]
        # For display: nothing in the environment loads the shim or sets its limit.
        assert env == {**dict(v.split("=", 1) for v in image_env), "NVIDIA_VISIBLE_DEVICES": "void",
                       "CDMO_GPU_MEMORY_LIMIT": str(limit),
                       "GPU_MEM_LIMIT_GB": LIMIT_GB[limit], "CDMO_SLICE": f"{NAMESPACE}/{name}"}
        # The shim, read-only from the node; the slice's ledger, read-write, at the path the shim has built in;
        # its limit and /etc/ld.so.preload naming the shim, read-only from the slice's limit directory.
        # (The CDI library orders mounts by container path; none nests in another, so order is immaterial.)
        assert sorted((m["source"], m["destination"], m["options"]) for m in result["summary"]["mounts"]) == \
            sorted([(str(node_shim), SHIM_IN_CONTAINER, ["ro", "nosuid", "nodev", "bind"]),
                    (str(ledgers / result["uid"]), LEDGER_IN_CONTAINER, ["rw", "nosuid", "nodev", "noexec", "bind"]),
                    (str(limits / result["uid"] / "limit"), LIMIT_IN_CONTAINER, READ_ONLY),
                    (str(limits / result["uid"] / "ld.so.preload"), PRELOAD_IN_CONTAINER, READ_ONLY)])
        assert result["limit_files"] == {"limit": f"{limit}\n", "ld.so.preload": f"{SHIM_IN_CONTAINER}\n"}
        # The device nodes: the GPU's, the control node and UVM's, each a character device on this
        # host with the numbers the spec gives, and allowed in the device cgroup.
        nodes = {n["path"]: (n["type"], n["major"], n["minor"]) for n in result["summary"]["deviceNodes"]}
        assert nodes == {"/dev/nvidiactl": ("c", NVIDIA_MAJOR, CTL_MINOR),
                         f"/dev/nvidia{target.minor}": ("c", NVIDIA_MAJOR, target.minor),
                         "/dev/nvidia-uvm": ("c", uvm[0], 0), "/dev/nvidia-uvm-tools": ("c", uvm[0], 1)}
        for path, (_, major, minor) in nodes.items():
            assert char_device(path) == (major, minor), f"{path} on this host is {char_device(path)}"
        allowed = {(r["type"], r["major"], r["minor"]) for r in result["summary"]["deviceCgroup"] if r["allow"]}
        assert allowed == set(nodes.values())
        # What the process saw: only those nodes (and runc's six), the shim read-only and the same file.
        report: ContainerReport = result["report"]
        assert report.char_devices == {**RUNC_DEVICES, **{p: (mj, mn) for p, (_, mj, mn) in nodes.items()}}, \
            result["stderr"]
        for read_only in (SHIM_IN_CONTAINER, LIMIT_IN_CONTAINER, PRELOAD_IN_CONTAINER):
            assert "ro" in report.mount_options[read_only], result["stderr"]
        assert "rw" in report.mount_options[LEDGER_IN_CONTAINER], result["stderr"]
        assert report.readonly == {SHIM_IN_CONTAINER, LIMIT_IN_CONTAINER, PRELOAD_IN_CONTAINER}
        assert report.same_content == {SHIM_IN_CONTAINER, LEDGER_IN_CONTAINER, LIMIT_IN_CONTAINER,
                                       PRELOAD_IN_CONTAINER}, result["stderr"]
        # Loaded without LD_PRELOAD, from the preload file alone.
        assert "LD_PRELOAD" not in result["environ"] and SHIM_IN_CONTAINER in result["mapped"], result["mapped"]
        assert len(result["ledger_files"]) == 1 and result["ledger_files"][0].startswith("gpu-"), result["ledger_files"]
        # And PyTorch: its limit as the GPU's total, out of memory at the limit, NVML's footprint within it.
        assert total == limit, "torch.cuda.mem_get_info() reports the slice's limit as the total"
        assert oom is not None and re.search(r"out of memory", oom, re.IGNORECASE), oom
        assert got <= limit, "nothing is allocated past the limit"
        assert got >= limit - 2 * GIB, "and close to it (the context and the allocator's slack aside)"
        assert footprint is not None and footprint <= limit, (
            f"NVML's footprint of the process ({footprint}) stays within its limit ({limit})")
    assert {r["spec"]["cdiVersion"] for r in results} == {"0.3.0", "0.5.0"}

    # The hostile process of the first slice: it ran with LD_PRELOAD gone and the variable at the whole
    # GPU, the shim mapped all the same (from /etc/ld.so.preload), and it held the slice's limit.
    [hostile] = hostile_results
    limit = SLICES[0][2]
    total = hostile["ready"]["info"]["0"]["total"]
    got, oom = hostile["done"]["allocated"]["0"], hostile["done"]["error"]["0"]
    print(json.dumps({"slice": SLICES[0][0], "hostile": True, "limit": limit, "whole_gpu": whole_gpu,
                      "environ_limit": hostile["environ"].get("CDMO_GPU_MEMORY_LIMIT"),
                      "environ_preload": hostile["environ"].get("LD_PRELOAD"), "mem_get_info_total": total,
                      "allocated": got, "refusal": oom, "nvml_footprint": hostile["footprint"]}))
    assert "LD_PRELOAD" not in hostile["environ"], hostile["environ"]
    assert hostile["environ"]["CDMO_GPU_MEMORY_LIMIT"] == str(whole_gpu)
    assert SHIM_IN_CONTAINER in hostile["mapped"], hostile["mapped"]
    assert total == limit, "the shim reported the file's limit, not the variable's"
    assert oom is not None and re.search(r"out of memory", oom, re.IGNORECASE), oom
    assert got <= limit, "nothing is allocated past the slice's limit"
    assert hostile["footprint"] is not None and hostile["footprint"] <= limit, (
        f"NVML's footprint of the hostile process ({hostile['footprint']}) stays within the limit ({limit})")


def test_a_whole_gpu_slice_gets_the_gpu_with_no_shim_and_torch_sees_all_of_it(
        gpu: str, cdi_validate: Path, container_tools: None, shim_library: Path, short_dir: Path) -> None:
    """Issue 17, item 2: nvidia.com/gpu on a GPU without MIG is a fraction of 1 (its grant is all of
    the GPU's memory). The agent's CDI spec then preloads no shim and sets no limit, and PyTorch,
    started with exactly that spec, sees the GPU's whole memory as NVML reports it."""
    from agent_events import event

    from mig_operator.core.books.slice_claim import claim_path as resource_claim_path
    from mig_operator.core.node.cdi import spec_file_name
    from mig_operator.core.requests.quantities import MIB
    from mig_operator.gpu import open_backend
    from mig_operator.kube.agent.agent import NodeAgent
    from mig_operator.kube.agent.context import AgentSettings
    from mig_operator.kube.agent.kubelet.settings import PluginSettings
    from mig_operator.kube.agent.kubelet.transport import KubeletPlugin
    from mig_operator.kube.agent.record import RecordStore
    from mig_operator.kube.common.client import slice_path

    backend = open_backend("nvml")
    serving = [g for g in backend.gpus() if not g.mig_enabled]
    if not serving:
        backend.close()
        pytest.skip(f"every GPU here is in MIG mode; a whole GPU without MIG needs one that is not:\n{gpu}")
    target = serving[0]
    whole = target.memory_mib * MIB
    name, uid = "whole", "5b1d7e3a-2c4f-4a6b-8d9e-0f1a2b3c4d5e"
    api = ApiDouble()
    cdi_dir = short_dir / "cdi"
    settings = PluginSettings(registry_dir=str(short_dir / "reg"), plugin_dir=str(short_dir / "plug"),
                              cdi_dir=str(cdi_dir), shim_host_dir=str(shim_library.parent), nvidia_cdi_dirs=())
    (short_dir / "reg").mkdir()
    image_env = [f"{k}={os.environ[k]}" for k in IMAGE_VARIABLES if k in os.environ]
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        agent = NodeAgent(AgentSettings(NODE, publish_delay_s=0.0, heartbeat_s=3600), backend,
                          RecordStore(str(short_dir / "owners.json")), api, NoEvents())  # type: ignore[arg-type]
        await agent.start()
        plugin = KubeletPlugin(agent, settings)
        assert await plugin.start()
        from fake_kubelet import FakeKubelet

        kubelet = FakeKubelet(settings.registration_socket, namespace=NAMESPACE, timeout_s=30)
        try:
            await kubelet.register()
            body = bound_fraction(name, uid, target.index, whole)
            api.objects[slice_path(NAMESPACE, name)] = body
            await event(agent, copy.deepcopy(body))
            assert api.objects[slice_path(NAMESPACE, name)]["status"]["phase"] == "Ready"
            api.objects[resource_claim_path(NAMESPACE, name)] = allocated_claim("claim-whole", name, uid)
            prepared = await kubelet.prepare(("claim-whole", name))
            assert prepared.claims["claim-whole"].error == ""
            seen["spec"] = json.loads((cdi_dir / spec_file_name(uid)).read_text())
            ids = list(prepared.claims["claim-whole"].devices[0].cdi_device_ids)
            base = {"ociVersion": "1.2.0", "root": {"path": "rootfs"}, "linux": {},
                    "process": {"cwd": "/", "env": image_env,
                                "args": [sys.executable, str(FILL), "torch", str(CHUNK_MIB), str(whole * 2 >> 20)]}}
            workdir = short_dir / name
            workdir.mkdir()
            seen["summary"], oci = apply_cdi(cdi_validate, cdi_dir, ids, base, workdir)
            seen.update(await asyncio.to_thread(run_torch_in_container, oci, whole, workdir))
            assert (await kubelet.unprepare(("claim-whole", name))).claims["claim-whole"].error == ""
        finally:
            await kubelet.close()
            await plugin.stop()
            await agent.stop()

    try:
        asyncio.run(scenario())
    finally:
        backend.close()
    total, got = seen["ready"]["info"]["0"]["total"], seen["done"]["allocated"]["0"]
    print(json.dumps({"slice": name, "granted": whole, "mem_get_info_total": total, "allocated": got,
                      "refusal": seen["done"]["error"]["0"], "nvml_footprint": seen["footprint"]}))
    print(f"CDI spec of {name}: {json.dumps(seen['spec'])}")
    edits = seen["spec"]["devices"][0]["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"] and "mounts" not in edits
    env = dict(v.split("=", 1) for v in seen["summary"]["env"])
    assert "LD_PRELOAD" not in env and "CDMO_GPU_MEMORY_LIMIT" not in env
    assert not seen["report"].readonly  # no shim mounted
    # Without the shim PyTorch sees the GPU itself: CUDA's total is NVML's (the driver reserves a
    # little of it, so it is at most the NVML figure and within 1 GiB of it) and it fills far past
    # any share.
    assert whole - GIB <= total <= whole, (total, whole)
    assert got >= total - 4 * GIB, (got, total)
