/*
 * One GPU's steering around the law, in C: `ThrottleController._observe` (a device's
 * observation from its region's reading) and `_settle` (its decision made final and written),
 * for the devices on the common path, the others handed to those methods.
 *
 * The common path before the law: a device seen before, its limits as remembered, no launch
 * debt being repaid, and no claim cut by its bucket. After it: no cap, no claim cut this tick,
 * and an overuse watch that cannot fire on this reading (its run of readings above the target
 * restarted or counted, as `OveruseWatch.read` does). Every other case (a first sight, a
 * policy changed, a liar, a cap, an int too large for a double to hold exactly) is handed to
 * the Python method before anything of the device was changed, so that it is steered wholly by
 * the reference. What is done here is what the methods do, with the same float operations in
 * the same order: the tests steer random and simulated runs both ways and compare every field
 * written.
 *
 * No I/O of its own: the rate writes are the controller's `_apply`, called back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

#define EXACT_INT ((int64_t)1 << 53) /* ints beyond this do not convert to doubles exactly */
#define FULL_SHARE 100.0

/* Observation's fields, and Decision's and LoopState's used here (checked at `bind`) */
enum { O_KEY, O_LIMIT, O_POLICY, O_PRIORITY, O_SPENT, O_LAUNCHES, O_WAITED, O_UTIL, O_RATE,
       O_BURST, O_SPAN, O_SAMPLES, O_FIELDS };
enum { D_RATE, D_BURST, D_TARGET, D_STATE = 5, D_FIELDS };
enum { S_K = 0, S_SURPRISE = 15, S_FIELDS };

static int64_t unlimited, overuse_readings, overuse_ends;
static double jitter_s, wait_fraction, margin_points, share_eps;
static PyObject *unlimited_obj, *zero_obj, *one_obj, *zero_float;
static PyObject *a_dev, *a_previous, *a_read_ns, *a_limits, *a_limited, *a_bucket,
    *a_launch_debt, *a_left, *a_key, *a_alloc_id, *a_liar_cap, *a_last, *a_overuse, *a_over,
    *a_k_start, *a_first, *a_recent;

/* An int in [0, 2**63): 1 and its value, or 0 (anything else, an error cleared) */
static int an_int(PyObject *o, int64_t *out)
{
    if (!PyLong_CheckExact(o))
        return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    if (v < 0)
        return 0;
    *out = (int64_t)v;
    return 1;
}

/* An int in [0, 2**53], which a double holds exactly (Python compares ints with floats
   exactly; C converts first): 1 and its value, or 0 */
static int small_int(PyObject *o, int64_t *out)
{
    return an_int(o, out) && *out <= EXACT_INT;
}

static int is_ascii(PyObject *o, const char *text)
{
    return PyUnicode_CheckExact(o) && PyUnicode_CompareWithASCIIString(o, text) == 0;
}

/* drops the references a function held, those it never took being NULL */
static void release(PyObject *const *held, size_t n)
{
    for (size_t i = 0; i < n; i++)
        Py_XDECREF(held[i]);
}
#define RELEASE(...)                                                                           \
    release((PyObject *const[]){__VA_ARGS__},                                                  \
            sizeof((PyObject *const[]){__VA_ARGS__}) / sizeof(PyObject *))

static inline int64_t gain(int64_t now, int64_t before) { return now > before ? now - before : 0; }

/*
 * `_observe` for a device on the common path: 1 when done (the row appended, the device
 * updated), 0 when it is not on it (nothing changed), -1 on an error.
 */
static int observe_one(PyObject *device, PyObject *reading, PyObject *fields, PyObject *steered,
                       PyObject *spent_by)
{
    if (!PyTuple_CheckExact(reading) || PyTuple_GET_SIZE(reading) != 6)
        return 0;
    PyObject *counters = PyTuple_GET_ITEM(reading, 0), *rates = PyTuple_GET_ITEM(reading, 1),
             *policies = PyTuple_GET_ITEM(reading, 2), *priority = PyTuple_GET_ITEM(reading, 3),
             *read_from = PyTuple_GET_ITEM(reading, 4),
             *read_until_o = PyTuple_GET_ITEM(reading, 5);
    if (!PyTuple_CheckExact(counters) || !PyTuple_CheckExact(rates)
        || !PyTuple_CheckExact(policies) || !PyLong_CheckExact(read_from))
        return 0;
    int done = 0;
    PyObject *dev_o = NULL, *previous = NULL, *previous_ns = NULL, *limits = NULL,
             *limited_o = NULL, *debt = NULL, *left = NULL, *bucket = NULL, *new_bucket = NULL,
             *now = NULL, *key = NULL, *alloc_id = NULL, *row = NULL, *entry = NULL,
             *total = NULL, *spent_o = NULL;
    int64_t dev, now_v[3], before_v[3], before_ns, read_until, written_rate, written_burst;
    if ((dev_o = PyObject_GetAttr(device, a_dev)) == NULL)
        goto fail;
    if (!small_int(dev_o, &dev) || dev > PY_SSIZE_T_MAX / 4)
        goto out;
    Py_ssize_t at = (Py_ssize_t)(3 * dev);
    if (PyTuple_GET_SIZE(counters) < at + 3 || PyTuple_GET_SIZE(rates) < 2 * dev + 2
        || PyTuple_GET_SIZE(policies) <= dev)
        goto out;
    /* totals and clocks may run past 2**53 (a monotonic clock does after 104 days of uptime):
       only their differences must be exact as doubles */
    for (int j = 0; j < 3; j++)
        if (!an_int(PyTuple_GET_ITEM(counters, at + j), &now_v[j]))
            goto out;
    if ((previous = PyObject_GetAttr(device, a_previous)) == NULL)
        goto fail;
    if (!PyTuple_CheckExact(previous) || PyTuple_GET_SIZE(previous) != 3)
        goto out; /* first sight (None): the Python method takes the baseline */
    for (int j = 0; j < 3; j++)
        if (!an_int(PyTuple_GET_ITEM(previous, j), &before_v[j]))
            goto out;
    if ((previous_ns = PyObject_GetAttr(device, a_read_ns)) == NULL)
        goto fail;
    PyObject *written_rate_o = PyTuple_GET_ITEM(rates, 2 * dev),
             *written_burst_o = PyTuple_GET_ITEM(rates, 2 * dev + 1);
    if (!an_int(previous_ns, &before_ns) || !an_int(read_until_o, &read_until)
        || read_until - before_ns > EXACT_INT || before_ns - read_until > EXACT_INT
        || !small_int(written_rate_o, &written_rate)
        || !small_int(written_burst_o, &written_burst))
        goto out;
    int64_t rate = written_rate, burst = written_burst;
    PyObject *rate_o = written_rate_o, *burst_o = written_burst_o;
    if (rate == 0 && burst == 0) { /* never configured: the shim does not throttle */
        rate = burst = unlimited;
        rate_o = burst_o = unlimited_obj;
    } else if (rate == 0) {
        goto out; /* paused for a turn alone, or left paused: the Python method decides */
    }
    /* the limits as remembered, for the policy and priority found now */
    PyObject *policy_now = PyTuple_GET_ITEM(policies, dev);
    if ((limits = PyObject_GetAttr(device, a_limits)) == NULL)
        goto fail;
    if (!PyTuple_CheckExact(limits) || PyTuple_GET_SIZE(limits) != 4
        || !PyUnicode_CheckExact(policy_now) || !PyFloat_CheckExact(PyTuple_GET_ITEM(limits, 0)))
        goto out;
    PyObject *policy_then = PyTuple_GET_ITEM(limits, 2);
    if (policy_then != policy_now
        && (!PyUnicode_CheckExact(policy_then) || PyUnicode_Compare(policy_then, policy_now) != 0))
        goto out;
    int64_t priority_now, priority_then;
    if (!small_int(priority, &priority_now)
        || !small_int(PyTuple_GET_ITEM(limits, 3), &priority_then) || priority_now != priority_then)
        goto out;
    PyObject *limit_o = PyTuple_GET_ITEM(limits, 0), *policy_o = PyTuple_GET_ITEM(limits, 1);
    double limit = PyFloat_AS_DOUBLE(limit_o);
    int limited = rate < unlimited && limit < FULL_SHARE && !is_ascii(policy_now, "off");
    if ((limited_o = PyObject_GetAttr(device, a_limited)) == NULL)
        goto fail;
    if (limited_o != Py_True && limited_o != Py_False)
        goto out;
    int limited_before = limited_o == Py_True;
    int64_t spent = gain(now_v[0], before_v[0]), launches = gain(now_v[1], before_v[1]),
            wait = gain(now_v[2], before_v[2]);
    if (spent > EXACT_INT)
        goto out;
    double read_dt_s = (double)(read_until - before_ns) / 1e9;
    if (limited) {
        if ((debt = PyObject_GetAttr(device, a_launch_debt)) == NULL
            || (left = PyObject_GetAttr(debt, a_left)) == NULL)
            goto fail;
        if (!PyFloat_CheckExact(left) || !(PyFloat_AS_DOUBLE(left) <= 0))
            goto out; /* a launch debt being repaid */
        if ((bucket = PyObject_GetAttr(device, a_bucket)) == NULL)
            goto fail;
        /* audit.believed_spend */
        double level = (double)burst;
        int64_t before_rate = rate;
        if (bucket != Py_None) {
            if (!PyTuple_CheckExact(bucket) || PyTuple_GET_SIZE(bucket) != 2
                || !PyFloat_CheckExact(PyTuple_GET_ITEM(bucket, 0))
                || !small_int(PyTuple_GET_ITEM(bucket, 1), &before_rate))
                goto out;
            level = PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(bucket, 0));
        }
        int64_t fastest = rate >= before_rate ? rate : before_rate;
        double lent = 2.0 * (double)burst + (double)fastest * jitter_s;
        double through = (level < (double)burst ? level : (double)burst)
                         + (double)fastest * read_dt_s;
        double allowed = through + lent;
        int64_t believed = (double)spent <= allowed ? spent : allowed > 0 ? (int64_t)allowed : 0;
        double after = through - (double)believed;
        double bound = after > -lent ? (after < (double)burst ? after : (double)burst) : -lent;
        if (!limited_before)
            bound = (double)burst; /* full when the rate reached it */
        else if (believed < spent)
            goto out; /* a claim cut: a launch's debt or a lie, judged in Python */
        spent = believed;
        PyObject *level_o = PyFloat_FromDouble(bound);
        if (level_o == NULL)
            goto fail;
        new_bucket = PyTuple_Pack(2, level_o, rate_o);
        Py_DECREF(level_o);
        if (new_bucket == NULL)
            goto fail;
    } else {
        new_bucket = Py_NewRef(Py_None); /* the shim did not limit: its bucket fills */
    }
    if (wait && (rate >= unlimited || (double)spent < wait_fraction * (double)rate * read_dt_s))
        wait = 0; /* waits without spending near the rate are not believed */
    /* from here the device is steered here: its state moves on */
    if ((now = PyTuple_GetSlice(counters, at, at + 3)) == NULL
        || PyObject_SetAttr(device, a_previous, now) < 0
        || PyObject_SetAttr(device, a_read_ns, read_from) < 0
        || PyObject_SetAttr(device, a_limited, limited ? Py_True : Py_False) < 0
        || PyObject_SetAttr(device, a_bucket, new_bucket) < 0)
        goto fail;
    if ((alloc_id = PyObject_GetAttr(device, a_alloc_id)) == NULL
        || (key = PyObject_GetAttr(device, a_key)) == NULL
        || (spent_o = PyLong_FromLongLong(spent)) == NULL)
        goto fail;
    PyObject *sum_before = PyDict_GetItemWithError(spent_by, alloc_id);
    if (sum_before == NULL && PyErr_Occurred())
        goto fail;
    total = sum_before == NULL ? Py_NewRef(spent_o) : PyNumber_Add(sum_before, spent_o);
    if (total == NULL || PyDict_SetItem(spent_by, alloc_id, total) < 0)
        goto fail;
    if ((row = PyList_New(O_FIELDS)) == NULL)
        goto fail;
    PyObject *launches_o = PyLong_FromLongLong(launches), *waited_o = PyFloat_FromDouble(
                                                              (double)wait / 1e9);
    if (launches_o == NULL || waited_o == NULL) {
        Py_XDECREF(launches_o);
        Py_XDECREF(waited_o);
        goto fail;
    }
    PyList_SET_ITEM(row, O_KEY, Py_NewRef(key));
    PyList_SET_ITEM(row, O_LIMIT, Py_NewRef(limit_o));
    PyList_SET_ITEM(row, O_POLICY, Py_NewRef(policy_o));
    PyList_SET_ITEM(row, O_PRIORITY, Py_NewRef(priority));
    PyList_SET_ITEM(row, O_SPENT, Py_NewRef(spent_o));
    PyList_SET_ITEM(row, O_LAUNCHES, launches_o);
    PyList_SET_ITEM(row, O_WAITED, waited_o);
    PyList_SET_ITEM(row, O_UTIL, Py_NewRef(Py_None));
    PyList_SET_ITEM(row, O_RATE, Py_NewRef(rate_o));
    PyList_SET_ITEM(row, O_BURST, Py_NewRef(burst_o));
    PyList_SET_ITEM(row, O_SPAN, Py_NewRef(zero_float));
    PyList_SET_ITEM(row, O_SAMPLES, Py_NewRef(one_obj));
    if (PyList_Append(fields, row) < 0
        || (entry = PyTuple_Pack(3, device, written_rate_o, written_burst_o)) == NULL
        || PyList_Append(steered, entry) < 0)
        goto fail;
    done = 1;
    goto out;
fail:
    done = -1;
out:
    RELEASE(dev_o, previous, previous_ns, limits, limited_o, debt, left, bucket, new_bucket, now,
            key, alloc_id, row, entry, total, spent_o);
    return done;
}

static PyObject *observe(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *entries, *slow, *states, *fields, *steered, *spent_by, *liars;
    if (!PyArg_ParseTuple(args, "O!OOO!O!O!O", &PyList_Type, &entries, &slow, &states,
                          &PyList_Type, &fields, &PyList_Type, &steered, &PyDict_Type, &spent_by,
                          &liars))
        return NULL;
    if (unlimited_obj == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_steerc.bind() was not called");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); i++) {
        PyObject *pair = PyList_GET_ITEM(entries, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "entries must hold (device, reading) pairs, got %R",
                         pair);
            return NULL;
        }
        Py_INCREF(pair);
        PyObject *device = PyTuple_GET_ITEM(pair, 0), *reading = PyTuple_GET_ITEM(pair, 1);
        int done = observe_one(device, reading, fields, steered, spent_by);
        if (done == 0) {
            PyObject *r = PyObject_CallFunctionObjArgs(slow, device, reading, states, fields,
                                                       steered, spent_by, liars, NULL);
            done = r == NULL ? -1 : 1;
            Py_XDECREF(r);
        }
        Py_DECREF(pair);
        if (done < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/*
 * `OveruseWatch.read` for a reading above the target that cannot make the watch fire (the run
 * is shorter than `overuse_readings` with it): 1 when counted, 0 when it may fire (nothing
 * changed), -1 on an error.
 */
static int over_target(PyObject *watch, PyObject *util, PyObject *k)
{
    int done = 0;
    PyObject *over_o = NULL, *first = NULL, *recent = NULL, *kept = NULL, *count = NULL;
    int64_t over;
    if ((over_o = PyObject_GetAttr(watch, a_over)) == NULL)
        goto fail;
    if (!small_int(over_o, &over) || over + 1 >= overuse_readings)
        goto out;
    if (over == 0) { /* a run begins */
        if (PyObject_SetAttr(watch, a_k_start, k) < 0 || (first = PyList_New(0)) == NULL
            || (recent = PyList_New(0)) == NULL || PyObject_SetAttr(watch, a_first, first) < 0
            || PyObject_SetAttr(watch, a_recent, recent) < 0)
            goto fail;
    } else if ((first = PyObject_GetAttr(watch, a_first)) == NULL
               || (recent = PyObject_GetAttr(watch, a_recent)) == NULL) {
        goto fail;
    }
    if (!PyList_Check(first) || !PyList_Check(recent)) {
        PyErr_SetString(PyExc_TypeError, "the overuse watch's readings must be lists");
        goto fail;
    }
    if ((count = PyLong_FromLongLong(over + 1)) == NULL
        || PyObject_SetAttr(watch, a_over, count) < 0)
        goto fail;
    if (PyList_GET_SIZE(first) < overuse_ends && PyList_Append(first, util) < 0)
        goto fail;
    /* the last `overuse_ends` readings, in a new list as `[*recent[1 - ends:], util]` makes */
    Py_ssize_t n = PyList_GET_SIZE(recent), from = n - (overuse_ends - 1);
    if ((kept = PyList_GetSlice(recent, from > 0 ? from : 0, n)) == NULL
        || PyList_Append(kept, util) < 0 || PyObject_SetAttr(watch, a_recent, kept) < 0)
        goto fail;
    done = 1;
    goto out;
fail:
    done = -1;
out:
    RELEASE(over_o, first, recent, kept, count);
    return done;
}

/* the float of a field the law makes a float: 1 and its value, or 0 */
static int a_float(PyObject *o, double *out)
{
    if (!PyFloat_CheckExact(o))
        return 0;
    *out = PyFloat_AS_DOUBLE(o);
    return 1;
}

/*
 * `_settle` for a device on the common path: 1 when done (written where it changed, its last
 * decision kept), 0 when not on it (nothing changed), -1 on an error.
 */
static int settle_one(PyObject *obs, PyObject *entry, PyObject *decision, PyObject *liars,
                      PyObject *apply, int sliced, PyObject *open_loop, double calm_points,
                      double calm_fraction, int *changed, int *lent)
{
    if (!PyTuple_Check(obs) || PyTuple_GET_SIZE(obs) != O_FIELDS || !PyTuple_CheckExact(entry)
        || PyTuple_GET_SIZE(entry) != 3 || !PyTuple_Check(decision)
        || PyTuple_GET_SIZE(decision) != D_FIELDS)
        return 0;
    PyObject *device = PyTuple_GET_ITEM(entry, 0), *rate_o = PyTuple_GET_ITEM(decision, D_RATE),
             *burst_o = PyTuple_GET_ITEM(decision, D_BURST),
             *state = PyTuple_GET_ITEM(decision, D_STATE);
    int64_t written_rate, written_burst, rate, burst;
    double target, limit, surprise;
    if (!small_int(PyTuple_GET_ITEM(entry, 1), &written_rate)
        || !small_int(PyTuple_GET_ITEM(entry, 2), &written_burst) || !small_int(rate_o, &rate)
        || !small_int(burst_o, &burst) || !a_float(PyTuple_GET_ITEM(decision, D_TARGET), &target)
        || !a_float(PyTuple_GET_ITEM(obs, O_LIMIT), &limit) || !PyTuple_Check(state)
        || PyTuple_GET_SIZE(state) < S_FIELDS)
        return 0;
    PyObject *surprise_o = PyTuple_GET_ITEM(state, S_SURPRISE);
    if (PyFloat_CheckExact(surprise_o))
        surprise = PyFloat_AS_DOUBLE(surprise_o);
    else if (PyLong_CheckExact(surprise_o) && (surprise_o == zero_obj || PyObject_Not(surprise_o)))
        surprise = 0.0;
    else
        return 0;
    PyObject *policy = PyTuple_GET_ITEM(obs, O_POLICY), *util_o = PyTuple_GET_ITEM(obs, O_UTIL);
    if (!PyUnicode_CheckExact(policy))
        return 0;
    int caught = PySet_Contains(liars, PyTuple_GET_ITEM(obs, O_KEY));
    if (caught != 0)
        return caught < 0 ? -1 : 0;
    int done = 0;
    PyObject *cap = NULL, *last = NULL, *overuse = NULL, *kept = NULL;
    if ((cap = PyObject_GetAttr(device, a_liar_cap)) == NULL)
        goto fail;
    if (cap != Py_None)
        goto out;
    if ((last = PyObject_GetAttr(device, a_last)) == NULL)
        goto fail;
    double last_target = 0.0;
    if (last != Py_None) {
        PyObject *aimed;
        if (!PyTuple_CheckExact(last) || PyTuple_GET_SIZE(last) != 3
            || !PyTuple_Check(aimed = PyTuple_GET_ITEM(last, 1))
            || PyTuple_GET_SIZE(aimed) != D_FIELDS
            || !a_float(PyTuple_GET_ITEM(aimed, D_TARGET), &last_target))
            goto out;
    }
    /* the overuse watch: a limited container's own use against the target its rate aimed at */
    int watched = util_o != Py_None && last != Py_None && !sliced && !is_ascii(policy, "off")
                  && limit < FULL_SHARE && written_rate > 0;
    if (watched) {
        PyObject *aimed_state = PyTuple_GET_ITEM(PyTuple_GET_ITEM(last, 1), D_STATE);
        double util, k;
        if (!a_float(util_o, &util) || !PyTuple_Check(aimed_state)
            || PyTuple_GET_SIZE(aimed_state) < S_FIELDS
            || !a_float(PyTuple_GET_ITEM(aimed_state, S_K), &k))
            goto out;
        if ((overuse = PyObject_GetAttr(device, a_overuse)) == NULL)
            goto fail;
        if (util <= last_target + margin_points || k <= 0) {
            if (PyObject_SetAttr(overuse, a_over, zero_obj) < 0)
                goto fail;
        } else { /* above it: a run of such readings goes on, judged in Python once it may fire */
            int r = over_target(overuse, util_o, PyTuple_GET_ITEM(aimed_state, S_K));
            if (r <= 0) {
                done = r;
                goto out;
            }
        }
    }
    if (!*lent)
        *lent = is_ascii(policy, "off") || target > limit + share_eps || rate >= unlimited;
    if (!*changed) /* news enough to keep the tick fast? */
        *changed = last == Py_None || fabs(last_target - target) > calm_points
                   || (double)(rate > written_rate ? rate - written_rate : written_rate - rate)
                          > calm_fraction * (double)written_rate
                   || surprise != 0;
    if (rate != written_rate || burst != written_burst) {
        PyObject *r = PyObject_CallFunctionObjArgs(apply, device, rate_o, burst_o, NULL);
        if (r == NULL)
            goto fail;
        Py_DECREF(r);
    }
    if ((kept = PyTuple_Pack(3, obs, decision, open_loop)) == NULL
        || PyObject_SetAttr(device, a_last, kept) < 0)
        goto fail;
    done = 1;
    goto out;
fail:
    done = -1;
out:
    RELEASE(cap, last, overuse, kept);
    return done;
}

static PyObject *settle(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *observations, *steered, *decisions, *slow, *apply, *liars, *open_loop;
    int sliced, changed, lent;
    double calm_points, calm_fraction;
    if (!PyArg_ParseTuple(args, "O!O!O!OOOpOddpp", &PyList_Type, &observations, &PyList_Type,
                          &steered, &PyDict_Type, &decisions, &liars, &slow, &apply, &sliced,
                          &open_loop, &calm_points, &calm_fraction, &changed, &lent))
        return NULL;
    if (unlimited_obj == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_steerc.bind() was not called");
        return NULL;
    }
    if (!PyAnySet_Check(liars)) {
        PyErr_SetString(PyExc_TypeError, "liars must be a set");
        return NULL;
    }
    if (PyList_GET_SIZE(observations) != PyList_GET_SIZE(steered)) {
        PyErr_Format(PyExc_ValueError, "%zd observations for %zd devices steered",
                     PyList_GET_SIZE(observations), PyList_GET_SIZE(steered));
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(observations); i++) {
        if (i >= PyList_GET_SIZE(steered)) { /* (a callback shortened it) */
            PyErr_SetString(PyExc_ValueError, "fewer devices steered than observations");
            return NULL;
        }
        PyObject *obs = PyList_GET_ITEM(observations, i), *entry = PyList_GET_ITEM(steered, i);
        if (!PyTuple_Check(obs) || PyTuple_GET_SIZE(obs) != O_FIELDS) {
            PyErr_Format(PyExc_TypeError, "an observation must be an Observation, got %R", obs);
            return NULL;
        }
        Py_INCREF(obs);
        Py_INCREF(entry);
        PyObject *decision = PyDict_GetItemWithError(decisions, PyTuple_GET_ITEM(obs, O_KEY));
        int done = -1;
        if (decision == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(obs, O_KEY));
        } else {
            Py_INCREF(decision);
            done = settle_one(obs, entry, decision, liars, apply, sliced, open_loop, calm_points,
                              calm_fraction, &changed, &lent);
            if (done == 0) {
                PyObject *r = PyObject_CallFunctionObjArgs(slow, obs, entry, decision,
                                                           changed ? Py_True : Py_False,
                                                           lent ? Py_True : Py_False, NULL);
                done = -1;
                if (r != NULL && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2) {
                    int c = PyObject_IsTrue(PyTuple_GET_ITEM(r, 0)),
                        l = PyObject_IsTrue(PyTuple_GET_ITEM(r, 1));
                    if (c >= 0 && l >= 0) {
                        changed = c;
                        lent = l;
                        done = 1;
                    }
                } else if (r != NULL) {
                    PyErr_Format(PyExc_TypeError, "settle must return (changed, lent), got %R",
                                 r);
                }
                Py_XDECREF(r);
            }
            Py_DECREF(decision);
        }
        Py_DECREF(obs);
        Py_DECREF(entry);
        if (done < 0)
            return NULL;
    }
    return Py_BuildValue("(OO)", changed ? Py_True : Py_False, lent ? Py_True : Py_False);
}

static PyObject *bind(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *unlimited_o, *full_share, *layout;
    double jitter, fraction, margin, eps;
    long long readings, ends;
    if (!PyArg_ParseTuple(args, "O!O!ddddLLO!", &PyLong_Type, &unlimited_o, &PyFloat_Type,
                          &full_share, &jitter, &fraction, &margin, &eps, &readings, &ends,
                          &PyTuple_Type, &layout))
        return NULL;
    int64_t value;
    if (!small_int(unlimited_o, &value)) {
        PyErr_Format(PyExc_ValueError, "UNLIMITED_RATE must be an int in [0, 2**53], got %R",
                     unlimited_o);
        return NULL;
    }
    if (PyFloat_AS_DOUBLE(full_share) != FULL_SHARE) {
        /* compared with limits and targets in here: a Python value of its own would make the
           two steerings disagree */
        PyErr_Format(PyExc_ValueError, "FULL_SHARE must be 100.0, the value this module was "
                     "built with, got %R", full_share);
        return NULL;
    }
    if (readings < 1 || ends < 1 || readings > 1000000 || ends > 1000000) {
        PyErr_Format(PyExc_ValueError, "OVERUSE_READINGS and OVERUSE_ENDS must be from 1 to "
                     "1000000, got %lld and %lld", readings, ends);
        return NULL;
    }
    /* the fields this module reads by position, where it reads them */
    PyObject *expected = Py_BuildValue(
        "(sssssssssssss" "ssssss" "sssssssssssssssss)", "key", "limit", "policy", "priority",
        "spent", "launches", "waited_s", "util", "rate", "burst", "util_span_s", "util_samples",
        "|", "rate", "burst", "target", "hungry", "demand", "state", "|", "tokens_per_pct",
        "lower_bound", "spend_history", "cost_per_launch", "util", "spread", "noise",
        "noise_pairs", "last_pair", "k_floor", "target", "learned", "adopted", "hungry",
        "tick_lengths", "surprise");
    if (expected == NULL)
        return NULL;
    int same = PyObject_RichCompareBool(layout, expected, Py_EQ);
    Py_DECREF(expected);
    if (same <= 0) {
        if (same == 0)
            PyErr_Format(PyExc_ValueError, "Observation, Decision and LoopState's fields are "
                         "not those this module was built for: %R", layout);
        return NULL;
    }
    unlimited = value;
    overuse_readings = readings;
    overuse_ends = ends;
    jitter_s = jitter;
    wait_fraction = fraction;
    margin_points = margin;
    share_eps = eps;
    Py_XSETREF(unlimited_obj, Py_NewRef(unlimited_o));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"observe", observe, METH_VARARGS,
     "observe(entries, observe_one, states, fields, steered, spent_by, liars): "
     "ThrottleController._observe for every entry, the common path here"},
    {"settle", settle, METH_VARARGS,
     "settle(observations, steered, decisions, liars, settle_one, apply, sliced, open_loop, "
     "calm_points, calm_fraction, changed, lent) -> (changed, lent): "
     "ThrottleController._settle for every device, the common path here"},
    {"bind", bind, METH_VARARGS,
     "bind(UNLIMITED_RATE, FULL_SHARE, JITTER_S, WAIT_SPEND_FRACTION, LIAR_MARGIN_POINTS, "
     "share_eps, "
     "OVERUSE_READINGS, OVERUSE_ENDS, "
     "fields of Observation, '|', of Decision, '|', of LoopState)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_steerc", "One GPU's steering around the law, in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

#define INTERN(var, text)                                                                      \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                      \
        return NULL;

PyMODINIT_FUNC PyInit__steerc(void)
{
    INTERN(a_dev, "dev")
    INTERN(a_previous, "previous")
    INTERN(a_read_ns, "read_ns")
    INTERN(a_limits, "limits")
    INTERN(a_limited, "limited")
    INTERN(a_bucket, "bucket")
    INTERN(a_launch_debt, "launch_debt")
    INTERN(a_left, "left")
    INTERN(a_key, "key")
    INTERN(a_alloc_id, "alloc_id")
    INTERN(a_liar_cap, "liar_cap")
    INTERN(a_last, "last")
    INTERN(a_overuse, "overuse")
    INTERN(a_over, "over")
    INTERN(a_k_start, "k_start")
    INTERN(a_first, "first")
    INTERN(a_recent, "recent")
    if ((zero_obj = PyLong_FromLong(0)) == NULL || (one_obj = PyLong_FromLong(1)) == NULL
        || (zero_float = PyFloat_FromDouble(0.0)) == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
