/*
 * The time-sliced split's loops over a GPU's containers in C (`throttle/timesliced.py`):
 * `learn` is `_newton_steps`, `watch` is `ChangeWatch._judge`, `age` is `_age_parts`, each
 * float for float.
 *
 * Every float is computed by the operations the Python reference uses, in its order: Python's
 * `max` and `min` (the first of equals), `math.log` and `math.exp` through the same libm, an
 * int divided by an int as Python divides them where both are below 2**53 (each converted,
 * then divided), and `sum` by calling the interpreter's own on the same floats (it sums them
 * left to right before 3.12 and with Neumaier's compensation from 3.12 on). Contraction into
 * fused multiply-adds is off (setup.py), so a * b + c rounds twice, as in Python.
 *
 * Each function reads and checks all it needs before it writes anything. Where an input is not
 * what the split makes (a value of another type, an int beyond 2**53) or where Python would
 * raise (a division by zero, `math.log` of a number not above 0, `math.exp` overflowing), it
 * writes nothing and returns None, and the Python reference runs instead: the answer, or the
 * error, is then the reference's own. The constants come with every call: nothing here can
 * be stale against the reference.
 *
 * Pure: no I/O, no clocks, no state between calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

#define EXACT_INT ((long long)1 << 53) /* ints beyond this do not convert to doubles exactly */

static PyObject *builtin_sum; /* the interpreter's `sum`, for sums float for float */

static inline double py_max(double a, double b) { return b > a ? b : a; }
static inline double py_min(double a, double b) { return b < a ? b : a; }

/* A call that Python would refuse, or an input the split does not make, sets this. */
typedef struct {
    int bail;
} Guard;

static int a_float(PyObject *o, double *out)
{
    if (!PyFloat_CheckExact(o))
        return 0;
    *out = PyFloat_AS_DOUBLE(o);
    return 1;
}

/* An exact int in [0, 2**53), or an exact float: its value as Python would divide it */
static int a_number(PyObject *o, double *out)
{
    if (PyFloat_CheckExact(o)) {
        *out = PyFloat_AS_DOUBLE(o);
        return 1;
    }
    if (!PyLong_CheckExact(o))
        return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || v < 0 || v >= EXACT_INT) {
        PyErr_Clear();
        return 0;
    }
    *out = (double)v;
    return 1;
}

static int an_int(PyObject *o, long long *out)
{
    if (!PyLong_CheckExact(o))
        return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || v < 0 || v >= EXACT_INT) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

/* sum() of n floats, by the interpreter's own `sum`; 0 on an error (raised) */
static int py_sum(const double *v, Py_ssize_t n, double *out)
{
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyFloat_FromDouble(v[i]);
        if (f == NULL) {
            Py_DECREF(list);
            return 0;
        }
        PyList_SET_ITEM(list, i, f);
    }
    PyObject *total = PyObject_CallOneArg(builtin_sum, list);
    Py_DECREF(list);
    if (total == NULL)
        return 0;
    int ok = PyFloat_CheckExact(total);
    if (ok)
        *out = PyFloat_AS_DOUBLE(total);
    else
        PyErr_SetString(PyExc_TypeError, "sum of floats was not a float");
    Py_DECREF(total);
    return ok;
}

/* Whether `key` equals `other`, both exact str (checked by the caller) */
static int same_str(PyObject *key, PyObject *other)
{
    return key == other || PyUnicode_Compare(key, other) == 0;
}

/* A pair of floats (a tuple of two exact floats) */
static int float_pair(PyObject *o, double *first, double *second)
{
    return PyTuple_CheckExact(o) && PyTuple_GET_SIZE(o) == 2
           && a_float(PyTuple_GET_ITEM(o, 0), first) && a_float(PyTuple_GET_ITEM(o, 1), second);
}

/* keys[j] -> (first[j], second[j]) in `dict`, for j < n; 0 on an error (raised) */
static int store_pairs(PyObject *dict, PyObject *const *keys, const double *first,
                       const double *second, Py_ssize_t n)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *pair = Py_BuildValue("(dd)", first[j], second[j]);
        int failed = pair == NULL || PyDict_SetItem(dict, keys[j], pair) < 0;
        Py_XDECREF(pair);
        if (failed)
            return 0;
    }
    return 1;
}

/* A list whose items are all exact str */
static int str_list(PyObject *o)
{
    if (!PyList_CheckExact(o))
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); i++)
        if (!PyUnicode_CheckExact(PyList_GET_ITEM(o, i)))
            return 0;
    return 1;
}

/* ------------------------------------------------------------------------------ learn */

/* `_chances_of(costs, tokens)` on the arrays: each one's part times exp(its log cost), over
 * their sum */
static int chances(Guard *g, Py_ssize_t n, const double *parts, const double *log_costs,
                   double *weighed, double *out)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        double e = exp(log_costs[i]);
        if (isinf(e) && isfinite(log_costs[i]))
            g->bail = 1; /* OverflowError in Python */
        weighed[i] = parts[i] * e;
    }
    double whole;
    if (!py_sum(weighed, n, &whole))
        return 0;
    if (whole == 0.0)
        g->bail = 1; /* ZeroDivisionError */
    for (Py_ssize_t i = 0; i < n && !g->bail; i++)
        out[i] = weighed[i] / whole;
    return 1;
}

/* learn(costs, tokens, drawn, fading, top): `_newton_steps`. True where done, None where the
 * reference is to run. */
static PyObject *learn(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *costs, *tokens, *drawn;
    double fading, top;
    if (!PyArg_ParseTuple(args, "O!O!O!dd", &PyDict_Type, &costs, &PyDict_Type, &tokens,
                          &PyList_Type, &drawn, &fading, &top))
        return NULL;
    if (!PyDict_CheckExact(costs) || !PyDict_CheckExact(tokens) || !str_list(drawn))
        Py_RETURN_NONE;
    Py_ssize_t n = PyDict_GET_SIZE(tokens), m = PyList_GET_SIZE(drawn);
    if (n < 1)
        Py_RETURN_NONE;
    PyObject **keys = PyMem_Malloc(sizeof(PyObject *) * (size_t)n);
    double *work = PyMem_Malloc(sizeof(double) * 5 * (size_t)n);
    Py_ssize_t *owner = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(m > 0 ? m : 1));
    PyObject *result = NULL;
    if (keys == NULL || work == NULL || owner == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double *parts = work, *log_costs = work + n, *info = work + 2 * n, *weighed = work + 3 * n,
           *chance = work + 4 * n;
    Guard g = {0};
    PyObject *key, *value;
    Py_ssize_t pos = 0, i = 0;
    while (PyDict_Next(tokens, &pos, &key, &value)) {
        PyObject *cost = PyDict_GetItemWithError(costs, key);
        if (cost == NULL && PyErr_Occurred())
            goto done;
        if (!PyUnicode_CheckExact(key) || !a_float(value, &parts[i]) || cost == NULL
            || !float_pair(cost, &log_costs[i], &info[i]))
            g.bail = 1;
        keys[i++] = key;
        if (g.bail)
            break;
    }
    for (Py_ssize_t d = 0; d < m && !g.bail; d++) {
        owner[d] = -1; /* one drawn among none of them is given to none: every one missed it */
        for (Py_ssize_t j = 0; j < n; j++)
            if (same_str(keys[j], PyList_GET_ITEM(drawn, d))) {
                owner[d] = j;
                break;
            }
    }
    if (PyErr_Occurred())
        goto done;
    for (Py_ssize_t d = 0; d < m && !g.bail; d++) {
        if (!chances(&g, n, parts, log_costs, weighed, chance))
            goto done;
        for (Py_ssize_t j = 0; j < n && !g.bail; j++) {
            double c = chance[j];
            double informed = fading * info[j] + c * (1.0 - c);
            if (informed == 0.0) {
                g.bail = 1; /* ZeroDivisionError */
                break;
            }
            double x = log_costs[j] + ((j == owner[d] ? 1.0 : 0.0) - c) / informed;
            log_costs[j] = x > top ? top : x < -top ? -top : x;
            info[j] = informed;
        }
    }
    if (g.bail) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    /* only the ratios matter: centred */
    double total;
    if (!py_sum(log_costs, n, &total))
        goto done;
    double mean = total / (double)n;
    for (Py_ssize_t j = 0; j < n; j++)
        log_costs[j] -= mean;
    if (store_pairs(costs, keys, log_costs, info, n))
        result = Py_NewRef(Py_True);
done:
    PyMem_Free(keys);
    PyMem_Free(work);
    PyMem_Free(owner);
    return result;
}

/* ------------------------------------------------------------------------------ watch */

/* watch(sums, expected, drawn, odds, log_odds, eps, evidence): `ChangeWatch._judge`. The
 * containers found changed (a list, empty where none), None where the reference is to run. */
static PyObject *watch(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *sums, *expected, *drawn;
    double odds, log_odds, eps, evidence;
    if (!PyArg_ParseTuple(args, "O!O!O!dddd", &PyDict_Type, &sums, &PyDict_Type, &expected,
                          &PyList_Type, &drawn, &odds, &log_odds, &eps, &evidence))
        return NULL;
    if (!PyDict_CheckExact(sums) || !PyDict_CheckExact(expected) || !str_list(drawn))
        Py_RETURN_NONE;
    Py_ssize_t n = PyDict_GET_SIZE(expected), m = PyList_GET_SIZE(drawn);
    if (n < 1)
        Py_RETURN_NONE;
    PyObject **keys = PyMem_Malloc(sizeof(PyObject *) * (size_t)n);
    double *work = PyMem_Malloc(sizeof(double) * 6 * (size_t)n);
    PyObject *result = NULL, *found = NULL;
    if (keys == NULL || work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double *up_given = work, *up_missed = work + n, *down_given = work + 2 * n,
           *down_missed = work + 3 * n, *up = work + 4 * n, *down = work + 5 * n;
    int bail = 0;
    PyObject *key, *value;
    Py_ssize_t pos = 0, i = 0;
    while (PyDict_Next(expected, &pos, &key, &value)) {
        double chance;
        if (!PyUnicode_CheckExact(key) || !a_float(value, &chance)) {
            bail = 1;
            break;
        }
        double q = py_min(1.0 - eps, py_max(eps, chance));
        double more = 1.0 + (odds - 1.0) * q, fewer = odds - (odds - 1.0) * q;
        if (!(more > 0.0) || !(fewer > 0.0) || isinf(more) || isinf(fewer)) {
            bail = 1; /* math.log refuses what is not above 0; the reference decides */
            break;
        }
        up_missed[i] = -log(more);
        down_given[i] = -log(fewer);
        up_given[i] = log_odds + up_missed[i];
        down_missed[i] = log_odds + down_given[i];
        PyObject *sum = PyDict_GetItemWithError(sums, key);
        if (sum == NULL) {
            if (PyErr_Occurred())
                goto done;
            up[i] = down[i] = 0.0;
        } else if (!float_pair(sum, &up[i], &down[i])) {
            bail = 1;
            break;
        }
        keys[i++] = key;
    }
    if (bail) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    found = PyList_New(0);
    if (found == NULL)
        goto done;
    for (Py_ssize_t d = 0; d < m && PyList_GET_SIZE(found) == 0; d++) {
        PyObject *owner = PyList_GET_ITEM(drawn, d);
        for (Py_ssize_t j = 0; j < n; j++) {
            int given = same_str(keys[j], owner);
            double u = up[j] + (given ? up_given[j] : up_missed[j]);
            double w = down[j] + (given ? down_given[j] : down_missed[j]);
            up[j] = u > 0 ? u : 0.0;
            down[j] = w > 0 ? w : 0.0;
            if ((up[j] > evidence || down[j] > evidence) && PyList_Append(found, keys[j]) < 0)
                goto done;
        }
    }
    if (PyErr_Occurred())
        goto done;
    if (PyList_GET_SIZE(found) > 0) {
        PyDict_Clear(sums); /* evidence from here on is judged against what follows */
    } else if (m > 0 && !store_pairs(sums, keys, up, down, n)) { /* (none judged: none written) */
        goto done;
    }
    result = Py_NewRef(found);
done:
    Py_XDECREF(found);
    PyMem_Free(keys);
    PyMem_Free(work);
    return result;
}

/* ------------------------------------------------------------------------------ age */

/* age(parts, unseen, owners, spent, total, remembered): `_age_parts`. True where done, None
 * where the reference is to run. */
static PyObject *age(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *parts, *unseen, *owners, *spent, *total_obj;
    long long remembered;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OL", &PyDict_Type, &parts, &PyDict_Type, &unseen,
                          &PyList_Type, &owners, &PyDict_Type, &spent, &total_obj,
                          &remembered))
        return NULL;
    double total;
    if (!PyDict_CheckExact(parts) || !PyDict_CheckExact(unseen) || !PyDict_CheckExact(spent)
        || !a_number(total_obj, &total) || remembered <= 0 || remembered >= EXACT_INT)
        Py_RETURN_NONE;
    Py_ssize_t m = PyList_GET_SIZE(owners);
    for (Py_ssize_t d = 0; d < m; d++)
        if (!str_list(PyList_GET_ITEM(owners, d)))
            Py_RETURN_NONE;
    Py_ssize_t n = PyDict_GET_SIZE(parts);
    if (n < 1 || m < 1)
        Py_RETURN_NONE;
    PyObject **keys = PyMem_Malloc(sizeof(PyObject *) * (size_t)n);
    double *work = PyMem_Malloc(sizeof(double) * 3 * (size_t)n);
    long long *counts = PyMem_Malloc(sizeof(long long) * 2 * (size_t)n);
    PyObject *result = NULL;
    if (keys == NULL || work == NULL || counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double *periods = work, *token_parts = work + n, *spent_part = work + 2 * n;
    long long *seen = counts, *unseen_for = counts + n;
    int bail = 0;
    PyObject *key, *value;
    Py_ssize_t pos = 0, i = 0;
    while (PyDict_Next(parts, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key) || !PyTuple_CheckExact(value)
            || PyTuple_GET_SIZE(value) != 3 || !a_float(PyTuple_GET_ITEM(value, 0), &periods[i])
            || !a_float(PyTuple_GET_ITEM(value, 1), &token_parts[i])
            || !an_int(PyTuple_GET_ITEM(value, 2), &seen[i])) {
            bail = 1;
            break;
        }
        PyObject *was = PyDict_GetItemWithError(unseen, key);
        if (was == NULL && PyErr_Occurred())
            goto done;
        PyObject *used = PyDict_GetItemWithError(spent, key);
        if (used == NULL && PyErr_Occurred())
            goto done;
        unseen_for[i] = 0;
        spent_part[i] = 0.0;
        if ((was != NULL && !an_int(was, &unseen_for[i]))
            || (used != NULL && !a_number(used, &spent_part[i]))) {
            bail = 1;
            break;
        }
        keys[i++] = key;
    }
    if (bail || (total > 0 && !isfinite(total))) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    double least = 1.0 / (double)remembered;
    for (Py_ssize_t d = 0; d < m; d++) {
        PyObject *given = PyList_GET_ITEM(owners, d);
        for (Py_ssize_t j = 0; j < n; j++) {
            int in_given = 0;
            for (Py_ssize_t k = 0; k < PyList_GET_SIZE(given) && !in_given; k++)
                in_given = same_str(keys[j], PyList_GET_ITEM(given, k));
            if (seen[j] + 1 >= EXACT_INT || unseen_for[j] + 1 >= EXACT_INT) {
                result = Py_NewRef(Py_None); /* nothing written yet */
                goto done;
            }
            seen[j] += 1;
            double alpha = py_max(1.0 / (double)seen[j], least);
            periods[j] += alpha * ((in_given ? 1.0 : 0.0) - periods[j]);
            if (total > 0)
                token_parts[j] += alpha * (spent_part[j] / total - token_parts[j]);
            unseen_for[j] = in_given ? 0 : unseen_for[j] + 1;
        }
    }
    if (PyErr_Occurred())
        goto done;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *part = Py_BuildValue("(ddL)", periods[j], token_parts[j], seen[j]);
        PyObject *count = part == NULL ? NULL : PyLong_FromLongLong(unseen_for[j]);
        int failed = count == NULL || PyDict_SetItem(parts, keys[j], part) < 0
                     || PyDict_SetItem(unseen, keys[j], count) < 0;
        Py_XDECREF(part);
        Py_XDECREF(count);
        if (failed)
            goto done;
    }
    result = Py_NewRef(Py_True);
done:
    PyMem_Free(keys);
    PyMem_Free(work);
    PyMem_Free(counts);
    return result;
}

static PyMethodDef methods[] = {
    {"learn", learn, METH_VARARGS,
     "learn(costs, tokens, drawn, fading, top): timesliced._newton_steps in C; True, or None "
     "where the reference is to run"},
    {"watch", watch, METH_VARARGS,
     "watch(sums, expected, drawn, odds, log_odds, eps, evidence): ChangeWatch._judge in C; "
     "the containers found changed, or None where the reference is to run"},
    {"age", age, METH_VARARGS,
     "age(parts, unseen, owners, spent, total, remembered): timesliced._age_parts in C; True, "
     "or None where the reference is to run"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_splitc",
    "The time-sliced split's loops over a GPU's containers, float for float with the Python "
    "reference (vgpu_agent/throttle/timesliced.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__splitc(void)
{
    PyObject *builtins = PyEval_GetBuiltins(); /* borrowed */
    if (builtins == NULL)
        return NULL;
    builtin_sum = PyDict_GetItemString(builtins, "sum");
    if (builtin_sum == NULL) {
        PyErr_SetString(PyExc_ImportError, "builtins.sum not found");
        return NULL;
    }
    Py_INCREF(builtin_sum);
    return PyModule_Create(&module_def);
}
