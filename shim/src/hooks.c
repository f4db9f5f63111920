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
    ACCOUNTED_ALLOC(rdev, bytesize, *dptr, real_(dptr, bytesize));
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

/* Forget the pointer first (the driver may hand the address out again at once), free, settle. */
#define FREE_TRACKED(kind, key, call)                                                             \
    do {                                                                                          \
        int rdev_ = -1;                                                                           \
        uint64_t bytes_ = 0;                                                                      \
        bool had_ = shim_track_take((kind), (key), &rdev_, &bytes_);                              \
        CUresult r_ = (call);                                                                     \
        if (had_) {                                                                               \
            if (r_ == CUDA_SUCCESS)                                                               \
                shim_mem_unreserve(rdev_, bytes_);                                                \
            else                                                                                  \
                shim_track_add((kind), (key), rdev_, bytes_);                                     \
        }                                                                                         \
        return r_;                                                                                \
    } while (0)

SHIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    NEED_REAL(cuMemFree_v2);
    GATE_OR_PASS(real_(dptr));
    FREE_TRACKED(TRACK_PTR, dptr, real_(dptr));
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
    if (limit != 0 && limit < *bytes)
        *bytes = (size_t)limit;
    return r;
}

/* ---------------------------------------------------------------- launches */

#define LAUNCH(name)                                                                              \
    SHIM_EXPORT CUresult name(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,    \
                              unsigned int bx, unsigned int by, unsigned int bz,                  \
                              unsigned int shmem, CUstream hStream, void **params, void **extra)  \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        CUresult r_ = shim_launch_gate(vgpu_launch_cost(gx, gy, gz, bx, by, bz), false);          \
        if (r_ != CUDA_SUCCESS)                                                                   \
            return r_;                                                                            \
        return real_(f, gx, gy, gz, bx, by, bz, shmem, hStream, params, extra);                   \
    }
LAUNCH(cuLaunchKernel)
LAUNCH(cuLaunchKernel_ptsz)

#define LAUNCH_EX(name)                                                                           \
    SHIM_EXPORT CUresult name(const CUlaunchConfig *config, CUfunction f, void **params,          \
                              void **extra)                                                       \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        if (config != NULL) {                                                                     \
            CUresult r_ = shim_launch_gate(                                                       \
                vgpu_launch_cost(config->gridDimX, config->gridDimY, config->gridDimZ,            \
                                 config->blockDimX, config->blockDimY, config->blockDimZ),        \
                false);                                                                           \
            if (r_ != CUDA_SUCCESS)                                                               \
                return r_;                                                                        \
        }                                                                                         \
        return real_(config, f, params, extra);                                                   \
    }
LAUNCH_EX(cuLaunchKernelEx)
LAUNCH_EX(cuLaunchKernelEx_ptsz)

#define LAUNCH_COOP(name)                                                                         \
    SHIM_EXPORT CUresult name(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,    \
                              unsigned int bx, unsigned int by, unsigned int bz,                  \
                              unsigned int shmem, CUstream hStream, void **params)                \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        CUresult r_ = shim_launch_gate(vgpu_launch_cost(gx, gy, gz, bx, by, bz), false);          \
        if (r_ != CUDA_SUCCESS)                                                                   \
            return r_;                                                                            \
        return real_(f, gx, gy, gz, bx, by, bz, shmem, hStream, params);                          \
    }
LAUNCH_COOP(cuLaunchCooperativeKernel)
LAUNCH_COOP(cuLaunchCooperativeKernel_ptsz)

#define LAUNCH_GRAPH(name)                                                                        \
    SHIM_EXPORT CUresult name(CUgraphExec hGraphExec, CUstream hStream)                           \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        CUresult r_ = shim_launch_gate(0, true);                                                  \
        if (r_ != CUDA_SUCCESS)                                                                   \
            return r_;                                                                            \
        return real_(hGraphExec, hStream);                                                        \
    }
LAUNCH_GRAPH(cuGraphLaunch)
LAUNCH_GRAPH(cuGraphLaunch_ptsz)
