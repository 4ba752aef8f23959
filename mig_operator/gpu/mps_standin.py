"""The simulator's stand-in for ``nvidia-cuda-mps-control`` (as ``simulated.py`` is for NVML).

The same command line as NVIDIA's: ``-d`` starts a daemon in the background that makes
``$CUDA_MPS_PIPE_DIRECTORY`` and ``$CUDA_MPS_LOG_DIRECTORY``, listens on ``control`` in the pipe
directory (a unix socket, as the real daemon's), writes its PID to
``nvidia-cuda-mps-control.pid`` there and its commands to ``control.log``; without ``-d`` it sends
stdin's commands to that daemon and prints the answers, failing as the real one does when no daemon
answers. It answers the commands ``gpu/mps.py`` uses; ``quit`` ends it. It runs no GPU work.
"""

from __future__ import annotations

import os
import socket
import sys

PID_FILE = "nvidia-cuda-mps-control.pid"


def _answer(state: dict[str, str], line: str) -> tuple[str, bool]:
    """The answer to one command and whether the daemon goes on."""
    words = line.split()
    if not words:
        return "", True
    cmd, args = words[0], words[1:]
    if cmd == "quit":
        return "", False
    if cmd == "get_server_list":
        return "", True  # no GPU work here, so no server
    if cmd == "get_default_active_thread_percentage":
        return state.get("threads", "100.0"), True
    if cmd == "set_default_active_thread_percentage" and len(args) == 1:
        state["threads"] = f"{float(args[0]):.1f}"
        return state["threads"], True
    if cmd == "get_default_device_pinned_mem_limit" and len(args) == 1:
        return state.get(f"pinned{args[0]}", "0"), True
    if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
        state[f"pinned{args[0]}"] = args[1]
        return "", True
    return f"Invalid command {line!r}", True


def daemon(pipe: str, log: str) -> None:
    os.makedirs(pipe, exist_ok=True)
    os.makedirs(log, exist_ok=True)
    # Bound by its name in the pipe directory: a unix socket's path holds 107 bytes, a test's
    # directory can be longer.
    os.chdir(pipe)
    path = os.path.join(pipe, "control")
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("control")
    server.listen(8)
    with open(os.path.join(pipe, PID_FILE), "w") as fh:
        fh.write(f"{os.getpid()}\n")
    state: dict[str, str] = {"uuid": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    with open(os.path.join(log, "control.log"), "a", buffering=1) as logf:
        logf.write(f"control daemon started for {state['uuid']} (pid {os.getpid()})\n")
        going = True
        while going:
            conn, _ = server.accept()
            with conn, conn.makefile("rw") as stream:
                for line in stream:
                    logf.write(f"command: {line.strip()}\n")
                    answer, going = _answer(state, line.strip())
                    stream.write(answer + "\n")
                    stream.flush()
                    if not going:
                        break
        logf.write("control daemon exits\n")
    server.close()
    os.unlink(path)
    os.unlink(os.path.join(pipe, PID_FILE))


def client(pipe: str) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.chdir(pipe)
        conn.connect("control")
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    with conn, conn.makefile("rw") as stream:
        for line in sys.stdin:
            if not line.strip():
                continue
            stream.write(line.strip() + "\n")
            stream.flush()
            answer = stream.readline()
            if answer.strip():
                print(answer.strip())
    return 0


def main(argv: list[str]) -> int:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    log = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
    if argv[:1] != ["-d"]:
        return client(pipe)
    if os.fork():  # the parent returns once the child has detached, as the real -d does
        return 0
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        daemon(pipe, log)
    finally:
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
