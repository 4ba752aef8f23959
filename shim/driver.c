/* driver.c: the real driver and NVML entry points, found lazily on first use
 * (never in the constructor: a process that never touches CUDA never loads
 * it), and the real dlsym they are found with.
 *
 * gs_cu_syms names each driver variant the shim hooks or calls, with what
 * procaddr.c needs to recognise it in a cuGetProcAddress answer; the real
 * pointers live in gs_cu_real / gs_nv_real by the same index.  The real dlsym
 * is resolved with dlvsym, never through a GLIBC_PRIVATE name, since the
 * shim's own dlsym (dlsym_tramp.S) hides it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>

#include "gs.h"

const struct gs_cu_sym gs_cu_syms[GS_CU_COUNT] = {
#define GS_ROW(id, sym, base_, ver, pt, hk) \
    [GS_CU_##id] = {.name = #sym, .base = #base_, .version = ver, .ptsz = pt, .hooked = hk},
    GS_CU_SYMBOLS(GS_ROW)
#undef GS_ROW
};

const char *const gs_nv_names[GS_NV_COUNT] = {
#define GS_NNAME(sym, hk) [GS_NV_##sym] = #sym,
    GS_NVML_SYMBOLS(GS_NNAME)
#undef GS_NNAME
};

void *gs_cu_real[GS_CU_COUNT];
void *gs_nv_real[GS_NV_COUNT];
_Atomic int gs_cu_ready;
_Atomic int gs_nv_ready;
void *(*gs_real_dlsym)(void *, const char *);
static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;

void gs_init_real_dlsym(void)
{
    if (__atomic_load_n(&gs_real_dlsym, __ATOMIC_ACQUIRE)) return;
    void *f = NULL;
#if defined(__x86_64__)
    static const char *const vers[] = {"GLIBC_2.34", "GLIBC_2.2.5"};
#elif defined(__aarch64__)
    static const char *const vers[] = {"GLIBC_2.34", "GLIBC_2.17"};
#else
#error "libgpuslice supports x86-64 and aarch64"
#endif
    for (unsigned i = 0; i < sizeof vers / sizeof vers[0] && !f; i++)
        f = dlvsym(RTLD_NEXT, "dlsym", vers[i]);
    __atomic_store_n(&gs_real_dlsym, (void *(*)(void *, const char *))f, __ATOMIC_RELEASE);
}

void gs_load_cuda(void)
{
    pthread_mutex_lock(&load_mu);
    if (!atomic_load_explicit(&gs_cu_ready, memory_order_relaxed)) {
        gs_init_real_dlsym();
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            gs_warn("cannot load libcuda.so.1: %s", dlerror());
        } else {
            for (int i = 0; i < GS_CU_COUNT; i++)
                gs_cu_real[i] = gs_real_dlsym(h, gs_cu_syms[i].name);
        }
        atomic_store_explicit(&gs_cu_ready, 1, memory_order_release);
    }
    pthread_mutex_unlock(&load_mu);
}

void gs_load_nvml(void)
{
    pthread_mutex_lock(&load_mu);
    if (!atomic_load_explicit(&gs_nv_ready, memory_order_relaxed)) {
        gs_init_real_dlsym();
        void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            gs_warn("cannot load libnvidia-ml.so.1: %s", dlerror());
        } else {
            for (int i = 0; i < GS_NV_COUNT; i++) gs_nv_real[i] = gs_real_dlsym(h, gs_nv_names[i]);
        }
        atomic_store_explicit(&gs_nv_ready, 1, memory_order_release);
    }
    pthread_mutex_unlock(&load_mu);
}

/* A fork in the middle of a load would leave load_mu locked in the child. */
static void atfork_prepare(void) { pthread_mutex_lock(&load_mu); }
static void atfork_release(void) { pthread_mutex_unlock(&load_mu); }

__attribute__((constructor(GS_INIT_MODULE))) static void driver_init(void)
{
    if (gs_cfg.active) pthread_atfork(atfork_prepare, atfork_release, atfork_release);
}
