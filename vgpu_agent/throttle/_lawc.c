/*
 * The control law for one GPU's containers in C: `fastlaw.control_step_gpu`, decision for
 * decision, float for float.
 *
 * Every float is computed by the operations the Python law uses, in its order: Python's `max`
 * and `min` (the first of equals, NaN kept where Python keeps it), `sum` as the running
 * interpreter sums floats (left to right before 3.12, Neumaier's compensated sum from 3.12 on),
 * `round` to even, `x ** 2` through libm's `pow` (called, never folded into x * x).
 * Contraction into fused multiply-adds is off (setup.py), so a * b + c rounds twice, as in
 * Python.
 *
 * Where Python would raise (a division by zero, `x ** 2` overflowing, `math.sqrt` of a negative
 * number) or where an input is not what the law makes (an int too large for a double to hold
 * exactly, a state that is not a LoopState), `step` returns None and `nativelaw` runs the Python
 * law instead: the answer, or the error, is then the reference's own.
 *
 * Pure: no I/O, no clocks, no state between calls but the record types bound at import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#define EPS 1e-9 /* control.py's _EPS, checked by bind() */
#define FULL_SHARE 100.0
#define ZERO_SPREAD 4.0 /* control.py's _ZERO_SPREAD, checked by bind() */
#define UNLIMITED ((int64_t)1 << 52)
#define TEXT_(x) #x
#define TEXT(x) TEXT_(x) /* a macro's value as a string literal */
#define EXACT_INT ((int64_t)1 << 53) /* ints beyond this do not convert to doubles exactly */

/* LoopState's fields */
enum { S_K, S_LOWER, S_HISTORY, S_COST, S_UTIL, S_SPREAD, S_NOISE, S_PAIRS, S_PAIR, S_FLOOR,
       S_TARGET, S_LEARNED, S_ADOPTED, S_HUNGRY, S_LENGTHS, S_SURPRISE, S_FIELDS };
/* Observation's fields */
enum { O_KEY, O_LIMIT, O_POLICY, O_PRIORITY, O_SPENT, O_LAUNCHES, O_WAITED, O_UTIL, O_RATE,
       O_BURST, O_SPAN, O_SAMPLES, O_FIELDS };
enum { OFF, STRICT, WORK_CONSERVING };

static PyTypeObject *loop_state_type, *decision_type;
static PyObject *blank; /* control._BLANK: a state is new by identity, as in the Python law */
static PyObject *unlimited_obj, *full_share_obj, *empty_tuple;

/* ----------------------------------------------------------------------- Python's arithmetic */

static inline double py_max(double a, double b) { return b > a ? b : a; }
static inline double py_min(double a, double b) { return b < a ? b : a; }

/* sum() of floats, as this interpreter computes it */
static double py_sum(const double *v, Py_ssize_t n)
{
    if (n <= 0)
        return 0.0;
    double total = 0.0 + v[0];
#if PY_VERSION_HEX >= 0x030C0000
    double c = 0.0;
    for (Py_ssize_t i = 1; i < n; i++) {
        double x = v[i], t = total + x;
        if (fabs(total) >= fabs(x))
            c += (total - t) + x;
        else
            c += (x - t) + total;
        total = t;
    }
    if (c != 0.0 && isfinite(c))
        total += c;
#else
    for (Py_ssize_t i = 1; i < n; i++)
        total += v[i];
#endif
    return total;
}

/* A call that Python would refuse sets this; the whole step is then handed back. */
typedef struct {
    int bail;
} Guard;

static inline double py_div(Guard *g, double a, double b)
{
    if (b == 0.0) {
        g->bail = 1; /* ZeroDivisionError in Python */
        return 0.0;
    }
    return a / b;
}

/* libm's pow, called: a compiler turns pow(x, 2.0) into x * x, which may round otherwise */
static double (*volatile libm_pow)(double, double) = pow;

static inline double py_square(Guard *g, double x)
{
    double r = libm_pow(fabs(x), 2.0);
    if (isinf(r) && isfinite(x))
        g->bail = 1; /* OverflowError in Python */
    return r;
}

static inline double py_round(double x)
{
    double r = round(x);
    if (fabs(x - r) == 0.5)
        r = 2.0 * round(x / 2.0);
    return r;
}

/* control._clamp_tokens: value within [low, UNLIMITED], rounded (or ceiled) */
static int64_t clamp_tokens(double value, int64_t low, int ceiled)
{
    if (!(value >= (double)low))
        return low;
    if (value >= (double)UNLIMITED)
        return UNLIMITED;
    int64_t t = (int64_t)(ceiled ? ceil(value) : py_round(value));
    if (t > UNLIMITED)
        t = UNLIMITED;
    return t > low ? t : low;
}

/* control._noise_shape */
static inline double noise_shape(double share, double tail)
{
    double p = py_min(1.0, py_max(0.0, share / FULL_SHARE));
    return py_max(tail, 4 * p * (1 - p));
}

/* ----------------------------------------------------------------------- reading the inputs */

static int as_double(PyObject *o, double *out)
{
    if (PyFloat_CheckExact(o)) {
        *out = PyFloat_AS_DOUBLE(o);
        return 1;
    }
    if (PyLong_Check(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || v > EXACT_INT || v < -EXACT_INT)
            return 0;
        *out = (double)v;
        return 1;
    }
    return 0;
}

static int as_float(PyObject *o, double *out) /* a float, not an int: sums treat those apart */
{
    if (!PyFloat_CheckExact(o))
        return 0;
    *out = PyFloat_AS_DOUBLE(o);
    return 1;
}

static int as_int(PyObject *o, int64_t *out)
{
    if (!PyLong_Check(o))
        return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || v > EXACT_INT || v < -EXACT_INT)
        return 0;
    *out = (int64_t)v;
    return 1;
}

static int as_flag(PyObject *o, int *out)
{
    int truth = PyObject_IsTrue(o);
    if (truth < 0) {
        PyErr_Clear();
        return 0;
    }
    *out = truth;
    return 1;
}

static int policy_of(PyObject *o, int *out)
{
    if (!PyUnicode_Check(o))
        return 0;
    if (PyUnicode_CompareWithASCIIString(o, "strict") == 0)
        *out = STRICT;
    else if (PyUnicode_CompareWithASCIIString(o, "work-conserving") == 0)
        *out = WORK_CONSERVING;
    else if (PyUnicode_CompareWithASCIIString(o, "off") == 0)
        *out = OFF;
    else
        return 0;
    return 1;
}

/* The tuning, as nativelaw packs it (see `_packed` there). */
typedef struct {
    double nvml_period, wait_fraction, spend_fraction, hysteresis, demand_margin,
        boot_widening, resolution, initial_var, drift2, noise_prior, noise_memory,
        held_tolerance, floor, surprise2, noise_tail, missing_above, partial,
        saturation_margin, cold_sigmas, rate_deadband, burst_s, burst_launches,
        relearn_weight, relearn_span, floor_trust2, saturation_sigmas;
    int64_t demand_ticks, cold_samples, min_rate, confirm;
} Params;

/* how many values nativelaw packs the tuning into (`bind` checks it) */
#define PARAMS 30

static int read_params(PyObject *t, Params *p)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != PARAMS)
        return 0;
    double *doubles[] = {&p->nvml_period, &p->wait_fraction, &p->spend_fraction, &p->hysteresis,
                         &p->demand_margin, &p->boot_widening, &p->resolution, &p->initial_var,
                         &p->drift2, &p->noise_prior, &p->noise_memory, &p->held_tolerance,
                         &p->floor, &p->surprise2, &p->noise_tail, &p->missing_above,
                         &p->partial, &p->saturation_margin, &p->cold_sigmas,
                         &p->rate_deadband, &p->burst_s, &p->burst_launches};
    for (int i = 0; i < 22; i++)
        if (!as_double(PyTuple_GET_ITEM(t, i), doubles[i]))
            return 0;
    return as_int(PyTuple_GET_ITEM(t, 22), &p->demand_ticks) && p->demand_ticks >= 1
        && as_int(PyTuple_GET_ITEM(t, 23), &p->cold_samples)
        && as_int(PyTuple_GET_ITEM(t, 24), &p->min_rate)
        && as_int(PyTuple_GET_ITEM(t, 25), &p->confirm)
        && as_double(PyTuple_GET_ITEM(t, 26), &p->relearn_weight)
        && as_double(PyTuple_GET_ITEM(t, 27), &p->relearn_span)
        && as_double(PyTuple_GET_ITEM(t, 28), &p->floor_trust2)
        && as_double(PyTuple_GET_ITEM(t, 29), &p->saturation_sigmas);
}

/* ----------------------------------------------------------------------- one container */

typedef struct {
    PyObject *prev, *key, *util_obj, *rate_obj, *burst_obj; /* borrowed */
    int policy, prev_blank, prev_hungry;
    double limit, waited, span, util;
    int64_t priority, spent, launches, rate, burst, samples;
    int has_util;
    /* what was learned: LoopState's fields less the target */
    double prev_k, k, cost, spread, noise, k_floor, pair_x, surprise;
    int lower_bound, adopted, hungry, pair_new;
    int64_t pairs, learned;
    double *hist; /* the new history: hist_len entries in the shared buffer */
    Py_ssize_t hist_len;
    PyObject *last_util, *pair_old, *prev_history; /* borrowed */
    PyObject *lengths; /* owned */
    double demand, target;
    int claim_hungry;
} Ctr;

typedef struct {
    double *weights;
    Py_ssize_t n, first;
    double total, later_total;
} Window;

/* control.span_weights over `lengths` (n of them), with fastlaw._window's sums */
static void make_window(double span, const double *lengths, Py_ssize_t n, double *weights,
                        Window *w)
{
    double end = lengths[n - 1] / 2, start = end + span, hi = 0.0;
    for (Py_ssize_t j = n - 1; j >= 0; j--) {
        double lo = hi;
        hi = hi + lengths[j];
        weights[j] = py_max(0.0, py_min(hi, start) - py_max(lo, end)) / span;
    }
    Py_ssize_t first = 0;
    while (first < n && weights[first] == 0.0)
        first++;
    w->weights = weights;
    w->n = n;
    w->first = first;
    w->total = py_sum(weights, n);
    w->later_total = py_sum(weights, n - 1);
}

/* fastlaw._matched: (spending over the window, how far off it may be) */
static void matched(const double *history, Py_ssize_t h_len, const Window *win, double partial,
                    double *scratch, double *out_x, double *out_off)
{
    const double *weights = win->weights;
    Py_ssize_t n = win->n, first = win->first;
    double total = win->total, later_total = win->later_total, unknown = 0.0;
    const double *hist;
    *out_x = *out_off = 0.0;
    if (h_len < n) {
        Py_ssize_t cut = n - h_len;
        unknown = py_sum(weights, cut);
        if (unknown > partial || h_len == 0)
            return;
        if (unknown > EPS) {
            for (Py_ssize_t j = 0; j < cut; j++)
                scratch[j] = history[0];
            memcpy(scratch + cut, history, (size_t)h_len * sizeof(double));
            hist = scratch;
        } else {
            weights += cut;
            n = h_len;
            first = first - cut > 0 ? first - cut : 0;
            total = py_sum(weights, n);
            later_total = py_sum(weights, n - 1);
            hist = history;
        }
    } else {
        hist = history + (h_len - n);
    }
    if (total <= EPS)
        return;
    Py_ssize_t covered = n - first;
    double *products = scratch + n; /* after the stand-in history, when there is one */
    for (Py_ssize_t j = 0; j < covered; j++)
        products[j] = hist[first + j] * weights[first + j];
    double x = py_sum(products, covered) / total;
    for (Py_ssize_t j = 0; j + 1 < covered; j++)
        products[j] = hist[first + 1 + j] * weights[first + j];
    double later = py_sum(products, covered - 1);
    double shifted = later_total > EPS ? later / later_total : x;
    double off = fabs(shifted - x);
    if (unknown > EPS)
        off = py_max(off, unknown * hist[0]);
    *out_x = x;
    *out_off = off;
}

static int read_observation(PyObject *o, Ctr *c)
{
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != O_FIELDS)
        return 0;
    c->key = PyTuple_GET_ITEM(o, O_KEY);
    c->util_obj = PyTuple_GET_ITEM(o, O_UTIL);
    c->rate_obj = PyTuple_GET_ITEM(o, O_RATE);
    c->burst_obj = PyTuple_GET_ITEM(o, O_BURST);
    c->has_util = c->util_obj != Py_None;
    c->util = 0.0;
    return PyUnicode_Check(c->key)
        && as_float(PyTuple_GET_ITEM(o, O_LIMIT), &c->limit)
        && policy_of(PyTuple_GET_ITEM(o, O_POLICY), &c->policy)
        && as_int(PyTuple_GET_ITEM(o, O_PRIORITY), &c->priority)
        && as_int(PyTuple_GET_ITEM(o, O_SPENT), &c->spent)
        && as_int(PyTuple_GET_ITEM(o, O_LAUNCHES), &c->launches)
        && as_double(PyTuple_GET_ITEM(o, O_WAITED), &c->waited)
        && (!c->has_util || as_float(c->util_obj, &c->util))
        && as_int(c->rate_obj, &c->rate)
        && as_int(c->burst_obj, &c->burst)
        && as_double(PyTuple_GET_ITEM(o, O_SPAN), &c->span)
        && as_int(PyTuple_GET_ITEM(o, O_SAMPLES), &c->samples) && c->samples >= 1;
}

/* The container's tick lengths after this tick (control.tick_lengths), as a tuple; the
 * containers of a GPU share theirs, so the one made for the container before is reused. */
static PyObject *tick_lengths(PyObject *prev_lengths, Py_ssize_t kept, PyObject *dt_obj,
                              Py_ssize_t history_len, PyObject **cache_src,
                              Py_ssize_t *cache_kept, PyObject **cache)
{
    if (*cache != NULL && *cache_src == prev_lengths && *cache_kept == kept) {
        Py_INCREF(*cache);
        return *cache;
    }
    Py_ssize_t have = PyTuple_GET_SIZE(prev_lengths);
    Py_ssize_t known = kept ? (have < kept ? have : kept) : 0;
    Py_ssize_t total = kept - known + known + 1; /* missing ones as dt, the known, the new */
    Py_ssize_t skip = total > history_len ? total - history_len : 0;
    PyObject *out = PyTuple_New(total - skip);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = skip; i < total; i++) {
        PyObject *item;
        if (i < kept - known)
            item = dt_obj;
        else if (i < kept)
            item = PyTuple_GET_ITEM(prev_lengths, have - known + (i - (kept - known)));
        else
            item = dt_obj;
        Py_INCREF(item);
        PyTuple_SET_ITEM(out, i - skip, item);
    }
    Py_XDECREF(*cache);
    Py_INCREF(out);
    *cache = out;
    *cache_src = prev_lengths;
    *cache_kept = kept;
    return out;
}

/* ----------------------------------------------------------------------- the allocation */

/* control._water_fill: `amount` split by `weights`, nobody above their cap, into `given` */
static void water_fill(double amount, const double *weights, const double *caps, Py_ssize_t n,
                       double *given, Py_ssize_t *open_at, double *scratch)
{
    Py_ssize_t open = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        given[i] = 0.0;
        if (caps[i] > EPS && weights[i] > 0)
            open_at[open++] = i;
    }
    while (amount > EPS && open) {
        for (Py_ssize_t j = 0; j < open; j++)
            scratch[j] = weights[open_at[j]];
        double total_weight = py_sum(scratch, open);
        double room = 0.0;
        for (Py_ssize_t j = 0; j < open; j++) {
            Py_ssize_t i = open_at[j];
            double r = (caps[i] - given[i]) * total_weight / weights[i];
            room = j ? py_min(room, r) : r;
        }
        double step = py_min(amount, room);
        for (Py_ssize_t j = 0; j < open; j++) {
            Py_ssize_t i = open_at[j];
            given[i] += step * weights[i] / total_weight;
        }
        amount -= step;
        Py_ssize_t still = 0;
        for (Py_ssize_t j = 0; j < open; j++)
            if (caps[open_at[j]] - given[open_at[j]] > EPS)
                open_at[still++] = open_at[j];
        open = still;
    }
}

typedef struct {
    double *weights, *wants, *gifts, *scratch;
    Py_ssize_t *members, *open_at;
    int64_t *levels;
} AllocScratch;

/* control._by_priority: granted per claim; `order` the order granted in (NULL: the claims') */
static int by_priority(const int64_t *priorities, const double *limits, const double *wants,
                       Py_ssize_t n, double capacity, double *granted, Py_ssize_t *order,
                       AllocScratch *s)
{
    Py_ssize_t levels = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int seen = 0;
        for (Py_ssize_t j = 0; j < levels; j++)
            seen |= s->levels[j] == priorities[i];
        if (!seen)
            s->levels[levels++] = priorities[i];
    }
    if (levels <= 1) {
        water_fill(capacity, limits, wants, n, granted, s->open_at, s->scratch);
        return 0;
    }
    /* highest level first */
    for (Py_ssize_t i = 1; i < levels; i++)
        for (Py_ssize_t j = i; j > 0 && s->levels[j] > s->levels[j - 1]; j--) {
            int64_t t = s->levels[j];
            s->levels[j] = s->levels[j - 1];
            s->levels[j - 1] = t;
        }
    double left = capacity;
    Py_ssize_t ordered = 0;
    for (Py_ssize_t l = 0; l < levels; l++) {
        Py_ssize_t m = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (priorities[i] == s->levels[l]) {
                s->members[m] = i;
                s->weights[m] = limits[i];
                s->wants[m] = wants[i];
                m++;
            }
        water_fill(left, s->weights, s->wants, m, s->gifts, s->open_at, s->scratch);
        for (Py_ssize_t j = 0; j < m; j++) {
            granted[s->members[j]] = s->gifts[j];
            order[ordered++] = s->members[j];
        }
        left = py_max(0.0, left - py_sum(s->gifts, m));
    }
    return 1;
}

/* fastlaw._allocate: each limited claim's target, into its container */
static void allocate(Ctr *ctrs, Py_ssize_t n, double capacity, double *buf, Py_ssize_t *ibuf,
                     int64_t *lbuf)
{
    Py_ssize_t m = 0;
    Ctr **limited = (Ctr **)(ibuf + 4 * n);
    for (Py_ssize_t i = 0; i < n; i++)
        if (ctrs[i].policy != OFF)
            limited[m++] = &ctrs[i];
    double *limits = buf, *wants = buf + n, *guarantee = buf + 2 * n, *used = buf + 3 * n,
           *caps = buf + 4 * n, *lent = buf + 5 * n, *ordered = buf + 6 * n;
    int64_t *priorities = lbuf;
    AllocScratch s = {buf + 7 * n, buf + 8 * n, buf + 9 * n, buf + 10 * n,
                      ibuf, ibuf + n, lbuf + n};
    Py_ssize_t *order = ibuf + 2 * n, *unused_order = ibuf + 3 * n;
    for (Py_ssize_t j = 0; j < m; j++) {
        priorities[j] = limited[j]->priority;
        limits[j] = limited[j]->limit;
    }
    int has_order = by_priority(priorities, limits, limits, m, capacity, guarantee, order, &s);
    for (Py_ssize_t j = 0; j < m; j++) {
        Ctr *c = limited[j];
        wants[j] = c->claim_hungry ? c->limit : py_min(c->limit, c->demand);
    }
    by_priority(priorities, limits, wants, m, capacity, used, unused_order, &s);
    double spare;
    if (has_order) {
        for (Py_ssize_t j = 0; j < m; j++)
            ordered[j] = used[order[j]];
        spare = capacity - py_sum(ordered, m);
    } else {
        spare = capacity - py_sum(used, m);
    }
    for (Py_ssize_t j = 0; j < m; j++) {
        Ctr *c = limited[j];
        double ceiling;
        if (c->policy == WORK_CONSERVING)
            ceiling = c->claim_hungry ? INFINITY : py_max(c->demand, used[j]);
        else
            ceiling = c->claim_hungry ? c->limit : py_min(c->limit, c->demand);
        caps[j] = py_max(0.0, ceiling - used[j]);
    }
    water_fill(spare, limits, caps, m, lent, s.open_at, s.scratch);
    for (Py_ssize_t j = 0; j < m; j++)
        limited[j]->target = py_min(capacity, py_max(guarantee[j], used[j] + lent[j]));
}

/* ----------------------------------------------------------------------- records */

static PyObject *record(PyTypeObject *type, PyObject **items, Py_ssize_t n)
{
    PyObject *t = type->tp_alloc(type, n); /* steals `items` */
    if (t == NULL) {
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(items[i]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == NULL) {
            Py_DECREF(t);
            for (Py_ssize_t j = i + 1; j < n; j++)
                Py_XDECREF(items[j]);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, items[i]);
    }
    return t;
}

static PyObject *ref(PyObject *o)
{
    Py_INCREF(o);
    return o;
}

static PyObject *history_tuple(const Ctr *c, PyObject *spend_obj)
{
    if (c->hist_len == 0)
        return ref(empty_tuple);
    PyObject *out = PyTuple_New(c->hist_len);
    if (out == NULL)
        return NULL;
    /* the entries carried over are the previous history's own objects */
    Py_ssize_t carried = c->hist_len - 1, have = PyTuple_GET_SIZE(c->prev_history);
    for (Py_ssize_t i = 0; i < carried; i++)
        PyTuple_SET_ITEM(out, i, ref(PyTuple_GET_ITEM(c->prev_history, have - carried + i)));
    PyTuple_SET_ITEM(out, carried, ref(spend_obj));
    return out;
}

static PyObject *state_of(const Ctr *c, PyObject *history, PyObject *target)
{
    PyObject *pair;
    if (c->pair_new) {
        PyObject *items[2] = {PyFloat_FromDouble(c->pair_x), ref(c->util_obj)};
        pair = items[0] ? PyTuple_Pack(2, items[0], items[1]) : NULL;
        Py_XDECREF(items[0]);
        Py_DECREF(items[1]);
    } else {
        pair = ref(c->pair_old);
    }
    PyObject *items[S_FIELDS] = {
        PyFloat_FromDouble(c->k), ref(c->lower_bound ? Py_True : Py_False), ref(history),
        PyFloat_FromDouble(c->cost), ref(c->last_util), PyFloat_FromDouble(c->spread),
        PyFloat_FromDouble(c->noise), PyLong_FromLongLong(c->pairs), pair,
        PyFloat_FromDouble(c->k_floor), target, PyLong_FromLongLong(c->learned),
        ref(c->adopted ? Py_True : Py_False), ref(c->hungry ? Py_True : Py_False),
        ref(c->lengths), PyFloat_FromDouble(c->surprise)};
    return record(loop_state_type, items, S_FIELDS);
}

static PyObject *decision(PyObject *rate, PyObject *burst, PyObject *target, int hungry,
                          double demand, PyObject *state)
{
    PyObject *items[6] = {rate, burst, target, ref(hungry ? Py_True : Py_False),
                          PyFloat_FromDouble(demand), state};
    return record(decision_type, items, 6);
}

/* ----------------------------------------------------------------------- the step */

/* step(observations, states, dt_s, params, history_len) -> dict of Decision, or None */
static PyObject *step(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *observations, *states, *dt_obj, *params_obj;
    Py_ssize_t history_len;
    if (!PyArg_ParseTuple(args, "O!O!O!O!n", &PyList_Type, &observations, &PyDict_Type,
                          &states, &PyFloat_Type, &dt_obj, &PyTuple_Type, &params_obj,
                          &history_len))
        return NULL;
    if (loop_state_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind() the record types first");
        return NULL;
    }
    Params p;
    double dt = PyFloat_AS_DOUBLE(dt_obj);
    Py_ssize_t n = PyList_GET_SIZE(observations);
    if (!read_params(params_obj, &p) || !(dt > 0) || history_len < 1 || history_len > 100000)
        Py_RETURN_NONE;
    if (n == 0)
        return PyDict_New();

    Guard g = {0};
    PyObject *result = NULL, *lengths_src = NULL, *lengths_cache = NULL;
    Py_ssize_t lengths_kept = -1;
    Py_ssize_t hl = history_len;
    /* one allocation for every array of the step */
    size_t doubles = (size_t)n * (size_t)hl          /* histories */
                   + 3 * (size_t)hl + 2 * (size_t)hl /* window lengths, weights, scratch */
                   + 14 * (size_t)n; /* the allocation's, the uses and their doubts */
    Ctr *ctrs = PyMem_Calloc((size_t)n, sizeof(Ctr));
    double *dbuf = PyMem_Malloc(doubles * sizeof(double));
    Py_ssize_t *ibuf = PyMem_Malloc((size_t)n * (4 * sizeof(Py_ssize_t) + sizeof(Ctr *)));
    int64_t *lbuf = PyMem_Malloc(2 * (size_t)n * sizeof(int64_t));
    if (ctrs == NULL || dbuf == NULL || ibuf == NULL || lbuf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double *histories = dbuf, *wlengths = dbuf + (size_t)n * hl, *weights = wlengths + hl,
           *scratch = weights + hl, *alloc_buf = scratch + 3 * hl, *off_uses = alloc_buf + 11 * n,
           *uses = off_uses + n, *doubts = uses + n;

    double wait_fraction = p.wait_fraction * dt, drift = p.drift2 * dt;
    Py_ssize_t off_count = 0; /* what `off` containers use, summed as `sum` does */
    for (Py_ssize_t i = 0; i < n; i++) {
        Ctr *c = &ctrs[i];
        if (!read_observation(PyList_GET_ITEM(observations, i), c))
            goto bail;
        PyObject *prev = PyDict_GetItemWithError(states, c->key);
        if (prev == NULL) {
            if (PyErr_Occurred())
                goto done;
            prev = blank;
        }
        if (!PyTuple_Check(prev) || PyTuple_GET_SIZE(prev) != S_FIELDS)
            goto bail;
        c->prev = prev;
        c->prev_blank = prev == blank;
        PyObject *prev_history = PyTuple_GET_ITEM(prev, S_HISTORY);
        PyObject *prev_lengths = PyTuple_GET_ITEM(prev, S_LENGTHS);
        PyObject *pair = PyTuple_GET_ITEM(prev, S_PAIR);
        if (!PyTuple_Check(prev_history) || !PyTuple_Check(prev_lengths) || !PyTuple_Check(pair)
            || PyTuple_GET_SIZE(pair) != 2)
            goto bail;
        c->prev_history = prev_history;

        double spend_rate = (double)c->spent / dt;
        /* the history with this tick's spending, newest last, at most history_len long */
        Py_ssize_t had = PyTuple_GET_SIZE(prev_history);
        Py_ssize_t kept = had + 1 > hl ? hl - 1 : had;
        double *hist = histories + (size_t)i * hl;
        for (Py_ssize_t j = 0; j < kept; j++)
            if (!as_float(PyTuple_GET_ITEM(prev_history, had - kept + j), &hist[j]))
                goto bail;
        hist[kept] = spend_rate;
        Py_ssize_t h_len = kept + 1;

        double prev_cost, prev_spread, prev_noise, prev_floor, held_x, held_y;
        int prev_lower, prev_adopted;
        if (!as_double(PyTuple_GET_ITEM(prev, S_K), &c->prev_k)
            || !as_flag(PyTuple_GET_ITEM(prev, S_LOWER), &prev_lower)
            || !as_double(PyTuple_GET_ITEM(prev, S_COST), &prev_cost)
            || !as_double(PyTuple_GET_ITEM(prev, S_SPREAD), &prev_spread)
            || !as_double(PyTuple_GET_ITEM(prev, S_NOISE), &prev_noise)
            || !as_int(PyTuple_GET_ITEM(prev, S_PAIRS), &c->pairs)
            || !as_double(PyTuple_GET_ITEM(pair, 0), &held_x)
            || !as_double(PyTuple_GET_ITEM(pair, 1), &held_y)
            || !as_double(PyTuple_GET_ITEM(prev, S_FLOOR), &prev_floor)
            || !as_int(PyTuple_GET_ITEM(prev, S_LEARNED), &c->learned)
            || !as_flag(PyTuple_GET_ITEM(prev, S_ADOPTED), &prev_adopted)
            || !as_flag(PyTuple_GET_ITEM(prev, S_HUNGRY), &c->prev_hungry)
            || !as_double(PyTuple_GET_ITEM(prev, S_SURPRISE), &c->surprise))
            goto bail;

        if (c->prev_blank) {
            c->lengths = ref(empty_tuple);
        } else {
            c->lengths = tick_lengths(prev_lengths, had, dt_obj, hl, &lengths_src,
                                      &lengths_kept, &lengths_cache);
            if (c->lengths == NULL)
                goto done;
        }
        double cost = prev_cost * 0.99;
        if (c->launches)
            cost = py_max(cost, (double)c->spent / (double)c->launches);
        int waited = c->waited >= wait_fraction;
        Py_ssize_t recent = h_len < p.demand_ticks ? h_len : (Py_ssize_t)p.demand_ticks;
        double fraction = p.spend_fraction - (c->prev_hungry ? p.hysteresis : 0.0);
        /* `control._judged_rate`: no more than its own limit's rate where a loan raised it */
        double judged = (double)c->rate;
        if (c->prev_hungry && c->prev_k > 0) {
            double prev_target;
            if (!as_double(PyTuple_GET_ITEM(prev, S_TARGET), &prev_target))
                goto bail;
            if (prev_target > c->limit)
                judged = py_min(judged, c->prev_k * c->limit);
        }
        int hungry = waited
            || (c->rate < UNLIMITED
                && py_max(spend_rate, py_sum(hist + h_len - recent, recent) / (double)recent)
                       >= fraction * judged);

        double k = c->prev_k, spread = prev_spread, k_floor = prev_floor;
        double noise = prev_noise != 0.0 ? prev_noise : p.noise_prior;
        int lower_bound = prev_lower, adopted = prev_adopted;
        c->pair_old = pair;
        c->pair_new = 0;
        if (k <= 0 && spend_rate > 0 && c->rate >= UNLIMITED) {
            double share_bound = FULL_SHARE;
            if (c->has_util && c->util >= 1)
                share_bound = py_min(FULL_SHARE, p.boot_widening * c->util + 1);
            k = spend_rate / share_bound;
            lower_bound = 1;
            k_floor = spend_rate / FULL_SHARE;
            spread = p.initial_var;
        } else if (k > 0) {
            spread += drift;
        }
        if (c->prev_blank)
            h_len = 0;
        if (c->has_util) {
            double span = c->span != 0.0 ? c->span : p.nvml_period;
            /* the window's lengths: before the history, ticks of dt */
            Py_ssize_t have = PyTuple_GET_SIZE(c->lengths), pad = hl - have;
            for (Py_ssize_t j = 0; j < pad; j++)
                wlengths[j] = dt;
            for (Py_ssize_t j = 0; j < have; j++)
                if (!as_double(PyTuple_GET_ITEM(c->lengths, j), &wlengths[pad + j]))
                    goto bail;
            Window win;
            make_window(span, wlengths, hl, weights, &win);
            double util = c->util;
            if (k <= 0) {
                if (util >= p.resolution) {
                    double x, unused;
                    matched(hist, h_len, &win, p.partial, scratch, &x, &unused);
                    if (x > 0) {
                        spread = py_div(&g, py_div(&g, py_max(noise * noise_shape(util,
                                                                 p.noise_tail), p.floor),
                                                   (double)c->samples),
                                        py_square(&g, util));
                        k = py_div(&g, x, util);
                        c->pair_x = x;
                        c->pair_new = 1;
                        adopted = 1;
                        c->learned += 1;
                    }
                }
            } else if (k > 0) {
                double x, misaligned;
                matched(hist, h_len, &win, p.partial, scratch, &x, &misaligned);
                if (x <= 0) {
                    /* idle as long as the history holds (control.py) */
                    int idle = 1;
                    for (Py_ssize_t j = 0; j < h_len && idle; j++)
                        idle = hist[j] == 0.0;
                    if (idle)
                        c->surprise = 0.0;
                }
                if (x > 0 && util < p.resolution && x / k > p.missing_above) {
                    /* NVML missed its processes, once; twice in a row, a bound (control.py) */
                    double expected = x / k;
                    double scatter = py_div(&g, py_max(noise * noise_shape(expected,
                                                                           p.noise_tail),
                                                       p.floor),
                                            (double)c->samples);
                    /* further off than noise reaches (control.py's _zero_off), or read
                       while the estimate is too loose to learn from it and further off than
                       the noise alone reaches from it (control.py) */
                    if (expected * expected > p.surprise2 * (expected * expected * spread + scatter)
                        || (spread * p.surprise2 * ZERO_SPREAD > 1
                            && expected * expected > p.surprise2 * scatter)) {
                        if (c->learned && c->surprise < 0) {
                            k = py_max(k, x / p.resolution);
                            k_floor = 0.0;
                            c->surprise = 0.0;
                            spread = py_max(spread, p.initial_var);
                            c->learned += 1;
                        } else {
                            c->surprise = -x / k;
                        }
                        x = 0.0;
                    }
                }
                if (x > 0) {
                    double b = 1 / k;
                    double shape = noise_shape(b * x, p.noise_tail);
                    /* no noise learned where the shape is only its floor (control.py) */
                    if (shape > p.noise_tail && held_x > 0
                        && fabs(x - held_x) <= p.held_tolerance * py_max(x, held_x)) {
                        double seen = py_div(
                            &g,
                            py_square(&g, util - py_div(&g, held_y * x, held_x)) / 2
                                * (double)c->samples,
                            shape);
                        seen = py_min(seen, p.surprise2 * noise); /* a change, not noise */
                        double weight = py_max(p.noise_memory,
                                               py_div(&g, 1, (double)(c->pairs + 2)));
                        noise = py_max(p.floor, (1 - weight) * noise + weight * seen);
                        c->pairs += 1;
                    }
                    c->pair_x = x;
                    c->pair_new = 1;
                    double alignment = py_square(&g, b * misaligned);
                    double r = py_div(&g, py_max(noise * shape, p.floor), (double)c->samples)
                        + alignment;
                    double pv = spread * b * b;
                    double innovation = util - b * x;
                    double bound = p.surprise2 * (x * x * pv + r);
                    int far = innovation * innovation > bound, relearn = 0;
                    if (c->surprise * innovation > 0 || (far && (b == 0 || !p.confirm))) {
                        /* far off, then off the same way again: a changed workload */
                        pv = py_max(pv, py_square(&g, innovation / x));
                        k_floor = 0.0;
                        c->surprise = 0.0;
                        relearn = (int)p.confirm;
                    } else if (!far) {
                        c->surprise = 0.0;
                    } else {
                        /* once: an outlier until the next measurement (control.py) */
                        c->surprise = innovation;
                        innovation = copysign(sqrt(bound), innovation);
                    }
                    double gain = py_div(&g, pv * x, x * x * pv + r);
                    b = py_max(b + gain * innovation, EPS * b);
                    pv *= 1 - gain * x;
                    if (relearn) { /* one reading, or a part of one where samples come often */
                        double weight = span <= p.relearn_span ? p.relearn_weight : 1.0;
                        pv = py_max(pv, py_div(&g, r, weight * x * x));
                    }
                    k = py_max(py_div(&g, 1, b), k_floor);
                    spread = pv * k * k;
                    lower_bound = 0;
                    c->learned += 1;
                    if (spread <= p.floor_trust2)
                        k_floor = 0.0; /* the estimate knows k better than the bound */
                }
            }
        }
        if (g.bail)
            goto bail;
        double demand = 0.0;
        if (k > 0) {
            double peak = 0.0;
            Py_ssize_t from = h_len - (h_len < p.demand_ticks ? h_len : p.demand_ticks);
            for (Py_ssize_t j = from; j < h_len; j++)
                peak = j > from ? py_max(peak, hist[j]) : hist[j];
            demand = peak / k + p.demand_margin;
        }
        c->last_util = c->has_util ? c->util_obj : PyTuple_GET_ITEM(prev, S_UTIL);
        c->k = k;
        c->lower_bound = lower_bound;
        c->hist = hist;
        c->hist_len = h_len;
        c->cost = cost;
        c->spread = spread;
        c->noise = noise;
        c->k_floor = k_floor;
        c->adopted = adopted;
        c->hungry = hungry;
        c->demand = demand;
        if (c->policy == OFF && c->last_util != Py_None) {
            double used;
            int truth = PyObject_IsTrue(c->last_util);
            if (truth < 0)
                goto done;
            if (truth) {
                if (!as_float(c->last_util, &used))
                    goto bail;
            } else {
                used = 0.0;
            }
            off_uses[off_count++] = used;
        }
    }

    /* control.guess_newcomers */
    {
        Py_ssize_t fresh = 0, spending = 0;
        int any_wc = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            Ctr *c = &ctrs[i];
            int is_new = c->prev_k <= 0 && c->lower_bound && c->k == c->k_floor && c->k_floor > 0
                && c->learned == 0;
            lbuf[i] = is_new;
            fresh += is_new;
            any_wc |= is_new && c->policy == WORK_CONSERVING;
        }
        if (any_wc) {
            double others = 0.0;
            for (Py_ssize_t i = 0; i < n; i++) {
                Ctr *c = &ctrs[i];
                if (c->hist_len && c->hist[c->hist_len - 1] > 0) {
                    spending++;
                    if (!lbuf[i] && c->k > 0)
                        others += c->hist[c->hist_len - 1] / c->k;
                }
            }
            double left = py_max(FULL_SHARE - others,
                                 FULL_SHARE * (double)fresh
                                     / (double)(spending > fresh ? spending : fresh) / 2);
            double share = left / (double)fresh;
            for (Py_ssize_t i = 0; i < n; i++) {
                Ctr *c = &ctrs[i];
                if (!lbuf[i] || c->policy != WORK_CONSERVING)
                    continue;
                double k = py_div(&g, c->k_floor * FULL_SHARE, share);
                if (g.bail)
                    goto bail;
                c->k = k;
                double peak = 0.0;
                Py_ssize_t from = c->hist_len
                    - (c->hist_len < p.demand_ticks ? c->hist_len : p.demand_ticks);
                for (Py_ssize_t j = from; j < c->hist_len; j++)
                    peak = j > from ? py_max(peak, c->hist[j]) : c->hist[j];
                c->demand = py_div(&g, peak, k) + p.demand_margin;
                if (g.bail)
                    goto bail;
            }
        }
    }

    Py_ssize_t using = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Ctr *c = &ctrs[i];
        if (c->k > 0 && c->hist_len) {
            double use = c->hist[c->hist_len - 1] / c->k;
            doubts[using] = use * use * c->spread;
            uses[using++] = use;
        }
    }
    double in_use = py_sum(uses, using), doubt2 = py_sum(doubts, using);
    if (doubt2 < 0) /* ValueError from math.sqrt in Python (a state with a negative spread) */
        goto bail;
    double doubt = sqrt(doubt2);
    int full = in_use + p.saturation_sigmas * doubt >= FULL_SHARE - p.saturation_margin;
    for (Py_ssize_t i = 0; i < n; i++) {
        Ctr *c = &ctrs[i];
        c->claim_hungry = c->hungry || (full && c->hist_len && c->hist[c->hist_len - 1] > 0);
    }
    allocate(ctrs, n, py_max(0.0, FULL_SHARE - py_sum(off_uses, off_count)), alloc_buf, ibuf,
             lbuf);

    result = PyDict_New();
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Ctr *c = &ctrs[i];
        if (c->policy != OFF && !isfinite(c->k))
            c->k = 0.0;
        PyObject *spend_obj = PyFloat_FromDouble((double)c->spent / dt);
        if (spend_obj == NULL)
            goto fail;
        PyObject *history = history_tuple(c, spend_obj);
        Py_DECREF(spend_obj);
        if (history == NULL)
            goto fail;
        PyObject *made = NULL, *prev_target = PyTuple_GET_ITEM(c->prev, S_TARGET);
        if (c->policy == OFF) {
            PyObject *state = state_of(c, history, ref(prev_target));
            made = state ? decision(ref(unlimited_obj), ref(unlimited_obj), ref(full_share_obj),
                                    c->hungry, c->demand, state)
                         : NULL;
        } else if (c->k <= 0 || (c->adopted && c->learned < p.cold_samples
                                 && c->rate < UNLIMITED)) {
            PyObject *state = state_of(c, history, ref(prev_target));
            PyObject *kept_rate = c->rate < UNLIMITED ? c->rate_obj : unlimited_obj;
            PyObject *kept_burst = c->rate < UNLIMITED ? c->burst_obj : unlimited_obj;
            made = state ? decision(ref(kept_rate), ref(kept_burst),
                                    PyFloat_FromDouble(c->target), c->hungry, c->demand, state)
                         : NULL;
        } else {
            double k_rate = c->k;
            if (c->policy == STRICT && 0 < c->learned && c->learned < p.cold_samples
                && p.cold_sigmas != 0.0) {
                if (c->spread < 0) { /* ValueError from math.sqrt in Python */
                    Py_DECREF(history);
                    Py_CLEAR(result);
                    goto bail;
                }
                double fade = 1 - (double)c->learned / (double)p.cold_samples;
                k_rate /= 1 + p.cold_sigmas * fade * sqrt(c->spread);
                k_rate = py_max(k_rate, c->k_floor);
            }
            int64_t rate = clamp_tokens(k_rate * c->target, p.min_rate, 0);
            PyObject *target = PyFloat_FromDouble(c->target);
            if (target == NULL) {
                Py_DECREF(history);
                goto fail;
            }
            PyObject *state = state_of(c, history, ref(target));
            int64_t change = rate - c->rate;
            int64_t by_launch = clamp_tokens(p.burst_launches * c->cost, 1, 1);
            if (state == NULL) {
                Py_DECREF(target);
            } else if (c->rate < UNLIMITED
                       && (double)(change < 0 ? -change : change)
                              <= p.rate_deadband * (double)c->rate) {
                /* the bucket kept unless the launches grew past it (control.py) */
                int64_t deeper = by_launch < c->rate ? by_launch : c->rate;
                made = decision(ref(c->rate_obj),
                                c->burst >= deeper ? ref(c->burst_obj)
                                                   : PyLong_FromLongLong(deeper),
                                target, c->hungry, c->demand, state);
            } else {
                /* room for the largest launches, up to a second of refill (control.py) */
                int64_t by_time = clamp_tokens((double)rate * p.burst_s, 1, 0);
                int64_t room = by_launch < rate ? by_launch : rate;
                made = decision(PyLong_FromLongLong(rate),
                                PyLong_FromLongLong(room > by_time ? room : by_time),
                                target, c->hungry, c->demand, state);
            }
        }
        Py_DECREF(history);
        if (made == NULL)
            goto fail;
        int failed = PyDict_SetItem(result, c->key, made);
        Py_DECREF(made);
        if (failed)
            goto fail;
    }
    goto done;

fail:
    Py_CLEAR(result);
    goto done;
bail:
    Py_CLEAR(result);
    result = ref(Py_None);
done:
    if (ctrs != NULL)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(ctrs[i].lengths);
    Py_XDECREF(lengths_cache);
    PyMem_Free(ctrs);
    PyMem_Free(dbuf);
    PyMem_Free(ibuf);
    PyMem_Free(lbuf);
    return result;
}

/* bind(LoopState, Decision, _BLANK, UNLIMITED_RATE, FULL_SHARE, _ZERO_SPREAD, _EPS, params) */
static PyObject *bind(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *state, *dec, *blank_obj, *unlimited, *full;
    double zero_spread, eps;
    Py_ssize_t params;
    if (!PyArg_ParseTuple(args, "O!O!OO!O!ddn", &PyType_Type, &state, &PyType_Type, &dec,
                          &blank_obj, &PyLong_Type, &unlimited, &PyFloat_Type, &full,
                          &zero_spread, &eps, &params))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)state, &PyTuple_Type)
        || !PyType_IsSubtype((PyTypeObject *)dec, &PyTuple_Type)
        || !PyObject_TypeCheck(blank_obj, (PyTypeObject *)state)
        || PyTuple_GET_SIZE(blank_obj) != S_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "bind() takes the LoopState and Decision tuple types "
                                         "and a blank LoopState");
        return NULL;
    }
    int64_t value;
    if (!as_int(unlimited, &value) || value != UNLIMITED
        || PyFloat_AS_DOUBLE(full) != FULL_SHARE) {
        PyErr_SetString(PyExc_ValueError, "UNLIMITED_RATE and FULL_SHARE differ from the "
                                          "values this module was built with");
        return NULL;
    }
    /* the law's constants are compiled in: a reference law changed without this module
       would otherwise decide differently only in the branches that use them */
    if (zero_spread != ZERO_SPREAD || eps != EPS) {
        PyErr_Format(PyExc_ValueError, "_ZERO_SPREAD %R and _EPS %R differ from the values "
                                       "this module was built with (" TEXT(ZERO_SPREAD) ", "
                                       TEXT(EPS) ")",
                     PyTuple_GET_ITEM(args, 5), PyTuple_GET_ITEM(args, 6));
        return NULL;
    }
    /* tuning packed otherwise would leave every step to the Python law, unsaid */
    if (params != PARAMS) {
        PyErr_Format(PyExc_ValueError, "the tuning comes as %zd values; this module was built "
                                       "for " TEXT(PARAMS), params);
        return NULL;
    }
    Py_INCREF(state);
    Py_INCREF(dec);
    Py_INCREF(blank_obj);
    Py_INCREF(unlimited);
    Py_INCREF(full);
    Py_XSETREF(loop_state_type, (PyTypeObject *)state);
    Py_XSETREF(decision_type, (PyTypeObject *)dec);
    Py_XSETREF(blank, blank_obj);
    Py_XSETREF(unlimited_obj, unlimited);
    Py_XSETREF(full_share_obj, full);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"step", step, METH_VARARGS,
     "step(observations, states, dt_s, params, history_len) -> dict of Decision, or None "
     "where the Python law must decide"},
    {"bind", bind, METH_VARARGS,
     "bind(LoopState, Decision, _BLANK, UNLIMITED_RATE, FULL_SHARE, _ZERO_SPREAD, _EPS, "
     "params)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_lawc", "The control law for one GPU's containers, in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__lawc(void)
{
    empty_tuple = PyTuple_New(0);
    if (empty_tuple == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
