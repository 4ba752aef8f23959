"""One process's GPU footprint as NVML reports it and as libgpuslice counts it.

Run by bench/shim_overhead.py with and without the shim.  Prints one JSON line:
  context_init_ms       first torch.cuda.mem_get_info() (creates the context; under the
                        shim it is also the device's first use, where the footprint is measured)
  counted_after_init    total - free from mem_get_info after it (under the shim: what the
                        slice counts for this process, context included)
  counted_after_1gib    the same after a 1 GiB tensor
  nvml_process_bytes    NVML's used memory for this pid after the tensor
  nvml_query_us         median time of one NVML per-process query (what a refresh costs)
"""

import json
import os
import statistics
import time

import pynvml
import torch


def main() -> None:
    t0 = time.perf_counter()
    free, total = torch.cuda.mem_get_info()
    init_ms = (time.perf_counter() - t0) * 1e3
    counted_init = total - free
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    h = next(pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
             if uuid in pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
    mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()]
    times = []
    for _ in range(200):
        t = time.perf_counter()
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        times.append((time.perf_counter() - t) * 1e6)
    print(json.dumps({"context_init_ms": round(init_ms, 2), "counted_after_init": counted_init,
                      "counted_after_1gib": total - free, "nvml_process_bytes": mine[0] if mine else None,
                      "nvml_query_us": round(statistics.median(times), 1), "total": total}))
    del x


if __name__ == "__main__":
    main()
