/*
 * vgpu_shm.h - the region ABI shared by the node agent and libvgpu.so.
 *
 * This header is the single source of truth for the two files of one allocation's region.
 * The Python mirror (vgpu_agent/shm/layout.py) is checked against it by a test that compiles
 * a program printing every offsetof/sizeof below.
 *
 * Location. Per allocation the agent creates, on the host, <state_dir>/regions/<alloc_id>/
 * holding `control` and `state`. Inside the container each file is mounted on its own at
 * /run/vgpu/<name> (`control` read-only, `state` read-write); the shim finds them there
 * (VGPU_MOUNTED_REGION_DIR), or through VGPU_REGION_DIR where the agent's control allows it or
 * nothing is mounted at the default place (see control.flags).
 *
 *   control  written only by the agent (file mode 0444; the shim maps it PROT_READ and never
 *            writes it): limits, token-bucket parameters, policy, heartbeat, identity.
 *   state    created by the agent (header filled in, everything else zero); afterwards written
 *            only by the shim with C11 atomics; the agent only reads it and never trusts it.
 *
 * Versioning. Every file starts with magic, ABI major/minor, header size and total size.
 * A reader refuses another magic or major version. Minor versions add fields in space that is
 * reserved (zero) in older minors, or append them after the end of the older layout, so offsets
 * below never move within a major.
 *
 * ABI 1.1 appends an extension to `state` (after slots[]): per-device words (struct
 * vgpu_state_ext_device: memory by kind, graph pricing, launch tickets) and per-slot memory by
 * kind (struct vgpu_proc_kinds, whose spilled word counts what the process spilled). `control`
 * keeps its size in 1.1 and gains one flag bit (VGPU_CONTROL_FLAG_SPILL, below); a shim that
 * does not know it ignores it and does not spill. Readers of `state`:
 *   - a 1.1 reader (agent or shim) accepts abi_minor 0 with total_size == VGPU_STATE_SIZE_1_0
 *     (no extension: the features it carries are off and its fields read as zero), and
 *     abi_minor >= 1 with total_size >= sizeof(struct vgpu_state) (a later minor may append more;
 *     a reader uses what it knows and maps/reads no further than sizeof(struct vgpu_state));
 *   - a 1.0 reader (shims and agents deployed before 1.1) requires total_size == its own
 *     sizeof and so refuses a 1.1 `state`: a 1.0 shim says "is not a region state file this shim
 *     understands" and passes through without limits (or refuses with VGPU_FAIL_CLOSED=1). This
 *     is the one-time cost of 1.1: containers started by a 1.1 agent need a 1.1 shim. A 1.1 agent
 *     keeps adopting, steering and reading the 1.0 regions an older agent created, and a 1.1 shim
 *     works on them (without the extension). A 1.0 agent (after a downgrade) adopts 1.1 regions
 *     (control did not change) and reads the 1.0 part of their state, counting the total size it
 *     does not know as one skipped record per read.
 *
 * Integers are little-endian, every field is naturally aligned. All timestamps are
 * CLOCK_MONOTONIC nanoseconds (Python: time.monotonic_ns()), the same clock for every
 * container on the host.
 *
 * Updates to control (no read-modify-write by the agent). The agent stores naturally aligned
 * 64-bit values only, framed by the generation counter like a seqlock: generation is made odd,
 * the fields are stored, generation is made even again. A reader that needs several fields to be
 * mutually consistent reads generation before and after (equal and even = consistent). The shim
 * reads the few fields a launch needs (policy, core limit, rate, burst) directly at every launch,
 * so a change is seen at the next launch; a torn (rate, burst) pair lasts one launch at most and is
 * harmless. The heartbeat is a single store, outside the generation protocol.
 *
 * Token bucket (the spending rule; vgpu_agent/shm/layout.py implements the same rule in Python,
 * `refill`, `admits`, `spend`, `wait_ns_for`, and a test runs both on the same inputs):
 *   - a kernel launch costs gridX*gridY*gridZ * blockX*blockY*blockZ tokens (threads);
 *     a graph launch costs the sum of its kernel nodes' costs (child graphs included); a graph
 *     the shim cannot price costs max(what it could read, the device's `graph_cost`, which is
 *     VGPU_DEFAULT_GRAPH_COST when 0) and is counted in ext[d].graphs_unpriced (1.1); a launch
 *     into a stream that is being captured runs nothing and costs nothing;
 *   - refill(balance, last, now, rate, burst): elapsed = now - last (nothing when now <= last or
 *     rate == 0, except clamping to burst); add = floor(elapsed * rate / 1e9); if add >= burst the
 *     bucket is full: balance = burst, last = now; otherwise balance = min(burst, balance + add) and
 *     last advances only by the time those whole tokens took, floor(add * 1e9 / rate), so fractions
 *     of a token carry over to the next refill instead of being lost;
 *   - a launch of cost c is admitted when balance >= min(c, burst); it then subtracts c. So the
 *     balance is negative only after a launch that costs more than the burst: that launch runs when
 *     the bucket is full and leaves a debt that refill pays back, which keeps the long-run rate
 *     exact for kernels of any size;
 *   - when not admitted the launch waits wait_ns_for = ceil((min(c, burst) - balance) * 1e9 / rate)
 *     in bounded sleeps (at most VGPU_MAX_SLEEP_NS each, re-reading the rate between them), and at
 *     most VGPU_MAX_WAIT_NS in total: after that it is admitted anyway and its cost is still
 *     subtracted (so rate == 0 cannot hang a process forever; it slows it to one launch per
 *     VGPU_MAX_WAIT_NS);
 *   - the shim samples `now` for a launch's first try with CLOCK_MONOTONIC_COARSE (same clock, tick
 *     resolution) and reads the precise clock only when tokens are short; the rule is the same
 *     for any sampling (a time not after last_refill_ns adds nothing), so only when refills happen
 *     differs, never how much they credit;
 *   - balance and last_refill_ns live in `state` and are shared by all processes of the container;
 *     the shim claims elapsed time by compare-and-swap on last_refill_ns and adds the tokens with a
 *     CAS loop on balance, so every nanosecond of refill is credited exactly once.
 *   - turns (1.1): a launch that is not admitted at once takes a ticket (atomic fetch-add on
 *     ext[d].ticket_next) and spends only when ext[d].ticket_serving equals its ticket, then sets
 *     ticket_serving to ticket + 1 (CAS); a launch spends at once only when ticket_next ==
 *     ticket_serving (nobody waits). A launch that has waited VGPU_MAX_WAIT_NS for its turn takes
 *     it (CAS ticket_serving to its ticket): tickets of holders that died are skipped that way, and
 *     a launch that finds ticket_serving past its ticket goes on without order. A serving word
 *     ahead of ticket_next is damage and is set back to ticket_next. 1.0 files have no turns;
 *   The bucket is unlimited (nothing is spent) when the policy is VGPU_POLICY_OFF, or the core
 *   limit is >= VGPU_CORE_LIMIT_FULL, or burst == 0 and rate == 0 (never configured).
 *
 * Memory accounting: state.devices[d].memory_used is the container's total (all processes),
 * changed only by CAS (allocation: check limit and add in one step) and atomic subtraction;
 * slots[i].devices[d].memory_used is one process's share. Slots of dead processes are reclaimed by
 * the shim (their memory stops counting). memory_limit == 0 means no memory limit.
 *
 * Memory by kind (1.1): memory_used stays the total of every kind, and the limit is checked
 * against it alone. ext[d] additionally says how much of the total is
 *   memory_context  what the driver holds for contexts (creation, primary-context retain, the
 *                   device malloc heap and stack limits), measured through the driver's own
 *                   memory info;
 *   memory_module   modules and libraries loaded (cuModuleLoad*, cuLibraryLoad*);
 *   memory_pool     what stream-ordered pools hold (their reserved memory, not what was asked
 *                   for) and graph memory nodes;
 *   memory_spilled  plain allocations served by managed (host-backed) memory because the card
 *                   was full (VGPU_CONTROL_FLAG_SPILL); each counted rounded up to
 *                   VGPU_KIND_UNIT, in memory_used as well (it is data, in the limit);
 * and data (plain allocations, VMM, arrays, spilled included) is memory_used - context - module
 * - pool, read as 0
 * when the difference is negative (the words are updated one after the other, not together).
 * The total is counted first (its CAS checks the limit) and the kind after it, and given back
 * in the reverse order, so a reader may briefly see such bytes as data. Each kind is counted in units of
 * VGPU_KIND_UNIT bytes (the shim rounds such charges up), so that slot_kinds[i][d] can hold a
 * process's share in 32 bits: a reclaimer subtracts a dead slot's kinds from ext[d] exactly.
 *
 * Counters: a launch is counted in its process's slot and in the device totals. A thread
 * publishes its counts once per clock tick (CLOCK_MONOTONIC_COARSE, a few ms), when it switches
 * device, waits or exits, so counters lag by at most one tick of launches per thread (a thread
 * that stops launching publishes its last tick at its next launch or its exit);
 * last_launch_ns has tick resolution. A slot given back has its counters zeroed; the device
 * totals keep counting what ended processes did.
 *
 * Process slots: VGPU_MAX_PROCS (1024) per region, enough for containers with many worker
 * processes; the state file stays under 1 MiB. A slot is free when pid == 0; a process claims it by
 * CAS 0 -> pid. pid is the pid inside the container; host_pid is the pid in the host's pid namespace
 * when the shim could learn it (NSpid in /proc/self/status), else 0. start_time is the process
 * start time in clock ticks since boot (field 22 of /proc/<pid>/stat), to tell a reused pid apart.
 * A slot being reclaimed holds VGPU_PID_RECLAIMING | reclaimer_pid in pid for a moment.
 *
 * Slot high-water mark: state.slot_high_water is above every slot index ever claimed, so slots
 * [slot_high_water, VGPU_MAX_PROCS) have never been used and readers skip them
 * (the agent reads every region's usage several times a second; most regions use a few slots of
 * 1024). A process raises it to at least i+1 with an atomic max (CAS loop) *before* its CAS on
 * slots[i].pid, so a slot in use is always below the mark; reclaiming a slot never lowers it.
 * Slots below the mark may be free (pid == 0). The agent creates the file with 0 and treats a
 * value above slot_count as damage (it reads slot_count slots at most).
 */
#ifndef VGPU_SHM_H
#define VGPU_SHM_H

#include <stddef.h>
#include <stdint.h>

#define VGPU_CONTROL_MAGIC UINT64_C(0x314C52544E435056) /* "VPCNTRL1" little-endian */
#define VGPU_STATE_MAGIC UINT64_C(0x3145544154535056)   /* "VPSTATE1" little-endian */
#define VGPU_ABI_MAJOR 1u
#define VGPU_ABI_MINOR 1u

#define VGPU_MAX_DEVICES 16        /* physical GPUs per allocation */
#define VGPU_MAX_DEVICE_IDS 64     /* kubelet device IDs per allocation */
#define VGPU_DEVICE_ID_LEN 64      /* "GPU-<uuid>::<n>", NUL-terminated, up to 63 chars */
#define VGPU_UUID_LEN 96           /* "GPU-xxxxxxxx-...", or a MIG UUID; NUL-terminated */
#define VGPU_MAX_PROCS 1024        /* process slots per region */

/* Policy per device (control_device.policy). */
#define VGPU_POLICY_OFF 0u
#define VGPU_POLICY_STRICT 1u
#define VGPU_POLICY_WORK_CONSERVING 2u

/* core_limit unit: parts per million of the GPU's SM time; 1,000,000 = 100%. */
#define VGPU_CORE_LIMIT_FULL UINT64_C(1000000)

/* control_device.flags: none are defined in 1.0; readers ignore bits they do not know (so a shim
 * that predates a bit behaves as if it were clear).
 * 1.1: VGPU_CONTROL_FLAG_SPILL - the agent lets this device's limit exceed the card (memory
 * scaling above 1) and wants what the card cannot hold spilled to host memory: a plain
 * allocation (cuMemAlloc) that fits the limit but that the driver refuses with
 * CUDA_ERROR_OUT_OF_MEMORY is served with managed memory (cuMemAllocManaged, attached globally,
 * preferred location the device) and counted in memory_used and in ext[d].memory_spilled. VMM
 * (cuMemCreate), pitched allocations, arrays and stream-ordered pools never spill, and IPC
 * handles of spilled memory are refused (CUDA_ERROR_INVALID_VALUE, as the driver refuses them
 * for managed memory). With the bit set, cuMemGetInfo reports total = the limit and
 * free = limit - used (the card's physical free memory no longer bounds it). A shim without
 * the bit (1.0, or 1.1 before spilling) does not spill: such allocations fail as before. */
#define VGPU_CONTROL_FLAG_SPILL (UINT64_C(1) << 0)
/*
 * control.flags (ABI 1.1; the word was reserved, so zero, in 1.0): what the agent lets the
 * container change about its own enforcement. All bits clear is the secure setting, the default,
 * and what a 1.0 control holds; a shim reads the word as zero when abi_minor < 1. A 1.0 shim
 * ignores the word: it honours VGPU_DISABLE and VGPU_REGION_DIR as it always did.
 *   VGPU_CONTROL_ALLOW_DISABLE     VGPU_DISABLE=1 in the container is honoured (else ignored,
 *                                  with one warning);
 *   VGPU_CONTROL_ALLOW_REGION_DIR  a VGPU_REGION_DIR other than the mounted region's directory
 *                                  (VGPU_MOUNTED_REGION_DIR) is honoured.
 */
#define VGPU_CONTROL_ALLOW_DISABLE UINT64_C(1)
#define VGPU_CONTROL_ALLOW_REGION_DIR UINT64_C(2)

/* A graph launch's cost when control_device.graph_cost is 0: 4096 blocks x 256 threads. */
#define VGPU_DEFAULT_GRAPH_COST UINT64_C(1048576)

/* Waiting for tokens: each sleep is at most this long, and one launch waits at most this long. */
#define VGPU_MAX_SLEEP_NS UINT64_C(10000000)    /* 10 ms */
#define VGPU_MAX_WAIT_NS UINT64_C(2000000000)   /* 2 s */

/* Memory of the kinds context, module and pool is counted in whole units of this many bytes. */
#define VGPU_KIND_UNIT UINT64_C(4096)

/* Marker in a slot's pid while a dead process's slot is being reclaimed. */
#define VGPU_PID_RECLAIMING (UINT64_C(1) << 63)

/* ------------------------------------------------------------------ control */

struct vgpu_control_device {
    char uuid[VGPU_UUID_LEN];   /* physical GPU UUID as NVML/CUDA print it, NUL-terminated */
    uint64_t memory_limit;      /* bytes; 0 = no limit */
    uint64_t core_limit;        /* parts per million of SM time (VGPU_CORE_LIMIT_FULL = 100%) */
    uint64_t rate;              /* token refill rate, tokens per second */
    uint64_t burst;             /* bucket capacity, tokens */
    uint64_t policy;            /* VGPU_POLICY_* */
    uint64_t flags;             /* VGPU_CONTROL_FLAG_* */
    uint64_t graph_cost;        /* least tokens per launch of a graph the shim cannot price;
                                   0 = VGPU_DEFAULT_GRAPH_COST */
    uint64_t reserved[5];
};

struct vgpu_control {
    uint64_t magic;             /* VGPU_CONTROL_MAGIC */
    uint32_t abi_major;
    uint32_t abi_minor;
    uint32_t header_size;       /* offsetof(struct vgpu_control, device_ids) */
    uint32_t device_count;      /* 0..VGPU_MAX_DEVICES valid entries in devices[] */
    uint64_t total_size;        /* sizeof(struct vgpu_control) */
    uint64_t generation;        /* even = stable; odd while the agent is storing */
    uint64_t heartbeat_ns;      /* agent's last write (CLOCK_MONOTONIC) */
    uint64_t created_ns;        /* when the allocation was made (CLOCK_MONOTONIC) */
    uint64_t seq;               /* creation sequence number: later allocations are larger */
    int64_t priority;           /* larger = served first when the GPU is oversubscribed */
    uint32_t device_id_count;   /* 0..VGPU_MAX_DEVICE_IDS valid entries in device_ids[] */
    uint32_t reserved0;
    uint64_t flags;             /* VGPU_CONTROL_* (1.1); reserved (zero) in 1.0 */
    uint64_t reserved[5];
    char device_ids[VGPU_MAX_DEVICE_IDS][VGPU_DEVICE_ID_LEN];
    struct vgpu_control_device devices[VGPU_MAX_DEVICES];
};

/* ------------------------------------------------------------------ state */

struct vgpu_state_device {
    int64_t balance;            /* tokens; negative only as a debt, see the rule above */
    uint64_t last_refill_ns;    /* CLOCK_MONOTONIC; 0 = never (the first refill fills the bucket) */
    uint64_t memory_used;       /* accounted bytes, all processes of the container */
    uint64_t tokens_spent;      /* cumulative, all processes, ended ones included */
    uint64_t launches;          /* cumulative, all processes */
    uint64_t wait_ns;           /* cumulative time launches waited for tokens */
    uint64_t reserved[2];
};

struct vgpu_proc_device {
    uint64_t memory_used;       /* bytes this process holds on the device */
    uint64_t launches;
    uint64_t tokens_spent;
    uint64_t wait_ns;
    uint64_t last_launch_ns;    /* CLOCK_MONOTONIC; 0 = never */
};

struct vgpu_proc_slot {
    uint64_t pid;               /* in-container pid; 0 = free */
    uint64_t host_pid;          /* 0 when unknown */
    uint64_t start_time;        /* clock ticks since boot, /proc/<pid>/stat field 22 */
    uint64_t reserved;
    struct vgpu_proc_device devices[VGPU_MAX_DEVICES];
};

/* 1.1: per-device words appended after the slots (zero in a fresh file). */
struct vgpu_state_ext_device {
    uint64_t memory_context;    /* bytes of memory_used held for contexts, heap and stack */
    uint64_t memory_module;     /* bytes of memory_used held by loaded modules and libraries */
    uint64_t memory_pool;       /* bytes of memory_used reserved by stream-ordered pools */
    uint64_t memory_spilled;    /* bytes of memory_used served by managed memory (spilled) */
    uint64_t graphs_unpriced;   /* executable graphs priced at the graph_cost floor, cumulative */
    uint64_t ticket_next;       /* launch turns: next ticket to hand out */
    uint64_t ticket_serving;    /* launch turns: ticket being served */
    uint64_t reserved[9];
};

/* 1.1: one process's memory by kind on one device, in VGPU_KIND_UNIT units (the slot's share of
 * ext[d]); zeroed when the slot is given back. */
struct vgpu_proc_kinds {
    uint32_t context;
    uint32_t module;
    uint32_t pool;
    uint32_t spilled;           /* 1.1 with spilling; zero from a shim that never spills */
};

struct vgpu_state {
    uint64_t magic;             /* VGPU_STATE_MAGIC */
    uint32_t abi_major;
    uint32_t abi_minor;
    uint32_t header_size;       /* offsetof(struct vgpu_state, slots) */
    uint32_t device_count;      /* copied from control when the agent created the file */
    uint64_t total_size;        /* sizeof(struct vgpu_state); VGPU_STATE_SIZE_1_0 in a 1.0 file */
    uint32_t slot_count;        /* VGPU_MAX_PROCS */
    uint32_t reserved0;
    uint64_t slot_high_water;   /* slots [0, slot_high_water) have ever been claimed; only grows */
    uint64_t reserved[2];
    struct vgpu_state_device devices[VGPU_MAX_DEVICES];
    struct vgpu_proc_slot slots[VGPU_MAX_PROCS];
    /* ---- 1.1 (absent from a state file of minor 0) */
    struct vgpu_state_ext_device ext[VGPU_MAX_DEVICES];
    struct vgpu_proc_kinds slot_kinds[VGPU_MAX_PROCS][VGPU_MAX_DEVICES];
};

/* The size of a 1.0 `state` (everything before ext[]), which a 1.1 reader still accepts. */
#define VGPU_STATE_SIZE_1_0 (offsetof(struct vgpu_state, ext))

#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(struct vgpu_control_device) == 192, "control device entry size");
_Static_assert(offsetof(struct vgpu_control, device_ids) == 128, "control header size");
_Static_assert(sizeof(struct vgpu_control) == 128 + 64 * 64 + 16 * 192, "control size");
_Static_assert(sizeof(struct vgpu_state_device) == 64, "state device entry size");
_Static_assert(sizeof(struct vgpu_proc_slot) == 32 + 16 * 40, "process slot size");
_Static_assert(offsetof(struct vgpu_state, slots) == 64 + 16 * 64, "state header size");
_Static_assert(offsetof(struct vgpu_control, generation) % 8 == 0, "aligned generation");
_Static_assert(offsetof(struct vgpu_control, flags) == 80, "control flags carved from reserved");
_Static_assert(offsetof(struct vgpu_state, slot_high_water) == 40, "slot high-water mark offset");
_Static_assert(sizeof(struct vgpu_state_ext_device) == 128, "state extension entry size");
_Static_assert(sizeof(struct vgpu_proc_kinds) == 16, "slot kinds entry size");
_Static_assert(offsetof(struct vgpu_state, ext) == 64 + 16 * 64 + 1024 * (32 + 16 * 40),
               "1.0 state size: the extension starts where a 1.0 file ends");
_Static_assert(sizeof(struct vgpu_state) < 1024 * 1024, "state file under 1 MiB");
#endif

#endif /* VGPU_SHM_H */
