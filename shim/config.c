/* config.c: the slice's limit and the shim's switches, read once by the
 * first constructor of the library, and logging.  It calls into no other
 * module: each module sets itself up from a constructor of its own that runs
 * after this one (GS_INIT_MODULE), registers its own fork handlers there, and
 * leaves everything alone when the shim is not active.
 *
 * The limit is the content of GS_LIMIT_FILE: one plain decimal byte count
 * from 1 to 2^64 - 1, optionally followed by one newline.  The CDI spec of a
 * fraction mounts that file read-only beside the ledger, and mounts
 * /etc/ld.so.preload naming this library, so every dynamically linked process
 * of the container loads the shim and reads the same limit whatever its
 * environment says.  The environment chooses nothing that loosens the slice:
 *  - file present, a byte count: that is the limit;
 *  - file present but unreadable, not a regular file, or not such a byte
 *    count (zero, negative, empty, garbage, beyond 64 bits): a limit of 0,
 *    which refuses every allocation of device memory, never "no limit";
 *  - file absent: pass-through, unless CDMO_GPU_MEMORY_LIMIT says this is a
 *    slice; then its limit is missing and, again, the limit is 0.
 * CDMO_GPU_MEMORY_LIMIT is otherwise for display only: its value is never
 * read.  CDMO_SHIM_DISABLE, once a kill switch, is ignored; so is
 * CDMO_SHIM_FOOTPRINT, except in the GPU-free tests' copy of the library
 * (GS_TEST_BUILD), where it forces one way of measuring against the fake
 * driver.  Where the ledger and the limit live is no variable's to say
 * (GS_LEDGER_DIR, GS_LIMIT_FILE).  CDMO_SHIM_DEBUG only adds log lines. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

/* A plain decimal byte count from 1 to 2^64 - 1.
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

enum { LIMIT_ABSENT, LIMIT_SET, LIMIT_REFUSED };

/* The slice's limit from GS_LIMIT_FILE: LIMIT_ABSENT (no such file),
 * LIMIT_SET with *limit, or LIMIT_REFUSED having said why (the limit is 0).
 * A byte count has at most 20 digits: a longer file is not one. */
static int read_limit(uint64_t *limit)
{
    *limit = 0;
    int fd = open(GS_LIMIT_FILE, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR) return LIMIT_ABSENT;
        gs_warn("the slice's limit file %s cannot be read (%s): every allocation of device "
                "memory is refused", GS_LIMIT_FILE, strerror(errno));
        return LIMIT_REFUSED;
    }
    struct stat st;
    char buf[32];
    ssize_t got = -1;
    const char *cannot = NULL;
    if (fstat(fd, &st) != 0) cannot = strerror(errno);
    else if (!S_ISREG(st.st_mode)) cannot = "not a regular file";
    else {
        do got = read(fd, buf, sizeof buf - 1);
        while (got < 0 && errno == EINTR);
        if (got < 0) cannot = strerror(errno);
    }
    close(fd);
    if (cannot || got < 0) {
        gs_warn("the slice's limit file %s cannot be read (%s): every allocation of device "
                "memory is refused", GS_LIMIT_FILE, cannot ? cannot : "read failed");
        return LIMIT_REFUSED;
    }
    size_t n = (size_t)got;
    buf[n] = 0;
    const char *why = NULL;
    if (n == sizeof buf - 1) why = "is longer than any byte count";
    else {
        if (n > 0 && buf[n - 1] == '\n') buf[--n] = 0;
        if (strlen(buf) != n) why = "is not a plain decimal byte count"; /* a NUL inside */
        else if (parse_limit(buf, limit, &why)) return LIMIT_SET;
    }
    for (size_t i = 0; i < n; i++) /* shown as text, whatever the bytes are */
        if (buf[i] < 0x20 || buf[i] > 0x7e) buf[i] = '?';
    gs_warn("the slice's limit file %s holds \"%s\", which %s (a limit is a byte count such as "
            "1073741824 for 1 GiB): every allocation of device memory is refused",
            GS_LIMIT_FILE, buf, why);
    *limit = 0;
    return LIMIT_REFUSED;
}

static int footprint_mode(void)
{
#ifdef GS_TEST_BUILD
    const char *fp = getenv("CDMO_SHIM_FOOTPRINT");
    if (!fp || !*fp || !strcmp(fp, "auto")) return GS_FP_AUTO;
    if (!strcmp(fp, "nvml")) return GS_FP_NVML;
    if (!strcmp(fp, "delta")) return GS_FP_DELTA;
    if (!strcmp(fp, "off")) return GS_FP_OFF;
    gs_warn("CDMO_SHIM_FOOTPRINT=%s is not auto, nvml, delta or off; using auto", fp);
#endif
    return GS_FP_AUTO;
}

__attribute__((constructor(GS_INIT_CONFIG))) static void gs_init(void)
{
    int saved = errno; /* every process of the container runs this: leave errno as it was */
    gs_cfg.debug = env_true("CDMO_SHIM_DEBUG");
    switch (read_limit(&gs_cfg.limit)) {
    case LIMIT_ABSENT:
        if (!getenv("CDMO_GPU_MEMORY_LIMIT")) {
            gs_cfg.active = 0; /* pure pass-through: no module sets anything up */
            gs_log("pass-through (no %s)", GS_LIMIT_FILE);
            errno = saved;
            return;
        }
        /* The container was given a slice, but not the file that holds its limit. */
        gs_warn("CDMO_GPU_MEMORY_LIMIT is set but the slice's limit file %s is absent (the "
                "variable is for display only): every allocation of device memory is refused",
                GS_LIMIT_FILE);
        break;
    case LIMIT_SET:
        gs_log("limit %llu bytes from %s", (unsigned long long)gs_cfg.limit, GS_LIMIT_FILE);
        break;
    default:
        break;
    }
    const char *off = getenv("CDMO_SHIM_DISABLE");
    if (off)
        gs_warn("CDMO_SHIM_DISABLE=%.16s is ignored: a container cannot lift its slice's "
                "memory limit", off);
    gs_cfg.footprint = footprint_mode();
    gs_cfg.active = 1;
    errno = saved;
}
