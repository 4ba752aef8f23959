"""Run inside a sliced container: print, as one JSON object, what the container sees of its slice.

Its environment (the slice's variables), the mounts of the shim, the ledger, the limit file and
/etc/ld.so.preload (with their options), whether the shim is mapped into this process (preloaded), the
device nodes under /dev, and, when PROBE_ALLOC_BYTES is set, how many allocations of that size the CUDA
driver API grants before it refuses one (through ctypes, as PyTorch and every CUDA program reach the
driver: dlopen + dlsym of libcuda.so.1, here the shim tests' fake one). Python's standard library only:
it runs in the workload image.
"""

import ctypes
import json
import os
import stat
import sys

SHIM = "/usr/local/lib/cdmo/libgpuslice.so"
LEDGER = "/run/cdmo/ledger"
LIMIT = "/run/cdmo/limit"
PRELOAD = "/etc/ld.so.preload"


def mounts() -> dict:
    found = {}
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            if fields[4] in (SHIM, LEDGER, LIMIT, PRELOAD):
                found[fields[4]] = fields[5].split(",")
    return found


def devices() -> dict:
    nodes = {}
    for root, _dirs, files in os.walk("/dev"):
        for name in files:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if stat.S_ISCHR(st.st_mode) and "nvidia" in path:
                nodes[path] = [os.major(st.st_rdev), os.minor(st.st_rdev)]
    return nodes


def allocate(size: int, tries: int) -> dict:
    cuda = ctypes.CDLL("libcuda.so.1")
    out = {"init": cuda.cuInit(0)}
    dev = ctypes.c_int()
    out["device"] = cuda.cuDeviceGet(ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    out["context"] = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    results = []
    for _ in range(tries):
        ptr = ctypes.c_uint64()
        rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
        results.append(rc)
        if rc != 0:
            break
    out["results"] = results
    return out


def main() -> None:
    with open("/proc/self/maps") as fh:
        mapped = SHIM in fh.read()
    view = {
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("CDMO_", "NVIDIA_", "GPU_MEM", "LD_PRELOAD"))},
        "mounts": mounts(),
        "shim_mapped": mapped,
        "devices": devices(),
    }
    size = int(os.environ.get("PROBE_ALLOC_BYTES", "0"))
    if size:
        view["alloc"] = allocate(size, int(os.environ.get("PROBE_ALLOC_TRIES", "64")))
    print("PROBE " + json.dumps(view, sort_keys=True), flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "--wait":
        import time
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
