"""What a prepare writes on the host: a slice's ledger directory, its limit files, and where the NVIDIA
toolkit's CDI spec names a device."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import stat
from collections.abc import Sequence

import yaml

from mig_operator.core.node.cdi import NVIDIA_CDI_KIND, names_device, nvidia_device_id
from mig_operator.gpu.files import write_atomically


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
