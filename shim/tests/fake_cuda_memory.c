/*
 * fake_cuda_memory.c - the fake driver's memory that is not a plain allocation, each kind held in
 * the device's used memory (what cuMemGetInfo and the fake NVML report):
 *
 *   contexts     cuCtxCreate_v2/_v3/_v4 and the primary context (retain/release/reset) each hold
 *                FAKE_CUDA_CONTEXT_MEMORY bytes (default 0, so tests of plain allocations see
 *                none); cuCtxSetLimit holds the heap above 8 MiB, the stack above 1 KiB for
 *                FAKE_STACK_THREADS threads and the printf FIFO above 1 MiB;
 *   modules      cuModuleLoad* / cuLibraryLoad* of a fake image ("FAKEMOD1" then the bytes it
 *                holds on the device, little-endian u64; in memory or as a file);
 *   pools        the device's default pool and cuMemPoolCreate pools reserve in 2 MiB chunks,
 *                keep what is freed into them, give back what exceeds the release threshold at
 *                cuCtxSynchronize / cuStreamSynchronize, and down to a floor at cuMemPoolTrimTo;
 *                pools of host memory hold no device memory;
 *   graph memory fakeCudaGraphMemReserve(dev, bytes) stands for graph memory nodes;
 *                cuDeviceGraphMemTrim gives it back;
 *   VMM          cuMemCreate (device memory; host and host-NUMA locations hold none) lives until
 *                it is released and unmapped everywhere; cuMemRetainAllocationHandle adds a
 *                reference;
 *   arrays       rows padded to 512 bytes, the whole rounded up to 64 KiB (what
 *                cuArrayGetMemoryRequirements reports), each mipmap level alike.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_subset.h"
#include "fake_cuda_internal.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEV 8
#define MAX_CTX 256
#define MAX_POOLS 64
#define MAX_POOL_ALLOCS 8192
#define MAX_MODULES 256
#define MAX_VMM 1024
#define MAX_MAPS 1024
#define MAX_ARRAYS 1024
#define POOL_CHUNK (2ull << 20)
#define FAKE_STACK_THREADS 4096ull
#define DEFAULT_HEAP (8ull << 20)
#define DEFAULT_STACK 1024ull
#define DEFAULT_FIFO (1ull << 20)
#define CTX_BASE 0x10000u
#define POOL_BASE 0x50000u

static pthread_mutex_t g_mlock = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_ctx = -1; /* index of this thread's current context */

/* like a driver that survives fork: the lock is never held across it */
static void mem_fork_prepare(void)
{
    pthread_mutex_lock(&g_mlock);
}

static void mem_fork_release(void)
{
    pthread_mutex_unlock(&g_mlock);
}

__attribute__((constructor)) static void fake_memory_load(void)
{
    pthread_atfork(mem_fork_prepare, mem_fork_release, mem_fork_release);
}

static uint64_t round_up(uint64_t v, uint64_t to)
{
    return (v + to - 1) / to * to;
}

static uint64_t context_memory(void)
{
    const char *v = getenv("FAKE_CUDA_CONTEXT_MEMORY");
    return v != NULL ? strtoull(v, NULL, 10) : 0;
}

/* ------------------------------------------------------------------ contexts */

static struct {
    int used, dev, primary;
    uint64_t held;                       /* the context's own memory */
    uint64_t heap, stack, fifo;          /* limits as set */
} g_ctx[MAX_CTX];
static struct {
    int refs;
    int ctx; /* index, -1 none */
} g_primary[MAX_DEV] = {[0 ... MAX_DEV - 1] = {0, -1}};

static CUcontext ctx_handle(int i)
{
    return (CUcontext)(uintptr_t)(CTX_BASE + (unsigned)i * 16u);
}

static int ctx_index(CUcontext c)
{
    uintptr_t v = (uintptr_t)c;
    if (v < CTX_BASE || (v - CTX_BASE) % 16 != 0 || (v - CTX_BASE) / 16 >= MAX_CTX)
        return -1;
    int i = (int)((v - CTX_BASE) / 16);
    return g_ctx[i].used ? i : -1;
}

static uint64_t limits_held(int i)
{
    uint64_t h = 0;
    if (g_ctx[i].heap > DEFAULT_HEAP)
        h += g_ctx[i].heap - DEFAULT_HEAP;
    if (g_ctx[i].stack > DEFAULT_STACK)
        h += (g_ctx[i].stack - DEFAULT_STACK) * FAKE_STACK_THREADS;
    if (g_ctx[i].fifo > DEFAULT_FIFO)
        h += g_ctx[i].fifo - DEFAULT_FIFO;
    return h;
}

/* Under g_mlock. */
static CUresult ctx_new(int dev, int primary, int *out)
{
    for (int i = 0; i < MAX_CTX; i++) {
        if (g_ctx[i].used)
            continue;
        uint64_t held = context_memory();
        if (held != 0 && fake_device_charge(dev, held) != CUDA_SUCCESS)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g_ctx[i].used = 1;
        g_ctx[i].dev = dev;
        g_ctx[i].primary = primary;
        g_ctx[i].held = held;
        g_ctx[i].heap = DEFAULT_HEAP;
        g_ctx[i].stack = DEFAULT_STACK;
        g_ctx[i].fifo = DEFAULT_FIFO;
        *out = i;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static void ctx_free(int i)
{
    fake_device_uncharge(g_ctx[i].dev, g_ctx[i].held + limits_held(i));
    g_ctx[i].used = 0;
}

static void set_current(int i)
{
    t_ctx = i;
    fake_set_current_dev(i < 0 ? -1 : g_ctx[i].dev);
}

static CUresult ctx_create(CUcontext *pctx, CUdevice dev)
{
    CUresult r = fake_need_ctx();
    if (r == CUDA_ERROR_NOT_INITIALIZED)
        return r;
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= fake_device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    int i;
    pthread_mutex_lock(&g_mlock);
    r = ctx_new(dev, 0, &i);
    pthread_mutex_unlock(&g_mlock);
    if (r != CUDA_SUCCESS)
        return r;
    set_current(i);
    *pctx = ctx_handle(i);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    (void)flags;
    return ctx_create(pctx, dev);
}

EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n,
                               unsigned int flags, CUdevice dev)
{
    (void)params, (void)n, (void)flags;
    return ctx_create(pctx, dev);
}

EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                               CUdevice dev)
{
    (void)params, (void)flags;
    return ctx_create(pctx, dev);
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    pthread_mutex_lock(&g_mlock);
    int i = ctx_index(ctx);
    if (i < 0 || g_ctx[i].primary) {
        pthread_mutex_unlock(&g_mlock);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    ctx_free(i);
    pthread_mutex_unlock(&g_mlock);
    if (t_ctx == i)
        set_current(-1);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    if (ctx == NULL) {
        set_current(-1);
        return CUDA_SUCCESS;
    }
    pthread_mutex_lock(&g_mlock);
    int i = ctx_index(ctx);
    pthread_mutex_unlock(&g_mlock);
    if (i < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    set_current(i);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_ctx < 0 ? NULL : ctx_handle(t_ctx);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= fake_device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mlock);
    CUresult r = CUDA_SUCCESS;
    if (g_primary[dev].ctx < 0)
        r = ctx_new(dev, 1, &g_primary[dev].ctx);
    if (r == CUDA_SUCCESS) {
        g_primary[dev].refs++;
        *pctx = ctx_handle(g_primary[dev].ctx);
    }
    pthread_mutex_unlock(&g_mlock);
    return r;
}

static void primary_drop(CUdevice dev)
{
    int i = g_primary[dev].ctx;
    if (i >= 0) {
        ctx_free(i);
        if (t_ctx == i)
            set_current(-1);
    }
    g_primary[dev].ctx = -1;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    if (dev < 0 || dev >= fake_device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mlock);
    CUresult r = CUDA_ERROR_INVALID_CONTEXT;
    if (g_primary[dev].refs > 0) {
        r = CUDA_SUCCESS;
        if (--g_primary[dev].refs == 0)
            primary_drop(dev);
    }
    pthread_mutex_unlock(&g_mlock);
    return r;
}

EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    if (dev < 0 || dev >= fake_device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mlock);
    primary_drop(dev);
    g_primary[dev].refs = 0;
    pthread_mutex_unlock(&g_mlock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    if (dev < 0 || dev >= fake_device_count() || flags == NULL || active == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mlock);
    *flags = 0;
    *active = g_primary[dev].ctx >= 0;
    pthread_mutex_unlock(&g_mlock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    CUresult r = fake_need_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&g_mlock);
    int i = t_ctx;
    uint64_t *slot = limit == CU_LIMIT_MALLOC_HEAP_SIZE   ? &g_ctx[i].heap
                     : limit == CU_LIMIT_STACK_SIZE        ? &g_ctx[i].stack
                     : limit == CU_LIMIT_PRINTF_FIFO_SIZE  ? &g_ctx[i].fifo
                                                           : NULL;
    if (slot == NULL) {
        pthread_mutex_unlock(&g_mlock);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    uint64_t before = limits_held(i), old = *slot;
    *slot = value;
    uint64_t after = limits_held(i);
    if (after > before && fake_device_charge(g_ctx[i].dev, after - before) != CUDA_SUCCESS) {
        *slot = old;
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (after < before) {
        fake_device_uncharge(g_ctx[i].dev, before - after);
    }
    pthread_mutex_unlock(&g_mlock);
    return r;
}

EXPORT CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)
{
    CUresult r = fake_need_ctx();
    if (r != CUDA_SUCCESS || pvalue == NULL)
        return r != CUDA_SUCCESS ? r : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mlock);
    int i = t_ctx;
    *pvalue = limit == CU_LIMIT_MALLOC_HEAP_SIZE ? g_ctx[i].heap
              : limit == CU_LIMIT_STACK_SIZE     ? g_ctx[i].stack
                                                 : g_ctx[i].fifo;
    pthread_mutex_unlock(&g_mlock);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ modules and libraries */

static struct {
    int used, dev;
    uint64_t held;
} g_mod[MAX_MODULES];

static CUresult image_bytes(const void *image, uint64_t *bytes)
{
    if (image == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (memcmp(image, "FAKEMOD1", 8) != 0)
        return (CUresult)200; /* CUDA_ERROR_INVALID_IMAGE */
    memcpy(bytes, (const char *)image + 8, sizeof *bytes);
    return CUDA_SUCCESS;
}

static CUresult file_bytes(const char *path, uint64_t *bytes)
{
    char head[16];
    FILE *f = path != NULL ? fopen(path, "rb") : NULL;
    if (f == NULL)
        return (CUresult)301; /* CUDA_ERROR_FILE_NOT_FOUND */
    size_t got = fread(head, 1, sizeof head, f);
    fclose(f);
    return got == sizeof head ? image_bytes(head, bytes) : (CUresult)200;
}

/* A module or library holding `bytes` on the current context's device (none without one: a
 * library loads into a context when one is used). */
static CUresult module_new(uint64_t bytes, uintptr_t *handle, bool need_context)
{
    int dev = fake_current_dev();
    if (dev < 0 && need_context)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_mlock);
    for (int i = 0; i < MAX_MODULES; i++) {
        if (g_mod[i].used)
            continue;
        uint64_t held = dev >= 0 ? bytes : 0;
        if (held != 0 && fake_device_charge(dev, held) != CUDA_SUCCESS) {
            pthread_mutex_unlock(&g_mlock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g_mod[i].used = 1;
        g_mod[i].dev = dev;
        g_mod[i].held = held;
        *handle = 0x90000u + (uintptr_t)i * 16u;
        pthread_mutex_unlock(&g_mlock);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mlock);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult module_drop(uintptr_t handle)
{
    if (handle < 0x90000u || (handle - 0x90000u) % 16 != 0 || (handle - 0x90000u) / 16 >= MAX_MODULES)
        return CUDA_ERROR_INVALID_HANDLE;
    int i = (int)((handle - 0x90000u) / 16);
    pthread_mutex_lock(&g_mlock);
    CUresult r = CUDA_ERROR_INVALID_HANDLE;
    if (g_mod[i].used) {
        if (g_mod[i].held != 0)
            fake_device_uncharge(g_mod[i].dev, g_mod[i].held);
        g_mod[i].used = 0;
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mlock);
    return r;
}

#define MODULE_OUT(out, bytes_expr, need)                                                         \
    do {                                                                                          \
        if ((out) == NULL)                                                                        \
            return CUDA_ERROR_INVALID_VALUE;                                                      \
        uint64_t bytes_;                                                                          \
        CUresult r_ = (bytes_expr);                                                               \
        uintptr_t h_;                                                                             \
        if (r_ == CUDA_SUCCESS)                                                                   \
            r_ = module_new(bytes_, &h_, (need));                                                 \
        if (r_ == CUDA_SUCCESS)                                                                   \
            *(out) = (__typeof__(*(out)))h_;                                                      \
        return r_;                                                                                \
    } while (0)

EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    MODULE_OUT(module, file_bytes(fname, &bytes_), true);
}

EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    MODULE_OUT(module, image_bytes(image, &bytes_), true);
}

EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int n,
                                   CUjit_option *options, void **values)
{
    (void)n, (void)options, (void)values;
    MODULE_OUT(module, image_bytes(image, &bytes_), true);
}

EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    MODULE_OUT(module, image_bytes(fatCubin, &bytes_), true);
}

EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    return module_drop((uintptr_t)hmod);
}

EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                  void **jitValues, unsigned int numJit,
                                  CUlibraryOption *libOptions, void **libValues,
                                  unsigned int numLib)
{
    (void)jitOptions, (void)jitValues, (void)numJit, (void)libOptions, (void)libValues,
        (void)numLib;
    MODULE_OUT(library, image_bytes(code, &bytes_), false);
}

EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName,
                                      CUjit_option *jitOptions, void **jitValues,
                                      unsigned int numJit, CUlibraryOption *libOptions,
                                      void **libValues, unsigned int numLib)
{
    (void)jitOptions, (void)jitValues, (void)numJit, (void)libOptions, (void)libValues,
        (void)numLib;
    MODULE_OUT(library, file_bytes(fileName, &bytes_), false);
}

EXPORT CUresult cuLibraryUnload(CUlibrary library)
{
    return module_drop((uintptr_t)library);
}

/* ------------------------------------------------------------------ pools */

static struct {
    int used;
    int dev; /* -1: host memory */
    uint64_t reserved, in_use, threshold, reserved_high, used_high;
} g_pool[MAX_POOLS];
static int g_current_pool[MAX_DEV]; /* index + 1; 0: the default pool, made when first asked */
static int g_default_pool[MAX_DEV]; /* index + 1 */
static struct {
    uint64_t ptr, size;
    int pool; /* index + 1; 0 free */
} g_palloc[MAX_POOL_ALLOCS];
static uint64_t g_next_pool_ptr = 0x7e0000000000ull;

static CUmemoryPool pool_handle(int i)
{
    return (CUmemoryPool)(uintptr_t)(POOL_BASE + (unsigned)i * 16u);
}

static int pool_index(CUmemoryPool p)
{
    uintptr_t v = (uintptr_t)p;
    if (v < POOL_BASE || (v - POOL_BASE) % 16 != 0 || (v - POOL_BASE) / 16 >= MAX_POOLS)
        return -1;
    int i = (int)((v - POOL_BASE) / 16);
    return g_pool[i].used ? i : -1;
}

/* Under g_mlock. */
static int pool_new(int dev)
{
    for (int i = 0; i < MAX_POOLS; i++)
        if (!g_pool[i].used) {
            memset(&g_pool[i], 0, sizeof g_pool[i]);
            g_pool[i].used = 1;
            g_pool[i].dev = dev;
            return i;
        }
    return -1;
}

static int default_pool(int dev)
{
    if (g_default_pool[dev] == 0) {
        int i = pool_new(dev);
        if (i < 0)
            return -1;
        g_default_pool[dev] = i + 1;
    }
    return g_default_pool[dev] - 1;
}

static int current_pool(int dev)
{
    return g_current_pool[dev] != 0 ? g_current_pool[dev] - 1 : default_pool(dev);
}

/* Give back what the pool holds above max(keep, in use), in whole chunks (under g_mlock). */
static void pool_shrink(int i, uint64_t keep)
{
    uint64_t floor = round_up(keep > g_pool[i].in_use ? keep : g_pool[i].in_use, POOL_CHUNK);
    if (g_pool[i].reserved > floor) {
        if (g_pool[i].dev >= 0)
            fake_device_uncharge(g_pool[i].dev, g_pool[i].reserved - floor);
        g_pool[i].reserved = floor;
    }
}

static CUresult pool_alloc(CUdeviceptr *dptr, size_t size, int i)
{
    if (dptr == NULL || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t idle = g_pool[i].reserved - g_pool[i].in_use;
    if (size > idle) {
        uint64_t grow = round_up(size - idle, POOL_CHUNK);
        if (g_pool[i].dev >= 0 && fake_device_charge(g_pool[i].dev, grow) != CUDA_SUCCESS)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g_pool[i].reserved += grow;
    }
    for (int k = 0; k < MAX_POOL_ALLOCS; k++)
        if (g_palloc[k].pool == 0) {
            g_palloc[k].ptr = g_next_pool_ptr;
            g_palloc[k].size = size;
            g_palloc[k].pool = i + 1;
            g_next_pool_ptr += round_up(size, 4096);
            g_pool[i].in_use += size;
            if (g_pool[i].reserved > g_pool[i].reserved_high)
                g_pool[i].reserved_high = g_pool[i].reserved;
            if (g_pool[i].in_use > g_pool[i].used_high)
                g_pool[i].used_high = g_pool[i].in_use;
            *dptr = g_palloc[k].ptr;
            fake_count_alloc();
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    (void)hStream;
    CUresult r = fake_need_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&g_mlock);
    int i = current_pool(fake_current_dev());
    r = i < 0 ? CUDA_ERROR_OUT_OF_MEMORY : pool_alloc(dptr, bytesize, i);
    pthread_mutex_unlock(&g_mlock);
    return r;
}

EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return cuMemAllocAsync(dptr, bytesize, hStream);
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                        CUstream hStream)
{
    (void)hStream;
    CUresult r = fake_need_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&g_mlock);
    int i = pool_index(pool);
    r = i < 0 ? CUDA_ERROR_INVALID_VALUE : pool_alloc(dptr, bytesize, i);
    pthread_mutex_unlock(&g_mlock);
    return r;
}

EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream)
{
    return cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream);
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    (void)hStream;
    pthread_mutex_lock(&g_mlock);
    for (int k = 0; k < MAX_POOL_ALLOCS; k++)
        if (g_palloc[k].pool != 0 && g_palloc[k].ptr == dptr) {
            g_pool[g_palloc[k].pool - 1].in_use -= g_palloc[k].size; /* the pool keeps it */
            g_palloc[k].pool = 0;
            pthread_mutex_unlock(&g_mlock);
            return CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&g_mlock);
    return cuMemFree_v2(dptr); /* memory from cuMemAlloc is freed at once */
}

EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return cuMemFreeAsync(dptr, hStream);
}

/* The pools give back what exceeds their release threshold. */
static void synchronize(void)
{
    pthread_mutex_lock(&g_mlock);
    for (int i = 0; i < MAX_POOLS; i++)
        if (g_pool[i].used)
            pool_shrink(i, g_pool[i].threshold);
    pthread_mutex_unlock(&g_mlock);
}

EXPORT CUresult cuCtxSynchronize(void)
{
    CUresult r = fake_need_ctx();
    if (r == CUDA_SUCCESS)
        synchronize();
    return r;
}

EXPORT CUresult cuStreamSynchronize(CUstream hStream)
{
    (void)hStream;
    return cuCtxSynchronize();
}

EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    if (pool == NULL || props == NULL || props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    int dev;
    if (props->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
        if (props->location.id < 0 || props->location.id >= fake_device_count())
            return CUDA_ERROR_INVALID_DEVICE;
        dev = props->location.id;
    } else if (props->location.type == CU_MEM_LOCATION_TYPE_HOST ||
               props->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
        dev = -1;
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&g_mlock);
    int i = pool_new(dev);
    pthread_mutex_unlock(&g_mlock);
    if (i < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = pool_handle(i);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    pthread_mutex_lock(&g_mlock);
    int i = pool_index(pool);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (i >= 0) {
        for (int k = 0; k < MAX_POOL_ALLOCS; k++)
            if (g_palloc[k].pool == i + 1)
                g_palloc[k].pool = 0; /* outstanding allocations go with it */
        if (g_pool[i].dev >= 0)
            fake_device_uncharge(g_pool[i].dev, g_pool[i].reserved);
        g_pool[i].used = 0;
        for (int d = 0; d < MAX_DEV; d++) {
            if (g_current_pool[d] == i + 1)
                g_current_pool[d] = 0;
            if (g_default_pool[d] == i + 1)
                g_default_pool[d] = 0;
        }
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_mlock);
    return r;
}

EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    pthread_mutex_lock(&g_mlock);
    int i = pool_index(pool);
    if (i >= 0)
        pool_shrink(i, minBytesToKeep);
    pthread_mutex_unlock(&g_mlock);
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    if (value == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mlock);
    int i = pool_index(pool);
    CUresult r = i < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (i >= 0 && attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        g_pool[i].threshold = *(cuuint64_t *)value;
    else if (i >= 0 && attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
        g_pool[i].reserved_high = g_pool[i].reserved;
    else if (i >= 0 && attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH)
        g_pool[i].used_high = g_pool[i].in_use;
    else if (i >= 0)
        r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_mlock);
    return r;
}

EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    if (value == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mlock);
    int i = pool_index(pool);
    CUresult r = CUDA_SUCCESS;
    cuuint64_t v = 0;
    if (i < 0)
        r = CUDA_ERROR_INVALID_VALUE;
    else if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        v = g_pool[i].threshold;
    else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
        v = g_pool[i].reserved;
    else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
        v = g_pool[i].reserved_high;
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        v = g_pool[i].in_use;
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH)
        v = g_pool[i].used_high;
    else
        r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_mlock);
    if (r == CUDA_SUCCESS)
        *(cuuint64_t *)value = v;
    return r;
}

EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    if (pool_out == NULL || dev < 0 || dev >= fake_device_count())
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mlock);
    int i = default_pool(dev);
    pthread_mutex_unlock(&g_mlock);
    if (i < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pool_out = pool_handle(i);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    if (pool == NULL || dev < 0 || dev >= fake_device_count())
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mlock);
    int i = current_pool(dev);
    pthread_mutex_unlock(&g_mlock);
    if (i < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = pool_handle(i);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    if (dev < 0 || dev >= fake_device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mlock);
    int i = pool_index(pool);
    if (i >= 0 && g_pool[i].dev == dev)
        g_current_pool[dev] = i + 1;
    pthread_mutex_unlock(&g_mlock);
    return i >= 0 && g_pool[i].dev == dev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ graph memory */

static uint64_t g_graph_reserved[MAX_DEV];

/* Stands for graph memory nodes: the device's graph memory now reserves `bytes`. */
EXPORT CUresult fakeCudaGraphMemReserve(int dev, unsigned long long bytes)
{
    if (dev < 0 || dev >= fake_device_count())
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mlock);
    CUresult r = CUDA_SUCCESS;
    if (bytes > g_graph_reserved[dev])
        r = fake_device_charge(dev, bytes - g_graph_reserved[dev]);
    else
        fake_device_uncharge(dev, g_graph_reserved[dev] - bytes);
    if (r == CUDA_SUCCESS)
        g_graph_reserved[dev] = bytes;
    pthread_mutex_unlock(&g_mlock);
    return r;
}

EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, CUgraphMem_attribute attr, void *value)
{
    if (dev < 0 || dev >= fake_device_count() || value == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (attr != CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT && attr != CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mlock);
    *(cuuint64_t *)value = g_graph_reserved[dev];
    pthread_mutex_unlock(&g_mlock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    return fakeCudaGraphMemReserve(dev, 0); /* no graph is running: all of it is idle */
}

/* ------------------------------------------------------------------ VMM */

static struct {
    uint64_t handle; /* 0: free */
    int dev;         /* -1: host memory */
    uint64_t size;
    int refs, maps;
} g_vmm[MAX_VMM];
static struct {
    uint64_t ptr, size, handle; /* handle 0: free */
} g_map[MAX_MAPS];
static uint64_t g_next_vmm = 0x100;

static int vmm_index(uint64_t h)
{
    for (int i = 0; i < MAX_VMM; i++)
        if (g_vmm[i].handle == h && h != 0)
            return i;
    return -1;
}

/* Under g_mlock: the memory goes when nothing refers to it or maps it any more. */
static void vmm_maybe_free(int i)
{
    if (g_vmm[i].refs > 0 || g_vmm[i].maps > 0)
        return;
    if (g_vmm[i].dev >= 0)
        fake_device_uncharge(g_vmm[i].dev, g_vmm[i].size);
    g_vmm[i].handle = 0;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                            const CUmemAllocationProp *prop, unsigned long long flags)
{
    CUresult r = fake_need_ctx();
    if (r == CUDA_ERROR_NOT_INITIALIZED)
        return r;
    if (handle == NULL || prop == NULL || flags != 0 || size == 0 ||
        prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    int dev;
    switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        if (prop->location.id < 0 || prop->location.id >= fake_device_count())
            return CUDA_ERROR_INVALID_VALUE;
        dev = prop->location.id;
        break;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: dev = -1; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&g_mlock);
    r = CUDA_ERROR_OUT_OF_MEMORY;
    for (int i = 0; i < MAX_VMM; i++) {
        if (g_vmm[i].handle != 0)
            continue;
        if (dev >= 0 && fake_device_charge(dev, size) != CUDA_SUCCESS)
            break;
        g_vmm[i].handle = g_next_vmm++;
        g_vmm[i].dev = dev;
        g_vmm[i].size = size;
        g_vmm[i].refs = 1;
        g_vmm[i].maps = 0;
        *handle = g_vmm[i].handle;
        r = CUDA_SUCCESS;
        break;
    }
    pthread_mutex_unlock(&g_mlock);
    if (r == CUDA_SUCCESS)
        fake_count_alloc();
    return r;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    pthread_mutex_lock(&g_mlock);
    int i = vmm_index(handle);
    if (i >= 0 && g_vmm[i].refs > 0) {
        g_vmm[i].refs--;
        vmm_maybe_free(i);
    }
    pthread_mutex_unlock(&g_mlock);
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                         CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    if (ptr == 0 || size == 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mlock);
    int i = vmm_index(handle);
    CUresult r = CUDA_ERROR_INVALID_HANDLE;
    if (i >= 0 && offset + size <= g_vmm[i].size) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
        for (int k = 0; k < MAX_MAPS; k++)
            if (g_map[k].handle == 0) {
                g_map[k].ptr = ptr;
                g_map[k].size = size;
                g_map[k].handle = handle;
                g_vmm[i].maps++;
                r = CUDA_SUCCESS;
                break;
            }
    }
    pthread_mutex_unlock(&g_mlock);
    return r;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    pthread_mutex_lock(&g_mlock);
    int n = 0;
    for (int k = 0; k < MAX_MAPS; k++)
        if (g_map[k].handle != 0 && g_map[k].ptr >= ptr && g_map[k].ptr < ptr + size) {
            int i = vmm_index(g_map[k].handle);
            g_map[k].handle = 0;
            n++;
            if (i >= 0) {
                g_vmm[i].maps--;
                vmm_maybe_free(i);
            }
        }
    pthread_mutex_unlock(&g_mlock);
    return n > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    if (handle == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t a = (uint64_t)(uintptr_t)addr;
    pthread_mutex_lock(&g_mlock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    for (int k = 0; k < MAX_MAPS; k++)
        if (g_map[k].handle != 0 && a >= g_map[k].ptr && a < g_map[k].ptr + g_map[k].size) {
            int i = vmm_index(g_map[k].handle);
            if (i >= 0) {
                g_vmm[i].refs++;
                *handle = g_map[k].handle;
                r = CUDA_SUCCESS;
            }
            break;
        }
    pthread_mutex_unlock(&g_mlock);
    return r;
}

/* ------------------------------------------------------------------ arrays */

static struct {
    int used, dev;
    uint64_t bytes;
} g_arr[MAX_ARRAYS];

static uint64_t elem_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 0;
    }
}

static uint64_t level_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format f, unsigned ch)
{
    uint64_t pitch = round_up(w * elem_bytes(f) * ch, 512);
    return round_up(pitch * (h ? h : 1) * (d ? d : 1), 64 << 10);
}

static CUresult array_new(uint64_t bytes, uintptr_t base, uintptr_t *handle)
{
    int dev = fake_current_dev();
    if (dev < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mlock);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    for (int i = 0; i < MAX_ARRAYS; i++)
        if (!g_arr[i].used) {
            if (fake_device_charge(dev, bytes) != CUDA_SUCCESS)
                break;
            g_arr[i].used = 1;
            g_arr[i].dev = dev;
            g_arr[i].bytes = bytes;
            *handle = base + (uintptr_t)i * 16u;
            r = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&g_mlock);
    if (r == CUDA_SUCCESS)
        fake_count_alloc();
    return r;
}

static int array_index(uintptr_t h, uintptr_t base)
{
    if (h < base || (h - base) % 16 != 0 || (h - base) / 16 >= MAX_ARRAYS)
        return -1;
    int i = (int)((h - base) / 16);
    return g_arr[i].used ? i : -1;
}

#define ARRAY_BASE 0xa0000u
#define MIPMAP_BASE 0xb0000u

static CUresult array_drop(uintptr_t h, uintptr_t base)
{
    pthread_mutex_lock(&g_mlock);
    int i = array_index(h, base);
    if (i >= 0) {
        fake_device_uncharge(g_arr[i].dev, g_arr[i].bytes);
        g_arr[i].used = 0;
    }
    pthread_mutex_unlock(&g_mlock);
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    if (pHandle == NULL || d == NULL || elem_bytes(d->Format) == 0 || d->NumChannels == 0 ||
        d->NumChannels > 4 || d->Width == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uintptr_t h;
    CUresult r = array_new(level_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels),
                           ARRAY_BASE, &h);
    if (r == CUDA_SUCCESS)
        *pHandle = (CUarray)h;
    return r;
}

EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    if (pHandle == NULL || d == NULL || elem_bytes(d->Format) == 0 || d->NumChannels == 0 ||
        d->NumChannels > 4 || d->Width == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uintptr_t h;
    CUresult r = array_new(level_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels),
                           ARRAY_BASE, &h);
    if (r == CUDA_SUCCESS)
        *pHandle = (CUarray)h;
    return r;
}

EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    return array_drop((uintptr_t)hArray, ARRAY_BASE);
}

static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    uint64_t total = 0;
    for (unsigned l = 0; l < levels && l < 32; l++) {
        uint64_t w = d->Width >> l ? d->Width >> l : 1, h = d->Height >> l, z = d->Depth >> l;
        total += level_bytes(w, d->Height ? (h ? h : 1) : 0, d->Depth ? (z ? z : 1) : 0,
                             d->Format, d->NumChannels);
    }
    return total;
}

EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                       const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels)
{
    if (pHandle == NULL || d == NULL || levels == 0 || elem_bytes(d->Format) == 0 ||
        d->NumChannels == 0 || d->NumChannels > 4 || d->Width == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uintptr_t h;
    CUresult r = array_new(mipmap_bytes(d, levels), MIPMAP_BASE, &h);
    if (r == CUDA_SUCCESS)
        *pHandle = (CUmipmappedArray)h;
    return r;
}

EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    return array_drop((uintptr_t)h, MIPMAP_BASE);
}

static CUresult requirements(uintptr_t h, uintptr_t base, CUDA_ARRAY_MEMORY_REQUIREMENTS *req,
                             CUdevice dev)
{
    if (req == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mlock);
    int i = array_index(h, base);
    CUresult r = i >= 0 && g_arr[i].dev == dev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        memset(req, 0, sizeof *req);
        req->size = g_arr[i].bytes;
        req->alignment = 64 << 10;
    }
    pthread_mutex_unlock(&g_mlock);
    return r;
}

EXPORT CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *req, CUarray array,
                                             CUdevice dev)
{
    return requirements((uintptr_t)array, ARRAY_BASE, req, dev);
}

EXPORT CUresult cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS *req,
                                                      CUmipmappedArray mipmap, CUdevice dev)
{
    return requirements((uintptr_t)mipmap, MIPMAP_BASE, req, dev);
}

/* ------------------------------------------------------------------ cuGetProcAddress entries */

void *fake_memory_proc(const char *base, int *min_version)
{
    static const struct {
        const char *base;
        void *fn;
        int min_version;
    } table[] = {
        {"cuCtxDestroy", (void *)cuCtxDestroy_v2, 4000},
        {"cuCtxGetCurrent", (void *)cuCtxGetCurrent, 4000},
        {"cuCtxSetLimit", (void *)cuCtxSetLimit, 3010},
        {"cuCtxGetLimit", (void *)cuCtxGetLimit, 3010},
        {"cuCtxSynchronize", (void *)cuCtxSynchronize, 2000},
        {"cuStreamSynchronize", (void *)cuStreamSynchronize, 2000},
        {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain, 7000},
        {"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease_v2, 11000},
        {"cuDevicePrimaryCtxReset", (void *)cuDevicePrimaryCtxReset_v2, 11000},
        {"cuDevicePrimaryCtxGetState", (void *)cuDevicePrimaryCtxGetState, 7000},
        {"cuModuleLoad", (void *)cuModuleLoad, 2000},
        {"cuModuleLoadData", (void *)cuModuleLoadData, 2000},
        {"cuModuleLoadDataEx", (void *)cuModuleLoadDataEx, 2010},
        {"cuModuleLoadFatBinary", (void *)cuModuleLoadFatBinary, 2000},
        {"cuModuleUnload", (void *)cuModuleUnload, 2000},
        {"cuLibraryLoadData", (void *)cuLibraryLoadData, 12000},
        {"cuLibraryLoadFromFile", (void *)cuLibraryLoadFromFile, 12000},
        {"cuLibraryUnload", (void *)cuLibraryUnload, 12000},
        {"cuMemPoolCreate", (void *)cuMemPoolCreate, 11020},
        {"cuMemPoolDestroy", (void *)cuMemPoolDestroy, 11020},
        {"cuMemPoolTrimTo", (void *)cuMemPoolTrimTo, 11020},
        {"cuMemPoolSetAttribute", (void *)cuMemPoolSetAttribute, 11020},
        {"cuMemPoolGetAttribute", (void *)cuMemPoolGetAttribute, 11020},
        {"cuDeviceGetMemPool", (void *)cuDeviceGetMemPool, 11020},
        {"cuDeviceGetDefaultMemPool", (void *)cuDeviceGetDefaultMemPool, 11020},
        {"cuDeviceSetMemPool", (void *)cuDeviceSetMemPool, 11020},
        {"cuDeviceGetGraphMemAttribute", (void *)cuDeviceGetGraphMemAttribute, 11040},
        {"cuDeviceGraphMemTrim", (void *)cuDeviceGraphMemTrim, 11040},
        {"cuMemMap", (void *)cuMemMap, 10020},
        {"cuMemUnmap", (void *)cuMemUnmap, 10020},
        {"cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle, 11000},
        {"cuArrayCreate", (void *)cuArrayCreate_v2, 3020},
        {"cuArray3DCreate", (void *)cuArray3DCreate_v2, 3020},
        {"cuArrayDestroy", (void *)cuArrayDestroy, 2000},
        {"cuArrayGetMemoryRequirements", (void *)cuArrayGetMemoryRequirements, 11060},
        {"cuMipmappedArrayCreate", (void *)cuMipmappedArrayCreate, 5000},
        {"cuMipmappedArrayDestroy", (void *)cuMipmappedArrayDestroy, 5000},
        {"cuMipmappedArrayGetMemoryRequirements", (void *)cuMipmappedArrayGetMemoryRequirements,
         11060},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(table[i].base, base) == 0) {
            *min_version = table[i].min_version;
            return table[i].fn;
        }
    return NULL;
}
