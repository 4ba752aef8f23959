/* shim_alloc_bench: driver allocation/free pairs per second, on a real GPU.
 * Built and run by bench/shim_overhead.py, once without and once with
 * LD_PRELOAD=libgpuslice.so.  The driver is loaded with dlopen, as the CUDA
 * runtime does, so the calls take the shim's dlsym path.
 * Usage: shim_alloc_bench SIZE_BYTES PAIRS */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define LOAD(name) \
    *(void **)&name = dlsym(h, #name); \
    if (!name) { fprintf(stderr, "no %s\n", #name); return 2; }
#define CK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s = %d\n", #x, r_); return 3; } } while (0)

int main(int argc, char **argv)
{
    size_t size = argc > 1 ? strtoull(argv[1], NULL, 0) : (2u << 20);
    int pairs = argc > 2 ? atoi(argv[2]) : 20000;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    CUresult (*cuInit)(unsigned), (*cuDeviceGet)(int *, int), (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
    CUresult (*cuCtxSetCurrent)(CUcontext), (*cuMemAlloc_v2)(CUdeviceptr *, size_t), (*cuMemFree_v2)(CUdeviceptr);
    CUresult (*cuMemAllocAsync)(CUdeviceptr *, size_t, CUstream), (*cuMemFreeAsync)(CUdeviceptr, CUstream);
    CUresult (*cuStreamSynchronize)(CUstream);
    LOAD(cuInit) LOAD(cuDeviceGet) LOAD(cuDevicePrimaryCtxRetain) LOAD(cuCtxSetCurrent)
    LOAD(cuMemAlloc_v2) LOAD(cuMemFree_v2) LOAD(cuMemAllocAsync) LOAD(cuMemFreeAsync) LOAD(cuStreamSynchronize)
    int dev;
    CUcontext ctx;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    CUdeviceptr p;
    for (int i = 0; i < 200; i++) { CK(cuMemAlloc_v2(&p, size)); CK(cuMemFree_v2(p)); } /* warm-up */
    double t0 = now();
    for (int i = 0; i < pairs; i++) { CK(cuMemAlloc_v2(&p, size)); CK(cuMemFree_v2(p)); }
    double t1 = now();
    for (int i = 0; i < 200; i++) { CK(cuMemAllocAsync(&p, size, NULL)); CK(cuMemFreeAsync(p, NULL)); }
    CK(cuStreamSynchronize(NULL));
    double t2 = now();
    for (int i = 0; i < pairs; i++) { CK(cuMemAllocAsync(&p, size, NULL)); CK(cuMemFreeAsync(p, NULL)); }
    CK(cuStreamSynchronize(NULL));
    double t3 = now();
    printf("{\"size\": %zu, \"pairs\": %d, \"sync_ns_per_pair\": %.1f, \"async_ns_per_pair\": %.1f}\n", size, pairs,
           (t1 - t0) * 1e9 / pairs, (t3 - t2) * 1e9 / pairs);
    return 0;
}
