"""Allocate device memory with one framework until it runs out, then report.

Usage: python fill.py MODE [CHUNK_MIB] [CAP_MIB] [DEVICES]
MODE: baseline | torch | cupy | cupy_async | jax   (PyTorch's allocator is
chosen with PYTORCH_CUDA_ALLOC_CONF, JAX's with its XLA_* variables.)
DEVICES: comma-separated device indices to fill one after the other (torch
only; default "0").

Protocol, so that a parent can measure the process from outside (NVML):
1. initialise the framework (this creates the CUDA context), print one JSON
   line {"phase": "ready", ...} and wait for a line on stdin;
2. allocate CHUNK_MIB pieces until the framework reports out of memory (or
   CAP_MIB), print {"phase": "done", ...};
3. hold everything until stdin closes.
"""

import json
import sys


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    mode = sys.argv[1]
    chunk = int(sys.argv[2] if len(sys.argv) > 2 else 64) << 20
    cap = int(sys.argv[3] if len(sys.argv) > 3 else 16384) << 20
    devices = [int(d) for d in (sys.argv[4] if len(sys.argv) > 4 else "0").split(",")]
    held: list = []
    got: dict[int, int] = {}
    err: dict[int, str | None] = {}
    info: dict = {}
    if mode in ("baseline", "torch"):
        import torch

        for d in devices:  # a context on each device
            free, total = torch.cuda.mem_get_info(d)
            info[str(d)] = {"free": free, "total": total}
        say({"phase": "ready", "info": info})
        sys.stdin.readline()
        if mode == "torch":
            for d in devices:
                got[d], err[d] = 0, None
                while got[d] < cap:
                    try:
                        held.append(torch.empty(chunk, dtype=torch.uint8, device=f"cuda:{d}"))
                        got[d] += chunk
                    except torch.cuda.OutOfMemoryError as e:
                        err[d] = str(e).splitlines()[0][:200]
                        break
                free, total = torch.cuda.mem_get_info(d)
                info[str(d)].update({"free_after": free, "total_after": total,
                                     "reserved": torch.cuda.memory_reserved(d)})
    elif mode in ("cupy", "cupy_async"):
        import cupy

        if mode == "cupy_async":
            cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
        free, total = cupy.cuda.runtime.memGetInfo()
        info["0"] = {"free": free, "total": total}
        say({"phase": "ready", "info": info})
        sys.stdin.readline()
        got[0], err[0] = 0, None
        while got[0] < cap:
            try:
                held.append(cupy.empty(chunk, dtype=cupy.uint8))
                got[0] += chunk
            except cupy.cuda.memory.OutOfMemoryError as e:
                err[0] = str(e)[:200]
                break
        cupy.cuda.Device().synchronize()
    elif mode == "jax":
        import jax
        import jax.numpy as jnp

        dev = jax.devices()[0]
        stats = dev.memory_stats() or {}
        info["0"] = {"bytes_limit": stats.get("bytes_limit"), "platform": dev.platform}
        say({"phase": "ready", "info": info})
        sys.stdin.readline()
        got[0], err[0] = 0, None
        while got[0] < cap:
            try:
                x = jnp.ones((chunk,), dtype=jnp.uint8)
                x.block_until_ready()
                held.append(x)
                got[0] += chunk
            except Exception as e:  # XlaRuntimeError RESOURCE_EXHAUSTED
                err[0] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                break
        stats = dev.memory_stats() or {}
        info["0"]["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    else:
        raise SystemExit(f"unknown mode {mode}")
    say({"phase": "done", "mode": mode, "allocated": {str(k): v for k, v in got.items()},
         "error": {str(k): v for k, v in err.items()}, "info": info})
    sys.stdin.read()  # hold until the parent closes our stdin
    del held


if __name__ == "__main__":
    main()
