// describe(): what kvguard's protected set records of a batch of tensors, in one pass.
// Part of the one translation unit write_hook.cpp (see kvguard/_native/build.py).
#pragma once

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/autograd/python_variable.h>

#include "python_api.h"

namespace {

// ---- describing protected tensors -------------------------------------------------------
// What kvguard's protected set records of each tensor when it starts protecting it and
// compares at the boundaries: which bytes its elements span, a hash of its identity and
// layout (a re-pointed or reshaped tensor gets another), and a digest of its values. One
// call for a whole batch: per tensor it costs a few metadata reads instead of a dozen
// Python calls. The digest is the one kvguard._native.digest computes (through its capsule), so
// digests taken here and there agree.

struct DigestApi {
  int version;
  int max_dims;
  uint64_t (*digest_strided)(const unsigned char*, Py_ssize_t, int, const Py_ssize_t*,
                             const Py_ssize_t*);
};

const DigestApi* digest_api() { return borrowed_api<DigestApi>("kvguard._native.digest._api"); }

inline uint64_t mix64(uint64_t h, uint64_t v) {  // splitmix64 over a running hash
  h ^= v + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2);
  h ^= h >> 30;
  h *= 0xBF58476D1CE4E5B9ULL;
  h ^= h >> 27;
  h *= 0x94D049BB133111EBULL;
  return h ^ (h >> 31);
}

struct Described {
  bool plain = false;  // false: Python describes it (a subclass, sparse, nested, meta, ...)
  uint64_t layout = 0, impl = 0;
  uintptr_t start = 0, stop = 0;  // both 0: no element memory (empty, or no data yet)
  bool dense = true;
  bool inference = false;  // an inference tensor (made inside torch.inference_mode())
  c10::Device device{c10::kCPU};
  // The digest: read on the host (CPU tensors inside their storage), left to Python's
  // torch-op digest (other devices), or none (elements outside the storage).
  enum { kNone, kHost, kDevice } digest_kind = kNone;
  const unsigned char* data = nullptr;
  Py_ssize_t itemsize = 0;
  c10::SmallVector<Py_ssize_t, 8> sizes, strides;  // inline: no allocation per tensor
  uint64_t digest = 0;
};

// ---- the record -------------------------------------------------------------------------
// What the protected set keeps of a tensor is one type on both sides: the NamedTuple
// kvguard._protect.records.Record, handed over once (set_record_type, from records.bind) and
// checked against kRecordFields, the one place its field order is written. C++ fills the
// first eight; `spans` is Python's (None here: the one span is device, start, stop, dense).

constexpr const char* kRecordFields[] = {"layout", "impl",   "device",    "start", "stop",
                                         "dense",  "digest", "inference", "spans"};
constexpr Py_ssize_t kRecordSize = sizeof(kRecordFields) / sizeof(kRecordFields[0]);

PyTypeObject* record_type = nullptr;  // a strong reference, once handed over

// RECORD_FIELDS: the field names, in order, as the module exports them.
PyObject* record_fields() {
  PyObject* names = PyTuple_New(kRecordSize);
  if (names == nullptr) return nullptr;
  for (Py_ssize_t k = 0; k < kRecordSize; ++k) {
    PyObject* name = PyUnicode_FromString(kRecordFields[k]);
    if (name == nullptr) {
      Py_DECREF(names);
      return nullptr;
    }
    PyTuple_SET_ITEM(names, k, name);
  }
  return names;
}

// set_record_type(type): the tuple subclass records are built as; its `_fields` must be
// kRecordFields, and it may add no storage of its own (a NamedTuple's `__slots__ = ()`).
PyObject* py_set_record_type(PyObject*, PyObject* arg) {
  if (!PyType_Check(arg) || !PyType_IsSubtype((PyTypeObject*)arg, &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "set_record_type: expected a tuple subclass (a NamedTuple)");
    return nullptr;
  }
  auto* type = (PyTypeObject*)arg;
  if (type->tp_basicsize != PyTuple_Type.tp_basicsize || type->tp_itemsize != PyTuple_Type.tp_itemsize ||
      type->tp_dictoffset != 0) {
    PyErr_Format(PyExc_TypeError, "set_record_type: %.100s adds storage to its tuple", type->tp_name);
    return nullptr;
  }
  PyObject* fields = PyObject_GetAttrString(arg, "_fields");
  if (fields == nullptr) PyErr_Clear();  // not a NamedTuple: no fields to match
  PyObject* expected = fields == nullptr ? nullptr : record_fields();
  const int same = expected == nullptr ? 0 : PyObject_RichCompareBool(fields, expected, Py_EQ);
  Py_XDECREF(fields);
  Py_XDECREF(expected);
  if (same < 0) return nullptr;
  if (!same) {
    PyErr_Format(PyExc_TypeError, "set_record_type: %.100s's fields are not RECORD_FIELDS", type->tp_name);
    return nullptr;
  }
  Py_INCREF(arg);
  Py_XSETREF(record_type, type);
  Py_RETURN_NONE;
}

// A record of the type handed over, from the eight values C++ fills (references stolen, any
// of them nullptr: an error is set, and the others are released). Not tracked by the garbage
// collector: it holds ints, bools, None and a torch.device, so it is in no cycle (as CPython
// untracks such exact tuples at their first collection, which never untracks a subclass's:
// 100,000 tracked records made each collection during a batch cost more than the batch).
PyObject* new_record(PyObject* layout, PyObject* impl, PyObject* device, PyObject* start, PyObject* stop,
                     PyObject* dense, PyObject* digest, PyObject* inference) {
  PyObject* items[kRecordSize] = {layout, impl, device, start, stop, dense, digest, inference, Py_NewRef(Py_None)};
  bool missing = false;
  for (PyObject* item : items) missing = missing || item == nullptr;
  PyObject* record = nullptr;
  if (!missing && record_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError,
                    "kvguard: no record type handed to the write hook (kvguard._protect.records.bind)");
  } else if (!missing) {
#if PY_VERSION_HEX < 0x030E0000
    // As tuple_subtype_new allocates a subclass's instance, without its temporary tuple.
    record = record_type->tp_alloc(record_type, kRecordSize);
    if (record != nullptr) {
      for (Py_ssize_t k = 0; k < kRecordSize; ++k) PyTuple_SET_ITEM(record, k, items[k]);
      PyObject_GC_UnTrack(record);  // see below
      return record;
    }
#else
    // Python 3.14 caches a tuple's hash in the object: only tuple's own constructor sets it up.
    PyObject* plain = PyTuple_New(kRecordSize);
    if (plain != nullptr) {
      for (Py_ssize_t k = 0; k < kRecordSize; ++k) PyTuple_SET_ITEM(plain, k, items[k]);
      PyObject* args = PyTuple_Pack(1, plain);
      Py_DECREF(plain);
      if (args == nullptr) return nullptr;
      record = PyTuple_Type.tp_new(record_type, args, nullptr);
      Py_DECREF(args);
      if (record != nullptr) PyObject_GC_UnTrack(record);  // see below
      return record;
    }
#endif
  }
  for (PyObject* item : items) Py_XDECREF(item);
  return nullptr;
}

// A plain strided tensor's layout token: its TensorImpl, where its elements start, its dtype,
// device, sizes and strides, hashed (another token: re-pointed, or re-laid out).
// Two independent chains (half the latency of one: a refresh reads every row's token), each
// step a bijection of the running hash for a given value and of the value for a given hash,
// and so is their join: tokens of two layouts that differ in one of these always differ.
inline uint64_t token_step(uint64_t h, uint64_t v) {
  h = (h ^ v) * 0x9E3779B97F4A7C15ULL;
  return h ^ (h >> 29);
}

inline uint64_t layout_token(const c10::TensorImpl* impl, const unsigned char* base, int64_t offset,
                             c10::Device device, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  uint64_t a = token_step(0x6B76677561726431ULL, reinterpret_cast<uintptr_t>(impl));
  uint64_t b = token_step(0x243F6A8885A308D3ULL, reinterpret_cast<uintptr_t>(base));
  a = token_step(a, (uint64_t)offset);
  b = token_step(b, (uint64_t)static_cast<int>(impl->dtype().toScalarType()));
  a = token_step(a, (uint64_t)static_cast<int>(device.type()) * 65536 + (uint64_t)(device.index() + 1));
  b = token_step(b, sizes.size());
  for (size_t k = 0; k < sizes.size(); ++k) {
    a = token_step(a, (uint64_t)sizes[k]);
    b = token_step(b, (uint64_t)strides[k]);
  }
  return mix64(a, b);
}

void describe_tensor(const at::Tensor& t, Described& d, bool want_digest, int max_dims) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->layout() != c10::kStrided || impl->is_nested() || t.is_quantized() ||
      !impl->has_storage() || impl->device_type() == c10::DeviceType::Meta ||
      impl->has_symbolic_sizes_strides()) {
    return;  // plain stays false
  }
  const c10::Storage& storage = impl->storage();
  const auto* base = static_cast<const unsigned char*>(storage.data());  // never materializes COW
  const int64_t offset = impl->storage_offset();
  const int64_t itemsize = static_cast<int64_t>(impl->itemsize());
  const auto sizes = impl->sizes();
  const auto strides = impl->strides();
  int64_t numel = 1, reach = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (sizes[k] < 0 || strides[k] < 0) return;
    numel *= sizes[k];
    reach += (sizes[k] > 0 ? sizes[k] - 1 : 0) * strides[k];
  }
  d.plain = true;
  d.inference = impl->is_inference();
  d.impl = reinterpret_cast<uintptr_t>(impl);
  d.device = impl->device();
  // As `t.data_ptr()` reads it (a storage freed with resize_(0) has a null base): no element
  // memory only when that is null, as kvguard._torch.spans decides.
  const uintptr_t first = reinterpret_cast<uintptr_t>(base) + (uintptr_t)(offset * itemsize);
  if (first != 0 && numel > 0) {
    d.start = first;
    d.stop = first + (uintptr_t)((reach + 1) * itemsize);
  }
  // Dense: the elements tile their span (dims by ascending stride, each stepping exactly
  // over the ones inside it), as kvguard._torch.is_dense decides.
  if (!impl->is_contiguous()) {
    std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims of size != 1
    for (size_t k = 0; k < sizes.size(); ++k)
      if (sizes[k] != 1) dims.emplace_back(strides[k], sizes[k]);
    std::stable_sort(dims.begin(), dims.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    int64_t expected = 1;
    for (const auto& [stride, size] : dims) {
      if (stride != expected) {
        d.dense = false;
        break;
      }
      expected *= size;
    }
  }
  d.layout = layout_token(impl, base, offset, d.device, sizes, strides);
  if (!want_digest) return;
  if (d.device.type() != c10::DeviceType::CPU) {
    d.digest_kind = Described::kDevice;
    return;
  }
  const bool inside = numel == 0 ||
      (base != nullptr && offset >= 0 && (offset + reach + 1) * itemsize <= (int64_t)storage.nbytes());
  if (!inside) return;  // elements outside the storage: nothing to digest
  if ((int)sizes.size() > max_dims) {  // more dims than the C digest takes, or no C digest: Python's
    d.digest_kind = Described::kDevice;
    return;
  }
  d.digest_kind = Described::kHost;
  d.data = base == nullptr ? nullptr : base + offset * itemsize;
  d.itemsize = (Py_ssize_t)itemsize;
  d.sizes.assign(sizes.begin(), sizes.end());
  d.strides.assign(strides.begin(), strides.end());
}

void describe_one(PyObject* obj, Described& d, bool want_digest, int max_dims) {
  describe_tensor(THPVariable_Unpack(obj), d, want_digest, max_dims);
}

// describe(tensors, plain_types, digest) -> list, one item per tensor: None when Python
// must describe it (not one of `plain_types` exactly, or not plain strided memory), else a
// record (the type set_record_type was handed; fields as kRecordFields): `layout` an int that
// changes when the tensor is re-pointed or its layout changes, `impl` its TensorImpl address
// (`_cdata`), `device` a torch.device, [start, stop) the bytes its elements span ((0, 0) for
// none), `dense` whether the elements tile that span, and `digest` an int (CPU), None (nothing
// readable, or `digest` false) or NotImplemented (another device: Python digests it there);
// `inference` whether it is an inference tensor; `spans` None.
PyObject* py_describe(PyObject*, PyObject* args) {
  KVGUARD_TRY
  PyObject *tensors = nullptr, *plain_types = nullptr;
  int want_digest = 1;
  if (!PyArg_ParseTuple(args, "O!O!p", &PyList_Type, &tensors, &PyTuple_Type, &plain_types,
                        &want_digest)) {
    return nullptr;
  }
  const DigestApi* api = want_digest ? digest_api() : nullptr;
  const int max_dims = api == nullptr ? 0 : api->max_dims;
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  const Py_ssize_t ntypes = PyTuple_GET_SIZE(plain_types);
  std::vector<Described> found((size_t)n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyList_GET_ITEM(tensors, i);
    bool plain = false;
    for (Py_ssize_t k = 0; k < ntypes && !plain; ++k)
      plain = (PyObject*)Py_TYPE(obj) == PyTuple_GET_ITEM(plain_types, k);
    if (!plain || !THPVariable_Check(obj)) continue;
    try {
      describe_one(obj, found[(size_t)i], want_digest != 0, max_dims);
    } catch (...) {
      found[(size_t)i] = Described();  // Python describes it, and copes with what threw
    }
    if (api == nullptr && found[(size_t)i].digest_kind == Described::kHost)
      found[(size_t)i].digest_kind = Described::kDevice;  // no C digest here: Python's
  }
  Py_BEGIN_ALLOW_THREADS  // the tensors stay alive: `tensors` holds them
  for (Described& d : found) {
    if (d.digest_kind == Described::kHost)
      d.digest = api->digest_strided(d.data, d.itemsize, (int)d.sizes.size(), d.sizes.data(),
                                     d.strides.data());
  }
  Py_END_ALLOW_THREADS
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  std::vector<std::pair<c10::Device, PyObject*>> devices;  // one torch.device per device
  auto device_object = [&](c10::Device device) -> PyObject* {
    for (auto& [known, object] : devices)
      if (known == device) return Py_NewRef(object);
    PyObject* object = THPDevice_New(device);
    if (object != nullptr) devices.emplace_back(device, object);
    return Py_XNewRef(object);
  };
  bool failed = false;
  for (Py_ssize_t i = 0; i < n && !failed; ++i) {
    const Described& d = found[(size_t)i];
    PyObject* item = nullptr;
    if (!d.plain) {
      item = Py_NewRef(Py_None);
    } else {
      PyObject* digest = d.digest_kind == Described::kHost ? PyLong_FromUnsignedLongLong(d.digest)
          : d.digest_kind == Described::kDevice ? Py_NewRef(Py_NotImplemented)
          : Py_NewRef(Py_None);
      item = new_record(PyLong_FromUnsignedLongLong(d.layout), PyLong_FromUnsignedLongLong(d.impl),
                        device_object(d.device), PyLong_FromSize_t(d.start), PyLong_FromSize_t(d.stop),
                        PyBool_FromLong(d.dense), digest, PyBool_FromLong(d.inference));
    }
    if (item == nullptr) {
      failed = true;
    } else {
      PyList_SET_ITEM(out, i, item);
    }
  }
  for (auto& [known, object] : devices) Py_DECREF(object);
  if (failed) {
    Py_DECREF(out);
    return nullptr;
  }
  return out;
  KVGUARD_CATCH
}

}  // namespace
