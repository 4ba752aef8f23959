/* region.c: the cross-process ledger of one slice on one GPU.
 *
 * A file GS_LEDGER_DIR/gpu-<uuid> (mode 0666) mapped MAP_SHARED by every
 * process of the slice.  The directory is the claim's own, mounted by its CDI
 * spec into every container of every pod that uses the claim, so they all
 * share one limit; nothing in the environment names another file.  A ledger
 * that cannot be opened (no mount, no permission, another layout) is closed:
 * every allocation of device memory on that GPU is refused, with one warning.
 * The header is versioned (magic, version, size) and stamped with the boot
 * id; it is initialised under flock(2) with the magic written last, so a
 * creator killed half-way leaves a file the next opener initialises again,
 * and a ledger left from an earlier boot (whose processes are all gone) is
 * started afresh.
 *
 * Reservation is one compare-and-swap on `used` against this process's
 * limit, made before the driver is called and rolled back if the driver
 * fails; a reservation refused for the limit is counted in `refused`, which
 * the node's agent reads.  Each process also adds its bytes to its own slot
 * (pid, start time, pid namespace), which is how the share of a killed
 * process is found and given back.  The robust mutex is taken only on the slow paths: claiming a
 * slot, exit, and recovery when a reservation would exceed the limit.  The
 * kernel hands a robust mutex to the next waiter (EOWNERDEAD) when its owner
 * dies, so a SIGKILL inside the lock cannot hang the slice.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdalign.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gs.h"

#define GS_MAGIC 0x31474d48534f4443ULL /* "CDOSHMG1" */
#define GS_VERSION 2u
#define GS_SLOTS 1024

struct gs_slot {
    _Atomic uint32_t pid;       /* 0 = free */
    uint32_t pad;
    uint64_t start;             /* process start time, clock ticks since boot */
    uint64_t pidns;             /* inode of /proc/<pid>/ns/pid */
    _Atomic uint64_t used;      /* bytes this process holds */
};

struct gs_region {
    _Atomic uint64_t magic;
    uint32_t version;
    uint32_t size;
    uint32_t nslots;
    _Atomic uint32_t refused;     /* allocations refused for the limit (read by the node's agent) */
    _Atomic uint64_t peak;        /* high-water mark of used */
    _Atomic uint64_t recovered;   /* bytes taken back from dead processes */
    _Atomic uint64_t last_limit;  /* limit of the last process that reserved (informational) */
    char boot[40];                /* /proc/sys/kernel/random/boot_id at initialisation */
    pthread_mutex_t lock;         /* robust, process-shared */
    alignas(64) _Atomic uint64_t used; /* own cache line: the only hot word */
    alignas(64) struct gs_slot slots[GS_SLOTS];
};

static struct gs_ref refs[GS_MAX_DEV];
static int nrefs;
static pthread_mutex_t attach_mu = PTHREAD_MUTEX_INITIALIZER;

/* this process's identity, computed on first slot claim, reset on fork */
static uint32_t my_pid;
static uint64_t my_start, my_ns;

/* /proc/<pid>/stat: state is field 3, starttime field 22. Returns 0 on error. */
static int proc_stat(uint32_t pid, char *state, uint64_t *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return 0;
    p += 2;
    *state = *p;
    /* fields after ')' start at 3 (state); starttime is the 20th of them */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
    }
    *start = strtoull(p, NULL, 10);
    return 1;
}

static uint64_t pidns_of(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static void ensure_identity(void)
{
    uint32_t pid = (uint32_t)getpid();
    if (my_pid == pid) return;
    char state;
    my_start = 0;
    proc_stat(pid, &state, &my_start);
    my_ns = pidns_of("/proc/self/ns/pid");
    my_pid = pid;
}

static void rlock(struct gs_region *r)
{
    int e = pthread_mutex_lock(&r->lock);
    if (e == EOWNERDEAD) {
        /* The owner died inside the lock.  Every field is kept consistent
         * with atomics, so there is nothing to repair. */
        pthread_mutex_consistent(&r->lock);
    }
}

static void runlock(struct gs_region *r) { pthread_mutex_unlock(&r->lock); }

/* A slot whose process is gone, or whose pid now names another process. */
static int slot_dead(const struct gs_slot *s)
{
    uint32_t pid = atomic_load(&s->pid);
    if (!pid) return 0;
    if (s->pidns != my_ns || !my_ns) return 0; /* cannot judge another pid namespace */
    if (kill((pid_t)pid, 0) == -1 && errno == ESRCH) return 1;
    char state;
    uint64_t start;
    if (!proc_stat(pid, &state, &start)) return 1;
    if (start != s->start) return 1;          /* pid reused */
    if (state == 'Z' || state == 'X') return 1; /* exited: the driver freed its memory */
    return 0;
}

static uint64_t release_slot(struct gs_region *r, struct gs_slot *s)
{
    uint64_t u = atomic_exchange(&s->used, 0);
    if (u) atomic_fetch_sub(&r->used, u);
    atomic_store(&s->pid, 0);
    return u;
}

/* Give back the shares of dead processes.  Lock held. */
static uint64_t reap_locked(struct gs_region *r, int keep)
{
    uint64_t freed = 0;
    for (uint32_t i = 0; i < r->nslots; i++) {
        struct gs_slot *s = &r->slots[i];
        if (!atomic_load(&s->pid) || (int)i == keep) continue;
        int stale_self = s->pid == my_pid && s->start == my_start && s->pidns == my_ns;
        if (stale_self || slot_dead(s)) {
            /* stale_self: a slot of this very process before it exec'ed */
            uint64_t u = release_slot(r, s);
            freed += u;
            atomic_fetch_add(&r->recovered, u);
            gs_log("recovered %llu bytes of pid %u", (unsigned long long)u, s->pid);
        }
    }
    return freed;
}

static void claim_slot(struct gs_ref *ref)
{
    pthread_mutex_lock(&attach_mu);
    if (ref->slot < 0 && ref->reg) {
        struct gs_region *r = ref->reg;
        ensure_identity();
        rlock(r);
        reap_locked(r, -1);
        for (uint32_t i = 0; i < r->nslots; i++) {
            struct gs_slot *s = &r->slots[i];
            if (atomic_load(&s->pid) == 0) {
                s->start = my_start;
                s->pidns = my_ns;
                atomic_store(&s->used, 0);
                atomic_store(&s->pid, my_pid);
                ref->slot = (int)i;
                break;
            }
        }
        runlock(r);
        if (ref->slot < 0)
            gs_warn("all %d process slots of the region are taken; this process's share "
                    "cannot be recovered if it is killed", GS_SLOTS);
    }
    pthread_mutex_unlock(&attach_mu);
}

static int recover(struct gs_ref *ref)
{
    struct gs_region *r = ref->reg;
    pthread_mutex_lock(&attach_mu);
    ensure_identity();
    rlock(r);
    uint64_t freed = reap_locked(r, ref->slot);
    runlock(r);
    pthread_mutex_unlock(&attach_mu);
    return freed > 0;
}

/* Reporting paths call this so that figures do not show the share of a
 * process that died without exiting normally.  cuMemGetInfo may be called
 * often: it scans at most once a second (CLOCK_MONOTONIC_COARSE is read in
 * the vDSO, no syscall); NVML queries scan every time. */
int gs_reap_if_due(struct gs_ref *ref, int force)
{
    static _Atomic int64_t next_ns;
    if (!ref || !ref->reg) return 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    int64_t due = atomic_load_explicit(&next_ns, memory_order_relaxed);
    if (!force && now < due) return 0;
    atomic_store_explicit(&next_ns, now + 1000000000LL, memory_order_relaxed);
    recover(ref);
    return 1;
}

static inline void raise_peak(struct gs_region *r, uint64_t now)
{
    uint64_t pk = atomic_load_explicit(&r->peak, memory_order_relaxed);
    while (GS_UNLIKELY(now > pk) &&
           !atomic_compare_exchange_weak_explicit(&r->peak, &pk, now, memory_order_relaxed,
                                                  memory_order_relaxed)) {
    }
}

int gs_reserve_spare(struct gs_ref *ref, uint64_t n)
{
    struct gs_region *r = ref->reg;
    if (GS_UNLIKELY(!r)) return 0; /* strict mode without a region: closed */
    if (GS_UNLIKELY(ref->slot < 0)) claim_slot(ref);
    const uint64_t lim = gs_cfg.limit;
    int pressed = 0;
    uint64_t cur = atomic_load_explicit(&r->used, memory_order_relaxed);
    /* This reservation would leave less than half the free space seen at the
     * last footprint measurement: measure again first, while neither the
     * region nor the driver holds these n bytes yet.  A plain load; the
     * refresh itself is rare (see footprint.c). */
    if (GS_UNLIKELY(n <= lim && cur <= lim - n &&
                    lim - cur - n < atomic_load_explicit(&ref->mark, memory_order_relaxed))) {
        gs_fp_mark_hit(ref);
        cur = atomic_load_explicit(&r->used, memory_order_relaxed);
    }
    for (;;) {
        if (GS_UNLIKELY(n > lim || cur > lim - n)) {
            /* Before refusing, once: give back dead processes' shares, trim
             * this process's pools and graph memory, re-measure its footprint. */
            if (pressed) return 0;
            pressed = 1;
            recover(ref);
            gs_fp_pressure(ref);
            cur = atomic_load_explicit(&r->used, memory_order_relaxed);
            continue;
        }
        if (atomic_compare_exchange_weak_explicit(&r->used, &cur, cur + n, memory_order_acq_rel,
                                                  memory_order_relaxed))
            break;
    }
    /* The global add comes first: killed between the two, the slice over-counts
     * by n (fail-safe), never under-counts. */
    if (GS_LIKELY(ref->slot >= 0))
        atomic_fetch_add_explicit(&r->slots[ref->slot].used, n, memory_order_relaxed);
    raise_peak(r, cur + n);
    return 1;
}

void gs_refused(struct gs_ref *ref)
{
    if (ref && ref->reg) atomic_fetch_add_explicit(&ref->reg->refused, 1, memory_order_relaxed);
}

int gs_reserve(struct gs_ref *ref, uint64_t n)
{
    if (GS_LIKELY(gs_reserve_spare(ref, n))) return 1;
    gs_refused(ref);
    return 0;
}

/* Memory the driver already holds for this process (context, pool and graph
 * reservations): it is counted whatever the limit says, since refusing cannot
 * give it back; further reservations then fail until it shrinks. */
void gs_charge(struct gs_ref *ref, uint64_t n)
{
    struct gs_region *r = ref->reg;
    if (!r || !n || ref->released) return;
    if (ref->slot < 0) claim_slot(ref);
    uint64_t now = atomic_fetch_add_explicit(&r->used, n, memory_order_acq_rel) + n;
    if (ref->slot >= 0)
        atomic_fetch_add_explicit(&r->slots[ref->slot].used, n, memory_order_relaxed);
    raise_peak(r, now);
}

/* Bytes this process holds in the region (allocations and charges). */
uint64_t gs_slot_used(const struct gs_ref *ref, int *ok)
{
    *ok = ref->reg && ref->slot >= 0;
    return *ok ? atomic_load_explicit(&ref->reg->slots[ref->slot].used, memory_order_acquire) : 0;
}

void gs_unreserve(struct gs_ref *ref, uint64_t n)
{
    struct gs_region *r = ref->reg;
    if (!r || !n || GS_UNLIKELY(ref->released)) return;
    /* slot first: killed between the two, the slice over-counts (fail-safe) */
    if (GS_LIKELY(ref->slot >= 0))
        atomic_fetch_sub_explicit(&r->slots[ref->slot].used, n, memory_order_relaxed);
    atomic_fetch_sub_explicit(&r->used, n, memory_order_release);
}

uint64_t gs_used(const struct gs_ref *ref)
{
    if (!ref) return 0;
    return ref->reg ? atomic_load_explicit(&ref->reg->used, memory_order_relaxed) : UINT64_MAX;
}

uint64_t gs_peak(const struct gs_ref *ref)
{
    return ref && ref->reg ? atomic_load_explicit(&ref->reg->peak, memory_order_relaxed) : 0;
}

static void boot_id(char out[40])
{
    memset(out, 0, 40);
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t n = read(fd, out, 39);
    close(fd);
    if (n > 0 && out[n - 1] == '\n') out[n - 1] = 0;
}

static void init_region(struct gs_region *r, const char *boot)
{
    memset(r, 0, sizeof *r);
    memcpy(r->boot, boot, sizeof r->boot);
    r->version = GS_VERSION;
    r->size = (uint32_t)sizeof *r;
    r->nslots = GS_SLOTS;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&r->lock, &a);
    pthread_mutexattr_destroy(&a);
    atomic_store_explicit(&r->magic, GS_MAGIC, memory_order_release);
}

/* The ledger file, mapped; NULL (and *why says why) if it cannot be used. */
static struct gs_region *open_region(const char *path, char *why, size_t cap)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd < 0) {
        snprintf(why, cap, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    (void)fchmod(fd, 0666); /* umask; fails harmlessly when another uid created it */
    struct gs_region *r = NULL;
    struct stat st;
    if (flock(fd, LOCK_EX) != 0 || fstat(fd, &st) != 0) {
        snprintf(why, cap, "cannot lock %s: %s", path, strerror(errno));
        goto out;
    }
    if ((size_t)st.st_size < sizeof *r && ftruncate(fd, (off_t)sizeof *r) != 0) {
        snprintf(why, cap, "cannot size %s: %s", path, strerror(errno));
        goto out;
    }
    r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) {
        snprintf(why, cap, "cannot map %s: %s", path, strerror(errno));
        r = NULL;
        goto out;
    }
    char boot[40];
    boot_id(boot);
    uint64_t magic = atomic_load_explicit(&r->magic, memory_order_acquire);
    if (magic == 0) {
        init_region(r, boot);
    } else if (magic != GS_MAGIC || r->version != GS_VERSION || r->size != sizeof *r) {
        snprintf(why, cap, "%s has an incompatible layout (version %u)", path, r->version);
        munmap(r, sizeof *r);
        r = NULL;
    } else if (memcmp(r->boot, boot, sizeof boot) != 0) {
        gs_log("%s is from an earlier boot: started afresh", path);
        init_region(r, boot);
    }
out:
    flock(fd, LOCK_UN);
    close(fd);
    return r;
}

struct gs_ref *gs_ref_for_key(const char *key)
{
    struct gs_ref *ref = NULL;
    pthread_mutex_lock(&attach_mu);
    for (int i = 0; i < nrefs; i++)
        if (!strcmp(refs[i].key, key)) {
            ref = &refs[i];
            goto out;
        }
    if (nrefs == GS_MAX_DEV) goto out;
    ref = &refs[nrefs];
    snprintf(ref->key, sizeof ref->key, "%s", key);
    ref->slot = -1;
    ref->cudev = -1;
    char path[600], why[700];
    snprintf(path, sizeof path, "%s/gpu-%s", GS_LEDGER_DIR, key);
    ref->reg = open_region(path, why, sizeof why);
    if (!ref->reg) {
        /* Closed, never a limit of this process alone: processes that could
         * not find the slice's ledger would each get the whole limit. */
        static int warned;
        if (!warned++)
            gs_warn("the slice's ledger cannot be used (%s): every allocation of device "
                    "memory is refused with CUDA_ERROR_OUT_OF_MEMORY", why);
    } else {
        ensure_identity();
        rlock(ref->reg);
        reap_locked(ref->reg, -1);
        runlock(ref->reg);
        gs_log("ledger %s", path);
    }
    __atomic_store_n(&nrefs, nrefs + 1, __ATOMIC_RELEASE);
out:
    pthread_mutex_unlock(&attach_mu);
    return ref;
}

static void atfork_prepare(void) { pthread_mutex_lock(&attach_mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&attach_mu); }

static void atfork_child(void)
{
    pthread_mutex_unlock(&attach_mu);
    for (int i = 0; i < nrefs; i++) {
        /* the child holds none of the parent's memory, context included */
        refs[i].slot = -1;
        refs[i].cudev = -1;
        refs[i].ctx_how = GS_CTX_NONE;
        refs[i].ctx = refs[i].graph = 0;
        refs[i].nvdev = NULL;
        atomic_store(&refs[i].mark, 0);
        atomic_store(&refs[i].freed, 0);
    }
    my_pid = 0;
}

/* A normal exit gives this process's shares back. */
__attribute__((destructor)) static void region_exit(void)
{
    if (!gs_cfg.active) return;
    pthread_mutex_lock(&attach_mu);
    for (int i = 0; i < nrefs; i++) {
        struct gs_ref *ref = &refs[i];
        if (ref->reg && ref->slot >= 0) {
            rlock(ref->reg);
            release_slot(ref->reg, &ref->reg->slots[ref->slot]);
            runlock(ref->reg);
            ref->slot = -1;
            ref->released = 1; /* frees after this point were already given back */
        }
    }
    pthread_mutex_unlock(&attach_mu);
}

__attribute__((constructor(GS_INIT_MODULE))) static void region_init(void)
{
    if (gs_cfg.active) pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}
