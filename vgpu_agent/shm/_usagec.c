/*
 * A region's whole `state` read in C for the metrics' round: `layout.decode_state`, refusal
 * for refusal and count for count, and `Region._read_usage`'s reads (header, extension, the
 * slots below the mark) in one call.
 *
 * Every value comes from a file the container writes, so every check of the Python decoder is
 * kept: a header of another magic, major version or size, or of more devices than the ABI has,
 * is corrupt (None); within a readable header, a nonsense slot is skipped whole, a nonsense
 * device total is replaced as in Python, and each is counted. Nothing past the bytes read is
 * ever looked at. The Python decoder stays the reference; the tests hold the two to the same
 * answers on random bytes.
 *
 * The layout's numbers are not repeated here: `bind` takes them from `layout` at import, and
 * nothing is decoded before it was called.
 *
 * The GIL is kept across the reads, as in `_statec`: a region's header and its few used slots
 * are a couple of kilobytes in the page cache.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_abiwords.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define MAX_HEADER 4096        /* the largest header `bind` accepts; layout's is 1,088 bytes */
#define MAX_DEVICES_BOUND 64   /* the most devices a `state` may have that `bind` accepts */
#define MAX_PROCS_BOUND 65536  /* the most slots `bind` accepts */
#define MAX_RECORD 65536       /* the largest slot `bind` accepts */
#define MAX_EXTENSION 16384    /* the most bytes of per-device extension words it accepts */

enum { PREFIX_MAGIC, PREFIX_MAJOR, PREFIX_MINOR, PREFIX_HEADER_SIZE, PREFIX_DEVICES,
       PREFIX_TOTAL, PREFIX_SLOT_COUNT, PREFIX_MARK, PREFIX_FIELDS };
enum { DEV_BALANCE, DEV_MEMORY, DEV_SPENT, DEV_LAUNCHES, DEV_WAIT, DEV_FIELDS };
enum { SLOT_PID, SLOT_HOST_PID, SLOT_START, SLOT_FIELDS };
enum { PROC_MEMORY, PROC_LAUNCHES, PROC_SPENT, PROC_WAIT, PROC_LAST, PROC_FIELDS };
enum { EXT_CONTEXT, EXT_MODULE, EXT_POOL, EXT_SPILLED, EXT_GRAPHS, EXT_FIELDS };
enum { SIZE_HEADER, SIZE_DEVICES_AT, SIZE_DEVICE, SIZE_SLOT, SIZE_SLOT_DEVICES_AT, SIZE_PROC,
       SIZE_EXT_AT, SIZE_EXT_DEVICE, SIZE_FIELDS };

struct usage_layout {
    int bound;
    uint64_t magic, major;
    Py_ssize_t prefix[PREFIX_FIELDS]; /* where each prefix field is */
    Py_ssize_t size[SIZE_FIELDS];     /* the header, records and where they start */
    Py_ssize_t device[DEV_FIELDS];    /* within a device record of the header */
    Py_ssize_t slot[SLOT_FIELDS];     /* within a slot */
    Py_ssize_t proc[PROC_FIELDS];     /* within a slot's record of one device */
    Py_ssize_t ext[EXT_FIELDS];       /* within a device record of the extension */
    uint64_t max_devices, max_procs, size_1_0, state_size, pid_max, plausible_bytes,
        plausible_counter, token_max;
};

static struct usage_layout L;

static uint64_t min_u64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

/* A new int from a sum of up to MAX_PROCS_BOUND plausible counters (it may pass 64 bits). */
static PyObject *long_of_sum(uint64_t high, uint64_t low)
{
    if (high == 0)
        return PyLong_FromUnsignedLongLong(low);
    PyObject *h = PyLong_FromUnsignedLongLong(high), *l = PyLong_FromUnsignedLongLong(low);
    PyObject *shift = PyLong_FromLong(64), *shifted = NULL, *out = NULL;
    if (h != NULL && l != NULL && shift != NULL && (shifted = PyNumber_Lshift(h, shift)) != NULL)
        out = PyNumber_Add(shifted, l);
    Py_XDECREF(h);
    Py_XDECREF(l);
    Py_XDECREF(shift);
    Py_XDECREF(shifted);
    return out;
}

static void add_to(uint64_t *high, uint64_t *low, uint64_t value)
{
    uint64_t sum = *low + value;
    *high += sum < *low;
    *low = sum;
}

/* A tuple of `count` words read `stride` bytes apart from `at`, or of `count` zeros (NULL). */
static PyObject *words_tuple(const unsigned char *at, Py_ssize_t stride, uint64_t count)
{
    PyObject *out = PyTuple_New((Py_ssize_t)count);
    if (out == NULL)
        return NULL;
    for (uint64_t i = 0; i < count; i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(at == NULL ? 0 : abi_u64(at + i * stride));
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, (Py_ssize_t)i, value);
    }
    return out;
}

static PyObject *values_tuple(const uint64_t *values, uint64_t count, int is_signed)
{
    PyObject *out = PyTuple_New((Py_ssize_t)count);
    if (out == NULL)
        return NULL;
    for (uint64_t i = 0; i < count; i++) {
        PyObject *value = is_signed ? PyLong_FromLongLong((long long)values[i])
                                    : PyLong_FromUnsignedLongLong(values[i]);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, (Py_ssize_t)i, value);
    }
    return out;
}

/* One live slot as (pid, host_pid, memory, launches, tokens, waited, last launch, start time),
 * each per-device field a tuple: a new reference, or NULL with an error set. */
static PyObject *process_of(const unsigned char *slot, uint64_t count, uint64_t pid,
                            uint64_t host_pid)
{
    const unsigned char *devices = slot + L.size[SIZE_SLOT_DEVICES_AT];
    PyObject *fields[PROC_FIELDS] = {NULL};
    for (int f = 0; f < PROC_FIELDS; f++) {
        fields[f] = words_tuple(devices + L.proc[f], L.size[SIZE_PROC], count);
        if (fields[f] == NULL) {
            for (int g = 0; g < f; g++)
                Py_DECREF(fields[g]);
            return NULL;
        }
    }
    return Py_BuildValue("(KKNNNNNK)", (unsigned long long)pid, (unsigned long long)host_pid,
                         fields[PROC_MEMORY], fields[PROC_LAUNCHES], fields[PROC_SPENT],
                         fields[PROC_WAIT], fields[PROC_LAST],
                         (unsigned long long)abi_u64(slot + L.slot[SLOT_START]));
}

/* `layout.decode_state(buf, device_count, slots_read, extension)` as plain values: None for a
 * corrupt header, else (processes, memory, tokens, skipped, balances, launches, waited,
 * context, module, pool, spilled, graphs unpriced, has the extension). `device_count` and
 * `slots_read` are -1 where not given, `ext` NULL where not given. */
static PyObject *decode_usage(const unsigned char *buf, Py_ssize_t len, long long device_count,
                              long long slots_read, const unsigned char *ext, Py_ssize_t ext_len)
{
    if (len < L.size[SIZE_HEADER])
        Py_RETURN_NONE;
    uint64_t minor = abi_u32(buf + L.prefix[PREFIX_MINOR]);
    uint64_t count = abi_u32(buf + L.prefix[PREFIX_DEVICES]);
    uint64_t total = abi_u64(buf + L.prefix[PREFIX_TOTAL]);
    if (abi_u64(buf + L.prefix[PREFIX_MAGIC]) != L.magic
        || abi_u32(buf + L.prefix[PREFIX_MAJOR]) != L.major
        || abi_u32(buf + L.prefix[PREFIX_HEADER_SIZE]) != (uint64_t)L.size[SIZE_HEADER]
        || count > L.max_devices || (device_count >= 0 && count != (uint64_t)device_count))
        Py_RETURN_NONE;

    uint64_t skipped = 0;
    uint64_t slot_count = abi_u32(buf + L.prefix[PREFIX_SLOT_COUNT]);
    uint64_t mark = abi_u64(buf + L.prefix[PREFIX_MARK]);
    uint64_t capacity = min_u64(slot_count, L.max_procs);
    if (mark > capacity) {
        skipped++; /* a mark past the last slot is damage: read the slots there are */
        mark = capacity;
    }
    uint64_t held = (uint64_t)(len - L.size[SIZE_HEADER]) / (uint64_t)L.size[SIZE_SLOT];
    int size_known = minor == 0 ? total == L.size_1_0 : total >= L.state_size;
    uint64_t wanted;
    if (slots_read < 0) {
        if (slot_count > min_u64(L.max_procs, held) || !size_known)
            skipped++;
        wanted = mark;
    } else {
        wanted = min_u64(mark, (uint64_t)slots_read);
        if (slot_count > L.max_procs || !size_known || held < wanted)
            skipped++;
    }
    uint64_t to_read = min_u64(wanted, held);

    uint64_t slot_mem[MAX_DEVICES_BOUND] = {0};
    uint64_t tokens_high[MAX_DEVICES_BOUND] = {0}, tokens_low[MAX_DEVICES_BOUND] = {0};
    PyObject *processes = PyList_New(0);
    if (processes == NULL)
        return NULL;
    const uint64_t reclaiming = (uint64_t)1 << 63;
    for (uint64_t index = 0; index < to_read; index++) {
        const unsigned char *slot = buf + L.size[SIZE_HEADER] + index * L.size[SIZE_SLOT];
        uint64_t pid = abi_u64(slot + L.slot[SLOT_PID]);
        if (pid == 0)
            continue;
        uint64_t host_pid = abi_u64(slot + L.slot[SLOT_HOST_PID]);
        if (pid & reclaiming) {
            /* being reclaimed right now by the process in the low bits: not in use */
            uint64_t owner = pid & ~reclaiming;
            if (!(owner > 0 && owner < L.pid_max))
                skipped++;
            continue;
        }
        int plausible = pid < L.pid_max && host_pid < L.pid_max;
        const unsigned char *devices = slot + L.size[SIZE_SLOT_DEVICES_AT];
        for (uint64_t d = 0; plausible && d < count; d++) {
            const unsigned char *record = devices + d * L.size[SIZE_PROC];
            plausible = abi_u64(record + L.proc[PROC_MEMORY]) <= L.plausible_bytes;
            for (int f = 0; plausible && f < PROC_FIELDS; f++)
                plausible = abi_u64(record + L.proc[f]) <= L.plausible_counter;
        }
        if (!plausible) {
            skipped++;
            continue;
        }
        PyObject *process = process_of(slot, count, pid, host_pid);
        if (process == NULL || PyList_Append(processes, process) < 0) {
            Py_XDECREF(process);
            Py_DECREF(processes);
            return NULL;
        }
        Py_DECREF(process);
        for (uint64_t d = 0; d < count; d++) {
            const unsigned char *record = devices + d * L.size[SIZE_PROC];
            slot_mem[d] += abi_u64(record + L.proc[PROC_MEMORY]);
            add_to(&tokens_high[d], &tokens_low[d], abi_u64(record + L.proc[PROC_SPENT]));
        }
    }

    uint64_t memory[MAX_DEVICES_BOUND], balances[MAX_DEVICES_BOUND],
        launches[MAX_DEVICES_BOUND], waited[MAX_DEVICES_BOUND], spent[MAX_DEVICES_BOUND];
    int spent_from_slots[MAX_DEVICES_BOUND] = {0};
    for (uint64_t d = 0; d < count; d++) {
        const unsigned char *record = buf + L.size[SIZE_DEVICES_AT] + d * L.size[SIZE_DEVICE];
        memory[d] = abi_u64(record + L.device[DEV_MEMORY]);
        spent[d] = abi_u64(record + L.device[DEV_SPENT]);
        int64_t balance = (int64_t)abi_u64(record + L.device[DEV_BALANCE]);
        launches[d] = abi_u64(record + L.device[DEV_LAUNCHES]);
        waited[d] = abi_u64(record + L.device[DEV_WAIT]);
        if (memory[d] > L.plausible_bytes) {
            skipped++;
            memory[d] = slot_mem[d];
        }
        if (spent[d] > L.plausible_counter) {
            skipped++;
            spent_from_slots[d] = 1;
        }
        if (balance < -(int64_t)L.token_max || balance > (int64_t)L.token_max) {
            skipped++;
            balance = 0;
        }
        balances[d] = (uint64_t)balance;
        /* totals the law relies on: nonsense is read as nothing (counted) */
        if (launches[d] > L.plausible_counter) {
            skipped++;
            launches[d] = 0;
        }
        if (waited[d] > L.plausible_counter) {
            skipped++;
            waited[d] = 0;
        }
    }

    /* the 1.1 extension: memory by kind and unpriced graphs per device */
    int has_extension = minor >= 1 && total >= L.state_size;
    uint64_t kinds[EXT_FIELDS][MAX_DEVICES_BOUND] = {{0}};
    const unsigned char *source = NULL;
    Py_ssize_t source_len = 0;
    if (has_extension && ext != NULL) {
        source = ext;
        source_len = ext_len;
    } else if (has_extension && slots_read < 0 && len >= L.size[SIZE_EXT_AT]) {
        source = buf + L.size[SIZE_EXT_AT];
        source_len = len - L.size[SIZE_EXT_AT];
    } else if (has_extension && slots_read < 0) {
        source_len = -1; /* the buffer ends before the extension starts */
    }
    if (source_len < 0 || (source != NULL
                           && (uint64_t)source_len < count * (uint64_t)L.size[SIZE_EXT_DEVICE])) {
        skipped++; /* shorter than the header says */
    } else if (source != NULL) {
        for (uint64_t d = 0; d < count; d++) {
            const unsigned char *record = source + d * L.size[SIZE_EXT_DEVICE];
            for (int f = 0; f < EXT_FIELDS; f++) {
                uint64_t value = abi_u64(record + L.ext[f]);
                uint64_t bound = f == EXT_GRAPHS ? L.plausible_counter : L.plausible_bytes;
                if (value > bound) {
                    skipped++;
                    value = 0;
                }
                kinds[f][d] = value;
            }
        }
    }

    PyObject *tokens = PyTuple_New((Py_ssize_t)count);
    for (uint64_t d = 0; tokens != NULL && d < count; d++) {
        PyObject *value = spent_from_slots[d] ? long_of_sum(tokens_high[d], tokens_low[d])
                                              : PyLong_FromUnsignedLongLong(spent[d]);
        if (value == NULL)
            Py_CLEAR(tokens);
        else
            PyTuple_SET_ITEM(tokens, (Py_ssize_t)d, value);
    }
    PyObject *listed = PyList_AsTuple(processes);
    Py_DECREF(processes);
    if (tokens == NULL || listed == NULL) {
        Py_XDECREF(tokens);
        Py_XDECREF(listed);
        return NULL;
    }
    return Py_BuildValue("(NNNKNNNNNNNNO)", listed, values_tuple(memory, count, 0), tokens,
                         (unsigned long long)skipped, values_tuple(balances, count, 1),
                         values_tuple(launches, count, 0), values_tuple(waited, count, 0),
                         values_tuple(kinds[EXT_CONTEXT], count, 0),
                         values_tuple(kinds[EXT_MODULE], count, 0),
                         values_tuple(kinds[EXT_POOL], count, 0),
                         values_tuple(kinds[EXT_SPILLED], count, 0),
                         values_tuple(kinds[EXT_GRAPHS], count, 0),
                         has_extension ? Py_True : Py_False);
}

static int check_bound(void)
{
    if (!L.bound) {
        PyErr_SetString(PyExc_RuntimeError, "vgpu_agent.shm._usagec: bind() was not called");
        return 0;
    }
    return 1;
}

/* One pread of `size` bytes at `offset`, retried where a signal interrupted it (as os.pread):
 * the bytes read, or -1 with OSError set. */
static Py_ssize_t read_at(int fd, unsigned char *into, Py_ssize_t size, Py_ssize_t offset)
{
    for (;;) {
        ssize_t n = pread(fd, into, (size_t)size, (off_t)offset);
        if (n >= 0)
            return n;
        if (errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
}

/* usage_at(fd, device_count, slot_budget): `Region._read_usage`'s reads and decode. */
static PyObject *usage_at(PyObject *module, PyObject *args)
{
    (void)module;
    int fd;
    long long device_count, budget;
    if (!PyArg_ParseTuple(args, "iLL:usage_at", &fd, &device_count, &budget) || !check_bound())
        return NULL;
    if (budget < 0 || (uint64_t)budget > L.max_procs) {
        PyErr_Format(PyExc_ValueError, "usage_at: slot_budget=%lld is not allowed: 0..%llu",
                     budget, (unsigned long long)L.max_procs);
        return NULL;
    }
    Py_ssize_t header = L.size[SIZE_HEADER];
    unsigned char head[MAX_HEADER];
    Py_ssize_t got = read_at(fd, head, header, 0);
    if (got < 0)
        return NULL;
    if (got < header)
        return decode_usage(head, got, device_count, 0, NULL, 0); /* unreadable */
    /* the slots to read: below the mark, clamped as `layout.state_slots_to_read`, then to the
     * region's budget */
    uint64_t slots = min_u64(min_u64(abi_u64(head + L.prefix[PREFIX_MARK]),
                                     abi_u32(head + L.prefix[PREFIX_SLOT_COUNT])),
                             min_u64(L.max_procs, (uint64_t)budget));
    unsigned char extension[MAX_EXTENSION];
    unsigned char *ext = NULL;
    Py_ssize_t ext_len = 0;
    if (abi_u32(head + L.prefix[PREFIX_MINOR]) >= 1
        && abi_u64(head + L.prefix[PREFIX_TOTAL]) >= L.state_size) {
        ext_len = read_at(fd, extension, (Py_ssize_t)L.max_devices * L.size[SIZE_EXT_DEVICE],
                          L.size[SIZE_EXT_AT]);
        if (ext_len < 0)
            return NULL;
        ext = extension;
    }
    if (slots == 0)
        return decode_usage(head, header, device_count, 0, ext, ext_len);
    Py_ssize_t wanted = (Py_ssize_t)slots * L.size[SIZE_SLOT];
    unsigned char *whole = PyMem_Malloc((size_t)(header + wanted));
    if (whole == NULL)
        return PyErr_NoMemory();
    memcpy(whole, head, (size_t)header);
    PyObject *out = NULL;
    Py_ssize_t more = read_at(fd, whole + header, wanted, header);
    if (more >= 0)
        out = decode_usage(whole, header + more, device_count, (long long)slots, ext, ext_len);
    PyMem_Free(whole);
    return out;
}

/* decode_state(buf, device_count, slots_read, extension): `layout.decode_state` as values
 * (None for a corrupt header); device_count, slots_read and extension may be None. */
static PyObject *decode_state(PyObject *module, PyObject *args)
{
    (void)module;
    Py_buffer buf = {0}, ext = {0};
    PyObject *count_arg, *slots_arg, *ext_arg;
    if (!PyArg_ParseTuple(args, "y*OOO:decode_state", &buf, &count_arg, &slots_arg, &ext_arg))
        return NULL;
    PyObject *out = NULL;
    long long device_count = -1, slots_read = -1;
    if (!check_bound())
        goto done;
    int overflow = 0;
    if (count_arg != Py_None) {
        device_count = PyLong_AsLongLongAndOverflow(count_arg, &overflow);
        if (device_count == -1 && PyErr_Occurred())
            goto done;
        if (overflow || device_count < 0) /* a count no header has: never matches */
            device_count = (long long)L.max_devices + 1;
    }
    if (slots_arg != Py_None) {
        slots_read = PyLong_AsLongLongAndOverflow(slots_arg, &overflow);
        if (slots_read == -1 && PyErr_Occurred())
            goto done;
        if (overflow || slots_read < 0 || (uint64_t)slots_read > L.max_procs) {
            PyErr_Format(PyExc_ValueError, "slots_read=%R is not allowed: 0..%llu", slots_arg,
                         (unsigned long long)L.max_procs);
            goto done;
        }
    }
    if (ext_arg != Py_None && PyObject_GetBuffer(ext_arg, &ext, PyBUF_SIMPLE) < 0)
        goto done;
    out = decode_usage(buf.buf, buf.len, device_count, slots_read,
                       ext_arg != Py_None ? ext.buf : NULL, ext.len);
done:
    PyBuffer_Release(&buf);
    if (ext.obj != NULL)
        PyBuffer_Release(&ext);
    return out;
}

/* `n` offsets from the tuple `seq` into `into`, each of a field `widths[i]` bytes wide (8
 * where `widths` is NULL), aligned to its width and within a record of `record` bytes. */
static int offsets_within(PyObject *seq, Py_ssize_t *into, Py_ssize_t n, Py_ssize_t record,
                          const Py_ssize_t *widths, const char *what)
{
    if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd offsets wanted", what, n);
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        into[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(seq, i));
        if (into[i] == -1 && PyErr_Occurred())
            return 0;
        Py_ssize_t width = widths == NULL ? 8 : widths[i];
        if (into[i] < 0 || into[i] % width != 0 || into[i] + width > record) {
            PyErr_Format(PyExc_ValueError,
                         "a state layout this reader cannot hold: %s offset %zd not an aligned "
                         "field of %zd bytes within its %zd",
                         what, into[i], width, record);
            return 0;
        }
    }
    return 1;
}

/* bind(magic, major, prefix offsets, sizes, device, slot, proc and extension offsets,
 * (max_devices, max_procs, size_1_0, state_size, pid_max, plausible_bytes, plausible_counter,
 * token_max)): the layout's numbers, once, before any decode. */
static PyObject *bind(PyObject *module, PyObject *args)
{
    (void)module;
    unsigned long long magic, major;
    PyObject *prefix, *sizes, *device, *slot, *proc, *ext;
    unsigned long long limits[8];
    if (!PyArg_ParseTuple(args, "KKOOOOOO(KKKKKKKK):bind", &magic, &major, &prefix, &sizes,
                          &device, &slot, &proc, &ext, &limits[0], &limits[1], &limits[2],
                          &limits[3], &limits[4], &limits[5], &limits[6], &limits[7]))
        return NULL;
    Py_ssize_t size[SIZE_FIELDS], at[PREFIX_FIELDS];
    if (!PyTuple_Check(sizes) || PyTuple_GET_SIZE(sizes) != SIZE_FIELDS) {
        PyErr_Format(PyExc_ValueError, "sizes: %d wanted", SIZE_FIELDS);
        return NULL;
    }
    for (int i = 0; i < SIZE_FIELDS; i++) {
        size[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, i));
        if (size[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    uint64_t max_devices = limits[0], max_procs = limits[1];
    if (size[SIZE_HEADER] < 64 || size[SIZE_HEADER] > MAX_HEADER || max_devices < 1
        || max_devices > MAX_DEVICES_BOUND || max_procs < 1 || max_procs > MAX_PROCS_BOUND
        || size[SIZE_DEVICE] < 8 || size[SIZE_SLOT] < 8 || size[SIZE_PROC] < 8
        || size[SIZE_EXT_DEVICE] < 8 || size[SIZE_SLOT] > MAX_RECORD
        || (Py_ssize_t)max_devices * size[SIZE_EXT_DEVICE] > MAX_EXTENSION
        || size[SIZE_DEVICES_AT] < 0
        || size[SIZE_DEVICES_AT] + (Py_ssize_t)max_devices * size[SIZE_DEVICE] > size[SIZE_HEADER]
        || size[SIZE_SLOT_DEVICES_AT] < 0
        || size[SIZE_SLOT_DEVICES_AT] + (Py_ssize_t)max_devices * size[SIZE_PROC] > size[SIZE_SLOT]
        || size[SIZE_EXT_AT] < size[SIZE_HEADER]
        /* the slots' memory is summed in 64 bits: every slot at the bound must fit */
        || limits[5] > UINT64_MAX / max_procs) {
        PyErr_Format(PyExc_ValueError,
                     "a state layout this reader cannot hold: header %zd bytes (64..%d), "
                     "%llu devices (1..%d), %llu slots (1..%d), slots of %zd bytes (at most %d), "
                     "extension records of %zd bytes (%d in all at most), records inside what "
                     "holds them, the slots' memory summed within 64 bits",
                     size[SIZE_HEADER], MAX_HEADER, max_devices, MAX_DEVICES_BOUND, max_procs,
                     MAX_PROCS_BOUND, size[SIZE_SLOT], MAX_RECORD, size[SIZE_EXT_DEVICE],
                     MAX_EXTENSION);
        return NULL;
    }
    /* magic, major, minor, header size, device count, total size, slot count, the mark */
    static const Py_ssize_t prefix_widths[PREFIX_FIELDS] = {8, 4, 4, 4, 4, 8, 4, 8};
    /* filled apart and taken whole: a refused layout leaves the one in force, if any */
    struct usage_layout next = {0};
    if (!offsets_within(prefix, at, PREFIX_FIELDS, size[SIZE_DEVICES_AT], prefix_widths,
                        "prefix")
        || !offsets_within(device, next.device, DEV_FIELDS, size[SIZE_DEVICE], NULL, "device")
        || !offsets_within(slot, next.slot, SLOT_FIELDS, size[SIZE_SLOT_DEVICES_AT], NULL,
                           "slot")
        || !offsets_within(proc, next.proc, PROC_FIELDS, size[SIZE_PROC], NULL, "process")
        || !offsets_within(ext, next.ext, EXT_FIELDS, size[SIZE_EXT_DEVICE], NULL, "extension"))
        return NULL;
    memcpy(next.prefix, at, sizeof at);
    memcpy(next.size, size, sizeof size);
    next.magic = magic;
    next.major = major;
    next.max_devices = max_devices;
    next.max_procs = max_procs;
    next.size_1_0 = limits[2];
    next.state_size = limits[3];
    next.pid_max = limits[4];
    next.plausible_bytes = limits[5];
    next.plausible_counter = limits[6];
    next.token_max = limits[7] > INT64_MAX ? (uint64_t)INT64_MAX : limits[7];
    next.bound = 1;
    L = next;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(magic, major, prefix, sizes, device, slot, process, extension, limits): the "
     "layout's numbers, once, before any decode (see `usageread.bind`)."},
    {"usage_at", usage_at, METH_VARARGS,
     "usage_at(fd, device_count, slot_budget): `Region._read_usage` of the `state` open at fd, "
     "as `decode_state` gives it; OSError where a read fails."},
    {"decode_state", decode_state, METH_VARARGS,
     "decode_state(buf, device_count, slots_read, extension): `layout.decode_state` as plain "
     "values, None for a corrupt header."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_usagec", "A region's whole `state` read in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__usagec(void)
{
    return PyModule_Create(&module_def);
}
