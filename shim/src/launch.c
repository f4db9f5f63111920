/*
 * launch.c - spending tokens from the device's shared bucket at each kernel or graph launch.
 *
 * The arithmetic is bucket.h's; here it is applied to the shared state with compare-and-swap:
 * the elapsed time is claimed by CAS on last_refill_ns (so it is credited exactly once, whoever
 * wins), the tokens are added and spent by CAS on balance. Waiting is done in bounded sleeps.
 */
#define _GNU_SOURCE
#include <errno.h>
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

/* Take `cost` tokens, waiting for them if needed; returns the ns waited. */
static uint64_t take_tokens(int rdev, uint64_t cost, bool graph, struct params *p, uint64_t *now)
{
    struct vgpu_state_device *sd = &g_shim.st->devices[rdev];
    uint64_t waited = 0;
    for (;;) {
        if (graph)
            cost = p->graph_cost != 0 ? p->graph_cost : VGPU_DEFAULT_GRAPH_COST;
        refill_shared(sd, *now, p);
        int64_t balance = __atomic_load_n(&sd->balance, __ATOMIC_RELAXED);
        if (vgpu_admits(balance, cost, p->burst) || waited >= VGPU_MAX_WAIT_NS) {
            if (__atomic_compare_exchange_n(&sd->balance, &balance, vgpu_spend(balance, cost),
                                            false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                return waited;
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
            return waited;
    }
}

CUresult shim_launch_gate(uint64_t cost, bool graph)
{
    enum shim_mode mode = shim_mode();
    if (mode != SHIM_ACTIVE)
        return mode == SHIM_FAIL_CLOSED ? CUDA_ERROR_NOT_INITIALIZED : CUDA_SUCCESS;
    int rdev = shim_region_dev_current();
    if (rdev < 0)
        return CUDA_SUCCESS;
    struct params p;
    read_params(rdev, &p);
    uint64_t now = shim_now_ns();
    uint64_t waited = 0;
    if (graph)
        cost = p.graph_cost != 0 ? p.graph_cost : VGPU_DEFAULT_GRAPH_COST;
    if (!vgpu_unlimited(p.policy, p.core_limit, p.rate, p.burst))
        waited = take_tokens(rdev, cost, graph, &p, &now);
    struct vgpu_state_device *sd = &g_shim.st->devices[rdev];
    __atomic_fetch_add(&sd->launches, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&sd->tokens_spent, cost, __ATOMIC_RELAXED);
    if (waited != 0)
        __atomic_fetch_add(&sd->wait_ns, waited, __ATOMIC_RELAXED);
    struct vgpu_proc_slot *slot = shim_slot();
    if (slot != NULL) {
        struct vgpu_proc_device *pd = &slot->devices[rdev];
        __atomic_fetch_add(&pd->launches, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&pd->tokens_spent, cost, __ATOMIC_RELAXED);
        if (waited != 0)
            __atomic_fetch_add(&pd->wait_ns, waited, __ATOMIC_RELAXED);
        __atomic_store_n(&pd->last_launch_ns, now, __ATOMIC_RELAXED);
    }
    return CUDA_SUCCESS;
}
