/*
 * cuda_client.c - a CUDA "application" for the shim tests, run with libvgpu.so preloaded.
 *
 *   cuda_client <way> <command>...
 *
 * way: how it reaches the driver
 *   direct        calls the linked entry points
 *   dlsym         dlopen("libcuda.so.1") + dlsym of the versioned names
 *   procaddr      cuGetProcAddress_v2 (found with dlsym), base names, CUDA 12.8
 *   procaddr_ptsz the same with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
 *   procaddr_v1   cuGetProcAddress (4 arguments), CUDA 11.8
 *
 * commands (EXPECT is ok | oom | noinit | a CUresult number; sizes take K/M/G suffixes):
 *   ctx DEV                                  cuInit + a context on DEV (current on this thread)
 *   alloc plain|pitch|managed|async|pool|create SIZE EXPECT
 *   free EXPECT                              frees the newest live allocation with its API
 *   info TOTAL|- FREE|-                      cuMemGetInfo_v2
 *   totalmem DEV TOTAL                       cuDeviceTotalMem_v2 of DEV
 *   mtpace THREADS SECONDS GRID BLOCK        THREADS threads launch for SECONDS, then are joined;
 *                                            prints "mtpace launches=N ns=T"
 *   launch kernel|ex|coop|graph N GRID BLOCK EXPECT
 *   pace kernel|ex|coop|graph SECONDS GRID BLOCK COST DRAIN
 *                                            spends at least DRAIN tokens (COST per launch) and
 *                                            until a launch has to wait, then launches for
 *                                            SECONDS and prints "pace launches=N ns=T"
 *   timed N GRID BLOCK                       N kernel launches, prints "timed ns=T"
 *   hold                                     prints "ready" and blocks until stdin closes
 *   nvml INDEX TOTAL USED                    NVML memory info (v1 and v2) of device INDEX
 *   counter NAME VALUE                       the fake driver's counter NAME equals VALUE
 *   forkstress N                             forks N children while a thread allocates/launches
 *   forkstress-launches N                    the same, the thread only launching (no malloc)
 *   rtldnext                                 dlsym(RTLD_NEXT, ...) answers as without the shim
 *   exec WAY COMMAND...                      replaces the process with a new client image
 * graphs, capture and legacy launches (slots: graphs G, executables E, nodes K, streams S are
 * small numbers; a stream argument is a slot, "null", "legacy" or "pt"):
 *   gnew G | gkernel G GRID BLOCK | gchild G C | gempty G | gcond G
 *                                            build graphs (each new node takes the next K)
 *   ginner K                                 the nodes of child-graph node K take the next Ks
 *   ginst E G v1|v2|flags|params|params_ptsz EXPECT
 *   glaunch E N STREAM EXPECT                N launches of executable E
 *   gdestroy E | gupdate E G EXPECT | gsetk E K GRID BLOCK v1|v2|generic EXPECT
 *   gsetchild E K G direct|generic EXPECT | genable E K 0|1 EXPECT | queryfail 0|1
 *   stream S [nonblocking] | capture STREAM global|thread|relaxed EXPECT | endcapture STREAM G EXPECT
 *   launchon STREAM N GRID BLOCK EXPECT      cuLaunchKernel into a stream; prints "launchon ns=T"
 *   blockshape X Y Z | legacy launch|grid|gridasync N W H EXPECT
 *   multidev S1 S2 GRID BLOCK EXPECT         cuLaunchCooperativeKernelMultiDevice on two streams
 *   gpa BASE VERSION default|pt hook:NAME|nothook|notfound
 *                                            cuGetProcAddress_v2 and cuGetProcAddress of BASE:
 *                                            the shim's hook NAME, anything but a hook (a driver
 *                                            function or not found), or not found
 *   spin SECONDS GRID BLOCK                  launches until SECONDS pass; prints "spin launches=N"
 *   itimer US                                a no-op SIGALRM every US microseconds (interrupts sleeps)
 * memory the driver holds (see fake_cuda_memory.c):
 *   primary DEV EXPECT | unprimary DEV       cuDevicePrimaryCtxRetain (made current) / Release
 *   ctxnew DEV EXPECT | ctxdrop              one more context (current) / destroy the newest
 *   limit heap|stack|fifo SIZE EXPECT        cuCtxSetLimit on the current context
 *   module data|file|lib SIZE EXPECT | unload  load a fake image holding SIZE / unload the newest
 *   poolcreate dev|host                      the pool "alloc pool" uses from now on
 *   threshold SIZE | trim SIZE | sync        release threshold and cuMemPoolTrimTo of the default
 *                                            and created pools; cuCtxSynchronize
 *   vmm SIZE DEV|host|hostnuma EXPECT        cuMemCreate at that location (freed by "free")
 *   map | unmap | retain                     cuMemMap of the newest handle / cuMemUnmap of the
 *                                            newest mapping / cuMemRetainAllocationHandle of it
 *   array 2d|3d|mip W H D EXPECT | undo      an array (freed by "free")
 *   graphmem DEV SIZE | graphtrim DEV        graph memory reserved (fake) / cuDeviceGraphMemTrim
 *   compare DEV TOLERANCE                    the shim's count in $VGPU_REGION_DIR/state (region
 *                                            device 0) and the driver's own count of DEV differ
 *                                            by at most TOLERANCE; prints "compare shim=.. driver=.."
 *   mixed N SEED                             N random operations of every kind above
 *   forkexit                                 forks a child that exits at once, waits for it
 * spilling to managed memory:
 *   ismanaged 0|1                            cuPointerGetAttribute(IS_MANAGED) of the newest
 *                                            allocation is that
 *   preferred DEV                            the fake's preferred location of the newest (-1 none,
 *                                            -2 not managed)
 *   ipc EXPECT                               cuIpcGetMemHandle of the newest allocation
 *   hostheld SIZE                            managed memory the fake driver holds is SIZE
 *   spilled SIZE                             the region's state counts SIZE spilled on device 0
 *   spillthreads T N SIZE                    T threads allocate up to 8 x SIZE and free them
 *                                            (cuMemFree / cuMemFreeAsync alternately), N rounds
 *   allocloop N SIZE                         N pairs of cuMemAlloc SIZE + cuMemFree, each timed;
 *                                            prints "allocloop median_ns=X p99_ns=Y managed=M"
 *   timedalloc API N SIZE                    N allocations and frees of SIZE with API (as
 *                                            "alloc"), prints "timedalloc ns=T"
 * Exit status 0 when every expectation held; 1 with a message on stderr otherwise.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_subset.h"
#include "vgpu_shm.h"
#include "nvml_subset.h"

unsigned long long fakeCudaCounter(const char *name);

struct api {
    __typeof__(&cuInit) init;
    __typeof__(&cuCtxCreate_v2) ctx_create;
    __typeof__(&cuCtxSetCurrent) ctx_set;
    __typeof__(&cuMemAlloc_v2) alloc;
    __typeof__(&cuMemAllocPitch_v2) alloc_pitch;
    __typeof__(&cuMemAllocManaged) alloc_managed;
    __typeof__(&cuMemAllocAsync) alloc_async;
    __typeof__(&cuMemAllocFromPoolAsync) alloc_pool;
    __typeof__(&cuMemCreate) create;
    __typeof__(&cuMemFree_v2) free_;
    __typeof__(&cuMemFreeAsync) free_async;
    __typeof__(&cuMemRelease) release;
    __typeof__(&cuMemGetInfo_v2) info;
    __typeof__(&cuLaunchKernel) launch;
    __typeof__(&cuLaunchKernelEx) launch_ex;
    __typeof__(&cuLaunchCooperativeKernel) launch_coop;
    __typeof__(&cuGraphLaunch) graph;
    __typeof__(&cuCtxGetDevice) ctx_device;
    __typeof__(&cuDeviceTotalMem_v2) total_mem;
};

static struct api A;
static const char *g_way;

static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cuda_client(%s): ", g_way);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void *resolve(void *lib, const char *versioned, const char *base)
{
    void *p = NULL;
    if (strcmp(g_way, "dlsym") == 0) {
        p = dlsym(lib, versioned);
    } else {
        bool v1 = strcmp(g_way, "procaddr_v1") == 0;
        cuuint64_t flags = strcmp(g_way, "procaddr_ptsz") == 0
                               ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                               : CU_GET_PROC_ADDRESS_DEFAULT;
        CUresult r;
        /* the ABI asked for must be the one called: from CUDA 11.4 "cuCtxCreate" is _v3, then _v4 */
        int version = strcmp(versioned, "cuCtxCreate_v2") == 0 ? 11000 : v1 ? 11080 : 12080;
        if (v1) {
            __typeof__(&cuGetProcAddress) gpa = (__typeof__(&cuGetProcAddress))dlsym(lib, "cuGetProcAddress");
            if (gpa == NULL)
                fail("no cuGetProcAddress");
            r = gpa(base, &p, version, flags);
        } else {
            __typeof__(&cuGetProcAddress_v2) gpa =
                (__typeof__(&cuGetProcAddress_v2))dlsym(lib, "cuGetProcAddress_v2");
            if (gpa == NULL)
                fail("no cuGetProcAddress_v2");
            CUdriverProcAddressQueryResult status;
            r = gpa(base, &p, version, flags, &status);
            if (r == CUDA_SUCCESS && status != CU_GET_PROC_ADDRESS_SUCCESS)
                fail("cuGetProcAddress_v2(%s) status %d", base, (int)status);
        }
        if (r != CUDA_SUCCESS)
            fail("cuGetProcAddress(%s) = %d", base, (int)r);
    }
    if (p == NULL)
        fail("cannot resolve %s", versioned);
    return p;
}

static void load_api(void)
{
    if (strcmp(g_way, "direct") == 0) {
        A = (struct api){cuInit,           cuCtxCreate_v2,  cuCtxSetCurrent,
                         cuMemAlloc_v2,    cuMemAllocPitch_v2, cuMemAllocManaged,
                         cuMemAllocAsync,  cuMemAllocFromPoolAsync, cuMemCreate,
                         cuMemFree_v2,     cuMemFreeAsync,  cuMemRelease,
                         cuMemGetInfo_v2,  cuLaunchKernel,  cuLaunchKernelEx,
                         cuLaunchCooperativeKernel, cuGraphLaunch, cuCtxGetDevice,
                         cuDeviceTotalMem_v2};
        return;
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        fail("dlopen libcuda.so.1: %s", dlerror());
#define R(field, versioned, base) A.field = (__typeof__(A.field))resolve(lib, versioned, base)
    R(init, "cuInit", "cuInit");
    R(ctx_create, "cuCtxCreate_v2", "cuCtxCreate");
    R(ctx_set, "cuCtxSetCurrent", "cuCtxSetCurrent");
    R(alloc, "cuMemAlloc_v2", "cuMemAlloc");
    R(alloc_pitch, "cuMemAllocPitch_v2", "cuMemAllocPitch");
    R(alloc_managed, "cuMemAllocManaged", "cuMemAllocManaged");
    R(alloc_async, "cuMemAllocAsync", "cuMemAllocAsync");
    R(alloc_pool, "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync");
    R(create, "cuMemCreate", "cuMemCreate");
    R(free_, "cuMemFree_v2", "cuMemFree");
    R(free_async, "cuMemFreeAsync", "cuMemFreeAsync");
    R(release, "cuMemRelease", "cuMemRelease");
    R(info, "cuMemGetInfo_v2", "cuMemGetInfo");
    R(launch, "cuLaunchKernel", "cuLaunchKernel");
    R(launch_ex, "cuLaunchKernelEx", "cuLaunchKernelEx");
    R(launch_coop, "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel");
    R(graph, "cuGraphLaunch", "cuGraphLaunch");
    R(ctx_device, "cuCtxGetDevice", "cuCtxGetDevice");
    R(total_mem, "cuDeviceTotalMem_v2", "cuDeviceTotalMem");
#undef R
}

static unsigned long long parse_size(const char *s)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    switch (*end) {
    case 'K': return v << 10;
    case 'M': return v << 20;
    case 'G': return v << 30;
    default: return v;
    }
}

static int parse_expect(const char *s)
{
    if (strcmp(s, "ok") == 0)
        return CUDA_SUCCESS;
    if (strcmp(s, "oom") == 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (strcmp(s, "noinit") == 0)
        return CUDA_ERROR_NOT_INITIALIZED;
    return atoi(s);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ allocations */

enum kind { K_PTR, K_ASYNC, K_HANDLE, K_ARRAY, K_MIPMAP };
static struct {
    unsigned long long key;
    enum kind kind;
} g_live[4096];
static int g_nlive;
static CUstream const STREAM = (CUstream)0;
static CUmemoryPool g_pool; /* created by "poolcreate", or on the first "alloc pool" */

static void *mem_api(void *direct, const char *versioned, const char *base);
#define M(fn, versioned, base) ((__typeof__(&fn))mem_api((void *)fn, versioned, base))

static CUmemoryPool the_pool(void)
{
    if (g_pool == NULL) {
        CUdevice dev = 0;
        A.ctx_device(&dev);
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = dev;
        if (M(cuMemPoolCreate, "cuMemPoolCreate", "cuMemPoolCreate")(&g_pool, &props) != CUDA_SUCCESS)
            g_pool = NULL;
    }
    return g_pool;
}

static CUresult do_alloc(const char *api, unsigned long long size)
{
    CUdeviceptr p = 0;
    CUresult r;
    enum kind kind = K_PTR;
    if (strcmp(api, "plain") == 0) {
        r = A.alloc(&p, size);
    } else if (strcmp(api, "pitch") == 0) {
        size_t pitch = 0;
        r = A.alloc_pitch(&p, &pitch, size, 1, 4);
    } else if (strcmp(api, "managed") == 0) {
        r = A.alloc_managed(&p, size, CU_MEM_ATTACH_GLOBAL);
    } else if (strcmp(api, "async") == 0) {
        r = A.alloc_async(&p, size, STREAM);
        kind = K_ASYNC;
    } else if (strcmp(api, "pool") == 0) {
        r = A.alloc_pool(&p, size, the_pool(), STREAM);
        kind = K_ASYNC;
    } else if (strcmp(api, "create") == 0) {
        CUdevice dev = 0;
        if (A.ctx_device(&dev) != CUDA_SUCCESS)
            fail("no current device for cuMemCreate");
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev;
        CUmemGenericAllocationHandle h = 0;
        r = A.create(&h, size, &prop, 0);
        p = h;
        kind = K_HANDLE;
    } else {
        fail("unknown alloc api %s", api);
        return CUDA_ERROR_UNKNOWN;
    }
    if (r == CUDA_SUCCESS) {
        if (g_nlive == (int)(sizeof g_live / sizeof g_live[0]))
            fail("too many live allocations");
        g_live[g_nlive].key = p;
        g_live[g_nlive].kind = kind;
        g_nlive++;
    }
    return r;
}

static CUresult do_free(void)
{
    if (g_nlive == 0)
        fail("free with nothing allocated");
    g_nlive--;
    switch (g_live[g_nlive].kind) {
    case K_ASYNC: return A.free_async(g_live[g_nlive].key, STREAM);
    case K_HANDLE: return A.release(g_live[g_nlive].key);
    case K_ARRAY: return M(cuArrayDestroy, "cuArrayDestroy", "cuArrayDestroy")((CUarray)(uintptr_t)g_live[g_nlive].key);
    case K_MIPMAP:
        return M(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy",
                 "cuMipmappedArrayDestroy")((CUmipmappedArray)(uintptr_t)g_live[g_nlive].key);
    default: return A.free_(g_live[g_nlive].key);
    }
}

/* ------------------------------------------------------------------ launches */

static CUfunction const FUNC = (CUfunction)0x6000;
static CUgraphExec const GRAPH = (CUgraphExec)0x7000; /* an executable graph no driver made */
static CUgraphExec one_kernel_graph(unsigned grid, unsigned block);

static CUresult do_launch(const char *kind, unsigned grid, unsigned block)
{
    if (strcmp(kind, "kernel") == 0)
        return A.launch(FUNC, grid, 1, 1, block, 1, 1, 0, STREAM, NULL, NULL);
    if (strcmp(kind, "ex") == 0) {
        CUlaunchConfig c = {grid, 1, 1, block, 1, 1, 0, STREAM, NULL, 0};
        return A.launch_ex(&c, FUNC, NULL, NULL);
    }
    if (strcmp(kind, "coop") == 0)
        return A.launch_coop(FUNC, grid, 1, 1, block, 1, 1, 0, STREAM, NULL);
    if (strcmp(kind, "graph") == 0) {
        CUgraphExec e = one_kernel_graph(grid, block);
        return A.graph(e != NULL ? e : GRAPH, STREAM);
    }
    fail("unknown launch kind %s", kind);
    return CUDA_ERROR_UNKNOWN;
}

static void pace(const char *kind, double seconds, unsigned grid, unsigned block,
                 unsigned long long cost, unsigned long long drain)
{
    /* spend the initial burst, then until a launch has to wait: from then on the bucket is
     * empty (a pause of the process alone, e.g. at the first call, does not count as a wait) */
    uint64_t give_up = now_ns() + 10ull * 1000000000ull;
    unsigned long long spent = 0;
    for (;;) {
        uint64_t before = now_ns();
        if (do_launch(kind, grid, block) != CUDA_SUCCESS)
            fail("launch failed while draining");
        uint64_t after = now_ns();
        spent += cost;
        if (spent >= drain && after - before > 200000) /* 0.2 ms: it slept for tokens */
            break;
        if (after > give_up)
            fail("never had to wait: the launches are not paced");
    }
    uint64_t t0 = now_ns(), t1 = t0, end = t0 + (uint64_t)(seconds * 1e9);
    unsigned long long n = 0;
    while (t1 < end) {
        if (do_launch(kind, grid, block) != CUDA_SUCCESS)
            fail("launch failed");
        n++;
        t1 = now_ns();
    }
    printf("pace launches=%llu ns=%llu\n", n, (unsigned long long)(t1 - t0));
}

/* ------------------------------------------------------------------ fork under load */

static volatile int g_stop;

static volatile int g_hammer_allocates;

static void *hammer(void *ctx)
{
    if (A.ctx_set((CUcontext)ctx) != CUDA_SUCCESS)
        return (void *)1;
    while (!__atomic_load_n(&g_stop, __ATOMIC_RELAXED)) {
        CUdeviceptr p;
        if (g_hammer_allocates && A.alloc(&p, 4096) == CUDA_SUCCESS)
            A.free_(p);
        A.launch(FUNC, 1, 1, 1, 32, 1, 1, 0, STREAM, NULL, NULL);
    }
    return NULL;
}

static void forkstress(int n, CUcontext ctx, int allocates)
{
    pthread_t t;
    g_hammer_allocates = allocates;
    if (pthread_create(&t, NULL, hammer, ctx) != 0)
        fail("pthread_create");
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid < 0)
            fail("fork");
        if (pid == 0) {
            alarm(20);
            CUdeviceptr p;
            if (A.alloc(&p, 1 << 20) != CUDA_SUCCESS || A.free_(p) != CUDA_SUCCESS)
                _exit(3);
            if (A.launch(FUNC, 1, 1, 1, 32, 1, 1, 0, STREAM, NULL, NULL) != CUDA_SUCCESS)
                _exit(4);
            _exit(0);
        }
        int status = 0;
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
            fail("forked child %d ended with status %#x", i, status);
    }
    __atomic_store_n(&g_stop, 1, __ATOMIC_RELAXED);
    pthread_join(t, NULL);
}

/* ------------------------------------------------------------------ threads */

struct mt {
    CUcontext ctx;
    uint64_t end;
    unsigned grid, block;
    unsigned long long launches;
};

static void *mt_worker(void *arg)
{
    struct mt *m = arg;
    if (A.ctx_set(m->ctx) != CUDA_SUCCESS)
        return (void *)1;
    while (now_ns() < m->end) {
        if (A.launch(FUNC, m->grid, 1, 1, m->block, 1, 1, 0, STREAM, NULL, NULL) != CUDA_SUCCESS)
            return (void *)1;
        m->launches++;
    }
    return NULL;
}

static void mtpace(CUcontext ctx, int threads, double seconds, unsigned grid, unsigned block)
{
    struct mt m[64];
    pthread_t t[64];
    if (threads < 1 || threads > 64)
        fail("mtpace: 1..64 threads");
    uint64_t t0 = now_ns();
    for (int i = 0; i < threads; i++) {
        m[i] = (struct mt){ctx, t0 + (uint64_t)(seconds * 1e9), grid, block, 0};
        if (pthread_create(&t[i], NULL, mt_worker, &m[i]) != 0)
            fail("pthread_create");
    }
    unsigned long long total = 0;
    for (int i = 0; i < threads; i++) {
        void *rc;
        pthread_join(t[i], &rc);
        if (rc != NULL)
            fail("thread %d: launch failed", i);
        total += m[i].launches;
    }
    printf("mtpace launches=%llu ns=%llu\n", total, (unsigned long long)(now_ns() - t0));
}

/* T threads each make N allocations of SIZE and free them, every other one with cuMemFreeAsync:
 * with a small card some are device memory and some are spilled, all at once. */
struct spill_worker {
    CUcontext ctx;
    int n;
    unsigned long long size;
};

static void *spill_worker(void *arg)
{
    struct spill_worker *w = arg;
    if (A.ctx_set(w->ctx) != CUDA_SUCCESS)
        return (void *)1;
    CUdeviceptr held[8];
    for (int k = 0; k < w->n; k++) {
        int m = 1 + k % 8;
        for (int j = 0; j < m; j++)
            if (A.alloc(&held[j], w->size) != CUDA_SUCCESS)
                return (void *)2;
        for (int j = 0; j < m; j++)
            if ((j % 2 ? A.free_async(held[j], STREAM) : A.free_(held[j])) != CUDA_SUCCESS)
                return (void *)3;
    }
    return NULL;
}

static void spillthreads(CUcontext ctx, int threads, int n, unsigned long long size)
{
    struct spill_worker w[32];
    pthread_t t[32];
    if (threads < 1 || threads > 32)
        fail("spillthreads: 1..32 threads");
    unsigned long long managed_before = fakeCudaCounter("managed");
    for (int i = 0; i < threads; i++) {
        w[i] = (struct spill_worker){ctx, n, size};
        if (pthread_create(&t[i], NULL, spill_worker, &w[i]) != 0)
            fail("pthread_create");
    }
    for (int i = 0; i < threads; i++) {
        void *rc;
        pthread_join(t[i], &rc);
        if (rc != NULL)
            fail("spillthreads: thread %d failed (%ld)", i, (long)(intptr_t)rc);
    }
    if (fakeCudaCounter("managed") == managed_before)
        fail("spillthreads: nothing was spilled");
}

/* ------------------------------------------------------------------ graphs and capture */

struct gapi {
    __typeof__(&cuGraphCreate) create;
    __typeof__(&cuGraphAddKernelNode_v2) add_kernel;
    __typeof__(&cuGraphAddKernelNode) add_kernel_v1;
    __typeof__(&cuGraphAddChildGraphNode) add_child;
    __typeof__(&cuGraphAddEmptyNode) add_empty;
    __typeof__(&cuGraphGetNodes) get_nodes;
    __typeof__(&cuGraphChildGraphNodeGetGraph) child_graph;
    __typeof__(&cuGraphInstantiate) inst_v1;
    __typeof__(&cuGraphInstantiate_v2) inst_v2;
    __typeof__(&cuGraphInstantiateWithFlags) inst_flags;
    __typeof__(&cuGraphInstantiateWithParams) inst_params;
    __typeof__(&cuGraphInstantiateWithParams_ptsz) inst_params_ptsz;
    __typeof__(&cuGraphExecDestroy) exec_destroy;
    __typeof__(&cuGraphExecUpdate) update_v1;
    __typeof__(&cuGraphExecUpdate_v2) update_v2;
    __typeof__(&cuGraphExecKernelNodeSetParams) setk_v1;
    __typeof__(&cuGraphExecKernelNodeSetParams_v2) setk_v2;
    __typeof__(&cuGraphExecChildGraphNodeSetParams) setchild;
    __typeof__(&cuGraphExecNodeSetParams) set_generic;
    __typeof__(&cuGraphNodeSetEnabled) enable;
    __typeof__(&cuStreamCreate) stream_create;
    __typeof__(&cuStreamBeginCapture_v2) begin;
    __typeof__(&cuStreamEndCapture) end;
    __typeof__(&cuFuncSetBlockShape) shape;
    __typeof__(&cuLaunch) launch0;
    __typeof__(&cuLaunchGrid) launch_grid;
    __typeof__(&cuLaunchGridAsync) launch_grid_async;
    __typeof__(&cuLaunchCooperativeKernelMultiDevice) multidev;
};

static struct gapi GA;
static int g_gapi_loaded;
static bool g_v11; /* procaddr_v1: the CUDA 11.8 ABIs of versioned graph entry points */

/* NULL when the way cannot reach it (the caller fails with its name) */
static void *try_resolve(void *lib, const char *versioned, const char *base)
{
    if (strcmp(g_way, "direct") == 0)
        return dlsym(RTLD_DEFAULT, versioned);
    if (strcmp(g_way, "dlsym") == 0)
        return dlsym(lib, versioned);
    void *p = NULL;
    cuuint64_t flags = strcmp(g_way, "procaddr_ptsz") == 0
                           ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                           : CU_GET_PROC_ADDRESS_DEFAULT;
    if (g_v11) {
        __typeof__(&cuGetProcAddress) gpa =
            (__typeof__(&cuGetProcAddress))dlsym(lib, "cuGetProcAddress");
        if (gpa == NULL || gpa(base, &p, 11080, flags) != CUDA_SUCCESS)
            return NULL;
    } else {
        __typeof__(&cuGetProcAddress_v2) gpa =
            (__typeof__(&cuGetProcAddress_v2))dlsym(lib, "cuGetProcAddress_v2");
        CUdriverProcAddressQueryResult st;
        if (gpa == NULL || gpa(base, &p, 12080, flags, &st) != CUDA_SUCCESS)
            return NULL;
    }
    return p;
}

static void load_gapi(void)
{
    if (g_gapi_loaded)
        return;
    g_gapi_loaded = 1;
    g_v11 = strcmp(g_way, "procaddr_v1") == 0;
    bool pt = strcmp(g_way, "procaddr_ptsz") == 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
#define G(field, versioned, base) GA.field = (__typeof__(GA.field))try_resolve(lib, versioned, base)
    G(create, "cuGraphCreate", "cuGraphCreate");
    if (g_v11)
        G(add_kernel_v1, "cuGraphAddKernelNode", "cuGraphAddKernelNode");
    else
        G(add_kernel, "cuGraphAddKernelNode_v2", "cuGraphAddKernelNode");
    G(add_child, "cuGraphAddChildGraphNode", "cuGraphAddChildGraphNode");
    G(add_empty, "cuGraphAddEmptyNode", "cuGraphAddEmptyNode");
    G(get_nodes, "cuGraphGetNodes", "cuGraphGetNodes");
    G(child_graph, "cuGraphChildGraphNodeGetGraph", "cuGraphChildGraphNodeGetGraph");
    G(inst_v2, "cuGraphInstantiate_v2", "cuGraphInstantiate");
    G(inst_flags, "cuGraphInstantiateWithFlags", "cuGraphInstantiateWithFlags");
    G(exec_destroy, "cuGraphExecDestroy", "cuGraphExecDestroy");
    G(setchild, "cuGraphExecChildGraphNodeSetParams", "cuGraphExecChildGraphNodeSetParams");
    G(enable, "cuGraphNodeSetEnabled", "cuGraphNodeSetEnabled");
    G(stream_create, "cuStreamCreate", "cuStreamCreate");
    G(begin, pt ? "cuStreamBeginCapture_v2_ptsz" : "cuStreamBeginCapture_v2", "cuStreamBeginCapture");
    G(end, pt ? "cuStreamEndCapture_ptsz" : "cuStreamEndCapture", "cuStreamEndCapture");
    G(shape, "cuFuncSetBlockShape", "cuFuncSetBlockShape");
    G(launch0, "cuLaunch", "cuLaunch");
    G(launch_grid, "cuLaunchGrid", "cuLaunchGrid");
    G(launch_grid_async, "cuLaunchGridAsync", "cuLaunchGridAsync");
    G(multidev, "cuLaunchCooperativeKernelMultiDevice", "cuLaunchCooperativeKernelMultiDevice");
    if (g_v11) {
        G(update_v1, "cuGraphExecUpdate", "cuGraphExecUpdate");
        G(setk_v1, "cuGraphExecKernelNodeSetParams", "cuGraphExecKernelNodeSetParams");
    } else {
        G(update_v2, "cuGraphExecUpdate_v2", "cuGraphExecUpdate");
        G(setk_v2, "cuGraphExecKernelNodeSetParams_v2", "cuGraphExecKernelNodeSetParams");
        G(set_generic, "cuGraphExecNodeSetParams", "cuGraphExecNodeSetParams");
        G(inst_params, pt ? "cuGraphInstantiateWithParams_ptsz" : "cuGraphInstantiateWithParams",
          "cuGraphInstantiateWithParams");
    }
    /* only the linked and dlsym ways name these old or per-thread exports directly */
    if (strcmp(g_way, "direct") == 0 || strcmp(g_way, "dlsym") == 0) {
        G(inst_v1, "cuGraphInstantiate", "cuGraphInstantiate");
        G(update_v1, "cuGraphExecUpdate", "cuGraphExecUpdate");
        G(setk_v1, "cuGraphExecKernelNodeSetParams", "cuGraphExecKernelNodeSetParams");
        G(inst_params_ptsz, "cuGraphInstantiateWithParams_ptsz", "cuGraphInstantiateWithParams");
    }
#undef G
}

#define NEED(fn, what)                                                                            \
    do {                                                                                          \
        load_gapi();                                                                              \
        if (GA.fn == NULL)                                                                        \
            fail("%s is not reachable this way", what);                                           \
    } while (0)

#define SLOTS 64
static CUgraph g_graphs[SLOTS];
static CUgraphExec g_execs[SLOTS];
static CUgraphNode g_nodes[4096];
static int g_nnodes;
static CUstream g_streams[SLOTS];

static int slot(const char *s)
{
    int i = atoi(s);
    if (i < 0 || i >= SLOTS)
        fail("slot %s out of range", s);
    return i;
}

static int node_slot(const char *s)
{
    int i = atoi(s);
    if (i < 0 || i >= g_nnodes)
        fail("node %s does not exist", s);
    return i;
}

static CUgraphNode *new_node(void)
{
    if (g_nnodes == (int)(sizeof g_nodes / sizeof g_nodes[0]))
        fail("too many nodes");
    return &g_nodes[g_nnodes++];
}

static CUstream stream_arg(const char *s)
{
    if (strcmp(s, "null") == 0)
        return NULL;
    if (strcmp(s, "legacy") == 0)
        return CU_STREAM_LEGACY;
    if (strcmp(s, "pt") == 0)
        return CU_STREAM_PER_THREAD;
    return g_streams[slot(s)];
}

static CUDA_KERNEL_NODE_PARAMS_v2 kparams(unsigned grid, unsigned block)
{
    CUDA_KERNEL_NODE_PARAMS_v2 k;
    memset(&k, 0, sizeof k);
    k.func = (CUfunction)0x6000;
    k.gridDimX = grid, k.gridDimY = k.gridDimZ = 1;
    k.blockDimX = block, k.blockDimY = k.blockDimZ = 1;
    return k;
}

static CUresult add_kernel(CUgraph g, unsigned grid, unsigned block, CUgraphNode *out)
{
    CUDA_KERNEL_NODE_PARAMS_v2 k = kparams(grid, block);
    load_gapi();
    if (g_v11) {
        NEED(add_kernel_v1, "cuGraphAddKernelNode");
        return GA.add_kernel_v1(out, g, NULL, 0, (CUDA_KERNEL_NODE_PARAMS_v1 *)&k);
    }
    NEED(add_kernel, "cuGraphAddKernelNode_v2");
    return GA.add_kernel(out, g, NULL, 0, &k);
}

static CUresult instantiate(CUgraphExec *e, CUgraph g, const char *how)
{
    if (strcmp(how, "v1") == 0) {
        NEED(inst_v1, "cuGraphInstantiate");
        return GA.inst_v1(e, g, NULL, NULL, 0);
    }
    if (strcmp(how, "v2") == 0) {
        NEED(inst_v2, "cuGraphInstantiate_v2");
        return GA.inst_v2(e, g, NULL, NULL, 0);
    }
    if (strcmp(how, "flags") == 0) {
        NEED(inst_flags, "cuGraphInstantiateWithFlags");
        return GA.inst_flags(e, g, 0);
    }
    CUDA_GRAPH_INSTANTIATE_PARAMS p;
    memset(&p, 0, sizeof p);
    if (strcmp(how, "params") == 0) {
        NEED(inst_params, "cuGraphInstantiateWithParams");
        return GA.inst_params(e, g, &p);
    }
    if (strcmp(how, "params_ptsz") == 0) {
        NEED(inst_params_ptsz, "cuGraphInstantiateWithParams_ptsz");
        return GA.inst_params_ptsz(e, g, &p);
    }
    fail("unknown instantiate %s", how);
    return CUDA_ERROR_UNKNOWN;
}

/* the graph of one kernel node of this shape, instantiated once: the "graph" launch kind */
static CUgraphExec one_kernel_graph(unsigned grid, unsigned block)
{
    static struct {
        unsigned grid, block;
        CUgraphExec exec;
    } cache[8];
    for (int i = 0; i < 8; i++)
        if (cache[i].exec != NULL && cache[i].grid == grid && cache[i].block == block)
            return cache[i].exec;
    NEED(create, "cuGraphCreate");
    CUgraph g;
    CUgraphNode n;
    CUgraphExec e;
    if (GA.create(&g, 0) != CUDA_SUCCESS || add_kernel(g, grid, block, &n) != CUDA_SUCCESS ||
        instantiate(&e, g, strcmp(g_way, "procaddr_v1") == 0 ? "v2" : "flags") != CUDA_SUCCESS)
        return NULL; /* e.g. no context yet: the launch reports it */
    for (int i = 0; i < 8; i++)
        if (cache[i].exec == NULL) {
            cache[i].grid = grid, cache[i].block = block, cache[i].exec = e;
            break;
        }
    return e;
}

static int parse_proc_expect(const char *s, const char **name)
{
    *name = NULL;
    if (strncmp(s, "hook:", 5) == 0) {
        *name = s + 5;
        return 1;
    }
    if (strcmp(s, "nothook") == 0)
        return 0;
    if (strcmp(s, "notfound") == 0)
        return -1;
    fail("bad gpa expectation %s", s);
    return -2;
}

static bool in_shim(void *p)
{
    Dl_info info;
    return p != NULL && dladdr(p, &info) != 0 && info.dli_fname != NULL &&
           strstr(info.dli_fname, "libvgpu") != NULL;
}

static void check_proc(const char *how, const char *base, int version, void *p, CUresult r,
                       int want, const char *name)
{
    if (want < 0) {
        if (r == CUDA_SUCCESS && p != NULL)
            fail("%s(%s, %d) found %p, expected not found", how, base, version, p);
        return;
    }
    if (want == 0 && (r != CUDA_SUCCESS || p == NULL))
        return; /* an ABI the shim does not hook: the driver may not have it either */
    if (r != CUDA_SUCCESS || p == NULL)
        fail("%s(%s, %d) = %d", how, base, version, (int)r);
    if (want == 1) {
        void *hook = dlsym(RTLD_DEFAULT, name);
        if (p != hook || !in_shim(p))
            fail("%s(%s, %d) = %p, expected the hook %s at %p", how, base, version, p, name, hook);
    } else if (in_shim(p)) {
        Dl_info info;
        dladdr(p, &info);
        fail("%s(%s, %d) handed out the shim's %s for another ABI version", how, base, version,
             info.dli_sname ? info.dli_sname : "?");
    }
}

static void gpa(const char *base, int version, const char *flag, const char *expect)
{
    const char *name;
    int want = parse_proc_expect(expect, &name);
    cuuint64_t flags = strcmp(flag, "pt") == 0 ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                               : CU_GET_PROC_ADDRESS_DEFAULT;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    __typeof__(&cuGetProcAddress_v2) v2 =
        (__typeof__(&cuGetProcAddress_v2))dlsym(lib, "cuGetProcAddress_v2");
    __typeof__(&cuGetProcAddress) v1 = (__typeof__(&cuGetProcAddress))dlsym(lib, "cuGetProcAddress");
    if (v2 == NULL || v1 == NULL)
        fail("no cuGetProcAddress");
    void *p = NULL;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = v2(base, &p, version, flags, &status);
    check_proc("cuGetProcAddress_v2", base, version, p, r, want, name);
    if (want >= 0 && r == CUDA_SUCCESS && status != CU_GET_PROC_ADDRESS_SUCCESS)
        fail("cuGetProcAddress_v2(%s, %d) status %d", base, version, (int)status);
    p = NULL;
    r = v1(base, &p, version, flags);
    check_proc("cuGetProcAddress", base, version, p, r, want, name);
}

/* ------------------------------------------------------------------ memory the driver holds */

CUresult fakeCudaGraphMemReserve(int dev, unsigned long long bytes);
unsigned long long fakeCudaDeviceUsed(int dev);
unsigned long long fakeCudaManagedUsed(void);
int fakeCudaPreferredLocation(unsigned long long ptr);

static void *mem_api(void *direct, const char *versioned, const char *base)
{
    if (strcmp(g_way, "direct") == 0)
        return direct;
    static void *lib;
    if (lib == NULL && (lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) == NULL)
        fail("dlopen libcuda.so.1: %s", dlerror());
    return resolve(lib, versioned, base);
}

static CUcontext g_extra_ctx[64], g_before_extra[64]; /* and what was current before each */
static int g_nextra;
static uintptr_t g_mods[256];
static bool g_mod_is_lib[256];
static int g_nmods;
static CUdeviceptr g_maps[256];
static int g_nmaps;
static CUdeviceptr g_next_va = 0x600000000000ull;

static void push_live(unsigned long long key, enum kind kind)
{
    if (g_nlive == (int)(sizeof g_live / sizeof g_live[0]))
        fail("too many live allocations");
    g_live[g_nlive].key = key;
    g_live[g_nlive].kind = kind;
    g_nlive++;
}

static CUresult do_module(const char *how, unsigned long long size)
{
    unsigned char image[16];
    memcpy(image, "FAKEMOD1", 8);
    memcpy(image + 8, &size, 8);
    char path[64] = "";
    if (strcmp(how, "file") == 0) {
        snprintf(path, sizeof path, "/tmp/vgpu-fake-module-%d", (int)getpid());
        FILE *f = fopen(path, "wb");
        if (f == NULL || fwrite(image, 1, sizeof image, f) != sizeof image)
            fail("cannot write %s", path);
        fclose(f);
    }
    uintptr_t h = 0;
    CUresult r;
    if (strcmp(how, "data") == 0) {
        CUmodule m = NULL;
        r = M(cuModuleLoadData, "cuModuleLoadData", "cuModuleLoadData")(&m, image);
        h = (uintptr_t)m;
    } else if (strcmp(how, "file") == 0) {
        CUmodule m = NULL;
        r = M(cuModuleLoad, "cuModuleLoad", "cuModuleLoad")(&m, path);
        unlink(path);
        h = (uintptr_t)m;
    } else {
        CUlibrary l = NULL;
        r = M(cuLibraryLoadData, "cuLibraryLoadData", "cuLibraryLoadData")(&l, image, NULL, NULL,
                                                                          0, NULL, NULL, 0);
        h = (uintptr_t)l;
    }
    if (r == CUDA_SUCCESS) {
        if (g_nmods == 256)
            fail("too many modules");
        g_mod_is_lib[g_nmods] = strcmp(how, "lib") == 0;
        g_mods[g_nmods++] = h;
    }
    return r;
}

static CUresult do_vmm(unsigned long long size, const char *where)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    if (strcmp(where, "host") == 0) {
        prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    } else if (strcmp(where, "hostnuma") == 0) {
        prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    } else {
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = atoi(where);
    }
    CUmemGenericAllocationHandle h = 0;
    CUresult r = A.create(&h, size, &prop, 0);
    if (r == CUDA_SUCCESS)
        push_live(h, K_HANDLE);
    return r;
}

static CUresult do_array(const char *how, size_t w, size_t h, size_t d)
{
    CUresult r;
    if (strcmp(how, "2d") == 0) {
        CUDA_ARRAY_DESCRIPTOR desc = {w, h, CU_AD_FORMAT_FLOAT, 4};
        CUarray a = NULL;
        r = M(cuArrayCreate_v2, "cuArrayCreate_v2", "cuArrayCreate")(&a, &desc);
        if (r == CUDA_SUCCESS)
            push_live((uintptr_t)a, K_ARRAY);
    } else if (strcmp(how, "3d") == 0) {
        CUDA_ARRAY3D_DESCRIPTOR desc = {w, h, d, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0};
        CUarray a = NULL;
        r = M(cuArray3DCreate_v2, "cuArray3DCreate_v2", "cuArray3DCreate")(&a, &desc);
        if (r == CUDA_SUCCESS)
            push_live((uintptr_t)a, K_ARRAY);
    } else {
        CUDA_ARRAY3D_DESCRIPTOR desc = {w, h, d, CU_AD_FORMAT_HALF, 2, 0};
        CUmipmappedArray a = NULL;
        r = M(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", "cuMipmappedArrayCreate")(&a, &desc,
                                                                                        4);
        if (r == CUDA_SUCCESS)
            push_live((uintptr_t)a, K_MIPMAP);
    }
    return r;
}

static void pools_do(const char *what, unsigned long long value)
{
    CUdevice dev = 0;
    A.ctx_device(&dev);
    CUmemoryPool pools[2] = {NULL, g_pool};
    if (M(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", "cuDeviceGetDefaultMemPool")(
            &pools[0], dev) != CUDA_SUCCESS)
        fail("cuDeviceGetDefaultMemPool");
    for (int k = 0; k < 2; k++) {
        if (pools[k] == NULL)
            continue;
        cuuint64_t v = value;
        CUresult r = strcmp(what, "trim") == 0
                         ? M(cuMemPoolTrimTo, "cuMemPoolTrimTo", "cuMemPoolTrimTo")(pools[k], value)
                         : M(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", "cuMemPoolSetAttribute")(
                               pools[k], CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v);
        if (r != CUDA_SUCCESS)
            fail("%s of pool %d: %d", what, k, (int)r);
    }
}

static unsigned long long shim_count(void)
{
    const char *dir = getenv("VGPU_REGION_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/state", dir != NULL ? dir : "/run/vgpu");
    FILE *f = fopen(path, "rb");
    unsigned long long used = 0;
    /* devices[0].memory_used: after the 64-byte header, the third word of the device entry */
    if (f == NULL || fseek(f, 64 + 16, SEEK_SET) != 0 || fread(&used, sizeof used, 1, f) != 1)
        fail("cannot read the shim's count from %s", path);
    fclose(f);
    return used;
}

/* ext[0].memory_spilled of the region's state (ABI 1.1) */
static unsigned long long shim_spilled(void)
{
    const char *dir = getenv("VGPU_REGION_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/state", dir != NULL ? dir : "/run/vgpu");
    FILE *f = fopen(path, "rb");
    unsigned long long spilled = 0;
    long at = (long)(offsetof(struct vgpu_state, ext) +
                     offsetof(struct vgpu_state_ext_device, memory_spilled));
    if (f == NULL || fseek(f, at, SEEK_SET) != 0 || fread(&spilled, sizeof spilled, 1, f) != 1)
        fail("cannot read the spilled count from %s", path);
    fclose(f);
    return spilled;
}

/* A mixed workload: plain, async (default pool and a created one), VMM, contexts, modules,
 * limits, arrays; every operation may be refused by the limit (then it is simply skipped). */
static void mixed(long n, unsigned seed)
{
    static const char *const apis[] = {"plain", "async", "pool", "pitch", "managed"};
    for (long k = 0; k < n; k++) {
        seed = seed * 1103515245u + 12345u;
        unsigned op = (seed >> 16) % 12;
        unsigned long long size = (((seed >> 8) % 64) + 1) << 18; /* 256 KiB .. 16 MiB */
        CUresult r;
        switch (op) {
        case 0: case 1: case 2: case 3:
            r = do_alloc(apis[(seed >> 4) % 5], size);
            break;
        case 4: case 5:
            r = g_nlive > 0 ? do_free() : CUDA_SUCCESS;
            break;
        case 6:
            r = do_vmm(size, "0");
            if (r == CUDA_SUCCESS && (seed & 1)) { /* mapped, then released while mapped */
                CUdeviceptr va = g_next_va;
                g_next_va += size;
                if (M(cuMemMap, "cuMemMap", "cuMemMap")(va, size, 0, g_live[g_nlive - 1].key, 0) ==
                        CUDA_SUCCESS &&
                    g_nmaps < 256)
                    g_maps[g_nmaps++] = va;
                r = do_free();
            }
            break;
        case 7:
            r = g_nmaps > 0 ? M(cuMemUnmap, "cuMemUnmap", "cuMemUnmap")(g_maps[--g_nmaps], 1ull << 40)
                            : CUDA_SUCCESS;
            break;
        case 8:
            r = do_module((seed & 1) ? "data" : "lib", size / 4);
            break;
        case 9:
            if (g_nmods > 0) {
                g_nmods--;
                r = g_mod_is_lib[g_nmods]
                        ? M(cuLibraryUnload, "cuLibraryUnload", "cuLibraryUnload")((CUlibrary)g_mods[g_nmods])
                        : M(cuModuleUnload, "cuModuleUnload", "cuModuleUnload")((CUmodule)g_mods[g_nmods]);
            } else {
                r = CUDA_SUCCESS;
            }
            break;
        case 10:
            r = M(cuCtxSynchronize, "cuCtxSynchronize", "cuCtxSynchronize")();
            break;
        default:
            r = do_array((seed & 2) ? "2d" : "mip", 256 + (seed % 512), 64 + (seed % 128), 0);
            break;
        }
        if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY)
            fail("mixed op %u: %d", op, (int)r);
    }
}

/* 1 when `cmd` was one of the commands above (its arguments consumed), 0 otherwise. */
static int memory_command(const char *cmd, int argc, char **argv, int *ip)
{
    int i = *ip;
#define MARG() (i < argc ? argv[i++] : (fail("%s: missing argument", cmd), ""))
    if (strcmp(cmd, "primary") == 0) {
        int dev = atoi(MARG());
        int want = parse_expect(MARG());
        CUcontext c = NULL;
        if (A.init(0) != CUDA_SUCCESS)
            fail("cuInit");
        CUresult r = M(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain",
                       "cuDevicePrimaryCtxRetain")(&c, dev);
        if ((int)r != want)
            fail("cuDevicePrimaryCtxRetain returned %d, expected %d", (int)r, want);
        if (r == CUDA_SUCCESS && A.ctx_set(c) != CUDA_SUCCESS)
            fail("cuCtxSetCurrent(primary)");
    } else if (strcmp(cmd, "unprimary") == 0) {
        if (M(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease_v2",
              "cuDevicePrimaryCtxRelease")(atoi(MARG())) != CUDA_SUCCESS)
            fail("cuDevicePrimaryCtxRelease");
    } else if (strcmp(cmd, "ctxnew") == 0) {
        int dev = atoi(MARG());
        int want = parse_expect(MARG());
        CUcontext c = NULL, before = NULL;
        if (A.init(0) != CUDA_SUCCESS)
            fail("cuInit");
        M(cuCtxGetCurrent, "cuCtxGetCurrent", "cuCtxGetCurrent")(&before);
        CUresult r = A.ctx_create(&c, 0, dev);
        if ((int)r != want)
            fail("cuCtxCreate returned %d, expected %d", (int)r, want);
        if (r == CUDA_SUCCESS && g_nextra < 64) {
            g_before_extra[g_nextra] = before;
            g_extra_ctx[g_nextra++] = c;
        }
    } else if (strcmp(cmd, "ctxdrop") == 0) {
        if (g_nextra == 0)
            fail("ctxdrop without ctxnew");
        if (M(cuCtxDestroy_v2, "cuCtxDestroy_v2", "cuCtxDestroy")(g_extra_ctx[--g_nextra]) !=
            CUDA_SUCCESS)
            fail("cuCtxDestroy");
        if (g_before_extra[g_nextra] != NULL && A.ctx_set(g_before_extra[g_nextra]) != CUDA_SUCCESS)
            fail("cuCtxSetCurrent after cuCtxDestroy");
    } else if (strcmp(cmd, "limit") == 0) {
        const char *which = MARG();
        unsigned long long size = parse_size(MARG());
        int want = parse_expect(MARG());
        CUlimit l = strcmp(which, "heap") == 0    ? CU_LIMIT_MALLOC_HEAP_SIZE
                    : strcmp(which, "stack") == 0 ? CU_LIMIT_STACK_SIZE
                                                  : CU_LIMIT_PRINTF_FIFO_SIZE;
        CUresult r = M(cuCtxSetLimit, "cuCtxSetLimit", "cuCtxSetLimit")(l, size);
        if ((int)r != want)
            fail("cuCtxSetLimit returned %d, expected %d", (int)r, want);
    } else if (strcmp(cmd, "module") == 0) {
        const char *how = MARG();
        unsigned long long size = parse_size(MARG());
        int want = parse_expect(MARG());
        CUresult r = do_module(how, size);
        if ((int)r != want)
            fail("module %s returned %d, expected %d", how, (int)r, want);
    } else if (strcmp(cmd, "unload") == 0) {
        if (g_nmods == 0)
            fail("unload without module");
        g_nmods--;
        CUresult r = g_mod_is_lib[g_nmods]
                         ? M(cuLibraryUnload, "cuLibraryUnload", "cuLibraryUnload")((CUlibrary)g_mods[g_nmods])
                         : M(cuModuleUnload, "cuModuleUnload", "cuModuleUnload")((CUmodule)g_mods[g_nmods]);
        if (r != CUDA_SUCCESS)
            fail("unload: %d", (int)r);
    } else if (strcmp(cmd, "poolcreate") == 0) {
        const char *where = MARG();
        CUdevice dev = 0;
        A.ctx_device(&dev);
        CUmemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type = strcmp(where, "host") == 0 ? CU_MEM_LOCATION_TYPE_HOST
                                                         : CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = strcmp(where, "host") == 0 ? 0 : dev;
        if (M(cuMemPoolCreate, "cuMemPoolCreate", "cuMemPoolCreate")(&g_pool, &props) != CUDA_SUCCESS)
            fail("cuMemPoolCreate");
    } else if (strcmp(cmd, "threshold") == 0 || strcmp(cmd, "trim") == 0) {
        pools_do(cmd, parse_size(MARG()));
    } else if (strcmp(cmd, "sync") == 0) {
        if (M(cuCtxSynchronize, "cuCtxSynchronize", "cuCtxSynchronize")() != CUDA_SUCCESS)
            fail("cuCtxSynchronize");
    } else if (strcmp(cmd, "vmm") == 0) {
        unsigned long long size = parse_size(MARG());
        const char *where = MARG();
        int want = parse_expect(MARG());
        CUresult r = do_vmm(size, where);
        if ((int)r != want)
            fail("vmm %s returned %d, expected %d", where, (int)r, want);
    } else if (strcmp(cmd, "map") == 0) {
        if (g_nlive == 0 || g_live[g_nlive - 1].kind != K_HANDLE || g_nmaps == 256)
            fail("map without a handle");
        CUdeviceptr va = g_next_va;
        g_next_va += 1ull << 30;
        if (M(cuMemMap, "cuMemMap", "cuMemMap")(va, 1 << 20, 0, g_live[g_nlive - 1].key, 0) !=
            CUDA_SUCCESS)
            fail("cuMemMap");
        g_maps[g_nmaps++] = va;
    } else if (strcmp(cmd, "unmap") == 0) {
        if (g_nmaps == 0)
            fail("unmap without a mapping");
        if (M(cuMemUnmap, "cuMemUnmap", "cuMemUnmap")(g_maps[--g_nmaps], 1 << 20) != CUDA_SUCCESS)
            fail("cuMemUnmap");
    } else if (strcmp(cmd, "retain") == 0) {
        if (g_nmaps == 0)
            fail("retain without a mapping");
        CUmemGenericAllocationHandle h = 0;
        if (M(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle",
              "cuMemRetainAllocationHandle")(&h, (void *)(uintptr_t)g_maps[g_nmaps - 1]) !=
            CUDA_SUCCESS)
            fail("cuMemRetainAllocationHandle");
        push_live(h, K_HANDLE);
    } else if (strcmp(cmd, "array") == 0) {
        const char *how = MARG();
        size_t w = (size_t)parse_size(MARG()), h = (size_t)parse_size(MARG()),
               d = (size_t)parse_size(MARG());
        int want = parse_expect(MARG());
        CUresult r = do_array(how, w, h, d);
        if ((int)r != want)
            fail("array %s returned %d, expected %d", how, (int)r, want);
    } else if (strcmp(cmd, "graphmem") == 0) {
        int dev = atoi(MARG());
        if (fakeCudaGraphMemReserve(dev, parse_size(MARG())) != CUDA_SUCCESS)
            fail("fakeCudaGraphMemReserve");
    } else if (strcmp(cmd, "graphtrim") == 0) {
        if (M(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", "cuDeviceGraphMemTrim")(atoi(MARG())) !=
            CUDA_SUCCESS)
            fail("cuDeviceGraphMemTrim");
    } else if (strcmp(cmd, "compare") == 0) {
        int dev = atoi(MARG());
        unsigned long long tolerance = parse_size(MARG());
        /* what the shim reads when it reports: cuMemGetInfo settles the pools first */
        size_t f = 0, t = 0;
        A.info(&f, &t);
        /* managed memory is host memory to the fake: the driver holds both */
        unsigned long long shim = shim_count(), driver = fakeCudaDeviceUsed(dev) + fakeCudaManagedUsed();
        printf("compare shim=%llu driver=%llu\n", shim, driver);
        unsigned long long diff = shim > driver ? shim - driver : driver - shim;
        if (diff > tolerance)
            fail("the shim counts %llu bytes, the driver holds %llu (tolerance %llu)", shim,
                 driver, tolerance);
    } else if (strcmp(cmd, "ismanaged") == 0) {
        int want = atoi(MARG()), got = -1;
        if (g_nlive == 0)
            fail("ismanaged with nothing allocated");
        CUresult r = M(cuPointerGetAttribute, "cuPointerGetAttribute", "cuPointerGetAttribute")(
            &got, CU_POINTER_ATTRIBUTE_IS_MANAGED, g_live[g_nlive - 1].key);
        if (r != CUDA_SUCCESS || got != want)
            fail("IS_MANAGED of the newest allocation: %d (rc %d), expected %d", got, (int)r, want);
        unsigned int type = 0;
        r = M(cuPointerGetAttribute, "cuPointerGetAttribute", "cuPointerGetAttribute")(
            &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, g_live[g_nlive - 1].key);
        if (r != CUDA_SUCCESS || type != CU_MEMORYTYPE_DEVICE)
            fail("memory type of the newest allocation: %u (rc %d), expected device", type, (int)r);
    } else if (strcmp(cmd, "preferred") == 0) {
        int want = atoi(MARG());
        if (g_nlive == 0)
            fail("preferred with nothing allocated");
        int got = fakeCudaPreferredLocation(g_live[g_nlive - 1].key);
        if (got != want)
            fail("preferred location %d, expected %d", got, want);
    } else if (strcmp(cmd, "ipc") == 0) {
        int want = parse_expect(MARG());
        if (g_nlive == 0)
            fail("ipc with nothing allocated");
        CUipcMemHandle h;
        CUresult r = M(cuIpcGetMemHandle, "cuIpcGetMemHandle", "cuIpcGetMemHandle")(
            &h, g_live[g_nlive - 1].key);
        if ((int)r != want)
            fail("cuIpcGetMemHandle returned %d, expected %d", (int)r, want);
    } else if (strcmp(cmd, "allocloop") == 0) {
        int n = atoi(MARG());
        unsigned long long size = parse_size(MARG());
        if (n < 1 || n > 1000000)
            fail("allocloop: N must be 1..1000000");
        uint64_t *ns = calloc((size_t)n, sizeof *ns);
        unsigned long long managed_before = fakeCudaCounter("managed");
        for (int k = 0; k < n; k++) {
            CUdeviceptr p = 0;
            uint64_t t0 = now_ns();
            if (A.alloc(&p, size) != CUDA_SUCCESS || A.free_(p) != CUDA_SUCCESS)
                fail("allocloop: pair %d failed", k);
            ns[k] = now_ns() - t0;
        }
        qsort(ns, (size_t)n, sizeof *ns, cmp_u64);
        printf("allocloop median_ns=%llu p99_ns=%llu managed=%llu\n",
               (unsigned long long)ns[n / 2], (unsigned long long)ns[(size_t)n * 99 / 100],
               fakeCudaCounter("managed") - managed_before);
        free(ns);
    } else if (strcmp(cmd, "spilled") == 0) {
        unsigned long long want = parse_size(MARG()), got = shim_spilled();
        if (got != want)
            fail("the region counts %llu spilled bytes, expected %llu", got, want);
    } else if (strcmp(cmd, "hostheld") == 0) {
        unsigned long long want = parse_size(MARG()), got = fakeCudaManagedUsed();
        if (got != want)
            fail("the fake driver holds %llu bytes of managed memory, expected %llu", got, want);
    } else if (strcmp(cmd, "timedalloc") == 0) {
        const char *api = MARG();
        long n = atol(MARG());
        unsigned long long size = parse_size(MARG());
        uint64_t t0 = now_ns();
        for (long k = 0; k < n; k++)
            if (do_alloc(api, size) != CUDA_SUCCESS || do_free() != CUDA_SUCCESS)
                fail("timedalloc %s: allocation or free failed", api);
        printf("timedalloc ns=%llu\n", (unsigned long long)(now_ns() - t0));
    } else if (strcmp(cmd, "forkexit") == 0) {
        /* a worker forked after initialisation that leaves without touching CUDA (a data loader):
         * its exit must give back nothing of what the parent holds */
        fflush(stdout);
        pid_t pid = fork();
        if (pid < 0)
            fail("fork");
        if (pid == 0)
            exit(0);
        int status = 0;
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
            fail("forked worker ended with status %#x", status);
    } else if (strcmp(cmd, "mixed") == 0) {
        long n = atol(MARG());
        mixed(n, (unsigned)strtoul(MARG(), NULL, 10));
    } else {
        return 0;
    }
#undef MARG
    *ip = i;
    return 1;
}

/* ------------------------------------------------------------------ main */

static volatile sig_atomic_t g_alarms;

static void on_alarm(int sig)
{
    (void)sig;
    g_alarms++;
}

static void check(CUresult got, int want, const char *what)
{
    if ((int)got != want)
        fail("%s returned %d, expected %d", what, (int)got, want);
}

int main(int argc, char **argv)
{
    if (argc < 2)
        fail("usage: cuda_client <way> <command>...");
    g_way = argv[1];
    load_api();
    CUcontext ctx = NULL;
    for (int i = 2; i < argc;) {
        const char *cmd = argv[i++];
#define ARG() (i < argc ? argv[i++] : (fail("%s: missing argument", cmd), ""))
        if (strcmp(cmd, "ctx") == 0) {
            int dev = atoi(ARG());
            check(A.init(0), 0, "cuInit");
            check(A.ctx_create(&ctx, 0, dev), 0, "cuCtxCreate");
        } else if (strcmp(cmd, "alloc") == 0) {
            const char *api = ARG();
            unsigned long long size = parse_size(ARG());
            int want = parse_expect(ARG());
            char what[64];
            snprintf(what, sizeof what, "alloc %s %llu", api, size);
            check(do_alloc(api, size), want, what);
        } else if (strcmp(cmd, "free") == 0) {
            check(do_free(), parse_expect(ARG()), "free");
        } else if (strcmp(cmd, "info") == 0) {
            const char *total = ARG(), *free_s = ARG();
            size_t f = 0, t = 0;
            check(A.info(&f, &t), 0, "cuMemGetInfo");
            if (strcmp(total, "-") != 0 && t != parse_size(total))
                fail("cuMemGetInfo total %zu, expected %llu", t, parse_size(total));
            if (strcmp(free_s, "-") != 0 && f != parse_size(free_s))
                fail("cuMemGetInfo free %zu, expected %llu", f, parse_size(free_s));
            printf("info free=%zu total=%zu\n", f, t);
        } else if (strcmp(cmd, "totalmem") == 0) {
            int dev = atoi(ARG());
            unsigned long long want = parse_size(ARG());
            size_t got = 0;
            check(A.total_mem(&got, dev), 0, "cuDeviceTotalMem");
            if (got != want)
                fail("cuDeviceTotalMem(%d) = %zu, expected %llu", dev, got, want);
        } else if (strcmp(cmd, "spillthreads") == 0) {
            int threads = atoi(ARG()), n = atoi(ARG());
            spillthreads(ctx, threads, n, parse_size(ARG()));
        } else if (strcmp(cmd, "mtpace") == 0) {
            int threads = atoi(ARG());
            double seconds = atof(ARG());
            unsigned grid = (unsigned)atoi(ARG()), block = (unsigned)atoi(ARG());
            mtpace(ctx, threads, seconds, grid, block);
        } else if (strcmp(cmd, "launch") == 0) {
            const char *kind = ARG();
            long n = atol(ARG());
            unsigned grid = (unsigned)atoi(ARG()), block = (unsigned)atoi(ARG());
            int want = parse_expect(ARG());
            for (long k = 0; k < n; k++)
                check(do_launch(kind, grid, block), want, kind);
        } else if (strcmp(cmd, "pace") == 0) {
            const char *kind = ARG();
            double seconds = atof(ARG());
            unsigned grid = (unsigned)atoi(ARG()), block = (unsigned)atoi(ARG());
            unsigned long long cost = strtoull(ARG(), NULL, 10);
            pace(kind, seconds, grid, block, cost, strtoull(ARG(), NULL, 10));
        } else if (strcmp(cmd, "timed") == 0) {
            long n = atol(ARG());
            unsigned grid = (unsigned)atoi(ARG()), block = (unsigned)atoi(ARG());
            uint64_t t0 = now_ns();
            for (long k = 0; k < n; k++)
                check(do_launch("kernel", grid, block), 0, "timed launch");
            printf("timed ns=%llu\n", (unsigned long long)(now_ns() - t0));
        } else if (strcmp(cmd, "hold") == 0) {
            printf("ready\n");
            fflush(stdout);
            char buf[16];
            while (read(STDIN_FILENO, buf, sizeof buf) > 0) {
            }
        } else if (strcmp(cmd, "nvml") == 0) {
            unsigned index = (unsigned)atoi(ARG());
            unsigned long long total = parse_size(ARG()), used = parse_size(ARG());
            nvmlDevice_t dev = NULL;
            __typeof__(&nvmlDeviceGetMemoryInfo) info = nvmlDeviceGetMemoryInfo;
            __typeof__(&nvmlDeviceGetMemoryInfo_v2) info2 = nvmlDeviceGetMemoryInfo_v2;
            if (strcmp(g_way, "direct") != 0) {
                void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
                if (lib == NULL)
                    fail("dlopen libnvidia-ml.so.1");
                info = (__typeof__(info))dlsym(lib, "nvmlDeviceGetMemoryInfo");
                info2 = (__typeof__(info2))dlsym(lib, "nvmlDeviceGetMemoryInfo_v2");
            }
            if (nvmlInit_v2() != NVML_SUCCESS || nvmlDeviceGetHandleByIndex_v2(index, &dev) != NVML_SUCCESS)
                fail("nvml init");
            nvmlMemory_t m;
            if (info(dev, &m) != NVML_SUCCESS)
                fail("nvmlDeviceGetMemoryInfo");
            if (m.total != total || m.used != used || m.free != total - used)
                fail("nvml v1 total/used/free %llu/%llu/%llu, expected %llu/%llu", m.total, m.used,
                     m.free, total, used);
            nvmlMemory_v2_t m2 = {.version = nvmlMemory_v2};
            if (info2(dev, &m2) != NVML_SUCCESS)
                fail("nvmlDeviceGetMemoryInfo_v2");
            if (m2.total != total || m2.used + m2.reserved != used || m2.free != total - used)
                fail("nvml v2 total/used/free %llu/%llu/%llu, expected %llu/%llu", m2.total,
                     m2.used, m2.free, total, used);
        } else if (strcmp(cmd, "counter") == 0) {
            const char *name = ARG();
            unsigned long long want = strtoull(ARG(), NULL, 10);
            if (fakeCudaCounter(name) != want)
                fail("driver counter %s = %llu, expected %llu", name, fakeCudaCounter(name), want);
        } else if (strcmp(cmd, "forkstress") == 0) {
            forkstress(atoi(ARG()), ctx, 1);
        } else if (strcmp(cmd, "forkstress-launches") == 0) {
            forkstress(atoi(ARG()), ctx, 0);
        } else if (strcmp(cmd, "exec") == 0) {
            fflush(stdout);
            argv[i - 1] = argv[0];
            execv("/proc/self/exe", &argv[i - 1]);
            fail("exec failed");
        } else if (strcmp(cmd, "rtldnext") == 0) {
            const char *names[] = {"malloc", "fakeCudaCounter", "nvmlInit_v2"};
            for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
                void *next = dlsym(RTLD_NEXT, names[k]);
                void *dflt = dlsym(RTLD_DEFAULT, names[k]);
                if (next == NULL || next != dflt)
                    fail("dlsym(RTLD_NEXT, %s) = %p, RTLD_DEFAULT gives %p", names[k], next, dflt);
            }
        } else if (strcmp(cmd, "gnew") == 0) {
            int g = slot(ARG());
            NEED(create, "cuGraphCreate");
            check(GA.create(&g_graphs[g], 0), 0, "cuGraphCreate");
        } else if (strcmp(cmd, "gkernel") == 0) {
            int g = slot(ARG());
            unsigned grid = (unsigned)atoi(ARG()), block = (unsigned)atoi(ARG());
            check(add_kernel(g_graphs[g], grid, block, new_node()), 0, "add kernel node");
        } else if (strcmp(cmd, "gchild") == 0) {
            int g = slot(ARG()), c = slot(ARG());
            NEED(add_child, "cuGraphAddChildGraphNode");
            check(GA.add_child(new_node(), g_graphs[g], NULL, 0, g_graphs[c]), 0, "add child node");
        } else if (strcmp(cmd, "gempty") == 0) {
            int g = slot(ARG());
            NEED(add_empty, "cuGraphAddEmptyNode");
            check(GA.add_empty(new_node(), g_graphs[g], NULL, 0), 0, "add empty node");
        } else if (strcmp(cmd, "gcond") == 0) {
            int g = slot(ARG());
            CUresult (*cond)(CUgraphNode *, CUgraph) =
                (CUresult(*)(CUgraphNode *, CUgraph))dlsym(RTLD_DEFAULT, "fakeCudaAddConditionalNode");
            if (cond == NULL)
                fail("the driver has no conditional nodes");
            check(cond(new_node(), g_graphs[g]), 0, "add conditional node");
        } else if (strcmp(cmd, "ginner") == 0) {
            CUgraphNode k = g_nodes[node_slot(ARG())];
            CUgraph child;
            size_t n = 0;
            NEED(child_graph, "cuGraphChildGraphNodeGetGraph");
            NEED(get_nodes, "cuGraphGetNodes");
            check(GA.child_graph(k, &child), 0, "cuGraphChildGraphNodeGetGraph");
            check(GA.get_nodes(child, NULL, &n), 0, "cuGraphGetNodes");
            if (n > 256)
                fail("child graph too big");
            CUgraphNode inner[256];
            check(GA.get_nodes(child, inner, &n), 0, "cuGraphGetNodes");
            for (size_t j = 0; j < n; j++)
                *new_node() = inner[j];
        } else if (strcmp(cmd, "ginst") == 0) {
            int e = slot(ARG()), g = slot(ARG());
            const char *how = ARG();
            check(instantiate(&g_execs[e], g_graphs[g], how), parse_expect(ARG()), how);
        } else if (strcmp(cmd, "glaunch") == 0) {
            int e = slot(ARG());
            long n = atol(ARG());
            CUstream st = stream_arg(ARG());
            int want = parse_expect(ARG());
            for (long k = 0; k < n; k++)
                check(A.graph(g_execs[e], st), want, "cuGraphLaunch");
        } else if (strcmp(cmd, "gdestroy") == 0) {
            int e = slot(ARG());
            NEED(exec_destroy, "cuGraphExecDestroy");
            check(GA.exec_destroy(g_execs[e]), 0, "cuGraphExecDestroy");
            g_execs[e] = NULL;
        } else if (strcmp(cmd, "gupdate") == 0) {
            int e = slot(ARG()), g = slot(ARG());
            int want = parse_expect(ARG());
            load_gapi();
            if (g_v11) {
                NEED(update_v1, "cuGraphExecUpdate");
                CUgraphNode err;
                CUgraphExecUpdateResult res;
                check(GA.update_v1(g_execs[e], g_graphs[g], &err, &res), want, "cuGraphExecUpdate");
            } else {
                NEED(update_v2, "cuGraphExecUpdate_v2");
                CUgraphExecUpdateResultInfo info;
                check(GA.update_v2(g_execs[e], g_graphs[g], &info), want, "cuGraphExecUpdate_v2");
            }
        } else if (strcmp(cmd, "gsetk") == 0) {
            int e = slot(ARG());
            CUgraphNode k = g_nodes[node_slot(ARG())];
            unsigned grid = (unsigned)atoi(ARG()), block = (unsigned)atoi(ARG());
            const char *how = ARG();
            int want = parse_expect(ARG());
            CUDA_KERNEL_NODE_PARAMS_v2 kp = kparams(grid, block);
            if (strcmp(how, "v1") == 0) {
                NEED(setk_v1, "cuGraphExecKernelNodeSetParams");
                check(GA.setk_v1(g_execs[e], k, (CUDA_KERNEL_NODE_PARAMS_v1 *)&kp), want, how);
            } else if (strcmp(how, "v2") == 0) {
                NEED(setk_v2, "cuGraphExecKernelNodeSetParams_v2");
                check(GA.setk_v2(g_execs[e], k, &kp), want, how);
            } else {
                NEED(set_generic, "cuGraphExecNodeSetParams");
                CUgraphNodeParams np;
                memset(&np, 0, sizeof np);
                np.type = CU_GRAPH_NODE_TYPE_KERNEL;
                np.kernel = kp;
                check(GA.set_generic(g_execs[e], k, &np), want, how);
            }
        } else if (strcmp(cmd, "gsetchild") == 0) {
            int e = slot(ARG());
            CUgraphNode k = g_nodes[node_slot(ARG())];
            int g = slot(ARG());
            const char *how = ARG();
            int want = parse_expect(ARG());
            if (strcmp(how, "direct") == 0) {
                NEED(setchild, "cuGraphExecChildGraphNodeSetParams");
                check(GA.setchild(g_execs[e], k, g_graphs[g]), want, how);
            } else {
                NEED(set_generic, "cuGraphExecNodeSetParams");
                CUgraphNodeParams np;
                memset(&np, 0, sizeof np);
                np.type = CU_GRAPH_NODE_TYPE_GRAPH;
                np.graph.graph = g_graphs[g];
                check(GA.set_generic(g_execs[e], k, &np), want, how);
            }
        } else if (strcmp(cmd, "genable") == 0) {
            int e = slot(ARG());
            CUgraphNode k = g_nodes[node_slot(ARG())];
            unsigned on = (unsigned)atoi(ARG());
            NEED(enable, "cuGraphNodeSetEnabled");
            check(GA.enable(g_execs[e], k, on), parse_expect(ARG()), "cuGraphNodeSetEnabled");
        } else if (strcmp(cmd, "queryfail") == 0) {
            void (*set)(int) = (void (*)(int))dlsym(RTLD_DEFAULT, "fakeCudaGraphQueriesFail");
            if (set == NULL)
                fail("no fakeCudaGraphQueriesFail");
            set(atoi(ARG()));
        } else if (strcmp(cmd, "stream") == 0) {
            int k = slot(ARG());
            unsigned flags = 0;
            if (i < argc && strcmp(argv[i], "nonblocking") == 0) {
                flags = CU_STREAM_NON_BLOCKING;
                i++;
            }
            NEED(stream_create, "cuStreamCreate");
            check(GA.stream_create(&g_streams[k], flags), 0, "cuStreamCreate");
        } else if (strcmp(cmd, "capture") == 0) {
            CUstream st = stream_arg(ARG());
            const char *m = ARG();
            CUstreamCaptureMode mode = strcmp(m, "global") == 0   ? CU_STREAM_CAPTURE_MODE_GLOBAL
                                       : strcmp(m, "thread") == 0 ? CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
                                                                  : CU_STREAM_CAPTURE_MODE_RELAXED;
            NEED(begin, "cuStreamBeginCapture");
            check(GA.begin(st, mode), parse_expect(ARG()), "cuStreamBeginCapture");
        } else if (strcmp(cmd, "endcapture") == 0) {
            CUstream st = stream_arg(ARG());
            int g = slot(ARG());
            NEED(end, "cuStreamEndCapture");
            check(GA.end(st, &g_graphs[g]), parse_expect(ARG()), "cuStreamEndCapture");
        } else if (strcmp(cmd, "launchon") == 0) {
            CUstream st = stream_arg(ARG());
            long n = atol(ARG());
            unsigned grid = (unsigned)atoi(ARG()), block = (unsigned)atoi(ARG());
            int want = parse_expect(ARG());
            uint64_t t0 = now_ns();
            for (long k = 0; k < n; k++)
                check(A.launch(FUNC, grid, 1, 1, block, 1, 1, 0, st, NULL, NULL), want, "launch");
            printf("launchon ns=%llu\n", (unsigned long long)(now_ns() - t0));
        } else if (strcmp(cmd, "blockshape") == 0) {
            int x = atoi(ARG()), y = atoi(ARG()), z = atoi(ARG());
            NEED(shape, "cuFuncSetBlockShape");
            check(GA.shape(FUNC, x, y, z), 0, "cuFuncSetBlockShape");
        } else if (strcmp(cmd, "legacy") == 0) {
            const char *how = ARG();
            long n = atol(ARG());
            int w = atoi(ARG()), h = atoi(ARG());
            int want = parse_expect(ARG());
            for (long k = 0; k < n; k++) {
                if (strcmp(how, "launch") == 0) {
                    NEED(launch0, "cuLaunch");
                    check(GA.launch0(FUNC), want, "cuLaunch");
                } else if (strcmp(how, "grid") == 0) {
                    NEED(launch_grid, "cuLaunchGrid");
                    check(GA.launch_grid(FUNC, w, h), want, "cuLaunchGrid");
                } else {
                    NEED(launch_grid_async, "cuLaunchGridAsync");
                    check(GA.launch_grid_async(FUNC, w, h, STREAM), want, "cuLaunchGridAsync");
                }
            }
        } else if (strcmp(cmd, "multidev") == 0) {
            CUstream s1 = stream_arg(ARG()), s2 = stream_arg(ARG());
            unsigned grid = (unsigned)atoi(ARG()), block = (unsigned)atoi(ARG());
            int want = parse_expect(ARG());
            CUDA_LAUNCH_PARAMS lp[2];
            memset(lp, 0, sizeof lp);
            for (int k = 0; k < 2; k++) {
                lp[k].function = FUNC;
                lp[k].gridDimX = grid, lp[k].gridDimY = lp[k].gridDimZ = 1;
                lp[k].blockDimX = block, lp[k].blockDimY = lp[k].blockDimZ = 1;
                lp[k].hStream = k == 0 ? s1 : s2;
            }
            NEED(multidev, "cuLaunchCooperativeKernelMultiDevice");
            check(GA.multidev(lp, 2, 0), want, "cuLaunchCooperativeKernelMultiDevice");
        } else if (strcmp(cmd, "gpa") == 0) {
            const char *base = ARG();
            int version = atoi(ARG());
            const char *flag = ARG();
            gpa(base, version, flag, ARG());
        } else if (strcmp(cmd, "itimer") == 0) {
            long us = atol(ARG());
            struct sigaction sa;
            memset(&sa, 0, sizeof sa);
            sa.sa_handler = on_alarm; /* no SA_RESTART: every sleep in progress is interrupted */
            sigaction(SIGALRM, &sa, NULL);
            struct itimerval it = {{us / 1000000, us % 1000000}, {us / 1000000, us % 1000000}};
            setitimer(ITIMER_REAL, &it, NULL);
        } else if (strcmp(cmd, "spin") == 0) {
            double seconds = atof(ARG());
            unsigned grid = (unsigned)atoi(ARG()), block = (unsigned)atoi(ARG());
            uint64_t end = now_ns() + (uint64_t)(seconds * 1e9);
            unsigned long long n = 0;
            while (now_ns() < end) {
                check(A.launch(FUNC, grid, 1, 1, block, 1, 1, 0, STREAM, NULL, NULL), 0, "spin");
                n++;
            }
            printf("spin launches=%llu\n", n);
        } else if (!memory_command(cmd, argc, argv, &i)) {
            fail("unknown command %s", cmd);
        }
#undef ARG
    }
    fflush(stdout);
    return 0;
}
