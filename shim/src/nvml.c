/*
 * nvml.c - the container's NVML view of memory: the limit as total and the accounted use, so
 * that nvidia-smi inside the container shows its slice.
 */
#include <string.h>

#include "shim.h"

static int nvml_region_dev(nvmlDevice_t device)
{
    typedef nvmlReturn_t (*uuid_fn)(nvmlDevice_t, char *, unsigned int);
    uuid_fn get = (uuid_fn)shim_real_by_name("nvmlDeviceGetUUID", true);
    char uuid[VGPU_UUID_LEN];
    if (get == NULL || get(device, uuid, sizeof uuid) != NVML_SUCCESS)
        return -1;
    uuid[sizeof uuid - 1] = '\0';
    return shim_region_dev_for_uuid(uuid);
}

/* (total, used, free) for the region device, from the physical total; false to leave as is. */
static bool limited_view(nvmlDevice_t device, unsigned long long *total, unsigned long long *used,
                         unsigned long long *free_bytes)
{
    if (shim_mode() != SHIM_ACTIVE)
        return false;
    int rdev = nvml_region_dev(device);
    if (rdev < 0)
        return false;
    uint64_t limit = __atomic_load_n(&g_shim.ctl->devices[rdev].memory_limit, __ATOMIC_RELAXED);
    if (limit == 0)
        return false;
    shim_pools_settle_all_if_free(); /* what pools gave back since */
    uint64_t accounted = __atomic_load_n(&g_shim.st->devices[rdev].memory_used, __ATOMIC_RELAXED);
    uint64_t t = limit < *total ? limit : *total;
    *total = t;
    *used = accounted < t ? accounted : t;
    *free_bytes = t - *used;
    return true;
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    __typeof__(&nvmlDeviceGetMemoryInfo) real = REAL(nvmlDeviceGetMemoryInfo);
    if (real == NULL)
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = real(device, memory);
    if (r == NVML_SUCCESS && memory != NULL)
        limited_view(device, &memory->total, &memory->used, &memory->free);
    return r;
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    __typeof__(&nvmlDeviceGetMemoryInfo_v2) real = REAL(nvmlDeviceGetMemoryInfo_v2);
    if (real == NULL)
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = real(device, memory);
    if (r == NVML_SUCCESS && memory != NULL &&
        limited_view(device, &memory->total, &memory->used, &memory->free))
        memory->reserved = 0; /* the driver's reservation is outside the slice's view */
    return r;
}
