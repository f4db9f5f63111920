/*
 * fake_nvml.c - the few NVML calls the shim hooks, for the in-container memory view test.
 * Devices and UUIDs match fake_cuda.c; each reports FAKE_CUDA_MEMORY bytes total (default 16 GiB)
 * and a fixed 1 GiB used by "other" processes, as a real shared GPU would, plus what the fake
 * driver holds on the device in this process (its fakeCudaDeviceUsed, when it is loaded).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "fake_ids.h"
#include "nvml_subset.h"

#define EXPORT __attribute__((visibility("default")))

static int g_init;

static unsigned long long total_memory(void)
{
    const char *m = getenv("FAKE_CUDA_MEMORY");
    return m != NULL ? strtoull(m, NULL, 10) : 16ull << 30;
}

EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    g_init = 1;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!g_init)
        return NVML_ERROR_UNINITIALIZED;
    if (index >= 8 || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)(unsigned long)(0x100 + index);
    return NVML_SUCCESS;
}

static int index_of(nvmlDevice_t device)
{
    unsigned long v = (unsigned long)device;
    return v >= 0x100 && v < 0x108 ? (int)(v - 0x100) : -1;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!g_init)
        return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < 8; i++) {
        char text[48];
        fake_uuid_text((int)i, text);
        if (strcmp(text, uuid) == 0) {
            *device = (nvmlDevice_t)(unsigned long)(0x100 + i);
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

static unsigned long long driver_used(int index)
{
    typedef unsigned long long (*used_fn)(int);
    used_fn used = (used_fn)dlsym(RTLD_DEFAULT, "fakeCudaDeviceUsed");
    return used != NULL ? used(index) : 0;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    int i = index_of(device);
    if (!g_init)
        return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || uuid == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    char text[48];
    fake_uuid_text(i, text);
    if (strlen(text) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(uuid, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    if (!g_init)
        return NVML_ERROR_UNINITIALIZED;
    if (index_of(device) < 0 || memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = total_memory();
    memory->used = (1ull << 30) + driver_used(index_of(device));
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    if (memory == NULL || memory->version != nvmlMemory_v2)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlMemory_t v1;
    nvmlReturn_t r = nvmlDeviceGetMemoryInfo(device, &v1);
    if (r != NVML_SUCCESS)
        return r;
    memory->total = v1.total;
    memory->reserved = 300ull << 20;
    memory->used = v1.used - memory->reserved;
    memory->free = v1.free;
    return NVML_SUCCESS;
}
