"""Allocate device memory with one framework until it runs out, then report.

Usage: python fill.py MODE [CHUNK_MIB] [CAP_MIB]
MODE: baseline | torch | cupy | cupy_async | jax   (PyTorch's allocator is
chosen with PYTORCH_CUDA_ALLOC_CONF, JAX's with its XLA_* variables.)
Prints one JSON line, then holds its memory until stdin closes, so that a
parent can look at the process from outside (nvidia-smi) and run a second
process of the same slice beside it.
"""

import json
import sys


def main() -> None:
    mode = sys.argv[1]
    chunk = int(sys.argv[2] if len(sys.argv) > 2 else 64) << 20
    cap = int(sys.argv[3] if len(sys.argv) > 3 else 16384) << 20
    held, got, err, info = [], 0, None, None
    if mode in ("baseline", "torch"):
        import torch

        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        info = {"free": free, "total": total}
        if mode == "torch":
            while got < cap:
                try:
                    held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
                    got += chunk
                except torch.cuda.OutOfMemoryError as e:
                    err = str(e).splitlines()[0][:200]
                    break
            info["reserved"] = torch.cuda.memory_reserved()
            info["max_reserved"] = torch.cuda.max_memory_reserved()
            free, total = torch.cuda.mem_get_info()
            info["free_after"], info["total_after"] = free, total
    elif mode in ("cupy", "cupy_async"):
        import cupy

        if mode == "cupy_async":
            cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
        free, total = cupy.cuda.runtime.memGetInfo()
        info = {"free": free, "total": total}
        while got < cap:
            try:
                held.append(cupy.empty(chunk, dtype=cupy.uint8))
                got += chunk
            except cupy.cuda.memory.OutOfMemoryError as e:
                err = str(e)[:200]
                break
        cupy.cuda.Device().synchronize()
    elif mode == "jax":
        import jax
        import jax.numpy as jnp

        dev = jax.devices()[0]
        stats = dev.memory_stats() or {}
        info = {"bytes_limit": stats.get("bytes_limit"), "platform": dev.platform}
        while got < cap:
            try:
                x = jnp.ones((chunk,), dtype=jnp.uint8)
                x.block_until_ready()
                held.append(x)
                got += chunk
            except Exception as e:  # XlaRuntimeError RESOURCE_EXHAUSTED
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                break
        stats = dev.memory_stats() or {}
        info["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
        info["bytes_limit_after"] = stats.get("bytes_limit")
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps({"mode": mode, "allocated": got, "error": err, "info": info}), flush=True)
    sys.stdin.read()  # hold until the parent closes our stdin
    del held


if __name__ == "__main__":
    main()
