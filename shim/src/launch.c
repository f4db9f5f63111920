/*
 * launch.c - spending tokens from the device's shared bucket at each kernel or graph launch.
 *
 * The arithmetic is bucket.h's; here it is applied to the shared state with compare-and-swap:
 * the elapsed time is claimed by CAS on last_refill_ns (so it is credited exactly once, whoever
 * wins), the tokens are added and spent by CAS on balance. Waiting is done in bounded sleeps.
 *
 * The first attempt of a launch reads CLOCK_MONOTONIC_COARSE (the same clock at tick resolution,
 * several times cheaper than a precise read): the rule holds for whatever times refills are made
 * at, and a coarse time older than the last refill simply adds nothing. Only a launch that finds
 * too few tokens reads the precise clock, refills and, if still short, sleeps.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <time.h>

#include "bucket.h"
#include "shim.h"

struct params {
    uint64_t policy, core_limit, rate, burst, graph_cost;
};

static void read_params(int rdev, struct params *p)
{
    const struct vgpu_control_device *c = &g_shim.ctl->devices[rdev];
    p->policy = __atomic_load_n(&c->policy, __ATOMIC_RELAXED);
    p->core_limit = __atomic_load_n(&c->core_limit, __ATOMIC_RELAXED);
    p->rate = __atomic_load_n(&c->rate, __ATOMIC_RELAXED);
    p->burst = __atomic_load_n(&c->burst, __ATOMIC_RELAXED);
    p->graph_cost = __atomic_load_n(&c->graph_cost, __ATOMIC_RELAXED);
}

static void refill_shared(struct vgpu_state_device *sd, uint64_t now, const struct params *p)
{
    uint64_t last = __atomic_load_n(&sd->last_refill_ns, __ATOMIC_ACQUIRE);
    int64_t balance = __atomic_load_n(&sd->balance, __ATOMIC_RELAXED);
    if (now <= last && (uint64_t)balance <= p->burst && balance >= 0)
        return; /* nothing to add, nothing to clamp: the common case within one clock tick */
    if (last == 0)
        now = shim_now_ns(); /* the first fill starts the bucket's clock: not a tick early */
    int64_t next_balance;
    uint64_t next_last;
    vgpu_refill(balance, last, now, p->rate, p->burst, &next_balance, &next_last);
    if (next_last != last &&
        !__atomic_compare_exchange_n(&sd->last_refill_ns, &last, next_last, false,
                                     __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return; /* another launch claimed this time span and credits it */
    int64_t add = next_balance > balance ? next_balance - balance : 0;
    int64_t burst = vgpu_clamp_tokens(p->burst);
    int64_t cur = __atomic_load_n(&sd->balance, __ATOMIC_RELAXED);
    for (;;) {
        int64_t want;
        if (__builtin_add_overflow(cur, add, &want) || want > burst)
            want = burst;
        if (want == cur)
            return;
        if (__atomic_compare_exchange_n(&sd->balance, &cur, want, true, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            return;
    }
}

static void sleep_ns(uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* One try without waiting: refill at `now`, spend if admitted. */
static bool try_take(struct vgpu_state_device *sd, uint64_t cost, const struct params *p,
                     uint64_t now)
{
    refill_shared(sd, now, p);
    int64_t balance = __atomic_load_n(&sd->balance, __ATOMIC_RELAXED);
    while (vgpu_admits(balance, cost, p->burst)) {
        if (__atomic_compare_exchange_n(&sd->balance, &balance, vgpu_spend(balance, cost), true,
                                        __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return true;
    }
    return false;
}

/* Take `cost` tokens, waiting for them if needed; returns the ns waited. */
static uint64_t graph_floor_cost(uint64_t cost, const struct params *p)
{
    uint64_t floor = p->graph_cost != 0 ? p->graph_cost : VGPU_DEFAULT_GRAPH_COST;
    return cost > floor ? cost : floor;
}

/*
 * Turns (ABI 1.1 regions). Launches that have to wait are served in arrival order across the
 * processes of the container: a waiting launch takes a ticket (fetch-add on ext.ticket_next) and
 * only the launch whose ticket is ext.ticket_serving may take tokens; it advances ticket_serving
 * once it has spent them. A launch that finds anyone waiting (ticket_next != ticket_serving) does
 * not take tokens ahead of them, so a large launch is admitted when its turn comes even while small
 * launches keep arriving. The fast path (nobody waiting, tokens there) reads the two words and
 * writes nothing. Waiting for a turn is done in sleeps of 50 us doubling to 1 ms. A launch whose
 * turn has not come after VGPU_MAX_WAIT_NS takes it (ticket_serving := its ticket): a holder that
 * died, was stopped or is stuck is skipped that way, and launches skipped over go on without order.
 * A 1.0 region has no ticket words: launches wait without order, as before.
 */
#define TURN_SLEEP_MIN_NS UINT64_C(50000)
#define TURN_SLEEP_MAX_NS UINT64_C(1000000)

static bool nobody_waits(const struct vgpu_state_ext_device *ext)
{
    return ext == NULL || __atomic_load_n(&ext->ticket_next, __ATOMIC_ACQUIRE) ==
                              __atomic_load_n(&ext->ticket_serving, __ATOMIC_ACQUIRE);
}

/* Wait until `ticket` is served; false when it was skipped (go on without order). */
static bool wait_turn(struct vgpu_state_ext_device *ext, uint64_t ticket, uint64_t *now,
                      uint64_t *waited)
{
    uint64_t sleep = TURN_SLEEP_MIN_NS;
    uint64_t last = __atomic_load_n(&ext->ticket_serving, __ATOMIC_ACQUIRE);
    for (;;) {
        uint64_t serving = __atomic_load_n(&ext->ticket_serving, __ATOMIC_ACQUIRE);
        if (serving == ticket)
            return true;
        if ((int64_t)(serving - ticket) > 0)
            return false; /* skipped by a launch that waited too long */
        if (serving != last) {
            last = serving;
            sleep = TURN_SLEEP_MIN_NS;
        }
        if (*waited >= VGPU_MAX_WAIT_NS) {
            /* those ahead took too long (dead, stopped, or a damaged word): take the turn */
            if (__atomic_compare_exchange_n(&ext->ticket_serving, &serving, ticket, false,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                return true;
            continue;
        }
        sleep_ns(sleep);
        sleep = sleep * 2 > TURN_SLEEP_MAX_NS ? TURN_SLEEP_MAX_NS : sleep * 2;
        uint64_t after = shim_now_ns();
        *waited += after - *now;
        *now = after;
    }
}

static void pass_turn(struct vgpu_state_ext_device *ext, uint64_t ticket)
{
    uint64_t expected = ticket;
    __atomic_compare_exchange_n(&ext->ticket_serving, &expected, ticket + 1, false,
                                __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
}

static uint64_t take_ticket(struct vgpu_state_ext_device *ext)
{
    /* a serving word past next can only be damage: start the queue again from next */
    uint64_t next = __atomic_load_n(&ext->ticket_next, __ATOMIC_ACQUIRE);
    uint64_t serving = __atomic_load_n(&ext->ticket_serving, __ATOMIC_ACQUIRE);
    if ((int64_t)(serving - next) > 0)
        __atomic_compare_exchange_n(&ext->ticket_serving, &serving, next, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED);
    return __atomic_fetch_add(&ext->ticket_next, 1, __ATOMIC_ACQ_REL);
}

/* The slow path: tokens short, or others waiting. */
__attribute__((noinline, cold)) static uint64_t wait_for_tokens(int rdev, uint64_t cost, bool graph,
                                                                struct params *p, uint64_t *now)
{
    struct vgpu_state_device *sd = &g_shim.st->devices[rdev];
    struct vgpu_state_ext_device *ext = g_shim.ext != NULL ? &g_shim.ext[rdev] : NULL;
    *now = shim_now_ns();
    uint64_t waited = 0, ticket = 0;
    bool turn = false;
    if (ext != NULL) {
        ticket = take_ticket(ext);
        turn = wait_turn(ext, ticket, now, &waited);
    }
    uint64_t known = cost;
    for (;;) {
        if (graph)
            cost = graph_floor_cost(known, p);
        refill_shared(sd, *now, p);
        int64_t balance = __atomic_load_n(&sd->balance, __ATOMIC_RELAXED);
        if (vgpu_admits(balance, cost, p->burst) || waited >= VGPU_MAX_WAIT_NS) {
            if (__atomic_compare_exchange_n(&sd->balance, &balance, vgpu_spend(balance, cost),
                                            false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                break;
            continue; /* another process spent meanwhile: look again */
        }
        uint64_t wait = vgpu_wait_ns_for(balance, cost, p->rate, p->burst);
        if (wait > VGPU_MAX_SLEEP_NS)
            wait = VGPU_MAX_SLEEP_NS;
        if (wait > VGPU_MAX_WAIT_NS - waited)
            wait = VGPU_MAX_WAIT_NS - waited;
        sleep_ns(wait == 0 ? 1000 : wait);
        uint64_t after = shim_now_ns();
        waited += after - *now;
        *now = after;
        read_params(rdev, p); /* the agent may have changed the rate meanwhile */
        if (vgpu_unlimited(p->policy, p->core_limit, p->rate, p->burst))
            break;
    }
    if (turn)
        pass_turn(ext, ticket);
    return waited;
}

/* Take `cost` tokens, waiting for them if needed; returns the ns waited. */
static inline uint64_t take_tokens(int rdev, uint64_t cost, bool graph, struct params *p,
                                   uint64_t *now)
{
    struct vgpu_state_ext_device *ext = g_shim.ext != NULL ? &g_shim.ext[rdev] : NULL;
    if (__builtin_expect(nobody_waits(ext) && try_take(&g_shim.st->devices[rdev], cost, p, *now), 1))
        return 0;
    return wait_for_tokens(rdev, cost, graph, p, now);
}

/*
 * Reporting. A thread adds its launches up locally and publishes them, to its process's slot and
 * to the device totals, with atomics once per clock tick (coarse clock, a few ms), when it
 * switches device, when it waits, and when it exits; so the counters lag by at most the launches
 * of the current tick of each thread, and the launch path itself touches no shared counter.
 */
struct pending {
    int rdev; /* -1: nothing pending */
    uint64_t tick, launches, tokens;
};
static __thread struct pending t_pending __attribute__((tls_model("initial-exec"))) = {-1, 0, 0, 0};
static pthread_key_t g_exit_key;
static pthread_once_t g_exit_once = PTHREAD_ONCE_INIT;
static __thread bool t_registered __attribute__((tls_model("initial-exec")));

void shim_flush_pending(void)
{
    struct pending *p = &t_pending;
    if (p->rdev < 0)
        return;
    struct vgpu_proc_slot *slot = shim_slot();
    if (slot != NULL) {
        struct vgpu_proc_device *pd = &slot->devices[p->rdev];
        __atomic_fetch_add(&pd->launches, p->launches, __ATOMIC_RELAXED);
        __atomic_fetch_add(&pd->tokens_spent, p->tokens, __ATOMIC_RELAXED);
        __atomic_store_n(&pd->last_launch_ns, p->tick, __ATOMIC_RELAXED);
    }
    struct vgpu_state_device *sd = &g_shim.st->devices[p->rdev];
    __atomic_fetch_add(&sd->launches, p->launches, __ATOMIC_RELAXED);
    __atomic_fetch_add(&sd->tokens_spent, p->tokens, __ATOMIC_RELAXED);
    p->rdev = -1;
    p->launches = p->tokens = 0;
}

void shim_forget_pending(void)
{
    t_pending.rdev = -1;
    t_pending.launches = t_pending.tokens = 0;
}

static void flush_at_thread_exit(void *unused)
{
    (void)unused;
    shim_flush_pending();
}

static void make_exit_key(void)
{
    pthread_key_create(&g_exit_key, flush_at_thread_exit);
}

static void count_launch(int rdev, uint64_t cost, uint64_t waited, uint64_t now)
{
    struct pending *p = &t_pending;
    if (__builtin_expect(p->rdev == rdev && p->tick == now && waited == 0, 1)) {
        p->launches++;
        p->tokens += cost;
        return;
    }
    shim_flush_pending();
    if (!t_registered) {
        t_registered = true;
        pthread_once(&g_exit_once, make_exit_key);
        pthread_setspecific(g_exit_key, (void *)1);
    }
    p->rdev = rdev;
    p->tick = now;
    p->launches = 1;
    p->tokens = cost;
    if (waited != 0) {
        /* a thread that waited publishes at once: it is being throttled right now */
        struct vgpu_proc_slot *slot = shim_slot();
        if (slot != NULL)
            __atomic_fetch_add(&slot->devices[rdev].wait_ns, waited, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g_shim.st->devices[rdev].wait_ns, waited, __ATOMIC_RELAXED);
        shim_flush_pending();
    }
}

static inline CUresult gate(int rdev, uint64_t cost, bool graph)
{
    if (rdev < 0)
        return CUDA_SUCCESS;
    struct params p;
    read_params(rdev, &p);
    uint64_t now = shim_coarse_now_ns();
    uint64_t waited = 0;
    if (graph)
        cost = graph_floor_cost(cost, &p);
    if (!vgpu_unlimited(p.policy, p.core_limit, p.rate, p.burst))
        waited = take_tokens(rdev, cost, graph, &p, &now);
    count_launch(rdev, cost, waited, now);
    return CUDA_SUCCESS;
}

CUresult shim_launch_gate(uint64_t cost, bool graph)
{
    enum shim_mode mode = shim_mode();
    if (mode != SHIM_ACTIVE)
        return mode == SHIM_FAIL_CLOSED ? CUDA_ERROR_NOT_INITIALIZED : CUDA_SUCCESS;
    return gate(shim_region_dev_current(), cost, graph);
}

CUresult shim_launch_gate_dev(int rdev, uint64_t cost, bool graph)
{
    enum shim_mode mode = shim_mode();
    if (mode != SHIM_ACTIVE)
        return mode == SHIM_FAIL_CLOSED ? CUDA_ERROR_NOT_INITIALIZED : CUDA_SUCCESS;
    return gate(rdev, cost, graph);
}
