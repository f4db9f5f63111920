/*
 * legacy_launch.c - the launch entry points from before cuLaunchKernel, and multi-device
 * cooperative launches, paced like the others.
 *
 * cuLaunch, cuLaunchGrid and cuLaunchGridAsync take their block shape from an earlier
 * cuFuncSetBlockShape on the function: the shim remembers it per function (a bounded table of
 * 4096 functions; a function whose shape it does not know costs one thread per block). cuLaunchCooperativeKernelMultiDevice launches one kernel
 * per device: each is paced on its own device's bucket (the device of its stream through
 * cuStreamGetDevice where the driver has it, else the current context's).
 */
#define _GNU_SOURCE
#include <pthread.h>

#include "bucket.h"
#include "ptrtable.h"
#include "shim.h"

#define SHAPE_TABLE_SIZE 4096
#define SHAPE_BITS 21
#define SHAPE_MASK ((UINT64_C(1) << SHAPE_BITS) - 1)

static struct ptr_slot g_shape_slots[SHAPE_TABLE_SIZE];
static struct ptr_table g_shapes = {g_shape_slots, SHAPE_TABLE_SIZE - 1, PTHREAD_MUTEX_INITIALIZER};

#define NEED_REAL(name)                                                                           \
    __typeof__(&name) real_ = REAL(name);                                                         \
    if (real_ == NULL)                                                                            \
    return CUDA_ERROR_NOT_INITIALIZED

static unsigned dim(int v)
{
    return v <= 0 ? 0u : (unsigned)v;
}

SHIM_EXPORT CUresult cuFuncSetBlockShape(CUfunction hfunc, int x, int y, int z)
{
    NEED_REAL(cuFuncSetBlockShape);
    CUresult r = real_(hfunc, x, y, z);
    if (r != CUDA_SUCCESS || (uintptr_t)hfunc <= PTR_TOMBSTONE || shim_mode() != SHIM_ACTIVE)
        return r;
    uint64_t packed = ((uint64_t)dim(x) & SHAPE_MASK) | (((uint64_t)dim(y) & SHAPE_MASK) << 21) |
                      (((uint64_t)dim(z) & SHAPE_MASK) << 42);
    pthread_mutex_lock(&g_shapes.lock);
    bool existed;
    struct ptr_slot *s = ptr_insert_locked(&g_shapes, (uintptr_t)hfunc, packed, NULL, &existed);
    if (s != NULL && existed)
        __atomic_store_n(&s->value, packed, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_shapes.lock);
    return r;
}

static uint64_t legacy_cost(CUfunction f, int grid_w, int grid_h)
{
    uint64_t packed;
    unsigned bx = 1, by = 1, bz = 1;
    if (ptr_lookup(&g_shapes, (uintptr_t)f, &packed)) {
        bx = (unsigned)(packed & SHAPE_MASK);
        by = (unsigned)((packed >> 21) & SHAPE_MASK);
        bz = (unsigned)((packed >> 42) & SHAPE_MASK);
    }
    return vgpu_launch_cost(dim(grid_w), dim(grid_h), 1, bx, by, bz);
}

SHIM_EXPORT CUresult cuLaunch(CUfunction f)
{
    NEED_REAL(cuLaunch);
    if (shim_capturing(NULL, false))
        return real_(f);
    CUresult r = shim_launch_gate(legacy_cost(f, 1, 1), false);
    return r != CUDA_SUCCESS ? r : real_(f);
}

SHIM_EXPORT CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    NEED_REAL(cuLaunchGrid);
    if (shim_capturing(NULL, false))
        return real_(f, grid_width, grid_height);
    CUresult r = shim_launch_gate(legacy_cost(f, grid_width, grid_height), false);
    return r != CUDA_SUCCESS ? r : real_(f, grid_width, grid_height);
}

SHIM_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height,
                                       CUstream hStream)
{
    NEED_REAL(cuLaunchGridAsync);
    if (shim_capturing(hStream, false))
        return real_(f, grid_width, grid_height, hStream);
    CUresult r = shim_launch_gate(legacy_cost(f, grid_width, grid_height), false);
    return r != CUDA_SUCCESS ? r : real_(f, grid_width, grid_height, hStream);
}

typedef CUresult (*stream_device_fn)(CUstream, CUdevice *);

static int stream_region_dev(CUstream s)
{
    static stream_device_fn cached; /* atomic */
    stream_device_fn fn = __atomic_load_n(&cached, __ATOMIC_ACQUIRE);
    if (fn == NULL) {
        fn = (stream_device_fn)shim_real_by_name("cuStreamGetDevice", false);
        __atomic_store_n(&cached, fn, __ATOMIC_RELEASE);
    }
    CUdevice dev;
    if (fn != NULL && fn(s, &dev) == CUDA_SUCCESS)
        return shim_region_dev_for_cuda(dev);
    return shim_region_dev_current();
}

SHIM_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                                          unsigned int numDevices,
                                                          unsigned int flags)
{
    NEED_REAL(cuLaunchCooperativeKernelMultiDevice);
    enum shim_mode mode = shim_mode();
    if (mode == SHIM_FAIL_CLOSED)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (mode == SHIM_ACTIVE && launchParamsList != NULL && numDevices <= 64) {
        for (unsigned i = 0; i < numDevices; i++) {
            const CUDA_LAUNCH_PARAMS *p = &launchParamsList[i];
            uint64_t cost = vgpu_launch_cost(p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX,
                                             p->blockDimY, p->blockDimZ);
            CUresult r = shim_launch_gate_dev(stream_region_dev(p->hStream), cost, false);
            if (r != CUDA_SUCCESS)
                return r;
        }
    }
    return real_(launchParamsList, numDevices, flags);
}

static void shapes_prepare(void)
{
    pthread_mutex_lock(&g_shapes.lock);
}

static void shapes_release(void)
{
    pthread_mutex_unlock(&g_shapes.lock);
}

__attribute__((constructor)) static void shapes_load(void)
{
    pthread_atfork(shapes_prepare, shapes_release, shapes_release);
}
