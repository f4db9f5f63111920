/*
 * region.c - finding and mapping the allocation's region, process slots, fork handling.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

struct shim g_shim;

int g_shim_mode;                   /* enum shim_mode, atomic */
static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static struct vgpu_proc_slot *g_slot; /* atomic pointer */
static int g_slot_tried;           /* atomic: a claim was attempted in this process */
static int g_warned;               /* atomic */

uint64_t shim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

uint64_t shim_coarse_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

void shim_warn_once(const char *what)
{
    if (__atomic_exchange_n(&g_warned, 1, __ATOMIC_RELAXED))
        return;
    char msg[512];
    int n = snprintf(msg, sizeof msg, "libvgpu: %s\n", what);
    if (n > 0) {
        ssize_t ignored = write(STDERR_FILENO, msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
        (void)ignored;
    }
}

static bool env_is_one(const char *name)
{
    const char *v = getenv(name);
    return v != NULL && strcmp(v, "1") == 0;
}

/* Map `path` if it is at least `size` bytes; NULL with a reason otherwise (*missing set when
 * there is no such file). */
static void *map_file(const char *path, size_t size, bool writable, char *why, size_t why_len,
                      bool *missing)
{
    int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) {
        if (missing != NULL)
            *missing = errno == ENOENT || errno == ENOTDIR;
        snprintf(why, why_len, "cannot open %.512s (%s)", path, strerror(errno));
        return NULL;
    }
    struct stat sb;
    void *p = NULL;
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_size < size) {
        snprintf(why, why_len, "%.512s is %lld bytes, expected at least %zu", path,
                 (long long)sb.st_size, size);
    } else {
        p = mmap(NULL, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            snprintf(why, why_len, "cannot map %.512s (%s)", path, strerror(errno));
            p = NULL;
        }
    }
    close(fd);
    return p;
}

static void region_close(void)
{
    if (g_shim.ctl != NULL)
        munmap((void *)g_shim.ctl, sizeof *g_shim.ctl);
    if (g_shim.st != NULL) /* as much as was mapped: the 1.1 extension only when present */
        munmap(g_shim.st, g_shim.ext != NULL ? sizeof *g_shim.st : VGPU_STATE_SIZE_1_0);
    g_shim.ctl = NULL;
    g_shim.st = NULL;
    g_shim.ext = NULL;
    g_shim.device_count = 0;
}

/* Map the region in `dir`; *missing tells "no control file there" from "there but unusable". */
static bool region_open(const char *dir, char *why, size_t why_len, bool *missing)
{
    char path[4096];
    *missing = false;
    snprintf(path, sizeof path, "%s/control", dir);
    const struct vgpu_control *ctl = map_file(path, sizeof *ctl, false, why, why_len, missing);
    if (ctl == NULL)
        return false;
    if (ctl->magic != VGPU_CONTROL_MAGIC || ctl->abi_major != VGPU_ABI_MAJOR ||
        ctl->header_size != offsetof(struct vgpu_control, device_ids) ||
        ctl->total_size != sizeof *ctl || ctl->device_count == 0 ||
        ctl->device_count > VGPU_MAX_DEVICES) {
        snprintf(why, why_len,
                 "%.512s is not a region control file this shim understands (magic %#llx, ABI %u.%u, "
                 "%u devices; expected magic %#llx, ABI %u.x, 1..%d devices)",
                 path, (unsigned long long)ctl->magic, ctl->abi_major, ctl->abi_minor,
                 ctl->device_count, (unsigned long long)VGPU_CONTROL_MAGIC, VGPU_ABI_MAJOR,
                 VGPU_MAX_DEVICES);
        munmap((void *)ctl, sizeof *ctl);
        return false;
    }
    snprintf(path, sizeof path, "%s/state", dir);
    /* the 1.0 part first; the 1.1 extension is mapped only when the file says it has it */
    size_t st_size = VGPU_STATE_SIZE_1_0;
    struct vgpu_state *st = map_file(path, st_size, true, why, why_len, NULL);
    if (st == NULL) {
        munmap((void *)ctl, sizeof *ctl);
        return false;
    }
    bool has_ext = st->abi_minor >= 1 && st->total_size >= sizeof *st;
    bool size_ok = has_ext || (st->abi_minor == 0 && st->total_size == VGPU_STATE_SIZE_1_0);
    if (st->magic != VGPU_STATE_MAGIC || st->abi_major != VGPU_ABI_MAJOR ||
        st->header_size != offsetof(struct vgpu_state, slots) || !size_ok ||
        st->slot_count != VGPU_MAX_PROCS || st->device_count != ctl->device_count) {
        snprintf(why, why_len,
                 "%.512s is not a region state file this shim understands (magic %#llx, ABI %u.%u, "
                 "%llu bytes, %u slots, %u devices; expected %d slots and %u devices)",
                 path, (unsigned long long)st->magic, st->abi_major, st->abi_minor,
                 (unsigned long long)st->total_size, st->slot_count, st->device_count,
                 VGPU_MAX_PROCS, ctl->device_count);
        munmap((void *)ctl, sizeof *ctl);
        munmap(st, st_size);
        return false;
    }
    if (has_ext) {
        munmap(st, st_size);
        st_size = sizeof *st;
        st = map_file(path, st_size, true, why, why_len, NULL); /* fails when shorter */
        if (st == NULL) {
            munmap((void *)ctl, sizeof *ctl);
            return false;
        }
    }
    g_shim.ctl = ctl;
    g_shim.st = st;
    g_shim.ext = has_ext ? st->ext : NULL;
    g_shim.device_count = (int)ctl->device_count;
    return true;
}

/* The policy word of the mapped control: zero (all secure) for a 1.0 control. */
static uint64_t control_flags(void)
{
    return g_shim.ctl->abi_minor >= 1 ? g_shim.ctl->flags : 0;
}

/*
 * The region and the container's overrides, decided once:
 *  - the mounted region (VGPU_MOUNTED_REGION_DIR) is opened first; VGPU_REGION_DIR naming another
 *    directory is followed only when that control allows it (VGPU_CONTROL_ALLOW_REGION_DIR), or
 *    when nothing is mounted at the default place (an agent configured to mount elsewhere);
 *  - VGPU_DISABLE=1 is honoured only when the region's control allows it;
 *  - no usable region: fail closed. Only when no region exists at all (no control file where
 *    one is looked for) does VGPU_FAIL_CLOSED=0 let calls through: a region that is there but
 *    damaged always fails closed, since the container can damage its own `state`.
 */
static enum shim_mode decide(void)
{
    char why[1024] = "", note[1200] = "";
    bool missing = false;
    const char *env_dir = getenv("VGPU_REGION_DIR");
    bool other = env_dir != NULL && env_dir[0] != '\0' && strcmp(env_dir, VGPU_MOUNTED_REGION_DIR) != 0;
    bool ok = region_open(VGPU_MOUNTED_REGION_DIR, why, sizeof why, &missing);
    if (ok && other) {
        if (control_flags() & VGPU_CONTROL_ALLOW_REGION_DIR) {
            region_close();
            ok = region_open(env_dir, why, sizeof why, &missing);
        } else {
            snprintf(note, sizeof note, "VGPU_REGION_DIR=%.512s ignored: the agent's control does "
                     "not allow another region directory", env_dir);
        }
    } else if (!ok && missing && other) {
        ok = region_open(env_dir, why, sizeof why, &missing);
    }
    if (ok && env_is_one("VGPU_DISABLE")) {
        if (control_flags() & VGPU_CONTROL_ALLOW_DISABLE) {
            region_close();
            return SHIM_DISABLED;
        }
        snprintf(note, sizeof note, "VGPU_DISABLE=1 ignored: the agent's control does not allow it");
    }
    if (ok) {
        if (note[0] != '\0')
            shim_warn_once(note);
        return SHIM_ACTIVE;
    }
    const char *fc = getenv("VGPU_FAIL_CLOSED");
    bool pass = missing && fc != NULL && strcmp(fc, "0") == 0;
    char msg[2048];
    snprintf(msg, sizeof msg, "%s; %s", why,
             pass ? "no region: passing through without limits (VGPU_FAIL_CLOSED=0)"
                  : missing ? "refusing CUDA allocations and launches (no region; VGPU_FAIL_CLOSED=0 "
                              "passes through instead)"
                            : "refusing CUDA allocations and launches (the region is unusable)");
    shim_warn_once(msg);
    return pass ? SHIM_PASSTHROUGH : SHIM_FAIL_CLOSED;
}

enum shim_mode shim_mode_init(void)
{
    int mode;
    pthread_mutex_lock(&g_init_lock);
    mode = __atomic_load_n(&g_shim_mode, __ATOMIC_RELAXED);
    if (mode == SHIM_UNSET) {
        mode = decide();
        __atomic_store_n(&g_shim_mode, mode, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_init_lock);
    return (enum shim_mode)mode;
}

/* ---------------------------------------------------------------- process identity */

/* Field 22 of /proc/<pid>/stat (start time in clock ticks), 0 when unreadable. */
static uint64_t proc_start_time(long pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may contain spaces and parentheses */
    if (p == NULL)
        return 0;
    /* after ") " comes field 3; skip to field 22 */
    int field = 2;
    for (p++; *p != '\0' && field < 22; p++)
        if (*p == ' ')
            field++;
    return strtoull(p, NULL, 10);
}

/* The pid in the outermost pid namespace /proc shows, when that is not our own namespace. */
static uint64_t host_pid(void)
{
    char buf[4096];
    int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *line = strstr(buf, "\nNSpid:");
    if (line == NULL)
        return 0;
    char *end;
    unsigned long long first = strtoull(line + 7, &end, 10);
    /* a second number means we are in a nested namespace and the first is the outer pid */
    char *q = end;
    while (*q == ' ' || *q == '\t')
        q++;
    if (*q < '0' || *q > '9')
        return 0;
    return first;
}

static bool slot_owner_alive(uint64_t pid, uint64_t start_time)
{
    if (pid == 0 || pid >= (UINT64_C(1) << 22))
        return false;
    if ((pid_t)pid == getpid())
        return true;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
        return false;
    uint64_t now_start = proc_start_time((long)pid);
    /* a live pid with another start time is a new process that reused the pid */
    return !(start_time != 0 && now_start != 0 && now_start != start_time);
}

/* Give a dead process's memory back. Idempotent: each counter is taken with an exchange. */
static void reclaim_slot(struct vgpu_proc_slot *slot, uint64_t expected_pid)
{
    uint64_t marker = VGPU_PID_RECLAIMING | (uint64_t)getpid();
    if (!__atomic_compare_exchange_n(&slot->pid, &expected_pid, marker, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_RELAXED))
        return;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t bytes = __atomic_exchange_n(&slot->devices[d].memory_used, 0, __ATOMIC_ACQ_REL);
        if (bytes != 0 && d < g_shim.device_count) {
            uint64_t *total = &g_shim.st->devices[d].memory_used;
            uint64_t cur = __atomic_load_n(total, __ATOMIC_RELAXED);
            uint64_t next;
            do { /* never wrap below zero, whatever the file says */
                next = cur > bytes ? cur - bytes : 0;
            } while (!__atomic_compare_exchange_n(total, &cur, next, true, __ATOMIC_ACQ_REL,
                                                  __ATOMIC_RELAXED));
        }
        if (d < g_shim.device_count)
            shim_kinds_release_slot((int)(slot - g_shim.st->slots), d);
        /* the device totals already hold this process's counts: they are cumulative */
        __atomic_store_n(&slot->devices[d].launches, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&slot->devices[d].tokens_spent, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&slot->devices[d].wait_ns, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&slot->devices[d].last_launch_ns, 0, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&slot->host_pid, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->start_time, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->pid, 0, __ATOMIC_RELEASE);
}

void shim_reclaim_dead_slots(void)
{
    if (g_shim.st == NULL)
        return;
    for (int i = 0; i < VGPU_MAX_PROCS; i++) {
        struct vgpu_proc_slot *slot = &g_shim.st->slots[i];
        uint64_t pid = __atomic_load_n(&slot->pid, __ATOMIC_ACQUIRE);
        if (pid == 0)
            continue;
        if (pid & VGPU_PID_RECLAIMING) {
            /* a reclaimer that died half-way: finish its work */
            uint64_t reclaimer = pid & ~VGPU_PID_RECLAIMING;
            if (!slot_owner_alive(reclaimer, 0))
                reclaim_slot(slot, pid);
            continue;
        }
        uint64_t start = __atomic_load_n(&slot->start_time, __ATOMIC_RELAXED);
        if (!slot_owner_alive(pid, start))
            reclaim_slot(slot, pid);
    }
}

/* Reclaiming reads /proc for every live slot: callers that may call often (cuMemGetInfo) do it at
 * most every 100 ms; a refused allocation always does it. */
void shim_reclaim_dead_slots_now_and_then(void)
{
    static uint64_t last; /* atomic */
    uint64_t now = shim_coarse_now_ns(), prev = __atomic_load_n(&last, __ATOMIC_RELAXED);
    if (prev != 0 && now - prev < UINT64_C(100000000))
        return;
    if (__atomic_compare_exchange_n(&last, &prev, now, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        shim_reclaim_dead_slots();
}

/* Atomic max: the mark only grows, whatever order processes claim in. Called before the claim's
 * CAS on the pid, so a reader that sees the slot in use also sees a mark above it. */
static void raise_slot_high_water(uint64_t at_least)
{
    uint64_t *mark = &g_shim.st->slot_high_water;
    uint64_t cur = __atomic_load_n(mark, __ATOMIC_RELAXED);
    while (cur < at_least && !__atomic_compare_exchange_n(mark, &cur, at_least, true,
                                                          __ATOMIC_RELEASE, __ATOMIC_RELAXED))
        ;
}

static struct vgpu_proc_slot *claim_slot(void)
{
    uint64_t me = (uint64_t)getpid();
    /* a slot with our own pid is from this process before it called exec: that image and its
     * device memory are gone (claiming happens once per image) */
    for (int i = 0; i < VGPU_MAX_PROCS; i++)
        if (__atomic_load_n(&g_shim.st->slots[i].pid, __ATOMIC_ACQUIRE) == me)
            reclaim_slot(&g_shim.st->slots[i], me);
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < VGPU_MAX_PROCS; i++) {
            struct vgpu_proc_slot *slot = &g_shim.st->slots[i];
            uint64_t expected = 0;
            if (__atomic_load_n(&slot->pid, __ATOMIC_RELAXED) != 0)
                continue;
            raise_slot_high_water((uint64_t)i + 1);
            if (__atomic_compare_exchange_n(&slot->pid, &expected, me, false, __ATOMIC_ACQ_REL,
                                            __ATOMIC_RELAXED)) {
                __atomic_store_n(&slot->start_time, proc_start_time((long)me), __ATOMIC_RELAXED);
                __atomic_store_n(&slot->host_pid, host_pid(), __ATOMIC_RELEASE);
                return slot;
            }
        }
        shim_reclaim_dead_slots();
    }
    return NULL;
}

struct vgpu_proc_slot *shim_slot(void)
{
    struct vgpu_proc_slot *slot = __atomic_load_n(&g_slot, __ATOMIC_ACQUIRE);
    if (slot != NULL || __atomic_load_n(&g_slot_tried, __ATOMIC_ACQUIRE))
        return slot;
    pthread_mutex_lock(&g_init_lock);
    if (!__atomic_load_n(&g_slot_tried, __ATOMIC_RELAXED)) {
        slot = claim_slot();
        if (slot == NULL)
            shim_warn_once("all process slots of the region are taken; this process is limited "
                           "but not reported");
        __atomic_store_n(&g_slot, slot, __ATOMIC_RELEASE);
        __atomic_store_n(&g_slot_tried, 1, __ATOMIC_RELEASE);
    }
    slot = __atomic_load_n(&g_slot, __ATOMIC_ACQUIRE);
    pthread_mutex_unlock(&g_init_lock);
    return slot;
}

/* ---------------------------------------------------------------- fork and exit */

static void atfork_prepare(void)
{
    pthread_mutex_lock(&g_init_lock);
    shim_track_lock();
}

static void atfork_parent(void)
{
    shim_track_unlock();
    pthread_mutex_unlock(&g_init_lock);
}

static void atfork_child(void)
{
    /* the child shares the mappings but is another process: it gets its own slot, and it does
     * not own the parent's device memory */
    shim_track_unlock();
    shim_track_reset();
    shim_spill_forget();
    shim_forget_pending();
    __atomic_store_n(&g_slot, NULL, __ATOMIC_RELAXED);
    __atomic_store_n(&g_slot_tried, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&g_init_lock);
}

__attribute__((constructor)) static void shim_load(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* A process that exits normally hands its slot (and the memory it still held) back at once;
 * one that is killed is reclaimed later by the others. */
__attribute__((destructor)) static void shim_unload(void)
{
    shim_flush_pending(); /* the exiting thread's counts; other threads' last tick is lost */
    struct vgpu_proc_slot *slot = __atomic_load_n(&g_slot, __ATOMIC_ACQUIRE);
    if (slot != NULL && __atomic_load_n(&slot->pid, __ATOMIC_RELAXED) == (uint64_t)getpid()) {
        __atomic_store_n(&g_slot, NULL, __ATOMIC_RELEASE);
        reclaim_slot(slot, (uint64_t)getpid());
    }
}
