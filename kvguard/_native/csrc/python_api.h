// What write_hook.cpp's Python API and describe.h share: borrowing a kvguard C helper's
// functions through its capsule, and turning C++ exceptions into Python ones. Part of the
// one translation unit write_hook.cpp (see kvguard/_native/build.py).
#pragma once

#include <Python.h>

#include <exception>

#include <torch/csrc/Exceptions.h>

namespace {

// The functions a kvguard C helper lends through its `_api` capsule (version 1), imported
// once; nullptr when the helper did not build. With the GIL.
template <class Api>
const Api* borrowed_api(const char* capsule) {
  static const Api* api = nullptr;
  static bool tried = false;
  if (!tried) {
    tried = true;
    api = static_cast<const Api*>(PyCapsule_Import(capsule, 0));
    if (api == nullptr || api->version != 1) {
      PyErr_Clear();
      api = nullptr;
    }
  }
  return api;
}

// An owned reference, released when it goes out of scope (the GIL must be held then).
struct PyRef {
  PyObject* p;
  ~PyRef() { Py_XDECREF(p); }
};

}  // namespace

// Around the body of a function called from Python: a C++ exception becomes a Python one.
#define KVGUARD_TRY try {
#define KVGUARD_CATCH                                     \
  }                                                       \
  catch (python_error & e) {                              \
    e.restore();                                          \
    return nullptr;                                       \
  }                                                       \
  catch (const std::exception& e) {                       \
    PyErr_SetString(PyExc_RuntimeError, e.what());        \
    return nullptr;                                       \
  }
