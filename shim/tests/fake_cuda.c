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
 * calling thread's current device.
 *
 * For the footprint rules it also models, per device: a primary context that
 * takes FAKE_CTX_BYTES when first retained (fake_grow_context() adds more, as
 * lazily loaded modules do); stream-ordered pools (a default pool per device,
 * cuMemPoolCreate, a release threshold: freed bytes stay reserved until a
 * synchronisation releases what exceeds it, or cuMemPoolTrimTo); graphs with
 * allocation and free nodes, built directly or by stream capture, whose memory
 * comes from a per-device graph pool at launch and stays there until
 * cuDeviceGraphMemTrim.  fake_dev_used(d) is what NVML would report for this
 * process on device d (fake_nvml.c reads it). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
static _Atomic uint64_t dev_used[8];  /* this process's footprint per device */
static _Atomic uint32_t next_k;
static uint64_t *rec_size;       /* size of pointer k, 0 = free */
static unsigned char *rec_dev;   /* device of pointer k */
static unsigned char *rec_pool;  /* pool of pointer k (index + 1), 0 = none */
static int *rec_owner;           /* pid that allocated pointer k */
static uint64_t ctx_bytes;
static uint64_t pool_granule;
static uint64_t pool_hidden; /* FAKE_POOL_HIDDEN: driver memory per pool allocation, in no pool figure */
static __thread int cur_dev;
static const char *_Atomic last;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static int ctx_refs[8];
static int my_pid; /* getpid() is a system call: cached, reset in the child */
/* A forked child holds no device memory of its parent (NVML does not list it
 * with the parent's bytes), and has no context. */
static void fake_atfork_child(void)
{
    my_pid = (int)getpid();
    for (int d = 0; d < 8; d++) {
        atomic_store(&dev_used[d], 0);
        ctx_refs[d] = 0;
    }
}

__attribute__((constructor)) static void fake_init(void)
{
    const char *v;
    if ((v = getenv("FAKE_TOTAL"))) phys_total = strtoull(v, NULL, 0);
    if ((v = getenv("FAKE_PITCH_ALIGN"))) pitch_align = strtoull(v, NULL, 0);
    if ((v = getenv("FAKE_NDEV"))) ndev = atoi(v);
    internal_ptrs = getenv("FAKE_PROCADDR_INTERNAL") != NULL;
    if ((v = getenv("FAKE_CTX_BYTES"))) ctx_bytes = strtoull(v, NULL, 0);
    if ((v = getenv("FAKE_POOL_GRANULE"))) pool_granule = strtoull(v, NULL, 0);
    if ((v = getenv("FAKE_POOL_HIDDEN"))) pool_hidden = strtoull(v, NULL, 0);
    rec_size = calloc(MAXREC, sizeof *rec_size);
    rec_dev = calloc(MAXREC, 1);
    rec_pool = calloc(MAXREC, 1);
    rec_owner = calloc(MAXREC, sizeof *rec_owner);
    my_pid = (int)getpid();
    pthread_atfork(NULL, NULL, fake_atfork_child);
}

EXPORT const char *fake_last(void) { return last; }
EXPORT void fake_set_device(int d) { cur_dev = d; }
EXPORT uint64_t fake_phys_used(void) { return phys_used; }
EXPORT uint64_t fake_dev_used(int d) { return d >= 0 && d < 8 ? dev_used[d] : 0; }

static int dev_now(void) { return cur_dev >= 0 && cur_dev < 8 ? cur_dev : 0; }

static int take_on(uint64_t n, int dev)
{
    uint64_t cur = atomic_load(&phys_used);
    do {
        if (n > phys_total || cur > phys_total - n) return 0;
    } while (!atomic_compare_exchange_weak(&phys_used, &cur, cur + n));
    atomic_fetch_add(&dev_used[dev & 7], n);
    return 1;
}
static int take(uint64_t n) { return take_on(n, dev_now()); }
static void give_on(uint64_t n, int dev)
{
    atomic_fetch_sub(&phys_used, n);
    atomic_fetch_sub(&dev_used[dev & 7], n);
}

static CUresult record(CUdeviceptr *p, uint64_t n, int dev, int pool)
{
    uint32_t k = atomic_fetch_add(&next_k, 1);
    if (k >= MAXREC) return CUDA_ERROR_OUT_OF_MEMORY;
    rec_dev[k] = (unsigned char)dev;
    rec_pool[k] = (unsigned char)pool;
    rec_owner[k] = my_pid;
    __atomic_store_n(&rec_size[k], n, __ATOMIC_RELEASE);
    *p = (CUdeviceptr)(k + 1) << STRIDE_SHIFT;
    return CUDA_SUCCESS;
}

static CUresult new_ptr(CUdeviceptr *p, uint64_t n)
{
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    if (!take(n)) return CUDA_ERROR_OUT_OF_MEMORY;
    return record(p, n, dev_now(), 0);
}

static void pool_free(int pool, uint64_t n);
static int graph_va_free(CUdeviceptr p);

static CUresult free_ptr(CUdeviceptr p)
{
    if (graph_va_free(p)) return CUDA_SUCCESS;
    uint64_t k = (p >> STRIDE_SHIFT) - 1;
    if (!p || (p & ((1ULL << STRIDE_SHIFT) - 1)) || k >= MAXREC) return CUDA_ERROR_INVALID_VALUE;
    uint64_t n = __atomic_exchange_n(&rec_size[k], 0, __ATOMIC_ACQ_REL);
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    if (rec_pool[k]) pool_free(rec_pool[k] - 1, n); /* back to its pool, still reserved */
    else if (rec_owner[k] == my_pid) give_on(n, rec_dev[k]);
    else atomic_fetch_sub(&phys_used, n); /* the parent's block, freed by a forked child */
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

/* ---- primary contexts -------------------------------------------------- */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
    CALLED("cuDevicePrimaryCtxRetain");
    if (d < 0 || d >= ndev || !c) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    int ok = ctx_refs[d] > 0 || take_on(ctx_bytes, d);
    if (ok) ctx_refs[d]++;
    pthread_mutex_unlock(&mu);
    if (!ok) return CUDA_ERROR_OUT_OF_MEMORY;
    *c = (CUcontext)(uintptr_t)(0xC0 + d);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int *flags, int *active)
{
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    *flags = 0;
    *active = ctx_refs[d] > 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    if (d < 0 || d >= ndev || ctx_refs[d] <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    if (--ctx_refs[d] == 0) give_on(ctx_bytes, d);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
/* what lazily loaded modules do to a context after it is made, and undo */
EXPORT int fake_grow_context(int d, uint64_t n) { return take_on(n, d); }
EXPORT void fake_shrink_context(int d, uint64_t n) { give_on(n, d); }

/* ---- stream-ordered pools ---------------------------------------------- */
#define MAXPOOL 32
static struct fpool { int live, dev, host; uint64_t reserved, used, threshold; } fpools[MAXPOOL];
static int npool, cur_pool_of[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
static CUmemoryPool pool_handle(int i) { return (CUmemoryPool)(uintptr_t)(0xD000 + i); }
static int pool_index(CUmemoryPool h)
{
    uintptr_t v = (uintptr_t)h;
    int i = (int)(v - 0xD000);
    return v >= 0xD000 && i < npool && fpools[i].live ? i : -1;
}
static int new_pool(int dev, int host)
{
    if (npool == MAXPOOL) return -1;
    int i = npool++;
    fpools[i] = (struct fpool){.live = 1, .dev = dev, .host = host};
    return i;
}
static int default_pool(int dev) /* mu held */
{
    static int dflt[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
    if (dflt[dev] < 0) dflt[dev] = new_pool(dev, 0);
    if (cur_pool_of[dev] < 0) cur_pool_of[dev] = dflt[dev];
    return dflt[dev];
}
/* mu held: release what the pool holds beyond its allocations and keep */
static void pool_shrink(struct fpool *f, uint64_t keep)
{
    uint64_t spare = f->reserved - f->used;
    if (spare <= keep) return;
    f->reserved -= spare - keep;
    if (!f->host) give_on(spare - keep, f->dev);
}
/* FAKE_POOL_GRANULE: pools grow in such steps (default 1 byte) */
static CUresult pool_alloc(int i, CUdeviceptr *p, uint64_t n)
{
    if (!p || !n) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct fpool *f = &fpools[i];
    uint64_t spare = f->reserved - f->used, grow = n > spare ? n - spare : 0;
    if (pool_granule > 1) grow = (grow + pool_granule - 1) / pool_granule * pool_granule;
    int ok = !grow || f->host || take_on(grow, f->dev);
    if (ok && pool_hidden && !f->host && !take_on(pool_hidden, f->dev)) {
        if (grow) give_on(grow, f->dev);
        ok = 0;
    }
    if (ok) {
        f->reserved += grow;
        f->used += n;
    }
    pthread_mutex_unlock(&mu);
    if (!ok) return CUDA_ERROR_OUT_OF_MEMORY;
    return record(p, n, f->dev, i + 1);
}
static void pool_free(int i, uint64_t n)
{
    pthread_mutex_lock(&mu);
    fpools[i].used -= n;
    if (pool_hidden && !fpools[i].host) give_on(pool_hidden, fpools[i].dev);
    pthread_mutex_unlock(&mu);
}
/* a synchronisation: every pool gives back what exceeds its threshold */
static void sync_pools(void)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < npool; i++)
        if (fpools[i].live) pool_shrink(&fpools[i], fpools[i].threshold);
    pthread_mutex_unlock(&mu);
}
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *p, CUdevice d)
{
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    *p = pool_handle(default_pool(d));
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *p, CUdevice d)
{
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    default_pool(d);
    *p = pool_handle(cur_pool_of[d]);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceSetMemPool(CUdevice d, CUmemoryPool p)
{
    CALLED("cuDeviceSetMemPool");
    int i = pool_index(p);
    if (d < 0 || d >= ndev || i < 0 || fpools[i].dev != d) return CUDA_ERROR_INVALID_VALUE;
    cur_pool_of[d] = i;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolCreate(CUmemoryPool *p, const CUmemPoolProps *props)
{
    CALLED("cuMemPoolCreate");
    if (!p || !props) return CUDA_ERROR_INVALID_VALUE;
    int host = props->location.type != CU_MEM_LOCATION_TYPE_DEVICE;
    int dev = host ? 0 : props->location.id;
    if (!host && (dev < 0 || dev >= ndev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    int i = new_pool(dev, host);
    pthread_mutex_unlock(&mu);
    if (i < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *p = pool_handle(i);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolDestroy(CUmemoryPool p)
{
    CALLED("cuMemPoolDestroy");
    int i = pool_index(p);
    if (i < 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    pool_shrink(&fpools[i], 0); /* blocks still allocated go when freed */
    fpools[i].threshold = 0;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool p, size_t keep)
{
    CALLED("cuMemPoolTrimTo");
    int i = pool_index(p);
    if (i < 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    pool_shrink(&fpools[i], keep);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool p, CUmemPool_attribute a, void *v)
{
    int i = pool_index(p);
    if (i < 0 || !v) return CUDA_ERROR_INVALID_VALUE;
    cuuint64_t *x = v;
    switch (a) {
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *x = fpools[i].reserved; return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *x = fpools[i].used; return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *x = fpools[i].threshold; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}
EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool p, CUmemPool_attribute a, void *v)
{
    int i = pool_index(p);
    if (i < 0 || !v || a != CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) return CUDA_ERROR_INVALID_VALUE;
    fpools[i].threshold = *(cuuint64_t *)v;
    return CUDA_SUCCESS;
}

/* ---- graphs --------------------------------------------------------------
 * Graph VAs live at GVA + (g << 32) + (n << 24): graph g, node n. */
#define MAXG 16
#define MAXN 32
#define GVA 0x600000000000ULL
struct fnode { int type, dev, live; uint64_t size; CUdeviceptr dptr; };
static struct fgraph { int used; int n; struct fnode nodes[MAXN]; } fgraphs[MAXG];
static int fexec_graph[MAXG * 4], nexec;
static uint64_t gp_reserved[8], gp_used[8];
static struct { CUstream s; int g; } captures[8];

static int graph_new(void)
{
    for (int i = 0; i < MAXG; i++)
        if (!fgraphs[i].used) {
            memset(&fgraphs[i], 0, sizeof fgraphs[i]);
            fgraphs[i].used = 1;
            return i;
        }
    return -1;
}
static int graph_index(CUgraph g)
{
    uintptr_t v = (uintptr_t)g;
    return v >= 0xF000 && v < 0xF000 + MAXG && fgraphs[v - 0xF000].used ? (int)(v - 0xF000) : -1;
}
static struct fnode *add_node(int g, int type, CUgraphNode *out)
{
    struct fgraph *G = &fgraphs[g];
    if (G->n == MAXN) return NULL;
    struct fnode *n = &G->nodes[G->n];
    memset(n, 0, sizeof *n);
    n->type = type;
    if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        n->dptr = GVA + ((uint64_t)g << 32) + ((uint64_t)G->n << 24);
    if (out) *out = (CUgraphNode)(uintptr_t)(((uintptr_t)g << 16) | (uintptr_t)(G->n + 1));
    G->n++;
    return n;
}
static struct fnode *node_of(CUgraphNode h)
{
    uintptr_t v = (uintptr_t)h;
    int g = (int)(v >> 16), i = (int)(v & 0xffff) - 1;
    if (g < 0 || g >= MAXG || !fgraphs[g].used || i < 0 || i >= fgraphs[g].n) return NULL;
    return &fgraphs[g].nodes[i];
}
static struct fnode *graph_alloc_of(CUdeviceptr p)
{
    if (p < GVA || p >= GVA + ((uint64_t)MAXG << 32)) return NULL;
    int g = (int)((p - GVA) >> 32);
    for (int i = 0; i < fgraphs[g].n; i++)
        if (fgraphs[g].nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && fgraphs[g].nodes[i].dptr == p)
            return &fgraphs[g].nodes[i];
    return NULL;
}
/* mu held */
static void gfree(struct fnode *a)
{
    if (a && a->live) {
        a->live = 0;
        gp_used[a->dev] -= a->size; /* back to the graph pool, still reserved */
    }
}
static int graph_va_free(CUdeviceptr p)
{
    struct fnode *a = graph_alloc_of(p);
    if (!a) return 0;
    pthread_mutex_lock(&mu);
    gfree(a);
    pthread_mutex_unlock(&mu);
    return 1;
}
static int capture_of(CUstream s)
{
    for (int i = 0; i < 8; i++)
        if (captures[i].s == s && captures[i].g >= 0 && s) return captures[i].g;
    return -1;
}

EXPORT CUresult cuGraphCreate(CUgraph *g, unsigned int flags)
{
    (void)flags;
    int i = graph_new();
    if (i < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *g = (CUgraph)(uintptr_t)(0xF000 + i);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *out, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                       CUDA_MEM_ALLOC_NODE_PARAMS *prm)
{
    (void)deps; (void)ndeps;
    int i = graph_index(g);
    if (i < 0 || !prm || !prm->bytesize) return CUDA_ERROR_INVALID_VALUE;
    struct fnode *n = add_node(i, CU_GRAPH_NODE_TYPE_MEM_ALLOC, out);
    if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
    n->size = prm->bytesize;
    n->dev = prm->poolProps.location.id;
    prm->dptr = n->dptr;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *out, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                      CUdeviceptr dptr)
{
    (void)deps; (void)ndeps;
    int i = graph_index(g);
    if (i < 0) return CUDA_ERROR_INVALID_VALUE;
    struct fnode *n = add_node(i, CU_GRAPH_NODE_TYPE_MEM_FREE, out);
    if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
    n->dptr = dptr;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddEmptyNode(CUgraphNode *out, CUgraph g, const CUgraphNode *deps, size_t ndeps)
{
    (void)deps; (void)ndeps;
    int i = graph_index(g);
    return i >= 0 && add_node(i, 5, out) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *n)
{
    int i = graph_index(g);
    if (i < 0 || !n) return CUDA_ERROR_INVALID_VALUE;
    if (nodes)
        for (int k = 0; k < fgraphs[i].n && (size_t)k < *n; k++)
            nodes[k] = (CUgraphNode)(uintptr_t)(((uintptr_t)i << 16) | (uintptr_t)(k + 1));
    *n = (size_t)fgraphs[i].n;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphNodeGetType(CUgraphNode h, CUgraphNodeType *t)
{
    struct fnode *n = node_of(h);
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *t = (CUgraphNodeType)n->type;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphMemAllocNodeGetParams(CUgraphNode h, CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    struct fnode *n = node_of(h);
    if (!n || n->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) return CUDA_ERROR_INVALID_VALUE;
    memset(p, 0, sizeof *p);
    p->poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p->poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p->poolProps.location.id = n->dev;
    p->bytesize = n->size;
    p->dptr = n->dptr;
    return CUDA_SUCCESS;
}
static CUresult instantiate(CUgraphExec *e, CUgraph g)
{
    int i = graph_index(g);
    if (i < 0 || !e || nexec == MAXG * 4) return CUDA_ERROR_INVALID_VALUE;
    fexec_graph[nexec] = i;
    *e = (CUgraphExec)(uintptr_t)(0xA000 + nexec++);
    return CUDA_SUCCESS;
}
static int exec_graph(CUgraphExec e)
{
    uintptr_t v = (uintptr_t)e;
    int i = (int)(v - 0xA000);
    return v >= 0xA000 && i < nexec && fexec_graph[i] >= 0 ? fexec_graph[i] : -1;
}
/* commit the allocations (launch and upload), then run the frees (launch) */
static CUresult graph_run(int g, int frees)
{
    struct fgraph *G = &fgraphs[g];
    pthread_mutex_lock(&mu);
    uint64_t need[8] = {0};
    for (int i = 0; i < G->n; i++)
        if (G->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && !G->nodes[i].live)
            need[G->nodes[i].dev & 7] += G->nodes[i].size;
    for (int d = 0; d < 8; d++) {
        uint64_t spare = gp_reserved[d] - gp_used[d];
        uint64_t grow = need[d] > spare ? need[d] - spare : 0;
        if (grow && !take_on(grow, d)) {
            pthread_mutex_unlock(&mu);
            return CUDA_ERROR_OUT_OF_MEMORY; /* the driver's own answer */
        }
        gp_reserved[d] += grow;
    }
    for (int i = 0; i < G->n; i++) {
        struct fnode *n = &G->nodes[i];
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && !n->live) {
            n->live = 1;
            gp_used[n->dev & 7] += n->size;
        }
    }
    if (frees)
        for (int i = 0; i < G->n; i++)
            if (G->nodes[i].type == CU_GRAPH_NODE_TYPE_MEM_FREE) gfree(graph_alloc_of(G->nodes[i].dptr));
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long f)
{
    (void)f;
    CALLED("cuGraphInstantiateWithFlags");
    return instantiate(e, g);
}
static CUresult inst_params(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    CUresult r = instantiate(e, g);
    if (r == CUDA_SUCCESS && p && (p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD)) {
        r = graph_run(exec_graph(*e), 0);
        p->result_out = r;
    }
    return r;
}
EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    CALLED("cuGraphInstantiateWithParams");
    return inst_params(e, g, p);
}
EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    CALLED("cuGraphInstantiateWithParams_ptsz");
    return inst_params(e, g, p);
}
/* the pre-12.0 ABIs of cuGraphInstantiate, which the shim leaves alone */
EXPORT CUresult cuGraphInstantiate(CUgraphExec *e, CUgraph g, CUgraphNode *en, char *log, size_t n)
{
    (void)en; (void)log; (void)n;
    CALLED("cuGraphInstantiate");
    return instantiate(e, g);
}
EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *e, CUgraph g, CUgraphNode *en, char *log, size_t n)
{
    (void)en; (void)log; (void)n;
    CALLED("cuGraphInstantiate_v2");
    return instantiate(e, g);
}
static CUresult launch(CUgraphExec e, int frees)
{
    int g = exec_graph(e);
    return g < 0 ? CUDA_ERROR_INVALID_VALUE : graph_run(g, frees);
}
EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream s) { (void)s; CALLED("cuGraphLaunch"); return launch(e, 1); }
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream s) { (void)s; CALLED("cuGraphLaunch_ptsz"); return launch(e, 1); }
EXPORT CUresult cuGraphUpload(CUgraphExec e, CUstream s) { (void)s; CALLED("cuGraphUpload"); return launch(e, 0); }
EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream s) { (void)s; CALLED("cuGraphUpload_ptsz"); return launch(e, 0); }
EXPORT CUresult cuGraphExecDestroy(CUgraphExec e)
{
    CALLED("cuGraphExecDestroy");
    int g = exec_graph(e);
    if (g < 0) return CUDA_ERROR_INVALID_VALUE;
    fexec_graph[(uintptr_t)e - 0xA000] = -1;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice d, CUgraphMem_attribute a, void *v)
{
    if (d < 0 || d >= ndev || !v) return CUDA_ERROR_INVALID_DEVICE;
    cuuint64_t *x = v;
    if (a == CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT) *x = gp_reserved[d];
    else if (a == CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT) *x = gp_used[d];
    else return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGraphMemTrim(CUdevice d)
{
    CALLED("cuDeviceGraphMemTrim");
    if (d < 0 || d >= ndev) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    give_on(gp_reserved[d] - gp_used[d], d);
    gp_reserved[d] = gp_used[d];
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, int mode)
{
    (void)mode;
    for (int i = 0; i < 8; i++)
        if (!captures[i].s) {
            int g = graph_new();
            if (g < 0) return CUDA_ERROR_OUT_OF_MEMORY;
            captures[i].s = s;
            captures[i].g = g;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_OUT_OF_MEMORY;
}
EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *g)
{
    for (int i = 0; i < 8; i++)
        if (captures[i].s == s && s) {
            *g = (CUgraph)(uintptr_t)(0xF000 + captures[i].g);
            captures[i].s = NULL;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_VALUE;
}

/* stream-ordered: on a capturing stream they become graph nodes */
static CUresult alloc_on(CUstream s, int pool, CUdeviceptr *p, size_t n)
{
    int g = capture_of(s);
    if (g >= 0) {
        struct fnode *a = add_node(g, CU_GRAPH_NODE_TYPE_MEM_ALLOC, NULL);
        if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
        a->size = n;
        a->dev = fpools[pool].dev;
        *p = a->dptr; /* an address only: memory comes at launch */
        return CUDA_SUCCESS;
    }
    return pool_alloc(pool, p, n);
}
static CUresult free_on(CUstream s, CUdeviceptr p)
{
    int g = capture_of(s);
    if (g >= 0) {
        struct fnode *f = add_node(g, CU_GRAPH_NODE_TYPE_MEM_FREE, NULL);
        if (!f) return CUDA_ERROR_OUT_OF_MEMORY;
        f->dptr = p;
        return CUDA_SUCCESS;
    }
    return free_ptr(p);
}
static int cur_pool(void)
{
    pthread_mutex_lock(&mu);
    default_pool(dev_now());
    int i = cur_pool_of[dev_now()];
    pthread_mutex_unlock(&mu);
    return i;
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { CALLED("cuMemAllocAsync"); return alloc_on(s, cur_pool(), p, n); }
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { CALLED("cuMemAllocAsync_ptsz"); return alloc_on(s, cur_pool(), p, n); }
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool m, CUstream s)
{
    CALLED("cuMemAllocFromPoolAsync");
    int i = pool_index(m);
    return i < 0 ? CUDA_ERROR_INVALID_VALUE : alloc_on(s, i, p, n);
}
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool m, CUstream s)
{
    CALLED("cuMemAllocFromPoolAsync_ptsz");
    int i = pool_index(m);
    return i < 0 ? CUDA_ERROR_INVALID_VALUE : alloc_on(s, i, p, n);
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { CALLED("cuMemFreeAsync"); return free_on(s, p); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { CALLED("cuMemFreeAsync_ptsz"); return free_on(s, p); }

/* VMM: memory lives until the handle is released and its last mapping gone */
#define MAXH 4096
static struct { uint64_t size; int refs; int maps; int live; int device; int dev; } hs[MAXH];
static struct { CUdeviceptr va; size_t size; uint64_t h; } ms[MAXH];
static int nh = 1;

static void h_maybe_free(uint64_t h)
{
    if (hs[h].live && hs[h].refs == 0 && hs[h].maps == 0) {
        hs[h].live = 0;
        if (hs[h].device) give_on(hs[h].size, hs[h].dev);
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
    if (device && !take_on(n, p->location.id)) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    int i = nh < MAXH ? nh++ : 0;
    if (i) {
        hs[i].size = n; hs[i].refs = 1; hs[i].maps = 0; hs[i].live = 1; hs[i].device = device;
        hs[i].dev = device ? p->location.id : 0;
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

/* ---- modules and libraries ---------------------------------------------
 * An image is the text "fakemod:<bytes>": the device memory its globals take.
 * A module commits it when loaded; a library (as the real driver does under
 * CUDA_MODULE_LOADING=LAZY) only when loaded into the context, by
 * cuLibraryGetModule, or at once with FAKE_LIBRARY_EAGER. */
#define MAXMOD 64
static struct { int live, lib, loaded, dev; uint64_t size; } mods[MAXMOD];
static int image_bytes(const void *image, uint64_t *n)
{
    const char *s = image;
    if (!s || strncmp(s, "fakemod:", 8)) return 0;
    *n = strtoull(s + 8, NULL, 10);
    return 1;
}
static int mod_new(const void *image, int lib)
{
    uint64_t n;
    if (!image_bytes(image, &n)) return -1;
    pthread_mutex_lock(&mu);
    int i = 1;
    while (i < MAXMOD && mods[i].live) i++;
    int ok = i < MAXMOD;
    int commit = !lib || getenv("FAKE_LIBRARY_EAGER");
    if (ok && commit && !take(n)) ok = 0;
    if (ok) {
        mods[i].live = 1;
        mods[i].lib = lib;
        mods[i].loaded = commit;
        mods[i].dev = dev_now();
        mods[i].size = n;
    }
    pthread_mutex_unlock(&mu);
    return ok ? i : -2;
}
static int mod_index(const void *h, int lib)
{
    uintptr_t i = (uintptr_t)h - (lib ? 0xB000 : 0xA000);
    return i > 0 && i < MAXMOD && mods[i].live && mods[i].lib == lib ? (int)i : 0;
}
static CUresult mod_drop(const void *h, int lib)
{
    pthread_mutex_lock(&mu);
    int i = mod_index(h, lib);
    if (i && mods[i].loaded) give_on(mods[i].size, mods[i].dev);
    if (i) mods[i].live = 0;
    pthread_mutex_unlock(&mu);
    return i ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
static CUresult mod_result(int i, void **out, int lib)
{
    if (i == -1) return CUDA_ERROR_INVALID_VALUE;
    if (i < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *out = (void *)(uintptr_t)((lib ? 0xB000 : 0xA000) + i);
    return CUDA_SUCCESS;
}
static char file_image[64];
static const void *read_image(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    size_t n = fread(file_image, 1, sizeof file_image - 1, f);
    fclose(f);
    file_image[n] = 0;
    return file_image;
}
EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image)
{
    CALLED("cuModuleLoadData");
    return m ? mod_result(mod_new(image, 0), (void **)m, 0) : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned n, CUjit_option *o, void **v)
{
    (void)n; (void)o; (void)v;
    CALLED("cuModuleLoadDataEx");
    return m ? mod_result(mod_new(image, 0), (void **)m, 0) : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *image)
{
    CALLED("cuModuleLoadFatBinary");
    return m ? mod_result(mod_new(image, 0), (void **)m, 0) : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuModuleLoad(CUmodule *m, const char *path)
{
    CALLED("cuModuleLoad");
    const void *image = read_image(path);
    if (!image) return CUDA_ERROR_NOT_FOUND;
    return m ? mod_result(mod_new(image, 0), (void **)m, 0) : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuModuleUnload(CUmodule m) { CALLED("cuModuleUnload"); return mod_drop(m, 0); }
EXPORT CUresult cuLibraryLoadData(CUlibrary *l, const void *code, CUjit_option *jo, void **jv, unsigned jn,
                                  CUlibraryOption *lo, void **lv, unsigned ln)
{
    (void)jo; (void)jv; (void)jn; (void)lo; (void)lv; (void)ln;
    CALLED("cuLibraryLoadData");
    return l ? mod_result(mod_new(code, 1), (void **)l, 1) : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *l, const char *path, CUjit_option *jo, void **jv, unsigned jn,
                                      CUlibraryOption *lo, void **lv, unsigned ln)
{
    (void)jo; (void)jv; (void)jn; (void)lo; (void)lv; (void)ln;
    CALLED("cuLibraryLoadFromFile");
    const void *image = read_image(path);
    if (!image) return CUDA_ERROR_NOT_FOUND;
    return l ? mod_result(mod_new(image, 1), (void **)l, 1) : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuLibraryGetModule(CUmodule *m, CUlibrary l)
{
    pthread_mutex_lock(&mu);
    int i = mod_index(l, 1);
    int ok = i && (mods[i].loaded || take(mods[i].size));
    if (ok) mods[i].loaded = 1;
    pthread_mutex_unlock(&mu);
    if (!i) return CUDA_ERROR_INVALID_HANDLE;
    if (!ok) return CUDA_ERROR_OUT_OF_MEMORY;
    *m = (CUmodule)(uintptr_t)(0xC000 + i);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLibraryUnload(CUlibrary l) { CALLED("cuLibraryUnload"); return mod_drop(l, 1); }
/* what the fake's device holds for loaded code, for the tests */
EXPORT uint64_t fake_module_bytes(void)
{
    uint64_t n = 0;
    for (int i = 1; i < MAXMOD; i++)
        if (mods[i].live && mods[i].loaded) n += mods[i].size;
    return n;
}

/* entry points the shim must leave alone */
EXPORT CUresult cuMemAlloc(unsigned int *p, unsigned int n) { (void)p; (void)n; CALLED("cuMemAlloc"); return CUDA_ERROR_NOT_SUPPORTED; }
EXPORT CUresult cuMemGetInfo(unsigned int *f, unsigned int *t) { *f = *t = 0; return CUDA_SUCCESS; }
EXPORT CUresult cuStreamSynchronize(CUstream s) { (void)s; CALLED("cuStreamSynchronize"); sync_pools(); return CUDA_SUCCESS; }
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
    {"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", 7000, 0},
    {"cuDevicePrimaryCtxGetState", "cuDevicePrimaryCtxGetState", 7000, 0},
    {"cuMemPoolCreate", "cuMemPoolCreate", 11020, 0},
    {"cuMemPoolDestroy", "cuMemPoolDestroy", 11020, 0},
    {"cuMemPoolTrimTo", "cuMemPoolTrimTo", 11020, 0},
    {"cuDeviceSetMemPool", "cuDeviceSetMemPool", 11020, 0},
    {"cuDeviceGetMemPool", "cuDeviceGetMemPool", 11020, 0},
    {"cuGraphInstantiate", "cuGraphInstantiate", 10000, 0},
    {"cuGraphInstantiate", "cuGraphInstantiate_v2", 11000, 0},
    {"cuGraphInstantiate", "cuGraphInstantiateWithFlags", 12000, 0},
    {"cuGraphInstantiateWithFlags", "cuGraphInstantiateWithFlags", 11040, 0},
    {"cuGraphInstantiateWithParams", "cuGraphInstantiateWithParams", 12000, 0},
    {"cuGraphInstantiateWithParams", "cuGraphInstantiateWithParams_ptsz", 12000, 1},
    {"cuGraphLaunch", "cuGraphLaunch", 10000, 0},
    {"cuGraphLaunch", "cuGraphLaunch_ptsz", 10000, 1},
    {"cuGraphUpload", "cuGraphUpload", 11010, 0},
    {"cuGraphUpload", "cuGraphUpload_ptsz", 11010, 1},
    {"cuGraphExecDestroy", "cuGraphExecDestroy", 10000, 0},
    {"cuDeviceGraphMemTrim", "cuDeviceGraphMemTrim", 11040, 0},
    {"cuModuleLoad", "cuModuleLoad", 2000, 0},
    {"cuModuleLoadData", "cuModuleLoadData", 2000, 0},
    {"cuModuleLoadDataEx", "cuModuleLoadDataEx", 2010, 0},
    {"cuModuleLoadFatBinary", "cuModuleLoadFatBinary", 2000, 0},
    {"cuModuleUnload", "cuModuleUnload", 2000, 0},
    {"cuLibraryLoadData", "cuLibraryLoadData", 12000, 0},
    {"cuLibraryLoadFromFile", "cuLibraryLoadFromFile", 12000, 0},
    {"cuLibraryGetModule", "cuLibraryGetModule", 12000, 0},
    {"cuLibraryUnload", "cuLibraryUnload", 12000, 0},
};

/* internal entry points, at other addresses than the exported ones */
static CUresult i_cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return cuMemAlloc_v2(p, n); }
static CUresult i_cuMemFree_v2(CUdeviceptr p) { return cuMemFree_v2(p); }
static CUresult i_cuMemGetInfo_v2(size_t *f, size_t *t) { return cuMemGetInfo_v2(f, t); }
static CUresult i_cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { return cuMemAllocAsync(p, n, s); }
static CUresult i_cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { return cuMemAllocAsync_ptsz(p, n, s); }
static CUresult i_cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return cuMemFreeAsync_ptsz(p, s); }
static CUresult i_cuModuleLoadData(CUmodule *m, const void *image) { return cuModuleLoadData(m, image); }
static CUresult i_cuLibraryLoadData(CUlibrary *l, const void *c, CUjit_option *jo, void **jv, unsigned jn,
                                    CUlibraryOption *lo, void **lv, unsigned ln) { return cuLibraryLoadData(l, c, jo, jv, jn, lo, lv, ln); }
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
    {"cuModuleLoadData", (void *)i_cuModuleLoadData},
    {"cuLibraryLoadData", (void *)i_cuLibraryLoadData},
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
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxGetState", (void *)cuDevicePrimaryCtxGetState},
    {"cuMemPoolCreate", (void *)cuMemPoolCreate},
    {"cuMemPoolDestroy", (void *)cuMemPoolDestroy},
    {"cuMemPoolTrimTo", (void *)cuMemPoolTrimTo},
    {"cuDeviceSetMemPool", (void *)cuDeviceSetMemPool},
    {"cuDeviceGetMemPool", (void *)cuDeviceGetMemPool},
    {"cuGraphInstantiate", (void *)cuGraphInstantiate},
    {"cuGraphInstantiate_v2", (void *)cuGraphInstantiate_v2},
    {"cuGraphInstantiateWithFlags", (void *)cuGraphInstantiateWithFlags},
    {"cuGraphInstantiateWithParams", (void *)cuGraphInstantiateWithParams},
    {"cuGraphInstantiateWithParams_ptsz", (void *)cuGraphInstantiateWithParams_ptsz},
    {"cuGraphLaunch", (void *)cuGraphLaunch},
    {"cuGraphLaunch_ptsz", (void *)cuGraphLaunch_ptsz},
    {"cuGraphUpload", (void *)cuGraphUpload},
    {"cuGraphUpload_ptsz", (void *)cuGraphUpload_ptsz},
    {"cuGraphExecDestroy", (void *)cuGraphExecDestroy},
    {"cuDeviceGraphMemTrim", (void *)cuDeviceGraphMemTrim},
    {"cuModuleLoad", (void *)cuModuleLoad},
    {"cuModuleLoadData", (void *)cuModuleLoadData},
    {"cuModuleLoadDataEx", (void *)cuModuleLoadDataEx},
    {"cuModuleLoadFatBinary", (void *)cuModuleLoadFatBinary},
    {"cuModuleUnload", (void *)cuModuleUnload},
    {"cuLibraryLoadData", (void *)cuLibraryLoadData},
    {"cuLibraryLoadFromFile", (void *)cuLibraryLoadFromFile},
    {"cuLibraryGetModule", (void *)cuLibraryGetModule},
    {"cuLibraryUnload", (void *)cuLibraryUnload},
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
