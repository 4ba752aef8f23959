/* libgpuslice internal interface.  Everything here has hidden visibility;
 * only the driver/NVML entry points (GS_EXPORT) and dlsym leave the library. */
#ifndef GS_H
#define GS_H

#include <stdatomic.h>
#include <stdint.h>
#include "cuda_abi.h"

#define GS_HIDDEN __attribute__((visibility("hidden")))
#define GS_EXPORT __attribute__((visibility("default")))
#define GS_LIKELY(x) __builtin_expect(!!(x), 1)
#define GS_UNLIKELY(x) __builtin_expect(!!(x), 0)

#define GS_MAX_DEV 64

/* ---- start-up order ----------------------------------------------------
 * config.c reads the slice's limit in the library's first constructor
 * (GS_INIT_CONFIG).  A module that needs setting up, or keeps state a fork
 * must lock or reset, does it in a constructor of its own at GS_INIT_MODULE,
 * only when gs_cfg.active, with its own pthread_atfork handlers: no module
 * calls another's fork handler.  The locks the prepare handlers take are never
 * held together anywhere else, so their order across modules does not matter
 * (it follows SRCS in the Makefile: handlers register in link order). */
#define GS_INIT_CONFIG 101
#define GS_INIT_MODULE 102

/* ---- config.c: the limit and switches, read once by the constructor ---- */
struct gs_config {
    int active;        /* a slice: count and enforce                          */
    int debug;         /* CDMO_SHIM_DEBUG=1: log decisions to stderr          */
    int footprint;     /* GS_FP_* below (CDMO_SHIM_FOOTPRINT in test builds)  */
    uint64_t limit;    /* GS_LIMIT_FILE's byte count; 0 (the file unreadable
                        * or not a byte count >= 1, or missing where
                        * CDMO_GPU_MEMORY_LIMIT says a slice): every
                        * allocation is refused                             */
};
/* The slice's ledger: a directory the CDI spec bind-mounts from the node's
 * per-claim directory, so every process of every pod of one claim shares it.
 * The slice's limit: a file the CDI spec bind-mounts read-only beside it.
 * Both fixed at build time: no variable chooses another ledger or limit.
 * The GPU-free tests build a copy (GS_TEST_BUILD) with relative paths, one
 * directory per test case, which also honours CDMO_SHIM_FOOTPRINT. */
#ifndef GS_LEDGER_DIR
#define GS_LEDGER_DIR "/run/cdmo/ledger"
#endif
#ifndef GS_LIMIT_FILE
#define GS_LIMIT_FILE "/run/cdmo/limit"
#endif
/* How the driver-side footprint (context, modules) of a process is measured:
 * NVML's per-process figure for our own pid, the device's used-memory delta
 * around primary-context creation, or not at all. */
enum { GS_FP_AUTO = 0, GS_FP_NVML, GS_FP_DELTA, GS_FP_OFF };
extern struct gs_config gs_cfg GS_HIDDEN;
void gs_log(const char *fmt, ...) GS_HIDDEN __attribute__((format(printf, 1, 2)));
void gs_warn(const char *fmt, ...) GS_HIDDEN __attribute__((format(printf, 1, 2)));

/* ---- real entry points (driver.c) -------------------------------------- */
/* X(id, symbol, base name for cuGetProcAddress, version, per-thread, hooked) */
#define GS_CU_SYMBOLS(X)                                                            \
    X(MemAlloc_v2, cuMemAlloc_v2, cuMemAlloc, 3020, 0, 1)                           \
    X(MemAllocPitch_v2, cuMemAllocPitch_v2, cuMemAllocPitch, 3020, 0, 1)            \
    X(MemFree_v2, cuMemFree_v2, cuMemFree, 3020, 0, 1)                              \
    X(MemGetInfo_v2, cuMemGetInfo_v2, cuMemGetInfo, 3020, 0, 1)                     \
    X(DeviceTotalMem_v2, cuDeviceTotalMem_v2, cuDeviceTotalMem, 3020, 0, 1)         \
    X(MemAllocManaged, cuMemAllocManaged, cuMemAllocManaged, 6000, 0, 1)            \
    X(MemCreate, cuMemCreate, cuMemCreate, 10020, 0, 1)                             \
    X(MemRelease, cuMemRelease, cuMemRelease, 10020, 0, 1)                          \
    X(MemMap, cuMemMap, cuMemMap, 10020, 0, 1)                                      \
    X(MemUnmap, cuMemUnmap, cuMemUnmap, 10020, 0, 1)                                \
    X(MemRetainAllocationHandle, cuMemRetainAllocationHandle,                       \
      cuMemRetainAllocationHandle, 11000, 0, 1)                                     \
    X(ArrayCreate_v2, cuArrayCreate_v2, cuArrayCreate, 3020, 0, 1)                  \
    X(Array3DCreate_v2, cuArray3DCreate_v2, cuArray3DCreate, 3020, 0, 1)            \
    X(ArrayDestroy, cuArrayDestroy, cuArrayDestroy, 2000, 0, 1)                     \
    X(MipmappedArrayCreate, cuMipmappedArrayCreate, cuMipmappedArrayCreate, 5000, 0, 1) \
    X(MipmappedArrayDestroy, cuMipmappedArrayDestroy, cuMipmappedArrayDestroy, 5000, 0, 1) \
    X(MemAllocAsync, cuMemAllocAsync, cuMemAllocAsync, 11020, 0, 1)                 \
    X(MemAllocAsync_ptsz, cuMemAllocAsync_ptsz, cuMemAllocAsync, 11020, 1, 1)       \
    X(MemFreeAsync, cuMemFreeAsync, cuMemFreeAsync, 11020, 0, 1)                    \
    X(MemFreeAsync_ptsz, cuMemFreeAsync_ptsz, cuMemFreeAsync, 11020, 1, 1)          \
    X(MemAllocFromPoolAsync, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync, 11020, 0, 1) \
    X(MemAllocFromPoolAsync_ptsz, cuMemAllocFromPoolAsync_ptsz,                     \
      cuMemAllocFromPoolAsync, 11020, 1, 1)                                         \
    X(GetProcAddress, cuGetProcAddress, cuGetProcAddress, 11030, 0, 1)              \
    X(GetProcAddress_v2, cuGetProcAddress_v2, cuGetProcAddress, 12000, 0, 1)        \
    X(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain,   \
      7000, 0, 1)                                                                   \
    X(MemPoolCreate, cuMemPoolCreate, cuMemPoolCreate, 11020, 0, 1)                 \
    X(MemPoolDestroy, cuMemPoolDestroy, cuMemPoolDestroy, 11020, 0, 1)              \
    X(DeviceSetMemPool, cuDeviceSetMemPool, cuDeviceSetMemPool, 11020, 0, 1)        \
    X(GraphInstantiateWithFlags, cuGraphInstantiateWithFlags,                       \
      cuGraphInstantiateWithFlags, 11040, 0, 1)                                     \
    /* from 12000 on, "cuGraphInstantiate" is the WithFlags ABI */                  \
    X(GraphInstantiate_12, cuGraphInstantiateWithFlags, cuGraphInstantiate,         \
      12000, 0, 1)                                                                  \
    X(GraphInstantiateWithParams, cuGraphInstantiateWithParams,                     \
      cuGraphInstantiateWithParams, 12000, 0, 1)                                    \
    X(GraphInstantiateWithParams_ptsz, cuGraphInstantiateWithParams_ptsz,           \
      cuGraphInstantiateWithParams, 12000, 1, 1)                                    \
    X(GraphLaunch, cuGraphLaunch, cuGraphLaunch, 10000, 0, 1)                       \
    X(GraphLaunch_ptsz, cuGraphLaunch_ptsz, cuGraphLaunch, 10000, 1, 1)             \
    X(GraphUpload, cuGraphUpload, cuGraphUpload, 11010, 0, 1)                       \
    X(GraphUpload_ptsz, cuGraphUpload_ptsz, cuGraphUpload, 11010, 1, 1)             \
    X(GraphExecDestroy, cuGraphExecDestroy, cuGraphExecDestroy, 10000, 0, 1)        \
    X(DeviceGraphMemTrim, cuDeviceGraphMemTrim, cuDeviceGraphMemTrim, 11040, 0, 1)  \
    X(ModuleLoad, cuModuleLoad, cuModuleLoad, 2000, 0, 1)                           \
    X(ModuleLoadData, cuModuleLoadData, cuModuleLoadData, 2000, 0, 1)               \
    X(ModuleLoadDataEx, cuModuleLoadDataEx, cuModuleLoadDataEx, 2010, 0, 1)         \
    X(ModuleLoadFatBinary, cuModuleLoadFatBinary, cuModuleLoadFatBinary, 2000, 0, 1) \
    X(ModuleUnload, cuModuleUnload, cuModuleUnload, 2000, 0, 1)                     \
    X(LibraryLoadData, cuLibraryLoadData, cuLibraryLoadData, 12000, 0, 1)           \
    X(LibraryLoadFromFile, cuLibraryLoadFromFile, cuLibraryLoadFromFile, 12000, 0, 1) \
    X(LibraryUnload, cuLibraryUnload, cuLibraryUnload, 12000, 0, 1)                 \
    /* used by the shim, never substituted */                                      \
    X(CtxGetDevice, cuCtxGetDevice, cuCtxGetDevice, 2000, 0, 0)                     \
    X(DeviceGetCount, cuDeviceGetCount, cuDeviceGetCount, 2000, 0, 0)               \
    X(DeviceGetUuid, cuDeviceGetUuid, cuDeviceGetUuid, 9020, 0, 0)                  \
    X(DeviceGetUuid_v2, cuDeviceGetUuid_v2, cuDeviceGetUuid, 11040, 0, 0)           \
    X(ArrayGetMemoryRequirements, cuArrayGetMemoryRequirements,                     \
      cuArrayGetMemoryRequirements, 11060, 0, 0)                                    \
    X(MipmappedArrayGetMemoryRequirements, cuMipmappedArrayGetMemoryRequirements,   \
      cuMipmappedArrayGetMemoryRequirements, 11060, 0, 0)                           \
    X(DevicePrimaryCtxGetState, cuDevicePrimaryCtxGetState,                         \
      cuDevicePrimaryCtxGetState, 7000, 0, 0)                                       \
    X(DeviceGetDefaultMemPool, cuDeviceGetDefaultMemPool, cuDeviceGetDefaultMemPool, \
      11020, 0, 0)                                                                  \
    X(DeviceGetMemPool, cuDeviceGetMemPool, cuDeviceGetMemPool, 11020, 0, 0)        \
    X(MemPoolTrimTo, cuMemPoolTrimTo, cuMemPoolTrimTo, 11020, 0, 0)                 \
    X(MemPoolGetAttribute, cuMemPoolGetAttribute, cuMemPoolGetAttribute, 11020, 0, 0) \
    X(DeviceGetGraphMemAttribute, cuDeviceGetGraphMemAttribute,                     \
      cuDeviceGetGraphMemAttribute, 11040, 0, 0)                                    \
    X(GraphGetNodes, cuGraphGetNodes, cuGraphGetNodes, 10000, 0, 0)                 \
    X(GraphNodeGetType, cuGraphNodeGetType, cuGraphNodeGetType, 10000, 0, 0)        \
    X(GraphMemAllocNodeGetParams, cuGraphMemAllocNodeGetParams,                     \
      cuGraphMemAllocNodeGetParams, 11040, 0, 0)                                    \
    X(LibraryGetModule, cuLibraryGetModule, cuLibraryGetModule, 12000, 0, 0)

#define GS_NVML_SYMBOLS(X)                                                          \
    X(nvmlDeviceGetMemoryInfo, 1)                                                   \
    X(nvmlDeviceGetMemoryInfo_v2, 1)                                                \
    X(nvmlDeviceGetUUID, 0)                                                         \
    X(nvmlInit_v2, 0)                                                               \
    X(nvmlDeviceGetHandleByUUID, 0)                                                 \
    X(nvmlDeviceGetComputeRunningProcesses_v3, 0)                                   \
    X(nvmlDeviceGetComputeRunningProcesses_v2, 0)

enum gs_cu_id {
#define GS_ENUM(id, sym, base, ver, ptsz, hooked) GS_CU_##id,
    GS_CU_SYMBOLS(GS_ENUM)
#undef GS_ENUM
    GS_CU_COUNT
};
enum gs_nvml_id {
#define GS_NENUM(sym, hooked) GS_NV_##sym,
    GS_NVML_SYMBOLS(GS_NENUM)
#undef GS_NENUM
    GS_NV_COUNT
};

struct gs_cu_sym {
    const char *name;  /* exported variant name, e.g. cuMemAllocAsync_ptsz */
    const char *base;  /* name cuGetProcAddress is asked with               */
    int version;       /* first CUDA version that returns this variant      */
    int ptsz;          /* per-thread default stream variant                 */
    int hooked;        /* 1: the shim exports a wrapper of this variant     */
};
extern const struct gs_cu_sym gs_cu_syms[GS_CU_COUNT] GS_HIDDEN;
extern void *gs_cu_real[GS_CU_COUNT] GS_HIDDEN;
extern void *gs_nv_real[GS_NV_COUNT] GS_HIDDEN;
extern const char *const gs_nv_names[GS_NV_COUNT] GS_HIDDEN;
extern void *const gs_nv_wrappers[GS_NV_COUNT] GS_HIDDEN;

extern _Atomic int gs_cu_ready GS_HIDDEN;
extern _Atomic int gs_nv_ready GS_HIDDEN;
void gs_load_cuda(void) GS_HIDDEN;
void gs_load_nvml(void) GS_HIDDEN;
static inline void gs_need_cuda(void)
{
    if (GS_UNLIKELY(!atomic_load_explicit(&gs_cu_ready, memory_order_acquire)))
        gs_load_cuda();
}
static inline void gs_need_nvml(void)
{
    if (GS_UNLIKELY(!atomic_load_explicit(&gs_nv_ready, memory_order_acquire)))
        gs_load_nvml();
}
#define GS_REAL(id) (gs_cu_real[GS_CU_##id])

/* real dlsym (driver.c); resolved with dlvsym, never a GLIBC_PRIVATE name */
extern void *(*gs_real_dlsym)(void *, const char *) GS_HIDDEN;
void gs_init_real_dlsym(void) GS_HIDDEN;

/* ---- region.c: one shared region per (slice, GPU UUID) ----------------- */
struct gs_region;
struct gs_ref {                 /* this process's view of one region        */
    struct gs_region *reg;      /* NULL: closed, the ledger cannot be used  */
    int slot;                   /* our process slot, -1 until claimed       */
    int released;               /* set at exit, after the slot is given back */
    char key[33];               /* GPU UUID as 32 hex digits                */
    /* footprint.c, process-local: bytes charged beside the allocations */
    int cudev;                  /* CUdevice of this GPU, -1 before first use */
    int ctx_how;                /* GS_CTX_*: how ctx was last measured      */
    uint64_t ctx;               /* context, modules, driver reservations    */
    uint64_t graph;             /* graph memory pool reservation            */
    void *nvdev;                /* NVML handle of this GPU, NULL unresolved */
    /* refresh when the slice's free bytes fall below this (0: never) */
    _Atomic uint64_t mark;
    /* memory was freed since the last refresh: a lower NVML figure may be real */
    _Atomic int freed;
};
enum { GS_CTX_NONE = 0, GS_CTX_NVML, GS_CTX_DELTA };
struct gs_ref *gs_ref_for_key(const char *hexkey) GS_HIDDEN;  /* slow path */
/* reserve bytes within the limit; 0 (counted as a refusal in the ledger) if they do not fit */
int gs_reserve(struct gs_ref *ref, uint64_t bytes) GS_HIDDEN;
/* the same, for memory nobody asked for (a pool's surplus): not fitting is no refusal */
int gs_reserve_spare(struct gs_ref *ref, uint64_t bytes) GS_HIDDEN;
/* an allocation refused for the limit after the driver made it: count it in the ledger */
void gs_refused(struct gs_ref *ref) GS_HIDDEN;
void gs_unreserve(struct gs_ref *ref, uint64_t bytes) GS_HIDDEN;
/* memory the driver already holds: counted even beyond the limit */
void gs_charge(struct gs_ref *ref, uint64_t bytes) GS_HIDDEN;
uint64_t gs_slot_used(const struct gs_ref *ref, int *ok) GS_HIDDEN;
/* bytes the slice holds; UINT64_MAX when its ledger is closed (nothing fits) */
uint64_t gs_used(const struct gs_ref *ref) GS_HIDDEN;
int gs_reap_if_due(struct gs_ref *ref, int force) GS_HIDDEN; /* 1: it ran */
uint64_t gs_peak(const struct gs_ref *ref) GS_HIDDEN;

/* ---- device.c (in report.c): CUdevice ordinal -> region ---------------- */
extern struct gs_ref *gs_dev_ref[GS_MAX_DEV] GS_HIDDEN;
extern int gs_ndev GS_HIDDEN;         /* 0 unknown, else visible device count */
struct gs_ref *gs_dev_ref_slow(int dev) GS_HIDDEN;
int gs_current_dev_slow(void) GS_HIDDEN;
static inline struct gs_ref *gs_ref_of(int dev)
{
    if (GS_UNLIKELY(dev < 0 || dev >= GS_MAX_DEV)) return NULL;
    struct gs_ref *r = gs_dev_ref[dev];
    return GS_LIKELY(r != NULL) ? r : gs_dev_ref_slow(dev);
}
static inline int gs_current_dev(void)
{
    return GS_LIKELY(gs_ndev == 1) ? 0 : gs_current_dev_slow();
}

/* ---- ptrtable.c: O(1) open-addressing tables ---------------------------- */
enum gs_kind { GS_K_MEM = 1, GS_K_ASYNC, GS_K_MANAGED, GS_K_ARRAY, GS_K_MIPMAP,
               GS_K_VMM, GS_K_MAP, GS_K_MODULE };
struct gs_entry {
    uint64_t key;       /* ~pointer; 0 = empty                               */
    uint64_t size;
    uint64_t aux;       /* VMM: handle of a mapping; refs|maps of a handle   */
    struct gs_ref *ref;
};
struct gs_table {
    struct gs_entry *e;
    uint64_t mask;
    unsigned shift;
    uint64_t count;
    uint64_t cap_limit;
    atomic_flag lock;
    const char *name;
};
extern struct gs_table gs_allocs GS_HIDDEN;   /* device pointers, arrays       */
extern struct gs_table gs_handles GS_HIDDEN;  /* cuMemCreate handles           */
extern struct gs_table gs_maps GS_HIDDEN;     /* cuMemMap ranges -> handle     */
extern struct gs_table gs_graphs GS_HIDDEN;   /* graph execs with alloc nodes  */
extern _Atomic uint64_t gs_untracked_bytes GS_HIDDEN;
void gs_table_lock(struct gs_table *t) GS_HIDDEN;
void gs_table_unlock(struct gs_table *t) GS_HIDDEN;
/* the _locked variants need gs_table_lock held */
int gs_table_put_locked(struct gs_table *t, uint64_t key, uint64_t size,
                        uint64_t aux, struct gs_ref *ref) GS_HIDDEN;
struct gs_entry *gs_table_get_locked(struct gs_table *t, uint64_t key) GS_HIDDEN;
void gs_table_del_locked(struct gs_table *t, struct gs_entry *e) GS_HIDDEN;
int gs_table_put(struct gs_table *t, uint64_t key, uint64_t size, uint64_t aux,
                 struct gs_ref *ref) GS_HIDDEN;
int gs_table_take(struct gs_table *t, uint64_t key, struct gs_entry *out) GS_HIDDEN;

/* ---- footprint.c: what the driver holds for this process besides the
 * allocations, and what happens under pressure ---------------------------- */
void gs_fp_first_use(struct gs_ref *ref, int dev) GS_HIDDEN;       /* slow path */
void gs_fp_refresh(struct gs_ref *ref) GS_HIDDEN;                  /* slow path */
int gs_fp_pressure(struct gs_ref *ref) GS_HIDDEN;  /* trim + refresh before OOM */
void gs_fp_mark_hit(struct gs_ref *ref) GS_HIDDEN;
void gs_fp_set(struct gs_ref *ref, uint64_t *field, uint64_t value) GS_HIDDEN;

/* ---- pools.c: stream-ordered pools ------------------------------------- */
/* A pool's entry: which region its memory counts in (NULL: host memory, not
 * counted) and the bytes it keeps reserved after frees (still counted). */
struct gs_pool {
    _Atomic(CUmemoryPool) pool; /* NULL: free entry                          */
    struct gs_ref *ref;
    int dev;                    /* CUdevice, -1 for host pools               */
    _Atomic int dead;           /* destroyed: frees give their bytes back    */
    _Atomic uint64_t kept;      /* freed bytes the pool still holds          */
};
#define GS_MAX_POOLS 64
struct gs_pool *gs_pool_of(CUmemoryPool p) GS_HIDDEN;
struct gs_pool *gs_pool_current(int dev) GS_HIDDEN;
uint64_t gs_pool_take(struct gs_pool *pl, uint64_t n) GS_HIDDEN;
void gs_pool_keep(struct gs_pool *pl, uint64_t n) GS_HIDDEN;
int gs_pool_index(const struct gs_pool *pl) GS_HIDDEN;
struct gs_pool *gs_pool_at(int index) GS_HIDDEN;
void gs_pools_measure(struct gs_ref *ref, int trim) GS_HIDDEN;
void gs_pool_settle(struct gs_pool *pl) GS_HIDDEN;

/* ---- alloc.c ------------------------------------------------------------- */
void gs_untrack_async(CUdeviceptr p) GS_HIDDEN;

/* ---- graphs.c: graph memory nodes -------------------------------------- */
void gs_graph_measure(struct gs_ref *ref, int trim) GS_HIDDEN;

/* ---- procaddr.c --------------------------------------------------------- */
void *gs_procaddr_substitute(const char *symbol, void *real_pfn, int version,
                             cuuint64_t flags) GS_HIDDEN;
void *gs_dlsym_filter(void *handle, const char *name) GS_HIDDEN;

#endif
