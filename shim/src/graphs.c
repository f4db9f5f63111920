/*
 * graphs.c - what a graph launch costs, and launches that only record into a capture.
 *
 * Price. An executable graph costs the sum of its kernel nodes' costs (grid blocks x threads per
 * block, as the same kernels launched one by one), child graphs included. It is computed once,
 * when the graph is instantiated, from the graph the executable was made from (the driver's node
 * queries: cuGraphGetNodes, cuGraphNodeGetType, cuGraphKernelNodeGetParams(_v2),
 * cuGraphChildGraphNodeGetGraph), kept per node so that the updates that change an executable
 * graph in place (cuGraphExecUpdate, cuGraphExecKernelNodeSetParams, ...ChildGraphNodeSetParams,
 * cuGraphExecNodeSetParams, cuGraphNodeSetEnabled) adjust it, and forgotten at
 * cuGraphExecDestroy. The launch path reads one word from a lock-free table.
 *
 * A graph the shim cannot price (a node query failed, a conditional node whose body runs an
 * unknown number of times, a node update it cannot place, an executable graph it never saw
 * instantiated, or the table is full) is "unpriced": a launch costs the larger of what could be
 * read and the device's graph_cost (VGPU_DEFAULT_GRAPH_COST when 0), and the executable graph is
 * counted once in the state file's graphs_unpriced (ABI 1.1 regions).
 *
 * Capture. A kernel or graph launched into a stream that is being captured runs nothing: it
 * becomes a node of the graph being captured, paid for when that graph is launched. Such a launch
 * spends nothing and never waits. Once this process has begun a capture (the cuStreamBeginCapture*
 * hooks say so) each launch asks the driver whether its stream is capturing (cuStreamIsCapturing;
 * the per-thread default stream of a _ptsz entry point is asked as CU_STREAM_PER_THREAD). A launch
 * into the legacy default stream while a blocking stream is captured is refused by the driver
 * (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT): it spends nothing either.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "bucket.h"
#include "ptrtable.h"
#include "shim.h"

#define GRAPH_TABLE_SIZE 4096     /* executable graphs per process priced at once */
#define GRAPH_MAX_NODES (1u << 20) /* more nodes than this in one graph: unpriced */
#define GRAPH_MAX_DEPTH 16         /* child graphs nested deeper: unpriced */
#define PRICE_UNPRICED (UINT64_C(1) << 63)

enum gkind { G_KERNEL, G_CHILD, G_OTHER };

struct gnode {
    CUgraphNode node; /* the node of the graph the executable was instantiated from */
    uint64_t cost;    /* kernel nodes: threads; 0 for others */
    int32_t parent;   /* index of the enclosing child-graph entry, -1 at the top */
    uint8_t kind;     /* enum gkind */
    uint8_t enabled;
};

struct gdetail {
    int rdev;         /* region device it was instantiated on (-1: not governed) */
    bool unreadable;  /* part of it could not be priced */
    size_t n, cap;
    struct gnode *v;
};

static struct ptr_slot g_graph_slots[GRAPH_TABLE_SIZE];
static struct ptr_table g_graphs = {g_graph_slots, GRAPH_TABLE_SIZE - 1, PTHREAD_MUTEX_INITIALIZER};
int g_capture_seen; /* atomic: this process has begun a stream capture */
static uint64_t g_unpriced_local; /* atomic: executable graphs unpriced in this process */

/* ---------------------------------------------------------------- driver queries */

typedef CUresult (*get_nodes_fn)(CUgraph, CUgraphNode *, size_t *);
typedef CUresult (*node_type_fn)(CUgraphNode, CUgraphNodeType *);
typedef CUresult (*kernel_params_fn)(CUgraphNode, void *);
typedef CUresult (*child_graph_fn)(CUgraphNode, CUgraph *);
typedef CUresult (*is_capturing_fn)(CUstream, CUstreamCaptureStatus *);

static void *driver_fn(void **cache, const char *name)
{
    void *p = __atomic_load_n(cache, __ATOMIC_ACQUIRE);
    if (p == NULL) {
        p = shim_real_by_name(name, false);
        if (p != NULL)
            __atomic_store_n(cache, p, __ATOMIC_RELEASE);
    }
    return p;
}

struct queries {
    get_nodes_fn get_nodes;
    node_type_fn node_type;
    kernel_params_fn kernel_params; /* _v2 layout when v2 is set */
    bool v2;
    child_graph_fn child_graph;
};

static bool load_queries(struct queries *q)
{
    static void *c_nodes, *c_type, *c_kp2, *c_kp1, *c_child;
    q->get_nodes = (get_nodes_fn)driver_fn(&c_nodes, "cuGraphGetNodes");
    q->node_type = (node_type_fn)driver_fn(&c_type, "cuGraphNodeGetType");
    q->kernel_params = (kernel_params_fn)driver_fn(&c_kp2, "cuGraphKernelNodeGetParams_v2");
    q->v2 = q->kernel_params != NULL;
    if (q->kernel_params == NULL)
        q->kernel_params = (kernel_params_fn)driver_fn(&c_kp1, "cuGraphKernelNodeGetParams");
    q->child_graph = (child_graph_fn)driver_fn(&c_child, "cuGraphChildGraphNodeGetGraph");
    return q->get_nodes != NULL && q->node_type != NULL && q->kernel_params != NULL &&
           q->child_graph != NULL;
}

/* ---------------------------------------------------------------- pricing a graph */

static bool push(struct gdetail *d, struct gnode e)
{
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 16;
        if (cap > GRAPH_MAX_NODES)
            return false;
        struct gnode *v = realloc(d->v, cap * sizeof *v);
        if (v == NULL)
            return false;
        d->v = v;
        d->cap = cap;
    }
    d->v[d->n++] = e;
    return true;
}

static uint64_t kernel_cost(const void *params)
{
    /* the grid and block fields sit at the same offsets in every version of the struct */
    const CUDA_KERNEL_NODE_PARAMS_v1 *k = params;
    return vgpu_launch_cost(k->gridDimX, k->gridDimY, k->gridDimZ, k->blockDimX, k->blockDimY,
                            k->blockDimZ);
}

/* Append the nodes of g (depth first, a child graph's nodes right after its node). */
static void walk(const struct queries *q, CUgraph g, struct gdetail *d, int32_t parent, int depth)
{
    size_t n = 0;
    if (depth > GRAPH_MAX_DEPTH || q->get_nodes(g, NULL, &n) != CUDA_SUCCESS ||
        n > GRAPH_MAX_NODES) {
        d->unreadable = true;
        return;
    }
    if (n == 0)
        return;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    size_t got = n;
    if (nodes == NULL || q->get_nodes(g, nodes, &got) != CUDA_SUCCESS) {
        free(nodes);
        d->unreadable = true;
        return;
    }
    if (got < n)
        n = got;
    for (size_t i = 0; i < n; i++) {
        CUgraphNodeType type;
        struct gnode e = {nodes[i], 0, parent, G_OTHER, 1};
        if (q->node_type(nodes[i], &type) != CUDA_SUCCESS) {
            d->unreadable = true;
            continue;
        }
        if (type == CU_GRAPH_NODE_TYPE_KERNEL) {
            CUDA_KERNEL_NODE_PARAMS_v2 kp;
            memset(&kp, 0, sizeof kp);
            if (q->kernel_params(nodes[i], &kp) != CUDA_SUCCESS) {
                d->unreadable = true;
                continue;
            }
            e.kind = G_KERNEL;
            e.cost = kernel_cost(&kp);
            if (!push(d, e))
                d->unreadable = true;
        } else if (type == CU_GRAPH_NODE_TYPE_GRAPH) {
            CUgraph child = NULL;
            e.kind = G_CHILD;
            if (q->child_graph(nodes[i], &child) != CUDA_SUCCESS || child == NULL ||
                !push(d, e)) {
                d->unreadable = true;
                continue;
            }
            walk(q, child, d, (int32_t)(d->n - 1), depth + 1);
        } else if (type == CU_GRAPH_NODE_TYPE_CONDITIONAL) {
            d->unreadable = true; /* its body runs a number of times only the device knows */
        }
    }
    free(nodes);
}

static struct gdetail *price_graph(CUgraph g, int rdev)
{
    struct gdetail *d = calloc(1, sizeof *d);
    if (d == NULL)
        return NULL;
    d->rdev = rdev;
    struct queries q;
    if (g == NULL || !load_queries(&q))
        d->unreadable = true;
    else
        walk(&q, g, d, -1, 0);
    return d;
}

static void free_detail(struct gdetail *d)
{
    if (d != NULL)
        free(d->v);
    free(d);
}

static uint64_t price_word(const struct gdetail *d)
{
    uint64_t sum = 0;
    for (size_t i = 0; i < d->n; i++)
        if (d->v[i].kind == G_KERNEL && d->v[i].enabled &&
            __builtin_add_overflow(sum, d->v[i].cost, &sum))
            sum = (uint64_t)VGPU_TOKEN_MAX;
    if (sum > (uint64_t)VGPU_TOKEN_MAX)
        sum = (uint64_t)VGPU_TOKEN_MAX;
    return sum | (d->unreadable ? PRICE_UNPRICED : 0);
}

/* ---------------------------------------------------------------- the unpriced counter */

uint64_t shim_graphs_unpriced_local(void)
{
    return __atomic_load_n(&g_unpriced_local, __ATOMIC_RELAXED);
}

static void count_unpriced(int rdev)
{
    __atomic_fetch_add(&g_unpriced_local, 1, __ATOMIC_RELAXED);
    if (rdev >= 0 && rdev < g_shim.device_count && g_shim.ext != NULL) /* 1.0 regions: none */
        __atomic_fetch_add(&g_shim.ext[rdev].graphs_unpriced, 1, __ATOMIC_RELAXED);
}

/* ---------------------------------------------------------------- the table */

/* Install d as exec's price (replacing what was there); takes ownership of d. */
static void install(CUgraphExec exec, struct gdetail *d)
{
    if ((uintptr_t)exec <= PTR_TOMBSTONE || d == NULL) {
        free_detail(d);
        return;
    }
    int rdev = d->rdev;
    bool unpriced = d->unreadable, was_unpriced = false, full = false;
    struct gdetail *old = NULL;
    pthread_mutex_lock(&g_graphs.lock);
    bool existed;
    struct ptr_slot *s = ptr_insert_locked(&g_graphs, (uintptr_t)exec, price_word(d), d, &existed);
    if (s == NULL) {
        full = true;
    } else if (existed) {
        old = s->aux;
        was_unpriced = old != NULL && old->unreadable;
        s->aux = d;
        __atomic_store_n(&s->value, price_word(d), __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_graphs.lock);
    if (full) {
        free_detail(d);
        unpriced = true;
    }
    free_detail(old);
    if (unpriced && !was_unpriced)
        count_unpriced(rdev);
}

/* Change exec's detail in place under the lock with `fn`; the price follows. */
typedef bool (*edit_fn)(struct gdetail *d, const void *arg);

static void edit(CUgraphExec exec, edit_fn fn, const void *arg)
{
    int rdev = -1;
    bool became_unpriced = false;
    pthread_mutex_lock(&g_graphs.lock);
    struct ptr_slot *s = ptr_find_locked(&g_graphs, (uintptr_t)exec);
    struct gdetail *d = s != NULL ? s->aux : NULL;
    if (d != NULL) {
        bool was = d->unreadable;
        if (!fn(d, arg))
            d->unreadable = true; /* an update the shim cannot place: price conservatively */
        became_unpriced = !was && d->unreadable;
        rdev = d->rdev;
        __atomic_store_n(&s->value, price_word(d), __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_graphs.lock);
    if (became_unpriced)
        count_unpriced(rdev);
}

static struct gnode *find_node(struct gdetail *d, CUgraphNode node, enum gkind kind)
{
    for (size_t i = 0; i < d->n; i++)
        if (d->v[i].node == node && d->v[i].kind == kind)
            return &d->v[i];
    return NULL;
}

static bool set_kernel(struct gdetail *d, const void *params)
{
    const struct {
        CUgraphNode node;
        uint64_t cost;
    } *a = params;
    struct gnode *e = find_node(d, a->node, G_KERNEL);
    if (e == NULL)
        return false;
    e->cost = a->cost;
    return true;
}

static bool set_enabled(struct gdetail *d, const void *params)
{
    const struct {
        CUgraphNode node;
        unsigned enabled;
    } *a = params;
    for (size_t i = 0; i < d->n; i++)
        if (d->v[i].node == a->node) {
            d->v[i].enabled = a->enabled != 0;
            return true;
        }
    return true; /* a copy or memset node: it costs nothing either way */
}

/* Replace the subtree of child-graph entry `node` with `fresh` (priced from the new child). */
static bool set_child(struct gdetail *d, const void *params)
{
    const struct {
        CUgraphNode node;
        const struct gdetail *fresh;
    } *a = params;
    size_t at = 0;
    for (; at < d->n; at++)
        if (d->v[at].node == a->node && d->v[at].kind == G_CHILD)
            break;
    if (at == d->n || a->fresh == NULL)
        return false;
    size_t end = at + 1; /* the subtree is contiguous: entries whose ancestry reaches `at` */
    while (end < d->n) {
        int32_t p = d->v[end].parent;
        while (p > (int32_t)at)
            p = d->v[p].parent;
        if (p != (int32_t)at)
            break;
        end++;
    }
    size_t old_len = end - (at + 1), new_len = a->fresh->n;
    size_t n = d->n - old_len + new_len;
    struct gnode *v = malloc((n ? n : 1) * sizeof *v);
    if (v == NULL)
        return false;
    memcpy(v, d->v, (at + 1) * sizeof *v);
    for (size_t i = 0; i < new_len; i++) {
        v[at + 1 + i] = a->fresh->v[i];
        int32_t p = a->fresh->v[i].parent;
        v[at + 1 + i].parent = p < 0 ? (int32_t)at : p + (int32_t)at + 1;
    }
    for (size_t i = end; i < d->n; i++) {
        struct gnode e = d->v[i];
        if (e.parent >= (int32_t)end)
            e.parent += (int32_t)new_len - (int32_t)old_len;
        v[i - old_len + new_len] = e;
    }
    free(d->v);
    d->v = v;
    d->n = d->cap = n;
    if (a->fresh->unreadable)
        d->unreadable = true;
    return true;
}

/* After cuGraphExecUpdate: the executable now has hGraph's parameters, node for node. The nodes
 * keep the handles of the graph it was instantiated from (later updates name those). */
static bool set_all(struct gdetail *d, const void *params)
{
    const struct gdetail *fresh = params;
    bool same_shape = fresh->n == d->n;
    for (size_t i = 0; same_shape && i < d->n; i++)
        same_shape = fresh->v[i].kind == d->v[i].kind && fresh->v[i].parent == d->v[i].parent;
    if (!same_shape) {
        /* a topology the shim pairs differently than the driver: take the new graph as is */
        struct gnode *v = malloc((fresh->n ? fresh->n : 1) * sizeof *v);
        if (v == NULL)
            return false;
        memcpy(v, fresh->v, fresh->n * sizeof *v);
        free(d->v);
        d->v = v;
        d->n = d->cap = fresh->n;
    } else {
        for (size_t i = 0; i < d->n; i++)
            d->v[i].cost = fresh->v[i].cost;
    }
    d->unreadable = fresh->unreadable;
    return true;
}

/* ---------------------------------------------------------------- used by the launch hooks */

bool shim_graph_price(CUgraphExec exec, uint64_t *cost)
{
    uint64_t word;
    if ((uintptr_t)exec <= PTR_TOMBSTONE) {
        word = PRICE_UNPRICED; /* not a handle: the driver refuses it; priced, not counted */
    } else if (!ptr_lookup(&g_graphs, (uintptr_t)exec, &word)) {
        /* instantiated where the shim did not see it: priced conservatively, counted once */
        struct gdetail *d = calloc(1, sizeof *d);
        if (d != NULL) {
            d->rdev = shim_region_dev_current();
            d->unreadable = true;
        }
        install(exec, d);
        word = PRICE_UNPRICED;
    }
    *cost = word & ~PRICE_UNPRICED;
    return (word & PRICE_UNPRICED) != 0;
}

bool shim_launch_in_capture(CUstream stream, bool per_thread)
{
    if (!__atomic_load_n(&g_capture_seen, __ATOMIC_RELAXED))
        return false;
    static void *cache;
    is_capturing_fn query = (is_capturing_fn)driver_fn(&cache, "cuStreamIsCapturing");
    if (query == NULL)
        return false;
    if (per_thread && stream == NULL)
        stream = CU_STREAM_PER_THREAD;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r = query(stream, &status);
    if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
        return true;
    return r == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* ---------------------------------------------------------------- hooks */

#define NEED_REAL(name)                                                                           \
    __typeof__(&name) real_ = REAL(name);                                                         \
    if (real_ == NULL)                                                                            \
    return CUDA_ERROR_NOT_INITIALIZED

static void priced_instantiate(CUresult r, CUgraphExec *exec, CUgraph graph)
{
    if (r != CUDA_SUCCESS || exec == NULL || shim_mode() != SHIM_ACTIVE)
        return;
    install(*exec, price_graph(graph, shim_region_dev_current()));
}

SHIM_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph,
                                        CUgraphNode *phErrorNode, char *logBuffer,
                                        size_t bufferSize)
{
    NEED_REAL(cuGraphInstantiate);
    CUresult r = real_(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
    priced_instantiate(r, phGraphExec, hGraph);
    return r;
}

SHIM_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
                                           CUgraphNode *phErrorNode, char *logBuffer,
                                           size_t bufferSize)
{
    NEED_REAL(cuGraphInstantiate_v2);
    CUresult r = real_(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
    priced_instantiate(r, phGraphExec, hGraph);
    return r;
}

SHIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                 unsigned long long flags)
{
    NEED_REAL(cuGraphInstantiateWithFlags);
    CUresult r = real_(phGraphExec, hGraph, flags);
    priced_instantiate(r, phGraphExec, hGraph);
    return r;
}

#define INSTANTIATE_PARAMS(name)                                                                  \
    SHIM_EXPORT CUresult name(CUgraphExec *phGraphExec, CUgraph hGraph,                          \
                              CUDA_GRAPH_INSTANTIATE_PARAMS *params)                              \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        CUresult r = real_(phGraphExec, hGraph, params);                                          \
        priced_instantiate(r, phGraphExec, hGraph);                                               \
        return r;                                                                                 \
    }
INSTANTIATE_PARAMS(cuGraphInstantiateWithParams)
INSTANTIATE_PARAMS(cuGraphInstantiateWithParams_ptsz)

SHIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    NEED_REAL(cuGraphExecDestroy);
    if ((uintptr_t)hGraphExec > PTR_TOMBSTONE) {
        /* before the driver frees it: the handle may be handed out again at once */
        pthread_mutex_lock(&g_graphs.lock);
        struct gdetail *d = ptr_remove_locked(&g_graphs, (uintptr_t)hGraphExec);
        pthread_mutex_unlock(&g_graphs.lock);
        free_detail(d);
    }
    return real_(hGraphExec);
}

static void after_update(CUresult r, CUgraphExec exec, CUgraph graph)
{
    if (r != CUDA_SUCCESS || shim_mode() != SHIM_ACTIVE)
        return;
    struct gdetail *fresh = price_graph(graph, -1);
    if (fresh == NULL)
        return;
    edit(exec, set_all, fresh);
    free_detail(fresh);
}

SHIM_EXPORT CUresult cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph,
                                       CUgraphNode *hErrorNode_out,
                                       CUgraphExecUpdateResult *updateResult_out)
{
    NEED_REAL(cuGraphExecUpdate);
    CUresult r = real_(hGraphExec, hGraph, hErrorNode_out, updateResult_out);
    after_update(r, hGraphExec, hGraph);
    return r;
}

SHIM_EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph,
                                          CUgraphExecUpdateResultInfo *resultInfo)
{
    NEED_REAL(cuGraphExecUpdate_v2);
    CUresult r = real_(hGraphExec, hGraph, resultInfo);
    after_update(r, hGraphExec, hGraph);
    return r;
}

static void after_kernel_set(CUresult r, CUgraphExec exec, CUgraphNode node, const void *params)
{
    if (r != CUDA_SUCCESS || params == NULL || shim_mode() != SHIM_ACTIVE)
        return;
    struct {
        CUgraphNode node;
        uint64_t cost;
    } a = {node, kernel_cost(params)};
    edit(exec, set_kernel, &a);
}

SHIM_EXPORT CUresult cuGraphExecKernelNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                    const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams)
{
    NEED_REAL(cuGraphExecKernelNodeSetParams);
    CUresult r = real_(hGraphExec, hNode, nodeParams);
    after_kernel_set(r, hGraphExec, hNode, nodeParams);
    return r;
}

SHIM_EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                       const CUDA_KERNEL_NODE_PARAMS_v2 *nodeParams)
{
    NEED_REAL(cuGraphExecKernelNodeSetParams_v2);
    CUresult r = real_(hGraphExec, hNode, nodeParams);
    after_kernel_set(r, hGraphExec, hNode, nodeParams);
    return r;
}

static void after_child_set(CUresult r, CUgraphExec exec, CUgraphNode node, CUgraph child)
{
    if (r != CUDA_SUCCESS || shim_mode() != SHIM_ACTIVE)
        return;
    struct gdetail *fresh = price_graph(child, -1);
    struct {
        CUgraphNode node;
        const struct gdetail *fresh;
    } a = {node, fresh};
    edit(exec, set_child, &a);
    free_detail(fresh);
}

SHIM_EXPORT CUresult cuGraphExecChildGraphNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                                        CUgraph childGraph)
{
    NEED_REAL(cuGraphExecChildGraphNodeSetParams);
    CUresult r = real_(hGraphExec, hNode, childGraph);
    after_child_set(r, hGraphExec, hNode, childGraph);
    return r;
}

SHIM_EXPORT CUresult cuGraphExecNodeSetParams(CUgraphExec hGraphExec, CUgraphNode hNode,
                                              CUgraphNodeParams *nodeParams)
{
    NEED_REAL(cuGraphExecNodeSetParams);
    CUresult r = real_(hGraphExec, hNode, nodeParams);
    if (r == CUDA_SUCCESS && nodeParams != NULL) {
        if (nodeParams->type == CU_GRAPH_NODE_TYPE_KERNEL)
            after_kernel_set(r, hGraphExec, hNode, &nodeParams->kernel);
        else if (nodeParams->type == CU_GRAPH_NODE_TYPE_GRAPH)
            after_child_set(r, hGraphExec, hNode, nodeParams->graph.graph);
    }
    return r;
}

SHIM_EXPORT CUresult cuGraphNodeSetEnabled(CUgraphExec hGraphExec, CUgraphNode hNode,
                                           unsigned int isEnabled)
{
    NEED_REAL(cuGraphNodeSetEnabled);
    CUresult r = real_(hGraphExec, hNode, isEnabled);
    if (r == CUDA_SUCCESS && shim_mode() == SHIM_ACTIVE) {
        struct {
            CUgraphNode node;
            unsigned enabled;
        } a = {hNode, isEnabled};
        edit(hGraphExec, set_enabled, &a);
    }
    return r;
}

/* Captures: only note that one began (before it does, so no launch misses it). */
static void capture_seen(void)
{
    __atomic_store_n(&g_capture_seen, 1, __ATOMIC_SEQ_CST);
}

#define BEGIN_CAPTURE_V1(name)                                                                    \
    SHIM_EXPORT CUresult name(CUstream hStream)                                                   \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        capture_seen();                                                                           \
        return real_(hStream);                                                                    \
    }
BEGIN_CAPTURE_V1(cuStreamBeginCapture)
BEGIN_CAPTURE_V1(cuStreamBeginCapture_ptsz)

#define BEGIN_CAPTURE_V2(name)                                                                    \
    SHIM_EXPORT CUresult name(CUstream hStream, CUstreamCaptureMode mode)                         \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        capture_seen();                                                                           \
        return real_(hStream, mode);                                                              \
    }
BEGIN_CAPTURE_V2(cuStreamBeginCapture_v2)
BEGIN_CAPTURE_V2(cuStreamBeginCapture_v2_ptsz)

#define BEGIN_CAPTURE_TO_GRAPH(name)                                                              \
    SHIM_EXPORT CUresult name(CUstream hStream, CUgraph hGraph, const CUgraphNode *deps,          \
                              const void *data, size_t n, CUstreamCaptureMode mode)               \
    {                                                                                             \
        NEED_REAL(name);                                                                          \
        capture_seen();                                                                           \
        return real_(hStream, hGraph, deps, data, n, mode);                                       \
    }
BEGIN_CAPTURE_TO_GRAPH(cuStreamBeginCaptureToGraph)
BEGIN_CAPTURE_TO_GRAPH(cuStreamBeginCaptureToGraph_ptsz)

/* fork: the child must not inherit a held table lock */
static void graphs_prepare(void)
{
    pthread_mutex_lock(&g_graphs.lock);
}

static void graphs_release(void)
{
    pthread_mutex_unlock(&g_graphs.lock);
}

__attribute__((constructor)) static void graphs_load(void)
{
    pthread_atfork(graphs_prepare, graphs_release, graphs_release);
}
