/* fake_cuda.c: a GPU-free stand-in for libcuda.so.1, for the shim's tests.
 *
 * It models what the shim depends on: device memory that runs out at a
 * physical size (FAKE_TOTAL bytes, default 80 GiB), pitch rounding
 * (FAKE_PITCH_ALIGN, default 2048), array tiling (64 KiB), VMM handles whose
 * memory lives until released *and* unmapped, and cuGetProcAddress with the
 * driver's (name, version, flags) rules written out independently of the shim.
 * FAKE_PROCADDR_INTERNAL=1 makes cuGetProcAddress return internal entry
 * points that differ from the exported ones, as a real driver may.
 * fake_last() names the last entry point called; fake_set_device() sets the
 * calling thread's current device. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_abi.h"

#define EXPORT __attribute__((visibility("default")))
#define DRIVER_VERSION 12080
#define STRIDE_SHIFT 24          /* fake device pointers: (k + 1) << 24 */
#define MAXREC (1u << 20)

static uint64_t phys_total = 80ULL << 30;
static uint64_t pitch_align = 2048;
static int ndev = 1;
static int internal_ptrs;
static _Atomic uint64_t phys_used;
static _Atomic uint32_t next_k;
static uint64_t *rec_size;       /* size of pointer k, 0 = free */
static __thread int cur_dev;
static const char *_Atomic last;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

__attribute__((constructor)) static void fake_init(void)
{
    const char *v;
    if ((v = getenv("FAKE_TOTAL"))) phys_total = strtoull(v, NULL, 0);
    if ((v = getenv("FAKE_PITCH_ALIGN"))) pitch_align = strtoull(v, NULL, 0);
    if ((v = getenv("FAKE_NDEV"))) ndev = atoi(v);
    internal_ptrs = getenv("FAKE_PROCADDR_INTERNAL") != NULL;
    rec_size = calloc(MAXREC, sizeof *rec_size);
}

EXPORT const char *fake_last(void) { return last; }
EXPORT void fake_set_device(int d) { cur_dev = d; }
EXPORT uint64_t fake_phys_used(void) { return phys_used; }

static int take(uint64_t n)
{
    uint64_t cur = atomic_load(&phys_used);
    do {
        if (n > phys_total || cur > phys_total - n) return 0;
    } while (!atomic_compare_exchange_weak(&phys_used, &cur, cur + n));
    return 1;
}

static CUresult new_ptr(CUdeviceptr *p, uint64_t n)
{
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    if (!take(n)) return CUDA_ERROR_OUT_OF_MEMORY;
    uint32_t k = atomic_fetch_add(&next_k, 1);
    if (k >= MAXREC) return CUDA_ERROR_OUT_OF_MEMORY;
    rec_size[k] = n;
    *p = (CUdeviceptr)(k + 1) << STRIDE_SHIFT;
    return CUDA_SUCCESS;
}

static CUresult free_ptr(CUdeviceptr p)
{
    uint64_t k = (p >> STRIDE_SHIFT) - 1;
    if (!p || (p & ((1ULL << STRIDE_SHIFT) - 1)) || k >= MAXREC) return CUDA_ERROR_INVALID_VALUE;
    uint64_t n = __atomic_exchange_n(&rec_size[k], 0, __ATOMIC_ACQ_REL);
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    atomic_fetch_sub(&phys_used, n);
    return CUDA_SUCCESS;
}

#define CALLED(name) (last = name)

EXPORT CUresult cuInit(unsigned int f) { (void)f; CALLED("cuInit"); return CUDA_SUCCESS; }
EXPORT CUresult cuDriverGetVersion(int *v) { *v = DRIVER_VERSION; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGetCount(int *n) { *n = ndev; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGet(CUdevice *d, int i)
{
    if (i < 0 || i >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    *d = i;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetDevice(CUdevice *d)
{
    if (cur_dev < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *d = cur_dev;
    return CUDA_SUCCESS;
}
static CUresult uuid(CUuuid *u, CUdevice d)
{
    static const unsigned char base[16] = {0x5b, 0x3b, 0x5d, 0x0c, 0x1f, 0x2e, 0x4a, 0x77,
                                           0x9c, 0x10, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x00};
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    memcpy(u->bytes, base, 16);
    u->bytes[15] = (char)d;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { return uuid(u, d); }
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { return uuid(u, d); }
EXPORT CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d)
{
    (void)d;
    *b = phys_total;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo_v2(size_t *f, size_t *t)
{
    CALLED("cuMemGetInfo_v2");
    *t = phys_total;
    *f = phys_total - phys_used;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { CALLED("cuMemAlloc_v2"); return new_ptr(p, n); }
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { CALLED("cuMemFree_v2"); return free_ptr(p); }
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned e)
{
    CALLED("cuMemAllocPitch_v2");
    if (e != 4 && e != 8 && e != 16) return CUDA_ERROR_INVALID_VALUE;
    *pitch = (w + pitch_align - 1) / pitch_align * pitch_align;
    return new_ptr(p, (uint64_t)*pitch * h);
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned f)
{
    (void)f;
    CALLED("cuMemAllocManaged");
    return new_ptr(p, n);
}

/* stream-ordered */
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { (void)s; CALLED("cuMemAllocAsync"); return new_ptr(p, n); }
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { (void)s; CALLED("cuMemAllocAsync_ptsz"); return new_ptr(p, n); }
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool m, CUstream s) { (void)s; (void)m; CALLED("cuMemAllocFromPoolAsync"); return new_ptr(p, n); }
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool m, CUstream s) { (void)s; (void)m; CALLED("cuMemAllocFromPoolAsync_ptsz"); return new_ptr(p, n); }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { (void)s; CALLED("cuMemFreeAsync"); return free_ptr(p); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { (void)s; CALLED("cuMemFreeAsync_ptsz"); return free_ptr(p); }

/* VMM: memory lives until the handle is released and its last mapping gone */
#define MAXH 4096
static struct { uint64_t size; int refs; int maps; int live; int device; } hs[MAXH];
static struct { CUdeviceptr va; size_t size; uint64_t h; } ms[MAXH];
static int nh = 1;

static void h_maybe_free(uint64_t h)
{
    if (hs[h].live && hs[h].refs == 0 && hs[h].maps == 0) {
        hs[h].live = 0;
        if (hs[h].device) atomic_fetch_sub(&phys_used, hs[h].size);
    }
}
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n,
                            const CUmemAllocationProp *p, unsigned long long f)
{
    (void)f;
    CALLED("cuMemCreate");
    if (!h || !p || !n || p->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    int device = p->location.type == CU_MEM_LOCATION_TYPE_DEVICE;
    if (device && (p->location.id < 0 || p->location.id >= ndev)) return CUDA_ERROR_INVALID_DEVICE;
    if (!device && p->location.type != CU_MEM_LOCATION_TYPE_HOST &&
        p->location.type != CU_MEM_LOCATION_TYPE_HOST_NUMA)
        return CUDA_ERROR_INVALID_VALUE;
    if (device && !take(n)) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    int i = nh < MAXH ? nh++ : 0;
    if (i) {
        hs[i].size = n; hs[i].refs = 1; hs[i].maps = 0; hs[i].live = 1; hs[i].device = device;
    }
    pthread_mutex_unlock(&mu);
    if (!i) return CUDA_ERROR_OUT_OF_MEMORY;
    *h = 0x7000 + (uint64_t)i; /* handles are small integers here */
    return CUDA_SUCCESS;
}
static int hidx(uint64_t h) { uint64_t i = h - 0x7000; return (h >= 0x7000 && i < MAXH && hs[i].live) ? (int)i : 0; }
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    CALLED("cuMemRelease");
    pthread_mutex_lock(&mu);
    int i = hidx(h);
    if (i && hs[i].refs > 0) { hs[i].refs--; h_maybe_free((uint64_t)i); }
    pthread_mutex_unlock(&mu);
    return i ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuMemMap(CUdeviceptr va, size_t n, size_t off, CUmemGenericAllocationHandle h,
                         unsigned long long f)
{
    (void)f; (void)off;
    CALLED("cuMemMap");
    pthread_mutex_lock(&mu);
    int i = hidx(h), slot = -1;
    for (int j = 0; j < MAXH && i; j++) if (!ms[j].h) { slot = j; break; }
    if (i && slot >= 0) { ms[slot].va = va; ms[slot].size = n; ms[slot].h = (uint64_t)i; hs[i].maps++; }
    pthread_mutex_unlock(&mu);
    return i && slot >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t n)
{
    CALLED("cuMemUnmap");
    int found = 0;
    pthread_mutex_lock(&mu);
    for (int j = 0; j < MAXH; j++)
        if (ms[j].h && ms[j].va >= va && ms[j].va + ms[j].size <= va + n) {
            uint64_t i = ms[j].h;
            ms[j].h = 0;
            hs[i].maps--;
            h_maybe_free(i);
            found = 1;
        }
    pthread_mutex_unlock(&mu);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    CALLED("cuMemRetainAllocationHandle");
    CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (int j = 0; j < MAXH; j++)
        if (ms[j].h && ms[j].va <= a && a < ms[j].va + ms[j].size) {
            hs[ms[j].h].refs++;
            *h = 0x7000 + ms[j].h;
            r = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&mu);
    return r;
}

/* arrays: 64 KiB tiles; the handle is a fake device pointer */
static uint64_t tiles(uint64_t n) { return (n + 65535) / 65536 * 65536; }
static uint64_t fmt_size(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: return 2;
    default: return 4;
    }
}
static uint64_t a3d(size_t w, size_t h, size_t d, CUarray_format f, unsigned ch)
{
    return tiles((uint64_t)w * (h ? h : 1) * (d ? d : 1) * fmt_size(f) * ch);
}
EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d)
{
    CALLED("cuArrayCreate_v2");
    CUdeviceptr p;
    CUresult r = new_ptr(&p, a3d(d->Width, d->Height, 1, d->Format, d->NumChannels));
    if (r == CUDA_SUCCESS) *a = (CUarray)(uintptr_t)p;
    return r;
}
EXPORT CUresult cuArray3DCreate_v2(CUarray *a, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    CALLED("cuArray3DCreate_v2");
    CUdeviceptr p;
    uint64_t n = (d->Flags & 0x40) ? 1 : a3d(d->Width, d->Height, d->Depth, d->Format, d->NumChannels);
    CUresult r = new_ptr(&p, n);
    if (r == CUDA_SUCCESS) *a = (CUarray)(uintptr_t)p;
    return r;
}
EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *a, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned levels)
{
    CALLED("cuMipmappedArrayCreate");
    uint64_t n = 0;
    size_t w = d->Width, h = d->Height, z = d->Depth;
    for (unsigned i = 0; i < levels; i++) {
        n += a3d(w, h, z, d->Format, d->NumChannels);
        w = w > 1 ? w / 2 : 1; h = h > 1 ? h / 2 : h; z = z > 1 ? z / 2 : z;
    }
    CUdeviceptr p;
    CUresult r = new_ptr(&p, n);
    if (r == CUDA_SUCCESS) *a = (CUmipmappedArray)(uintptr_t)p;
    return r;
}
EXPORT CUresult cuArrayDestroy(CUarray a) { CALLED("cuArrayDestroy"); return free_ptr((CUdeviceptr)(uintptr_t)a); }
EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) { CALLED("cuMipmappedArrayDestroy"); return free_ptr((CUdeviceptr)(uintptr_t)a); }
static CUresult reqs(CUDA_ARRAY_MEMORY_REQUIREMENTS *r, CUdeviceptr p)
{
    uint64_t k = (p >> STRIDE_SHIFT) - 1;
    if (k >= MAXREC || !rec_size[k]) return CUDA_ERROR_INVALID_HANDLE;
    memset(r, 0, sizeof *r);
    r->size = rec_size[k];
    r->alignment = 65536;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *r, CUarray a, CUdevice d) { (void)d; return reqs(r, (CUdeviceptr)(uintptr_t)a); }
EXPORT CUresult cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *r, CUmipmappedArray a, CUdevice d) { (void)d; return reqs(r, (CUdeviceptr)(uintptr_t)a); }

/* entry points the shim must leave alone */
EXPORT CUresult cuMemAlloc(unsigned int *p, unsigned int n) { (void)p; (void)n; CALLED("cuMemAlloc"); return CUDA_ERROR_NOT_SUPPORTED; }
EXPORT CUresult cuMemGetInfo(unsigned int *f, unsigned int *t) { *f = *t = 0; return CUDA_SUCCESS; }
EXPORT CUresult cuStreamSynchronize(CUstream s) { (void)s; CALLED("cuStreamSynchronize"); return CUDA_SUCCESS; }
EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) { (void)s; CALLED("cuStreamSynchronize_ptsz"); return CUDA_SUCCESS; }
EXPORT CUresult cuMemAdvise(CUdeviceptr p, size_t n, int a, CUdevice d) { (void)p; (void)n; (void)a; (void)d; CALLED("cuMemAdvise"); return CUDA_SUCCESS; }
EXPORT CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, int a, CUmemLocation l) { (void)p; (void)n; (void)a; (void)l; CALLED("cuMemAdvise_v2"); return CUDA_SUCCESS; }
EXPORT CUresult cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice d, CUstream s) { (void)p; (void)n; (void)d; (void)s; CALLED("cuMemPrefetchAsync"); return CUDA_SUCCESS; }
EXPORT CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr p, size_t n, CUdevice d, CUstream s) { (void)p; (void)n; (void)d; (void)s; CALLED("cuMemPrefetchAsync_ptsz"); return CUDA_SUCCESS; }
EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation l, unsigned f, CUstream s) { (void)p; (void)n; (void)l; (void)f; (void)s; CALLED("cuMemPrefetchAsync_v2"); return CUDA_SUCCESS; }
EXPORT CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr p, size_t n, CUmemLocation l, unsigned f, CUstream s) { (void)p; (void)n; (void)l; (void)f; (void)s; CALLED("cuMemPrefetchAsync_v2_ptsz"); return CUDA_SUCCESS; }

static const void *export_table[4] = {(void *)0x1111, (void *)0x2222, NULL, NULL};
EXPORT CUresult cuGetExportTable(const void **t, const CUuuid *id)
{
    (void)id;
    CALLED("cuGetExportTable");
    *t = export_table;
    return CUDA_SUCCESS;
}

/* ---- cuGetProcAddress: the driver's rules, written from its documentation */
struct variant { const char *base, *sym; int version, ptsz; };
static const struct variant variants[] = {
    {"cuInit", "cuInit", 2000, 0},
    {"cuDriverGetVersion", "cuDriverGetVersion", 2020, 0},
    {"cuDeviceGetCount", "cuDeviceGetCount", 2000, 0},
    {"cuCtxGetDevice", "cuCtxGetDevice", 2000, 0},
    {"cuDeviceGetUuid", "cuDeviceGetUuid", 9020, 0},
    {"cuDeviceGetUuid", "cuDeviceGetUuid_v2", 11040, 0},
    {"cuDeviceTotalMem", "cuDeviceTotalMem_v2", 3020, 0},
    {"cuMemGetInfo", "cuMemGetInfo", 2000, 0},
    {"cuMemGetInfo", "cuMemGetInfo_v2", 3020, 0},
    {"cuMemAlloc", "cuMemAlloc", 2000, 0},
    {"cuMemAlloc", "cuMemAlloc_v2", 3020, 0},
    {"cuMemAllocPitch", "cuMemAllocPitch_v2", 3020, 0},
    {"cuMemFree", "cuMemFree_v2", 3020, 0},
    {"cuMemAllocManaged", "cuMemAllocManaged", 6000, 0},
    {"cuMemCreate", "cuMemCreate", 10020, 0},
    {"cuMemRelease", "cuMemRelease", 10020, 0},
    {"cuMemMap", "cuMemMap", 10020, 0},
    {"cuMemUnmap", "cuMemUnmap", 10020, 0},
    {"cuMemRetainAllocationHandle", "cuMemRetainAllocationHandle", 11000, 0},
    {"cuArrayCreate", "cuArrayCreate_v2", 3020, 0},
    {"cuArray3DCreate", "cuArray3DCreate_v2", 3020, 0},
    {"cuArrayDestroy", "cuArrayDestroy", 2000, 0},
    {"cuMipmappedArrayCreate", "cuMipmappedArrayCreate", 5000, 0},
    {"cuMipmappedArrayDestroy", "cuMipmappedArrayDestroy", 5000, 0},
    {"cuArrayGetMemoryRequirements", "cuArrayGetMemoryRequirements", 11060, 0},
    {"cuMipmappedArrayGetMemoryRequirements", "cuMipmappedArrayGetMemoryRequirements", 11060, 0},
    {"cuMemAllocAsync", "cuMemAllocAsync", 11020, 0},
    {"cuMemAllocAsync", "cuMemAllocAsync_ptsz", 11020, 1},
    {"cuMemFreeAsync", "cuMemFreeAsync", 11020, 0},
    {"cuMemFreeAsync", "cuMemFreeAsync_ptsz", 11020, 1},
    {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", 11020, 0},
    {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", 11020, 1},
    {"cuStreamSynchronize", "cuStreamSynchronize", 2000, 0},
    {"cuStreamSynchronize", "cuStreamSynchronize_ptsz", 7000, 1},
    {"cuMemAdvise", "cuMemAdvise", 8000, 0},
    {"cuMemAdvise", "cuMemAdvise_v2", 12020, 0},
    {"cuMemPrefetchAsync", "cuMemPrefetchAsync", 8000, 0},
    {"cuMemPrefetchAsync", "cuMemPrefetchAsync_ptsz", 8000, 1},
    {"cuMemPrefetchAsync", "cuMemPrefetchAsync_v2", 12020, 0},
    {"cuMemPrefetchAsync", "cuMemPrefetchAsync_v2_ptsz", 12020, 1},
    {"cuGetExportTable", "cuGetExportTable", 3000, 0},
    {"cuGetProcAddress", "cuGetProcAddress", 11030, 0},
    {"cuGetProcAddress", "cuGetProcAddress_v2", 12000, 0},
};

/* internal entry points, at other addresses than the exported ones */
static CUresult i_cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return cuMemAlloc_v2(p, n); }
static CUresult i_cuMemFree_v2(CUdeviceptr p) { return cuMemFree_v2(p); }
static CUresult i_cuMemGetInfo_v2(size_t *f, size_t *t) { return cuMemGetInfo_v2(f, t); }
static CUresult i_cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { return cuMemAllocAsync(p, n, s); }
static CUresult i_cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { return cuMemAllocAsync_ptsz(p, n, s); }
static CUresult i_cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return cuMemFreeAsync_ptsz(p, s); }
static CUresult i_cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *p, unsigned long long f) { return cuMemCreate(h, n, p, f); }
EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
static CUresult i_cuGetProcAddress_v2(const char *s, void **p, int v, cuuint64_t f, CUdriverProcAddressQueryResult *q) { return cuGetProcAddress_v2(s, p, v, f, q); }
static CUresult i_cuGetProcAddress(const char *s, void **p, int v, cuuint64_t f) { return cuGetProcAddress(s, p, v, f); }
static const struct { const char *sym; void *fn; } internals[] = {
    {"cuMemAlloc_v2", (void *)i_cuMemAlloc_v2},
    {"cuMemFree_v2", (void *)i_cuMemFree_v2},
    {"cuMemGetInfo_v2", (void *)i_cuMemGetInfo_v2},
    {"cuMemAllocAsync", (void *)i_cuMemAllocAsync},
    {"cuMemAllocAsync_ptsz", (void *)i_cuMemAllocAsync_ptsz},
    {"cuMemFreeAsync_ptsz", (void *)i_cuMemFreeAsync_ptsz},
    {"cuMemCreate", (void *)i_cuMemCreate},
    {"cuGetProcAddress_v2", (void *)i_cuGetProcAddress_v2},
    {"cuGetProcAddress", (void *)i_cuGetProcAddress},
};

/* exported entry points; linked -Bsymbolic so these are this library's own */
static const struct { const char *sym; void *fn; } exported[] = {
    {"cuInit", (void *)cuInit},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuCtxGetDevice", (void *)cuCtxGetDevice},
    {"cuDeviceGetUuid", (void *)cuDeviceGetUuid},
    {"cuDeviceGetUuid_v2", (void *)cuDeviceGetUuid_v2},
    {"cuDeviceTotalMem_v2", (void *)cuDeviceTotalMem_v2},
    {"cuMemGetInfo", (void *)cuMemGetInfo},
    {"cuMemGetInfo_v2", (void *)cuMemGetInfo_v2},
    {"cuMemAlloc", (void *)cuMemAlloc},
    {"cuMemAlloc_v2", (void *)cuMemAlloc_v2},
    {"cuMemAllocPitch_v2", (void *)cuMemAllocPitch_v2},
    {"cuMemFree_v2", (void *)cuMemFree_v2},
    {"cuMemAllocManaged", (void *)cuMemAllocManaged},
    {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemMap", (void *)cuMemMap},
    {"cuMemUnmap", (void *)cuMemUnmap},
    {"cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle},
    {"cuArrayCreate_v2", (void *)cuArrayCreate_v2},
    {"cuArray3DCreate_v2", (void *)cuArray3DCreate_v2},
    {"cuArrayDestroy", (void *)cuArrayDestroy},
    {"cuMipmappedArrayCreate", (void *)cuMipmappedArrayCreate},
    {"cuMipmappedArrayDestroy", (void *)cuMipmappedArrayDestroy},
    {"cuArrayGetMemoryRequirements", (void *)cuArrayGetMemoryRequirements},
    {"cuMipmappedArrayGetMemoryRequirements", (void *)cuMipmappedArrayGetMemoryRequirements},
    {"cuMemAllocAsync", (void *)cuMemAllocAsync},
    {"cuMemAllocAsync_ptsz", (void *)cuMemAllocAsync_ptsz},
    {"cuMemFreeAsync", (void *)cuMemFreeAsync},
    {"cuMemFreeAsync_ptsz", (void *)cuMemFreeAsync_ptsz},
    {"cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync},
    {"cuMemAllocFromPoolAsync_ptsz", (void *)cuMemAllocFromPoolAsync_ptsz},
    {"cuStreamSynchronize", (void *)cuStreamSynchronize},
    {"cuStreamSynchronize_ptsz", (void *)cuStreamSynchronize_ptsz},
    {"cuMemAdvise", (void *)cuMemAdvise},
    {"cuMemAdvise_v2", (void *)cuMemAdvise_v2},
    {"cuMemPrefetchAsync", (void *)cuMemPrefetchAsync},
    {"cuMemPrefetchAsync_ptsz", (void *)cuMemPrefetchAsync_ptsz},
    {"cuMemPrefetchAsync_v2", (void *)cuMemPrefetchAsync_v2},
    {"cuMemPrefetchAsync_v2_ptsz", (void *)cuMemPrefetchAsync_v2_ptsz},
    {"cuGetExportTable", (void *)cuGetExportTable},
    {"cuGetProcAddress", (void *)cuGetProcAddress},
    {"cuGetProcAddress_v2", (void *)cuGetProcAddress_v2},
};

static void *self_sym(const char *sym)
{
    if (internal_ptrs)
        for (size_t i = 0; i < sizeof internals / sizeof internals[0]; i++)
            if (!strcmp(internals[i].sym, sym)) return internals[i].fn;
    for (size_t i = 0; i < sizeof exported / sizeof exported[0]; i++)
        if (!strcmp(exported[i].sym, sym)) return exported[i].fn;
    return NULL;
}

EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *st)
{
    if (!sym || !pfn) return CUDA_ERROR_INVALID_VALUE;
    if (ver > DRIVER_VERSION) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    int known = 0, best = -1;
    int ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
        const struct variant *v = &variants[i];
        if (strcmp(v->base, sym)) continue;
        known = 1;
        if (v->version > ver || v->ptsz != ptds) continue;
        if (best < 0 || v->version > variants[best].version) best = (int)i;
    }
    if (best < 0 && ptds) /* no per-thread variant: the plain one */
        for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
            const struct variant *v = &variants[i];
            if (strcmp(v->base, sym) || v->ptsz || v->version > ver) continue;
            if (best < 0 || v->version > variants[best].version) best = (int)i;
        }
    if (best >= 0) *pfn = self_sym(variants[best].sym);
    if (st)
        *st = !known ? CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
            : best < 0 ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags)
{
    CUdriverProcAddressQueryResult st;
    CUresult r = cuGetProcAddress_v2(sym, pfn, ver, flags, &st);
    if (r == CUDA_SUCCESS && st != CU_GET_PROC_ADDRESS_SUCCESS) return CUDA_ERROR_NOT_FOUND;
    return r;
}
