/* footprint.c: what the driver holds for this process on a GPU besides its
 * allocations (the CUDA context, module images, driver reservations), charged
 * to the slice so that the processes' whole footprints, as NVML reports them
 * per process, stay within the limit.
 *
 * The process's region share is allocations + pool kept bytes (pools.c) +
 * graph pool (graphs.c) + `ctx`, where ctx is measured, never guessed:
 *  - NVML: ctx = NVML's used memory for our own pid on this GPU minus
 *    everything else the process has counted there.  Used when the process
 *    runs in the kernel's initial pid namespace (then NVML's pids are ours);
 *    in a container's own pid namespace NVML reports host pids, which the
 *    process cannot map to itself without a serialised probe, so:
 *  - DELTA: the GPU's used memory (NVML device figure) just before and just
 *    after cuDevicePrimaryCtxRetain creates this process's primary context.
 *    Another process allocating in that window inflates it (over-count).
 *    It is taken once per context; module growth later is not seen.
 * CDMO_SHIM_FOOTPRINT=nvml|delta|off forces one; auto (default) picks NVML
 * in the initial pid namespace and falls back to the delta when NVML does
 * not list our pid.
 *
 * When: at a device's first use (first allocation or memory query in this
 * process); whenever the slice's free bytes have halved since the last
 * measurement (a plain load on the reservation path, see region.c; the
 * refresh itself is rare: about log2(limit / allocation) times per fill);
 * before an allocation is refused (with the pools and graph memory trimmed
 * first); at most once a second from cuMemGetInfo; on every NVML memory
 * query.  Never per allocation.  Footprint that grows after the last
 * refresh (kernels loaded lazily) is over the limit until the next one.
 * The NVML figure lags behind stream-ordered allocations: it may lower the
 * charge only after something was freed (see gs_fp_refresh).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gs.h"
#include "gs_api.h"

#define PROC_PID_INIT_INO 0xEFFFFFFCU /* inode of the kernel's initial pid namespace */

/* recursive: refresh -> pools/graph measure -> gs_fp_set */
static pthread_mutex_t fp_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static int mode = -1;                    /* resolved GS_FP_* */
static int nvml_state;                   /* 0 untried, 1 ready, -1 unusable */
static uint64_t ctx_delta[GS_MAX_DEV];   /* measured at primary context creation */
static unsigned char delta_known[GS_MAX_DEV];
static nvmlProcessInfo_t procs[1024];    /* fp_mu held */
static int over_warned;                  /* fp_mu held; said once per process */

typedef nvmlReturn_t (*pfn_nv_init)(void);
typedef nvmlReturn_t (*pfn_nv_by_uuid)(const char *, nvmlDevice_t *);
typedef nvmlReturn_t (*pfn_nv_procs)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_t *);
typedef nvmlReturn_t (*pfn_nv_mem)(nvmlDevice_t, nvmlMemory_t *);

static int fp_mode(void)
{
    if (GS_LIKELY(mode >= 0)) return mode;
    int m = gs_cfg.footprint;
    if (m == GS_FP_AUTO) {
        struct stat st;
        m = stat("/proc/self/ns/pid", &st) == 0 && st.st_ino == PROC_PID_INIT_INO ? GS_FP_NVML
                                                                                   : GS_FP_DELTA;
    }
    gs_log("footprint: %s", m == GS_FP_NVML ? "NVML per-process figure"
                          : m == GS_FP_DELTA ? "context-creation delta" : "off");
    return mode = m;
}

static int nvml_ready(void)
{
    if (nvml_state) return nvml_state > 0;
    gs_need_nvml();
    pfn_nv_init init = (pfn_nv_init)gs_nv_real[GS_NV_nvmlInit_v2];
    nvml_state = init && init() == NVML_SUCCESS ? 1 : -1;
    if (nvml_state < 0) gs_log("footprint: NVML unavailable; context not measured through it");
    return nvml_state > 0;
}

/* NVML handle for a 32-hex-digit UUID: GPU- first, then MIG-. */
static nvmlDevice_t nvml_handle(const char *key)
{
    if (!nvml_ready()) return NULL; /* loads the NVML entry points first */
    pfn_nv_by_uuid f = (pfn_nv_by_uuid)gs_nv_real[GS_NV_nvmlDeviceGetHandleByUUID];
    if (!f) return NULL;
    static const char *const prefix[] = {"GPU", "MIG"};
    for (int i = 0; i < 2; i++) {
        char u[64];
        snprintf(u, sizeof u, "%s-%.8s-%.4s-%.4s-%.4s-%.12s", prefix[i], key, key + 8, key + 12,
                 key + 16, key + 20);
        nvmlDevice_t d = NULL;
        if (f(u, &d) == NVML_SUCCESS && d) return d;
    }
    return NULL;
}

static nvmlDevice_t ref_nvdev(struct gs_ref *ref)
{
    if (!ref->nvdev) ref->nvdev = nvml_handle(ref->key);
    return ref->nvdev;
}

/* NVML's used memory of our pid on this GPU.  fp_mu held. */
static int nvml_pid_used(struct gs_ref *ref, uint64_t *out)
{
    nvmlDevice_t d = ref_nvdev(ref);
    if (!d) return 0;
    pfn_nv_procs f = (pfn_nv_procs)gs_nv_real[GS_NV_nvmlDeviceGetComputeRunningProcesses_v3];
    if (!f) f = (pfn_nv_procs)gs_nv_real[GS_NV_nvmlDeviceGetComputeRunningProcesses_v2];
    unsigned int n = sizeof procs / sizeof procs[0];
    if (!f || f(d, &n, procs) != NVML_SUCCESS) return 0;
    unsigned int me = (unsigned int)getpid();
    uint64_t sum = 0;
    int found = 0;
    for (unsigned int i = 0; i < n; i++) {
        if (procs[i].pid != me || procs[i].usedGpuMemory == GS_NVML_VALUE_NOT_AVAILABLE) continue;
        sum += procs[i].usedGpuMemory; /* one entry per GPU instance under MIG */
        found = 1;
    }
    *out = sum;
    return found;
}

/* Used memory of the whole GPU behind CUdevice dev (no context needed). */
static int nvml_dev_used(int dev, uint64_t *out)
{
    CUuuid u;
    gs_pfn_DeviceGetUuid f2 = (gs_pfn_DeviceGetUuid)GS_REAL(DeviceGetUuid_v2);
    gs_pfn_DeviceGetUuid f1 = (gs_pfn_DeviceGetUuid)GS_REAL(DeviceGetUuid);
    CUresult r = f2 ? f2(&u, dev) : CUDA_ERROR_NOT_FOUND;
    if (r != CUDA_SUCCESS && f1) r = f1(&u, dev);
    if (r != CUDA_SUCCESS) return 0;
    char key[33];
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        key[2 * i] = hex[(unsigned char)u.bytes[i] >> 4];
        key[2 * i + 1] = hex[(unsigned char)u.bytes[i] & 15];
    }
    key[32] = 0;
    nvmlDevice_t d = nvml_handle(key);
    pfn_nv_mem m = (pfn_nv_mem)gs_nv_real[GS_NV_nvmlDeviceGetMemoryInfo];
    nvmlMemory_t mem;
    if (!d || !m || m(d, &mem) != NVML_SUCCESS) return 0;
    *out = mem.used;
    return 1;
}

/* Change a charge field of ref to value, adjusting the region by the difference. */
void gs_fp_set(struct gs_ref *ref, uint64_t *field, uint64_t value)
{
    pthread_mutex_lock(&fp_mu);
    uint64_t old = *field;
    *field = value;
    if (value > old) gs_charge(ref, value - old);
    else if (old > value) gs_unreserve(ref, old - value);
    pthread_mutex_unlock(&fp_mu);
}

/* fp_mu held.  Returns GS_CTX_* and the measured bytes. */
static int measure_ctx(struct gs_ref *ref, uint64_t *ctx)
{
    int m = fp_mode();
    if (m == GS_FP_OFF) return GS_CTX_NONE;
    if (m == GS_FP_NVML) {
        for (int tries = 0; tries < 3; tries++) {
            int ok1, ok2;
            uint64_t nv, s1 = gs_slot_used(ref, &ok1);
            if (!ok1 || !nvml_pid_used(ref, &nv)) break;
            uint64_t s2 = gs_slot_used(ref, &ok2);
            if (s1 != s2) continue; /* an allocation raced the query: again */
            uint64_t rest = s1 > ref->ctx ? s1 - ref->ctx : 0; /* all but ctx */
            *ctx = nv > rest ? nv - rest : 0;
            return GS_CTX_NVML;
        }
    }
    int d = ref->cudev;
    if (d >= 0 && delta_known[d]) {
        *ctx = ctx_delta[d];
        return GS_CTX_DELTA;
    }
    return GS_CTX_NONE;
}

void gs_fp_refresh(struct gs_ref *ref)
{
    if (!ref || !gs_cfg.active) return;
    pthread_mutex_lock(&fp_mu);
    if (ref->cudev >= 0) {
        gs_pools_measure(ref, 0);
        gs_graph_measure(ref, 0);
        uint64_t ctx = 0;
        int freed = atomic_exchange_explicit(&ref->freed, 0, memory_order_relaxed);
        int how = measure_ctx(ref, &ctx);
        /* NVML's per-process figure can lag behind memory the driver has just
         * committed (stream-ordered allocations): a lower figure is believed
         * only when something was freed since the last refresh.  The other way
         * round (a free not yet seen) errs on the safe side. */
        if (how == GS_CTX_NVML && ref->ctx_how == GS_CTX_NVML && ctx < ref->ctx && !freed) ctx = ref->ctx;
        if (how != GS_CTX_NONE) {
            if (ctx != ref->ctx)
                gs_log("footprint of device %d: %llu bytes (%s)", ref->cudev,
                       (unsigned long long)ctx, how == GS_CTX_NVML ? "NVML" : "delta");
            gs_fp_set(ref, &ref->ctx, ctx);
            ref->ctx_how = how;
            /* A limit below the context: the context stays charged (the
             * driver holds it) and nothing else fits.  Said once, since every
             * refused allocation measures again.  A limit of 0 said so
             * already, naming its value. */
            if (ctx >= gs_cfg.limit && gs_cfg.limit && !over_warned) {
                over_warned = 1;
                gs_warn("the CUDA context and driver memory of this process on device %d "
                        "(%llu bytes) alone take the whole limit of %llu bytes: every "
                        "allocation of device memory is refused", ref->cudev,
                        (unsigned long long)ctx, (unsigned long long)gs_cfg.limit);
            }
        }
        /* next refresh when the slice's free bytes have halved */
        uint64_t used = gs_used(ref), lim = gs_cfg.limit;
        atomic_store_explicit(&ref->mark, used < lim ? (lim - used) / 2 : 0,
                              memory_order_relaxed);
    }
    pthread_mutex_unlock(&fp_mu);
}

void gs_fp_first_use(struct gs_ref *ref, int dev)
{
    if (!ref || !gs_cfg.active) return;
    pthread_mutex_lock(&fp_mu);
    int first = ref->cudev < 0;
    if (first) ref->cudev = dev;
    if (first) gs_fp_refresh(ref);
    pthread_mutex_unlock(&fp_mu);
}

void gs_fp_mark_hit(struct gs_ref *ref)
{
    /* one thread refreshes; the others go on (a refresh is under way) */
    if (pthread_mutex_trylock(&fp_mu) != 0) return;
    atomic_store_explicit(&ref->mark, 0, memory_order_relaxed);
    gs_fp_refresh(ref);
    pthread_mutex_unlock(&fp_mu);
}

/* A reservation would fail: give back what this process's pools and graph
 * pool hold unused, and re-measure, before the caller retries once. */
int gs_fp_pressure(struct gs_ref *ref)
{
    if (!ref || !gs_cfg.active || ref->cudev < 0) return 0;
    pthread_mutex_lock(&fp_mu);
    gs_pools_measure(ref, 1);
    gs_graph_measure(ref, 1);
    gs_fp_refresh(ref);
    pthread_mutex_unlock(&fp_mu);
    return 1;
}

static void atfork_child(void)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&fp_mu, &a);
    pthread_mutexattr_destroy(&a);
    nvml_state = 0;
    over_warned = 0; /* the child measures a context of its own */
    memset(delta_known, 0, sizeof delta_known);
}

__attribute__((constructor(GS_INIT_MODULE))) static void footprint_init(void)
{
    if (gs_cfg.active) pthread_atfork(NULL, NULL, atfork_child);
}

/* The primary context is where the runtimes (cudart, so PyTorch and CuPy;
 * XLA) keep their state: its creation is measured for the DELTA method. */
GS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    gs_need_cuda();
    CUresult (*real)(CUcontext *, CUdevice) = GS_REAL(DevicePrimaryCtxRetain);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!gs_cfg.active || dev < 0 || dev >= GS_MAX_DEV || fp_mode() == GS_FP_OFF)
        return real(pctx, dev);
    CUresult (*state)(CUdevice, unsigned int *, int *) = GS_REAL(DevicePrimaryCtxGetState);
    unsigned int flags = 0;
    int active = 1;
    if (!state || state(dev, &flags, &active) != CUDA_SUCCESS || active) return real(pctx, dev);
    pthread_mutex_lock(&fp_mu);
    uint64_t before = 0, after = 0;
    int ok = nvml_dev_used(dev, &before);
    CUresult r = real(pctx, dev);
    if (r == CUDA_SUCCESS && ok && nvml_dev_used(dev, &after)) {
        ctx_delta[dev] = after > before ? after - before : 0;
        delta_known[dev] = 1;
        gs_log("context on device %d: %llu bytes (device used-memory delta)", dev,
               (unsigned long long)ctx_delta[dev]);
        struct gs_ref *ref = gs_dev_ref[dev];
        if (ref && ref->cudev >= 0) gs_fp_refresh(ref); /* a context made again */
    }
    pthread_mutex_unlock(&fp_mu);
    return r;
}
