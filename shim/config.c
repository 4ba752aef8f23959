/* config.c: the environment, read once by the first constructor of the
 * library, and logging.  It calls into no other module: each module sets
 * itself up from a constructor of its own that runs after this one
 * (GS_INIT_MODULE), registers its own fork handlers there, and leaves
 * everything alone when the shim is not active.
 *
 * CDMO_GPU_MEMORY_LIMIT absent: pass-through.  Present, it is this process's
 * limit, and no variable the workload sets lifts it: a value that is not a
 * byte count of at least 1 (zero, negative, empty, garbage, beyond 64 bits)
 * becomes a limit of 0, which refuses every allocation of device memory,
 * never "no limit".  CDMO_SHIM_DISABLE, once a kill switch, is ignored.
 * Where the slice's ledger lives is no variable's to say (GS_LEDGER_DIR). */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gs.h"

struct gs_config gs_cfg;

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

/* CDMO_GPU_MEMORY_LIMIT: a plain decimal byte count from 1 to 2^64 - 1.
 * Returns 1 with the count, or 0 with why the value is not one. */
static int parse_limit(const char *v, uint64_t *out, const char **why)
{
    uint64_t x = 0;
    if (!*v) {
        *why = "is empty";
        return 0;
    }
    for (const char *p = v; *p; p++) {
        if (*p < '0' || *p > '9') {
            *why = "is not a plain decimal byte count";
            return 0;
        }
        uint64_t d = (uint64_t)(*p - '0');
        if (x > (UINT64_MAX - d) / 10) {
            *why = "is beyond 18446744073709551615";
            return 0;
        }
        x = x * 10 + d;
    }
    if (x == 0) {
        *why = "is zero";
        return 0;
    }
    *out = x;
    return 1;
}

__attribute__((constructor(GS_INIT_CONFIG))) static void gs_init(void)
{
    gs_cfg.debug = env_true("CDMO_SHIM_DEBUG");
    const char *lim = getenv("CDMO_GPU_MEMORY_LIMIT");
    if (!lim) {
        gs_cfg.active = 0; /* pure pass-through: no module sets anything up */
        gs_log("pass-through (no CDMO_GPU_MEMORY_LIMIT)");
        return;
    }
    const char *why = NULL;
    if (!parse_limit(lim, &gs_cfg.limit, &why)) {
        /* The operator meant a limit; "none" would hand out the whole GPU. */
        gs_cfg.limit = 0;
        gs_warn("CDMO_GPU_MEMORY_LIMIT=\"%.64s\" %s (a limit is a byte count such as "
                "1073741824 for 1 GiB): every allocation of device memory is refused",
                lim, why);
    }
    const char *off = getenv("CDMO_SHIM_DISABLE");
    if (off)
        gs_warn("CDMO_SHIM_DISABLE=%.16s is ignored: a container cannot lift its slice's "
                "memory limit", off);
    const char *fp = getenv("CDMO_SHIM_FOOTPRINT");
    if (!fp || !*fp || !strcmp(fp, "auto")) gs_cfg.footprint = GS_FP_AUTO;
    else if (!strcmp(fp, "nvml")) gs_cfg.footprint = GS_FP_NVML;
    else if (!strcmp(fp, "delta")) gs_cfg.footprint = GS_FP_DELTA;
    else if (!strcmp(fp, "off")) gs_cfg.footprint = GS_FP_OFF;
    else gs_warn("CDMO_SHIM_FOOTPRINT=%s is not auto, nvml, delta or off; using auto", fp);
    gs_cfg.active = 1;
    gs_log("limit %llu bytes", (unsigned long long)gs_cfg.limit);
}
