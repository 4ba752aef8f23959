/* modules.c: device memory that loading code commits (module and library
 * globals, constant banks, code).
 *
 * What a load commits is not in its arguments: a `__device__` array of 1 GiB
 * is 1 GiB of device memory the moment its module is loaded.  Measured on an
 * H200 (driver 580, docs/shim.md): cuModuleLoad* commits a module's globals
 * during the call, under CUDA_MODULE_LOADING=LAZY as under EAGER; under LAZY
 * cuLibraryLoad* commits nothing until the library is loaded into a context
 * (cuLibraryGetModule, a launch), under EAGER during the call.
 *
 * So each load is measured: the device's used memory (the driver's own
 * cuMemGetInfo) just before and just after the load, less what this process
 * counted in the ledger meanwhile (its own allocations and frees on other
 * threads).  A library is loaded into the current context inside that window
 * (cuLibraryGetModule), so its globals are committed where they can be seen.
 * The bytes are charged to the slice at once; if that takes the slice over
 * its limit, the pools are trimmed and the footprint measured again once
 * (as before any refusal), and if it is still over, the module is unloaded
 * before the call returns and the load fails with CUDA_ERROR_OUT_OF_MEMORY.
 * Unloading gives the bytes back.
 *
 * Loads and unloads of one process are serialised (a concurrent unload would
 * hide a load's bytes); another process of the GPU that frees memory during
 * the window makes the load look smaller than it is, one that allocates makes
 * it look larger.  A library loaded with no current context is loaded into
 * contexts later, where only the footprint's NVML measurement sees it.
 * Loads are not an allocation fast path: the mutex and two driver queries
 * are fine here. */
#define _GNU_SOURCE
#include <pthread.h>

#include "gs.h"
#include "gs_api.h"

static pthread_mutex_t mod_mu = PTHREAD_MUTEX_INITIALIZER;

typedef CUresult (*pfn_getinfo)(size_t *, size_t *);
typedef CUresult (*pfn_lib_module)(CUmodule *, CUlibrary);
typedef CUresult (*pfn_unload)(void *);

/* the device's used memory, as the driver reports it to the current context */
static int device_used(uint64_t *out)
{
    pfn_getinfo f = (pfn_getinfo)GS_REAL(MemGetInfo_v2);
    size_t fr = 0, t = 0;
    if (!f || f(&fr, &t) != CUDA_SUCCESS || fr > t) return 0;
    *out = (uint64_t)(t - fr);
    return 1;
}

struct window {
    struct gs_ref *ref;
    uint64_t used0, slot0;
    int measured;
};

/* mod_mu held from here to close() */
static void open_window(struct window *w)
{
    pthread_mutex_lock(&mod_mu);
    w->ref = gs_ref_of(gs_current_dev()); /* first use measures the context: before used0 */
    int ok;
    w->slot0 = w->ref ? gs_slot_used(w->ref, &ok) : 0;
    w->measured = w->ref && device_used(&w->used0);
}

/* What the load committed: the device's growth less this process's own. */
static uint64_t window_bytes(const struct window *w)
{
    uint64_t used1;
    if (!w->measured || !device_used(&used1)) return 0;
    int ok;
    uint64_t slot1 = gs_slot_used(w->ref, &ok);
    int64_t grew = (int64_t)(used1 - w->used0) - (int64_t)(slot1 - w->slot0);
    return grew > 0 ? (uint64_t)grew : 0;
}

static int over_limit(struct gs_ref *ref) { return gs_used(ref) > gs_cfg.limit; }

/* Charge n bytes the driver now holds for handle; 0 if the slice cannot keep
 * them (the caller unloads).  mod_mu held. */
static int keep(struct gs_ref *ref, void *handle, uint64_t n)
{
    if (!n) return 1; /* nothing committed (or nothing measurable: no context) */
    if (ref->reg) gs_charge(ref, n); /* counted first: a refresh must not take it for context */
    if (over_limit(ref)) {
        gs_reap_if_due(ref, 1);
        gs_fp_pressure(ref);
    }
    if (over_limit(ref)) {
        if (ref->reg) gs_unreserve(ref, n);
        return 0;
    }
    if (!gs_table_put(&gs_allocs, (uint64_t)(uintptr_t)handle, n, GS_K_MODULE, ref)) {
        if (atomic_fetch_add(&gs_untracked_bytes, n) == 0)
            gs_warn("%s table full: some memory stays counted after it is freed", gs_allocs.name);
    }
    return 1;
}

/* The load was refused after the driver made it: undo it, then measure again
 * (the footprint may have taken the module's bytes for context meanwhile). */
static void refuse(struct gs_ref *ref, pfn_unload unload, void *handle, uint64_t n)
{
    if (unload) unload(handle);
    gs_refused(ref);
    atomic_store_explicit(&ref->freed, 1, memory_order_relaxed);
    gs_fp_refresh(ref);
    gs_log("a load of %llu bytes of module memory refused: over the slice's limit",
           (unsigned long long)n);
}

/* After the real load: keep what it committed, or undo it and refuse; ends the window. */
static CUresult settle(struct window *w, CUresult r, void **out, pfn_unload unload)
{
    if (r == CUDA_SUCCESS && w->ref) {
        uint64_t n = window_bytes(w);
        if (!keep(w->ref, *out, n)) {
            refuse(w->ref, unload, *out, n);
            *out = NULL;
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&mod_mu);
    return r;
}

/* The common path of every module load; call is the real call. */
#define MODULE_LOAD(real, out, call)                                            \
    do {                                                                        \
        if (GS_UNLIKELY(!(real))) return CUDA_ERROR_NOT_INITIALIZED;            \
        if (!gs_cfg.active || !(out)) return (call);                            \
        struct window w;                                                        \
        open_window(&w);                                                        \
        CUresult r = (call);                                                    \
        return settle(&w, r, (void **)(out), (pfn_unload)GS_REAL(ModuleUnload)); \
    } while (0)

GS_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    gs_need_cuda();
    CUresult (*real)(CUmodule *, const char *) = GS_REAL(ModuleLoad);
    MODULE_LOAD(real, module, real(module, fname));
}

GS_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    gs_need_cuda();
    CUresult (*real)(CUmodule *, const void *) = GS_REAL(ModuleLoadData);
    MODULE_LOAD(real, module, real(module, image));
}

GS_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                      CUjit_option *options, void **optionValues)
{
    gs_need_cuda();
    CUresult (*real)(CUmodule *, const void *, unsigned int, CUjit_option *, void **) =
        GS_REAL(ModuleLoadDataEx);
    MODULE_LOAD(real, module, real(module, image, numOptions, options, optionValues));
}

GS_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    gs_need_cuda();
    CUresult (*real)(CUmodule *, const void *) = GS_REAL(ModuleLoadFatBinary);
    MODULE_LOAD(real, module, real(module, fatCubin));
}

/* A library is loaded into the current context inside the window. */
static void library_into_context(CUresult r, CUlibrary lib)
{
    pfn_lib_module f = (pfn_lib_module)GS_REAL(LibraryGetModule);
    CUmodule m;
    if (r == CUDA_SUCCESS && lib && f) (void)f(&m, lib); /* no context: nothing to load into */
}

GS_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                     void **jitOptionsValues, unsigned int numJitOptions,
                                     CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                     unsigned int numLibraryOptions)
{
    gs_need_cuda();
    CUresult (*real)(CUlibrary *, const void *, CUjit_option *, void **, unsigned int,
                     CUlibraryOption *, void **, unsigned int) = GS_REAL(LibraryLoadData);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!gs_cfg.active || !library)
        return real(library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                    libraryOptionValues, numLibraryOptions);
    struct window w;
    open_window(&w);
    CUresult r = real(library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                      libraryOptionValues, numLibraryOptions);
    library_into_context(r, *library);
    return settle(&w, r, (void **)library, (pfn_unload)GS_REAL(LibraryUnload));
}

GS_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName,
                                         CUjit_option *jitOptions, void **jitOptionsValues,
                                         unsigned int numJitOptions, CUlibraryOption *libraryOptions,
                                         void **libraryOptionValues, unsigned int numLibraryOptions)
{
    gs_need_cuda();
    CUresult (*real)(CUlibrary *, const char *, CUjit_option *, void **, unsigned int,
                     CUlibraryOption *, void **, unsigned int) = GS_REAL(LibraryLoadFromFile);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!gs_cfg.active || !library)
        return real(library, fileName, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                    libraryOptionValues, numLibraryOptions);
    struct window w;
    open_window(&w);
    CUresult r = real(library, fileName, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                      libraryOptionValues, numLibraryOptions);
    library_into_context(r, *library);
    return settle(&w, r, (void **)library, (pfn_unload)GS_REAL(LibraryUnload));
}

/* Unload: the bytes go back once the driver has let go of them. */
static CUresult unload(pfn_unload real, void *handle)
{
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!gs_cfg.active || !handle) return real(handle);
    pthread_mutex_lock(&mod_mu);
    struct gs_entry e;
    int had = gs_table_take(&gs_allocs, (uint64_t)(uintptr_t)handle, &e);
    CUresult r = real(handle);
    if (had) {
        if (r == CUDA_SUCCESS) {
            atomic_store_explicit(&e.ref->freed, 1, memory_order_relaxed);
            gs_unreserve(e.ref, e.size);
        } else {
            gs_table_put(&gs_allocs, (uint64_t)(uintptr_t)handle, e.size, e.aux, e.ref);
        }
    }
    pthread_mutex_unlock(&mod_mu);
    return r;
}

GS_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    gs_need_cuda();
    return unload((pfn_unload)GS_REAL(ModuleUnload), (void *)hmod);
}

GS_EXPORT CUresult cuLibraryUnload(CUlibrary library)
{
    gs_need_cuda();
    return unload((pfn_unload)GS_REAL(LibraryUnload), (void *)library);
}

static void atfork_prepare(void) { pthread_mutex_lock(&mod_mu); }
static void atfork_release(void) { pthread_mutex_unlock(&mod_mu); }

__attribute__((constructor(GS_INIT_MODULE))) static void modules_init(void)
{
    if (gs_cfg.active) pthread_atfork(atfork_prepare, atfork_release, atfork_release);
}
