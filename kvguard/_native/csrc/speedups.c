/* kvguard._native.speedups: the placement check, and the walk's leaves for a list of tensors, in C.
 *
 * same_values(containers, held) -> bool
 *   True when the lists and dicts in `containers` (a tuple), walked in order, hold
 *   exactly the objects of `held` (a tuple), compared by identity. No Python code runs
 *   and no object is compared by value, so a tensor's __eq__ is never called.
 *
 * list_leaves(lst, path, chain, tensor_type, leaf_type) -> list | None
 *   The walk's leaves for a list of tensors, built in C (see below).
 *
 * list_tensors(lst, tensor_type) -> list | None
 *   The same list's tensors alone, for a walk that keeps a list of tensors as one run.
 *
 * The capsule `kvguard._native.speedups._api` gives the same check to kvguard._native.write_hook, which
 * runs it before every writing op without entering Python code.
 *
 * Optional: kvguard/_protect/tree.py falls back to the same check in Python when this module
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

/* A copy of `lst`'s storage (no __iter__ of a subclass runs, so user code cannot change it
 * under us) when every item is an instance of `tensor_type`; a new reference to None when
 * one is not; NULL with an exception set. */
static PyObject *
tensors_copy(PyObject *lst, PyObject *tensor_type)
{
    PyObject *items = PyList_GetSlice(lst, 0, PY_SSIZE_T_MAX);
    if (items == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        int is = PyObject_IsInstance(PyList_GET_ITEM(items, i), tensor_type);
        if (is <= 0) {
            Py_DECREF(items);
            if (is < 0)
                return NULL;
            Py_RETURN_NONE;
        }
    }
    return items;
}

/* list_leaves(lst, path, chain, tensor_type, leaf_type) -> list | None
 *   The leaves of a list whose items are all instances of `tensor_type` (a per-sample
 *   list of tensors): `leaf_type((f"{path}[{i}]", item, chain + ((lst, i),)))` for each,
 *   in order; None as soon as one item is something else (the caller walks it in Python). */
static PyObject *
list_leaves(PyObject *self, PyObject *args)
{
    PyObject *lst, *path, *chain, *tensor_type;
    PyTypeObject *leaf_type;
    if (!PyArg_ParseTuple(args, "O!UO!OO!", &PyList_Type, &lst, &path, &PyTuple_Type, &chain, &tensor_type,
                          &PyType_Type, &leaf_type))
        return NULL;
    if (!PyType_IsSubtype(leaf_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "list_leaves(): leaf_type must be a tuple subclass");
        return NULL;
    }
    PyObject *items = tensors_copy(lst, tensor_type);
    if (items == NULL || items == Py_None)
        return items;
    Py_ssize_t n = PyList_GET_SIZE(items), depth = PyTuple_GET_SIZE(chain);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        PyObject *leaf_path = PyUnicode_FromFormat("%U[%zd]", path, i);
        PyObject *index = PyLong_FromSsize_t(i);
        PyObject *step = index == NULL ? NULL : PyTuple_Pack(2, lst, index);
        PyObject *leaf_chain = step == NULL ? NULL : PyTuple_New(depth + 1);
        PyObject *leaf = leaf_chain == NULL || leaf_path == NULL ? NULL : leaf_type->tp_alloc(leaf_type, 3);
        Py_XDECREF(index);
        if (leaf == NULL) {
            Py_XDECREF(leaf_path);
            Py_XDECREF(step);
            Py_XDECREF(leaf_chain);
            goto fail;
        }
        for (Py_ssize_t d = 0; d < depth; d++)
            PyTuple_SET_ITEM(leaf_chain, d, Py_NewRef(PyTuple_GET_ITEM(chain, d)));
        PyTuple_SET_ITEM(leaf_chain, depth, step);
        PyTuple_SET_ITEM(leaf, 0, leaf_path);
        PyTuple_SET_ITEM(leaf, 1, Py_NewRef(item));
        PyTuple_SET_ITEM(leaf, 2, leaf_chain);
        PyList_SET_ITEM(out, i, leaf);
    }
    Py_DECREF(items);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(items);
    return NULL;
}

/* list_tensors(lst, tensor_type) -> list | None
 *   A copy of a list whose items are all instances of `tensor_type`, else None: what
 *   list_leaves reads, without a leaf per item (kvguard._protect.tree's runs). */
static PyObject *
list_tensors(PyObject *self, PyObject *args)
{
    PyObject *lst, *tensor_type;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &lst, &tensor_type))
        return NULL;
    return tensors_copy(lst, tensor_type);
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
    {"list_leaves", list_leaves, METH_VARARGS,
     "list_leaves(lst, path, chain, tensor_type, leaf_type): the leaves of a list of tensors, or None"},
    {"list_tensors", list_tensors, METH_VARARGS,
     "list_tensors(lst, tensor_type): a copy of a list of tensors, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvguard._native.speedups", NULL, -1, methods};

PyMODINIT_FUNC
PyInit_speedups(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *capsule = PyCapsule_New(&api, "kvguard._native.speedups._api", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_api", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
