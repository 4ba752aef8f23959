/* fake_nvml.c: a GPU-free stand-in for libnvidia-ml.so.1.  Total memory is
 * FAKE_TOTAL (default 80 GiB), used FAKE_NVML_USED (default 1 GiB), reserved
 * 512 MiB; the UUID matches the fake libcuda's device. */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_abi.h"

#define EXPORT __attribute__((visibility("default")))
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25

static unsigned long long total = 80ULL << 30, used = 1ULL << 30;

__attribute__((constructor)) static void fake_init(void)
{
    const char *v;
    if ((v = getenv("FAKE_TOTAL"))) total = strtoull(v, NULL, 0);
    if ((v = getenv("FAKE_NVML_USED"))) used = strtoull(v, NULL, 0);
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) { *n = 1; return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d)
{
    if (i != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *d = (nvmlDevice_t)(uintptr_t)0x100;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned int len)
{
    if (d != (nvmlDevice_t)(uintptr_t)0x100) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(buf, len, "GPU-5b3b5d0c-1f2e-4a77-9c10-abcdef012300");
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    if (d != (nvmlDevice_t)(uintptr_t)0x100 || !m) return NVML_ERROR_INVALID_ARGUMENT;
    m->total = total;
    m->used = used;
    m->free = total - used;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    if (d != (nvmlDevice_t)(uintptr_t)0x100 || !m) return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != GS_NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    m->total = total;
    m->reserved = 512ULL << 20;
    m->used = used;
    m->free = total - used;
    return NVML_SUCCESS;
}
