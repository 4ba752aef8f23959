"""Device memory that loading code commits: module and library globals, through the driver API.

Usage:
  python modules.py probe API GLOBAL_MIB
      API: module | library.  Loads one image holding a GLOBAL_MIB `__device__` array (compiled here
      with NVRTC, the way CuPy and Triton compile) and prints, as one JSON line, the device's used
      memory (cuMemGetInfo, no shim expected) after each step: load, (library: cuLibraryGetModule),
      cuModuleGetFunction / cuLibraryGetKernel, first launch, unload.  What CUDA_MODULE_LOADING
      (LAZY, EAGER) changes is read by running it under both.
  python modules.py attack N GLOBAL_MIB CHUNK_MIB
      The hostile workload of issue 24: N CuPy RawModules, each with a GLOBAL_MIB `__device__` array
      that a kernel touches, then CuPy allocations of CHUNK_MIB until out of memory.  Protocol as
      fill.py: {"phase": "ready"} after the context exists, wait for a line, load and allocate,
      {"phase": "done", ...}, hold until stdin closes.
  python modules.py libattack N GLOBAL_MIB
      The same N images loaded with cuLibraryLoadData through ctypes (dlsym on libcuda.so.1) and
      launched once each.
"""

from __future__ import annotations

import ctypes
import json
import sys

SOURCE = r"""
extern "C" __device__ unsigned char big[%d];
extern "C" __global__ void touch(unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i < n; i += (unsigned long long)gridDim.x * blockDim.x) big[i] = 1;
}
"""


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


class Driver:
    def __init__(self) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.ok(self.cu.cuInit(0))
        dev = ctypes.c_int()
        self.ok(self.cu.cuDeviceGet(ctypes.byref(dev), 0))
        self.dev = dev.value
        self.ctx = ctypes.c_void_p()
        self.ok(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), self.dev))
        self.ok(self.cu.cuCtxSetCurrent(self.ctx))

    @staticmethod
    def ok(r: int) -> None:
        if r != 0:
            raise RuntimeError(f"CUDA error {r}")

    def used(self) -> int:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.ok(self.cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
        return total.value - free.value

    def arch(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.ok(self.cu.cuDeviceGetAttribute(ctypes.byref(major), 75, self.dev))
        self.ok(self.cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, self.dev))
        return f"sm_{major.value}{minor.value}"

    def launch(self, fn: ctypes.c_void_p, n: int) -> int:
        arg = ctypes.c_ulonglong(n)
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p))
        r = self.cu.cuLaunchKernel(fn, 1024, 1, 1, 256, 1, 1, 0, None, params, None)
        return r or self.cu.cuCtxSynchronize()


def nvrtc_lib() -> ctypes.CDLL:
    import cupy  # noqa: F401  (loads CuPy's NVRTC)
    from cupy.cuda import nvrtc

    nvrtc.getVersion()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libnvrtc.so" in line and "builtins" not in line}
    if not paths:
        raise RuntimeError("no libnvrtc loaded")
    return ctypes.CDLL(sorted(paths)[0])


def cubin(global_mib: int, arch: str) -> bytes:
    lib = nvrtc_lib()
    prog = ctypes.c_void_p()
    src = (SOURCE % (global_mib << 20)).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"m.cu", 0, None, None) == 0
    opts = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
    r = lib.nvrtcCompileProgram(prog, 1, opts)
    if r != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"nvrtc: {log.value.decode()[:500]}")
    size = ctypes.c_size_t()
    assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) == 0
    buf = ctypes.create_string_buffer(size.value)
    assert lib.nvrtcGetCUBIN(prog, buf) == 0
    return buf.raw


def probe(api: str, global_mib: int) -> None:
    d = Driver()
    image = cubin(global_mib, d.arch())
    cu = d.cu
    steps: list[tuple[str, int, int]] = [("start", 0, d.used())]
    n = global_mib << 20
    if api == "module":
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        steps.append(("load", cu.cuModuleLoadData(ctypes.byref(mod), image), d.used()))
        steps.append(("get_function", cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"touch"), d.used()))
        steps.append(("launch", d.launch(fn, n), d.used()))
        steps.append(("unload", cu.cuModuleUnload(mod), d.used()))
    else:
        lib, mod, kern, fn = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        steps.append(("load", cu.cuLibraryLoadData(ctypes.byref(lib), image, None, None, 0, None, None, 0),
                      d.used()))
        steps.append(("get_kernel", cu.cuLibraryGetKernel(ctypes.byref(kern), lib, b"touch"), d.used()))
        steps.append(("get_module", cu.cuLibraryGetModule(ctypes.byref(mod), lib), d.used()))
        steps.append(("get_function", cu.cuKernelGetFunction(ctypes.byref(fn), kern), d.used()))
        steps.append(("launch", d.launch(fn, n), d.used()))
        steps.append(("unload", cu.cuLibraryUnload(lib), d.used()))
    mode = ctypes.c_int()
    cu.cuModuleGetLoadingMode(ctypes.byref(mode))
    base = steps[0][2]
    say({"api": api, "global_mib": global_mib, "loading_mode": {1: "EAGER", 2: "LAZY"}.get(mode.value, mode.value),
         "steps": [{"step": s, "rc": rc, "used_mib": round((u - base) / 2**20, 1)} for s, rc, u in steps]})


def attack(count: int, global_mib: int, chunk_mib: int) -> None:
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    say({"phase": "ready", "info": {"free": free, "total": total}})
    sys.stdin.readline()
    n = global_mib << 20
    loaded, errors = 0, []
    kernels = []
    for i in range(count):
        try:
            mod = cupy.RawModule(code=SOURCE % n, options=(f"-DVARIANT={i}",))
            fn = mod.get_function("touch")
            fn((1024,), (256,), (cupy.uint64(n),))
            cupy.cuda.Device().synchronize()
            kernels.append((mod, fn))
            loaded += 1
        except Exception as e:  # noqa: BLE001  (CuPy raises CUDADriverError / CompileException)
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    held, got, err = [], 0, None
    while True:
        try:
            held.append(cupy.empty(chunk_mib << 20, dtype=cupy.uint8))
            got += chunk_mib << 20
        except cupy.cuda.memory.OutOfMemoryError as e:
            err = str(e).splitlines()[0][:200]
            break
    free, total = cupy.cuda.runtime.memGetInfo()
    say({"phase": "done", "modules_loaded": loaded, "module_errors": errors, "allocated": got, "error": err,
         "info": {"free": free, "total": total}})
    sys.stdin.read()


def libattack(count: int, global_mib: int) -> None:
    d = Driver()
    image = cubin(global_mib, d.arch())
    say({"phase": "ready", "info": {}})
    sys.stdin.readline()
    n = global_mib << 20
    loaded, rcs, libs = 0, [], []
    for _ in range(count):
        lib, kern, fn = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        r = d.cu.cuLibraryLoadData(ctypes.byref(lib), image, None, None, 0, None, None, 0)
        if r == 0:
            r = d.cu.cuLibraryGetKernel(ctypes.byref(kern), lib, b"touch")
        if r == 0:
            r = d.cu.cuKernelGetFunction(ctypes.byref(fn), kern)
        if r == 0:
            r = d.launch(fn, n)
        rcs.append(r)
        if r == 0:
            loaded += 1
            libs.append(lib)
    say({"phase": "done", "modules_loaded": loaded, "rcs": rcs})
    sys.stdin.read()


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "probe":
        probe(sys.argv[2], int(sys.argv[3]))
    elif what == "attack":
        attack(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        libattack(int(sys.argv[2]), int(sys.argv[3]))
