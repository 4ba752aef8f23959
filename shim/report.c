/* report.c: which region a CUdevice or an NVML device belongs to, and the
 * memory figures the application sees: cuMemGetInfo_v2, cuDeviceTotalMem_v2,
 * nvmlDeviceGetMemoryInfo and nvmlDeviceGetMemoryInfo_v2.
 *
 * total = min(limit, physical); used = the slice's counted bytes, which
 * include each process's driver footprint (footprint.c), so free falls by it;
 * free = min(physical free, total - used), never below 0.  A query never
 * fails because of the shim: if the device's region cannot be resolved the
 * driver's own figures are returned with total and free capped at the limit. */
#define _GNU_SOURCE
#include <ctype.h>
#include <pthread.h>
#include <string.h>

#include "gs.h"
#include "gs_api.h"

struct gs_ref *gs_dev_ref[GS_MAX_DEV];
int gs_ndev;
static pthread_mutex_t dev_mu = PTHREAD_MUTEX_INITIALIZER;

static void uuid_hex(const CUuuid *u, char out[33])
{
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        unsigned char b = (unsigned char)u->bytes[i];
        out[2 * i] = hex[b >> 4];
        out[2 * i + 1] = hex[b & 15];
    }
    out[32] = 0;
}

/* "GPU-5b3b5d0c-1f2e-..." or "MIG-..." -> 32 lowercase hex digits */
static int nvml_uuid_hex(const char *s, char out[33])
{
    const char *p = strchr(s, '-');
    p = p ? p + 1 : s;
    int n = 0;
    for (; *p && n < 32; p++) {
        if (*p == '-') continue;
        if (!isxdigit((unsigned char)*p)) return 0;
        out[n++] = (char)tolower((unsigned char)*p);
    }
    out[n] = 0;
    return n == 32;
}

static void learn_ndev(void)
{
    if (gs_ndev) return;
    int n = 0;
    gs_pfn_DeviceGetCount f = (gs_pfn_DeviceGetCount)GS_REAL(DeviceGetCount);
    if (f && f(&n) == CUDA_SUCCESS && n > 0) __atomic_store_n(&gs_ndev, n, __ATOMIC_RELEASE);
}

int gs_current_dev_slow(void)
{
    gs_need_cuda();
    if (!gs_ndev) {
        pthread_mutex_lock(&dev_mu);
        learn_ndev();
        pthread_mutex_unlock(&dev_mu);
        if (gs_ndev == 1) return 0;
    }
    CUdevice d = -1;
    gs_pfn_CtxGetDevice f = (gs_pfn_CtxGetDevice)GS_REAL(CtxGetDevice);
    if (!f || f(&d) != CUDA_SUCCESS) return -1;
    return d;
}

struct gs_ref *gs_dev_ref_slow(int dev)
{
    gs_need_cuda();
    pthread_mutex_lock(&dev_mu);
    struct gs_ref *ref = gs_dev_ref[dev];
    int first = 0;
    if (!ref) {
        learn_ndev();
        CUuuid u;
        CUresult r = CUDA_ERROR_NOT_FOUND;
        gs_pfn_DeviceGetUuid f2 = (gs_pfn_DeviceGetUuid)GS_REAL(DeviceGetUuid_v2);
        gs_pfn_DeviceGetUuid f1 = (gs_pfn_DeviceGetUuid)GS_REAL(DeviceGetUuid);
        if (f2) r = f2(&u, dev);
        if (r != CUDA_SUCCESS && f1) r = f1(&u, dev);
        if (r == CUDA_SUCCESS) {
            char key[33];
            uuid_hex(&u, key);
            ref = gs_ref_for_key(key);
            __atomic_store_n(&gs_dev_ref[dev], ref, __ATOMIC_RELEASE);
            first = ref != NULL;
        } else {
            gs_log("no UUID for device %d (error %d); its allocations pass through", dev, r);
        }
    }
    pthread_mutex_unlock(&dev_mu);
    /* first use of this GPU in this process: measure its footprint (NVML,
     * outside dev_mu) */
    if (first) gs_fp_first_use(ref, dev);
    return ref;
}

static void atfork_child(void)
{
    /* the child's first use of each GPU measures its own footprint */
    pthread_mutex_init(&dev_mu, NULL);
    for (int i = 0; i < GS_MAX_DEV; i++) __atomic_store_n(&gs_dev_ref[i], NULL, __ATOMIC_RELAXED);
}

__attribute__((constructor(GS_INIT_MODULE))) static void report_init(void)
{
    if (gs_cfg.active) pthread_atfork(NULL, NULL, atfork_child);
}

static void clamp(uint64_t phys_total, uint64_t phys_free, uint64_t used, uint64_t *total,
                  uint64_t *free)
{
    uint64_t t = gs_cfg.limit < phys_total ? gs_cfg.limit : phys_total;
    uint64_t f = used >= t ? 0 : t - used;
    if (f > phys_free) f = phys_free;
    *total = t;
    *free = f;
}

GS_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    gs_need_cuda();
    CUresult (*real)(size_t *, size_t *) = GS_REAL(MemGetInfo_v2);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(free, total);
    if (!gs_cfg.active || r != CUDA_SUCCESS || !free || !total) return r;
    int dev = gs_current_dev();
    struct gs_ref *ref = gs_ref_of(dev);
    if (gs_reap_if_due(ref, 0)) gs_fp_refresh(ref); /* at most once a second */
    uint64_t t, f;
    clamp(*total, *free, gs_used(ref), &t, &f);
    *total = (size_t)t;
    *free = (size_t)f;
    return r;
}

GS_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    gs_need_cuda();
    CUresult (*real)(size_t *, CUdevice) = GS_REAL(DeviceTotalMem_v2);
    if (!real) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(bytes, dev);
    if (gs_cfg.active && r == CUDA_SUCCESS && bytes && gs_cfg.limit < *bytes)
        *bytes = (size_t)gs_cfg.limit;
    return r;
}

static struct gs_ref *nvml_ref(nvmlDevice_t device)
{
    char buf[GS_NVML_UUID_BUFFER], key[33];
    gs_pfn_nvmlDeviceGetUUID f = (gs_pfn_nvmlDeviceGetUUID)gs_nv_real[GS_NV_nvmlDeviceGetUUID];
    if (!f || f(device, buf, sizeof buf) != NVML_SUCCESS) return NULL;
    buf[sizeof buf - 1] = 0;
    if (!nvml_uuid_hex(buf, key)) return NULL;
    struct gs_ref *ref = gs_ref_for_key(key);
    if (gs_reap_if_due(ref, 1)) gs_fp_refresh(ref); /* no-op unless CUDA uses this GPU here */
    return ref;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    gs_need_nvml();
    nvmlReturn_t (*real)(nvmlDevice_t, nvmlMemory_t *) =
        gs_nv_real[GS_NV_nvmlDeviceGetMemoryInfo];
    if (!real) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = real(device, memory);
    if (!gs_cfg.active || r != NVML_SUCCESS || !memory) return r;
    uint64_t t, f;
    clamp(memory->total, memory->free, gs_used(nvml_ref(device)), &t, &f);
    memory->total = t;
    memory->free = f;
    memory->used = t - f; /* total = free + used, as v1 promises */
    return r;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    gs_need_nvml();
    nvmlReturn_t (*real)(nvmlDevice_t, nvmlMemory_v2_t *) =
        gs_nv_real[GS_NV_nvmlDeviceGetMemoryInfo_v2];
    if (!real) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = real(device, memory);
    if (!gs_cfg.active || r != NVML_SUCCESS || !memory) return r;
    uint64_t t, f;
    clamp(memory->total, memory->free, gs_used(nvml_ref(device)), &t, &f);
    memory->total = t;
    memory->free = f;
    memory->reserved = 0; /* the driver's reservation is not part of the slice */
    memory->used = t - f;
    return r;
}
