/*
 * ptrtable.h - a bounded table keyed by a driver handle (a pointer), for the launch path.
 *
 * Readers take no lock: open addressing with linear probing over a fixed array, the key stored
 * last (release) and read first (acquire), so a reader that finds the key sees its value.
 * Writers (instantiate, update, destroy: rare) hold the table's mutex. A removed key leaves a
 * tombstone that later inserts reuse, so the table never clogs beyond its capacity; when every
 * slot is taken an insert fails and the caller falls back to a conservative answer.
 */
#ifndef VGPU_PTRTABLE_H
#define VGPU_PTRTABLE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PTR_EMPTY ((uintptr_t)0)
#define PTR_TOMBSTONE ((uintptr_t)1)

struct ptr_slot {
    uintptr_t key;   /* atomic: PTR_EMPTY, PTR_TOMBSTONE or a handle */
    uint64_t value;  /* atomic */
    void *aux;       /* owned by the writer side, under the mutex */
};

struct ptr_table {
    struct ptr_slot *slots;
    size_t mask; /* capacity - 1, capacity a power of two */
    pthread_mutex_t lock;
};

static inline size_t ptr_hash(uintptr_t key, size_t mask)
{
    uint64_t h = (uint64_t)key * UINT64_C(0x9E3779B97F4A7C15);
    return (size_t)(h >> 32) & mask;
}

/* Lock-free: the value stored for key, or false when there is none. */
static inline bool ptr_lookup(const struct ptr_table *t, uintptr_t key, uint64_t *value)
{
    size_t i = ptr_hash(key, t->mask);
    for (size_t n = 0; n <= t->mask; n++, i = (i + 1) & t->mask) {
        uintptr_t k = __atomic_load_n(&t->slots[i].key, __ATOMIC_ACQUIRE);
        if (k == key) {
            *value = __atomic_load_n(&t->slots[i].value, __ATOMIC_ACQUIRE);
            return true;
        }
        if (k == PTR_EMPTY)
            return false;
    }
    return false;
}

/* Under the mutex: the slot holding key, or NULL. */
static inline struct ptr_slot *ptr_find_locked(struct ptr_table *t, uintptr_t key)
{
    size_t i = ptr_hash(key, t->mask);
    for (size_t n = 0; n <= t->mask; n++, i = (i + 1) & t->mask) {
        uintptr_t k = t->slots[i].key;
        if (k == key)
            return &t->slots[i];
        if (k == PTR_EMPTY)
            return NULL;
    }
    return NULL;
}

/* Under the mutex: the slot for key (existing, or claimed with `value` and `aux`), NULL when full. */
static inline struct ptr_slot *ptr_insert_locked(struct ptr_table *t, uintptr_t key, uint64_t value,
                                                 void *aux, bool *existed)
{
    struct ptr_slot *s = ptr_find_locked(t, key);
    *existed = s != NULL;
    if (s != NULL)
        return s;
    size_t i = ptr_hash(key, t->mask);
    for (size_t n = 0; n <= t->mask; n++, i = (i + 1) & t->mask) {
        uintptr_t k = t->slots[i].key;
        if (k == PTR_EMPTY || k == PTR_TOMBSTONE) {
            s = &t->slots[i];
            s->aux = aux;
            __atomic_store_n(&s->value, value, __ATOMIC_RELAXED);
            __atomic_store_n(&s->key, key, __ATOMIC_RELEASE);
            return s;
        }
    }
    return NULL;
}

/* Under the mutex: forget key; returns its aux (the caller frees it). */
static inline void *ptr_remove_locked(struct ptr_table *t, uintptr_t key)
{
    struct ptr_slot *s = ptr_find_locked(t, key);
    if (s == NULL)
        return NULL;
    void *aux = s->aux;
    s->aux = NULL;
    __atomic_store_n(&s->key, PTR_TOMBSTONE, __ATOMIC_RELEASE);
    return aux;
}

#endif /* VGPU_PTRTABLE_H */
