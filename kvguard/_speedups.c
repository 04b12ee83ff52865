/* kvguard._speedups: the placement check in C.
 *
 * same_values(containers, held) -> bool
 *   True when the lists and dicts in `containers` (a tuple), walked in order, hold
 *   exactly the objects of `held` (a tuple), compared by identity. No Python code runs
 *   and no object is compared by value, so a tensor's __eq__ is never called.
 *
 * The capsule `kvguard._speedups._api` gives the same check to kvguard._write_hook, which
 * runs it before every writing op without entering Python code.
 *
 * Optional: kvguard/_tree.py falls back to the same check in Python when this module
 * did not build.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* 1 when the containers hold exactly `held`, 0 when not, -1 with an exception set. */
static int
check(PyObject *containers, PyObject *held)
{
    if (!PyTuple_Check(containers) || !PyTuple_Check(held)) {
        PyErr_SetString(PyExc_TypeError, "same_values() takes two tuples");
        return -1;
    }
    Py_ssize_t k = 0, n_held = PyTuple_GET_SIZE(held);
    for (Py_ssize_t c = 0; c < PyTuple_GET_SIZE(containers); c++) {
        PyObject *container = PyTuple_GET_ITEM(containers, c);
        if (PyList_Check(container)) {
            Py_ssize_t n = PyList_GET_SIZE(container);
            if (k + n > n_held)
                return 0;
            /* Both keep their items as contiguous pointer arrays: one memcmp. */
            if (n && memcmp(((PyListObject *)container)->ob_item, ((PyTupleObject *)held)->ob_item + k,
                            (size_t)n * sizeof(PyObject *)) != 0)
                return 0;
            k += n;
        }
        else if (PyDict_Check(container)) {
            Py_ssize_t pos = 0;
            PyObject *key, *value;
            while (PyDict_Next(container, &pos, &key, &value)) {
                if (k >= n_held || value != PyTuple_GET_ITEM(held, k))
                    return 0;
                k++;
            }
        }
        else {
            PyErr_SetString(PyExc_TypeError, "same_values() compares lists and dicts only");
            return -1;
        }
    }
    return k == n_held;
}

static PyObject *
same_values(PyObject *self, PyObject *args)
{
    PyObject *containers, *held;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &containers, &PyTuple_Type, &held))
        return NULL;
    int same = check(containers, held);
    if (same < 0)
        return NULL;
    return PyBool_FromLong(same);
}

/* The capsule's contents: a version and the check (the GIL held, `containers` and `held` tuples). */
typedef struct {
    int version;
    int (*same_values)(PyObject *containers, PyObject *held);
} kvguard_speedups_api;

static kvguard_speedups_api api = {1, check};

static PyMethodDef methods[] = {
    {"same_values", same_values, METH_VARARGS,
     "same_values(containers, held): do the lists and dicts hold exactly `held`, by identity?"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvguard._speedups", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *capsule = PyCapsule_New(&api, "kvguard._speedups._api", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_api", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
