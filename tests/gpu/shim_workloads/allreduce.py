"""torch.distributed all-reduce over NCCL under the shim, one process per GPU.

Usage: python allreduce.py RANK WORLD PORT ITERS
After init_process_group and a first all-reduce it prints {"phase": "ready"}
and waits for a line on stdin; then runs ITERS all-reduces of a 256 MiB
float32 tensor, checking each sum; then allocates 64 MiB tensors until out of
memory and tries one more (small) all-reduce; prints {"phase": "done"} and
holds until stdin closes.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    rank, world, port, iters = (int(a) for a in sys.argv[1:5])
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}")
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    x = torch.ones(64 << 20, dtype=torch.float32, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    say({"phase": "ready", "rank": rank, "free": free, "total": total})
    sys.stdin.readline()
    want = float(sum(range(1, world + 1)))
    wrong = 0
    t0 = time.perf_counter()
    for _ in range(iters):
        x.fill_(rank + 1)
        dist.all_reduce(x)
        wrong += int(x[0].item() != want or x[-1].item() != want)
    torch.cuda.synchronize()
    per_iter_ms = (time.perf_counter() - t0) * 1e3 / iters
    held, got, err = [], 0, None
    while True:
        try:
            held.append(torch.empty(64 << 20, dtype=torch.uint8, device=dev))
            got += 64 << 20
        except torch.cuda.OutOfMemoryError as e:
            err = str(e).splitlines()[0][:200]
            break
    try:
        y = torch.ones(1024, device=dev)
        dist.all_reduce(y)
        torch.cuda.synchronize()
        after = "ok" if y[0].item() == world else "wrong sum"
    except Exception as e:  # reported, not asserted: the GPU is full by design here
        after = f"{type(e).__name__}: {str(e)[:120]}"
    free, total = torch.cuda.mem_get_info()
    say({"phase": "done", "rank": rank, "iters": iters, "wrong": wrong, "per_iter_ms": round(per_iter_ms, 3),
         "filled": got, "error": err, "allreduce_when_full": after, "free": free, "total": total})
    sys.stdin.read()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
