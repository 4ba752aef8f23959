/* procaddr.c: every way a program finds a driver entry point.
 *
 * 1. Link-time calls: the shim exports the hooked names itself (alloc.c,
 *    report.c) and, preloaded, comes first in the global scope.
 * 2. dlsym(handle, name) on a handle of libcuda or libnvidia-ml: dlsym is
 *    overridden by a trampoline (dlsym_tramp.S) that asks gs_dlsym_filter and,
 *    when the filter declines, *jumps* to the real dlsym, so the caller seen
 *    by glibc (which decides what RTLD_NEXT means) is the program's, not ours.
 *    RTLD_NEXT, RTLD_DEFAULT and every other handle are passed through.
 * 3. cuGetProcAddress / cuGetProcAddress_v2: the real driver is asked first
 *    with the caller's (name, version, flags); its answer, error and
 *    symbolStatus pass through untouched unless it returned a function of a
 *    hooked variant.  The variant is identified by the address the driver
 *    returned when it equals an exported entry point of libcuda, otherwise by
 *    the table below (base name, first version of each ABI, per-thread
 *    flag).  A request older than a variant's version never gets that
 *    variant's wrapper.
 * 4. cuGetProcAddress asked for itself follows the same rule: a request for
 *    11030..11080 gets the 4-argument wrapper, 12000 and later the _v2 one.
 * cuGetExportTable is never hooked: it reaches the driver untouched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <string.h>

#include "gs.h"
#include "gs_api.h"

#define W(f) ((void *)&(f))
/* wrappers, by variant (NULL: not hooked) */
static void *const wrappers[GS_CU_COUNT] = {
    [GS_CU_MemAlloc_v2] = W(cuMemAlloc_v2),
    [GS_CU_MemAllocPitch_v2] = W(cuMemAllocPitch_v2),
    [GS_CU_MemFree_v2] = W(cuMemFree_v2),
    [GS_CU_MemGetInfo_v2] = W(cuMemGetInfo_v2),
    [GS_CU_DeviceTotalMem_v2] = W(cuDeviceTotalMem_v2),
    [GS_CU_MemAllocManaged] = W(cuMemAllocManaged),
    [GS_CU_MemCreate] = W(cuMemCreate),
    [GS_CU_MemRelease] = W(cuMemRelease),
    [GS_CU_MemMap] = W(cuMemMap),
    [GS_CU_MemUnmap] = W(cuMemUnmap),
    [GS_CU_MemRetainAllocationHandle] = W(cuMemRetainAllocationHandle),
    [GS_CU_ArrayCreate_v2] = W(cuArrayCreate_v2),
    [GS_CU_Array3DCreate_v2] = W(cuArray3DCreate_v2),
    [GS_CU_ArrayDestroy] = W(cuArrayDestroy),
    [GS_CU_MipmappedArrayCreate] = W(cuMipmappedArrayCreate),
    [GS_CU_MipmappedArrayDestroy] = W(cuMipmappedArrayDestroy),
    [GS_CU_MemAllocAsync] = W(cuMemAllocAsync),
    [GS_CU_MemAllocAsync_ptsz] = W(cuMemAllocAsync_ptsz),
    [GS_CU_MemFreeAsync] = W(cuMemFreeAsync),
    [GS_CU_MemFreeAsync_ptsz] = W(cuMemFreeAsync_ptsz),
    [GS_CU_MemAllocFromPoolAsync] = W(cuMemAllocFromPoolAsync),
    [GS_CU_MemAllocFromPoolAsync_ptsz] = W(cuMemAllocFromPoolAsync_ptsz),
    [GS_CU_GetProcAddress] = W(cuGetProcAddress),
    [GS_CU_GetProcAddress_v2] = W(cuGetProcAddress_v2),
    [GS_CU_DevicePrimaryCtxRetain] = W(cuDevicePrimaryCtxRetain),
    [GS_CU_MemPoolCreate] = W(cuMemPoolCreate),
    [GS_CU_MemPoolDestroy] = W(cuMemPoolDestroy),
    [GS_CU_DeviceSetMemPool] = W(cuDeviceSetMemPool),
    [GS_CU_GraphInstantiateWithFlags] = W(cuGraphInstantiateWithFlags),
    [GS_CU_GraphInstantiate_12] = W(cuGraphInstantiateWithFlags),
    [GS_CU_GraphInstantiateWithParams] = W(cuGraphInstantiateWithParams),
    [GS_CU_GraphInstantiateWithParams_ptsz] = W(cuGraphInstantiateWithParams_ptsz),
    [GS_CU_GraphLaunch] = W(cuGraphLaunch),
    [GS_CU_GraphLaunch_ptsz] = W(cuGraphLaunch_ptsz),
    [GS_CU_GraphUpload] = W(cuGraphUpload),
    [GS_CU_GraphUpload_ptsz] = W(cuGraphUpload_ptsz),
    [GS_CU_GraphExecDestroy] = W(cuGraphExecDestroy),
    [GS_CU_DeviceGraphMemTrim] = W(cuDeviceGraphMemTrim),
    [GS_CU_ModuleLoad] = W(cuModuleLoad),
    [GS_CU_ModuleLoadData] = W(cuModuleLoadData),
    [GS_CU_ModuleLoadDataEx] = W(cuModuleLoadDataEx),
    [GS_CU_ModuleLoadFatBinary] = W(cuModuleLoadFatBinary),
    [GS_CU_ModuleUnload] = W(cuModuleUnload),
    [GS_CU_LibraryLoadData] = W(cuLibraryLoadData),
    [GS_CU_LibraryLoadFromFile] = W(cuLibraryLoadFromFile),
    [GS_CU_LibraryUnload] = W(cuLibraryUnload),
};

void *const gs_nv_wrappers[GS_NV_COUNT] = {
    [GS_NV_nvmlDeviceGetMemoryInfo] = W(nvmlDeviceGetMemoryInfo),
    [GS_NV_nvmlDeviceGetMemoryInfo_v2] = W(nvmlDeviceGetMemoryInfo_v2),
};

/* Variant of `base` the driver gives for (version, flags), or -1. */
static int pick_variant(const char *base, int version, cuuint64_t flags)
{
    int best = -1;
    int want_ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    for (int i = 0; i < GS_CU_COUNT; i++) {
        const struct gs_cu_sym *s = &gs_cu_syms[i];
        if (!wrappers[i] || strcmp(s->base, base) || s->version > version) continue;
        if (s->ptsz && !want_ptsz) continue;
        if (best < 0) {
            best = i;
            continue;
        }
        const struct gs_cu_sym *b = &gs_cu_syms[best];
        /* prefer the per-thread variant when asked for, then the newest ABI */
        if ((s->ptsz && !b->ptsz) || (s->ptsz == b->ptsz && s->version > b->version)) best = i;
    }
    return best;
}

void *gs_procaddr_substitute(const char *symbol, void *pfn, int version, cuuint64_t flags)
{
    gs_need_cuda();
    /* the driver's own answer names the ABI when it is an exported entry point */
    for (int i = 0; i < GS_CU_COUNT; i++) {
        if (wrappers[i] && gs_cu_real[i] == pfn) {
            gs_log("cuGetProcAddress(%s, %d, %llu) -> %s (by address)", symbol, version,
                   (unsigned long long)flags, gs_cu_syms[i].name);
            return wrappers[i];
        }
    }
    int v = pick_variant(symbol, version, flags);
    if (v >= 0) {
        gs_log("cuGetProcAddress(%s, %d, %llu) -> %s (by table)", symbol, version,
               (unsigned long long)flags, gs_cu_syms[v].name);
        /* the wrapper calls the entry point the driver chose */
        if (!gs_cu_real[v]) gs_cu_real[v] = pfn;
        return wrappers[v];
    }
    return NULL;
}

GS_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                       cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    gs_need_cuda();
    CUresult (*real)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
        GS_REAL(GetProcAddress_v2);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(symbol, pfn, cudaVersion, flags, status);
    if (!gs_cfg.active || r != CUDA_SUCCESS || !symbol || !pfn || !*pfn) return r;
    void *w = gs_procaddr_substitute(symbol, *pfn, cudaVersion, flags);
    if (w) {
        *pfn = w;
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    }
    return r;
}

GS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags)
{
    gs_need_cuda();
    CUresult (*real)(const char *, void **, int, cuuint64_t) = GS_REAL(GetProcAddress);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(symbol, pfn, cudaVersion, flags);
    if (!gs_cfg.active || r != CUDA_SUCCESS || !symbol || !pfn || !*pfn) return r;
    void *w = gs_procaddr_substitute(symbol, *pfn, cudaVersion, flags);
    if (w) *pfn = w;
    return r;
}

/* ---- dlsym ------------------------------------------------------------- */
enum { LIB_OTHER, LIB_CUDA, LIB_NVML };

static int lib_of(void *handle)
{
    struct link_map *lm = NULL;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) != 0 || !lm || !lm->l_name) return LIB_OTHER;
    const char *base = strrchr(lm->l_name, '/');
    base = base ? base + 1 : lm->l_name;
    if (!strncmp(base, "libcuda.so", 10)) return LIB_CUDA;
    if (!strncmp(base, "libnvidia-ml.so", 15)) return LIB_NVML;
    return LIB_OTHER;
}

/* Called by the dlsym trampoline.  NULL: let the real dlsym answer. */
void *gs_dlsym_filter(void *handle, const char *name)
{
    if (GS_UNLIKELY(!gs_real_dlsym)) gs_init_real_dlsym();
    if (!gs_cfg.active || !name || handle == RTLD_NEXT || handle == RTLD_DEFAULT) return NULL;
    if (name[0] == 'c' && name[1] == 'u') {
        for (int i = 0; i < GS_CU_COUNT; i++) {
            if (!wrappers[i] || strcmp(gs_cu_syms[i].name, name)) continue;
            if (lib_of(handle) != LIB_CUDA) return NULL;
            /* substitute only what this driver really has */
            return gs_real_dlsym(handle, name) ? wrappers[i] : NULL;
        }
    } else if (!strncmp(name, "nvml", 4)) {
        for (int i = 0; i < GS_NV_COUNT; i++) {
            if (!gs_nv_wrappers[i] || strcmp(gs_nv_names[i], name)) continue;
            if (lib_of(handle) != LIB_NVML) return NULL;
            return gs_real_dlsym(handle, name) ? gs_nv_wrappers[i] : NULL;
        }
    }
    return NULL;
}
