/* alloc.c: accounting of every driver call that commits device memory.
 *
 * Pattern of each allocation: reserve in the slice's region (one CAS), call
 * the driver, roll the reservation back if the driver fails, record the
 * pointer in the O(1) table.  Frees take the pointer out of the table
 * *before* calling the driver (the driver may hand the same address to
 * another thread as soon as it returns) and put it back if the driver fails.
 *
 * Policies:
 * - cuMemAllocManaged counts its full size against the current device: the
 *   pages may all migrate there.
 * - cuMemCreate counts only CU_MEM_LOCATION_TYPE_DEVICE, on prop->location.id.
 *   The bytes are uncounted when the handle is released AND its last mapping
 *   is unmapped (cuMemRetainAllocationHandle adds a reference).
 * - Arrays are reserved from their descriptor, then corrected to what
 *   cu(Mipmapped)ArrayGetMemoryRequirements reports; sparse and
 *   deferred-mapping arrays commit nothing and are not counted.
 * - Pitched allocations are counted as the returned pitch x Height.
 * - Stream-ordered allocations are counted in their pool's device from
 *   cuMemAlloc(FromPool)Async; after cuMemFreeAsync their bytes stay counted
 *   as what the pool keeps, and serve the pool's next allocations (pools.c).
 */
#define _GNU_SOURCE
#include "gs.h"
#include "gs_api.h"

#define ACTIVE() GS_LIKELY(gs_cfg.active)

static inline struct gs_ref *cur_ref(void) { return gs_ref_of(gs_current_dev()); }

static void track(struct gs_table *t, uint64_t key, uint64_t size, uint64_t aux,
                  struct gs_ref *ref)
{
    if (GS_UNLIKELY(!gs_table_put(t, key, size, aux, ref))) {
        /* The table is full: the bytes stay counted (fail-safe) for good. */
        if (atomic_fetch_add(&gs_untracked_bytes, size) == 0)
            gs_warn("%s table full: some memory stays counted after it is freed", t->name);
    }
}

/* aux of a stream-ordered allocation: its kind and its pool's index */
#define ASYNC_AUX(pool_index) ((uint64_t)GS_K_ASYNC | ((uint64_t)(pool_index) << 8))

/* The bytes of a freed allocation: back to the slice, or, for a
 * stream-ordered one, to what its pool keeps. */
static void give_back(const struct gs_entry *e)
{
    atomic_store_explicit(&e->ref->freed, 1, memory_order_relaxed);
    if ((e->aux & 0xff) == GS_K_ASYNC) {
        struct gs_pool *pl = gs_pool_at((int)(e->aux >> 8));
        if (pl && pl->ref == e->ref) {
            gs_pool_keep(pl, e->size);
            return;
        }
    }
    gs_unreserve(e->ref, e->size);
}

/* Free-side helper: take key out, call the driver, restore on failure. */
#define FREE_TRACKED(table, key, call)                                   \
    do {                                                                 \
        struct gs_entry e_;                                              \
        int had_ = gs_table_take((table), (key), &e_);                   \
        CUresult r_ = (call);                                            \
        if (had_) {                                                      \
            if (r_ == CUDA_SUCCESS)                                      \
                give_back(&e_);                                          \
            else                                                         \
                gs_table_put((table), (key), e_.size, e_.aux, e_.ref);   \
        }                                                                \
        return r_;                                                       \
    } while (0)

/* A pointer counted as a stream-ordered allocation turned out to be a graph
 * allocation (captured cuMemAllocAsync): graphs.c counts the graph's pool
 * instead.  Its bytes go to the pool it was counted from: an over-count until
 * that pool is next measured, never an under-count. */
void gs_untrack_async(CUdeviceptr p)
{
    struct gs_entry e;
    if (!gs_table_take(&gs_allocs, p, &e)) return;
    if ((e.aux & 0xff) == GS_K_ASYNC) give_back(&e);
    else gs_table_put(&gs_allocs, p, e.size, e.aux, e.ref);
}

/* Correct a reservation made from an estimate to the size the driver used.
 * Returns 0 if the larger size does not fit: the caller undoes the call. */
static int settle(struct gs_ref *ref, uint64_t est, uint64_t actual)
{
    if (actual > est) return gs_reserve(ref, actual - est);
    if (actual < est) gs_unreserve(ref, est - actual);
    return 1;
}

/* ---- plain, pitched, managed ------------------------------------------ */
GS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    gs_need_cuda();
    CUresult (*real)(CUdeviceptr *, size_t) = GS_REAL(MemAlloc_v2);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !dptr || !bytesize) return real(dptr, bytesize);
    struct gs_ref *ref = cur_ref();
    if (GS_UNLIKELY(!ref)) return real(dptr, bytesize); /* no context: the driver says why */
    if (!gs_reserve(ref, bytesize)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, bytesize);
    if (r != CUDA_SUCCESS) {
        gs_unreserve(ref, bytesize);
        return r;
    }
    track(&gs_allocs, *dptr, bytesize, GS_K_MEM, ref);
    return r;
}

GS_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                      size_t Height, unsigned int ElementSizeBytes)
{
    gs_need_cuda();
    CUresult (*real)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int) =
        GS_REAL(MemAllocPitch_v2);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !dptr || !pPitch || !WidthInBytes || !Height)
        return real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    struct gs_ref *ref = cur_ref();
    if (GS_UNLIKELY(!ref)) return real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    /* estimate with a 512-byte pitch alignment, settle on the real pitch */
    uint64_t w = ((uint64_t)WidthInBytes + 511) & ~(uint64_t)511;
    if (w < WidthInBytes || (Height && w > UINT64_MAX / Height)) return CUDA_ERROR_INVALID_VALUE;
    uint64_t est = w * Height;
    if (!gs_reserve(ref, est)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (r != CUDA_SUCCESS) {
        gs_unreserve(ref, est);
        return r;
    }
    uint64_t actual = (uint64_t)*pPitch * Height;
    if (!settle(ref, est, actual)) {
        CUresult (*fr)(CUdeviceptr) = GS_REAL(MemFree_v2);
        if (fr) fr(*dptr);
        gs_unreserve(ref, est);
        *dptr = 0;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    track(&gs_allocs, *dptr, actual, GS_K_MEM, ref);
    return r;
}

GS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    gs_need_cuda();
    CUresult (*real)(CUdeviceptr *, size_t, unsigned int) = GS_REAL(MemAllocManaged);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !dptr || !bytesize) return real(dptr, bytesize, flags);
    struct gs_ref *ref = cur_ref();
    if (GS_UNLIKELY(!ref)) return real(dptr, bytesize, flags);
    if (!gs_reserve(ref, bytesize)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, bytesize, flags);
    if (r != CUDA_SUCCESS) {
        gs_unreserve(ref, bytesize);
        return r;
    }
    track(&gs_allocs, *dptr, bytesize, GS_K_MANAGED, ref);
    return r;
}

GS_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    gs_need_cuda();
    CUresult (*real)(CUdeviceptr) = GS_REAL(MemFree_v2);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !dptr) return real(dptr);
    FREE_TRACKED(&gs_allocs, dptr, real(dptr));
}

/* ---- stream-ordered ---------------------------------------------------- */
typedef CUresult (*pfn_alloc_async)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*pfn_alloc_pool)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*pfn_free_async)(CUdeviceptr, CUstream);

/* Reserve n for an allocation from pool pl (NULL: no pool entry, count on
 * ref): first from what the pool keeps, the rest in the region.  *kept gets
 * the part that came from the pool. */
static int async_reserve(struct gs_pool *pl, struct gs_ref *ref, uint64_t n, uint64_t *kept)
{
    uint64_t k = pl ? gs_pool_take(pl, n) : 0;
    if (k < n && !gs_reserve(ref, n - k)) {
        if (k) gs_pool_keep(pl, k);
        return 0;
    }
    *kept = k;
    return 1;
}

static void async_rollback(struct gs_pool *pl, struct gs_ref *ref, uint64_t n, uint64_t k)
{
    if (k) gs_pool_keep(pl, k);
    gs_unreserve(ref, n - k);
}

/* Near the limit, a stream-ordered allocation is checked after the driver
 * made it: what a pool commits is not exactly what was asked for (granules,
 * per-allocation driver memory), so the footprint is measured again (one
 * NVML query, ~30 us on an H100) and an allocation that took the slice over
 * its limit is undone and refused.  Only when the slice has less than
 * max(4 x n, limit / 32) free.  Returns 0 if it was undone. */
static int async_check(struct gs_ref *ref, CUdeviceptr p, uint64_t n)
{
    uint64_t lim = gs_cfg.limit, used = gs_used(ref);
    uint64_t near = n < lim / 128 ? lim / 32 : 4 * n;
    if (GS_LIKELY(used < lim && lim - used >= near)) return 1;
    gs_fp_refresh(ref);
    if (gs_used(ref) <= lim) return 1;
    struct gs_entry e;
    if (!gs_table_take(&gs_allocs, p, &e)) return 1;
    CUresult (*fr)(CUdeviceptr) = GS_REAL(MemFree_v2);
    if (!fr || fr(p) != CUDA_SUCCESS) { /* e.g. a captured address: keep it, counted */
        gs_table_put(&gs_allocs, p, e.size, e.aux, e.ref);
        return 1;
    }
    give_back(&e);
    gs_refused(ref);
    gs_pools_measure(ref, 1); /* the block went back to its pool: release it */
    gs_log("stream-ordered allocation of %llu bytes undone: the slice went over its limit",
           (unsigned long long)n);
    return 0;
}

static CUresult alloc_async(pfn_alloc_async real, CUdeviceptr *dptr, size_t n, CUstream s)
{
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !dptr || !n) return real(dptr, n, s);
    int dev = gs_current_dev();
    struct gs_ref *ref = gs_ref_of(dev);
    if (GS_UNLIKELY(!ref)) return real(dptr, n, s);
    struct gs_pool *pl = gs_pool_current(dev);
    if (pl && pl->ref != ref) pl = NULL;
    uint64_t k;
    if (!async_reserve(pl, ref, n, &k)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, n, s);
    if (r != CUDA_SUCCESS) {
        async_rollback(pl, ref, n, k);
        return r;
    }
    track(&gs_allocs, *dptr, n, ASYNC_AUX(gs_pool_index(pl)), ref);
    if (pl && k < n) gs_pool_settle(pl); /* the pool grew: maybe by more than n */
    if (GS_UNLIKELY(!async_check(ref, *dptr, n))) {
        *dptr = 0;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return r;
}

static CUresult alloc_pool(pfn_alloc_pool real, CUdeviceptr *dptr, size_t n, CUmemoryPool p,
                           CUstream s)
{
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !dptr || !n) return real(dptr, n, p, s);
    /* charged to the pool's device, not the current one */
    struct gs_pool *pl = p ? gs_pool_of(p) : NULL;
    struct gs_ref *ref = pl ? pl->ref : cur_ref();
    if (pl && !ref) return real(dptr, n, p, s); /* a pool in host memory */
    if (GS_UNLIKELY(!ref)) return real(dptr, n, p, s);
    uint64_t k;
    if (!async_reserve(pl, ref, n, &k)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, n, p, s);
    if (r != CUDA_SUCCESS) {
        async_rollback(pl, ref, n, k);
        return r;
    }
    track(&gs_allocs, *dptr, n, ASYNC_AUX(gs_pool_index(pl)), ref);
    if (pl && k < n) gs_pool_settle(pl); /* the pool grew: maybe by more than n */
    if (GS_UNLIKELY(!async_check(ref, *dptr, n))) {
        *dptr = 0;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return r;
}

static CUresult free_async(pfn_free_async real, CUdeviceptr dptr, CUstream s)
{
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !dptr) return real(dptr, s);
    FREE_TRACKED(&gs_allocs, dptr, real(dptr, s));
}

GS_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    gs_need_cuda();
    return alloc_async((pfn_alloc_async)GS_REAL(MemAllocAsync), dptr, bytesize, hStream);
}

GS_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    gs_need_cuda();
    return alloc_async((pfn_alloc_async)GS_REAL(MemAllocAsync_ptsz), dptr, bytesize, hStream);
}

GS_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                           CUstream hStream)
{
    gs_need_cuda();
    return alloc_pool((pfn_alloc_pool)GS_REAL(MemAllocFromPoolAsync), dptr, bytesize, pool,
                      hStream);
}

GS_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                                CUmemoryPool pool, CUstream hStream)
{
    gs_need_cuda();
    return alloc_pool((pfn_alloc_pool)GS_REAL(MemAllocFromPoolAsync_ptsz), dptr, bytesize, pool,
                      hStream);
}

GS_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    gs_need_cuda();
    return free_async((pfn_free_async)GS_REAL(MemFreeAsync), dptr, hStream);
}

GS_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    gs_need_cuda();
    return free_async((pfn_free_async)GS_REAL(MemFreeAsync_ptsz), dptr, hStream);
}

/* ---- virtual memory management ---------------------------------------- */
/* A handle entry's aux holds its references (low 32 bits) and mappings
 * (high 32 bits); the bytes go back when both reach zero. */
#define H_REF 1ULL
#define H_MAP (1ULL << 32)

GS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                               const CUmemAllocationProp *prop, unsigned long long flags)
{
    gs_need_cuda();
    CUresult (*real)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                     unsigned long long) = GS_REAL(MemCreate);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    /* host and host-NUMA locations (NCCL's probe, pinned host) are not device memory */
    if (!ACTIVE() || !handle || !prop || !size || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real(handle, size, prop, flags);
    struct gs_ref *ref = gs_ref_of(prop->location.id);
    if (GS_UNLIKELY(!ref)) return real(handle, size, prop, flags);
    if (!gs_reserve(ref, size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(handle, size, prop, flags);
    if (r != CUDA_SUCCESS) {
        gs_unreserve(ref, size);
        return r;
    }
    track(&gs_handles, *handle, size, H_REF, ref);
    return r;
}

/* Apply delta to a handle's counts; give its bytes back when both are 0. */
static void handle_adjust(CUmemGenericAllocationHandle h, int64_t dref, int64_t dmap)
{
    struct gs_ref *ref = NULL;
    uint64_t size = 0;
    gs_table_lock(&gs_handles);
    struct gs_entry *e = gs_table_get_locked(&gs_handles, h);
    if (e) {
        int64_t refs = (int64_t)(e->aux & 0xffffffffULL) + dref;
        int64_t maps = (int64_t)(e->aux >> 32) + dmap;
        if (refs < 0) refs = 0;
        if (maps < 0) maps = 0;
        if (refs == 0 && maps == 0) {
            ref = e->ref;
            size = e->size;
            gs_table_del_locked(&gs_handles, e);
        } else {
            e->aux = (uint64_t)refs | ((uint64_t)maps << 32);
        }
    }
    gs_table_unlock(&gs_handles);
    if (ref) {
        atomic_store_explicit(&ref->freed, 1, memory_order_relaxed);
        gs_unreserve(ref, size);
    }
}

GS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    gs_need_cuda();
    CUresult (*real)(CUmemGenericAllocationHandle) = GS_REAL(MemRelease);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(handle);
    if (ACTIVE() && r == CUDA_SUCCESS) handle_adjust(handle, -1, 0);
    return r;
}

GS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    gs_need_cuda();
    CUresult (*real)(CUmemGenericAllocationHandle *, void *) = GS_REAL(MemRetainAllocationHandle);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(handle, addr);
    if (ACTIVE() && r == CUDA_SUCCESS && handle) handle_adjust(*handle, +1, 0);
    return r;
}

GS_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                            CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    gs_need_cuda();
    CUresult (*real)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                     unsigned long long) = GS_REAL(MemMap);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(ptr, size, offset, handle, flags);
    if (!ACTIVE() || r != CUDA_SUCCESS) return r;
    gs_table_lock(&gs_handles);
    struct gs_entry *e = gs_table_get_locked(&gs_handles, handle);
    if (e) e->aux += H_MAP;
    gs_table_unlock(&gs_handles);
    /* only mappings of tracked handles are remembered */
    if (e) track(&gs_maps, ptr, size, handle, NULL);
    return r;
}

GS_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    gs_need_cuda();
    CUresult (*real)(CUdeviceptr, size_t) = GS_REAL(MemUnmap);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(ptr, size);
    if (!ACTIVE() || r != CUDA_SUCCESS) return r;
    /* the range may cover several consecutive mappings */
    uint64_t p = ptr, end = ptr + size;
    while (p < end) {
        struct gs_entry m;
        if (!gs_table_take(&gs_maps, p, &m) || !m.size) break;
        handle_adjust(m.aux, 0, -1);
        p += m.size;
    }
    return r;
}

/* ---- arrays ------------------------------------------------------------ */
#define GS_ARRAY3D_SPARSE 0x40
#define GS_ARRAY3D_DEFERRED_MAPPING 0x80

static uint64_t fmt_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    default: return 4; /* an estimate; settled from the driver's requirements */
    }
}

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    if (a && b > UINT64_MAX / a) return UINT64_MAX;
    return a * b;
}

static uint64_t array_estimate(size_t w, size_t h, size_t d, CUarray_format f, unsigned ch)
{
    uint64_t n = mul_sat(w ? w : 1, h ? h : 1);
    n = mul_sat(n, d ? d : 1);
    n = mul_sat(n, fmt_bytes(f));
    return mul_sat(n, ch ? ch : 1);
}

static CUresult array_finish(CUresult r, struct gs_ref *ref, uint64_t est, CUarray arr, int dev,
                             int kind)
{
    if (r != CUDA_SUCCESS) {
        gs_unreserve(ref, est);
        return r;
    }
    uint64_t actual = est;
    CUDA_ARRAY_MEMORY_REQUIREMENTS req = {0};
    if (kind == GS_K_ARRAY) {
        gs_pfn_ArrayGetMemoryRequirements f =
            (gs_pfn_ArrayGetMemoryRequirements)GS_REAL(ArrayGetMemoryRequirements);
        if (f && f(&req, arr, dev) == CUDA_SUCCESS && req.size) actual = req.size;
    } else {
        gs_pfn_MipmappedArrayGetMemoryRequirements f =
            (gs_pfn_MipmappedArrayGetMemoryRequirements)GS_REAL(MipmappedArrayGetMemoryRequirements);
        if (f && f(&req, (CUmipmappedArray)(void *)arr, dev) == CUDA_SUCCESS && req.size)
            actual = req.size;
    }
    if (!settle(ref, est, actual)) {
        if (kind == GS_K_ARRAY) {
            CUresult (*d)(CUarray) = GS_REAL(ArrayDestroy);
            if (d) d(arr);
        } else {
            CUresult (*d)(CUmipmappedArray) = GS_REAL(MipmappedArrayDestroy);
            if (d) d((CUmipmappedArray)(void *)arr);
        }
        gs_unreserve(ref, est);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    track(&gs_allocs, (uint64_t)(uintptr_t)arr, actual, (uint64_t)kind, ref);
    return r;
}

GS_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    gs_need_cuda();
    CUresult (*real)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *) = GS_REAL(ArrayCreate_v2);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !pHandle || !desc) return real(pHandle, desc);
    int dev = gs_current_dev();
    struct gs_ref *ref = gs_ref_of(dev);
    if (!ref) return real(pHandle, desc);
    uint64_t est = array_estimate(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels);
    if (!gs_reserve(ref, est)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(pHandle, desc);
    return array_finish(r, ref, est, r == CUDA_SUCCESS ? *pHandle : NULL, dev, GS_K_ARRAY);
}

GS_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    gs_need_cuda();
    CUresult (*real)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *) = GS_REAL(Array3DCreate_v2);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !pHandle || !desc ||
        (desc->Flags & (GS_ARRAY3D_SPARSE | GS_ARRAY3D_DEFERRED_MAPPING)))
        return real(pHandle, desc);
    int dev = gs_current_dev();
    struct gs_ref *ref = gs_ref_of(dev);
    if (!ref) return real(pHandle, desc);
    uint64_t est = array_estimate(desc->Width, desc->Height, desc->Depth, desc->Format,
                                  desc->NumChannels);
    if (!gs_reserve(ref, est)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(pHandle, desc);
    return array_finish(r, ref, est, r == CUDA_SUCCESS ? *pHandle : NULL, dev, GS_K_ARRAY);
}

GS_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                          const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                          unsigned int levels)
{
    gs_need_cuda();
    CUresult (*real)(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int) =
        GS_REAL(MipmappedArrayCreate);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !pHandle || !desc ||
        (desc->Flags & (GS_ARRAY3D_SPARSE | GS_ARRAY3D_DEFERRED_MAPPING)))
        return real(pHandle, desc, levels);
    int dev = gs_current_dev();
    struct gs_ref *ref = gs_ref_of(dev);
    if (!ref) return real(pHandle, desc, levels);
    uint64_t est = 0;
    size_t w = desc->Width, h = desc->Height, d = desc->Depth;
    for (unsigned i = 0; i < (levels ? levels : 1); i++) {
        uint64_t lvl = array_estimate(w, h, d, desc->Format, desc->NumChannels);
        est = est + lvl < est ? UINT64_MAX : est + lvl;
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        d = d > 1 ? d / 2 : d;
    }
    if (!gs_reserve(ref, est)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(pHandle, desc, levels);
    return array_finish(r, ref, est, r == CUDA_SUCCESS ? (CUarray)(void *)*pHandle : NULL, dev,
                        GS_K_MIPMAP);
}

GS_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    gs_need_cuda();
    CUresult (*real)(CUarray) = GS_REAL(ArrayDestroy);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !hArray) return real(hArray);
    FREE_TRACKED(&gs_allocs, (uint64_t)(uintptr_t)hArray, real(hArray));
}

GS_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    gs_need_cuda();
    CUresult (*real)(CUmipmappedArray) = GS_REAL(MipmappedArrayDestroy);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ACTIVE() || !h) return real(h);
    FREE_TRACKED(&gs_allocs, (uint64_t)(uintptr_t)h, real(h));
}
