/*
 * The controller's lean read of a `state` header in C: one pread and the decode of
 * `layout.state_counters`, refusal for refusal, in one call.
 *
 * The header is written by the container, so every refusal of the Python decoder is kept: a
 * wrong magic or major version, another device count, a header size below the agent's or a
 * total size below the header's, and any total above the plausible bound. Where Python's
 * reader returns None (an error from pread, a short read), so does this one.
 *
 * The layout's numbers are not repeated here: `bind` takes them from `layout` at import, and
 * nothing is read before it was called.
 *
 * The GIL is kept across the pread: a header is about a kilobyte in the page cache, and
 * handing the GIL over twice per region costs the agent more than the read.
 *
 * `readings_many` reads many regions at once, each with its rates in force from the words of
 * its `control` (the agent's own file, mapped by the caller): what `Region.controls` gives.
 * `readings_of` is `Region.readings_together`'s loop around that read: each region's lock,
 * fields and file checks, looked up on the region object as the Python loop does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_abiwords.h"

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_HEADER 4096 /* the largest header `bind` accepts; layout's is 1,088 bytes */
#define MAX_DEVICES_BOUND 64

static struct {
    int bound;
    uint64_t magic;
    uint32_t major;
    Py_ssize_t at[5]; /* where magic, major, header size, device count, total size are */
    Py_ssize_t header_size;    /* bytes read, and the least header size accepted */
    Py_ssize_t devices_offset; /* where device 0's record starts */
    Py_ssize_t device_size;    /* bytes per device record */
    Py_ssize_t spent_offset;   /* tokens spent, launches, ns waited: three words from here */
    uint64_t plausible;        /* the largest total accepted */
    int max_devices;
} layout;

/* `layout.state_counters(header, device_count)`: a new tuple, or None (a new reference). */
static PyObject *decode(const unsigned char *header, Py_ssize_t size, long device_count)
{
    if (size < layout.header_size || device_count < 1 || device_count > layout.max_devices)
        Py_RETURN_NONE;
    /* magic u64, major u32, header_size u32, device_count u32, total_size u64 */
    uint64_t header_size = abi_u32(header + layout.at[2]), total = abi_u64(header + layout.at[4]);
    if (abi_u64(header + layout.at[0]) != layout.magic
        || abi_u32(header + layout.at[1]) != layout.major
        || abi_u32(header + layout.at[3]) != (uint32_t)device_count
        || header_size < (uint64_t)layout.header_size || total < header_size)
        Py_RETURN_NONE;
    uint64_t values[3 * MAX_DEVICES_BOUND];
    for (long dev = 0; dev < device_count; dev++) {
        const unsigned char *at =
            header + layout.devices_offset + dev * layout.device_size + layout.spent_offset;
        for (int word = 0; word < 3; word++) {
            uint64_t value = abi_u64(at + 8 * word);
            if (value > layout.plausible)
                Py_RETURN_NONE;
            values[3 * dev + word] = value;
        }
    }
    PyObject *out = PyTuple_New(3 * device_count);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < 3 * device_count; i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(values[i]);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, value);
    }
    return out;
}

static int check_bound(void)
{
    if (!layout.bound) {
        PyErr_SetString(PyExc_RuntimeError, "vgpu_agent.shm._statec: bind() was not called");
        return 0;
    }
    return 1;
}

/* The header from offset 0 of `fd` into `header`: the bytes read (fewer than a header where
 * pread failed or the file ends early: unreadable, as in Python), or -1 with an error set (a
 * signal's handler raised). */
static Py_ssize_t read_header(int fd, unsigned char *header)
{
    Py_ssize_t got = 0;
    while (got < layout.header_size) {
        ssize_t n = pread(fd, header + got, (size_t)(layout.header_size - got), (off_t)got);
        if (n < 0 && errno == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return -1;
            continue;
        }
        if (n <= 0)
            break;
        got += n;
    }
    return got;
}

static PyObject *counters_at(PyObject *module, PyObject *args)
{
    (void)module;
    int fd;
    long device_count;
    if (!PyArg_ParseTuple(args, "il:counters_at", &fd, &device_count) || !check_bound())
        return NULL;
    unsigned char header[MAX_HEADER];
    Py_ssize_t got = read_header(fd, header);
    return got < 0 ? NULL : decode(header, got, device_count);
}

static long long monotonic_ns(void) /* time.monotonic_ns(): the same clock */
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* The rates in force of one region's devices, (rate0, burst0, rate1, ...), from the 64-bit
 * words of its `control` (`Region.controls`): a new tuple, or NULL with an error set. */
static PyObject *rates_of(PyObject *words, Py_ssize_t devices, Py_ssize_t rate_word,
                          Py_ssize_t burst_word, Py_ssize_t device_words)
{
    Py_buffer view;
    if (PyObject_GetBuffer(words, &view, PyBUF_FULL_RO) < 0)
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t last = (devices - 1) * device_words + (rate_word > burst_word ? rate_word
                                                                               : burst_word);
    if (view.itemsize != 8 || view.ndim != 1 || view.format == NULL
        || strcmp(view.format, "Q") != 0 || !PyBuffer_IsContiguous(&view, 'C')
        || last >= view.len / 8) {
        PyErr_Format(PyExc_ValueError,
                     "readings_many: a control of %zd devices needs contiguous 64-bit words "
                     "up to word %zd, got %zd bytes of format %s",
                     devices, last, view.len, view.format == NULL ? "B" : view.format);
        goto done;
    }
    const uint64_t *word = view.buf;
    out = PyTuple_New(2 * devices);
    if (out == NULL)
        goto done;
    for (Py_ssize_t dev = 0; dev < devices; dev++) {
        PyObject *rate = PyLong_FromUnsignedLongLong(word[dev * device_words + rate_word]);
        PyObject *burst = rate == NULL ? NULL
            : PyLong_FromUnsignedLongLong(word[dev * device_words + burst_word]);
        if (burst == NULL) {
            Py_XDECREF(rate);
            Py_CLEAR(out);
            goto done;
        }
        PyTuple_SET_ITEM(out, 2 * dev, rate);
        PyTuple_SET_ITEM(out, 2 * dev + 1, burst);
    }
done:
    PyBuffer_Release(&view);
    return out;
}

/* One region's reading: its header read from `fd` between two monotonic stamps, and its rates
 * in force from `words`, the device count being the policies' (a tuple):
 * (counters or None, rates, policies, priority, before, after), or NULL with an error set. */
static PyObject *read_one(int fd, PyObject *words, PyObject *policies, PyObject *priority,
                          Py_ssize_t rate_word, Py_ssize_t burst_word, Py_ssize_t device_words)
{
    Py_ssize_t devices = PyTuple_GET_SIZE(policies);
    if (devices < 1 || devices > layout.max_devices) {
        PyErr_Format(PyExc_ValueError, "readings: %zd devices (allowed 1..%d)", devices,
                     layout.max_devices);
        return NULL;
    }
    PyObject *rates = rates_of(words, devices, rate_word, burst_word, device_words);
    if (rates == NULL)
        return NULL;
    unsigned char header[MAX_HEADER];
    long long before = monotonic_ns();
    Py_ssize_t got = read_header(fd, header);
    long long after = monotonic_ns();
    PyObject *counters = got < 0 ? NULL : decode(header, got, (long)devices);
    if (counters == NULL) {
        Py_DECREF(rates);
        return NULL;
    }
    return Py_BuildValue("(NNOOLL)", counters, rates, policies, priority, before, after);
}

/* readings_many(fds, controls, (rate_word, burst_word, device_words)): per region, its
 * header read from its `state` descriptor between two monotonic stamps, and its controls in
 * force: `controls` holds per region (the words of its `control`, its policies, its
 * priority), the device count being the policies'. Each reading is the controller's:
 * (counters or None, rates, policies, priority, before, after). */
static PyObject *readings_many(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *fds, *controls;
    Py_ssize_t rate_word, burst_word, device_words;
    if (!PyArg_ParseTuple(args, "O!O!(nnn):readings_many", &PyList_Type, &fds, &PyList_Type,
                          &controls, &rate_word, &burst_word, &device_words)
        || !check_bound())
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(fds);
    if (PyList_GET_SIZE(controls) != n) {
        PyErr_Format(PyExc_ValueError, "readings_many: %zd descriptors but %zd controls", n,
                     PyList_GET_SIZE(controls));
        return NULL;
    }
    if (rate_word < 0 || burst_word < 0 || device_words < 1) {
        PyErr_Format(PyExc_ValueError,
                     "readings_many: word indexes must be >= 0 and words per device >= 1, got "
                     "%zd, %zd, %zd", rate_word, burst_word, device_words);
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *control = PyList_GET_ITEM(controls, i);
        long fd = PyLong_AsLong(PyList_GET_ITEM(fds, i));
        if (fd == -1 && PyErr_Occurred())
            goto failed;
        if (fd < INT_MIN || fd > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "readings_many: %ld is no file descriptor", fd);
            goto failed;
        }
        if (!PyTuple_CheckExact(control) || PyTuple_GET_SIZE(control) != 3
            || !PyTuple_CheckExact(PyTuple_GET_ITEM(control, 1))) {
            PyErr_SetString(PyExc_TypeError,
                            "readings_many: each control must be (words, policies, priority)");
            goto failed;
        }
        PyObject *read = read_one((int)fd, PyTuple_GET_ITEM(control, 0),
                                  PyTuple_GET_ITEM(control, 1), PyTuple_GET_ITEM(control, 2),
                                  rate_word, burst_word, device_words);
        if (read == NULL)
            goto failed;
        PyList_SET_ITEM(out, i, read);
    }
    return out;
failed:
    Py_DECREF(out);
    return NULL;
}

/* Names `readings_of` looks up on a region, interned once. */
static PyObject *name_view, *name_lock, *name_policed, *name_fd, *name_words, *name_in_force,
    *name_acquire, *name_release, *name_checks;

static int intern_names(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&name_view, "_view"}, {&name_lock, "_fd_lock"}, {&name_policed, "_policed_ns"},
        {&name_fd, "_state_fd"}, {&name_words, "_words"}, {&name_in_force, "_in_force"},
        {&name_acquire, "acquire"}, {&name_release, "release"},
        {&name_checks, "_checks_find_nothing"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(
                                           names[i].text)) == NULL)
            return 0;
    return 1;
}

/* Gives `lock` back, keeping whatever error is set: 0 where the release itself failed (its
 * error then set, unless one was set before). */
static int release(PyObject *lock)
{
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyObject *done = PyObject_CallMethodNoArgs(lock, name_release);
    Py_XDECREF(done);
    if (type != NULL) {
        PyErr_Clear();
        PyErr_Restore(type, value, trace);
    }
    return done != NULL;
}

/* One region of `readings_of`, whose lock is held: its reading, Py_None where it is left to
 * its own read (closed meanwhile, no descriptor, checks due that find something), or NULL with
 * an error set. */
static PyObject *read_held(PyObject *region, PyObject *now, long long now_ns, long long police_ns,
                           Py_ssize_t rate_word, Py_ssize_t burst_word, Py_ssize_t device_words)
{
    PyObject *out = NULL, *view = NULL, *policed = NULL, *fd = NULL, *words = NULL,
             *in_force = NULL;
    if ((view = PyObject_GetAttr(region, name_view)) == NULL
        || (policed = PyObject_GetAttr(region, name_policed)) == NULL
        || (fd = PyObject_GetAttr(region, name_fd)) == NULL
        || (words = PyObject_GetAttr(region, name_words)) == NULL)
        goto done;
    if (view == Py_None || fd == Py_None || words == Py_None || policed == Py_None) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    long long at = PyLong_AsLongLong(policed);
    if (at == -1 && PyErr_Occurred())
        goto done;
    if (now_ns - at >= police_ns) { /* (as Python's ints: no overflow for clock values) */
        PyObject *found = PyObject_CallMethodOneArg(region, name_checks, now);
        if (found == NULL)
            goto done;
        int nothing = PyObject_IsTrue(found);
        Py_DECREF(found);
        if (nothing < 0)
            goto done;
        if (!nothing) {
            out = Py_NewRef(Py_None);
            goto done;
        }
    }
    long descriptor = PyLong_AsLong(fd);
    if (descriptor == -1 && PyErr_Occurred())
        goto done;
    if (descriptor < 0 || descriptor > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "readings_of: %ld is no file descriptor", descriptor);
        goto done;
    }
    if ((in_force = PyObject_GetAttr(region, name_in_force)) == NULL)
        goto done;
    if (!PyTuple_CheckExact(in_force) || PyTuple_GET_SIZE(in_force) != 2
        || !PyTuple_CheckExact(PyTuple_GET_ITEM(in_force, 0))) {
        PyErr_SetString(PyExc_TypeError, "readings_of: a region's controls in force must be "
                                         "(policies, priority)");
        goto done;
    }
    out = read_one((int)descriptor, words, PyTuple_GET_ITEM(in_force, 0),
                   PyTuple_GET_ITEM(in_force, 1), rate_word, burst_word, device_words);
done:
    Py_XDECREF(view);
    Py_XDECREF(policed);
    Py_XDECREF(fd);
    Py_XDECREF(words);
    Py_XDECREF(in_force);
    return out;
}

/* readings_of(regions, region_type, now_ns, police_ns, (rate_word, burst_word, device_words)):
 * `Region.readings_together`'s loop, region by region under its readers' lock: the readings
 * (None for a region left to its own read) and the indexes of those whose header was corrupt.
 * An error gives every lock taken back and is raised. */
static PyObject *readings_of(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *sequence, *region_type, *now;
    long long police_ns;
    Py_ssize_t rate_word, burst_word, device_words;
    if (!PyArg_ParseTuple(args, "OO!O!L(nnn):readings_of", &sequence, &PyType_Type,
                          &region_type, &PyLong_Type, &now, &police_ns, &rate_word, &burst_word,
                          &device_words)
        || !check_bound() || !intern_names())
        return NULL;
    if (rate_word < 0 || burst_word < 0 || device_words < 1) {
        PyErr_Format(PyExc_ValueError,
                     "readings_of: word indexes must be >= 0 and words per device >= 1, got "
                     "%zd, %zd, %zd", rate_word, burst_word, device_words);
        return NULL;
    }
    long long now_ns = PyLong_AsLongLong(now);
    if (now_ns == -1 && PyErr_Occurred())
        return NULL;
    PyObject *regions = PySequence_Fast(sequence, "readings_of: regions must be a sequence");
    if (regions == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(regions);
    PyObject *out = PyList_New(n), *corrupt = PyList_New(0);
    if (out == NULL || corrupt == NULL)
        goto failed;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *region = PySequence_Fast_GET_ITEM(regions, i);
        PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
        if (Py_TYPE(region) != (PyTypeObject *)region_type)
            continue; /* not a `Region`: read the usual way */
        PyObject *view = PyObject_GetAttr(region, name_view);
        if (view == NULL)
            goto failed;
        Py_DECREF(view);
        if (view == Py_None)
            continue; /* closed (the reference outlives the object: compared only) */
        PyObject *lock = PyObject_GetAttr(region, name_lock);
        if (lock == NULL)
            goto failed;
        PyObject *taken = PyObject_CallMethodOneArg(lock, name_acquire, Py_False);
        int held = taken == NULL ? -1 : PyObject_IsTrue(taken);
        Py_XDECREF(taken);
        if (held <= 0) {
            Py_DECREF(lock);
            if (held < 0)
                goto failed;
            continue; /* another reader may be reopening its file: read it the usual way */
        }
        PyObject *read = read_held(region, now, now_ns, police_ns, rate_word, burst_word,
                                   device_words);
        int released = release(lock);
        Py_DECREF(lock);
        if (read == NULL || !released) {
            Py_XDECREF(read);
            goto failed;
        }
        if (read != Py_None && PyTuple_GET_ITEM(read, 0) == Py_None) {
            PyObject *index = PyLong_FromSsize_t(i);
            int added = index == NULL ? -1 : PyList_Append(corrupt, index);
            Py_XDECREF(index);
            if (added < 0) {
                Py_DECREF(read);
                goto failed;
            }
        }
        PyList_SetItem(out, i, read); /* (steals `read`, drops the None) */
    }
    Py_DECREF(regions);
    return Py_BuildValue("(NN)", out, corrupt);
failed:
    Py_DECREF(regions);
    Py_XDECREF(out);
    Py_XDECREF(corrupt);
    return NULL;
}

static PyObject *decode_header(PyObject *module, PyObject *args)
{
    (void)module;
    Py_buffer header;
    long device_count;
    if (!PyArg_ParseTuple(args, "y*l:decode", &header, &device_count))
        return NULL;
    PyObject *out = check_bound() ? decode(header.buf, header.len, device_count) : NULL;
    PyBuffer_Release(&header);
    return out;
}

static PyObject *bind(PyObject *module, PyObject *args)
{
    (void)module;
    unsigned long long magic, plausible;
    unsigned long major;
    Py_ssize_t at[5], header_size, devices_offset, device_size, spent_offset;
    int max_devices;
    if (!PyArg_ParseTuple(args, "Kk(nnnnn)nnnnKi:bind", &magic, &major, &at[0], &at[1], &at[2],
                          &at[3], &at[4], &header_size, &devices_offset, &device_size,
                          &spent_offset, &plausible, &max_devices))
        return NULL;
    /* each prefix field inside the prefix, before the devices: 8 bytes for magic and total */
    int prefix_ok = 1;
    for (int i = 0; i < 5; i++) {
        Py_ssize_t width = i == 0 || i == 4 ? 8 : 4;
        prefix_ok = prefix_ok && at[i] >= 0 && at[i] + width <= devices_offset;
    }
    if (!prefix_ok || header_size > MAX_HEADER || max_devices < 1
        || max_devices > MAX_DEVICES_BOUND || devices_offset < 0 || spent_offset < 0
        || device_size < spent_offset + 24
        || devices_offset + max_devices * device_size > header_size || major > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "a state header layout this reader cannot hold: header %zd bytes (at most "
                     "%d), %d devices (1..%d) of %zd bytes from %zd (prefix fields before it), "
                     "totals at %zd",
                     header_size, MAX_HEADER, max_devices, MAX_DEVICES_BOUND, device_size,
                     devices_offset, spent_offset);
        return NULL;
    }
    memcpy(layout.at, at, sizeof at);
    layout.magic = magic;
    layout.major = (uint32_t)major;
    layout.header_size = header_size;
    layout.devices_offset = devices_offset;
    layout.device_size = device_size;
    layout.spent_offset = spent_offset;
    layout.plausible = plausible;
    layout.max_devices = max_devices;
    layout.bound = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS,
     "bind(magic, major, (magic_at, major_at, header_size_at, device_count_at, total_size_at), "
     "header_size, devices_offset, device_size, spent_offset, plausible, max_devices): the "
     "layout's numbers, once, before any read."},
    {"counters_at", counters_at, METH_VARARGS,
     "counters_at(fd, device_count): `layout.state_counters` of the header read from fd at "
     "offset 0; None when unreadable."},
    {"readings_many", readings_many, METH_VARARGS,
     "readings_many(fds, controls, (rate_word, burst_word, device_words)): per region, "
     "(counters, rates, policies, priority, monotonic ns before its read, after), `controls` "
     "holding (control words, policies, priority) per region."},
    {"readings_of", readings_of, METH_VARARGS,
     "readings_of(regions, region_type, now_ns, police_ns, (rate_word, burst_word, "
     "device_words)): `Region.readings_together`'s loop; (readings, indexes of corrupt "
     "headers)."},
    {"decode", decode_header, METH_VARARGS,
     "decode(header, device_count): `layout.state_counters(header, device_count)`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_statec", "The lean read of a `state` header in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__statec(void)
{
    return PyModule_Create(&module_def);
}
