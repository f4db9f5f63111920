/*
 * bucket.h - the token-spending rule on plain numbers (no shared memory, no clock).
 *
 * The rule is specified in include/vgpu_shm.h; vgpu_agent/shm/layout.py implements the same rule
 * in Python (refill, admits, spend, wait_ns_for, launch_cost) and a test compares the two on the
 * same inputs through tests/rule_harness.c.
 */
#ifndef VGPU_BUCKET_H
#define VGPU_BUCKET_H

#include <stdbool.h>
#include <stdint.h>

#include "vgpu_shm.h"

#define VGPU_NS_PER_S UINT64_C(1000000000)
#define VGPU_TOKEN_MAX (INT64_C(1) << 62)

static inline int64_t vgpu_clamp_tokens(uint64_t v)
{
    return v > (uint64_t)VGPU_TOKEN_MAX ? VGPU_TOKEN_MAX : (int64_t)v;
}

/* New (balance, last_ns) after a lazy refill at now_ns. */
static inline void vgpu_refill(int64_t balance, uint64_t last_ns, uint64_t now_ns, uint64_t rate_in,
                               uint64_t burst_in, int64_t *out_balance, uint64_t *out_last)
{
    int64_t rate = vgpu_clamp_tokens(rate_in);
    int64_t burst = vgpu_clamp_tokens(burst_in);
    if (rate == 0) {
        *out_balance = balance < burst ? balance : burst;
        *out_last = now_ns > last_ns ? now_ns : last_ns;
        return;
    }
    if (now_ns <= last_ns) {
        *out_balance = balance < burst ? balance : burst;
        *out_last = last_ns;
        return;
    }
    uint64_t elapsed = now_ns - last_ns, product;
    unsigned __int128 add;
    if (!__builtin_mul_overflow(elapsed, (uint64_t)rate, &product))
        add = product / VGPU_NS_PER_S; /* the common case: a cheap division by a constant */
    else
        add = (unsigned __int128)elapsed * (uint64_t)rate / VGPU_NS_PER_S;
    if ((__int128)balance + (__int128)add >= (__int128)burst) {
        *out_balance = burst;
        *out_last = now_ns;
        return;
    }
    /* here add < burst - balance <= 2^63, so it fits */
    *out_balance = balance + (int64_t)add;
    *out_last = last_ns + (uint64_t)(add * VGPU_NS_PER_S / (uint64_t)rate);
}

static inline bool vgpu_admits(int64_t balance, uint64_t cost, uint64_t burst)
{
    int64_t c = vgpu_clamp_tokens(cost), b = vgpu_clamp_tokens(burst);
    return balance >= (c < b ? c : b);
}

/* balance - cost, floored at -VGPU_TOKEN_MAX (a debt never needs more range than that). */
static inline int64_t vgpu_spend(int64_t balance, uint64_t cost)
{
    int64_t after = balance - vgpu_clamp_tokens(cost);
    return after < -VGPU_TOKEN_MAX ? -VGPU_TOKEN_MAX : after;
}

/* ns until min(cost, burst) tokens are there at this rate, capped at VGPU_MAX_WAIT_NS. */
static inline uint64_t vgpu_wait_ns_for(int64_t balance, uint64_t cost, uint64_t rate_in,
                                        uint64_t burst)
{
    int64_t c = vgpu_clamp_tokens(cost), b = vgpu_clamp_tokens(burst);
    int64_t need = c < b ? c : b;
    if (balance >= need)
        return 0;
    int64_t rate = vgpu_clamp_tokens(rate_in);
    if (rate == 0)
        return VGPU_MAX_WAIT_NS;
    unsigned __int128 missing = (unsigned __int128)((__int128)need - balance);
    unsigned __int128 ns = (missing * VGPU_NS_PER_S + (uint64_t)rate - 1) / (uint64_t)rate;
    return ns > VGPU_MAX_WAIT_NS ? VGPU_MAX_WAIT_NS : (uint64_t)ns;
}

/* grid blocks x threads per block, clamped to VGPU_TOKEN_MAX. */
static inline uint64_t vgpu_launch_cost(unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                        unsigned by, unsigned bz)
{
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0)
        return 0;
    uint64_t blocks = (uint64_t)gx * gy, threads = (uint64_t)bx * by, c;
    if (__builtin_mul_overflow(blocks, (uint64_t)gz, &blocks) ||
        __builtin_mul_overflow(threads, (uint64_t)bz, &threads) ||
        __builtin_mul_overflow(blocks, threads, &c) || c > (uint64_t)VGPU_TOKEN_MAX)
        return (uint64_t)VGPU_TOKEN_MAX;
    return c;
}

static inline bool vgpu_unlimited(uint64_t policy, uint64_t core_limit, uint64_t rate,
                                  uint64_t burst)
{
    return policy == VGPU_POLICY_OFF || core_limit >= VGPU_CORE_LIMIT_FULL ||
           (rate == 0 && burst == 0);
}

#endif /* VGPU_BUCKET_H */
