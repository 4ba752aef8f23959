"""What the agent's rooms share: its settings and the one instance of each collaborator (the GPUs,
the owner record, the API client, the Event poster, the MPS keeper). Each room takes the context; none
imports another room's module to reach them."""

from __future__ import annotations

from dataclasses import dataclass

from ..common.client import KubeClient
from ..common.events import EventPoster
from .gpus import Gpus
from .mps_keeper import MpsKeeper
from .record import RecordStore


@dataclass(frozen=True)
class AgentSettings:
    node: str
    idle_timeout_s: float | None = None  # None: idle instances stay until their space is needed
    nvml_attempts: int = 5  # tries of a transiently failing GPU call before the slice fails
    nvml_first_wait_s: float = 0.2
    # Changes within this window go out in one GpuNode write. The controller never waits for it (its
    # own bindings say what is taken), so it only bounds how stale `kubectl get gn` may look.
    publish_delay_s: float = 1.0
    heartbeat_s: float = 30.0  # GpuNode re-read and re-published at least this often
    health_poll_s: float = 2.0  # each GPU's health (Xid events, GPU lost) is read this often
    device_taint_effect: str = "NoSchedule"  # of the taint on an unhealthy GPU's devices (NoExecute evicts)
    toolkit_config: str = ""  # the node's NVIDIA toolkit config.toml, read for RuntimeTrusted ("": not read)
    # A deleted slice kept while its claim is in use is looked at again this often (and at once when
    # the kubelet unprepares a claim on it): the pod's end frees the claim's reservation without an
    # event the agent sees.
    release_recheck_s: float = 2.0
    release_recheck_max_s: float = 30.0  # the re-check's interval doubles up to this while nothing changes
    usage_interval_s: float = 10.0  # each Ready slice's usage is read this often (0: not read)
    idle_after_s: float = 1800.0  # a Ready slice with no process for this long is Active=False (NoProcess)
    # The fractions' ledger directories, where the kubelet plugin makes them (PluginSettings.ledger_host_dir);
    # "": none kept, a fraction reads as unused.
    ledger_host_dir: str = ""


@dataclass(frozen=True)
class AgentContext:
    settings: AgentSettings
    gpus: Gpus
    store: RecordStore
    client: KubeClient
    events: EventPoster
    mps: MpsKeeper
