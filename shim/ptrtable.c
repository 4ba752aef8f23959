/* ptrtable.c: O(1) tables keyed by device pointer (or VMM handle).
 *
 * Linear probing over a power-of-two array reserved once at start with
 * mmap(MAP_NORESERVE) (pages are committed as they are touched), Fibonacci
 * hashing of the key, backward-shift deletion (no tombstones, so probe
 * lengths do not grow with churn).  A process-local spin lock guards each
 * table: the critical section is a few probes, and taking it is one atomic
 * exchange with no syscall.  Nothing here allocates after start. */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>

#include "gs.h"

struct gs_table gs_allocs = {.lock = ATOMIC_FLAG_INIT, .name = "allocations"};
struct gs_table gs_handles = {.lock = ATOMIC_FLAG_INIT, .name = "vmm handles"};
struct gs_table gs_maps = {.lock = ATOMIC_FLAG_INIT, .name = "vmm mappings"};
struct gs_table gs_graphs = {.lock = ATOMIC_FLAG_INIT, .name = "graph execs"};
_Atomic uint64_t gs_untracked_bytes;

static void table_init(struct gs_table *t, unsigned bits)
{
    size_t n = (size_t)1 << bits;
    void *p = mmap(NULL, n * sizeof(struct gs_entry), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        gs_warn("cannot reserve the %s table; allocations stay counted but are never uncounted",
                t->name);
        t->e = NULL;
        t->mask = 0;
        return;
    }
    t->e = p;
    t->mask = n - 1;
    t->shift = 64 - bits;
    t->count = 0;
    t->cap_limit = n - n / 8; /* keep the load under 7/8 */
}

static void table_reset(struct gs_table *t)
{
    if (!t->e) return;
    /* private anonymous memory reads back as zeros after MADV_DONTNEED */
    madvise(t->e, (t->mask + 1) * sizeof(struct gs_entry), MADV_DONTNEED);
    t->count = 0;
}

/* No table may be mid-update when the process forks. */
static void atfork_prepare(void)
{
    gs_table_lock(&gs_allocs);
    gs_table_lock(&gs_handles);
    gs_table_lock(&gs_maps);
    gs_table_lock(&gs_graphs);
}

static void atfork_parent(void)
{
    gs_table_unlock(&gs_graphs);
    gs_table_unlock(&gs_maps);
    gs_table_unlock(&gs_handles);
    gs_table_unlock(&gs_allocs);
}

static void atfork_child(void)
{
    /* The child owns none of the parent's device memory (a CUDA context does
     * not survive fork): it forgets the parent's pointers. */
    atfork_parent();
    table_reset(&gs_allocs);
    table_reset(&gs_handles);
    table_reset(&gs_maps);
    table_reset(&gs_graphs);
}

__attribute__((constructor(GS_INIT_MODULE))) static void tables_init(void)
{
    if (!gs_cfg.active) return;
    table_init(&gs_allocs, 20); /* 1M live allocations, 32 MiB of address space */
    table_init(&gs_handles, 18);
    table_init(&gs_maps, 18);
    table_init(&gs_graphs, 12);
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

void gs_table_lock(struct gs_table *t)
{
    while (atomic_flag_test_and_set_explicit(&t->lock, memory_order_acquire)) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
    }
}

void gs_table_unlock(struct gs_table *t)
{
    atomic_flag_clear_explicit(&t->lock, memory_order_release);
}

static inline uint64_t slot_of(const struct gs_table *t, uint64_t key)
{
    /* Fibonacci hashing: device pointers share low zero bits and high bits */
    return (key * 0x9E3779B97F4A7C15ULL) >> t->shift;
}

int gs_table_put_locked(struct gs_table *t, uint64_t key, uint64_t size, uint64_t aux,
                        struct gs_ref *ref)
{
    if (!t->e || t->count >= t->cap_limit) return 0;
    uint64_t stored = ~key;
    for (uint64_t i = slot_of(t, key);; i = (i + 1) & t->mask) {
        struct gs_entry *e = &t->e[i];
        if (e->key == 0 || e->key == stored) {
            if (e->key == 0) t->count++;
            e->key = stored;
            e->size = size;
            e->aux = aux;
            e->ref = ref;
            return 1;
        }
    }
}

struct gs_entry *gs_table_get_locked(struct gs_table *t, uint64_t key)
{
    if (!t->e) return NULL;
    uint64_t stored = ~key;
    for (uint64_t i = slot_of(t, key);; i = (i + 1) & t->mask) {
        struct gs_entry *e = &t->e[i];
        if (e->key == stored) return e;
        if (e->key == 0) return NULL;
    }
}

void gs_table_del_locked(struct gs_table *t, struct gs_entry *e)
{
    uint64_t i = (uint64_t)(e - t->e);
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        struct gs_entry *n = &t->e[j];
        if (n->key == 0) break;
        uint64_t home = slot_of(t, ~n->key);
        /* move n into the hole at i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            t->e[i] = *n;
            i = j;
        }
    }
    memset(&t->e[i], 0, sizeof t->e[i]);
    t->count--;
}

int gs_table_put(struct gs_table *t, uint64_t key, uint64_t size, uint64_t aux,
                 struct gs_ref *ref)
{
    gs_table_lock(t);
    int ok = gs_table_put_locked(t, key, size, aux, ref);
    gs_table_unlock(t);
    return ok;
}

int gs_table_take(struct gs_table *t, uint64_t key, struct gs_entry *out)
{
    gs_table_lock(t);
    struct gs_entry *e = gs_table_get_locked(t, key);
    if (e) {
        *out = *e;
        out->key = key;
        gs_table_del_locked(t, e);
    }
    gs_table_unlock(t);
    return e != NULL;
}
