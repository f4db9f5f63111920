/*
 * hooks.c - the exported CUDA driver entry points: memory accounting and launch pacing.
 *
 * Every hook forwards to the real driver function of the same name; it only adds a check before
 * and bookkeeping after. A hook whose real function cannot be found returns
 * CUDA_ERROR_NOT_INITIALIZED (the driver is not there).
 */
#include "bucket.h"
#include "shim.h"

#define GATE_OR_PASS(expr)                                                                        \
    do {                                                                                          \
        enum shim_mode mode_ = shim_mode();                                                       \
        if (mode_ == SHIM_FAIL_CLOSED)                                                            \
            return CUDA_ERROR_NOT_INITIALIZED;                                                    \
        if (mode_ != SHIM_ACTIVE)                                                                 \
            return (expr);                                                                        \
    } while (0)

#define NEED_REAL(name)                                                                           \
    __typeof__(&name) real_ = REAL(name);                                                         \
    if (real_ == NULL)                                                                            \
        return CUDA_ERROR_NOT_INITIALIZED

/* Reserve, allocate, then record (or give the reservation back when the driver fails). */
#define ACCOUNTED_ALLOC(rdev, bytes, ptr_expr, call)                                              \
    do {                                                                                          \
        CUresult r_ = shim_mem_reserve((rdev), (bytes));                                          \
        if (r_ != CUDA_SUCCESS)                                                                   \
            return r_;                                                                            \
        r_ = (call);                                                                              \
        if (r_ == CUDA_SUCCESS)                                                                   \
            shim_track_add(TRACK_PTR, (uint64_t)(ptr_expr), (rdev), (bytes));                     \
        else                                                                                      \
            shim_mem_unreserve((rdev), (bytes));                                                  \
        return r_;                                                                                \
    } while (0)

SHIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    NEED_REAL(cuMemAlloc_v2);
    GATE_OR_PASS(real_(dptr, bytesize));
    if (dptr == NULL)
        return real_(dptr, bytesize);
    int rdev = shim_region_dev_current();
    CUresult r = shim_mem_reserve(rdev, bytesize);
    if (r != CUDA_SUCCESS)
        return r;
    r = real_(dptr, bytesize);
    if (r == CUDA_SUCCESS) {
        shim_track_add(TRACK_PTR, (uint64_t)*dptr, rdev, bytesize);
        return r;
    }
    shim_mem_unreserve(rdev, bytesize);
    /* within the limit but not on the card: spill when the agent asked for it */
    if (r == CUDA_ERROR_OUT_OF_MEMORY && shim_spill_alloc(rdev, dptr, bytesize) == CUDA_SUCCESS)
        return CUDA_SUCCESS;
    return r;
}

SHIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    NEED_REAL(cuMemAllocManaged);
    GATE_OR_PASS(real_(dptr, bytesize, flags));
    if (dptr == NULL)
        return real_(dptr, bytesize, flags);
    int rdev = shim_region_dev_current();
    ACCOUNTED_ALLOC(rdev, bytesize, *dptr, real_(dptr, bytesize, flags));
}

SHIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                        size_t Height, unsigned int ElementSizeBytes)
{
    NEED_REAL(cuMemAllocPitch_v2);
    GATE_OR_PASS(real_(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes));
    if (dptr == NULL || pPitch == NULL)
        return real_(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    int rdev = shim_region_dev_current();
    /* the pitch is the driver's choice: reserve the least it can be, then settle the rest */
    uint64_t least = (uint64_t)WidthInBytes * Height;
    CUresult r = shim_mem_reserve(rdev, least);
    if (r != CUDA_SUCCESS)
        return r;
    r = real_(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (r != CUDA_SUCCESS) {
        shim_mem_unreserve(rdev, least);
        return r;
    }
    uint64_t actual = (uint64_t)*pPitch * Height;
    if (actual > least && shim_mem_reserve(rdev, actual - least) != CUDA_SUCCESS) {
        __typeof__(&cuMemFree_v2) release = REAL(cuMemFree_v2);
        if (release != NULL)
            release(*dptr);
        shim_mem_unreserve(rdev, least);
        *dptr = 0;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    shim_track_add(TRACK_PTR, *dptr, rdev, actual > least ? actual : least);
    return CUDA_SUCCESS;
}

/* Forget the pointer first (the driver may hand the address out again at once), free, settle.
 * Device and spilled (managed) pointers alike: the record says what its bytes count as. */
SHIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    NEED_REAL(cuMemFree_v2);
    GATE_OR_PASS(real_(dptr));
    struct shim_tracked rec;
    bool had = shim_track_get(TRACK_PTR, dptr, &rec, true);
    CUresult r = real_(dptr);
    if (had) {
        if (r != CUDA_SUCCESS) {
            shim_track_put(TRACK_PTR, dptr, &rec);
        } else {
            shim_mem_unreserve_kind(rec.rdev, rec.bytes, rec.mkind);
            if (rec.mkind == KIND_SPILLED)
                shim_spill_released();
        }
    }
    return r;
}

/* IPC handles of spilled memory would hand other processes managed memory as if it were device
 * memory: refused with the error the driver gives for managed memory. */
SHIM_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    NEED_REAL(cuIpcGetMemHandle);
    GATE_OR_PASS(real_(pHandle, dptr));
    if (shim_spill_is_spilled(dptr))
        return CUDA_ERROR_INVALID_VALUE;
    return real_(pHandle, dptr);
}

SHIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    NEED_REAL(cuMemGetInfo_v2);
    GATE_OR_PASS(real_(free_bytes, total_bytes));
    CUresult r = real_(free_bytes, total_bytes);
    int rdev = shim_region_dev_current();
    if (r != CUDA_SUCCESS || rdev < 0 || free_bytes == NULL || total_bytes == NULL)
        return r;
    uint64_t limit = __atomic_load_n(&g_shim.ctl->devices[rdev].memory_limit, __ATOMIC_RELAXED);
    if (limit == 0)
        return r;
    shim_reclaim_dead_slots_now_and_then(); /* what a killed process held is not in use */
    shim_pools_settle_all_if_free();        /* what pools gave back since */
    uint64_t used = __atomic_load_n(&g_shim.st->devices[rdev].memory_used, __ATOMIC_RELAXED);
    if (shim_spill_enabled(rdev)) {
        /* what does not fit the card spills: the limit is the container's device size */
        *free_bytes = (size_t)(used < limit ? limit - used : 0);
        *total_bytes = (size_t)limit;
        return r;
    }
    uint64_t total = limit < *total_bytes ? limit : *total_bytes; /* never more than physical */
    uint64_t free_in_limit = used < total ? total - used : 0;
    if (free_in_limit < *free_bytes)
        *free_bytes = (size_t)free_in_limit;
    *total_bytes = (size_t)total;
    return r;
}

/* What frameworks read as the device's memory size (cudaGetDeviceProperties.totalGlobalMem). */
SHIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    NEED_REAL(cuDeviceTotalMem_v2);
    CUresult r = real_(bytes, dev);
    if (r != CUDA_SUCCESS || bytes == NULL || shim_mode() != SHIM_ACTIVE)
        return r;
    int rdev = shim_region_dev_for_cuda(dev);
    if (rdev < 0)
        return r;
    uint64_t limit = __atomic_load_n(&g_shim.ctl->devices[rdev].memory_limit, __ATOMIC_RELAXED);
    if (limit != 0 && (limit < *bytes || shim_spill_enabled(rdev)))
        *bytes = (size_t)limit;
    return r;
}

/* ---------------------------------------------------------------- launches */

/* A launch into a stream being captured records a node and runs nothing: it spends nothing. */
#define CAPTURING(stream, per_thread) shim_capturing((stream), (per_thread))

#define LAUNCH(name, per_thread)                                                                  \
    SHIM_EXPORT CUresult name(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,    \
                              unsigned int bx, unsigned int by, unsigned int bz,                  \
                              unsigned int shmem, CUstream hStream, void **params, void **extra)  \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        if (CAPTURING(hStream, per_thread))                                                       \
            return real_(f, gx, gy, gz, bx, by, bz, shmem, hStream, params, extra);               \
        CUresult r_ = shim_launch_gate(vgpu_launch_cost(gx, gy, gz, bx, by, bz), false);          \
        if (r_ != CUDA_SUCCESS)                                                                   \
            return r_;                                                                            \
        return real_(f, gx, gy, gz, bx, by, bz, shmem, hStream, params, extra);                   \
    }
LAUNCH(cuLaunchKernel, false)
LAUNCH(cuLaunchKernel_ptsz, true)

#define LAUNCH_EX(name, per_thread)                                                               \
    SHIM_EXPORT CUresult name(const CUlaunchConfig *config, CUfunction f, void **params,          \
                              void **extra)                                                       \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        if (config != NULL && !CAPTURING(config->hStream, per_thread)) {                                                                     \
            CUresult r_ = shim_launch_gate(                                                       \
                vgpu_launch_cost(config->gridDimX, config->gridDimY, config->gridDimZ,            \
                                 config->blockDimX, config->blockDimY, config->blockDimZ),        \
                false);                                                                           \
            if (r_ != CUDA_SUCCESS)                                                               \
                return r_;                                                                        \
        }                                                                                         \
        return real_(config, f, params, extra);                                                   \
    }
LAUNCH_EX(cuLaunchKernelEx, false)
LAUNCH_EX(cuLaunchKernelEx_ptsz, true)

#define LAUNCH_COOP(name, per_thread)                                                             \
    SHIM_EXPORT CUresult name(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,    \
                              unsigned int bx, unsigned int by, unsigned int bz,                  \
                              unsigned int shmem, CUstream hStream, void **params)                \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        if (CAPTURING(hStream, per_thread))                                                       \
            return real_(f, gx, gy, gz, bx, by, bz, shmem, hStream, params);                      \
        CUresult r_ = shim_launch_gate(vgpu_launch_cost(gx, gy, gz, bx, by, bz), false);          \
        if (r_ != CUDA_SUCCESS)                                                                   \
            return r_;                                                                            \
        return real_(f, gx, gy, gz, bx, by, bz, shmem, hStream, params);                          \
    }
LAUNCH_COOP(cuLaunchCooperativeKernel, false)
LAUNCH_COOP(cuLaunchCooperativeKernel_ptsz, true)

/* A graph costs the sum of its kernel nodes (src/graphs.c); an unpriced one at least graph_cost. */
#define LAUNCH_GRAPH(name, per_thread)                                                            \
    SHIM_EXPORT CUresult name(CUgraphExec hGraphExec, CUstream hStream)                           \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        enum shim_mode mode_ = shim_mode();                                                       \
        if (mode_ != SHIM_ACTIVE) {                                                               \
            if (mode_ == SHIM_FAIL_CLOSED)                                                        \
                return CUDA_ERROR_NOT_INITIALIZED;                                                \
            return real_(hGraphExec, hStream);                                                    \
        }                                                                                         \
        if (shim_capturing(hStream, per_thread))                                                  \
            return real_(hGraphExec, hStream);                                                    \
        uint64_t cost_;                                                                           \
        bool floor_ = shim_graph_price(hGraphExec, &cost_);                                       \
        CUresult r_ = shim_launch_gate(cost_, floor_);                                            \
        if (r_ != CUDA_SUCCESS)                                                                   \
            return r_;                                                                            \
        return real_(hGraphExec, hStream);                                                        \
    }
LAUNCH_GRAPH(cuGraphLaunch, false)
LAUNCH_GRAPH(cuGraphLaunch_ptsz, true)
