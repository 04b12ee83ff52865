/* kvguard._native.stores: the moment a value is stored into a watched dict (CPython 3.12+ dict watchers).
 *
 * start(callback) -> bool
 *   Registers one dict watcher for the process (once; later calls only replace the callback).
 *   False where the interpreter has no dict watchers (before 3.12), or none is free.
 *
 * watch(d) / unwatch(d)
 *   Start and stop calling `callback(d, key, value)` for stores into the dict `d`, just
 *   before each lands: `d[key] = value`, `d.update(...)`, `d.setdefault(...)`, `d |= ...`,
 *   an attribute stored into an instance `__dict__`. For a dict that was empty and had a
 *   whole dict merged into it, `key` is None and `value` that dict.
 *
 * Stores of None, bools, numbers, strings and bytes (a metrics dict's floats) never enter
 * Python. The callback must not write into `d` (CPython's rule for watchers) and its
 * exceptions are the caller's to catch: one that escapes is printed as unraisable, and the
 * store goes on. A store made while the callback runs (on any thread holding the GIL then)
 * does not call it again.
 *
 * Optional: kvguard/_protect/stores.py says a placement is protected at the next write op
 * when this module did not build or `start` returns False.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX >= 0x030C0000
#define HAVE_DICT_WATCHERS 1
#endif

static PyObject *callback = NULL;  /* the Python function told of each store */

#ifdef HAVE_DICT_WATCHERS
static int watcher_id = -1;
static int inside = 0;  /* the callback runs: stores it makes are its own */

static int
scalar(PyObject *value)
{
    return value == Py_None || PyBool_Check(value) || PyLong_CheckExact(value) || PyFloat_CheckExact(value)
           || PyUnicode_CheckExact(value) || PyBytes_CheckExact(value);
}

static int
on_event(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *new_value)
{
    if (event == PyDict_EVENT_CLONED) {  /* an empty dict updated from a whole dict: that dict comes as `key` */
        new_value = key;
        key = NULL;
    }
    else if (event != PyDict_EVENT_ADDED && event != PyDict_EVENT_MODIFIED)
        return 0;
    if (callback == NULL || inside || new_value == NULL)
        return 0;
    if (scalar(new_value))
        return 0;
    inside = 1;
    PyObject *result = PyObject_CallFunctionObjArgs(callback, dict, key != NULL ? key : Py_None, new_value, NULL);
    inside = 0;
    if (result == NULL)
        return -1;  /* CPython prints it as unraisable; the store goes on */
    Py_DECREF(result);
    return 0;
}
#endif

static PyObject *
start(PyObject *self, PyObject *arg)
{
    if (!PyCallable_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "start() takes a callable");
        return NULL;
    }
#ifdef HAVE_DICT_WATCHERS
    if (watcher_id < 0) {
        watcher_id = PyDict_AddWatcher(on_event);
        if (watcher_id < 0) {  /* all eight taken by other extensions */
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
    }
    Py_INCREF(arg);
    Py_XSETREF(callback, arg);
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *
watch(PyObject *self, PyObject *dict)
{
#ifdef HAVE_DICT_WATCHERS
    if (!PyDict_Check(dict)) {
        PyErr_SetString(PyExc_TypeError, "watch() takes a dict");
        return NULL;
    }
    if (watcher_id < 0) {
        PyErr_SetString(PyExc_RuntimeError, "watch() before start()");
        return NULL;
    }
    if (PyDict_Watch(watcher_id, dict) < 0)
        return NULL;
#endif
    Py_RETURN_NONE;
}

static PyObject *
unwatch(PyObject *self, PyObject *dict)
{
#ifdef HAVE_DICT_WATCHERS
    if (!PyDict_Check(dict)) {
        PyErr_SetString(PyExc_TypeError, "unwatch() takes a dict");
        return NULL;
    }
    if (watcher_id >= 0 && PyDict_Unwatch(watcher_id, dict) < 0)
        return NULL;
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"start", start, METH_O, "start(callback): call callback(d, key, value) before each store into a watched dict"},
    {"watch", watch, METH_O, "watch(d): tell the callback of stores into the dict d"},
    {"unwatch", unwatch, METH_O, "unwatch(d): stop telling it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvguard._native.stores", NULL, -1, methods};

PyMODINIT_FUNC
PyInit_stores(void)
{
    return PyModule_Create(&module);
}
