/* config.c: environment (read once, in the constructor), logging, loading
 * the real driver and NVML entry points, fork and exit hooks. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gs.h"

struct gs_config gs_cfg;
void *gs_cu_real[GS_CU_COUNT];
void *gs_nv_real[GS_NV_COUNT];
_Atomic int gs_cu_ready;
_Atomic int gs_nv_ready;
static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;

static void vlog(const char *tag, const char *fmt, va_list ap)
{
    char buf[512];
    int n = snprintf(buf, sizeof buf, "libgpuslice[%d] %s: ", (int)getpid(), tag);
    if (n < 0) return;
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    if (m < 0) return;
    size_t len = (size_t)n + (size_t)m;
    if (len > sizeof buf - 2) len = sizeof buf - 2;
    buf[len++] = '\n';
    ssize_t w = write(2, buf, len); /* one write: lines of processes do not mix */
    (void)w;
}

void gs_log(const char *fmt, ...)
{
    if (!gs_cfg.debug) return;
    va_list ap;
    va_start(ap, fmt);
    vlog("debug", fmt, ap);
    va_end(ap);
}

void gs_warn(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog("warning", fmt, ap);
    va_end(ap);
}

static int env_true(const char *name)
{
    const char *v = getenv(name);
    return v && (!strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes"));
}

/* Strict decimal parse of a byte count; 0 and garbage mean "no limit". */
static uint64_t parse_bytes(const char *v)
{
    if (!v || !*v) return 0;
    uint64_t x = 0;
    for (const char *p = v; *p; p++) {
        if (*p < '0' || *p > '9') {
            gs_warn("CDMO_GPU_MEMORY_LIMIT=%s is not a byte count; no limit applied", v);
            return 0;
        }
        uint64_t d = (uint64_t)(*p - '0');
        if (x > (UINT64_MAX - d) / 10) {
            gs_warn("CDMO_GPU_MEMORY_LIMIT=%s overflows; no limit applied", v);
            return 0;
        }
        x = x * 10 + d;
    }
    return x;
}

/* "<namespace>/<name>" -> file-name-safe form.  Kubernetes names use only
 * [a-z0-9.-], so '/' -> '_' is unambiguous; anything else becomes %XX. */
static void sanitize_slice(const char *in, char *out, size_t cap)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    if (!in || !*in) in = "default";
    for (const unsigned char *p = (const unsigned char *)in; *p && o + 4 < cap; p++) {
        unsigned char c = *p;
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
            c == '.' || c == '-') {
            out[o++] = (char)c;
        } else if (c == '/') {
            out[o++] = '_';
        } else {
            out[o++] = '%';
            out[o++] = hex[c >> 4];
            out[o++] = hex[c & 15];
        }
    }
    out[o] = 0;
}

static void atfork_prepare(void)
{
    pthread_mutex_lock(&load_mu);
    gs_region_atfork_prepare();
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
    gs_region_atfork_parent();
    pthread_mutex_unlock(&load_mu);
}

static void atfork_child(void)
{
    /* The child owns none of the parent's device memory (a CUDA context does
     * not survive fork): forget the parent's pointers and take a slot of our
     * own on first use.  The shared mappings stay. */
    gs_table_unlock(&gs_graphs);
    gs_table_unlock(&gs_maps);
    gs_table_unlock(&gs_handles);
    gs_table_unlock(&gs_allocs);
    gs_tables_reset();
    gs_region_atfork_child();
    gs_report_atfork_child();
    gs_pools_atfork_child();
    gs_graphs_atfork_child();
    gs_fp_atfork_child();
    pthread_mutex_unlock(&load_mu);
}

__attribute__((constructor)) static void gs_init(void)
{
    gs_cfg.debug = env_true("CDMO_SHIM_DEBUG");
    gs_cfg.disabled = env_true("CDMO_SHIM_DISABLE");
    gs_cfg.limit = parse_bytes(getenv("CDMO_GPU_MEMORY_LIMIT"));
    if (gs_cfg.disabled || gs_cfg.limit == 0) {
        gs_cfg.active = 0;   /* pure pass-through: nothing else is set up */
        gs_log("pass-through (%s)", gs_cfg.disabled ? "CDMO_SHIM_DISABLE" : "no limit");
        return;
    }
    gs_cfg.strict = env_true("CDMO_SHIM_STRICT");
    const char *fp = getenv("CDMO_SHIM_FOOTPRINT");
    if (!fp || !*fp || !strcmp(fp, "auto")) gs_cfg.footprint = GS_FP_AUTO;
    else if (!strcmp(fp, "nvml")) gs_cfg.footprint = GS_FP_NVML;
    else if (!strcmp(fp, "delta")) gs_cfg.footprint = GS_FP_DELTA;
    else if (!strcmp(fp, "off")) gs_cfg.footprint = GS_FP_OFF;
    else gs_warn("CDMO_SHIM_FOOTPRINT=%s is not auto, nvml, delta or off; using auto", fp);
    sanitize_slice(getenv("CDMO_SLICE"), gs_cfg.slice, sizeof gs_cfg.slice);
    const char *dir = getenv("CDMO_SHIM_DIR");
    snprintf(gs_cfg.dir, sizeof gs_cfg.dir, "%s", dir && *dir ? dir : "/dev/shm");
    gs_tables_init();
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    gs_cfg.active = 1;
    gs_log("limit %llu bytes, slice %s, dir %s", (unsigned long long)gs_cfg.limit,
           gs_cfg.slice, gs_cfg.dir);
}

__attribute__((destructor)) static void gs_fini(void)
{
    if (gs_cfg.active) gs_region_exit();
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
