/*
 * shim.h - internals of libvgpu.so shared by its source files (nothing here is exported).
 */
#ifndef VGPU_SHIM_H
#define VGPU_SHIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_subset.h"
#include "nvml_subset.h"
#include "vgpu_shm.h"

#define SHIM_EXPORT __attribute__((visibility("default")))

/* Where the agent mounts the region's files in the container (its container_region_dir). A test
 * build points it elsewhere with -DVGPU_MOUNTED_REGION_DIR=... */
#ifndef VGPU_MOUNTED_REGION_DIR
#define VGPU_MOUNTED_REGION_DIR "/run/vgpu"
#endif

/* What the shim does, decided once per process at the first hooked call. */
enum shim_mode {
    SHIM_UNSET = 0,
    SHIM_ACTIVE,      /* region mapped: enforce and report */
    SHIM_PASSTHROUGH, /* no region at all and VGPU_FAIL_CLOSED=0: call the driver directly */
    SHIM_FAIL_CLOSED, /* no usable region (the default without one): refuse hooked calls */
    SHIM_DISABLED     /* VGPU_DISABLE=1, allowed by the region's control */
};

struct shim {
    const struct vgpu_control *ctl; /* read-only mapping */
    struct vgpu_state *st;          /* read-write shared mapping */
    /* st->ext when the state file has the 1.1 extension, else NULL (a 1.0 region: the features
     * kept there are off; st->slot_kinds is not mapped either) */
    struct vgpu_state_ext_device *ext;
    int device_count;
};

/* ---- region.c */
extern int g_shim_mode; /* enum shim_mode, atomic */
enum shim_mode shim_mode_init(void);
/* What the shim does in this process; decides (maps the region) on first use. */
static inline enum shim_mode shim_mode(void)
{
    int mode = __atomic_load_n(&g_shim_mode, __ATOMIC_ACQUIRE);
    return __builtin_expect(mode != SHIM_UNSET, 1) ? (enum shim_mode)mode : shim_mode_init();
}
extern struct shim g_shim;
struct vgpu_proc_slot *shim_slot(void); /* this process's slot, claimed lazily; may be NULL */
void shim_reclaim_dead_slots(void);
void shim_reclaim_dead_slots_now_and_then(void); /* at most every 100 ms per process */
void shim_after_fork_child(void);
uint64_t shim_now_ns(void);
uint64_t shim_coarse_now_ns(void); /* same clock, tick resolution, much cheaper */
void shim_warn_once(const char *what);

/* ---- device.c: map a CUDA device / NVML device to a region device index (-1: not governed) */
int shim_region_dev_for_cuda(CUdevice dev);
int shim_region_dev_current(void);
int shim_region_dev_for_uuid(const char *uuid);
void shim_format_uuid(const CUuuid *uuid, char out[48]);

/* ---- memory.c */
CUresult shim_mem_reserve(int rdev, uint64_t bytes);
void shim_mem_unreserve(int rdev, uint64_t bytes);
void shim_track_add(int kind, uint64_t key, int rdev, uint64_t bytes);
bool shim_track_take(int kind, uint64_t key, int *rdev, uint64_t *bytes);
void shim_track_reset(void);
void shim_track_lock(void);
void shim_track_unlock(void);
#define TRACK_PTR 1
#define TRACK_HANDLE 2

/* Memory by kind (ABI 1.1, see vgpu_shm.h): every kind counts in memory_used; the kinds other
 * than data are also counted in ext[d] and this process's slot_kinds, in VGPU_KIND_UNIT units. */
enum shim_kind { KIND_DATA = 0, KIND_CONTEXT, KIND_MODULE, KIND_POOL, KIND_SPILLED };
uint64_t shim_kind_bytes(int kind, uint64_t bytes); /* what a charge of `bytes` counts */
CUresult shim_mem_reserve_kind(int rdev, uint64_t bytes, int kind); /* bytes: shim_kind_bytes */
void shim_mem_unreserve_kind(int rdev, uint64_t bytes, int kind);
void shim_kinds_release_slot(int slot_index, int rdev); /* a slot given back: its kinds too */
void shim_mem_count_kind(int rdev, uint64_t bytes, int kind); /* held already: past the limit too */

/* A tracked record: what it counts, as what, and a word its kind needs. */
struct shim_tracked {
    int rdev;
    int mkind;
    uint64_t bytes;
    uint64_t aux;
};
void shim_track_put(int kind, uint64_t key, const struct shim_tracked *rec);
bool shim_track_get(int kind, uint64_t key, struct shim_tracked *out, bool remove);
int shim_track_each(int kind, uint64_t lo, uint64_t hi,
                    void (*fn)(uint64_t key, struct shim_tracked *rec, void *arg), void *arg);
#define TRACK_CONTEXT 3   /* key: CUcontext; bytes: its measured cost */
#define TRACK_LIMIT 4     /* key: CUcontext ^ limit; bytes: heap or stack charged for it */
#define TRACK_MODULE 5    /* key: CUmodule / CUlibrary; bytes: measured */
#define TRACK_VMM 6       /* key: handle; bytes; aux: references (low 32 bits), mappings (high) */
#define TRACK_MAPPING 7   /* key: mapped address; aux: the handle */
#define TRACK_ARRAY 8     /* key: CUarray / CUmipmappedArray */
#define TRACK_POOL_PTR 9  /* key: pointer from a pool; aux: the pool; counts nothing itself */

/* ---- spill.c: plain allocations the card cannot hold, served by managed memory */
bool shim_spill_enabled(int rdev); /* VGPU_CONTROL_FLAG_SPILL on the device (and a 1.1 state) */
/* After the driver refused `bytes` for lack of memory: serve them spilled. CUDA_SUCCESS with *dptr
 * set and everything counted, or CUDA_ERROR_OUT_OF_MEMORY with nothing counted. */
CUresult shim_spill_alloc(int rdev, CUdeviceptr *dptr, uint64_t bytes);
bool shim_spill_is_spilled(CUdeviceptr ptr); /* a pointer this process spilled */
void shim_spill_released(void);             /* a KIND_SPILLED record was given back */
void shim_spill_forget(void);               /* after fork: the child holds none */
#define SHIM_SPILL_MAX 65536                /* spilled allocations a process may hold at once */

/* ---- hooks_memory.c: what pools and graphs hold, settled against the driver's own counts */
void shim_pools_settle_all_if_free(void); /* skipped when the pool lock is busy */
void shim_graph_mem_settle(CUdevice dev); /* after graph instantiation or launch on dev */

/* ---- launch.c */
/* Spend `cost` tokens on the current device (or rdev), waiting for them if needed. With
 * `graph_floor` the cost is at least the device's graph_cost (an unpriced graph). */
CUresult shim_launch_gate(uint64_t cost, bool graph_floor);
CUresult shim_launch_gate_dev(int rdev, uint64_t cost, bool graph_floor);
void shim_flush_pending(void);  /* publish this thread's launch counts */
void shim_forget_pending(void); /* after fork: the child does not own the parent's counts */

/* ---- graphs.c */
bool shim_graph_price(CUgraphExec exec, uint64_t *cost); /* true: unpriced (use graph_floor) */
bool shim_launch_in_capture(CUstream stream, bool per_thread); /* records only: spend nothing */
extern int g_capture_seen; /* atomic: this process has begun a stream capture */
/* The launch path's check: one relaxed load until the process first begins a capture. */
static inline bool shim_capturing(CUstream stream, bool per_thread)
{
    return __builtin_expect(__atomic_load_n(&g_capture_seen, __ATOMIC_RELAXED) != 0, 0) &&
           shim_mode() == SHIM_ACTIVE && shim_launch_in_capture(stream, per_thread);
}
uint64_t shim_graphs_unpriced_local(void);

/* ---- interpose.c: real entry points, found through dlsym/cuGetProcAddress/RTLD_NEXT */
enum hook_id {
#define HOOK(name, base) HOOK_##name,
#include "hooks.def"
#undef HOOK
    HOOK_COUNT
};
extern void *g_real[HOOK_COUNT]; /* atomic pointers */
void *shim_real_resolve(enum hook_id id);
static inline void *shim_real(enum hook_id id)
{
    void *p = __atomic_load_n(&g_real[id], __ATOMIC_ACQUIRE);
    return __builtin_expect(p != NULL, 1) ? p : shim_real_resolve(id);
}
void *shim_real_by_name(const char *name, bool nvml); /* driver functions the shim calls, unhooked */

#define REAL(name) ((__typeof__(&name))shim_real(HOOK_##name))

#endif /* VGPU_SHIM_H */
