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

static CUresult reserve(int rdev, uint64_t bytes, bool enforce)
{
    if (rdev < 0)
        return CUDA_SUCCESS;
    /* the slot first: claiming it gives back what this pid held before an exec */
    struct vgpu_proc_slot *slot = shim_slot();
    uint64_t limit = enforce ? __atomic_load_n(&g_shim.ctl->devices[rdev].memory_limit,
                                               __ATOMIC_RELAXED)
                             : 0;
    uint64_t *total = &g_shim.st->devices[rdev].memory_used;
    if (!try_add(total, bytes, limit)) {
        /* memory of processes that died without freeing still counts, and pools may have given
         * memory back since they were last looked at: settle both, retry */
        shim_reclaim_dead_slots();
        shim_pools_settle_all_if_free();
        if (!try_add(total, bytes, limit))
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (slot != NULL)
        __atomic_fetch_add(&slot->devices[rdev].memory_used, bytes, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

/* Check the limit and count `bytes` in one step; CUDA_ERROR_OUT_OF_MEMORY changes nothing. */
CUresult shim_mem_reserve(int rdev, uint64_t bytes)
{
    return reserve(rdev, bytes, true);
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

/* ---------------------------------------------------------------- memory by kind (ABI 1.1) */

uint64_t shim_kind_bytes(int kind, uint64_t bytes)
{
    if (kind == KIND_DATA || bytes == 0)
        return bytes;
    uint64_t units = bytes / VGPU_KIND_UNIT + (bytes % VGPU_KIND_UNIT != 0);
    return units * VGPU_KIND_UNIT;
}

static uint64_t *ext_word(int rdev, int kind)
{
    struct vgpu_state_ext_device *ext = &g_shim.ext[rdev];
    return kind == KIND_CONTEXT  ? &ext->memory_context
           : kind == KIND_MODULE ? &ext->memory_module
           : kind == KIND_POOL   ? &ext->memory_pool
                                 : &ext->memory_spilled;
}

static uint32_t *slot_kind_word(struct vgpu_proc_slot *slot, int rdev, int kind)
{
    struct vgpu_proc_kinds *k = &g_shim.st->slot_kinds[slot - g_shim.st->slots][rdev];
    return kind == KIND_CONTEXT  ? &k->context
           : kind == KIND_MODULE ? &k->module
           : kind == KIND_POOL   ? &k->pool
                                 : &k->spilled;
}

/* 32-bit saturating subtraction of units from a slot's kind word. */
static void saturating_sub32(uint32_t *word, uint32_t units)
{
    uint32_t cur = __atomic_load_n(word, __ATOMIC_RELAXED);
    uint32_t next;
    do {
        next = cur > units ? cur - units : 0;
    } while (!__atomic_compare_exchange_n(word, &cur, next, true, __ATOMIC_ACQ_REL,
                                          __ATOMIC_RELAXED));
}

static CUresult reserve_kind(int rdev, uint64_t bytes, int kind, bool enforce)
{
    CUresult rc = reserve(rdev, bytes, enforce);
    if (rc != CUDA_SUCCESS || rdev < 0 || kind == KIND_DATA || g_shim.ext == NULL || bytes == 0)
        return rc;
    __atomic_fetch_add(ext_word(rdev, kind), bytes, __ATOMIC_RELAXED);
    struct vgpu_proc_slot *slot = shim_slot();
    if (slot != NULL) {
        uint64_t units = bytes / VGPU_KIND_UNIT;
        __atomic_fetch_add(slot_kind_word(slot, rdev, kind),
                           units > UINT32_MAX ? UINT32_MAX : (uint32_t)units, __ATOMIC_RELAXED);
    }
    return rc;
}

CUresult shim_mem_reserve_kind(int rdev, uint64_t bytes, int kind)
{
    return reserve_kind(rdev, bytes, kind, true);
}

/* Memory the driver already holds (a pool grew, a graph reserved): counted even past the limit,
 * so that what follows is refused until it is given back. */
void shim_mem_count_kind(int rdev, uint64_t bytes, int kind)
{
    (void)reserve_kind(rdev, bytes, kind, false);
}

void shim_mem_unreserve_kind(int rdev, uint64_t bytes, int kind)
{
    if (rdev < 0 || bytes == 0)
        return;
    if (kind != KIND_DATA && g_shim.ext != NULL) {
        struct vgpu_proc_slot *slot = shim_slot();
        if (slot != NULL) {
            uint64_t units = bytes / VGPU_KIND_UNIT;
            saturating_sub32(slot_kind_word(slot, rdev, kind),
                             units > UINT32_MAX ? UINT32_MAX : (uint32_t)units);
        }
        saturating_sub(ext_word(rdev, kind), bytes);
    }
    shim_mem_unreserve(rdev, bytes);
}

void shim_kinds_release_slot(int slot_index, int rdev)
{
    if (g_shim.ext == NULL || slot_index < 0 || slot_index >= VGPU_MAX_PROCS)
        return;
    struct vgpu_proc_kinds *k = &g_shim.st->slot_kinds[slot_index][rdev];
    static const int kinds[] = {KIND_CONTEXT, KIND_MODULE, KIND_POOL, KIND_SPILLED};
    uint32_t *words[] = {&k->context, &k->module, &k->pool, &k->spilled};
    for (int i = 0; i < 4; i++) {
        uint64_t units = __atomic_exchange_n(words[i], 0, __ATOMIC_ACQ_REL);
        if (units != 0)
            saturating_sub(ext_word(rdev, kinds[i]), units * VGPU_KIND_UNIT);
    }
}

/* ---------------------------------------------------------------- this process's allocations */

struct track {
    struct track *next;
    uint64_t key;
    uint64_t bytes;
    uint64_t aux; /* what the record's kind needs besides the bytes */
    int kind;
    int rdev;
    int mkind; /* enum shim_kind the bytes are counted as */
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
    struct shim_tracked rec = {rdev, KIND_DATA, bytes, 0};
    shim_track_put(kind, key, &rec);
}

/* Records come from slabs kept on a free list (under g_track_lock), never given back to malloc:
 * an allocation or free costs no malloc/free, and a child forked while another thread was inside
 * the allocator (whose locks not every allocator takes across fork) finds records ready. */
#define SLAB 256
static struct track *g_free_tracks;

/* A record from the free list, refilled with a new slab when empty; called with the lock held,
 * returns with it held. NULL when no memory is left. */
static struct track *track_new_locked(void)
{
    if (g_free_tracks == NULL) {
        pthread_mutex_unlock(&g_track_lock);
        struct track *slab = calloc(SLAB, sizeof *slab);
        pthread_mutex_lock(&g_track_lock);
        if (slab == NULL)
            return NULL;
        for (int i = 0; i < SLAB; i++) {
            slab[i].next = g_free_tracks;
            g_free_tracks = &slab[i];
        }
    }
    struct track *t = g_free_tracks;
    g_free_tracks = t->next;
    return t;
}

void shim_track_put(int kind, uint64_t key, const struct shim_tracked *rec)
{
    if (rec->rdev < 0)
        return;
    pthread_mutex_lock(&g_track_lock);
    struct track *t = track_new_locked();
    if (t == NULL) {
        pthread_mutex_unlock(&g_track_lock);
        /* cannot remember it: the bytes would never be given back, so do not count them */
        shim_mem_unreserve_kind(rec->rdev, rec->bytes, rec->mkind);
        return;
    }
    t->key = key;
    t->bytes = rec->bytes;
    t->aux = rec->aux;
    t->kind = kind;
    t->rdev = rec->rdev;
    t->mkind = rec->mkind;
    unsigned b = bucket_of(kind, key);
    t->next = g_buckets[b];
    g_buckets[b] = t;
    pthread_mutex_unlock(&g_track_lock);
}

bool shim_track_take(int kind, uint64_t key, int *rdev, uint64_t *bytes)
{
    struct shim_tracked rec;
    if (!shim_track_get(kind, key, &rec, true))
        return false;
    *rdev = rec.rdev;
    *bytes = rec.bytes;
    return true;
}

bool shim_track_get(int kind, uint64_t key, struct shim_tracked *out, bool remove)
{
    unsigned b = bucket_of(kind, key);
    struct track *found = NULL;
    pthread_mutex_lock(&g_track_lock);
    for (struct track **p = &g_buckets[b]; *p != NULL; p = &(*p)->next) {
        if ((*p)->kind == kind && (*p)->key == key) {
            found = *p;
            *out = (struct shim_tracked){found->rdev, found->mkind, found->bytes, found->aux};
            if (remove) {
                *p = found->next;
                found->next = g_free_tracks;
                g_free_tracks = found;
            }
            break;
        }
    }
    pthread_mutex_unlock(&g_track_lock);
    return found != NULL;
}

/* Every record of `kind` whose key is in [lo, hi) is handed to `fn` (under the lock: fn must not
 * call back into tracking). Returns how many there were. */
int shim_track_each(int kind, uint64_t lo, uint64_t hi,
                    void (*fn)(uint64_t key, struct shim_tracked *rec, void *arg), void *arg)
{
    int n = 0;
    pthread_mutex_lock(&g_track_lock);
    for (int b = 0; b < BUCKETS; b++)
        for (struct track *t = g_buckets[b]; t != NULL; t = t->next)
            if (t->kind == kind && t->key >= lo && t->key < hi) {
                struct shim_tracked rec = {t->rdev, t->mkind, t->bytes, t->aux};
                fn(t->key, &rec, arg);
                t->bytes = rec.bytes;
                t->aux = rec.aux;
                n++;
            }
    pthread_mutex_unlock(&g_track_lock);
    return n;
}

void shim_track_reset(void)
{
    for (int b = 0; b < BUCKETS; b++) {
        struct track *t = g_buckets[b];
        g_buckets[b] = NULL;
        while (t != NULL) {
            struct track *next = t->next;
            t->next = g_free_tracks;
            g_free_tracks = t;
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
