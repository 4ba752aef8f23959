"""NVIDIA MPS control daemons, one per GPU, behind one small interface (the agent's compute shares).

A GPU that holds a fraction with a compute share runs ``nvidia-cuda-mps-control -d`` of its own:
``CUDA_VISIBLE_DEVICES`` = the GPU's UUID, and its pipe, log and shm directories under the agent's
host directory (``<root>/<GPU UUID>/{pipe,log,shm}``), so that two GPUs' daemons, and the clients
of each, never meet. Commands go to a running daemon the way NVIDIA's own tools send them: the same
program without ``-d``, the command on its stdin, the pipe directory in its environment (the
daemon answers on the ``control`` socket there). A daemon is running when it answers
``get_default_active_thread_percentage``; that is also how a restarted agent finds (adopts) the
one it left: nothing is restarted that answers.

The daemon and the MPS server it starts share ``/dev/shm`` with their clients. With
``private_shm`` the daemon starts in a mount namespace of its own whose ``/dev/shm`` is the GPU's
``shm`` directory (``unshare``, root), the directory every client's CDI spec mounts at
``/dev/shm``: a GPU's clients share that directory with its daemon and with nobody else.

The simulator's stand-in (``mps_standin.py``) is the same program to this module: a daemon on
``-d``, a client otherwise, answering the commands used here; the lifecycle code is one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

CONTROL_PROGRAM = "nvidia-cuda-mps-control"
DEFAULT_MPS_ROOT = "/var/lib/mig-operator/mps"
_UUID = re.compile(r"GPU-[0-9A-Za-z-]{1,64}")
# A started daemon answers within a second on a real GPU; a command that hangs past this is a daemon
# that does not work, whatever its process says.
COMMAND_TIMEOUT_S = 10.0


class MpsError(Exception):
    """An MPS control daemon cannot be started, asked or stopped; the message names the GPU and why."""


@dataclass(frozen=True)
class MpsDirs:
    """One GPU's MPS directories on the node."""

    root: str  # <mps root>/<GPU UUID>
    pipe: str
    log: str
    shm: str


def mps_dirs(mps_root: str, gpu_uuid: str) -> MpsDirs:
    """The directories of ``gpu_uuid``'s daemon under ``mps_root``. ValueError for a UUID that is not
    one (it becomes a path component)."""
    if _UUID.fullmatch(gpu_uuid) is None:
        raise ValueError(f"{gpu_uuid!r} is not a GPU UUID; e.g. 'GPU-5d3c7e4a-1b2c-4d5e-8f9a-0b1c2d3e4f5a'")
    base = f"{mps_root.rstrip('/')}/{gpu_uuid}"
    return MpsDirs(base, f"{base}/pipe", f"{base}/log", f"{base}/shm")


@runtime_checkable
class MpsControl(Protocol):
    """Start, find, configure and stop the MPS control daemon of one GPU (by UUID). Every method may
    raise :class:`MpsError`; none blocks longer than a few command timeouts."""

    def dirs(self, gpu_uuid: str) -> MpsDirs: ...

    def running(self, gpu_uuid: str) -> bool:
        """Whether the GPU's daemon runs and answers (an agent restarted finds its daemon this way)."""
        ...

    def start(self, gpu_uuid: str) -> None:
        """Start the GPU's daemon unless one answers already (adoption: it is never restarted)."""
        ...

    def hold(self, gpu_uuid: str, thread_percentage: int, pinned_bytes: int) -> None:
        """The most any client of the GPU may have: the daemon's defaults (for servers to come) and
        each running server's own limits."""
        ...

    def stop(self, gpu_uuid: str) -> None:
        """``quit`` the GPU's daemon (its servers end with their last client) and remove its pipe and
        log directories; nothing to do when none runs."""
        ...


class MpsDaemons:
    """:class:`MpsControl` through a control program: ``nvidia-cuda-mps-control`` on a node, the
    stand-in (``[python, -m, mig_operator.gpu.mps_standin]``) with the simulator."""

    def __init__(self, root: str = DEFAULT_MPS_ROOT, program: tuple[str, ...] = (CONTROL_PROGRAM,),
                 private_shm: bool = True, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self.root = root
        self.program = program
        self.private_shm = private_shm
        self.timeout_s = timeout_s

    def dirs(self, gpu_uuid: str) -> MpsDirs:
        return mps_dirs(self.root, gpu_uuid)

    def _env(self, gpu_uuid: str) -> dict[str, str]:
        d = self.dirs(gpu_uuid)
        return {**os.environ, "CUDA_VISIBLE_DEVICES": gpu_uuid, "CUDA_MPS_PIPE_DIRECTORY": d.pipe,
                "CUDA_MPS_LOG_DIRECTORY": d.log}

    def command(self, gpu_uuid: str, line: str) -> str:
        """Send one command to the GPU's daemon; its answer. MpsError when it cannot be sent or fails."""
        try:
            done = subprocess.run(list(self.program), input=line + "\n", capture_output=True, text=True,
                                  env=self._env(gpu_uuid), timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"MPS control daemon of {gpu_uuid}: {line!r} failed: {exc}") from None
        answer = done.stdout.strip()
        # The real program exits 0 even when the daemon refuses a command; it says so in its answer.
        if done.returncode != 0 or answer.lower().startswith(("error", "invalid", "cannot")):
            why = (done.stderr.strip() or answer or f"exit status {done.returncode}")[:300]
            raise MpsError(f"MPS control daemon of {gpu_uuid}: {line!r} failed: {why}")
        return answer

    def running(self, gpu_uuid: str) -> bool:
        if not os.path.isdir(self.dirs(gpu_uuid).pipe):
            return False
        try:
            self.command(gpu_uuid, "get_default_active_thread_percentage")
        except MpsError:
            return False
        return True

    def start(self, gpu_uuid: str) -> None:
        if self.running(gpu_uuid):
            return
        d = self.dirs(gpu_uuid)
        try:
            for path in (d.pipe, d.log, d.shm):
                os.makedirs(path, mode=0o755, exist_ok=True)
            # Clients run as any user: the server's files in shm are theirs to open, as in a /dev/shm.
            os.chmod(d.shm, 0o1777)
        except OSError as exc:
            raise MpsError(f"cannot make the MPS directories of {gpu_uuid} under {d.root}: {exc}") from None
        argv = [*self.program, "-d"]
        if self.private_shm:
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$1" /dev/shm && shift && exec "$@"', "sh", d.shm, *argv]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=self._env(gpu_uuid),
                                  timeout=self.timeout_s, check=False, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"cannot start the MPS control daemon of {gpu_uuid}: {exc}") from None
        if done.returncode != 0:
            why = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}")[:300]
            raise MpsError(f"cannot start the MPS control daemon of {gpu_uuid}: {why}")
        deadline = time.monotonic() + self.timeout_s
        while not self.running(gpu_uuid):
            if time.monotonic() > deadline:
                raise MpsError(f"the MPS control daemon of {gpu_uuid} started but does not answer on "
                               f"{d.pipe}/control (its log: {d.log}/control.log)")
            time.sleep(0.05)

    def servers(self, gpu_uuid: str) -> list[int]:
        """The PIDs of the daemon's running MPS servers (``get_server_list``)."""
        return [int(word) for word in self.command(gpu_uuid, "get_server_list").split() if word.isdigit()]

    def hold(self, gpu_uuid: str, thread_percentage: int, pinned_bytes: int) -> None:
        if not 1 <= thread_percentage <= 100:
            raise ValueError(f"thread percentage {thread_percentage} is not 1..100; e.g. 25")
        limit = f"{max(1, pinned_bytes >> 20)}M"
        self.command(gpu_uuid, f"set_default_active_thread_percentage {thread_percentage}")
        self.command(gpu_uuid, f"set_default_device_pinned_mem_limit 0 {limit}")
        for pid in self.servers(gpu_uuid):
            try:
                self.command(gpu_uuid, f"set_active_thread_percentage {pid} {thread_percentage}")
                self.command(gpu_uuid, f"set_device_pinned_mem_limit {pid} 0 {limit}")
            except MpsError:
                if pid in self.servers(gpu_uuid):
                    raise
                # it ended meanwhile (with its last client): nothing left to hold

    def stop(self, gpu_uuid: str) -> None:
        d = self.dirs(gpu_uuid)
        if self.running(gpu_uuid):
            self.command(gpu_uuid, "quit")
            deadline = time.monotonic() + self.timeout_s
            while self.running(gpu_uuid):
                if time.monotonic() > deadline:
                    raise MpsError(f"the MPS control daemon of {gpu_uuid} does not quit")
                time.sleep(0.05)
        for path in (d.pipe, d.log):
            shutil.rmtree(path, ignore_errors=True)


def standin_program() -> tuple[str, ...]:
    """The stand-in's command line, for the simulator backend."""
    return (sys.executable, "-m", "mig_operator.gpu.mps_standin")


def mps_for_backend(backend: str, root: str) -> MpsDaemons:
    """The NVML backend's daemons are NVIDIA's; the simulator's are the stand-in's (no namespace of
    their own: nothing shares memory with them)."""
    if backend == "nvml":
        return MpsDaemons(root)
    return MpsDaemons(root, standin_program(), private_shm=False)
