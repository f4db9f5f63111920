/*
 * spill.c - memory scaling above 1 with VGPU_CONTROL_FLAG_SPILL: a plain allocation that fits the
 * container's limit but not the card is served with managed memory, which the driver keeps on
 * the device while it fits and migrates to host memory under pressure.
 *
 * A spilled pointer is an ordinary tracked pointer (TRACK_PTR) whose record counts its bytes as
 * KIND_SPILLED: cuMemFree and cuMemFreeAsync give it back through the same path as device memory,
 * and the record is what tells the IPC hook that a pointer is managed. The table is the tracking
 * table (thread-safe under its lock, reset in a forked child); its spilled records are bounded by
 * SHIM_SPILL_MAX per process so a runaway loop of small spills cannot grow it without end.
 */
#define _GNU_SOURCE
#include "shim.h"

static int g_spill_count; /* spilled records this process holds (atomic) */

bool shim_spill_enabled(int rdev)
{
    if (rdev < 0 || g_shim.ext == NULL) /* a 1.0 state has no word to count spilled bytes in */
        return false;
    uint64_t flags = __atomic_load_n(&g_shim.ctl->devices[rdev].flags, __ATOMIC_RELAXED);
    return (flags & VGPU_CONTROL_FLAG_SPILL) != 0;
}

/* Managed memory prefers the device: its pages stay there while they fit. The advice is a hint:
 * a driver that refuses it still serves the memory (from wherever it is). */
static void prefer_device(CUdeviceptr ptr, uint64_t bytes)
{
    CUdevice dev;
    __typeof__(&cuCtxGetDevice) get_dev =
        (__typeof__(&cuCtxGetDevice))shim_real_by_name("cuCtxGetDevice", false);
    if (get_dev == NULL || get_dev(&dev) != CUDA_SUCCESS)
        return;
    __typeof__(&cuMemAdvise_v2) advise2 =
        (__typeof__(&cuMemAdvise_v2))shim_real_by_name("cuMemAdvise_v2", false);
    if (advise2 != NULL) {
        CUmemLocation where = {CU_MEM_LOCATION_TYPE_DEVICE, dev};
        if (advise2(ptr, bytes, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, where) == CUDA_SUCCESS)
            return;
    }
    __typeof__(&cuMemAdvise) advise =
        (__typeof__(&cuMemAdvise))shim_real_by_name("cuMemAdvise", false);
    if (advise == NULL || advise(ptr, bytes, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, dev) != CUDA_SUCCESS)
        shim_warn_once("cannot advise the device as preferred location of spilled memory; it is "
                       "served all the same");
}

CUresult shim_spill_alloc(int rdev, CUdeviceptr *dptr, uint64_t bytes)
{
    if (!shim_spill_enabled(rdev) || bytes == 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    __typeof__(&cuMemAllocManaged) managed = REAL(cuMemAllocManaged);
    if (managed == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (__atomic_add_fetch(&g_spill_count, 1, __ATOMIC_ACQ_REL) > SHIM_SPILL_MAX) {
        __atomic_sub_fetch(&g_spill_count, 1, __ATOMIC_ACQ_REL);
        shim_warn_once("too many spilled allocations held at once; further ones are refused");
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* managed memory is page-granular: count what it takes, in the limit as well */
    uint64_t charged = shim_kind_bytes(KIND_SPILLED, bytes);
    if (charged < bytes || shim_mem_reserve_kind(rdev, charged, KIND_SPILLED) != CUDA_SUCCESS) {
        __atomic_sub_fetch(&g_spill_count, 1, __ATOMIC_ACQ_REL);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUdeviceptr ptr = 0;
    if (managed(&ptr, (size_t)bytes, CU_MEM_ATTACH_GLOBAL) != CUDA_SUCCESS) {
        shim_mem_unreserve_kind(rdev, charged, KIND_SPILLED);
        __atomic_sub_fetch(&g_spill_count, 1, __ATOMIC_ACQ_REL);
        return CUDA_ERROR_OUT_OF_MEMORY; /* the application asked for device memory: its error */
    }
    prefer_device(ptr, bytes);
    struct shim_tracked rec = {rdev, KIND_SPILLED, charged, 0};
    shim_track_put(TRACK_PTR, ptr, &rec);
    *dptr = ptr;
    return CUDA_SUCCESS;
}

/* Called by the free paths when a KIND_SPILLED record is given back. */
void shim_spill_released(void)
{
    int left = __atomic_sub_fetch(&g_spill_count, 1, __ATOMIC_ACQ_REL);
    if (left < 0)
        __atomic_store_n(&g_spill_count, 0, __ATOMIC_RELAXED);
}

bool shim_spill_is_spilled(CUdeviceptr ptr)
{
    struct shim_tracked rec;
    return shim_track_get(TRACK_PTR, ptr, &rec, false) && rec.mkind == KIND_SPILLED;
}

void shim_spill_forget(void)
{
    __atomic_store_n(&g_spill_count, 0, __ATOMIC_RELAXED);
}
