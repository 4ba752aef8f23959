"""The agent as the kubelet's DRA plugin for driver ``gpu.cdmo.io`` (Kubernetes 1.34, DRA v1 gRPC).

Two unix sockets, as the kubelet's plugin manager expects:

- ``<registry dir>/gpu.cdmo.io-reg.sock``: the plugin registration service. The kubelet finds the
  socket, calls ``GetInfo`` (type ``DRAPlugin``, our name, the DRA socket, the service ``v1.DRAPlugin``)
  and then ``NotifyRegistrationStatus``.
- ``<plugin dir>/dra.sock``: ``NodePrepareResources`` / ``NodeUnprepareResources``.

Prepare reads each ResourceClaim from the API server, checks that what the scheduler allocated from
this driver is a device of this node's pool, a slice the agent holds Ready, and that the claim is that
slice's own (``core.claim_owner``: a claim of another namespace may be allocated any device its
selector matches, so the scheduler's word is not enough), writes the slice's CDI spec (for a fraction,
after making the slice's ledger directory and writing its limit file and ld.so.preload, which the
spec mounts) and answers its CDI device ID (plus the
NVIDIA toolkit's ID for the same UUID where the node has
that spec: the driver's user-space libraries come from it). The prepared claim is recorded before
the answer, so that an agent restarted later still unprepares it and still holds the instance.
Both calls are idempotent; a claim's failure is its own error string, which the kubelet shows in
the pod's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import logging
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import yaml

from mig_operator.core.cdi import (
    DRIVER,
    NVIDIA_CDI_KIND,
    SliceDevice,
    device_id,
    ledger_dir,
    limit_dir,
    names_device,
    nvidia_device_id,
    slice_spec,
    spec_file_name,
)
from mig_operator.core.claim_owner import claim_refusal
from mig_operator.core.cluster import MODE_FRACTION, MODE_MIG
from mig_operator.core.environment import shim_files
from mig_operator.core.lifecycle import OwnerEntry
from mig_operator.core.slice_claim import claim_path
from mig_operator.gpu.device_files import DeviceFileError, device_nodes
from mig_operator.gpu.files import write_atomically
from mig_operator.gpu.mps import MpsDirs

from ..common.client import ApiError, KubeClient
from ..common.names import SHIM_HOST_DIR
from .kubeletapi import DRA_PLUGIN_SERVICE, DRA_PLUGIN_TYPE
from .kubeletapi import dra_v1_pb2 as dra
from .kubeletapi import dra_v1_pb2_grpc as dra_grpc
from .kubeletapi import pluginregistration_v1_pb2 as reg
from .kubeletapi import pluginregistration_v1_pb2_grpc as reg_grpc
from .record import PreparedClaim, RecordStore

# How long a prepare waits for a slice being realised here to be Ready (a reuse or a fraction: a
# record write and no GPU call, milliseconds).
REALISE_WAIT_S = 10.0
log = logging.getLogger("mig_operator.agent.kubelet")

REGISTRATION_SOCKET = f"{DRIVER}-reg.sock"
DRA_SOCKET = "dra.sock"
DEFAULT_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_PLUGIN_DIR = f"/var/lib/kubelet/plugins/{DRIVER}"
DEFAULT_CDI_DIR = "/var/run/cdi"
# Where the NVIDIA toolkit's spec may be (nvidia-ctk cdi generate; the GPU Operator with CDI on).
NVIDIA_CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


@dataclass(frozen=True)
class PluginSettings:
    registry_dir: str = DEFAULT_REGISTRY_DIR  # "" serves no plugin (no kubelet on this machine)
    plugin_dir: str = DEFAULT_PLUGIN_DIR
    cdi_dir: str = DEFAULT_CDI_DIR
    shim_host_dir: str = SHIM_HOST_DIR
    nvidia_cdi_dirs: tuple[str, ...] = NVIDIA_CDI_DIRS

    @property
    def ledger_host_dir(self) -> str:
        """The slices' ledger directories live beside the shim's (``/var/lib/mig-operator/ledgers``)."""
        return os.path.join(os.path.dirname(self.shim_host_dir.rstrip("/")) or "/", "ledgers")

    @property
    def limits_host_dir(self) -> str:
        """The slices' limit files and ld.so.preload, one directory per slice beside the ledgers
        (``/var/lib/mig-operator/limits``); no container mounts these directories, only their files."""
        return os.path.join(os.path.dirname(self.shim_host_dir.rstrip("/")) or "/", "limits")

    @property
    def mps_host_dir(self) -> str:
        """The GPUs' MPS control daemon directories, beside the ledgers (``/var/lib/mig-operator/mps``)."""
        return os.path.join(os.path.dirname(self.shim_host_dir.rstrip("/")) or "/", "mps")

    @property
    def registration_socket(self) -> str:
        return os.path.join(self.registry_dir, REGISTRATION_SOCKET)

    @property
    def dra_socket(self) -> str:
        return os.path.join(self.plugin_dir, DRA_SOCKET)


class SliceHolder(Protocol):
    """What the plugin needs of the node agent (``NodeAgent`` is one)."""

    @property
    def node(self) -> str: ...

    @property
    def store(self) -> RecordStore: ...

    @property
    def client(self) -> KubeClient: ...

    def ready_entry(self, slice_uid: str) -> OwnerEntry | None:
        """The slice's completed owner entry if it is Ready here and not being taken away."""
        ...

    async def until_ready(self, slice_uid: str, timeout_s: float) -> OwnerEntry | None:
        """``ready_entry`` once the slice's realisation here ends, if it is under way (at most
        ``timeout_s``); None at once for a slice not being realised here."""
        ...

    def gpu_minor(self, gpu_index: int) -> int | None: ...

    def gpu_memory_bytes(self, gpu_index: int) -> int | None: ...

    def mps_dirs(self, gpu_uuid: str) -> MpsDirs | None:
        """The GPU's MPS directories while its control daemon answers, else None."""
        ...

    async def device_root(self) -> str: ...

    async def claim_released(self, slice_uid: str) -> None:
        """A prepared claim on the slice was unprepared (a held instance may go now)."""
        ...

    def kubelet_registered(self) -> None:
        """The kubelet registered the plugin (it may have deleted the node's ResourceSlices)."""
        ...


class PrepareRefused(Exception):
    """One claim cannot be prepared; the message (for the pod's events) names the claim, the device, why."""


def _claim_ref(claim: Any) -> str:
    return f"ResourceClaim {claim.namespace}/{claim.name} (uid {claim.uid})"


def make_ledger_dir(path: str) -> None:
    """The slice's ledger directory, kept if it exists (the kubelet prepares a claim again while its
    pods run). Sticky and writable by all: a container's user, root or not, creates the ledger file
    in it and none removes another's. Refused if something else than a directory is there."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise OSError(f"{path} is not a directory: the slice's ledger cannot be made")
    os.chmod(path, 0o1777)  # after mkdir: the umask would take bits off


def remove_slice_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def write_limit_dir(path: str, files: dict[str, str]) -> None:
    """The slice's limit directory with ``files`` (``environment.shim_files``), each replaced whole by
    a rename, so that a container being made never reads half a file; readable by all (a container's
    user, root or not, loads what they name) and writable by the agent alone. Refused if something
    else than a directory is there."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise OSError(f"{path} is not a directory: the slice's limit cannot be written")
    os.chmod(path, 0o755)
    for name, content in files.items():
        write_atomically(os.path.join(path, name), content, 0o644)


def find_nvidia_device(dirs: Sequence[str], device_uuid: str) -> str | None:
    """The NVIDIA toolkit's CDI device ID for ``device_uuid`` if a spec in ``dirs`` defines it."""
    for directory in dirs:
        for path in sorted(glob.glob(os.path.join(directory, "*.json")) + glob.glob(os.path.join(directory, "*.yaml"))):
            try:
                with open(path) as fh:
                    spec = json.load(fh) if path.endswith(".json") else yaml.safe_load(fh)
            except (OSError, ValueError, yaml.YAMLError):
                continue  # not ours to judge; the runtime reports specs it cannot read
            if names_device(spec, NVIDIA_CDI_KIND, device_uuid):
                return nvidia_device_id(device_uuid)
    return None


class ClaimPreparer:
    """Prepare and unprepare claims for the agent; one call at a time (they share the record)."""

    def __init__(self, holder: SliceHolder, settings: PluginSettings) -> None:
        self.holder = holder
        self.settings = settings
        self._lock = asyncio.Lock()

    async def prepare(self, claims: Sequence[Any]) -> dra.NodePrepareResourcesResponse:
        answer = dra.NodePrepareResourcesResponse()
        async with self._lock:
            for claim in claims:
                try:
                    devices = await self._prepare_one(claim)
                    answer.claims[claim.uid].devices.extend(devices)
                except PrepareRefused as exc:
                    log.warning("refused to prepare %s: %s", _claim_ref(claim), exc)
                    answer.claims[claim.uid].error = str(exc)
                except (ApiError, OSError, DeviceFileError) as exc:
                    log.warning("cannot prepare %s: %s", _claim_ref(claim), exc)
                    answer.claims[claim.uid].error = f"{_claim_ref(claim)}: {exc}"
        return answer

    async def unprepare(self, claims: Sequence[Any]) -> dra.NodeUnprepareResourcesResponse:
        answer = dra.NodeUnprepareResourcesResponse()
        async with self._lock:
            for claim in claims:
                try:
                    await self._unprepare_one(claim)
                    answer.claims[claim.uid].error = ""
                except OSError as exc:
                    answer.claims[claim.uid].error = f"{_claim_ref(claim)}: {exc}"
        return answer

    async def _prepare_one(self, claim: Any) -> list[dra.Device]:
        holder = self.holder
        ref = _claim_ref(claim)
        try:
            body = await holder.client.get(claim_path(claim.namespace, claim.name))
        except ApiError as exc:
            if exc.not_found:
                raise PrepareRefused(f"{ref} does not exist") from None
            raise
        if body["metadata"].get("uid") != claim.uid:
            raise PrepareRefused(f"{ref}: the API server's claim of that name has uid "
                                 f"{body['metadata'].get('uid')}, another claim")
        results = [r for r in ((((body.get("status") or {}).get("allocation") or {}).get("devices") or {})
                               .get("results") or []) if r.get("driver") == DRIVER]
        if not results:
            raise PrepareRefused(f"{ref} has no device of driver {DRIVER} allocated")
        devices: list[dra.Device] = []
        for result in results:
            name, pool = str(result.get("device", "")), str(result.get("pool", ""))
            where = f"device {DRIVER}/{pool}/{name}"
            if pool != holder.node:
                raise PrepareRefused(f"{ref}: {where} is in pool {pool!r}, not this node's ({holder.node})")
            entry = holder.ready_entry(name)
            if entry is None and any(c.claim_uid == claim.uid for c in holder.store.claims_on(name)):
                # Prepared before (the kubelet asks again): the instance is still held for this claim,
                # even if its slice has gone since.
                entry = holder.store.record.owners.get(name)
            if entry is None:
                # A pod whose device needs no NVML call is let go at its slice's binding, so the
                # kubelet may ask while the slice is still being realised here: that takes no GPU call.
                entry = await holder.until_ready(name, REALISE_WAIT_S)
            if entry is None:
                raise PrepareRefused(f"{ref}: {where} is not a slice Ready on node {holder.node} "
                                     "(deleted, failed, not yet Ready, or bound elsewhere)")
            refusal = claim_refusal(body["metadata"], name, entry.slice)
            if refusal is not None:
                raise PrepareRefused(f"{ref}: {where} {refusal}")
            others = [c for c in holder.store.claims_on(name) if c.claim_uid != claim.uid]
            if others:
                other = others[0]
                raise PrepareRefused(f"{ref}: {where} (slice {entry.slice}) is already prepared for "
                                     f"ResourceClaim {other.namespace}/{other.name} (uid {other.claim_uid})")
            ids = await self._write_spec(ref, where, entry)
            devices.append(dra.Device(request_names=[str(result.get("request", ""))], pool_name=pool,
                                      device_name=name, cdi_device_ids=ids))
        # Recorded before answering: from here on the instance stays until the claim is unprepared.
        for device in devices:
            await asyncio.to_thread(holder.store.put_prepared,
                                    PreparedClaim(claim.uid, claim.namespace, claim.name, device.device_name))
        log.info("prepared %s: %s", ref, ", ".join(i for d in devices for i in d.cdi_device_ids))
        return devices

    async def _write_spec(self, ref: str, where: str, entry: OwnerEntry) -> list[str]:
        minor = self.holder.gpu_minor(entry.gpu)
        if minor is None or minor < 0:
            raise PrepareRefused(f"{ref}: {where}: GPU {entry.gpu} of node {self.holder.node} has no device minor")
        root = await self.holder.device_root()
        try:
            if entry.mode == MODE_MIG:
                nodes = device_nodes(root, minor, entry.gi_id, entry.ci_id)
            else:
                nodes = device_nodes(root, minor)
        except DeviceFileError as exc:
            raise PrepareRefused(f"{ref}: {where}: {exc}") from None
        namespace, _, name = entry.slice.partition("/")
        memory = self.holder.gpu_memory_bytes(entry.gpu)
        whole = entry.mode == MODE_FRACTION and memory is not None and entry.granted_bytes >= memory
        pipe = shm = ""
        if entry.compute is not None:  # an MPS client: its GPU's daemon must answer before it starts
            mps = self.holder.mps_dirs(entry.device_uuid)
            if mps is None:
                raise PrepareRefused(f"{ref}: {where}: the MPS control daemon of GPU {entry.gpu} "
                                     f"({entry.device_uuid}) on node {self.holder.node} is not running "
                                     "(GpuNode condition MPSReady)")
            pipe, shm = mps.pipe, mps.shm
        spec = slice_spec(SliceDevice(entry.uid, namespace, name, entry.mode, entry.device_uuid, entry.granted_bytes,
                                      tuple(nodes), self.settings.shim_host_dir, self.settings.ledger_host_dir,
                                      self.settings.limits_host_dir, whole_gpu=whole, compute=entry.compute,
                                      mps_pipe_dir=pipe, mps_shm_dir=shm))
        if entry.mode == MODE_FRACTION and not whole:  # the shim's ledger and limit, which the spec mounts
            await asyncio.to_thread(make_ledger_dir, ledger_dir(self.settings.ledger_host_dir, entry.uid))
            await asyncio.to_thread(write_limit_dir, limit_dir(self.settings.limits_host_dir, entry.uid),
                                    shim_files(entry.granted_bytes))
        os.makedirs(self.settings.cdi_dir, exist_ok=True)
        path = os.path.join(self.settings.cdi_dir, spec_file_name(entry.uid))
        await asyncio.to_thread(write_atomically, path, json.dumps(spec, indent=1) + "\n", 0o644)
        ids = [device_id(entry.uid)]
        nvidia = await asyncio.to_thread(find_nvidia_device, self.settings.nvidia_cdi_dirs, entry.device_uuid)
        if nvidia is not None:
            ids.append(nvidia)
        return ids

    async def resync(self) -> None:
        """On start: the spec of every claim still prepared is written again (``/var/run/cdi`` is a
        tmpfs, and the kubelet does not prepare a claim again that its own checkpoint says is
        prepared), and specs of this driver that no prepared claim names are removed."""
        async with self._lock:
            store = self.holder.store
            wanted: set[str] = set()
            for claim in store.prepared.values():
                entry = store.record.owners.get(claim.slice_uid)
                if entry is None or not entry.device_uuid:
                    log.warning("prepared ResourceClaim %s/%s names slice %s, which this node no longer holds",
                                claim.namespace, claim.name, claim.slice_uid)
                    continue
                wanted.add(spec_file_name(claim.slice_uid))
                ref = f"ResourceClaim {claim.namespace}/{claim.name} (uid {claim.claim_uid})"
                try:
                    await self._write_spec(ref, f"device {DRIVER}/{self.holder.node}/{claim.slice_uid}", entry)
                except (PrepareRefused, OSError, DeviceFileError) as exc:
                    log.warning("cannot write the CDI spec of %s again: %s", ref, exc)
            prefix = spec_file_name("")
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(self.settings.cdi_dir):
                    if name.startswith(prefix.removesuffix(".json")) and name.endswith(".json") \
                            and name not in wanted:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(self.settings.cdi_dir, name))
                        log.info("removed CDI spec %s: no prepared claim names its slice", name)
            await asyncio.to_thread(self._prune_slice_dirs, {c.slice_uid for c in store.prepared.values()})

    def _prune_slice_dirs(self, keep: set[str]) -> None:
        for directory, what in ((self.settings.ledger_host_dir, "ledger"), (self.settings.limits_host_dir, "limit")):
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(directory):
                    if name not in keep:
                        remove_slice_dir(os.path.join(directory, name))
                        log.info("removed %s %s: no prepared claim names its slice", what, name)

    async def _unprepare_one(self, claim: Any) -> None:
        store = self.holder.store
        prepared = await asyncio.to_thread(store.drop_prepared, claim.uid)
        if prepared is None:
            log.info("unprepare %s: not prepared here (already unprepared)", _claim_ref(claim))
            return
        if not store.claims_on(prepared.slice_uid):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.settings.cdi_dir, spec_file_name(prepared.slice_uid)))
            await asyncio.to_thread(remove_slice_dir,
                                    ledger_dir(self.settings.ledger_host_dir, prepared.slice_uid))
            await asyncio.to_thread(remove_slice_dir,
                                    limit_dir(self.settings.limits_host_dir, prepared.slice_uid))
        log.info("unprepared %s (slice %s)", _claim_ref(claim), prepared.slice_uid)
        await self.holder.claim_released(prepared.slice_uid)


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, holder: SliceHolder, settings: PluginSettings) -> None:
        self.holder = holder
        self.settings = settings
        self.registered: asyncio.Event = asyncio.Event()

    async def GetInfo(self, request: reg.InfoRequest, context: grpc.aio.ServicerContext) -> reg.PluginInfo:  # noqa: N802
        return reg.PluginInfo(type=DRA_PLUGIN_TYPE, name=DRIVER, endpoint=self.settings.dra_socket,
                              supported_versions=[DRA_PLUGIN_SERVICE])

    async def NotifyRegistrationStatus(self, request: reg.RegistrationStatus,  # noqa: N802
                                       context: grpc.aio.ServicerContext) -> reg.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("the kubelet registered DRA driver %s at %s", DRIVER, self.settings.dra_socket)
            self.registered.set()
            self.holder.kubelet_registered()
        else:
            log.error("the kubelet refused DRA driver %s: %s", DRIVER, request.error)
        return reg.RegistrationStatusResponse()


class _DraService(dra_grpc.DRAPluginServicer):
    def __init__(self, preparer: ClaimPreparer) -> None:
        self.preparer = preparer

    async def NodePrepareResources(self, request: dra.NodePrepareResourcesRequest,  # noqa: N802
                                   context: grpc.aio.ServicerContext) -> dra.NodePrepareResourcesResponse:
        return await self.preparer.prepare(request.claims)

    async def NodeUnprepareResources(self, request: dra.NodeUnprepareResourcesRequest,  # noqa: N802
                                     context: grpc.aio.ServicerContext) -> dra.NodeUnprepareResourcesResponse:
        return await self.preparer.unprepare(request.claims)


class KubeletPlugin:
    """Both gRPC servers on their unix sockets, in the running asyncio loop."""

    def __init__(self, holder: SliceHolder, settings: PluginSettings) -> None:
        self.settings = settings
        self.preparer = ClaimPreparer(holder, settings)
        self.registration = _Registration(holder, settings)
        self._servers: list[grpc.aio.Server] = []

    async def start(self) -> bool:
        """Serve both sockets; False (and nothing served) when there is no kubelet registry here."""
        if not self.settings.registry_dir:
            return False
        if not os.path.isdir(self.settings.registry_dir):
            log.warning("no kubelet plugin registry at %s: the kubelet cannot find DRA driver %s on this "
                        "node (mount the kubelet's plugins_registry there, or pass --kubelet-registry-dir)",
                        self.settings.registry_dir, DRIVER)
            return False
        os.makedirs(self.settings.plugin_dir, exist_ok=True)
        await self.preparer.resync()
        dra_server = grpc.aio.server()
        dra_grpc.add_DRAPluginServicer_to_server(_DraService(self.preparer), dra_server)
        await self._serve(dra_server, self.settings.dra_socket)
        # Registration last: the kubelet calls the DRA socket as soon as it has registered us.
        reg_server = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(self.registration, reg_server)
        await self._serve(reg_server, self.settings.registration_socket)
        log.info("DRA driver %s: registration at %s, service %s at %s", DRIVER, self.settings.registration_socket,
                 DRA_PLUGIN_SERVICE, self.settings.dra_socket)
        return True

    async def _serve(self, server: grpc.aio.Server, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket left by an earlier agent
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        self._servers.append(server)

    async def stop(self) -> None:
        # The registration socket goes first: the kubelet deregisters the plugin when it disappears.
        for server, path in zip(reversed(self._servers), (self.settings.registration_socket, self.settings.dra_socket),
                                strict=False):
            await server.stop(grace=1.0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._servers.clear()


def socket_paths_fit(settings: PluginSettings) -> list[str]:
    """The socket paths too long for a unix socket (empty when all fit)."""
    paths = [settings.dra_socket] + ([settings.registration_socket] if settings.registry_dir else [])
    return [p for p in paths if len(p.encode()) > MAX_SOCKET_PATH]

