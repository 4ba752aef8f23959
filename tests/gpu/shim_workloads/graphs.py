"""CUDA graph allocation nodes under the shim, through the driver API (ctypes).

Usage: python graphs.py LIMIT_BYTES
After the context exists it prints {"phase": "ready"} and waits for a line
on stdin; then:
  a. a graph that allocates 512 MiB and frees it: instantiate, launch twice;
  b. a graph that allocates LIMIT bytes and keeps them: its launch must be
     refused with CUDA_ERROR_OUT_OF_MEMORY (2), the context alone being
     charged;
  c. cuMemAllocAsync + cuMemFreeAsync of 256 MiB captured from a stream,
     instantiated and launched three times;
prints {"phase": "done", ...} with return codes and the shim's figures
(cuMemGetInfo through the shim, the graph pool's reservation from the driver),
and holds until stdin closes.
"""

import ctypes as C
import json
import sys

MiB = 1 << 20
cu = C.CDLL("libcuda.so.1")  # dlopen + dlsym: the shim's dlsym path


def ck(r: int, what: str) -> None:
    if r:
        raise SystemExit(f"{what} failed: CUresult {r}")


class Loc(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class PoolProps(C.Structure):
    _fields_ = [("allocType", C.c_int), ("handleTypes", C.c_int), ("location", Loc),
                ("win32SecurityAttributes", C.c_void_p), ("maxSize", C.c_size_t),
                ("usage", C.c_ushort), ("reserved", C.c_ubyte * 54)]


class AllocParams(C.Structure):
    _fields_ = [("poolProps", PoolProps), ("accessDescs", C.c_void_p), ("accessDescCount", C.c_size_t),
                ("bytesize", C.c_size_t), ("dptr", C.c_uint64)]


assert C.sizeof(AllocParams) == 120


def meminfo() -> dict:
    free, total = C.c_size_t(), C.c_size_t()
    ck(cu.cuMemGetInfo_v2(C.byref(free), C.byref(total)), "cuMemGetInfo_v2")
    return {"free": free.value, "total": total.value}


def graph_reserved(dev: C.c_int) -> int:
    v = C.c_uint64()
    ck(cu.cuDeviceGetGraphMemAttribute(dev, 2, C.byref(v)), "cuDeviceGetGraphMemAttribute")
    return v.value


def alloc_graph(nbytes: int, free_it: bool) -> C.c_void_p:
    g = C.c_void_p()
    ck(cu.cuGraphCreate(C.byref(g), 0), "cuGraphCreate")
    p = AllocParams()
    p.poolProps.allocType = 1  # pinned
    p.poolProps.location.type = 1  # device
    p.poolProps.location.id = 0
    p.bytesize = nbytes
    n = C.c_void_p()
    ck(cu.cuGraphAddMemAllocNode(C.byref(n), g, None, C.c_size_t(0), C.byref(p)), "cuGraphAddMemAllocNode")
    if free_it:
        n2 = C.c_void_p()
        ck(cu.cuGraphAddMemFreeNode(C.byref(n2), g, C.byref(n), C.c_size_t(1), C.c_uint64(p.dptr)),
           "cuGraphAddMemFreeNode")
    e = C.c_void_p()
    ck(cu.cuGraphInstantiateWithFlags(C.byref(e), g, C.c_ulonglong(0)), "cuGraphInstantiateWithFlags")
    return e


def main() -> None:
    limit = int(sys.argv[1])
    ck(cu.cuInit(0), "cuInit")
    dev = C.c_int()
    ck(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    ctx = C.c_void_p()
    ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    out: dict = {"ready": meminfo()}
    print(json.dumps({"phase": "ready", "info": out["ready"]}), flush=True)
    sys.stdin.readline()

    e1 = alloc_graph(512 * MiB, True)
    out["a_instantiated"] = meminfo()
    out["a_launch"] = [cu.cuGraphLaunch(e1, None), cu.cuGraphLaunch(e1, None)]
    ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    out["a_after"] = meminfo()
    out["a_graph_reserved"] = graph_reserved(dev)

    e2 = alloc_graph(limit, False)
    out["b_launch"] = cu.cuGraphLaunch(e2, None)
    ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    out["b_after"] = meminfo()
    out["b_graph_reserved"] = graph_reserved(dev)

    s = C.c_void_p()
    ck(cu.cuStreamCreate(C.byref(s), 1), "cuStreamCreate")
    ck(cu.cuStreamBeginCapture_v2(s, 2), "cuStreamBeginCapture_v2")  # relaxed
    d = C.c_uint64()
    out["c_alloc"] = cu.cuMemAllocAsync(C.byref(d), C.c_size_t(256 * MiB), s)
    out["c_free"] = cu.cuMemFreeAsync(d, s)
    g = C.c_void_p()
    ck(cu.cuStreamEndCapture(s, C.byref(g)), "cuStreamEndCapture")
    e3 = C.c_void_p()
    ck(cu.cuGraphInstantiateWithFlags(C.byref(e3), g, C.c_ulonglong(0)), "instantiate captured")
    out["c_launch"] = [cu.cuGraphLaunch(e3, s) for _ in range(3)]
    ck(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
    out["c_after"] = meminfo()
    out["c_graph_reserved"] = graph_reserved(dev)
    print(json.dumps({"phase": "done", **out}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
