/* fake_nvml.c: a GPU-free stand-in for libnvidia-ml.so.1.
 *
 * FAKE_NDEV devices (default 1), UUIDs matching the fake libcuda's.  Each has
 * FAKE_TOTAL bytes (default 80 GiB); used = FAKE_NVML_USED (default 1 GiB,
 * other tenants) + what the calling process holds there according to the
 * fake libcuda (fake_dev_used: context, allocations, pools, graph pool);
 * reserved 512 MiB.  The compute-process list names the calling process with
 * that same figure, under pid getpid() + FAKE_NVML_PID_OFFSET (a container's
 * pid namespace: NVML reports host pids). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_abi.h"

#define EXPORT __attribute__((visibility("default")))
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define H0 0x100

static unsigned long long total = 80ULL << 30, used = 1ULL << 30;
static unsigned int ndev = 1, pid_offset;
static unsigned int proc_queries;
static unsigned long long lag; /* the process list reports this much less */

EXPORT void fake_nvml_set_lag(unsigned long long n) { lag = n; }

/* how often the process list was asked for: the shim must not ask per allocation */
EXPORT unsigned int fake_nvml_proc_queries(void) { return proc_queries; }

__attribute__((constructor)) static void fake_init(void)
{
    const char *v;
    if ((v = getenv("FAKE_TOTAL"))) total = strtoull(v, NULL, 0);
    if ((v = getenv("FAKE_NVML_USED"))) used = strtoull(v, NULL, 0);
    if ((v = getenv("FAKE_NDEV"))) ndev = (unsigned)atoi(v);
    if ((v = getenv("FAKE_NVML_PID_OFFSET"))) pid_offset = (unsigned)atoi(v);
}

/* this process's footprint on device i, from the fake libcuda if loaded */
static unsigned long long mine(unsigned i)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h) return 0;
    unsigned long long (*f)(int) = (unsigned long long (*)(int))dlsym(h, "fake_dev_used");
    unsigned long long n = f ? f((int)i) : 0;
    dlclose(h);
    return n;
}

static int idx(nvmlDevice_t d)
{
    uintptr_t v = (uintptr_t)d;
    return v >= H0 && v < H0 + ndev ? (int)(v - H0) : -1;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) { *n = ndev; return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d)
{
    if (i >= ndev) return NVML_ERROR_INVALID_ARGUMENT;
    *d = (nvmlDevice_t)(uintptr_t)(H0 + i);
    return NVML_SUCCESS;
}
static void uuid_of(unsigned i, char *buf, unsigned len)
{
    snprintf(buf, len, "GPU-5b3b5d0c-1f2e-4a77-9c10-abcdef0123%02x", i);
}
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned int len)
{
    int i = idx(d);
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    uuid_of((unsigned)i, buf, len);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d)
{
    char buf[96];
    for (unsigned i = 0; i < ndev; i++) {
        uuid_of(i, buf, sizeof buf);
        if (!strcmp(buf, uuid)) {
            *d = (nvmlDevice_t)(uintptr_t)(H0 + i);
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    int i = idx(d);
    if (i < 0 || !m) return NVML_ERROR_INVALID_ARGUMENT;
    m->total = total;
    m->used = used + mine((unsigned)i);
    m->free = total - m->used;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    int i = idx(d);
    if (i < 0 || !m) return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != GS_NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    m->total = total;
    m->reserved = 512ULL << 20;
    m->used = used + mine((unsigned)i);
    m->free = total - m->used;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                            nvmlProcessInfo_t *infos)
{
    int i = idx(d);
    if (i < 0 || !count) return NVML_ERROR_INVALID_ARGUMENT;
    proc_queries++;
    unsigned long long m = mine((unsigned)i);
    unsigned int n = m ? 1 : 0;
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = n;
    if (n) {
        memset(infos, 0, sizeof *infos);
        infos[0].pid = (unsigned)getpid() + pid_offset;
        infos[0].usedGpuMemory = m > lag ? m - lag : 0;
    }
    return NVML_SUCCESS;
}
