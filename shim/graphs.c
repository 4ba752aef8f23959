/* graphs.c: the memory of CUDA graphs' allocation nodes.
 *
 * A graph allocation commits nothing when its node is made, whether by
 * cuGraphAddMemAllocNode or by capturing cuMemAllocAsync: the driver maps
 * physical memory from the device's graph memory pool when the graph is
 * launched (or uploaded), and that pool keeps it after the graph frees it,
 * until cuDeviceGraphMemTrim.  So what is counted is the graph pool itself:
 * the `graph` charge of a device is CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT.
 *
 * - Instantiation sums the graph's allocation nodes (bytes, devices) into a
 *   table keyed by the exec.  Captured cuMemAllocAsync pointers, which
 *   alloc.c counted as stream-ordered allocations, leave that count.
 * - Launching (or uploading) such an exec first reserves the part of its
 *   bytes the graph pool cannot serve from what it already holds; if that
 *   does not fit, the launch returns CUDA_ERROR_OUT_OF_MEMORY, as the driver
 *   itself does when graph memory runs out.  After the launch the charge is
 *   set to the pool's reservation and the provisional reservation dropped.
 * - cuDeviceGraphMemTrim, cuGraphExecDestroy, pressure (which trims) and
 *   every footprint refresh re-measure the pool.
 * Launches of graphs without allocation nodes cost one relaxed load.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>

#include "gs.h"
#include "gs_api.h"

static _Atomic int mem_execs; /* execs in gs_graphs */

typedef CUresult (*pfn_graph_attr)(CUdevice, CUgraphMem_attribute, void *);
typedef CUresult (*pfn_get_nodes)(CUgraph, CUgraphNode *, size_t *);
typedef CUresult (*pfn_node_type)(CUgraphNode, CUgraphNodeType *);
typedef CUresult (*pfn_alloc_params)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *);
typedef CUresult (*pfn_exec_stream)(CUgraphExec, CUstream);

static int graph_attr(int dev, CUgraphMem_attribute a, uint64_t *v)
{
    pfn_graph_attr f = (pfn_graph_attr)GS_REAL(DeviceGetGraphMemAttribute);
    cuuint64_t x = 0;
    if (!f || f(dev, a, &x) != CUDA_SUCCESS) return 0;
    *v = x;
    return 1;
}

/* Set ref's graph charge to what the device's graph pool reserves. */
void gs_graph_measure(struct gs_ref *ref, int trim)
{
    if (!ref || ref->cudev < 0) return;
    if (trim) {
        CUresult (*t)(CUdevice) = GS_REAL(DeviceGraphMemTrim);
        if (t && ref->graph) t(ref->cudev);
    }
    uint64_t res;
    if (graph_attr(ref->cudev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &res))
        gs_fp_set(ref, &ref->graph, res);
}

/* Sum a graph's allocation nodes: bytes, and a mask of their devices. */
static uint64_t alloc_nodes(CUgraph g, uint64_t *mask)
{
    pfn_get_nodes nodes = (pfn_get_nodes)GS_REAL(GraphGetNodes);
    pfn_node_type type = (pfn_node_type)GS_REAL(GraphNodeGetType);
    pfn_alloc_params params = (pfn_alloc_params)GS_REAL(GraphMemAllocNodeGetParams);
    *mask = 0;
    size_t n = 0;
    if (!nodes || !type || !params || nodes(g, NULL, &n) != CUDA_SUCCESS || !n) return 0;
    /* instantiation is not an allocation path: malloc is fine here */
    CUgraphNode *v = malloc(n * sizeof *v);
    if (!v) return 0;
    uint64_t bytes = 0;
    if (nodes(g, v, &n) == CUDA_SUCCESS) {
        for (size_t i = 0; i < n; i++) {
            CUgraphNodeType t;
            CUDA_MEM_ALLOC_NODE_PARAMS p;
            if (type(v[i], &t) != CUDA_SUCCESS || t != CU_GRAPH_NODE_TYPE_MEM_ALLOC) continue;
            if (params(v[i], &p) != CUDA_SUCCESS) continue;
            if (p.poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE) continue;
            int d = p.poolProps.location.id;
            if (d < 0 || d >= GS_MAX_DEV) continue;
            bytes += p.bytesize;
            *mask |= 1ULL << d;
            gs_untrack_async(p.dptr); /* captured: counted with the graph now */
        }
    }
    free(v);
    return bytes;
}

/* What the graph pool of dev holds beyond its live allocations. */
static uint64_t graph_spare(int dev)
{
    uint64_t res = 0, used = 0;
    if (!graph_attr(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &res) ||
        !graph_attr(dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used))
        return 0;
    return res > used ? res - used : 0;
}

/* Before a launch/upload: reserve what the graph pool of each device cannot
 * serve from its own reservation.  Returns 0 (nothing held) on refusal. */
static int provision(uint64_t bytes, uint64_t mask, uint64_t need[GS_MAX_DEV])
{
    for (int d = 0; d < GS_MAX_DEV; d++) {
        need[d] = 0;
        if (!(mask >> d & 1)) continue;
        struct gs_ref *ref = gs_ref_of(d);
        if (!ref) continue;
        /* a reservation under pressure may trim the graph pool: its spare
         * shrinks, so what is needed is computed again until it holds */
        for (;;) {
            uint64_t spare = graph_spare(d);
            uint64_t n = bytes > spare ? bytes - spare : 0;
            if (n <= need[d]) break;
            if (!gs_reserve(ref, n - need[d])) {
                for (int e = 0; e <= d; e++)
                    if (need[e]) gs_unreserve(gs_ref_of(e), need[e]);
                return 0;
            }
            need[d] = n;
        }
    }
    return 1;
}

/* After: the charge follows the pool, then the provisional part goes. */
static void settle(uint64_t mask, const uint64_t need[GS_MAX_DEV])
{
    for (int d = 0; d < GS_MAX_DEV; d++) {
        if (!(mask >> d & 1)) continue;
        struct gs_ref *ref = gs_ref_of(d);
        if (!ref) continue;
        gs_graph_measure(ref, 0);
        if (need[d]) gs_unreserve(ref, need[d]);
    }
}

static CUresult run(pfn_exec_stream real, CUgraphExec e, CUstream s)
{
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (GS_LIKELY(!atomic_load_explicit(&mem_execs, memory_order_relaxed)) || !gs_cfg.active)
        return real(e, s);
    gs_table_lock(&gs_graphs);
    struct gs_entry *x = gs_table_get_locked(&gs_graphs, (uint64_t)(uintptr_t)e);
    uint64_t bytes = x ? x->size : 0, mask = x ? x->aux : 0;
    gs_table_unlock(&gs_graphs);
    if (!bytes) return real(e, s);
    uint64_t need[GS_MAX_DEV];
    if (!provision(bytes, mask, need)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(e, s);
    settle(mask, need);
    return r;
}

/* Record exec if its graph allocates; upload: it commits now. */
static CUresult instantiated(CUresult r, CUgraphExec *pe, uint64_t bytes, uint64_t mask)
{
    if (r != CUDA_SUCCESS || !pe || !bytes) return r;
    if (gs_table_put(&gs_graphs, (uint64_t)(uintptr_t)*pe, bytes, mask, NULL))
        atomic_fetch_add(&mem_execs, 1);
    return r;
}

GS_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g,
                                               unsigned long long flags)
{
    gs_need_cuda();
    CUresult (*real)(CUgraphExec *, CUgraph, unsigned long long) =
        GS_REAL(GraphInstantiateWithFlags);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!gs_cfg.active) return real(pe, g, flags);
    uint64_t mask, bytes = alloc_nodes(g, &mask);
    return instantiated(real(pe, g, flags), pe, bytes, mask);
}

typedef CUresult (*pfn_inst_params)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);

static CUresult inst_params(pfn_inst_params real, CUgraphExec *pe, CUgraph g,
                            CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!gs_cfg.active) return real(pe, g, p);
    uint64_t mask, bytes = alloc_nodes(g, &mask);
    if (!bytes || !p || !(p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD))
        return instantiated(real(pe, g, p), pe, bytes, mask);
    /* instantiate-and-upload commits the graph's memory now */
    uint64_t need[GS_MAX_DEV];
    if (!provision(bytes, mask, need)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(pe, g, p);
    settle(mask, need);
    return instantiated(r, pe, bytes, mask);
}

GS_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *pe, CUgraph g,
                                                CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    gs_need_cuda();
    return inst_params((pfn_inst_params)GS_REAL(GraphInstantiateWithParams), pe, g, p);
}

GS_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *pe, CUgraph g,
                                                     CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    gs_need_cuda();
    return inst_params((pfn_inst_params)GS_REAL(GraphInstantiateWithParams_ptsz), pe, g, p);
}

GS_EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream s)
{
    gs_need_cuda();
    return run((pfn_exec_stream)GS_REAL(GraphLaunch), e, s);
}

GS_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream s)
{
    gs_need_cuda();
    return run((pfn_exec_stream)GS_REAL(GraphLaunch_ptsz), e, s);
}

GS_EXPORT CUresult cuGraphUpload(CUgraphExec e, CUstream s)
{
    gs_need_cuda();
    return run((pfn_exec_stream)GS_REAL(GraphUpload), e, s);
}

GS_EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream s)
{
    gs_need_cuda();
    return run((pfn_exec_stream)GS_REAL(GraphUpload_ptsz), e, s);
}

GS_EXPORT CUresult cuGraphExecDestroy(CUgraphExec e)
{
    gs_need_cuda();
    CUresult (*real)(CUgraphExec) = GS_REAL(GraphExecDestroy);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    if (!gs_cfg.active || !atomic_load_explicit(&mem_execs, memory_order_relaxed)) return real(e);
    struct gs_entry x;
    int had = gs_table_take(&gs_graphs, (uint64_t)(uintptr_t)e, &x);
    CUresult r = real(e);
    if (!had) return r;
    if (r != CUDA_SUCCESS) {
        gs_table_put(&gs_graphs, (uint64_t)(uintptr_t)e, x.size, x.aux, NULL);
        return r;
    }
    atomic_fetch_sub(&mem_execs, 1);
    for (int d = 0; d < GS_MAX_DEV; d++)
        if (x.aux >> d & 1) gs_graph_measure(gs_ref_of(d), 0);
    return r;
}

GS_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    gs_need_cuda();
    CUresult (*real)(CUdevice) = GS_REAL(DeviceGraphMemTrim);
    if (GS_UNLIKELY(!real)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(dev);
    if (gs_cfg.active && r == CUDA_SUCCESS && dev >= 0 && dev < GS_MAX_DEV && gs_dev_ref[dev])
        gs_graph_measure(gs_dev_ref[dev], 0);
    return r;
}

/* the child has none of the parent's graph execs */
static void atfork_child(void) { atomic_store(&mem_execs, 0); }

__attribute__((constructor(GS_INIT_MODULE))) static void graphs_init(void)
{
    if (gs_cfg.active) pthread_atfork(NULL, NULL, atfork_child);
}
