"""Hold, free and ask for device memory with PyTorch on command, so a parent can read the slice's ledger
and NVML from outside at each step.

Usage: python hold.py
Protocol: initialise CUDA on device 0 (its context and one small allocation), print {"phase": "ready"}; then, per
line on stdin, do it and print one JSON line:
  alloc MIB   -> {"phase": "alloc", "ok": bool}   one tensor of MIB MiB, kept (ok False: out of memory)
  free        -> {"phase": "free"}                drop every tensor and return the cache to the driver
  busy SECS   -> {"phase": "busy"}                run matrix products for SECS seconds
Exit when stdin closes.
"""

import json
import sys
import time


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda:0")  # the context, and a first allocation (the shim's slot), exist from here
    torch.cuda.synchronize(0)
    held: list = []
    say({"phase": "ready"})
    for line in sys.stdin:
        word, *args = line.split()
        if word == "alloc":
            try:
                held.append(torch.empty(int(args[0]) << 20, dtype=torch.uint8, device="cuda:0"))
                ok = True
            except torch.cuda.OutOfMemoryError:
                ok = False
            torch.cuda.synchronize(0)
            say({"phase": "alloc", "ok": ok})
        elif word == "free":
            held.clear()
            torch.cuda.synchronize(0)
            torch.cuda.empty_cache()
            say({"phase": "free"})
        elif word == "busy":
            a = torch.randn(4096, 4096, device="cuda:0")
            end = time.monotonic() + float(args[0])
            while time.monotonic() < end:
                for _ in range(8):
                    a = torch.tanh(a @ a)
                torch.cuda.synchronize(0)
            del a
            say({"phase": "busy"})


if __name__ == "__main__":
    main()
