/*
 * fake_cuda.c - a stand-in libcuda.so.1 for testing the shim without a GPU.
 *
 * It keeps real bookkeeping: devices with a fixed amount of memory (FAKE_CUDA_MEMORY bytes each,
 * default 16 GiB; FAKE_CUDA_DEVICES devices, default 2), allocations that fail with
 * CUDA_ERROR_OUT_OF_MEMORY when the device is full, frees of unknown pointers that fail with
 * CUDA_ERROR_INVALID_VALUE, a per-thread current context (CUDA_ERROR_INVALID_CONTEXT without one),
 * and cuGetProcAddress resolving base names to versioned entry points as the driver does.
 * Managed memory (cuMemAllocManaged) lives in host memory as far as capacity goes: it is not
 * charged to the device (its pages would migrate), so it succeeds past a full device; it takes
 * cuMemAdvise, answers pointer attributes as managed, and cuIpcGetMemHandle refuses it.
 * Launches are counted (fakeCudaCounter) so tests can see they arrived; streams, capture, graphs,
 * kernel run time and versioned entry points are in fake_cuda_graphs.c.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_subset.h"
#include "fake_cuda_graphs.h"
#include "fake_cuda_internal.h"
#include "fake_ids.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEV 8
#define MAX_ALLOCS 65536

enum counter {
    C_LAUNCH, C_LAUNCH_EX, C_COOP, C_GRAPH, C_ALLOC, C_FREE, C_PROC, C_MANAGED, C_ADVISE, C_IPC,
    C_COUNT
};
static const char *const counter_names[C_COUNT] = {"launch", "launch_ex", "coop",    "graph",
                                                   "alloc",  "free",      "getproc", "managed",
                                                   "advise", "ipc"};
static unsigned long long g_counters[C_COUNT];

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_inited;
static int g_devices = 2;
static uint64_t g_memory = 16ull << 30;
static uint64_t g_used[MAX_DEV];
static struct {
    uint64_t key;
    uint64_t bytes;
    int dev;
    int kind;      /* 1 pointer, 2 handle, 3 managed pointer */
    int preferred; /* managed: device advised as preferred location, -1 none */
} g_allocs[MAX_ALLOCS];
static uint64_t g_managed_used; /* bytes of managed memory held (host memory) */
static uint64_t g_next_ptr = 0x7f0000000000ull;
static uint64_t g_next_handle = 1;
static __thread int t_dev = -1;

/* like a driver that survives fork: the lock is never held across it */
static void fork_prepare(void)
{
    pthread_mutex_lock(&g_lock);
}

static void fork_release(void)
{
    pthread_mutex_unlock(&g_lock);
}

__attribute__((constructor)) static void fake_load(void)
{
    pthread_atfork(fork_prepare, fork_release, fork_release);
}

static void count(enum counter c)
{
    __atomic_fetch_add(&g_counters[c], 1, __ATOMIC_RELAXED);
}

EXPORT unsigned long long fakeCudaCounter(const char *name)
{
    for (int i = 0; i < C_COUNT; i++)
        if (strcmp(counter_names[i], name) == 0)
            return __atomic_load_n(&g_counters[i], __ATOMIC_RELAXED);
    return fake_graphs_counter(name);
}

EXPORT CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    const char *n = getenv("FAKE_CUDA_DEVICES");
    const char *m = getenv("FAKE_CUDA_MEMORY");
    pthread_mutex_lock(&g_lock);
    if (n != NULL)
        g_devices = atoi(n) < 1 ? 1 : (atoi(n) > MAX_DEV ? MAX_DEV : atoi(n));
    if (m != NULL)
        g_memory = strtoull(m, NULL, 10);
    g_inited = 1;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

static CUresult need_init(void)
{
    return __atomic_load_n(&g_inited, __ATOMIC_ACQUIRE) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

static CUresult need_ctx(void)
{
    CUresult r = need_init();
    if (r != CUDA_SUCCESS)
        return r;
    return t_dev >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

EXPORT CUresult cuDeviceGetCount(int *count_out)
{
    CUresult r = need_init();
    if (r == CUDA_SUCCESS)
        *count_out = g_devices;
    return r;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CUresult r = need_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (ordinal < 0 || ordinal >= g_devices)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    CUresult r = need_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (dev < 0 || dev >= g_devices)
        return CUDA_ERROR_INVALID_DEVICE;
    if (uuid == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    fake_uuid_bytes(dev, (unsigned char *)uuid->bytes);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    return cuDeviceGetUuid_v2(uuid, dev);
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    CUresult r = need_init();
    if (r == CUDA_SUCCESS && (dev < 0 || dev >= g_devices))
        r = CUDA_ERROR_INVALID_DEVICE;
    if (r == CUDA_SUCCESS)
        *bytes = (size_t)g_memory;
    return r;
}

/* ---- shared with fake_cuda_memory.c (contexts, pools, modules, VMM, arrays) */

int fake_device_count(void)
{
    return g_devices;
}

int fake_current_dev(void)
{
    return t_dev;
}

void fake_set_current_dev(int dev)
{
    t_dev = dev;
}

CUresult fake_need_ctx(void)
{
    return need_ctx();
}

/* Device memory the driver holds for something else than an allocation (context, pool, module). */
CUresult fake_device_charge(int dev, uint64_t bytes)
{
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    if (g_used[dev] + bytes <= g_memory && g_used[dev] + bytes >= g_used[dev]) {
        g_used[dev] += bytes;
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

void fake_device_uncharge(int dev, uint64_t bytes)
{
    pthread_mutex_lock(&g_lock);
    g_used[dev] -= bytes < g_used[dev] ? bytes : g_used[dev];
    pthread_mutex_unlock(&g_lock);
}

void fake_count_alloc(void)
{
    count(C_ALLOC);
}

/* The driver's own count of a device's used memory, to compare the shim's account with. */
EXPORT unsigned long long fakeCudaDeviceUsed(int dev)
{
    if (dev < 0 || dev >= MAX_DEV)
        return 0;
    pthread_mutex_lock(&g_lock);
    unsigned long long used = g_used[dev];
    pthread_mutex_unlock(&g_lock);
    return used;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    CUresult r = need_ctx();
    if (r == CUDA_SUCCESS)
        *device = t_dev;
    return r;
}

static CUresult record(int kind, int dev, uint64_t bytes, uint64_t *key_out)
{
    if (bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    bool on_device = kind != 3;
    if (!on_device || (g_used[dev] + bytes <= g_memory && g_used[dev] + bytes >= g_used[dev])) {
        for (int i = 0; i < MAX_ALLOCS; i++) {
            if (g_allocs[i].kind == 0) {
                uint64_t key = kind != 2 ? g_next_ptr : g_next_handle++;
                if (kind != 2)
                    g_next_ptr += (bytes + 0xfffull) & ~0xfffull;
                g_allocs[i].key = key;
                g_allocs[i].bytes = bytes;
                g_allocs[i].dev = dev;
                g_allocs[i].kind = kind;
                g_allocs[i].preferred = -1;
                if (on_device)
                    g_used[dev] += bytes;
                else
                    g_managed_used += bytes;
                *key_out = key;
                r = CUDA_SUCCESS;
                break;
            }
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (r == CUDA_SUCCESS)
        count(C_ALLOC);
    return r;
}

static CUresult forget(int kind, uint64_t key)
{
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        /* a pointer is freed by cuMemFree whether it is device or managed memory */
        int k = g_allocs[i].kind;
        if ((k == kind || (kind == 1 && k == 3)) && g_allocs[i].key == key) {
            if (k == 3)
                g_managed_used -= g_allocs[i].bytes;
            else
                g_used[g_allocs[i].dev] -= g_allocs[i].bytes;
            g_allocs[i].kind = 0;
            r = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (r == CUDA_SUCCESS)
        count(C_FREE);
    return r;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    CUresult r = need_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    if (dptr == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t key;
    r = record(1, t_dev, bytesize, &key);
    if (r == CUDA_SUCCESS)
        *dptr = key;
    return r;
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != 2 /* CU_MEM_ATTACH_HOST */)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = need_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    if (dptr == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t key;
    r = record(3, t_dev, bytesize, &key);
    if (r == CUDA_SUCCESS) {
        *dptr = key;
        count(C_MANAGED);
    }
    return r;
}

/* The allocation holding [ptr, ptr+1), or -1; called with g_lock held. */
static int find_ptr_locked(uint64_t ptr)
{
    for (int i = 0; i < MAX_ALLOCS; i++) {
        int k = g_allocs[i].kind;
        if ((k == 1 || k == 3) && ptr >= g_allocs[i].key && ptr - g_allocs[i].key < g_allocs[i].bytes)
            return i;
    }
    return -1;
}

static CUresult advise(CUdeviceptr ptr, size_t count_bytes, CUmem_advise advice, int dev)
{
    CUresult r = need_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY ||
        count_bytes == 0 || dev < -1 || dev >= g_devices)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_ptr_locked(ptr);
    if (i < 0 || g_allocs[i].kind != 3 || ptr + count_bytes > g_allocs[i].key + g_allocs[i].bytes) {
        r = CUDA_ERROR_INVALID_VALUE; /* advice is for managed memory only */
    } else if (advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION) {
        g_allocs[i].preferred = dev;
    } else if (advice == CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION) {
        g_allocs[i].preferred = -1;
    }
    pthread_mutex_unlock(&g_lock);
    if (r == CUDA_SUCCESS)
        count(C_ADVISE);
    return r;
}

EXPORT CUresult cuMemAdvise(CUdeviceptr ptr, size_t count_bytes, CUmem_advise advice, CUdevice dev)
{
    return advise(ptr, count_bytes, advice, dev);
}

EXPORT CUresult cuMemAdvise_v2(CUdeviceptr ptr, size_t count_bytes, CUmem_advise advice,
                               CUmemLocation location)
{
    if (location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE; /* the fake knows devices only */
    return advise(ptr, count_bytes, advice, location.id);
}

/* The device advised as preferred location of a managed allocation; -1 none, -2 not managed. */
EXPORT int fakeCudaPreferredLocation(unsigned long long ptr)
{
    pthread_mutex_lock(&g_lock);
    int i = find_ptr_locked(ptr);
    int where = i >= 0 && g_allocs[i].kind == 3 ? g_allocs[i].preferred : -2;
    pthread_mutex_unlock(&g_lock);
    return where;
}

EXPORT unsigned long long fakeCudaManagedUsed(void)
{
    pthread_mutex_lock(&g_lock);
    unsigned long long used = g_managed_used;
    pthread_mutex_unlock(&g_lock);
    return used;
}

EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    CUresult r = need_init();
    if (r != CUDA_SUCCESS)
        return r;
    if (data == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_ptr_locked(ptr);
    int managed = i >= 0 && g_allocs[i].kind == 3, dev = i >= 0 ? g_allocs[i].dev : -1;
    pthread_mutex_unlock(&g_lock);
    if (i < 0)
        return CUDA_ERROR_INVALID_VALUE;
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = managed; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; /* managed memory reads as device memory */
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = dev; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

/* IPC is for device memory; the driver refuses managed memory. */
EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr ptr)
{
    CUresult r = need_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    count(C_IPC);
    if (handle == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    int i = find_ptr_locked(ptr);
    int ok = i >= 0 && g_allocs[i].kind == 1 && g_allocs[i].key == ptr;
    pthread_mutex_unlock(&g_lock);
    if (!ok)
        return CUDA_ERROR_INVALID_VALUE;
    memset(handle, 0, sizeof *handle);
    memcpy(handle->reserved, &ptr, sizeof ptr);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t width, size_t height,
                                   unsigned int elementSize)
{
    if (pPitch == NULL || (elementSize != 4 && elementSize != 8 && elementSize != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (width + 511) & ~(size_t)511;
    CUresult r = cuMemAlloc_v2(dptr, pitch * height);
    if (r == CUDA_SUCCESS)
        *pPitch = pitch;
    return r;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    CUresult r = need_init();
    return r != CUDA_SUCCESS ? r : forget(1, dptr);
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    CUresult r = need_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    if (free_bytes == NULL || total_bytes == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    *total_bytes = (size_t)g_memory;
    *free_bytes = (size_t)(g_memory - g_used[t_dev]);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

static CUresult check_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz)
{
    CUresult r = need_ctx();
    if (r != CUDA_SUCCESS)
        return r;
    if (f == NULL)
        return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 ||
        (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* checked, then recorded into a capture or run (fake_cuda_graphs.c); counted when it ran */
static CUresult launch(enum counter c, int per_thread, CUfunction f, unsigned gx, unsigned gy,
                       unsigned gz, unsigned bx, unsigned by, unsigned bz, CUstream s)
{
    CUresult r = check_launch(f, gx, gy, gz, bx, by, bz);
    int ran = 0;
    if (r == CUDA_SUCCESS)
        r = fake_submit_kernel(s, per_thread, f, gx, gy, gz, bx, by, bz, &ran);
    if (r == CUDA_SUCCESS && ran)
        count(c);
    return r;
}

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params,
                               void **extra)
{
    (void)shmem, (void)params, (void)extra;
    return launch(C_LAUNCH, 0, f, gx, gy, gz, bx, by, bz, s);
}

EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                    unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                    CUstream s, void **params, void **extra)
{
    (void)shmem, (void)params, (void)extra;
    return launch(C_LAUNCH, 1, f, gx, gy, gz, bx, by, bz, s);
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    (void)params, (void)extra;
    if (c == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(C_LAUNCH_EX, 0, f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX,
                  c->blockDimY, c->blockDimZ, c->hStream);
}

EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params,
                                      void **extra)
{
    (void)params, (void)extra;
    if (c == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(C_LAUNCH_EX, 1, f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX,
                  c->blockDimY, c->blockDimZ, c->hStream);
}

EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                          unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                          CUstream s, void **params)
{
    (void)shmem, (void)params;
    return launch(C_COOP, 0, f, gx, gy, gz, bx, by, bz, s);
}

EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                               unsigned bx, unsigned by, unsigned bz,
                                               unsigned shmem, CUstream s, void **params)
{
    (void)shmem, (void)params;
    return launch(C_COOP, 1, f, gx, gy, gz, bx, by, bz, s);
}

EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    CUresult r = fake_graph_launch(g, s, 0);
    if (r == CUDA_SUCCESS)
        count(C_GRAPH);
    return r;
}

EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s)
{
    CUresult r = fake_graph_launch(g, s, 1);
    if (r == CUDA_SUCCESS)
        count(C_GRAPH);
    return r;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult *status);

struct proc_entry {
    const char *base;
    void *plain;
    void *ptsz; /* NULL: same as plain */
    int min_version;
};

static const struct proc_entry *proc_table(size_t *n)
{
    static const struct proc_entry table[] = {
        {"cuInit", (void *)cuInit, NULL, 2000},
        {"cuDeviceGet", (void *)cuDeviceGet, NULL, 2000},
        {"cuDeviceGetCount", (void *)cuDeviceGetCount, NULL, 2000},
        {"cuDeviceGetUuid", (void *)cuDeviceGetUuid_v2, NULL, 11040},
        {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2, NULL, 3020},
        {"cuCtxCreate", (void *)cuCtxCreate_v2, NULL, 3020},
        {"cuCtxSetCurrent", (void *)cuCtxSetCurrent, NULL, 4000},
        {"cuCtxGetDevice", (void *)cuCtxGetDevice, NULL, 2000},
        {"cuMemAlloc", (void *)cuMemAlloc_v2, NULL, 3020},
        {"cuMemAllocPitch", (void *)cuMemAllocPitch_v2, NULL, 3020},
        {"cuMemAllocManaged", (void *)cuMemAllocManaged, NULL, 6000},
        {"cuMemAllocAsync", (void *)cuMemAllocAsync, (void *)cuMemAllocAsync_ptsz, 11020},
        {"cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync,
         (void *)cuMemAllocFromPoolAsync_ptsz, 11020},
        {"cuMemFree", (void *)cuMemFree_v2, NULL, 3020},
        {"cuMemFreeAsync", (void *)cuMemFreeAsync, (void *)cuMemFreeAsync_ptsz, 11020},
        {"cuMemCreate", (void *)cuMemCreate, NULL, 10020},
        {"cuMemRelease", (void *)cuMemRelease, NULL, 10020},
        {"cuMemGetInfo", (void *)cuMemGetInfo_v2, NULL, 3020},
        {"cuMemAdvise", (void *)cuMemAdvise_v2, NULL, 12020},
        {"cuPointerGetAttribute", (void *)cuPointerGetAttribute, NULL, 4000},
        {"cuIpcGetMemHandle", (void *)cuIpcGetMemHandle, NULL, 4010},
        {"cuLaunchKernel", (void *)cuLaunchKernel, (void *)cuLaunchKernel_ptsz, 4000},
        {"cuLaunchKernelEx", (void *)cuLaunchKernelEx, (void *)cuLaunchKernelEx_ptsz, 11060},
        {"cuLaunchCooperativeKernel", (void *)cuLaunchCooperativeKernel,
         (void *)cuLaunchCooperativeKernel_ptsz, 9000},
        {"cuGraphLaunch", (void *)cuGraphLaunch, (void *)cuGraphLaunch_ptsz, 10000},
        {"cuGetProcAddress", (void *)cuGetProcAddress_v2, NULL, 12000},
        {"fakeCudaCounter", (void *)fakeCudaCounter, NULL, 0},
    };
    *n = sizeof table / sizeof table[0];
    return table;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    count(C_PROC);
    if (symbol == NULL || pfn == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    if (strcmp(symbol, "cuGetProcAddress") == 0 && cudaVersion >= 11030 && cudaVersion < 12000) {
        *pfn = fake_maybe_trampoline((void *)cuGetProcAddress);
        if (status)
            *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    int versioned = fake_versioned_proc(symbol, cudaVersion, flags, pfn);
    if (versioned != 0) {
        if (status)
            *status = versioned > 0 ? CU_GET_PROC_ADDRESS_SUCCESS
                                    : CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        *pfn = versioned > 0 ? fake_maybe_trampoline(*pfn) : NULL;
        return versioned > 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
    }
    size_t n;
    const struct proc_entry *t = proc_table(&n);
    for (size_t i = 0; i < n; i++) {
        if (strcmp(t[i].base, symbol) != 0)
            continue;
        if (cudaVersion < t[i].min_version) {
            if (status)
                *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
            return CUDA_ERROR_NOT_FOUND;
        }
        int want_ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
        *pfn = fake_maybe_trampoline(want_ptsz && t[i].ptsz != NULL ? t[i].ptsz : t[i].plain);
        if (status)
            *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    /* entry points of fake_cuda_memory.c */
    int min_version = 0;
    void *found = fake_memory_proc(symbol, &min_version);
    if (found != NULL) {
        if (cudaVersion < min_version) {
            if (status)
                *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
            return CUDA_ERROR_NOT_FOUND;
        }
        *pfn = found;
        if (status)
            *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    if (status)
        *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
