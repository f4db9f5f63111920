/*
 * hooks_memory.c - memory the driver holds for a process, counted against the limit:
 * contexts (created or primary), their heap/stack/printf limits, loaded modules and libraries,
 * stream-ordered pools (what a pool holds, not what was asked of it), graph memory, VMM handles
 * until their last unmap, and arrays.
 *
 * What cannot be computed from the arguments is measured through the driver's own counts:
 *   - a context: the device's used memory (NVML, the only count that exists before the context
 *     does) before and after the first context of this process on the device; later contexts on
 *     that device are charged the same;
 *   - a module, library or limit change: cuMemGetInfo before and after, on the current context;
 *   - a pool: its CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT; graph memory: the device's
 *     CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT;
 *   - an array: cuArrayGetMemoryRequirements.
 * Measurements are serialised in this process (g_measure_lock); memory other threads or
 * processes allocate in the same moment shows in a delta, so a charge can be off by that much.
 * A charge that does not fit the limit undoes the driver call and fails with
 * CUDA_ERROR_OUT_OF_MEMORY; memory the driver already holds (a pool that grew past what was
 * reserved for it, graph memory) is counted even past the limit, so later allocations fail.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include "shim.h"

#define MEM_GATE(expr)                                                                            \
    do {                                                                                          \
        enum shim_mode mode_ = shim_mode();                                                       \
        if (mode_ == SHIM_FAIL_CLOSED)                                                            \
            return CUDA_ERROR_NOT_INITIALIZED;                                                    \
        if (mode_ != SHIM_ACTIVE)                                                                 \
            return (expr);                                                                        \
        memory_fork_once();                                                                       \
    } while (0)

static void memory_fork_once(void);

/* For calls that hold memory but allocate nothing the application asked for (contexts, modules,
 * limits, pool management): without a region they pass through even with VGPU_FAIL_CLOSED=1,
 * which refuses allocations and launches. */
#define MEM_PASS(expr)                                                                            \
    do {                                                                                          \
        if (shim_mode() != SHIM_ACTIVE)                                                           \
            return (expr);                                                                        \
        memory_fork_once();                                                                       \
    } while (0)

#define MEM_NEED_REAL(name)                                                                       \
    __typeof__(&name) real_ = REAL(name);                                                         \
    if (real_ == NULL)                                                                            \
    return CUDA_ERROR_NOT_INITIALIZED

/* A driver function the accounting calls itself (never a hook), looked up once. */
#define DRIVER(name)                                                                              \
    ((__typeof__(&name))({                                                                        \
        static void *cached_;                                                                     \
        void *p_ = __atomic_load_n(&cached_, __ATOMIC_ACQUIRE);                                   \
        if (p_ == NULL) {                                                                         \
            p_ = shim_real_by_name(#name, false);                                                 \
            __atomic_store_n(&cached_, p_, __ATOMIC_RELEASE);                                     \
        }                                                                                         \
        p_;                                                                                       \
    }))

#define MAX_ORDINALS 64
#define MAX_POOLS 256

static pthread_mutex_t g_measure_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_ctx_lock = PTHREAD_MUTEX_INITIALIZER;  /* primary refs, costs */
static pthread_mutex_t g_pool_lock = PTHREAD_MUTEX_INITIALIZER; /* pools, graph memory */
static pthread_mutex_t g_vmm_lock = PTHREAD_MUTEX_INITIALIZER;  /* handles and mappings */

static uint64_t g_ctx_cost[MAX_ORDINALS];       /* measured cost + 1; 0 = not measured yet */
static int g_primary_refs[MAX_ORDINALS];        /* retains this process made and kept */
static CUcontext g_primary_ctx[MAX_ORDINALS];
static uint64_t g_devices_seen;                 /* bit per ordinal with a context (atomic) */

static CUresult current_device(CUdevice *dev)
{
    __typeof__(&cuCtxGetDevice) get = DRIVER(cuCtxGetDevice);
    return get != NULL ? get(dev) : CUDA_ERROR_NOT_INITIALIZED;
}

/* Free memory on the current context's device; false when there is no current context. */
static bool cuda_free_now(uint64_t *free_bytes)
{
    __typeof__(&cuMemGetInfo_v2) info = REAL(cuMemGetInfo_v2);
    size_t f = 0, t = 0;
    if (info == NULL || info(&f, &t) != CUDA_SUCCESS)
        return false;
    *free_bytes = f;
    return true;
}

/* ---------------------------------------------------------------- NVML: a device's used memory */

typedef nvmlReturn_t (*nvml_init_fn)(void);
typedef nvmlReturn_t (*nvml_by_uuid_fn)(const char *, nvmlDevice_t *);

static void *nvml_fn(const char *name)
{
    static int opened; /* atomic */
    void *p = shim_real_by_name(name, true);
    if (p == NULL && !__atomic_exchange_n(&opened, 1, __ATOMIC_ACQ_REL)) {
        /* not loaded by the application: load it (the shim's dlsym then knows its handle) */
        void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
        if (lib != NULL)
            (void)dlsym(lib, "nvmlDeviceGetMemoryInfo");
        p = shim_real_by_name(name, true);
    }
    return p;
}

/* The used memory NVML reports for CUDA device `dev` (all processes); false when unknown. */
static bool nvml_used(CUdevice dev, uint64_t *used)
{
    static int inited; /* atomic: 1 ok, -1 failed */
    int state = __atomic_load_n(&inited, __ATOMIC_ACQUIRE);
    if (state == 0) {
        nvml_init_fn init = (nvml_init_fn)nvml_fn("nvmlInit_v2");
        state = init != NULL && init() == NVML_SUCCESS ? 1 : -1;
        __atomic_store_n(&inited, state, __ATOMIC_RELEASE);
    }
    if (state < 0)
        return false;
    typedef CUresult (*uuid_fn)(CUuuid *, CUdevice);
    uuid_fn get_uuid = (uuid_fn)shim_real_by_name("cuDeviceGetUuid_v2", false);
    nvml_by_uuid_fn by_uuid = (nvml_by_uuid_fn)nvml_fn("nvmlDeviceGetHandleByUUID");
    __typeof__(&nvmlDeviceGetMemoryInfo) info =
        (__typeof__(&nvmlDeviceGetMemoryInfo))shim_real(HOOK_nvmlDeviceGetMemoryInfo);
    CUuuid raw;
    nvmlDevice_t handle;
    nvmlMemory_t m;
    char text[48];
    if (get_uuid == NULL || by_uuid == NULL || info == NULL || get_uuid(&raw, dev) != CUDA_SUCCESS)
        return false;
    shim_format_uuid(&raw, text);
    if (by_uuid(text, &handle) != NVML_SUCCESS || info(handle, &m) != NVML_SUCCESS)
        return false;
    *used = m.used;
    return true;
}

/* ---------------------------------------------------------------- contexts */

static void note_device(CUdevice dev)
{
    if (dev >= 0 && dev < MAX_ORDINALS)
        __atomic_fetch_or(&g_devices_seen, UINT64_C(1) << dev, __ATOMIC_RELAXED);
}

/* The measured cost of a context on `dev`, or 0 with *known false when not measured yet. */
static uint64_t known_ctx_cost(CUdevice dev, bool *known)
{
    uint64_t v = dev >= 0 && dev < MAX_ORDINALS ? __atomic_load_n(&g_ctx_cost[dev], __ATOMIC_ACQUIRE)
                                                : 0;
    *known = v != 0;
    return v != 0 ? v - 1 : 0;
}

struct ctx_measure {
    bool measuring;
    bool have_before;
    uint64_t used_before;
};

/* Before a call that may create a context on `dev`: the NVML reading, when the cost is unknown. */
static void ctx_measure_begin(CUdevice dev, struct ctx_measure *m)
{
    bool known;
    known_ctx_cost(dev, &known);
    m->measuring = !known && dev >= 0 && dev < MAX_ORDINALS;
    m->have_before = false;
    if (m->measuring) {
        pthread_mutex_lock(&g_measure_lock);
        m->have_before = nvml_used(dev, &m->used_before);
    }
}

/* After it: the cost (measured now, or known), stored for the next context on `dev`. */
static uint64_t ctx_measure_end(CUdevice dev, struct ctx_measure *m, bool created)
{
    bool known;
    uint64_t cost = known_ctx_cost(dev, &known);
    if (!m->measuring)
        return cost;
    uint64_t after = 0;
    if (created && m->have_before && nvml_used(dev, &after)) {
        cost = after > m->used_before ? after - m->used_before : 0;
        __atomic_store_n(&g_ctx_cost[dev], cost + 1, __ATOMIC_RELEASE);
    } else if (created) {
        shim_warn_once("cannot measure the memory a context holds (NVML unavailable); contexts "
                       "are not counted against the limit");
    }
    pthread_mutex_unlock(&g_measure_lock);
    return cost;
}

/* Count a new context's memory; false (and nothing counted) when it does not fit. */
static bool charge_context(CUcontext ctx, CUdevice dev, uint64_t cost)
{
    note_device(dev);
    int rdev = shim_region_dev_for_cuda(dev);
    uint64_t bytes = shim_kind_bytes(KIND_CONTEXT, cost);
    if (rdev < 0 || bytes == 0)
        return true;
    if (shim_mem_reserve_kind(rdev, bytes, KIND_CONTEXT) != CUDA_SUCCESS)
        return false;
    struct shim_tracked rec = {rdev, KIND_CONTEXT, bytes, 0};
    shim_track_put(TRACK_CONTEXT, (uint64_t)(uintptr_t)ctx, &rec);
    return true;
}

static void uncharge_limits(CUcontext ctx)
{
    static const CUlimit limits[] = {CU_LIMIT_STACK_SIZE, CU_LIMIT_PRINTF_FIFO_SIZE,
                                     CU_LIMIT_MALLOC_HEAP_SIZE};
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        struct shim_tracked rec;
        if (shim_track_get(TRACK_LIMIT, (uint64_t)(uintptr_t)ctx ^ (uint64_t)limits[i], &rec, true))
            shim_mem_unreserve_kind(rec.rdev, rec.bytes, rec.mkind);
    }
}

static void uncharge_context(CUcontext ctx)
{
    struct shim_tracked rec;
    if (shim_track_get(TRACK_CONTEXT, (uint64_t)(uintptr_t)ctx, &rec, true))
        shim_mem_unreserve_kind(rec.rdev, rec.bytes, rec.mkind);
    uncharge_limits(ctx);
}

/* Reserve a known cost before the driver call; measure an unknown one around it. */
#define CREATE_CONTEXT(pctx, dev, call)                                                           \
    do {                                                                                          \
        bool known_;                                                                              \
        uint64_t cost_ = known_ctx_cost((dev), &known_);                                          \
        int rdev_ = shim_region_dev_for_cuda(dev);                                                \
        uint64_t bytes_ = shim_kind_bytes(KIND_CONTEXT, cost_);                                   \
        if (known_ && rdev_ >= 0 && bytes_ != 0 &&                                                \
            shim_mem_reserve_kind(rdev_, bytes_, KIND_CONTEXT) != CUDA_SUCCESS)                   \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                      \
        if (known_ && rdev_ >= 0)                                                                 \
            shim_mem_unreserve_kind(rdev_, bytes_, KIND_CONTEXT); /* re-counted below */         \
        struct ctx_measure m_;                                                                    \
        ctx_measure_begin((dev), &m_);                                                            \
        CUresult r_ = (call);                                                                     \
        cost_ = ctx_measure_end((dev), &m_, r_ == CUDA_SUCCESS);                                  \
        if (r_ == CUDA_SUCCESS && !charge_context(*(pctx), (dev), cost_)) {                       \
            __typeof__(&cuCtxDestroy_v2) destroy_ = DRIVER(cuCtxDestroy_v2);                      \
            if (destroy_ != NULL)                                                                 \
                destroy_(*(pctx));                                                                \
            *(pctx) = NULL;                                                                       \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                      \
        }                                                                                         \
        return r_;                                                                                \
    } while (0)

SHIM_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    MEM_NEED_REAL(cuCtxCreate_v2);
    MEM_PASS(real_(pctx, flags, dev));
    if (pctx == NULL)
        return real_(pctx, flags, dev);
    CREATE_CONTEXT(pctx, dev, real_(pctx, flags, dev));
}

SHIM_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n,
                                    unsigned int flags, CUdevice dev)
{
    MEM_NEED_REAL(cuCtxCreate_v3);
    MEM_PASS(real_(pctx, params, n, flags, dev));
    if (pctx == NULL)
        return real_(pctx, params, n, flags, dev);
    CREATE_CONTEXT(pctx, dev, real_(pctx, params, n, flags, dev));
}

SHIM_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params,
                                    unsigned int flags, CUdevice dev)
{
    MEM_NEED_REAL(cuCtxCreate_v4);
    MEM_PASS(real_(pctx, params, flags, dev));
    if (pctx == NULL)
        return real_(pctx, params, flags, dev);
    CREATE_CONTEXT(pctx, dev, real_(pctx, params, flags, dev));
}

SHIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    MEM_NEED_REAL(cuCtxDestroy_v2);
    MEM_PASS(real_(ctx));
    CUresult r = real_(ctx);
    if (r == CUDA_SUCCESS)
        uncharge_context(ctx);
    return r;
}

SHIM_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    MEM_NEED_REAL(cuDevicePrimaryCtxRetain);
    MEM_PASS(real_(pctx, dev));
    if (pctx == NULL || dev < 0 || dev >= MAX_ORDINALS)
        return real_(pctx, dev);
    pthread_mutex_lock(&g_ctx_lock);
    CUresult r;
    if (g_primary_refs[dev] > 0) {
        r = real_(pctx, dev);
        if (r == CUDA_SUCCESS)
            g_primary_refs[dev]++;
        pthread_mutex_unlock(&g_ctx_lock);
        return r;
    }
    /* the first retain this process makes: the driver creates the context now (or it was made
     * before the shim saw it, and is held all the same) */
    bool known;
    uint64_t cost = known_ctx_cost(dev, &known);
    struct ctx_measure m;
    ctx_measure_begin(dev, &m);
    r = real_(pctx, dev);
    cost = ctx_measure_end(dev, &m, r == CUDA_SUCCESS);
    if (r == CUDA_SUCCESS) {
        if (!charge_context(*pctx, dev, cost)) {
            __typeof__(&cuDevicePrimaryCtxRelease_v2) release = REAL(cuDevicePrimaryCtxRelease_v2);
            if (release != NULL)
                release(dev);
            *pctx = NULL;
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            g_primary_refs[dev] = 1;
            g_primary_ctx[dev] = *pctx;
        }
    }
    pthread_mutex_unlock(&g_ctx_lock);
    return r;
}

SHIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    MEM_NEED_REAL(cuDevicePrimaryCtxRelease_v2);
    MEM_PASS(real_(dev));
    if (dev < 0 || dev >= MAX_ORDINALS)
        return real_(dev);
    pthread_mutex_lock(&g_ctx_lock);
    CUresult r = real_(dev);
    if (r == CUDA_SUCCESS && g_primary_refs[dev] > 0 && --g_primary_refs[dev] == 0) {
        uncharge_context(g_primary_ctx[dev]);
        g_primary_ctx[dev] = NULL;
    }
    pthread_mutex_unlock(&g_ctx_lock);
    return r;
}

SHIM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    MEM_NEED_REAL(cuDevicePrimaryCtxReset_v2);
    MEM_PASS(real_(dev));
    if (dev < 0 || dev >= MAX_ORDINALS)
        return real_(dev);
    pthread_mutex_lock(&g_ctx_lock);
    CUresult r = real_(dev);
    /* the context's resources are gone; retains made before stay valid, and the next use
     * creates it again, which the next first retain counts */
    if (r == CUDA_SUCCESS && g_primary_refs[dev] > 0) {
        uncharge_context(g_primary_ctx[dev]);
        g_primary_refs[dev] = 0;
        g_primary_ctx[dev] = NULL;
    }
    pthread_mutex_unlock(&g_ctx_lock);
    return r;
}

/* Heap, stack and printf FIFO sizes are device memory of the current context: the change of the
 * driver's free memory across the call is added to (or taken from) what is charged for it. */
SHIM_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    MEM_NEED_REAL(cuCtxSetLimit);
    MEM_PASS(real_(limit, value));
    CUcontext ctx = NULL;
    __typeof__(&cuCtxGetCurrent) get_ctx = DRIVER(cuCtxGetCurrent);
    int rdev = shim_region_dev_current();
    if (rdev < 0 || get_ctx == NULL || get_ctx(&ctx) != CUDA_SUCCESS || ctx == NULL)
        return real_(limit, value);
    pthread_mutex_lock(&g_measure_lock);
    uint64_t before = 0, after = 0;
    bool measured = cuda_free_now(&before);
    CUresult r = real_(limit, value);
    if (r == CUDA_SUCCESS && measured && cuda_free_now(&after) && after != before) {
        uint64_t key = (uint64_t)(uintptr_t)ctx ^ (uint64_t)limit;
        struct shim_tracked rec = {rdev, KIND_CONTEXT, 0, 0};
        shim_track_get(TRACK_LIMIT, key, &rec, true);
        uint64_t charged = rec.bytes;
        uint64_t next = after < before ? charged + (before - after)
                                       : (charged > after - before ? charged - (after - before) : 0);
        next = shim_kind_bytes(KIND_CONTEXT, next);
        if (next > charged &&
            shim_mem_reserve_kind(rdev, next - charged, KIND_CONTEXT) != CUDA_SUCCESS) {
            /* does not fit: the driver keeps what it reserved, the old value is not restored
             * (it may not shrink); count what it holds and refuse */
            shim_mem_count_kind(rdev, next - charged, KIND_CONTEXT);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (next < charged) {
            shim_mem_unreserve_kind(rdev, charged - next, KIND_CONTEXT);
        }
        rec.bytes = next;
        rec.rdev = rdev;
        if (next != 0)
            shim_track_put(TRACK_LIMIT, key, &rec);
    }
    pthread_mutex_unlock(&g_measure_lock);
    return r;
}

/* ---------------------------------------------------------------- modules and libraries */

/* Measure a load on the current context; count it, or unload and refuse when it does not fit. */
#define LOAD_MEASURED(handle_ptr, call, unload_name)                                              \
    do {                                                                                          \
        int rdev_ = shim_region_dev_current();                                                    \
        if (rdev_ < 0)                                                                            \
            return (call);                                                                        \
        pthread_mutex_lock(&g_measure_lock);                                                      \
        uint64_t before_ = 0, after_ = 0;                                                         \
        bool measured_ = cuda_free_now(&before_);                                                 \
        CUresult r_ = (call);                                                                     \
        if (r_ == CUDA_SUCCESS && measured_ && cuda_free_now(&after_) && after_ < before_) {     \
            uint64_t bytes_ = shim_kind_bytes(KIND_MODULE, before_ - after_);                     \
            if (shim_mem_reserve_kind(rdev_, bytes_, KIND_MODULE) != CUDA_SUCCESS) {              \
                __typeof__(&unload_name) unload_ = REAL(unload_name);                             \
                if (unload_ != NULL)                                                              \
                    unload_(*(handle_ptr));                                                       \
                *(handle_ptr) = NULL;                                                             \
                r_ = CUDA_ERROR_OUT_OF_MEMORY;                                                    \
            } else {                                                                              \
                struct shim_tracked rec_ = {rdev_, KIND_MODULE, bytes_, 0};                       \
                shim_track_put(TRACK_MODULE, (uint64_t)(uintptr_t) * (handle_ptr), &rec_);        \
            }                                                                                     \
        }                                                                                         \
        pthread_mutex_unlock(&g_measure_lock);                                                    \
        return r_;                                                                                \
    } while (0)

#define UNLOAD_TRACKED(handle, call)                                                              \
    do {                                                                                          \
        struct shim_tracked rec_;                                                                 \
        bool had_ = shim_track_get(TRACK_MODULE, (uint64_t)(uintptr_t)(handle), &rec_, true);     \
        CUresult r_ = (call);                                                                     \
        if (had_) {                                                                               \
            if (r_ == CUDA_SUCCESS)                                                               \
                shim_mem_unreserve_kind(rec_.rdev, rec_.bytes, rec_.mkind);                       \
            else                                                                                  \
                shim_track_put(TRACK_MODULE, (uint64_t)(uintptr_t)(handle), &rec_);               \
        }                                                                                         \
        return r_;                                                                                \
    } while (0)

SHIM_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    MEM_NEED_REAL(cuModuleLoad);
    MEM_PASS(real_(module, fname));
    if (module == NULL)
        return real_(module, fname);
    LOAD_MEASURED(module, real_(module, fname), cuModuleUnload);
}

SHIM_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    MEM_NEED_REAL(cuModuleLoadData);
    MEM_PASS(real_(module, image));
    if (module == NULL)
        return real_(module, image);
    LOAD_MEASURED(module, real_(module, image), cuModuleUnload);
}

SHIM_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int n,
                                        CUjit_option *options, void **values)
{
    MEM_NEED_REAL(cuModuleLoadDataEx);
    MEM_PASS(real_(module, image, n, options, values));
    if (module == NULL)
        return real_(module, image, n, options, values);
    LOAD_MEASURED(module, real_(module, image, n, options, values), cuModuleUnload);
}

SHIM_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    MEM_NEED_REAL(cuModuleLoadFatBinary);
    MEM_PASS(real_(module, fatCubin));
    if (module == NULL)
        return real_(module, fatCubin);
    LOAD_MEASURED(module, real_(module, fatCubin), cuModuleUnload);
}

SHIM_EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    MEM_NEED_REAL(cuModuleUnload);
    MEM_PASS(real_(hmod));
    UNLOAD_TRACKED(hmod, real_(hmod));
}

SHIM_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code,
                                       CUjit_option *jitOptions, void **jitValues,
                                       unsigned int numJit, CUlibraryOption *libOptions,
                                       void **libValues, unsigned int numLib)
{
    MEM_NEED_REAL(cuLibraryLoadData);
    MEM_PASS(real_(library, code, jitOptions, jitValues, numJit, libOptions, libValues, numLib));
    if (library == NULL)
        return real_(library, code, jitOptions, jitValues, numJit, libOptions, libValues, numLib);
    LOAD_MEASURED(library,
                  real_(library, code, jitOptions, jitValues, numJit, libOptions, libValues, numLib),
                  cuLibraryUnload);
}

SHIM_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName,
                                           CUjit_option *jitOptions, void **jitValues,
                                           unsigned int numJit, CUlibraryOption *libOptions,
                                           void **libValues, unsigned int numLib)
{
    MEM_NEED_REAL(cuLibraryLoadFromFile);
    MEM_PASS(real_(library, fileName, jitOptions, jitValues, numJit, libOptions, libValues, numLib));
    if (library == NULL)
        return real_(library, fileName, jitOptions, jitValues, numJit, libOptions, libValues,
                     numLib);
    LOAD_MEASURED(
        library,
        real_(library, fileName, jitOptions, jitValues, numJit, libOptions, libValues, numLib),
        cuLibraryUnload);
}

SHIM_EXPORT CUresult cuLibraryUnload(CUlibrary library)
{
    MEM_NEED_REAL(cuLibraryUnload);
    MEM_PASS(real_(library));
    UNLOAD_TRACKED(library, real_(library));
}

/* ---------------------------------------------------------------- stream-ordered pools */

struct pool_rec {
    CUmemoryPool pool; /* NULL: free entry */
    int rdev;          /* -1: not governed (host memory, another GPU) */
    uint64_t charged;  /* what is counted for it: its reserved memory when last looked at */
};
static struct pool_rec g_pools[MAX_POOLS];
static uint64_t g_graph_charged[MAX_ORDINALS]; /* graph memory counted per CUDA device */

static bool pool_attr(CUmemoryPool pool, CUmemPool_attribute attr, uint64_t *value)
{
    __typeof__(&cuMemPoolGetAttribute) get = DRIVER(cuMemPoolGetAttribute);
    cuuint64_t v = 0;
    if (get == NULL || get(pool, attr, &v) != CUDA_SUCCESS)
        return false;
    *value = v;
    return true;
}

/* Under g_pool_lock. */
static struct pool_rec *pool_find(CUmemoryPool pool, int rdev_if_new)
{
    struct pool_rec *free_entry = NULL;
    for (int i = 0; i < MAX_POOLS; i++) {
        if (g_pools[i].pool == pool)
            return &g_pools[i];
        if (g_pools[i].pool == NULL && free_entry == NULL)
            free_entry = &g_pools[i];
    }
    if (rdev_if_new == -2 || free_entry == NULL)
        return NULL;
    *free_entry = (struct pool_rec){pool, rdev_if_new, 0};
    return free_entry;
}

/* Count exactly what the driver says the pool holds now (under g_pool_lock). */
static void pool_settle(struct pool_rec *rec)
{
    uint64_t reserved;
    if (rec->rdev < 0 || !pool_attr(rec->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved))
        return;
    uint64_t held = shim_kind_bytes(KIND_POOL, reserved);
    if (held > rec->charged)
        shim_mem_count_kind(rec->rdev, held - rec->charged, KIND_POOL);
    else if (held < rec->charged)
        shim_mem_unreserve_kind(rec->rdev, rec->charged - held, KIND_POOL);
    rec->charged = held;
}

static void graph_mem_settle_locked(CUdevice dev)
{
    __typeof__(&cuDeviceGetGraphMemAttribute) get = DRIVER(cuDeviceGetGraphMemAttribute);
    int rdev = shim_region_dev_for_cuda(dev);
    cuuint64_t reserved = 0;
    if (get == NULL || rdev < 0 || dev < 0 || dev >= MAX_ORDINALS ||
        get(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS)
        return;
    uint64_t held = shim_kind_bytes(KIND_POOL, reserved);
    if (held > g_graph_charged[dev])
        shim_mem_count_kind(rdev, held - g_graph_charged[dev], KIND_POOL);
    else if (held < g_graph_charged[dev])
        shim_mem_unreserve_kind(rdev, g_graph_charged[dev] - held, KIND_POOL);
    g_graph_charged[dev] = held;
}

static void settle_all_locked(void)
{
    for (int i = 0; i < MAX_POOLS; i++)
        if (g_pools[i].pool != NULL)
            pool_settle(&g_pools[i]);
    uint64_t seen = __atomic_load_n(&g_devices_seen, __ATOMIC_RELAXED);
    for (int d = 0; d < MAX_ORDINALS; d++)
        if (seen & (UINT64_C(1) << d))
            graph_mem_settle_locked(d);
}

void shim_pools_settle_all_if_free(void)
{
    if (shim_mode() != SHIM_ACTIVE || pthread_mutex_trylock(&g_pool_lock) != 0)
        return; /* busy: whoever holds it settles */
    settle_all_locked();
    pthread_mutex_unlock(&g_pool_lock);
}

void shim_graph_mem_settle(CUdevice dev)
{
    if (shim_mode() != SHIM_ACTIVE)
        return;
    note_device(dev);
    pthread_mutex_lock(&g_pool_lock);
    graph_mem_settle_locked(dev);
    pthread_mutex_unlock(&g_pool_lock);
}

static bool over_limit(int rdev)
{
    uint64_t limit = __atomic_load_n(&g_shim.ctl->devices[rdev].memory_limit, __ATOMIC_RELAXED);
    uint64_t used = __atomic_load_n(&g_shim.st->devices[rdev].memory_used, __ATOMIC_RELAXED);
    return limit != 0 && used > limit;
}

/*
 * An allocation from a pool (the device's current pool when `pool` is NULL). The pool serves it
 * from what it holds unused, or grows: the growth it needs at least is reserved against the limit
 * first; afterwards what the pool really holds is counted. When the pool grew by more than fits,
 * the allocation is given back, the pool trimmed to what is in use, and the call refused.
 */
static CUresult pool_alloc(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream stream,
                           CUresult (*alloc)(CUdeviceptr *, size_t, CUmemoryPool, CUstream,
                                             void *),
                           void *real, CUresult (*free_fn)(CUdeviceptr, CUstream))
{
    CUdevice dev;
    if (current_device(&dev) != CUDA_SUCCESS)
        return alloc(dptr, size, pool, stream, real);
    note_device(dev);
    int rdev = shim_region_dev_for_cuda(dev);
    if (pool == NULL) {
        __typeof__(&cuDeviceGetMemPool) get_pool = DRIVER(cuDeviceGetMemPool);
        if (get_pool == NULL || get_pool(&pool, dev) != CUDA_SUCCESS || pool == NULL)
            return alloc(dptr, size, NULL, stream, real);
    }
    pthread_mutex_lock(&g_pool_lock);
    struct pool_rec *rec = pool_find(pool, rdev);
    if (rec == NULL || rec->rdev < 0) {
        pthread_mutex_unlock(&g_pool_lock);
        return alloc(dptr, size, pool, stream, real);
    }
    pool_settle(rec);
    uint64_t used = 0;
    pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used);
    uint64_t idle = rec->charged > used ? rec->charged - used : 0;
    uint64_t need = size > idle ? shim_kind_bytes(KIND_POOL, size - idle) : 0;
    if (need != 0 && shim_mem_reserve_kind(rec->rdev, need, KIND_POOL) != CUDA_SUCCESS) {
        settle_all_locked(); /* other pools may have given memory back since */
        if (shim_mem_reserve_kind(rec->rdev, need, KIND_POOL) != CUDA_SUCCESS) {
            pthread_mutex_unlock(&g_pool_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    rec->charged += need;
    CUresult r = alloc(dptr, size, pool, stream, real);
    pool_settle(rec);
    if (r == CUDA_SUCCESS) { /* which pool to look at again when the pointer is freed */
        struct shim_tracked from = {rec->rdev, KIND_POOL, 0, (uint64_t)(uintptr_t)pool};
        shim_track_put(TRACK_POOL_PTR, *dptr, &from);
    }
    if (r == CUDA_SUCCESS && over_limit(rec->rdev)) {
        __typeof__(&cuMemPoolTrimTo) trim = DRIVER(cuMemPoolTrimTo);
        if (free_fn != NULL && free_fn(*dptr, stream) == CUDA_SUCCESS) {
            struct shim_tracked gone;
            shim_track_get(TRACK_POOL_PTR, *dptr, &gone, true);
            if (trim != NULL)
                trim(pool, used);
            *dptr = 0;
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
        pool_settle(rec);
    }
    pthread_mutex_unlock(&g_pool_lock);
    return r;
}

static CUresult call_async(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s,
                           void *real)
{
    (void)pool;
    return ((__typeof__(&cuMemAllocAsync))real)(dptr, size, s);
}

static CUresult call_from_pool(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream s,
                               void *real)
{
    return ((__typeof__(&cuMemAllocFromPoolAsync))real)(dptr, size, pool, s);
}

#define ALLOC_ASYNC(name, free_name)                                                              \
    SHIM_EXPORT CUresult name(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)               \
    {                                                                                             \
        MEM_NEED_REAL(name);                                                                      \
        MEM_GATE(real_(dptr, bytesize, hStream));                                                 \
        if (dptr == NULL)                                                                         \
            return real_(dptr, bytesize, hStream);                                                \
        return pool_alloc(dptr, bytesize, NULL, hStream, call_async, (void *)real_,               \
                          REAL(free_name));                                                       \
    }
ALLOC_ASYNC(cuMemAllocAsync, cuMemFreeAsync)
ALLOC_ASYNC(cuMemAllocAsync_ptsz, cuMemFreeAsync_ptsz)

#define ALLOC_POOL(name, free_name)                                                               \
    SHIM_EXPORT CUresult name(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,              \
                              CUstream hStream)                                                   \
    {                                                                                             \
        MEM_NEED_REAL(name);                                                                      \
        MEM_GATE(real_(dptr, bytesize, pool, hStream));                                           \
        if (dptr == NULL || pool == NULL)                                                         \
            return real_(dptr, bytesize, pool, hStream);                                          \
        return pool_alloc(dptr, bytesize, pool, hStream, call_from_pool, (void *)real_,           \
                          REAL(free_name));                                                       \
    }
ALLOC_POOL(cuMemAllocFromPoolAsync, cuMemFreeAsync)
ALLOC_POOL(cuMemAllocFromPoolAsync_ptsz, cuMemFreeAsync_ptsz)

/* A pool keeps what is freed into it (up to its release threshold, given back at the next
 * synchronisation): the count follows the pools, not the pointer. A pointer from cuMemAlloc
 * freed here is given back as data. */
#define FREE_ASYNC(name)                                                                          \
    SHIM_EXPORT CUresult name(CUdeviceptr dptr, CUstream hStream)                                 \
    {                                                                                             \
        MEM_NEED_REAL(name);                                                                      \
        MEM_GATE(real_(dptr, hStream));                                                           \
        struct shim_tracked rec_;                                                                 \
        if (shim_track_get(TRACK_PTR, dptr, &rec_, true)) {                                       \
            CUresult r_ = real_(dptr, hStream);                                                   \
            if (r_ != CUDA_SUCCESS)                                                               \
                shim_track_put(TRACK_PTR, dptr, &rec_);                                           \
            else                                                                                  \
                shim_mem_unreserve_kind(rec_.rdev, rec_.bytes, rec_.mkind);                       \
            if (r_ == CUDA_SUCCESS && rec_.mkind == KIND_SPILLED)                                 \
                shim_spill_released();                                                            \
            return r_;                                                                            \
        }                                                                                         \
        bool known_ = shim_track_get(TRACK_POOL_PTR, dptr, &rec_, true);                          \
        pthread_mutex_lock(&g_pool_lock);                                                         \
        CUresult r_ = real_(dptr, hStream);                                                       \
        struct pool_rec *pool_ = known_ ? pool_find((CUmemoryPool)(uintptr_t)rec_.aux, -2) : NULL; \
        if (known_ && r_ != CUDA_SUCCESS)                                                         \
            shim_track_put(TRACK_POOL_PTR, dptr, &rec_);                                          \
        if (pool_ != NULL)                                                                        \
            pool_settle(pool_); /* the pool it came from */                                       \
        else                                                                                      \
            settle_all_locked(); /* from a pool made before the shim saw it */                    \
        pthread_mutex_unlock(&g_pool_lock);                                                       \
        return r_;                                                                                \
    }
FREE_ASYNC(cuMemFreeAsync)
FREE_ASYNC(cuMemFreeAsync_ptsz)

SHIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    MEM_NEED_REAL(cuMemPoolCreate);
    MEM_PASS(real_(pool, props));
    CUresult r = real_(pool, props);
    if (r != CUDA_SUCCESS || pool == NULL || props == NULL)
        return r;
    /* a pool of host memory is not device memory */
    int rdev = props->location.type == CU_MEM_LOCATION_TYPE_DEVICE
                   ? shim_region_dev_for_cuda(props->location.id)
                   : -1;
    pthread_mutex_lock(&g_pool_lock);
    struct pool_rec *rec = pool_find(*pool, rdev);
    if (rec != NULL) { /* a handle the driver reuses: it is a new pool */
        if (rec->charged != 0 && rec->rdev >= 0)
            shim_mem_unreserve_kind(rec->rdev, rec->charged, KIND_POOL);
        *rec = (struct pool_rec){*pool, rdev, 0};
    }
    pthread_mutex_unlock(&g_pool_lock);
    return r;
}

SHIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    MEM_NEED_REAL(cuMemPoolDestroy);
    MEM_PASS(real_(pool));
    pthread_mutex_lock(&g_pool_lock);
    CUresult r = real_(pool);
    struct pool_rec *rec = r == CUDA_SUCCESS ? pool_find(pool, -2) : NULL;
    if (rec != NULL) {
        if (rec->rdev >= 0 && rec->charged != 0)
            shim_mem_unreserve_kind(rec->rdev, rec->charged, KIND_POOL);
        *rec = (struct pool_rec){NULL, -1, 0};
    }
    pthread_mutex_unlock(&g_pool_lock);
    return r;
}

SHIM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    MEM_NEED_REAL(cuMemPoolTrimTo);
    MEM_PASS(real_(pool, minBytesToKeep));
    pthread_mutex_lock(&g_pool_lock);
    CUresult r = real_(pool, minBytesToKeep);
    struct pool_rec *rec = pool_find(pool, -2);
    if (rec != NULL)
        pool_settle(rec);
    pthread_mutex_unlock(&g_pool_lock);
    return r;
}

SHIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr,
                                           void *value)
{
    MEM_NEED_REAL(cuMemPoolSetAttribute);
    MEM_PASS(real_(pool, attr, value));
    pthread_mutex_lock(&g_pool_lock);
    CUresult r = real_(pool, attr, value);
    struct pool_rec *rec = pool_find(pool, -2);
    if (rec != NULL)
        pool_settle(rec);
    pthread_mutex_unlock(&g_pool_lock);
    return r;
}

SHIM_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    MEM_NEED_REAL(cuDeviceGraphMemTrim);
    MEM_PASS(real_(device));
    CUresult r = real_(device);
    shim_graph_mem_settle(device);
    return r;
}

/* ---------------------------------------------------------------- VMM */

#define VMM_REFS(aux) ((uint32_t)((aux) & 0xffffffffu))
#define VMM_MAPS(aux) ((uint32_t)((aux) >> 32))
#define VMM_AUX(refs, maps) (((uint64_t)(maps) << 32) | (uint64_t)(refs))

/* Under g_vmm_lock: a handle's references or mappings changed by (dref, dmap); the memory stops
 * counting when both are gone (a handle released while mapped lives until its last unmap). */
static void vmm_adjust(CUmemGenericAllocationHandle h, int dref, int dmap)
{
    struct shim_tracked rec;
    if (!shim_track_get(TRACK_VMM, h, &rec, true))
        return;
    int64_t refs = (int64_t)VMM_REFS(rec.aux) + dref, maps = (int64_t)VMM_MAPS(rec.aux) + dmap;
    if (refs < 0)
        refs = 0;
    if (maps < 0)
        maps = 0;
    if (refs == 0 && maps == 0) {
        shim_mem_unreserve_kind(rec.rdev, rec.bytes, rec.mkind);
        return;
    }
    rec.aux = VMM_AUX(refs, maps);
    shim_track_put(TRACK_VMM, h, &rec);
}

SHIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                 const CUmemAllocationProp *prop, unsigned long long flags)
{
    MEM_NEED_REAL(cuMemCreate);
    MEM_GATE(real_(handle, size, prop, flags));
    if (handle == NULL || prop == NULL)
        return real_(handle, size, prop, flags);
    /* host and host-NUMA memory (NCCL's host buffers) is not device memory; a device location
     * names its device, which need not be the current one */
    int rdev = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE
                   ? shim_region_dev_for_cuda(prop->location.id)
                   : -1;
    CUresult r = shim_mem_reserve(rdev, size);
    if (r != CUDA_SUCCESS)
        return r;
    r = real_(handle, size, prop, flags);
    if (r == CUDA_SUCCESS) {
        struct shim_tracked rec = {rdev, KIND_DATA, size, VMM_AUX(1, 0)};
        pthread_mutex_lock(&g_vmm_lock);
        shim_track_put(TRACK_VMM, *handle, &rec);
        pthread_mutex_unlock(&g_vmm_lock);
    } else {
        shim_mem_unreserve(rdev, size);
    }
    return r;
}

SHIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    MEM_NEED_REAL(cuMemRelease);
    MEM_GATE(real_(handle));
    pthread_mutex_lock(&g_vmm_lock);
    CUresult r = real_(handle);
    if (r == CUDA_SUCCESS)
        vmm_adjust(handle, -1, 0);
    pthread_mutex_unlock(&g_vmm_lock);
    return r;
}

SHIM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    MEM_NEED_REAL(cuMemRetainAllocationHandle);
    MEM_PASS(real_(handle, addr));
    pthread_mutex_lock(&g_vmm_lock);
    CUresult r = real_(handle, addr);
    if (r == CUDA_SUCCESS && handle != NULL)
        vmm_adjust(*handle, +1, 0);
    pthread_mutex_unlock(&g_vmm_lock);
    return r;
}

SHIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                              CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    MEM_NEED_REAL(cuMemMap);
    MEM_PASS(real_(ptr, size, offset, handle, flags));
    pthread_mutex_lock(&g_vmm_lock);
    CUresult r = real_(ptr, size, offset, handle, flags);
    struct shim_tracked rec;
    if (r == CUDA_SUCCESS && shim_track_get(TRACK_VMM, handle, &rec, false)) {
        /* a mapping record counts nothing itself (0 bytes): it names the handle to unmap */
        struct shim_tracked map = {rec.rdev, KIND_DATA, 0, handle};
        shim_track_put(TRACK_MAPPING, ptr, &map);
        vmm_adjust(handle, 0, +1);
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return r;
}

struct unmapped {
    uint64_t keys[64];
    int n;
};

static void collect_mapping(uint64_t key, struct shim_tracked *rec, void *arg)
{
    (void)rec;
    struct unmapped *u = arg;
    if (u->n < (int)(sizeof u->keys / sizeof u->keys[0]))
        u->keys[u->n++] = key;
}

SHIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    MEM_NEED_REAL(cuMemUnmap);
    MEM_PASS(real_(ptr, size));
    pthread_mutex_lock(&g_vmm_lock);
    CUresult r = real_(ptr, size);
    if (r == CUDA_SUCCESS) {
        uint64_t end = (uint64_t)ptr + size < (uint64_t)ptr ? UINT64_MAX : (uint64_t)ptr + size;
        for (;;) { /* every mapping that started inside the range is gone */
            struct unmapped u = {.n = 0};
            shim_track_each(TRACK_MAPPING, ptr, end, collect_mapping, &u);
            for (int i = 0; i < u.n; i++) {
                struct shim_tracked map;
                if (shim_track_get(TRACK_MAPPING, u.keys[i], &map, true))
                    vmm_adjust(map.aux, 0, -1);
            }
            if (u.n < (int)(sizeof u.keys / sizeof u.keys[0]))
                break;
        }
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return r;
}

/* ---------------------------------------------------------------- arrays */

static uint64_t format_bytes(CUarray_format format)
{
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    default: return 4; /* 32-bit formats; others are settled by the driver's requirements */
    }
}

static uint64_t sat_mul(uint64_t a, uint64_t b)
{
    return a != 0 && b > UINT64_MAX / a ? UINT64_MAX : a * b;
}

static uint64_t array_estimate(size_t w, size_t h, size_t d, CUarray_format f, unsigned ch,
                               unsigned levels)
{
    uint64_t total = 0;
    for (unsigned l = 0; l < (levels ? levels : 1) && l < 64; l++) {
        uint64_t lw = w >> l ? w >> l : 1, lh = h >> l ? h >> l : 1, ld = d >> l ? d >> l : 1;
        uint64_t bytes = sat_mul(sat_mul(sat_mul(lw, lh), ld), sat_mul(format_bytes(f), ch ? ch : 1));
        total = total + bytes < total ? UINT64_MAX : total + bytes;
    }
    return total;
}

static CUresult destroy_array(uint64_t key)
{
    __typeof__(&cuArrayDestroy) destroy = REAL(cuArrayDestroy);
    return destroy != NULL ? destroy((CUarray)(uintptr_t)key) : CUDA_ERROR_NOT_INITIALIZED;
}

static CUresult destroy_mipmapped(uint64_t key)
{
    __typeof__(&cuMipmappedArrayDestroy) destroy = REAL(cuMipmappedArrayDestroy);
    return destroy != NULL ? destroy((CUmipmappedArray)(uintptr_t)key) : CUDA_ERROR_NOT_INITIALIZED;
}

static uint64_t array_size(uint64_t key, uint64_t estimate)
{
    __typeof__(&cuArrayGetMemoryRequirements) get = DRIVER(cuArrayGetMemoryRequirements);
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    CUdevice dev;
    memset(&req, 0, sizeof req);
    if (get == NULL || current_device(&dev) != CUDA_SUCCESS ||
        get(&req, (CUarray)(uintptr_t)key, dev) != CUDA_SUCCESS)
        return estimate;
    return req.size;
}

static uint64_t mipmapped_size(uint64_t key, uint64_t estimate)
{
    __typeof__(&cuMipmappedArrayGetMemoryRequirements) get =
        DRIVER(cuMipmappedArrayGetMemoryRequirements);
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    CUdevice dev;
    memset(&req, 0, sizeof req);
    if (get == NULL || current_device(&dev) != CUDA_SUCCESS ||
        get(&req, (CUmipmappedArray)(uintptr_t)key, dev) != CUDA_SUCCESS)
        return estimate;
    return req.size;
}

/* How one kind of array is sized and destroyed, its handle the key. */
struct array_kind {
    uint64_t (*size)(uint64_t key, uint64_t estimate);
    CUresult (*destroy)(uint64_t key);
};

static const struct array_kind PLAIN_ARRAY = {array_size, destroy_array};
static const struct array_kind MIPMAPPED_ARRAY = {mipmapped_size, destroy_mipmapped};

/* After the driver made an array, `estimate` bytes reserved before: what the driver says it
 * takes is counted instead, and where that does not fit, the array is destroyed again. */
static CUresult settle_array(int rdev, uint64_t key, uint64_t estimate,
                             const struct array_kind *kind)
{
    uint64_t actual = kind->size(key, estimate);
    if (actual > estimate && shim_mem_reserve(rdev, actual - estimate) != CUDA_SUCCESS) {
        kind->destroy(key);
        shim_mem_unreserve(rdev, estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < estimate)
        shim_mem_unreserve(rdev, estimate - actual);
    struct shim_tracked rec = {rdev, KIND_DATA, actual, 0};
    shim_track_put(TRACK_ARRAY, key, &rec);
    return CUDA_SUCCESS;
}

/* The body of an array's creation hook, counted: the estimate reserved (refused over the
 * limit), the driver called as `call`, the reservation given back where the driver fails, the
 * array settled where it succeeds (its handle cleared where it did not fit after all). */
#define CREATE_COUNTED(handle, estimate, kind, call)                                              \
    do {                                                                                          \
        uint64_t estimate_ = (estimate);                                                          \
        CUresult r_ = shim_mem_reserve(rdev, estimate_);                                          \
        if (r_ != CUDA_SUCCESS)                                                                   \
            return r_;                                                                            \
        r_ = (call);                                                                              \
        if (r_ != CUDA_SUCCESS) {                                                                 \
            shim_mem_unreserve(rdev, estimate_);                                                  \
            return r_;                                                                            \
        }                                                                                         \
        r_ = settle_array(rdev, (uint64_t)(uintptr_t)*(handle), estimate_, (kind));              \
        if (r_ != CUDA_SUCCESS)                                                                   \
            *(handle) = NULL;                                                                     \
        return r_;                                                                                \
    } while (0)

SHIM_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    MEM_NEED_REAL(cuArrayCreate_v2);
    MEM_GATE(real_(pHandle, desc));
    int rdev = shim_region_dev_current();
    if (pHandle == NULL || desc == NULL || rdev < 0)
        return real_(pHandle, desc);
    CREATE_COUNTED(pHandle, array_estimate(desc->Width, desc->Height, 1, desc->Format,
                                           desc->NumChannels, 1),
                   &PLAIN_ARRAY, real_(pHandle, desc));
}

SHIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    MEM_NEED_REAL(cuArray3DCreate_v2);
    MEM_GATE(real_(pHandle, desc));
    int rdev = shim_region_dev_current();
    if (pHandle == NULL || desc == NULL || rdev < 0)
        return real_(pHandle, desc);
    CREATE_COUNTED(pHandle, array_estimate(desc->Width, desc->Height, desc->Depth, desc->Format,
                                           desc->NumChannels, 1),
                   &PLAIN_ARRAY, real_(pHandle, desc));
}

SHIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                            const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                            unsigned int numMipmapLevels)
{
    MEM_NEED_REAL(cuMipmappedArrayCreate);
    MEM_GATE(real_(pHandle, desc, numMipmapLevels));
    int rdev = shim_region_dev_current();
    if (pHandle == NULL || desc == NULL || rdev < 0)
        return real_(pHandle, desc, numMipmapLevels);
    CREATE_COUNTED(pHandle, array_estimate(desc->Width, desc->Height, desc->Depth, desc->Format,
                                           desc->NumChannels, numMipmapLevels),
                   &MIPMAPPED_ARRAY, real_(pHandle, desc, numMipmapLevels));
}

#define DESTROY_ARRAY(name, type)                                                                 \
    SHIM_EXPORT CUresult name(type handle)                                                        \
    {                                                                                             \
        MEM_NEED_REAL(name);                                                                      \
        MEM_GATE(real_(handle));                                                                  \
        struct shim_tracked rec_;                                                                 \
        bool had_ = shim_track_get(TRACK_ARRAY, (uint64_t)(uintptr_t)handle, &rec_, true);        \
        CUresult r_ = real_(handle);                                                              \
        if (had_) {                                                                               \
            if (r_ == CUDA_SUCCESS)                                                               \
                shim_mem_unreserve(rec_.rdev, rec_.bytes);                                        \
            else                                                                                  \
                shim_track_put(TRACK_ARRAY, (uint64_t)(uintptr_t)handle, &rec_);                  \
        }                                                                                         \
        return r_;                                                                                \
    }
DESTROY_ARRAY(cuArrayDestroy, CUarray)
DESTROY_ARRAY(cuMipmappedArrayDestroy, CUmipmappedArray)

/* ---------------------------------------------------------------- fork */

static void memory_fork_prepare(void)
{
    pthread_mutex_lock(&g_measure_lock);
    pthread_mutex_lock(&g_ctx_lock);
    pthread_mutex_lock(&g_pool_lock);
    pthread_mutex_lock(&g_vmm_lock);
}

static void memory_fork_parent(void)
{
    pthread_mutex_unlock(&g_vmm_lock);
    pthread_mutex_unlock(&g_pool_lock);
    pthread_mutex_unlock(&g_ctx_lock);
    pthread_mutex_unlock(&g_measure_lock);
}

/* The child has none of the parent's contexts, pools or handles (CUDA state does not survive
 * fork): it starts with nothing counted; what it creates is counted in its own slot. */
static void memory_fork_child(void)
{
    memset(g_primary_refs, 0, sizeof g_primary_refs);
    memset(g_primary_ctx, 0, sizeof g_primary_ctx);
    memset(g_pools, 0, sizeof g_pools);
    memset(g_graph_charged, 0, sizeof g_graph_charged);
    __atomic_store_n(&g_devices_seen, 0, __ATOMIC_RELAXED);
    memory_fork_parent();
}

/* Registered at the first hook call, so after region.c's handlers: its prepare handler (taking
 * the tracking lock, which these locks are held around) then runs after these. */
static void memory_fork_register(void)
{
    pthread_atfork(memory_fork_prepare, memory_fork_parent, memory_fork_child);
}

static void memory_fork_once(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, memory_fork_register);
}
