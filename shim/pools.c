/* pools.c: stream-ordered memory pools (cuMemAllocAsync, cuMemAllocFromPoolAsync).
 *
 * A pool keeps the physical memory of freed blocks reserved, up to its
 * release threshold (PyTorch's cudaMallocAsync backend sets "keep all"), so a
 * block freed with cuMemFreeAsync stays counted: its bytes move to the pool's
 * `kept` count, and the pool's next allocations are served from there before
 * anything new is reserved in the region.  What a pool really holds is
 * measured from the driver (RESERVED_MEM_CURRENT - USED_MEM_CURRENT) at every
 * footprint refresh, and under pressure the pools of the device are first
 * trimmed (cuMemPoolTrimTo(pool, 0)).  So the count never falls below what
 * the pools hold; it can lie above it (a pool that released memory at a
 * synchronisation) only until the next refresh.
 *
 * Each pool is charged to its own device: pools made by cuMemPoolCreate to
 * props->location, a device's default or current pool to that device; pools
 * in host memory are not counted.  The table is process-local and small
 * (GS_MAX_POOLS); lookups are a short scan of relaxed loads, insertions take
 * a mutex.  Entries are never reused, so an allocation can name its pool by
 * index for as long as it lives.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>

#include "gs.h"
#include "gs_api.h"

static struct gs_pool pools[GS_MAX_POOLS + 1]; /* [0] unused: index 0 = no pool */
static _Atomic int npools;
static struct gs_pool *_Atomic cur_pool[GS_MAX_DEV]; /* cuMemAllocAsync's pool */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static int full_warned;

typedef CUresult (*pfn_pool_attr)(CUmemoryPool, CUmemPool_attribute, void *);
typedef CUresult (*pfn_dev_pool)(CUmemoryPool *, CUdevice);

struct gs_pool *gs_pool_at(int i)
{
    return i > 0 && i <= atomic_load_explicit(&npools, memory_order_acquire) ? &pools[i] : NULL;
}

int gs_pool_index(const struct gs_pool *pl) { return pl ? (int)(pl - pools) : 0; }

static struct gs_pool *find(CUmemoryPool p)
{
    int n = atomic_load_explicit(&npools, memory_order_acquire);
    for (int i = 1; i <= n; i++)
        if (atomic_load_explicit(&pools[i].pool, memory_order_relaxed) == p &&
            !atomic_load_explicit(&pools[i].dead, memory_order_relaxed))
            return &pools[i];
    return NULL;
}

/* Lock held.  dev < 0: host memory. */
static struct gs_pool *add_locked(CUmemoryPool p, int dev)
{
    struct gs_pool *e = find(p);
    if (e) return e;
    int n = atomic_load_explicit(&npools, memory_order_relaxed);
    if (n == GS_MAX_POOLS) {
        if (!full_warned++)
            gs_warn("more than %d memory pools: bytes freed to the others are given back at once",
                    GS_MAX_POOLS);
        return NULL;
    }
    e = &pools[n + 1];
    e->dev = dev;
    e->ref = dev >= 0 ? gs_ref_of(dev) : NULL;
    atomic_store_explicit(&e->kept, 0, memory_order_relaxed);
    atomic_store_explicit(&e->dead, 0, memory_order_relaxed);
    atomic_store_explicit(&e->pool, p, memory_order_relaxed);
    atomic_store_explicit(&npools, n + 1, memory_order_release);
    gs_log("pool %p on %s %d", (void *)p, dev >= 0 ? "device" : "host", dev);
    return e;
}

/* The device whose default or current pool p is, else the current device. */
static int device_of(CUmemoryPool p)
{
    pfn_dev_pool dflt = (pfn_dev_pool)GS_REAL(DeviceGetDefaultMemPool);
    pfn_dev_pool curp = (pfn_dev_pool)GS_REAL(DeviceGetMemPool);
    int n = 0;
    gs_pfn_DeviceGetCount cnt = (gs_pfn_DeviceGetCount)GS_REAL(DeviceGetCount);
    if (cnt && cnt(&n) != CUDA_SUCCESS) n = 0;
    for (int d = 0; d < n && d < GS_MAX_DEV; d++) {
        CUmemoryPool q = NULL;
        if (dflt && dflt(&q, d) == CUDA_SUCCESS && q == p) return d;
        if (curp && curp(&q, d) == CUDA_SUCCESS && q == p) return d;
    }
    return gs_current_dev();
}

struct gs_pool *gs_pool_of(CUmemoryPool p)
{
    struct gs_pool *e = find(p);
    if (GS_LIKELY(e != NULL)) return e;
    int dev = device_of(p); /* driver queries: outside the lock */
    if (dev < 0) return NULL;
    pthread_mutex_lock(&pool_mu);
    e = add_locked(p, dev);
    pthread_mutex_unlock(&pool_mu);
    return e;
}

/* The pool cuMemAllocAsync draws from on dev (its current pool). */
struct gs_pool *gs_pool_current(int dev)
{
    if (GS_UNLIKELY(dev < 0 || dev >= GS_MAX_DEV)) return NULL;
    struct gs_pool *e = atomic_load_explicit(&cur_pool[dev], memory_order_acquire);
    if (GS_LIKELY(e != NULL)) return e;
    pfn_dev_pool curp = (pfn_dev_pool)GS_REAL(DeviceGetMemPool);
    CUmemoryPool p = NULL;
    if (!curp || curp(&p, dev) != CUDA_SUCCESS || !p) return NULL;
    pthread_mutex_lock(&pool_mu);
    e = add_locked(p, dev);
    atomic_store_explicit(&cur_pool[dev], e, memory_order_release);
    pthread_mutex_unlock(&pool_mu);
    return e;
}

/* Take up to n of the pool's kept bytes for a new allocation. */
uint64_t gs_pool_take(struct gs_pool *pl, uint64_t n)
{
    uint64_t k = atomic_load_explicit(&pl->kept, memory_order_relaxed);
    while (k) {
        uint64_t t = k < n ? k : n;
        if (atomic_compare_exchange_weak_explicit(&pl->kept, &k, k - t, memory_order_acq_rel,
                                                  memory_order_relaxed))
            return t;
    }
    return 0;
}

/* n freed bytes stay in the pool (still counted), unless it is destroyed. */
void gs_pool_keep(struct gs_pool *pl, uint64_t n)
{
    atomic_fetch_add_explicit(&pl->kept, n, memory_order_acq_rel);
    if (GS_UNLIKELY(atomic_load_explicit(&pl->dead, memory_order_acquire))) {
        uint64_t k = atomic_exchange(&pl->kept, 0);
        if (k && pl->ref) gs_unreserve(pl->ref, k);
    }
}

/* Re-measure what the pools of ref's device hold beyond their allocations;
 * trim them first when asked (pressure). */
void gs_pools_measure(struct gs_ref *ref, int trim)
{
    pfn_pool_attr attr = (pfn_pool_attr)GS_REAL(MemPoolGetAttribute);
    CUresult (*trimto)(CUmemoryPool, size_t) = GS_REAL(MemPoolTrimTo);
    int n = atomic_load_explicit(&npools, memory_order_acquire);
    for (int i = 1; i <= n; i++) {
        struct gs_pool *e = &pools[i];
        if (e->ref != ref || atomic_load(&e->dead)) continue;
        CUmemoryPool p = atomic_load_explicit(&e->pool, memory_order_relaxed);
        if (trim && trimto) trimto(p, 0);
        cuuint64_t res = 0, used = 0;
        if (!attr || attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res) != CUDA_SUCCESS ||
            attr(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) != CUDA_SUCCESS)
            continue;
        uint64_t truth = res > used ? res - used : 0;
        uint64_t old = atomic_exchange(&e->kept, truth);
        if (truth > old) gs_charge(ref, truth - old);
        else if (old > truth) gs_unreserve(ref, old - truth);
        if (old != truth)
            gs_log("pool %p keeps %llu bytes (was counted as %llu)", (void *)p,
                   (unsigned long long)truth, (unsigned long long)old);
    }
}

/* After an allocation made the pool grow: a pool reserves physical memory
 * in its own granules, so it may now hold more than its allocations and
 * the bytes counted as kept.  Count the surplus; if the slice has no room
 * for it, the surplus is unused memory: trim it (the pressure path inside
 * gs_reserve already did, and re-measured).  Two attribute reads, only when
 * the pool grew. */
void gs_pool_settle(struct gs_pool *pl)
{
    pfn_pool_attr attr = (pfn_pool_attr)GS_REAL(MemPoolGetAttribute);
    CUmemoryPool p = atomic_load_explicit(&pl->pool, memory_order_relaxed);
    cuuint64_t res = 0, used = 0;
    if (!attr || !pl->ref || attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res) != CUDA_SUCCESS ||
        attr(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) != CUDA_SUCCESS)
        return;
    uint64_t spare = res > used ? res - used : 0;
    uint64_t k = atomic_load_explicit(&pl->kept, memory_order_acquire);
    if (spare <= k || !gs_reserve_spare(pl->ref, spare - k)) return;
    /* reserved; pressure inside gs_reserve may have trimmed and re-measured
     * the pool meanwhile: settle on what it holds now */
    if (attr(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res) != CUDA_SUCCESS ||
        attr(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) != CUDA_SUCCESS)
        res = used = 0;
    uint64_t truth = res > used ? res - used : 0;
    uint64_t have = atomic_exchange(&pl->kept, truth) + (spare - k);
    if (truth > have) gs_charge(pl->ref, truth - have);
    else if (have > truth) gs_unreserve(pl->ref, have - truth);
}

static void atfork_child(void)
{
    /* the child owns no pool of the parent */
    pthread_mutex_init(&pool_mu, NULL);
    for (int i = 1; i <= GS_MAX_POOLS; i++) memset(&pools[i], 0, sizeof pools[i]);
    atomic_store(&npools, 0);
    for (int d = 0; d < GS_MAX_DEV; d++) atomic_store(&cur_pool[d], NULL);
}

__attribute__((constructor(GS_INIT_MODULE))) static void pools_init(void)
{
    if (gs_cfg.active) pthread_atfork(NULL, NULL, atfork_child);
}

/* ---- hooks ------------------------------------------------------------- */
GS_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    gs_need_cuda();
    CUresult (*real)(CUmemoryPool *, const CUmemPoolProps *) = GS_REAL(MemPoolCreate);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(pool, props);
    if (!gs_cfg.active || r != CUDA_SUCCESS || !pool || !props) return r;
    int dev = props->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? props->location.id : -1;
    pthread_mutex_lock(&pool_mu);
    add_locked(*pool, dev);
    pthread_mutex_unlock(&pool_mu);
    return r;
}

GS_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    gs_need_cuda();
    CUresult (*real)(CUmemoryPool) = GS_REAL(MemPoolDestroy);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    struct gs_pool *e = gs_cfg.active ? find(pool) : NULL;
    CUresult r = real(pool);
    if (!e || r != CUDA_SUCCESS) return r;
    /* its kept bytes go back now; bytes of blocks still allocated go back
     * when they are freed (gs_pool_keep sees `dead`) */
    atomic_store_explicit(&e->dead, 1, memory_order_release);
    uint64_t k = atomic_exchange(&e->kept, 0);
    if (k && e->ref) {
        atomic_store_explicit(&e->ref->freed, 1, memory_order_relaxed);
        gs_unreserve(e->ref, k);
    }
    for (int d = 0; d < GS_MAX_DEV; d++) {
        struct gs_pool *want = e;
        atomic_compare_exchange_strong(&cur_pool[d], &want, NULL);
    }
    return r;
}

GS_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    gs_need_cuda();
    CUresult (*real)(CUdevice, CUmemoryPool) = GS_REAL(DeviceSetMemPool);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(dev, pool);
    if (!gs_cfg.active || r != CUDA_SUCCESS || dev < 0 || dev >= GS_MAX_DEV) return r;
    pthread_mutex_lock(&pool_mu);
    struct gs_pool *e = add_locked(pool, dev);
    atomic_store_explicit(&cur_pool[dev], e, memory_order_release);
    pthread_mutex_unlock(&pool_mu);
    return r;
}
