/*
 * memory.c - per-device memory accounting in the shared state, and this process's record of
 * which pointer or handle holds how many bytes on which device (to give them back at free).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>

#include "shim.h"

/* ---------------------------------------------------------------- shared accounting */

static bool try_add(uint64_t *total, uint64_t bytes, uint64_t limit)
{
    uint64_t cur = __atomic_load_n(total, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t next = cur + bytes;
        if (next < cur || (limit != 0 && next > limit))
            return false;
        if (__atomic_compare_exchange_n(total, &cur, next, true, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            return true;
    }
}

static void saturating_sub(uint64_t *total, uint64_t bytes)
{
    uint64_t cur = __atomic_load_n(total, __ATOMIC_RELAXED);
    uint64_t next;
    do {
        next = cur > bytes ? cur - bytes : 0;
    } while (!__atomic_compare_exchange_n(total, &cur, next, true, __ATOMIC_ACQ_REL,
                                          __ATOMIC_RELAXED));
}

/* Check the limit and count `bytes` in one step; CUDA_ERROR_OUT_OF_MEMORY changes nothing. */
CUresult shim_mem_reserve(int rdev, uint64_t bytes)
{
    if (rdev < 0)
        return CUDA_SUCCESS;
    /* the slot first: claiming it gives back what this pid held before an exec */
    struct vgpu_proc_slot *slot = shim_slot();
    uint64_t limit = __atomic_load_n(&g_shim.ctl->devices[rdev].memory_limit, __ATOMIC_RELAXED);
    uint64_t *total = &g_shim.st->devices[rdev].memory_used;
    if (!try_add(total, bytes, limit)) {
        /* memory of processes that died without freeing still counts: give it back, retry */
        shim_reclaim_dead_slots();
        if (!try_add(total, bytes, limit))
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (slot != NULL)
        __atomic_fetch_add(&slot->devices[rdev].memory_used, bytes, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

void shim_mem_unreserve(int rdev, uint64_t bytes)
{
    if (rdev < 0 || bytes == 0)
        return;
    saturating_sub(&g_shim.st->devices[rdev].memory_used, bytes);
    struct vgpu_proc_slot *slot = shim_slot();
    if (slot != NULL)
        saturating_sub(&slot->devices[rdev].memory_used, bytes);
}

/* ---------------------------------------------------------------- this process's allocations */

struct track {
    struct track *next;
    uint64_t key;
    uint64_t bytes;
    int kind;
    int rdev;
};

#define BUCKETS 4096
static struct track *g_buckets[BUCKETS];
static pthread_mutex_t g_track_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned bucket_of(int kind, uint64_t key)
{
    uint64_t h = (key ^ (uint64_t)kind) * UINT64_C(0x9E3779B97F4A7C15);
    return (unsigned)(h >> 52) % BUCKETS;
}

void shim_track_add(int kind, uint64_t key, int rdev, uint64_t bytes)
{
    if (rdev < 0)
        return;
    struct track *t = malloc(sizeof *t);
    if (t == NULL) {
        /* cannot remember it: the bytes would never be given back, so do not count them */
        shim_mem_unreserve(rdev, bytes);
        return;
    }
    t->key = key;
    t->bytes = bytes;
    t->kind = kind;
    t->rdev = rdev;
    unsigned b = bucket_of(kind, key);
    pthread_mutex_lock(&g_track_lock);
    t->next = g_buckets[b];
    g_buckets[b] = t;
    pthread_mutex_unlock(&g_track_lock);
}

bool shim_track_take(int kind, uint64_t key, int *rdev, uint64_t *bytes)
{
    unsigned b = bucket_of(kind, key);
    struct track *found = NULL;
    pthread_mutex_lock(&g_track_lock);
    for (struct track **p = &g_buckets[b]; *p != NULL; p = &(*p)->next) {
        if ((*p)->kind == kind && (*p)->key == key) {
            found = *p;
            *p = found->next;
            break;
        }
    }
    pthread_mutex_unlock(&g_track_lock);
    if (found == NULL)
        return false;
    *rdev = found->rdev;
    *bytes = found->bytes;
    free(found);
    return true;
}

void shim_track_reset(void)
{
    for (int b = 0; b < BUCKETS; b++) {
        struct track *t = g_buckets[b];
        g_buckets[b] = NULL;
        while (t != NULL) {
            struct track *next = t->next;
            free(t);
            t = next;
        }
    }
}

void shim_track_lock(void)
{
    pthread_mutex_lock(&g_track_lock);
}

void shim_track_unlock(void)
{
    pthread_mutex_unlock(&g_track_lock);
}
