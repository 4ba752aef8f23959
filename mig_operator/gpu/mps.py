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

A daemon lives as long as the container that started it. So that compute-share clients outlive the
agent's pod (an upgrade replaces it), the chart runs the daemons in a pod of their own on each node,
``mig-operator mps-host`` (:func:`serve_starts`), and the agent asks it through the GPU's directory
(:class:`HostedMps`): a ``start`` file there says the GPU needs a daemon; the MPS host starts one
(and starts it again should it die) while the file is there, or writes why it cannot to
``start-error``. Everything else (asking, holding, ``quit``) goes over the daemon's pipe, from the
agent, as before. A lock file in the GPU's directory (``flock``, one kernel lock across both pods)
keeps a stop and a start of one GPU from crossing.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mig_operator.core.requests.quantities import read_integer

CONTROL_PROGRAM = "nvidia-cuda-mps-control"
DEFAULT_MPS_ROOT = "/var/lib/mig-operator/mps"
_UUID = re.compile(r"GPU-[0-9A-Za-z-]{1,64}")
# A started daemon answers within a second on a real GPU; a command that hangs past this is a daemon
# that does not work, whatever its process says.
COMMAND_TIMEOUT_S = 10.0
# In a GPU's directory: the agent's request that the node's MPS host run its daemon, the host's
# answer when it cannot, and the lock both take around a start or a stop.
START_REQUEST = "start"
START_ERROR = "start-error"
LOCK_FILE = ".lock"
PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe directory, written by the daemon (NVIDIA's and the stand-in)

log = logging.getLogger("mig_operator.mps")


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
        words = self.command(gpu_uuid, "get_server_list").split()
        return [pid for pid in map(read_integer, words) if pid is not None]

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


@contextlib.contextmanager
def _gpu_lock(d: MpsDirs) -> Iterator[None]:
    """The GPU's start/stop lock (``flock`` on a file in its directory, held across pods)."""
    os.makedirs(d.root, mode=0o755, exist_ok=True)
    fd = os.open(os.path.join(d.root, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class HostedMps:
    """:class:`MpsControl` whose daemons the node's MPS host starts (``mig-operator mps-host``, a pod of
    its own), so that they and their clients outlive the agent's pod. ``start`` asks the host and
    waits until the daemon answers; the rest talks to the daemon as :class:`MpsDaemons` does."""

    def __init__(self, daemons: MpsDaemons, wait_s: float = 3 * COMMAND_TIMEOUT_S) -> None:
        self.daemons = daemons
        self.wait_s = wait_s

    def dirs(self, gpu_uuid: str) -> MpsDirs:
        return self.daemons.dirs(gpu_uuid)

    def running(self, gpu_uuid: str) -> bool:
        return self.daemons.running(gpu_uuid)

    def hold(self, gpu_uuid: str, thread_percentage: int, pinned_bytes: int) -> None:
        self.daemons.hold(gpu_uuid, thread_percentage, pinned_bytes)

    def start(self, gpu_uuid: str) -> None:
        d = self.dirs(gpu_uuid)
        request, error = os.path.join(d.root, START_REQUEST), os.path.join(d.root, START_ERROR)
        try:
            with _gpu_lock(d):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(error)  # the host's answer to an earlier request
                with open(request, "w"):
                    pass  # adopted or not: the host keeps it running from now on
        except OSError as exc:
            raise MpsError(f"cannot ask for the MPS control daemon of {gpu_uuid} under {d.root}: {exc}") from None
        deadline = time.monotonic() + self.wait_s
        while not self.running(gpu_uuid):
            try:
                with open(error) as fh:
                    raise MpsError(fh.read().strip()[:300] or f"the MPS host cannot start the daemon of {gpu_uuid}")
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise MpsError(f"no MPS host started the MPS control daemon of {gpu_uuid} within {self.wait_s:g}s: "
                               "is this node's MPS host pod running (DaemonSet <release>-mps, "
                               "'mig-operator mps-host')?")
            time.sleep(0.1)

    def stop(self, gpu_uuid: str) -> None:
        d = self.dirs(gpu_uuid)
        try:
            with _gpu_lock(d):
                for name in (START_REQUEST, START_ERROR):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(d.root, name))
                self.daemons.stop(gpu_uuid)
        except OSError as exc:
            raise MpsError(f"cannot stop the MPS control daemon of {gpu_uuid} under {d.root}: {exc}") from None


def _alive(pipe: str) -> bool:
    """Whether the daemon's PID file names a live process started for this pipe directory (a cheap
    look, no command sent). A PID file left by a daemon of an earlier pod (another PID namespace) may
    name an unrelated process of this one: only the daemon's own environment names its pipe."""
    try:
        with open(os.path.join(pipe, PID_FILE)) as fh:
            pid = int(fh.read().strip())
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in fh.read().split(b"\0")
    except (OSError, ValueError, IndexError):
        return False


def _reap() -> None:
    """Collect the daemons that quit: started with ``-d``, they are this process's children when it
    is the container's first process (PID 1)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def settle_starts(daemons: MpsDaemons) -> None:
    """One pass of the MPS host: a daemon runs for each GPU directory under the root holding a start
    request (started unless one answers); why one cannot start is written beside the request."""
    _reap()
    try:
        names = sorted(os.listdir(daemons.root))
    except FileNotFoundError:
        return
    for name in names:
        try:
            d = daemons.dirs(name)
        except ValueError:
            continue  # not a GPU's directory
        if not os.path.exists(os.path.join(d.root, START_REQUEST)) or _alive(d.pipe):
            continue
        with _gpu_lock(d):
            if not os.path.exists(os.path.join(d.root, START_REQUEST)):
                continue  # stopped meanwhile
            try:
                started = not daemons.running(name)
                daemons.start(name)
            except MpsError as exc:
                log.error("%s", exc)
                write_error = os.path.join(d.root, START_ERROR)
                with open(write_error, "w") as fh:
                    fh.write(f"{exc}\n")
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d.root, START_ERROR))
            if started:
                log.info("MPS control daemon of %s started (%s)", name, d.pipe)


def serve_starts(daemons: MpsDaemons, stop: threading.Event, interval_s: float = 0.5) -> None:
    """The MPS host: :func:`settle_starts` every ``interval_s`` until ``stop`` is set."""
    os.makedirs(daemons.root, mode=0o755, exist_ok=True)
    while not stop.is_set():
        try:
            settle_starts(daemons)
        except OSError as exc:
            log.error("MPS host: %s", exc)
        stop.wait(interval_s)
