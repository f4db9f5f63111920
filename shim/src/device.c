/*
 * device.c - which region device a CUDA or NVML device is: by UUID, else by CUDA ordinal.
 */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "shim.h"

#define MAX_ORDINALS 64
#define MAP_UNKNOWN (-2)

/* CUDA ordinal -> region device + 1 (0 = not looked up yet); atomic ints */
static int g_ordinal_map[MAX_ORDINALS];

void shim_format_uuid(const CUuuid *uuid, char out[48])
{
    const unsigned char *b = (const unsigned char *)uuid->bytes;
    snprintf(out, 48,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

int shim_region_dev_for_uuid(const char *uuid)
{
    for (int d = 0; d < g_shim.device_count; d++) {
        char want[VGPU_UUID_LEN];
        memcpy(want, g_shim.ctl->devices[d].uuid, sizeof want);
        want[sizeof want - 1] = '\0';
        if (want[0] != '\0' && strcasecmp(want, uuid) == 0)
            return d;
    }
    return -1;
}

static int lookup(CUdevice dev)
{
    typedef CUresult (*uuid_fn)(CUuuid *, CUdevice);
    uuid_fn get = (uuid_fn)shim_real_by_name("cuDeviceGetUuid_v2", false);
    if (get == NULL)
        get = (uuid_fn)shim_real_by_name("cuDeviceGetUuid", false);
    CUuuid raw;
    if (get != NULL && get(&raw, dev) == CUDA_SUCCESS) {
        char text[48];
        shim_format_uuid(&raw, text);
        int d = shim_region_dev_for_uuid(text);
        if (d >= 0)
            return d;
        /* the region names this GPU by UUID elsewhere? then it is not ours */
        for (int i = 0; i < g_shim.device_count; i++)
            if (strncmp(g_shim.ctl->devices[i].uuid, "GPU-", 4) == 0)
                return -1;
    }
    /* no UUIDs to compare: the container sees its devices in region order */
    return dev >= 0 && dev < g_shim.device_count ? dev : -1;
}

int shim_region_dev_for_cuda(CUdevice dev)
{
    if (dev < 0 || dev >= MAX_ORDINALS)
        return -1;
    int cached = __atomic_load_n(&g_ordinal_map[dev], __ATOMIC_RELAXED);
    if (cached != 0)
        return cached == MAP_UNKNOWN ? -1 : cached - 1;
    int d = lookup(dev);
    __atomic_store_n(&g_ordinal_map[dev], d < 0 ? MAP_UNKNOWN : d + 1, __ATOMIC_RELAXED);
    return d;
}

int shim_region_dev_current(void)
{
    typedef CUresult (*ctx_dev_fn)(CUdevice *);
    static ctx_dev_fn get; /* atomic */
    ctx_dev_fn fn = __atomic_load_n(&get, __ATOMIC_RELAXED);
    if (fn == NULL) {
        fn = (ctx_dev_fn)shim_real_by_name("cuCtxGetDevice", false);
        if (fn == NULL)
            return -1;
        __atomic_store_n(&get, fn, __ATOMIC_RELAXED);
    }
    CUdevice dev;
    if (fn(&dev) != CUDA_SUCCESS)
        return -1;
    return shim_region_dev_for_cuda(dev);
}
