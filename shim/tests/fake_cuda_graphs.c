/*
 * fake_cuda_graphs.c - the fake driver's streams, stream capture, graphs, executable graphs,
 * legacy launches, kernel run time, versioned entry points and cuGetProcAddress trampolines.
 *
 * Modelled on the driver API's documented behaviour:
 *   - streams (cuStreamCreate) belong to the current device; the legacy default stream cannot be
 *     captured, the per-thread default stream (CU_STREAM_PER_THREAD, or NULL through a _ptsz
 *     entry point) can; a kernel launched into a capturing stream becomes a kernel node and runs
 *     nothing; a graph launched into one becomes a child graph node. While a blocking stream is
 *     captured in global mode (any thread) or thread-local mode (this thread), the legacy stream
 *     refuses work and cuStreamIsCapturing on it with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and the
 *     capture is invalidated;
 *   - graphs hold kernel, child-graph (a clone owned by the node), empty and conditional nodes;
 *     an executable graph is a deep copy whose nodes remember the node they were made from, which
 *     the in-place updates name (cuGraphExecKernelNodeSetParams, ...ChildGraphNodeSetParams,
 *     cuGraphExecNodeSetParams, cuGraphNodeSetEnabled); cuGraphExecUpdate takes the parameters of
 *     a graph of the same topology, node for node;
 *   - kernels "run" for FAKE_CUDA_PS_PER_THREAD picoseconds per thread (grid x block), default 0,
 *     one after the other on the process's GPU; a launch returns once at most FAKE_CUDA_QUEUE_NS
 *     (default 1 ms) of queued work is ahead of it, like a launch into a bounded queue;
 *   - cuGetProcAddress resolves a base name to the newest version not newer than the requested
 *     one (a per-thread form only where one exists), and with FAKE_CUDA_TRAMPOLINES=1 returns an
 *     internal stub that jumps to the function instead of the exported symbol.
 * fakeCudaGraphQueriesFail(1) makes the kernel-node queries fail (a graph that cannot be read).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "cuda_subset.h"
#include "fake_cuda_graphs.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_OBJECTS 65536
#define CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE ((CUresult)910)

enum gcounter { G_GRAPH_LAUNCH, G_GRAPH_KERNELS, G_CAPTURED, G_LEGACY, G_MULTIDEV, G_COUNT };
static const char *const gcounter_names[G_COUNT] = {"graph_launch", "graph_kernels", "captured",
                                                    "legacy", "multidev"};
static unsigned long long g_gcounters[G_COUNT];

static void gcount(enum gcounter c, unsigned long long n)
{
    __atomic_fetch_add(&g_gcounters[c], n, __ATOMIC_RELAXED);
}

unsigned long long fake_graphs_counter(const char *name)
{
    for (int i = 0; i < G_COUNT; i++)
        if (strcmp(gcounter_names[i], name) == 0)
            return __atomic_load_n(&g_gcounters[i], __ATOMIC_RELAXED);
    return ~0ull;
}

/* ------------------------------------------------------------------ objects */

enum okind { O_STREAM = 1, O_GRAPH, O_EXEC, O_NODE };

struct fgraph;

struct fnode {
    enum okind kind; /* O_NODE */
    CUgraphNodeType type;
    CUDA_KERNEL_NODE_PARAMS_v2 k;
    struct fgraph *child; /* owned clone for CU_GRAPH_NODE_TYPE_GRAPH */
    struct fnode *orig;   /* in an executable graph: the node it was made from */
    int enabled;
};

struct fgraph {
    enum okind kind; /* O_GRAPH or O_EXEC */
    size_t n, cap;
    struct fnode **nodes;
};

struct fstream {
    enum okind kind; /* O_STREAM */
    int dev;
    unsigned flags;
    int capture;      /* CUstreamCaptureStatus */
    int mode;         /* CUstreamCaptureMode of the capture */
    pthread_t thread; /* that began the capture */
    struct fgraph *graph;
    int borrowed;     /* graph is the caller's (cuStreamBeginCaptureToGraph) */
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static void *g_live[2 * MAX_OBJECTS];
static int g_query_fail;
static __thread struct fstream t_per_thread = {O_STREAM, -1, 0, 0, 0, 0, NULL, 0};

static void fork_prepare(void)
{
    pthread_mutex_lock(&g_lock);
}

static void fork_release(void)
{
    pthread_mutex_unlock(&g_lock);
}

__attribute__((constructor)) static void graphs_load(void)
{
    pthread_atfork(fork_prepare, fork_release, fork_release);
    /* modelled kernel times are short (tens of us): sleep that long, not the default 50 us more */
    if (getenv("FAKE_CUDA_PS_PER_THREAD") != NULL)
        prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
}

/* the live objects: an open-addressing set of pointers (tombstones reused), under g_lock */
#define LIVE_SLOTS (2 * MAX_OBJECTS)
#define LIVE_GONE ((void *)1)

static size_t live_hash(const void *p)
{
    return (size_t)(((uintptr_t)p * UINT64_C(0x9E3779B97F4A7C15)) >> 40) % LIVE_SLOTS;
}

static void live_add(void *p)
{
    size_t i = live_hash(p);
    for (size_t n = 0; n < LIVE_SLOTS; n++, i = (i + 1) % LIVE_SLOTS)
        if (g_live[i] == NULL || g_live[i] == LIVE_GONE) {
            g_live[i] = p;
            return;
        }
}

static void **live_slot(const void *p)
{
    size_t i = live_hash(p);
    for (size_t n = 0; n < LIVE_SLOTS; n++, i = (i + 1) % LIVE_SLOTS) {
        if (g_live[i] == p)
            return &g_live[i];
        if (g_live[i] == NULL)
            return NULL;
    }
    return NULL;
}

static void live_del(void *p)
{
    void **slot = live_slot(p);
    if (slot != NULL)
        *slot = LIVE_GONE;
}

static void *live_get(const void *p, enum okind kind)
{
    if (p == NULL || p == LIVE_GONE)
        return NULL;
    void **slot = live_slot(p);
    return slot != NULL && *(const enum okind *)*slot == kind ? *slot : NULL;
}

EXPORT void fakeCudaGraphQueriesFail(int fail)
{
    __atomic_store_n(&g_query_fail, fail, __ATOMIC_RELAXED);
}

static int current_dev(void)
{
    CUdevice d;
    return cuCtxGetDevice(&d) == CUDA_SUCCESS ? d : -1;
}

/* ------------------------------------------------------------------ kernel run time */

/* The process's GPU runs its kernels one after the other: a launch queues its kernel behind the
 * ones already queued and returns at once, unless more than FAKE_CUDA_QUEUE_NS (default 1 ms)
 * of work would then be ahead of the caller: then it waits until that much is left, as a launch
 * into a full queue does. A short hiccup of the launching thread leaves the GPU busy. */
static uint64_t g_gpu_free_at; /* CLOCK_MONOTONIC ns when the queued work is done */

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void run_for(uint64_t threads)
{
    static long ps = -1, queue = -1;
    long per = __atomic_load_n(&ps, __ATOMIC_RELAXED);
    if (per < 0) {
        const char *e = getenv("FAKE_CUDA_PS_PER_THREAD"), *q = getenv("FAKE_CUDA_QUEUE_NS");
        per = e != NULL ? atol(e) : 0;
        __atomic_store_n(&queue, q != NULL ? atol(q) : 1000000L, __ATOMIC_RELAXED);
        __atomic_store_n(&ps, per, __ATOMIC_RELAXED);
    }
    if (per <= 0)
        return;
    uint64_t ns = threads * (uint64_t)per / 1000, now = mono_ns();
    uint64_t free_at = __atomic_load_n(&g_gpu_free_at, __ATOMIC_RELAXED), end;
    do {
        end = (free_at > now ? free_at : now) + ns;
    } while (!__atomic_compare_exchange_n(&g_gpu_free_at, &free_at, end, true, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
    uint64_t ahead = (uint64_t)__atomic_load_n(&queue, __ATOMIC_RELAXED);
    if (end - now <= ahead)
        return;
    uint64_t wait = end - now - ahead;
    struct timespec ts = {(time_t)(wait / 1000000000u), (long)(wait % 1000000000u)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static uint64_t threads_of(const CUDA_KERNEL_NODE_PARAMS_v2 *k)
{
    return (uint64_t)k->gridDimX * k->gridDimY * k->gridDimZ * k->blockDimX * k->blockDimY *
           k->blockDimZ;
}

static int valid_kernel(const CUDA_KERNEL_NODE_PARAMS_v1 *k)
{
    return k != NULL && k->func != NULL && k->gridDimX && k->gridDimY && k->gridDimZ &&
           k->blockDimX && k->blockDimY && k->blockDimZ &&
           (uint64_t)k->blockDimX * k->blockDimY * k->blockDimZ <= 1024;
}

/* ------------------------------------------------------------------ graphs */

static struct fgraph *graph_new(enum okind kind)
{
    struct fgraph *g = calloc(1, sizeof *g);
    if (g != NULL) {
        g->kind = kind;
        live_add(g);
    }
    return g;
}

static void graph_free(struct fgraph *g);

static void node_free(struct fnode *n)
{
    if (n->child != NULL)
        graph_free(n->child);
    live_del(n);
    free(n);
}

static void graph_free(struct fgraph *g)
{
    for (size_t i = 0; i < g->n; i++)
        node_free(g->nodes[i]);
    free(g->nodes);
    live_del(g);
    free(g);
}

static struct fnode *node_add(struct fgraph *g, CUgraphNodeType type)
{
    if (g->n == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 8;
        struct fnode **v = realloc(g->nodes, cap * sizeof *v);
        if (v == NULL)
            return NULL;
        g->nodes = v;
        g->cap = cap;
    }
    struct fnode *n = calloc(1, sizeof *n);
    if (n == NULL)
        return NULL;
    n->kind = O_NODE;
    n->type = type;
    n->enabled = 1;
    live_add(n);
    g->nodes[g->n++] = n;
    return n;
}

/* deep copy; `link` makes each copied node remember its source (executable graphs) */
static struct fgraph *graph_clone(const struct fgraph *src, enum okind kind, int link)
{
    struct fgraph *g = graph_new(kind);
    if (g == NULL)
        return NULL;
    for (size_t i = 0; i < src->n; i++) {
        struct fnode *s = src->nodes[i], *n = node_add(g, s->type);
        if (n == NULL)
            break;
        n->k = s->k;
        n->enabled = s->enabled;
        n->orig = link ? s : NULL;
        if (s->child != NULL)
            n->child = graph_clone(s->child, O_GRAPH, link);
    }
    return g;
}

static int same_topology(const struct fgraph *a, const struct fgraph *b)
{
    if (a->n != b->n)
        return 0;
    for (size_t i = 0; i < a->n; i++) {
        if (a->nodes[i]->type != b->nodes[i]->type)
            return 0;
        if (a->nodes[i]->child != NULL &&
            (b->nodes[i]->child == NULL || !same_topology(a->nodes[i]->child, b->nodes[i]->child)))
            return 0;
    }
    return 1;
}

/* copy parameters node for node (same topology) */
static void take_params(struct fgraph *dst, const struct fgraph *src)
{
    for (size_t i = 0; i < dst->n; i++) {
        dst->nodes[i]->k = src->nodes[i]->k;
        if (dst->nodes[i]->child != NULL)
            take_params(dst->nodes[i]->child, src->nodes[i]->child);
    }
}

static struct fnode *exec_node(struct fgraph *g, const struct fnode *orig)
{
    for (size_t i = 0; i < g->n; i++) {
        if (g->nodes[i]->orig == orig)
            return g->nodes[i];
        if (g->nodes[i]->child != NULL) {
            struct fnode *n = exec_node(g->nodes[i]->child, orig);
            if (n != NULL)
                return n;
        }
    }
    return NULL;
}

static uint64_t run_graph(const struct fgraph *g, uint64_t *kernels)
{
    uint64_t threads = 0;
    for (size_t i = 0; i < g->n; i++) {
        const struct fnode *n = g->nodes[i];
        if (n->type == CU_GRAPH_NODE_TYPE_KERNEL && n->enabled) {
            threads += threads_of(&n->k);
            (*kernels)++;
        } else if (n->child != NULL) {
            threads += run_graph(n->child, kernels);
        }
    }
    return threads;
}

EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    if (phGraph == NULL || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    *phGraph = (CUgraph)graph_new(O_GRAPH);
    pthread_mutex_unlock(&g_lock);
    return *phGraph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

EXPORT CUresult cuGraphDestroy(CUgraph hGraph)
{
    pthread_mutex_lock(&g_lock);
    struct fgraph *g = live_get(hGraph, O_GRAPH);
    if (g != NULL)
        graph_free(g);
    pthread_mutex_unlock(&g_lock);
    return g ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult add_node(CUgraphNode *out, CUgraph hGraph, CUgraphNodeType type,
                         const CUDA_KERNEL_NODE_PARAMS_v2 *k, CUgraph child)
{
    if (out == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    struct fgraph *g = live_get(hGraph, O_GRAPH), *c = NULL;
    if (g != NULL && (child == NULL || (c = live_get(child, O_GRAPH)) != NULL)) {
        struct fnode *n = node_add(g, type);
        if (n != NULL) {
            if (k != NULL)
                n->k = *k;
            if (c != NULL)
                n->child = graph_clone(c, O_GRAPH, 0);
            *out = (CUgraphNode)n;
            r = CUDA_SUCCESS;
        } else {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                                        const CUgraphNode *dependencies, size_t numDependencies,
                                        const CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams)
{
    (void)dependencies, (void)numDependencies;
    if (!valid_kernel((const CUDA_KERNEL_NODE_PARAMS_v1 *)nodeParams))
        return CUDA_ERROR_INVALID_VALUE;
    return add_node(phGraphNode, hGraph, CU_GRAPH_NODE_TYPE_KERNEL, nodeParams, NULL);
}

EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                     const CUgraphNode *dependencies, size_t numDependencies,
                                     const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams)
{
    if (!valid_kernel(nodeParams))
        return CUDA_ERROR_INVALID_VALUE;
    CUDA_KERNEL_NODE_PARAMS_v2 k;
    memset(&k, 0, sizeof k);
    memcpy(&k, nodeParams, sizeof *nodeParams);
    return cuGraphAddKernelNode_v2(phGraphNode, hGraph, dependencies, numDependencies, &k);
}

EXPORT CUresult cuGraphAddChildGraphNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                         const CUgraphNode *dependencies, size_t numDependencies,
                                         CUgraph childGraph)
{
    (void)dependencies, (void)numDependencies;
    if (childGraph == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return add_node(phGraphNode, hGraph, CU_GRAPH_NODE_TYPE_GRAPH, NULL, childGraph);
}

EXPORT CUresult cuGraphAddEmptyNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                    const CUgraphNode *dependencies, size_t numDependencies)
{
    (void)dependencies, (void)numDependencies;
    return add_node(phGraphNode, hGraph, CU_GRAPH_NODE_TYPE_EMPTY, NULL, NULL);
}

/* A conditional node (its body runs a number of times decided on the device). */
EXPORT CUresult fakeCudaAddConditionalNode(CUgraphNode *phGraphNode, CUgraph hGraph)
{
    return add_node(phGraphNode, hGraph, CU_GRAPH_NODE_TYPE_CONDITIONAL, NULL, NULL);
}

EXPORT CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes)
{
    if (numNodes == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct fgraph *g = live_get(hGraph, O_GRAPH);
    if (g != NULL) {
        if (nodes != NULL) {
            for (size_t i = 0; i < *numNodes; i++)
                nodes[i] = i < g->n ? (CUgraphNode)g->nodes[i] : NULL;
        }
        *numNodes = g->n;
    }
    pthread_mutex_unlock(&g_lock);
    return g ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGraphNodeGetType(CUgraphNode hNode, CUgraphNodeType *type)
{
    pthread_mutex_lock(&g_lock);
    struct fnode *n = live_get(hNode, O_NODE);
    if (n != NULL && type != NULL)
        *type = n->type;
    pthread_mutex_unlock(&g_lock);
    return n && type ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult kernel_params(CUgraphNode hNode, void *out, size_t size)
{
    if (__atomic_load_n(&g_query_fail, __ATOMIC_RELAXED))
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_lock);
    struct fnode *n = live_get(hNode, O_NODE);
    int ok = n != NULL && out != NULL && n->type == CU_GRAPH_NODE_TYPE_KERNEL;
    if (ok)
        memcpy(out, &n->k, size);
    pthread_mutex_unlock(&g_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode hNode,
                                              CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams)
{
    return kernel_params(hNode, nodeParams, sizeof *nodeParams);
}

EXPORT CUresult cuGraphKernelNodeGetParams(CUgraphNode hNode, CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams)
{
    return kernel_params(hNode, nodeParams, sizeof *nodeParams);
}

EXPORT CUresult cuGraphKernelNodeSetParams_v2(CUgraphNode hNode,
                                              const CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams)
{
    if (!valid_kernel((const CUDA_KERNEL_NODE_PARAMS_v1 *)nodeParams))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct fnode *n = live_get(hNode, O_NODE);
    int ok = n != NULL && n->type == CU_GRAPH_NODE_TYPE_KERNEL;
    if (ok)
        n->k = *nodeParams;
    pthread_mutex_unlock(&g_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode hNode, CUgraph *phGraph)
{
    pthread_mutex_lock(&g_lock);
    struct fnode *n = live_get(hNode, O_NODE);
    int ok = n != NULL && phGraph != NULL && n->type == CU_GRAPH_NODE_TYPE_GRAPH;
    if (ok)
        *phGraph = (CUgraph)n->child;
    pthread_mutex_unlock(&g_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult instantiate(CUgraphExec *out, CUgraph hGraph)
{
    if (out == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct fgraph *g = live_get(hGraph, O_GRAPH);
    struct fgraph *e = g != NULL ? graph_clone(g, O_EXEC, 1) : NULL;
    pthread_mutex_unlock(&g_lock);
    if (e == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *out = (CUgraphExec)e;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph,
                                   CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize)
{
    (void)phErrorNode, (void)logBuffer, (void)bufferSize;
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
                                      CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize)
{
    (void)phErrorNode, (void)logBuffer, (void)bufferSize;
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                            unsigned long long flags)
{
    (void)flags;
    return instantiate(phGraphExec, hGraph);
}

EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                             CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    CUresult r = instantiate(phGraphExec, hGraph);
    if (params != NULL)
        params->result_out = r == CUDA_SUCCESS ? 0 : 1;
    return r;
}

EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                  CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    return cuGraphInstantiateWithParams(phGraphExec, hGraph, params);
}

EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    pthread_mutex_lock(&g_lock);
    struct fgraph *e = live_get(hGraphExec, O_EXEC);
    if (e != NULL)
        graph_free(e);
    pthread_mutex_unlock(&g_lock);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult exec_update(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphExecUpdateResult *res)
{
    pthread_mutex_lock(&g_lock);
    struct fgraph *e = live_get(hGraphExec, O_EXEC), *g = live_get(hGraph, O_GRAPH);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    *res = CU_GRAPH_EXEC_UPDATE_ERROR;
    if (e != NULL && g != NULL) {
        if (same_topology(e, g)) {
            take_params(e, g);
            *res = CU_GRAPH_EXEC_UPDATE_SUCCESS;
            r = CUDA_SUCCESS;
        } else {
            *res = CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
            r = CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph,
                                  CUgraphNode *hErrorNode_out,
                                  CUgraphExecUpdateResult *updateResult_out)
{
    CUgraphExecUpdateResult res;
    CUresult r = exec_update(hGraphExec, hGraph, &res);
    if (hErrorNode_out != NULL)
        *hErrorNode_out = NULL;
    if (updateResult_out != NULL)
        *updateResult_out = res;
    return r;
}

EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph,
                                     CUgraphExecUpdateResultInfo *resultInfo)
{
    CUgraphExecUpdateResult res;
    CUresult r = exec_update(hGraphExec, hGraph, &res);
    if (resultInfo != NULL) {
        resultInfo->result = res;
        resultInfo->errorNode = resultInfo->errorFromNode = NULL;
    }
    return r;
}

static CUresult exec_set_kernel(CUgraphExec hGraphExec, CUgraphNode hNode, const void *params,
                                size_t size)
{
    if (!valid_kernel(params))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct fgraph *e = live_get(hGraphExec, O_EXEC);
    struct fnode *n = e != NULL ? exec_node(e, (const struct fnode *)hNode) : NULL;
    int ok = n != NULL && n->type == CU_GRAPH_NODE_TYPE_KERNEL;
    if (ok)
        memcpy(&n->k, params, size);
    pthread_mutex_unlock(&g_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGraphExecKernelNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                               const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams)
{
    return exec_set_kernel(hGraphExec, hNode, nodeParams, sizeof *nodeParams);
}

EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                  const CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams)
{
    return exec_set_kernel(hGraphExec, hNode, nodeParams, sizeof *nodeParams);
}

EXPORT CUresult cuGraphExecChildGraphNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                   CUgraph childGraph)
{
    pthread_mutex_lock(&g_lock);
    struct fgraph *e = live_get(hGraphExec, O_EXEC), *c = live_get(childGraph, O_GRAPH);
    struct fnode *n = e != NULL ? exec_node(e, (const struct fnode *)hNode) : NULL;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (n != NULL && c != NULL && n->type == CU_GRAPH_NODE_TYPE_GRAPH && n->child != NULL) {
        if (same_topology(n->child, c)) {
            take_params(n->child, c);
            r = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuGraphExecNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                         CUgraphNodeParams *nodeParams)
{
    if (nodeParams == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (nodeParams->type == CU_GRAPH_NODE_TYPE_KERNEL)
        return exec_set_kernel(hGraphExec, hNode, &nodeParams->kernel, sizeof nodeParams->kernel);
    if (nodeParams->type == CU_GRAPH_NODE_TYPE_GRAPH)
        return cuGraphExecChildGraphNodeSetParams(hGraphExec, hNode, nodeParams->graph.graph);
    return CUDA_ERROR_NOT_SUPPORTED;
}

EXPORT CUresult cuGraphNodeSetEnabled(CUgraphExec hGraphExec, CUgraphNode hNode,
                                      unsigned int isEnabled)
{
    pthread_mutex_lock(&g_lock);
    struct fgraph *e = live_get(hGraphExec, O_EXEC);
    struct fnode *n = e != NULL ? exec_node(e, (const struct fnode *)hNode) : NULL;
    int ok = n != NULL && n->type == CU_GRAPH_NODE_TYPE_KERNEL;
    if (ok)
        n->enabled = isEnabled != 0;
    pthread_mutex_unlock(&g_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------ streams and capture */

/* The stream a handle names; `legacy` set for the legacy default stream (never captured). */
static struct fstream *stream_of(CUstream s, int per_thread, int *legacy)
{
    *legacy = 0;
    if (s == CU_STREAM_PER_THREAD || (s == NULL && per_thread))
        return &t_per_thread;
    if (s == NULL || s == CU_STREAM_LEGACY) {
        *legacy = 1;
        return NULL;
    }
    return live_get(s, O_STREAM);
}

/* Is the legacy stream fenced off by a capture (global mode anywhere, thread-local here)? The
 * per-thread default streams of other threads are not visible here: they are counted below. */
static int g_global_captures; /* blocking streams capturing in global mode, all threads */
static int g_any_capture;     /* atomic: captures in progress, any stream, any mode */
static __thread int t_local_captures;

static int legacy_fenced(void)
{
    return g_global_captures > 0 || t_local_captures > 0;
}

static void invalidate_fencing_captures(void)
{
    for (int i = 0; i < LIVE_SLOTS; i++) {
        struct fstream *st = g_live[i];
        if (st != NULL && st != LIVE_GONE && st->kind == O_STREAM && st->capture == CU_STREAM_CAPTURE_STATUS_ACTIVE &&
            !(st->flags & CU_STREAM_NON_BLOCKING))
            st->capture = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    }
    if (t_per_thread.capture == CU_STREAM_CAPTURE_STATUS_ACTIVE)
        t_per_thread.capture = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
}

EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    int dev = current_dev();
    if (dev < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (phStream == NULL || (Flags & ~CU_STREAM_NON_BLOCKING) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct fstream *st = calloc(1, sizeof *st);
    if (st == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    st->kind = O_STREAM;
    st->dev = dev;
    st->flags = Flags;
    pthread_mutex_lock(&g_lock);
    live_add(st);
    pthread_mutex_unlock(&g_lock);
    *phStream = (CUstream)st;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream hStream)
{
    pthread_mutex_lock(&g_lock);
    struct fstream *st = live_get(hStream, O_STREAM);
    if (st != NULL) {
        if (st->graph != NULL && !st->borrowed)
            graph_free(st->graph);
        if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE)
            __atomic_fetch_sub(&g_any_capture, 1, __ATOMIC_ACQ_REL);
        live_del(st);
    }
    pthread_mutex_unlock(&g_lock);
    free(st);
    return st ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuStreamGetDevice(CUstream hStream, CUdevice *device)
{
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    int legacy;
    pthread_mutex_lock(&g_lock);
    struct fstream *st = stream_of(hStream, 0, &legacy);
    int dev = st != NULL && st != &t_per_thread ? st->dev : current_dev();
    pthread_mutex_unlock(&g_lock);
    if (st == NULL && !legacy)
        return CUDA_ERROR_INVALID_HANDLE;
    if (dev < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = dev;
    return CUDA_SUCCESS;
}

static CUresult begin_capture_into(CUstream s, int per_thread, CUstreamCaptureMode mode,
                                   CUgraph into)
{
    if (mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    int legacy;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    struct fstream *st = stream_of(s, per_thread, &legacy);
    if (legacy)
        r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    else if (st == NULL)
        r = CUDA_ERROR_INVALID_HANDLE;
    else if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE)
        r = CUDA_ERROR_ILLEGAL_STATE;
    struct fgraph *target = NULL;
    if (r == CUDA_SUCCESS && into != NULL && (target = live_get(into, O_GRAPH)) == NULL)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        st->graph = target != NULL ? target : graph_new(O_GRAPH);
        st->borrowed = target != NULL;
        st->capture = CU_STREAM_CAPTURE_STATUS_ACTIVE;
        __atomic_fetch_add(&g_any_capture, 1, __ATOMIC_ACQ_REL);
        st->mode = mode;
        st->thread = pthread_self();
        if (!(st->flags & CU_STREAM_NON_BLOCKING) && st != &t_per_thread) {
            if (mode == CU_STREAM_CAPTURE_MODE_GLOBAL)
                g_global_captures++;
            else if (mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                t_local_captures++;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

static CUresult begin_capture(CUstream s, int per_thread, CUstreamCaptureMode mode)
{
    return begin_capture_into(s, per_thread, mode, NULL);
}

EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph,
                                            const CUgraphNode *dependencies,
                                            const void *dependencyData, size_t numDependencies,
                                            CUstreamCaptureMode mode)
{
    (void)dependencies, (void)dependencyData, (void)numDependencies;
    if (hGraph == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return begin_capture_into(hStream, 0, mode, hGraph);
}

EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream hStream, CUgraph hGraph,
                                                 const CUgraphNode *dependencies,
                                                 const void *dependencyData,
                                                 size_t numDependencies, CUstreamCaptureMode mode)
{
    (void)dependencies, (void)dependencyData, (void)numDependencies;
    if (hGraph == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    return begin_capture_into(hStream, 1, mode, hGraph);
}

EXPORT CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    return begin_capture(hStream, 0, mode);
}

EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode)
{
    return begin_capture(hStream, 1, mode);
}

EXPORT CUresult cuStreamBeginCapture(CUstream hStream)
{
    return begin_capture(hStream, 0, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    return begin_capture(hStream, 1, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

static CUresult end_capture(CUstream s, int per_thread, CUgraph *phGraph)
{
    if (phGraph == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    int legacy;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    struct fstream *st = stream_of(s, per_thread, &legacy);
    if (st == NULL)
        r = legacy ? CUDA_ERROR_ILLEGAL_STATE : CUDA_ERROR_INVALID_HANDLE;
    else if (st->capture == CU_STREAM_CAPTURE_STATUS_NONE)
        r = CUDA_ERROR_ILLEGAL_STATE;
    else if (st->mode != CU_STREAM_CAPTURE_MODE_RELAXED && !pthread_equal(st->thread, pthread_self()))
        r = CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    if (r == CUDA_SUCCESS) {
        if (!(st->flags & CU_STREAM_NON_BLOCKING) && st != &t_per_thread) {
            if (st->mode == CU_STREAM_CAPTURE_MODE_GLOBAL)
                g_global_captures--;
            else if (st->mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                t_local_captures--;
        }
        if (st->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
            if (!st->borrowed)
                graph_free(st->graph);
            *phGraph = NULL;
            r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        } else {
            *phGraph = (CUgraph)st->graph;
        }
        st->graph = NULL;
        st->capture = CU_STREAM_CAPTURE_STATUS_NONE;
        __atomic_fetch_sub(&g_any_capture, 1, __ATOMIC_ACQ_REL);
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(hStream, 0, phGraph);
}

EXPORT CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    return end_capture(hStream, 1, phGraph);
}

static CUresult is_capturing(CUstream s, int per_thread, CUstreamCaptureStatus *status)
{
    if (status == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    int legacy;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    struct fstream *st = stream_of(s, per_thread, &legacy);
    if (legacy)
        r = legacy_fenced() ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : CUDA_SUCCESS;
    else if (st == NULL)
        r = CUDA_ERROR_INVALID_HANDLE;
    *status = st != NULL ? (CUstreamCaptureStatus)st->capture : CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return is_capturing(hStream, 0, captureStatus);
}

EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    return is_capturing(hStream, 1, captureStatus);
}

/* ------------------------------------------------------------------ submitting work */

CUresult fake_submit_kernel(CUstream s, int per_thread, CUfunction f, unsigned gx, unsigned gy,
                            unsigned gz, unsigned bx, unsigned by, unsigned bz, int *ran)
{
    *ran = 0;
    if ((s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) &&
        __atomic_load_n(&g_any_capture, __ATOMIC_ACQUIRE) == 0) {
        /* no capture anywhere: a default stream just runs it (no lock on the common path) */
        run_for((uint64_t)gx * gy * gz * bx * by * bz);
        *ran = 1;
        return CUDA_SUCCESS;
    }
    int legacy;
    pthread_mutex_lock(&g_lock);
    struct fstream *st = stream_of(s, per_thread, &legacy);
    if (legacy && legacy_fenced()) {
        invalidate_fencing_captures();
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
    if (!legacy && st == NULL) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (st != NULL && st->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
        CUresult r = CUDA_SUCCESS;
        if (st->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
            r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        } else {
            struct fnode *n = node_add(st->graph, CU_GRAPH_NODE_TYPE_KERNEL);
            if (n != NULL) {
                n->k = (CUDA_KERNEL_NODE_PARAMS_v2){f, gx, gy, gz, bx, by, bz, 0, NULL, NULL,
                                                    NULL, NULL};
                gcount(G_CAPTURED, 1);
            }
        }
        pthread_mutex_unlock(&g_lock);
        return r;
    }
    pthread_mutex_unlock(&g_lock);
    run_for((uint64_t)gx * gy * gz * bx * by * bz);
    *ran = 1;
    return CUDA_SUCCESS;
}

CUresult fake_graph_launch(CUgraphExec g, CUstream s, int per_thread)
{
    if (current_dev() < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    int legacy;
    pthread_mutex_lock(&g_lock);
    struct fgraph *e = live_get(g, O_EXEC);
    struct fstream *st = stream_of(s, per_thread, &legacy);
    CUresult r = CUDA_SUCCESS;
    if (e == NULL)
        r = CUDA_ERROR_INVALID_HANDLE;
    else if (!legacy && st == NULL)
        r = CUDA_ERROR_INVALID_HANDLE;
    else if (legacy && legacy_fenced()) {
        invalidate_fencing_captures();
        r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
    if (r != CUDA_SUCCESS || (st != NULL && st->capture != CU_STREAM_CAPTURE_STATUS_NONE)) {
        if (r == CUDA_SUCCESS && st->capture == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
            struct fnode *n = node_add(st->graph, CU_GRAPH_NODE_TYPE_GRAPH);
            if (n != NULL)
                n->child = graph_clone(e, O_GRAPH, 0);
            gcount(G_CAPTURED, 1);
        } else if (r == CUDA_SUCCESS) {
            r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        }
        pthread_mutex_unlock(&g_lock);
        return r;
    }
    uint64_t kernels = 0, threads = run_graph(e, &kernels);
    pthread_mutex_unlock(&g_lock);
    gcount(G_GRAPH_LAUNCH, 1);
    gcount(G_GRAPH_KERNELS, kernels);
    run_for(threads);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ legacy launches */

#define MAX_SHAPES 256
static struct {
    CUfunction f;
    int x, y, z;
} g_shapes[MAX_SHAPES];

EXPORT CUresult cuFuncSetBlockShape(CUfunction hfunc, int x, int y, int z)
{
    if (hfunc == NULL)
        return CUDA_ERROR_INVALID_HANDLE;
    if (x <= 0 || y <= 0 || z <= 0 || (long)x * y * z > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_SHAPES; i++)
        if (g_shapes[i].f == hfunc || g_shapes[i].f == NULL) {
            g_shapes[i].f = hfunc;
            g_shapes[i].x = x, g_shapes[i].y = y, g_shapes[i].z = z;
            r = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    return r;
}

static CUresult legacy_launch(CUfunction f, int w, int h, CUstream s)
{
    if (current_dev() < 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (f == NULL)
        return CUDA_ERROR_INVALID_HANDLE;
    if (w <= 0 || h <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    int x = 0, y = 0, z = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_SHAPES; i++)
        if (g_shapes[i].f == f) {
            x = g_shapes[i].x, y = g_shapes[i].y, z = g_shapes[i].z;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    if (x == 0)
        return CUDA_ERROR_INVALID_VALUE; /* no block shape was set */
    int ran;
    CUresult r = fake_submit_kernel(s, 0, f, (unsigned)w, (unsigned)h, 1, (unsigned)x, (unsigned)y,
                                    (unsigned)z, &ran);
    if (r == CUDA_SUCCESS && ran)
        gcount(G_LEGACY, 1);
    return r;
}

EXPORT CUresult cuLaunch(CUfunction f)
{
    return legacy_launch(f, 1, 1, NULL);
}

EXPORT CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    return legacy_launch(f, grid_width, grid_height, NULL);
}

EXPORT CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream)
{
    return legacy_launch(f, grid_width, grid_height, hStream);
}

EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                                     unsigned int numDevices, unsigned int flags)
{
    if (launchParamsList == NULL || numDevices == 0 || flags > 3)
        return CUDA_ERROR_INVALID_VALUE;
    int used[64] = {0};
    for (unsigned i = 0; i < numDevices; i++) {
        const CUDA_LAUNCH_PARAMS *p = &launchParamsList[i];
        CUdevice dev;
        if (!valid_kernel(&(CUDA_KERNEL_NODE_PARAMS_v1){p->function, p->gridDimX, p->gridDimY,
                                                        p->gridDimZ, p->blockDimX, p->blockDimY,
                                                        p->blockDimZ, 0, NULL, NULL}))
            return CUDA_ERROR_INVALID_VALUE;
        if (p->hStream == NULL || cuStreamGetDevice(p->hStream, &dev) != CUDA_SUCCESS ||
            dev < 0 || dev >= 64 || used[dev]++)
            return CUDA_ERROR_INVALID_VALUE; /* one kernel per device, on its own stream */
    }
    for (unsigned i = 0; i < numDevices; i++) {
        const CUDA_LAUNCH_PARAMS *p = &launchParamsList[i];
        run_for((uint64_t)p->gridDimX * p->gridDimY * p->gridDimZ * p->blockDimX * p->blockDimY *
                p->blockDimZ);
    }
    gcount(G_MULTIDEV, numDevices);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ versioned entry points */

/* Older ABIs of entry points whose current version the rest of the fake implements: they exist
 * so that cuGetProcAddress hands out a distinct function per version, as the driver does. */
static CUresult v1_mem_alloc(unsigned int *dptr, unsigned int bytesize)
{
    (void)dptr, (void)bytesize;
    return CUDA_ERROR_NOT_SUPPORTED;
}

static CUresult v1_mem_alloc_pitch(unsigned int *dptr, unsigned int *pitch, unsigned int w,
                                   unsigned int h, unsigned int e)
{
    (void)dptr, (void)pitch, (void)w, (void)h, (void)e;
    return CUDA_ERROR_NOT_SUPPORTED;
}

static CUresult v1_mem_free(unsigned int dptr)
{
    (void)dptr;
    return CUDA_ERROR_NOT_SUPPORTED;
}

static CUresult v1_mem_get_info(unsigned int *free_bytes, unsigned int *total)
{
    (void)free_bytes, (void)total;
    return CUDA_ERROR_NOT_SUPPORTED;
}

static CUresult v1_device_total_mem(unsigned int *bytes, CUdevice dev)
{
    (void)bytes, (void)dev;
    return CUDA_ERROR_NOT_SUPPORTED;
}

struct vproc {
    const char *base;
    int since;
    void *fn;
    void *per_thread; /* NULL: none */
    int per_thread_since;
};

static const struct vproc g_vprocs[] = {
    {"cuMemAlloc", 2000, (void *)v1_mem_alloc, NULL, 0},
    {"cuMemAlloc", 3020, (void *)cuMemAlloc_v2, NULL, 0},
    {"cuMemAllocPitch", 2000, (void *)v1_mem_alloc_pitch, NULL, 0},
    {"cuMemAllocPitch", 3020, (void *)cuMemAllocPitch_v2, NULL, 0},
    {"cuMemFree", 2000, (void *)v1_mem_free, NULL, 0},
    {"cuMemFree", 3020, (void *)cuMemFree_v2, NULL, 0},
    {"cuMemGetInfo", 2000, (void *)v1_mem_get_info, NULL, 0},
    {"cuMemGetInfo", 3020, (void *)cuMemGetInfo_v2, NULL, 0},
    {"cuDeviceTotalMem", 2000, (void *)v1_device_total_mem, NULL, 0},
    {"cuDeviceTotalMem", 3020, (void *)cuDeviceTotalMem_v2, NULL, 0},
    {"cuCtxCreate", 3020, (void *)cuCtxCreate_v2, NULL, 0},
    {"cuCtxCreate", 11040, (void *)cuCtxCreate_v3, NULL, 0},
    {"cuCtxCreate", 12050, (void *)cuCtxCreate_v4, NULL, 0},
    {"cuLaunchKernel", 4000, (void *)cuLaunchKernel, (void *)cuLaunchKernel_ptsz, 7000},
    {"cuLaunch", 2000, (void *)cuLaunch, NULL, 0},
    {"cuLaunchGrid", 2000, (void *)cuLaunchGrid, NULL, 0},
    {"cuLaunchGridAsync", 2000, (void *)cuLaunchGridAsync, NULL, 0},
    {"cuFuncSetBlockShape", 2000, (void *)cuFuncSetBlockShape, NULL, 0},
    {"cuLaunchCooperativeKernelMultiDevice", 9000, (void *)cuLaunchCooperativeKernelMultiDevice,
     NULL, 0},
    {"cuStreamCreate", 2000, (void *)cuStreamCreate, NULL, 0},
    {"cuStreamDestroy", 4000, (void *)cuStreamDestroy_v2, NULL, 0},
    {"cuStreamGetDevice", 12080, (void *)cuStreamGetDevice, (void *)cuStreamGetDevice, 12080},
    {"cuStreamIsCapturing", 10000, (void *)cuStreamIsCapturing, (void *)cuStreamIsCapturing_ptsz,
     10000},
    {"cuStreamBeginCapture", 10000, (void *)cuStreamBeginCapture, (void *)cuStreamBeginCapture_ptsz,
     10000},
    {"cuStreamBeginCapture", 10010, (void *)cuStreamBeginCapture_v2,
     (void *)cuStreamBeginCapture_v2_ptsz, 10010},
    {"cuStreamBeginCaptureToGraph", 12030, (void *)cuStreamBeginCaptureToGraph,
     (void *)cuStreamBeginCaptureToGraph_ptsz, 12030},
    {"cuStreamEndCapture", 10000, (void *)cuStreamEndCapture, (void *)cuStreamEndCapture_ptsz,
     10000},
    {"cuGraphCreate", 10000, (void *)cuGraphCreate, NULL, 0},
    {"cuGraphDestroy", 10000, (void *)cuGraphDestroy, NULL, 0},
    {"cuGraphAddKernelNode", 10000, (void *)cuGraphAddKernelNode, NULL, 0},
    {"cuGraphAddKernelNode", 12000, (void *)cuGraphAddKernelNode_v2, NULL, 0},
    {"cuGraphAddChildGraphNode", 10000, (void *)cuGraphAddChildGraphNode, NULL, 0},
    {"cuGraphAddEmptyNode", 10000, (void *)cuGraphAddEmptyNode, NULL, 0},
    {"cuGraphGetNodes", 10000, (void *)cuGraphGetNodes, NULL, 0},
    {"cuGraphNodeGetType", 10000, (void *)cuGraphNodeGetType, NULL, 0},
    {"cuGraphKernelNodeGetParams", 10000, (void *)cuGraphKernelNodeGetParams, NULL, 0},
    {"cuGraphKernelNodeGetParams", 12000, (void *)cuGraphKernelNodeGetParams_v2, NULL, 0},
    {"cuGraphKernelNodeSetParams", 12000, (void *)cuGraphKernelNodeSetParams_v2, NULL, 0},
    {"cuGraphChildGraphNodeGetGraph", 10000, (void *)cuGraphChildGraphNodeGetGraph, NULL, 0},
    {"cuGraphInstantiate", 10000, (void *)cuGraphInstantiate, NULL, 0},
    {"cuGraphInstantiate", 11000, (void *)cuGraphInstantiate_v2, NULL, 0},
    {"cuGraphInstantiateWithFlags", 11040, (void *)cuGraphInstantiateWithFlags, NULL, 0},
    {"cuGraphInstantiateWithParams", 12000, (void *)cuGraphInstantiateWithParams,
     (void *)cuGraphInstantiateWithParams_ptsz, 12000},
    {"cuGraphExecDestroy", 10000, (void *)cuGraphExecDestroy, NULL, 0},
    {"cuGraphExecUpdate", 10020, (void *)cuGraphExecUpdate, NULL, 0},
    {"cuGraphExecUpdate", 12000, (void *)cuGraphExecUpdate_v2, NULL, 0},
    {"cuGraphExecKernelNodeSetParams", 10010, (void *)cuGraphExecKernelNodeSetParams, NULL, 0},
    {"cuGraphExecKernelNodeSetParams", 12000, (void *)cuGraphExecKernelNodeSetParams_v2, NULL, 0},
    {"cuGraphExecChildGraphNodeSetParams", 11010, (void *)cuGraphExecChildGraphNodeSetParams, NULL,
     0},
    {"cuGraphExecNodeSetParams", 12020, (void *)cuGraphExecNodeSetParams, NULL, 0},
    {"cuGraphNodeSetEnabled", 11060, (void *)cuGraphNodeSetEnabled, NULL, 0},
};

int fake_versioned_proc(const char *symbol, int version, cuuint64_t flags, void **pfn)
{
    const struct vproc *best = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof g_vprocs / sizeof g_vprocs[0]; i++) {
        if (strcmp(g_vprocs[i].base, symbol) != 0)
            continue;
        known = 1;
        if (g_vprocs[i].since <= version && (best == NULL || g_vprocs[i].since > best->since))
            best = &g_vprocs[i];
    }
    if (best == NULL)
        return known ? -1 : 0;
    int want = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    *pfn = want && best->per_thread != NULL && version >= best->per_thread_since ? best->per_thread
                                                                                 : best->fn;
    return 1;
}

/* ------------------------------------------------------------------ trampolines */

#if defined(__x86_64__)
#define TRAMP(i)                                                                                  \
    __attribute__((used)) void *fake_tramp_target_##i;                                            \
    __attribute__((naked)) static void fake_tramp_##i(void)                                       \
    {                                                                                             \
        __asm__("jmp *fake_tramp_target_" #i "(%rip)");                                           \
    }
#elif defined(__aarch64__)
#define TRAMP(i)                                                                                  \
    __attribute__((used)) void *fake_tramp_target_##i;                                            \
    __attribute__((naked)) static void fake_tramp_##i(void)                                       \
    {                                                                                             \
        __asm__("adrp x16, fake_tramp_target_" #i "\n"                                            \
                "ldr x16, [x16, #:lo12:fake_tramp_target_" #i "]\n"                               \
                "br x16");                                                                        \
    }
#else
#error "the fake driver's trampolines are written for x86_64 and aarch64"
#endif

#define T8(p) TRAMP(p##0) TRAMP(p##1) TRAMP(p##2) TRAMP(p##3) TRAMP(p##4) TRAMP(p##5) TRAMP(p##6) TRAMP(p##7)
T8(1) T8(2) T8(3) T8(4) T8(5) T8(6) T8(7) T8(8) T8(9) T8(10) T8(11) T8(12) T8(13) T8(14) T8(15) T8(16)

#define E(i) {(void *)fake_tramp_##i, &fake_tramp_target_##i},
#define E8(p) E(p##0) E(p##1) E(p##2) E(p##3) E(p##4) E(p##5) E(p##6) E(p##7)
static const struct {
    void *stub;
    void **target;
} g_tramps[] = {E8(1) E8(2) E8(3) E8(4) E8(5) E8(6) E8(7) E8(8) E8(9) E8(10) E8(11) E8(12) E8(13)
                    E8(14) E8(15) E8(16)};

void *fake_maybe_trampoline(void *fn)
{
    const char *e = getenv("FAKE_CUDA_TRAMPOLINES");
    if (fn == NULL || e == NULL || strcmp(e, "1") != 0)
        return fn;
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    void *stub = fn; /* out of stubs: the function itself */
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < sizeof g_tramps / sizeof g_tramps[0]; i++) {
        void *t = __atomic_load_n(g_tramps[i].target, __ATOMIC_ACQUIRE);
        if (t == fn || t == NULL) {
            if (t == NULL)
                __atomic_store_n(g_tramps[i].target, fn, __ATOMIC_RELEASE);
            stub = g_tramps[i].stub;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return stub;
}
