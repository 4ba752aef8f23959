"""A small PyTorch training loop; prints its median step time as JSON.
Used by bench/shim_overhead.py with and without libgpuslice preloaded."""

import json
import os
import statistics

import torch
import torch.nn as nn


def nvml_process_bytes() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            if uuid in pynvml.nvmlDeviceGetUUID(h):
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    if p.pid == os.getpid():
                        return int(p.usedGpuMemory)
    except Exception:  # NVML missing: the figure is simply absent
        return None
    return None


def main() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=1024, nhead=16, dim_feedforward=4096, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=6).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 512, 1024, device="cuda")
    times = []
    allocs_before = frees_before = 0
    for i in range(230):
        if i == 30:
            # Calls of cudaMalloc/cudaFree PyTorch makes from here on: the only way this loop can
            # reach the shim's allocation hooks. In steady state the caching allocator makes none.
            stats = torch.cuda.memory_stats()
            allocs_before, frees_before = stats["num_device_alloc"], stats["num_device_free"]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        if i >= 30:
            times.append(start.elapsed_time(end))
    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    print(json.dumps({"median_step_ms": round(statistics.median(times), 4), "steps": len(times),
                      # under the shim total is the limit and total - free what the slice counts
                      # for this process (context included); NVML's own figure for this pid beside it
                      "mem_get_info_used": total - free, "nvml_process_bytes": nvml_process_bytes(),
                      "max_reserved": torch.cuda.max_memory_reserved(),
                      "device_allocs_in_timed_steps": stats["num_device_alloc"] - allocs_before,
                      "device_frees_in_timed_steps": stats["num_device_free"] - frees_before}))


if __name__ == "__main__":
    main()
