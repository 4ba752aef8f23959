"""Where the plugin's sockets and the slices' host directories are."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mig_operator.core.node.cdi import DRIVER

from ...common.names import SHIM_HOST_DIR

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


def socket_paths_fit(settings: PluginSettings) -> list[str]:
    """The socket paths too long for a unix socket (empty when all fit)."""
    paths = [settings.dra_socket] + ([settings.registration_socket] if settings.registry_dir else [])
    return [p for p in paths if len(p.encode()) > MAX_SOCKET_PATH]

