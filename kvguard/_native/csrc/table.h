// Table: a protected set's tensors kept in C++, one row each, as arrays.
// Part of the one translation unit write_hook.cpp (see kvguard/_native/build.py).
//
// Why: a guard over many tensors paid, per tensor, for a Python entry, a weak reference, a
// record tuple and dict slots (about 5 µs and 680 bytes), and its first write built a
// lookup index over all of them in Python. Here a row is a few machine words: a weak
// reference to the TensorImpl (keeps nothing alive: the storage goes with the last strong
// reference; only the small TensorImpl object waits for `sweep`), the byte span its
// elements cover, a layout hash, a digest and flags. Batches go in and are compared in one
// C++ pass each; the memory index is kept up to date as rows arrive (recent rows in a
// short unsorted tail, merged into the sorted runs when it grows), so no write pays for
// indexing the whole set. Python keeps only what reports need (paths, placement sites),
// by row number.
//
// Rows are never renumbered: a dead row stays (flag kGone) until the table is cleared.
// Every method needs the GIL.
#pragma once

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/autograd/python_variable.h>

#include "describe.h"
#include "python_api.h"

namespace {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

enum RowFlag : uint8_t {
  kDense = 1,         // its elements tile [start, stop)
  kInference = 2,     // an inference tensor
  kDigest = 4,        // `digest` holds a host digest (else: none, or Python keeps it: kPyDigest)
  kExplained = 8,     // an op event reported a write since the digest was taken
  kPython = 16,       // not plain strided memory: Python keeps its record (and its index)
  kPyDigest = 32,     // its digest is taken by Python (another device)
  kGone = 64,         // dead and swept, or dropped: never looked at again
};

// The flags as the module exports them (write_hook.ROW_EXPLAINED, ...): Python reads these
// names (kvguard._protect.native), never the numbers.
struct RowFlagName {
  const char* name;
  RowFlag flag;
};
constexpr RowFlagName kRowFlagNames[] = {
    {"ROW_DENSE", kDense},   {"ROW_INFERENCE", kInference}, {"ROW_DIGEST", kDigest},
    {"ROW_EXPLAINED", kExplained}, {"ROW_PYTHON", kPython}, {"ROW_PY_DIGEST", kPyDigest},
    {"ROW_GONE", kGone},
};

bool add_row_flags(PyObject* module) {
  for (const RowFlagName& named : kRowFlagNames)
    if (PyModule_AddIntConstant(module, named.name, named.flag) < 0) return false;
  return true;
}

// TensorImpl address -> row, open addressing with linear probing (no node per row: 16 bytes
// a slot, at most half full). Erased slots keep a tombstone until the next growth.
class RowMap {
 public:
  static constexpr uintptr_t kEmpty = 0, kTomb = 1;
  int32_t find(const void* key) const {
    if (slots_.empty()) return -1;
    for (size_t i = slot(key);; i = (i + 1) & mask()) {
      if (slots_[i].key == (uintptr_t)key) return slots_[i].row;
      if (slots_[i].key == kEmpty) return -1;
    }
  }
  // The row `key` had (-1: none), `row` from now on.
  int32_t put(const void* key, int32_t row) {
    reserve(used_ + 1);
    size_t tomb = SIZE_MAX;
    for (size_t i = slot(key);; i = (i + 1) & mask()) {
      Slot& s = slots_[i];
      if (s.key == (uintptr_t)key) {
        const int32_t old = s.row;
        s.row = row;
        return old;
      }
      if (s.key == kTomb && tomb == SIZE_MAX) tomb = i;
      if (s.key == kEmpty) {
        Slot& into = slots_[tomb != SIZE_MAX ? tomb : i];
        if (into.key == kEmpty) ++used_;
        into.key = (uintptr_t)key;
        into.row = row;
        ++size_;
        return -1;
      }
    }
  }
  void erase(const void* key, int32_t row) {
    if (slots_.empty()) return;
    for (size_t i = slot(key);; i = (i + 1) & mask()) {
      Slot& s = slots_[i];
      if (s.key == (uintptr_t)key) {
        if (s.row == row) {
          s.key = kTomb;
          --size_;
        }
        return;
      }
      if (s.key == kEmpty) return;
    }
  }
  void prefetch(const void* key) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[slot(key)], 1);
  }
  // Room for `n` used slots (live and tombstones) at most half full.
  void reserve(size_t n) {
    if (2 * n <= slots_.size()) return;
    size_t cap = 16;
    while (cap < 2 * std::max(n, size_)) cap *= 2;
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(cap, Slot{kEmpty, -1});
    used_ = size_ = 0;
    for (const Slot& s : old)
      if (s.key != kEmpty && s.key != kTomb) put((const void*)s.key, s.row);
  }
  void clear() {
    slots_.clear();
    slots_.shrink_to_fit();
    used_ = size_ = 0;
  }
  size_t nbytes() const { return slots_.capacity() * sizeof(Slot); }

 private:
  struct Slot {
    uintptr_t key;
    int32_t row;
  };
  size_t mask() const { return slots_.size() - 1; }
  size_t slot(const void* key) const {
    uint64_t h = (uint64_t)(uintptr_t)key * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 20) & mask();
  }
  std::vector<Slot> slots_;
  size_t used_ = 0, size_ = 0;
};

struct IndexSpan {
  uintptr_t start, stop;
  int32_t row;
  c10::Device device;
};

struct TableData {
  // One entry per row.
  std::vector<WeakImpl> impl;
  std::vector<uint64_t> layout, digest;
  std::vector<uintptr_t> start, stop;
  std::vector<c10::Device> device;
  std::vector<uint8_t> flags;
  // Live rows by TensorImpl: a weak reference keeps the TensorImpl's address from being
  // reused, so the address names the row until it is swept.
  RowMap row_of;
  // The memory index: `sorted` by start with `reach` its running maximum of stops (so the
  // first span that can meet an address is found by binary search), then `recent`, unsorted.
  // A span is current while its row is live and still has that span (a moved row leaves a
  // stale one behind, skipped and dropped at the next merge).
  std::vector<IndexSpan> sorted, recent;
  std::vector<uintptr_t> reach;
  bool want_digest = true;
  bool met_dead = false;  // a lookup met a row whose tensor died since the last sweep
  size_t live = 0;

  bool current(const IndexSpan& s) const {
    const auto r = (size_t)s.row;
    return !(flags[r] & kGone) && start[r] == s.start && stop[r] == s.stop && device[r] == s.device;
  }

  void merge_recent() {
    std::vector<IndexSpan> all;
    all.reserve(sorted.size() + recent.size());
    for (const IndexSpan& s : sorted)
      if (current(s)) all.push_back(s);
    std::vector<IndexSpan> fresh;
    fresh.reserve(recent.size());
    for (const IndexSpan& s : recent)
      if (current(s)) fresh.push_back(s);
    auto by_start = [](const IndexSpan& a, const IndexSpan& b) { return a.start < b.start; };
    std::sort(fresh.begin(), fresh.end(), by_start);
    const size_t middle = all.size();
    all.insert(all.end(), fresh.begin(), fresh.end());
    std::inplace_merge(all.begin(), all.begin() + (std::ptrdiff_t)middle, all.end(), by_start);
    sorted = std::move(all);
    recent.clear();
    if (recent.capacity() > 1024) std::vector<IndexSpan>().swap(recent);  // a large batch's room: given back
    reach.resize(sorted.size());
    uintptr_t most = 0;
    for (size_t i = 0; i < sorted.size(); ++i) reach[i] = most = std::max(most, sorted[i].stop);
  }

  // `batch`: more rows follow at once (add() merges once at its end).
  void index_row(int32_t row, bool batch = false) {
    const auto r = (size_t)row;
    if (flags[r] & (kPython | kGone) || start[r] >= stop[r]) return;
    recent.push_back(IndexSpan{start[r], stop[r], row, device[r]});
    // A short tail keeps a lookup cheap; merging when it reaches a sixteenth of the sorted
    // part (at least 64) costs O(1) amortized per row.
    if (!batch && recent.size() > 64 + sorted.size() / 16) merge_recent();
  }

  // Rows whose current span meets [lo, hi) on `dev`, each once, in row order.
  void meeting(uintptr_t lo, uintptr_t hi, c10::Device dev, std::vector<int32_t>* out) const {
    auto take = [&](const IndexSpan& s) {
      if (s.start < hi && lo < s.stop && s.device == dev && current(s)) out->push_back(s.row);
    };
    auto first = std::upper_bound(reach.begin(), reach.end(), lo);  // the first that reaches past lo
    for (size_t i = (size_t)(first - reach.begin()); i < sorted.size() && sorted[i].start < hi; ++i)
      take(sorted[i]);
    for (const IndexSpan& s : recent) take(s);
    std::sort(out->begin(), out->end());
    out->erase(std::unique(out->begin(), out->end()), out->end());
  }

  bool alive(size_t r) const { return !(flags[r] & kGone) && !impl[r].expired(); }

  void forget(size_t r) {
    if (flags[r] & kGone) return;
    row_of.erase(impl[r]._unsafe_get_target(), (int32_t)r);
    forget_dead(r);
  }

  // A dead row whose address a new row takes over (the map already points at the new one).
  void forget_dead(size_t r) {
    if (flags[r] & kGone) return;
    flags[r] |= kGone;
    impl[r] = WeakImpl(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>());
    --live;
  }

  void set_record(size_t r, const Described& d) {
    layout[r] = d.layout;
    start[r] = d.start;
    stop[r] = d.stop;
    device[r] = d.device;
    uint8_t f = flags[r] & (kExplained | kGone);
    if (!d.plain) f |= kPython;
    if (d.dense) f |= kDense;
    if (d.inference) f |= kInference;
    if (d.digest_kind == Described::kHost) f |= kDigest;
    if (d.digest_kind == Described::kDevice) f |= kPyDigest;
    flags[r] = f;
    digest[r] = d.digest;
  }

  void clear() {
    impl.clear();
    layout.clear();
    digest.clear();
    start.clear();
    stop.clear();
    device.clear();
    flags.clear();
    row_of.clear();
    sorted.clear();
    recent.clear();
    reach.clear();
    live = 0;
    impl.shrink_to_fit();
    layout.shrink_to_fit();
    digest.shrink_to_fit();
    start.shrink_to_fit();
    stop.shrink_to_fit();
    device.shrink_to_fit();
    flags.shrink_to_fit();
    sorted.shrink_to_fit();
    reach.shrink_to_fit();
  }
};

struct TableObject {
  PyObject_HEAD
  TableData* data;
  PyObject* plain_types;  // a tuple: exact types described in C++ (others: Python's)
};

PyTypeObject* table_type();

// A TensorImpl's refcounts, storage, sizes and strides lie on its first few cache lines.
inline void prefetch_impl(const c10::TensorImpl* impl, int write) {
  const char* p = reinterpret_cast<const char*>(impl);
  if (write) {
    __builtin_prefetch(p, 1);
  } else {
    __builtin_prefetch(p);
  }
  __builtin_prefetch(p + 64);
  __builtin_prefetch(p + 128);
}

// The i-th of a range of tensors: held (at::Tensor) or borrowed (a pointer to one its owner keeps).
inline const at::Tensor& tensor_at(const at::Tensor* tensors, size_t i) { return tensors[i]; }
inline const at::Tensor& tensor_at(const at::Tensor* const* tensors, size_t i) { return *tensors[i]; }

constexpr uintptr_t kDigestNow = 64 * 1024;  // bytes a digest takes with the GIL held, in the describe pass
constexpr auto kDigested = static_cast<decltype(Described::kHost)>(3);  // taken in that pass

// Describes tensors[0, n) (alive: the caller holds them; `plain(i)`: whether C++ describes the
// i-th), the digests on the host with the GIL released.
template <class Tensors, class Plain>
void describe_range(const Tensors& tensors, size_t n, Plain plain, std::vector<Described>* out,
                    bool want_digest) {
  const DigestApi* api = want_digest ? digest_api() : nullptr;
  const int max_dims = api == nullptr ? 0 : api->max_dims;
  out->assign(n, Described());
  for (size_t i = 0; i < n; ++i) {
    // Each tensor's TensorImpl, then its StorageImpl, are a cache miss apiece when the set is
    // large: fetched a few tensors ahead, so that the misses overlap instead of adding up.
    if (i + 16 < n) prefetch_impl(tensor_at(tensors, i + 16).unsafeGetTensorImpl(), 0);
    if (i + 8 < n) {
      const c10::TensorImpl* ahead = tensor_at(tensors, i + 8).unsafeGetTensorImpl();
      if (ahead->has_storage()) __builtin_prefetch(ahead->storage().unsafeGetStorageImpl());
    }
    if (i + 4 < n) {
      const c10::TensorImpl* ahead = tensor_at(tensors, i + 4).unsafeGetTensorImpl();
      if (ahead->has_storage() && ahead->storage().data() != nullptr)
        __builtin_prefetch(static_cast<const char*>(ahead->storage().data()) +
                           ahead->storage_offset() * (int64_t)ahead->itemsize());
    }
    if (!plain(i)) continue;
    Described& d = (*out)[i];
    try {
      describe_tensor(tensor_at(tensors, i), d, want_digest, max_dims);
    } catch (...) {
      d = Described();
    }
    if (api == nullptr && d.digest_kind == Described::kHost) d.digest_kind = Described::kDevice;
    if (d.digest_kind == Described::kHost && d.stop - d.start <= kDigestNow) {  // small: now, while it is in cache
      d.digest = api->digest_strided(d.data, d.itemsize, (int)d.sizes.size(), d.sizes.data(), d.strides.data());
      d.digest_kind = kDigested;
    }
  }
  if (api == nullptr) return;
  bool large = false;
  for (const Described& d : *out) large = large || d.digest_kind == Described::kHost;
  if (large) {
    Py_BEGIN_ALLOW_THREADS  // large tensors: other threads run meanwhile
    for (Described& d : *out)
      if (d.digest_kind == Described::kHost)
        d.digest = api->digest_strided(d.data, d.itemsize, (int)d.sizes.size(), d.sizes.data(), d.strides.data());
    Py_END_ALLOW_THREADS
  }
  for (Described& d : *out)
    if (d.digest_kind == kDigested) d.digest_kind = Described::kHost;
}

void describe_all(const std::vector<at::Tensor>& tensors, const std::vector<bool>& plain,
                  std::vector<Described>* out, bool want_digest) {
  describe_range(tensors.data(), tensors.size(), [&](size_t i) { return (bool)plain[i]; }, out, want_digest);
}

// How a refresh read a row again: the short way (quick_row: no move, a host digest or none),
// or fully (describe_tensor).
enum Quick : uint8_t { kDescribe = 0, kSameNoDigest = 1, kSameDigested = 2 };

// A row read again the short way, where it can be: a plain CPU tensor whose layout token is
// still the row's `layout` (so its span, density, device and kind are still the row's), its
// elements inside their storage and few enough to digest now (`want_digest`; into *digest,
// taken from the TensorImpl's own sizes and strides, no copy). What describe_tensor would find,
// without filling a Described; kDescribe where anything is otherwise (the full path decides).
inline Quick quick_row(const at::Tensor& t, uint64_t layout, const DigestApi* api, int max_dims, bool want_digest,
                       uint64_t* digest) {
  static_assert(sizeof(int64_t) == sizeof(Py_ssize_t), "sizes are read as Py_ssize_t");
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->layout() != c10::kStrided || impl->is_nested() || t.is_quantized() || !impl->has_storage() ||
      impl->device_type() != c10::DeviceType::CPU || impl->has_symbolic_sizes_strides()) {
    return kDescribe;
  }
  const c10::Storage& storage = impl->storage();
  const auto* base = static_cast<const unsigned char*>(storage.data());  // never materializes COW
  const int64_t offset = impl->storage_offset();
  const auto sizes = impl->sizes();
  const auto strides = impl->strides();
  int64_t numel = 1, reach = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (sizes[k] < 0 || strides[k] < 0) return kDescribe;
    numel *= sizes[k];
    reach += (sizes[k] > 0 ? sizes[k] - 1 : 0) * strides[k];
  }
  if (layout_token(impl, base, offset, impl->device(), sizes, strides) != layout) return kDescribe;
  if (!want_digest) return kSameNoDigest;
  const int64_t itemsize = static_cast<int64_t>(impl->itemsize());
  const bool inside = numel == 0 ||
      (base != nullptr && offset >= 0 && (offset + reach + 1) * itemsize <= (int64_t)storage.nbytes());
  if (api == nullptr || !inside || (int)sizes.size() > max_dims ||
      (numel > 0 && (uintptr_t)((reach + 1) * itemsize) > kDigestNow)) {
    return kDescribe;
  }
  *digest = api->digest_strided(base == nullptr ? nullptr : base + offset * itemsize, (Py_ssize_t)itemsize,
                                (int)sizes.size(), reinterpret_cast<const Py_ssize_t*>(sizes.data()),
                                reinterpret_cast<const Py_ssize_t*>(strides.data()));
  return kSameDigested;
}

// Rows a refresh describes at a time: their descriptions stay in cache between the pass that
// takes them and the one that compares them (a whole table's would not, at thousands of rows).
constexpr size_t kRefreshChunk = 128;

bool is_plain(TableObject* self, PyObject* obj) {
  PyObject* types = self->plain_types;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(types); ++k)
    if ((PyObject*)Py_TYPE(obj) == PyTuple_GET_ITEM(types, k)) return true;
  return false;
}

PyObject* table_new(PyTypeObject* type, PyObject* args, PyObject*) {
  PyObject* plain_types = nullptr;
  int want_digest = 1;
  if (!PyArg_ParseTuple(args, "O!p:Table", &PyTuple_Type, &plain_types, &want_digest)) return nullptr;
  auto* self = (TableObject*)type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  self->data = new (std::nothrow) TableData();
  if (self->data == nullptr) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  self->data->want_digest = want_digest != 0;
  self->plain_types = Py_NewRef(plain_types);
  return (PyObject*)self;
}

void table_dealloc(TableObject* self) {
  delete self->data;
  Py_XDECREF(self->plain_types);
  Py_TYPE(self)->tp_free((PyObject*)self);
}

PyObject* rows_list(const std::vector<size_t>& rows) {
  PyObject* out = PyList_New((Py_ssize_t)rows.size());
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < rows.size(); ++i) {
    PyObject* v = PyLong_FromSize_t(rows[i]);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, (Py_ssize_t)i, v);
  }
  return out;
}

// add(tensors) -> (first, again, python): the tensors not protected yet get rows first,
// first + 1, ... in their order; `again` lists (position, row) for each one that already has a
// live row (a second path to it, or one placed again), so the caller knows which positions
// took rows; `python` lists the new rows whose record or digest Python must take.
PyObject* table_add(TableObject* self, PyObject* arg) {
  KVGUARD_TRY
  if (!PyList_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "Table.add: expected a list of tensors");
    return nullptr;
  }
  TableData& t = *self->data;
  const Py_ssize_t n = PyList_GET_SIZE(arg);
  for (Py_ssize_t i = 0; i < n; ++i) {  // checked first: a bad item leaves the table as it was
    if (i + 8 < n) __builtin_prefetch(PyList_GET_ITEM(arg, i + 8));
    PyObject* obj = PyList_GET_ITEM(arg, i);
    if (!THPVariable_Check(obj)) {
      PyErr_Format(PyExc_TypeError, "Table.add: item %zd is a %.100s, not a tensor", i, Py_TYPE(obj)->tp_name);
      return nullptr;
    }
  }
  std::vector<at::Tensor> tensors;
  std::vector<bool> plain;
  tensors.reserve((size_t)n);
  plain.reserve((size_t)n);
  PyObject* again = PyList_New(0);
  if (again == nullptr) return nullptr;
  const int32_t first = (int32_t)t.impl.size();
  t.row_of.reserve(t.live + (size_t)n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + 4 < n) {  // the misses of tensors a few ahead (object, TensorImpl, map slot) overlap this one's
      const c10::TensorImpl* ahead = THPVariable_Unpack(PyList_GET_ITEM(arg, i + 4)).unsafeGetTensorImpl();
      __builtin_prefetch(ahead, 1);
      t.row_of.prefetch(ahead);
    }
    PyObject* obj = PyList_GET_ITEM(arg, i);
    const at::Tensor& tensor = THPVariable_Unpack(obj);
    const c10::TensorImpl* key = tensor.unsafeGetTensorImpl();
    const int32_t row = first + (int32_t)tensors.size();
    const int32_t known = t.row_of.put(key, row);
    if (known >= 0 && (known >= first || t.alive((size_t)known))) {
      t.row_of.put(key, known);  // protected already (or earlier in this batch): keeps its row
      PyObject* pair = Py_BuildValue("(ni)", i, known);
      if (pair == nullptr || PyList_Append(again, pair) < 0) {
        Py_XDECREF(pair);
        Py_DECREF(again);
        for (size_t k = 0; k < tensors.size(); ++k)  // nothing added
          t.row_of.erase(tensors[k].unsafeGetTensorImpl(), first + (int32_t)k);
        return nullptr;
      }
      Py_DECREF(pair);
      continue;
    }
    if (known >= 0) t.forget_dead((size_t)known);  // a dead row at this address: gone now
    tensors.push_back(tensor);
    plain.push_back(is_plain(self, obj));
  }
  std::vector<Described> found;
  describe_all(tensors, plain, &found, t.want_digest);
  const size_t total = t.impl.size() + tensors.size();
  t.impl.reserve(total);
  t.layout.resize(total);
  t.digest.resize(total);
  t.start.resize(total);
  t.stop.resize(total);
  t.device.resize(total, c10::Device(c10::kCPU));
  t.flags.resize(total, 0);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const size_t r = (size_t)first + k;
    t.impl.emplace_back(tensors[k].getIntrusivePtr());
    t.set_record(r, found[k]);
    ++t.live;
    t.index_row((int32_t)r, /*batch=*/true);
  }
  // One sort for a large batch, so that lookups stay logarithmic; small ones wait in the tail
  // until it reaches a sixteenth of the sorted part (a placement loop merges O(1) a row).
  if (t.recent.size() > 64 + t.sorted.size() / 16 || tensors.size() > 256) t.merge_recent();
  std::vector<size_t> python;  // new rows whose record or digest Python must take
  for (size_t k = 0; k < tensors.size(); ++k)
    if (t.flags[(size_t)first + k] & (kPython | kPyDigest)) python.push_back((size_t)first + k);
  PyObject* python_list = rows_list(python);
  if (python_list == nullptr) {
    Py_DECREF(again);
    return nullptr;
  }
  return Py_BuildValue("(iNN)", first, again, python_list);
  KVGUARD_CATCH
}

bool read_row(TableObject* self, PyObject* arg, size_t* out) {
  const long row = PyLong_AsLong(arg);
  if (row == -1 && PyErr_Occurred()) return false;
  if (row < 0 || (size_t)row >= self->data->impl.size()) {
    PyErr_Format(PyExc_IndexError, "Table: no row %ld", row);
    return false;
  }
  *out = (size_t)row;
  return true;
}

bool read_rows(TableObject* self, PyObject* arg, std::vector<size_t>* out) {
  PyObject* seq = PySequence_Fast(arg, "Table: expected a list of rows");
  if (seq == nullptr) return false;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); ++i) {
    size_t r = 0;
    ok = read_row(self, PySequence_Fast_GET_ITEM(seq, i), &r);
    if (ok) out->push_back(r);
  }
  Py_DECREF(seq);
  return ok;
}

// tensor(row) -> Tensor | None: the row's tensor, if it is alive (the same Python object).
PyObject* table_tensor(TableObject* self, PyObject* arg) {
  KVGUARD_TRY
  size_t r = 0;
  if (!read_row(self, arg, &r)) return nullptr;
  TableData& t = *self->data;
  if (t.flags[r] & kGone) Py_RETURN_NONE;
  auto strong = t.impl[r].lock();
  if (!strong) Py_RETURN_NONE;
  return THPVariable_Wrap(at::Tensor(std::move(strong)));
  KVGUARD_CATCH
}

// row_of(tensor) -> int: the live row protecting this very tensor, or -1.
PyObject* table_row_of(TableObject* self, PyObject* arg) {
  if (!THPVariable_Check(arg)) return PyLong_FromLong(-1);
  TableData& t = *self->data;
  const int32_t row = t.row_of.find(THPVariable_Unpack(arg).unsafeGetTensorImpl());
  return PyLong_FromLong(row >= 0 && t.alive((size_t)row) ? row : -1);
}

PyObject* device_object(c10::Device device) { return THPDevice_New(device); }

PyObject* record_of_row(TableObject* self, size_t r) {
  TableData& t = *self->data;
  const uint8_t f = t.flags[r];
  return new_record(PyLong_FromUnsignedLongLong(t.layout[r]),
                    PyLong_FromSize_t((uintptr_t)t.impl[r]._unsafe_get_target()), device_object(t.device[r]),
                    PyLong_FromSize_t(t.start[r]), PyLong_FromSize_t(t.stop[r]), PyBool_FromLong(f & kDense),
                    f & kDigest ? PyLong_FromUnsignedLongLong(t.digest[r]) : Py_NewRef(Py_None),
                    PyBool_FromLong(f & kInference));
}

// record(row) -> the record kvguard._protect.records keeps (describe.h's new_record): digest
// None where the table holds none.
PyObject* table_record(TableObject* self, PyObject* arg) {
  KVGUARD_TRY
  size_t r = 0;
  if (!read_row(self, arg, &r)) return nullptr;
  return record_of_row(self, r);
  KVGUARD_CATCH
}

// flags(row) -> int (the RowFlag bits).
PyObject* table_flags(TableObject* self, PyObject* arg) {
  size_t r = 0;
  if (!read_row(self, arg, &r)) return nullptr;
  return PyLong_FromLong(self->data->flags[r]);
}

// set_flag(row, flag, on): kExplained only, or kPython / kPyDigest / kGone from Python's side.
PyObject* table_set_flag(TableObject* self, PyObject* args) {
  PyObject* row_obj = nullptr;
  int flag = 0, on = 0;
  if (!PyArg_ParseTuple(args, "Oip:set_flag", &row_obj, &flag, &on)) return nullptr;
  size_t r = 0;
  if (!read_row(self, row_obj, &r)) return nullptr;
  TableData& t = *self->data;
  if (flag == kGone) {
    if (on) t.forget(r);
    Py_RETURN_NONE;
  }
  t.flags[r] = on ? (uint8_t)(t.flags[r] | flag) : (uint8_t)(t.flags[r] & ~flag);
  Py_RETURN_NONE;
}

// set_digest(row, digest: int | None): the host digest (None: none).
PyObject* table_set_digest(TableObject* self, PyObject* args) {
  PyObject *row_obj = nullptr, *value = nullptr;
  if (!PyArg_ParseTuple(args, "OO:set_digest", &row_obj, &value)) return nullptr;
  size_t r = 0;
  if (!read_row(self, row_obj, &r)) return nullptr;
  TableData& t = *self->data;
  if (value == Py_None) {
    t.flags[r] &= (uint8_t)~kDigest;
    Py_RETURN_NONE;
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(value);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) return nullptr;
  t.digest[r] = v;
  t.flags[r] |= kDigest;
  Py_RETURN_NONE;
}

// The live rows among `rows` (all rows when null) and their tensors: the k-th row asked is read
// from `given`'s k-th item where that is the row's very tensor (the caller holds it: no
// reference taken, which for a tensor with a Python object means no GIL round trip through
// torch's PyObject preservation), else its weak reference is locked into `held` (reserved up
// front: `tensors` points into it).
void lock_rows(TableData& t, const std::vector<size_t>* rows, PyObject* given, std::vector<size_t>* live,
               std::vector<const at::Tensor*>* tensors, std::vector<at::Tensor>* held) {
  const size_t asked = rows != nullptr ? rows->size() : t.impl.size();
  const Py_ssize_t ngiven = given != nullptr ? PyList_GET_SIZE(given) : 0;
  held->reserve(asked);
  live->reserve(asked);
  tensors->reserve(asked);
  for (size_t k = 0; k < asked; ++k) {
    const size_t r = rows != nullptr ? (*rows)[k] : k;
    if (rows == nullptr && k + 16 < asked && (Py_ssize_t)(k + 16) >= ngiven)
      prefetch_impl(t.impl[k + 16]._unsafe_get_target(), 1);  // its refcounts: written
    if (t.flags[r] & kGone) continue;
    if ((Py_ssize_t)k < ngiven) {
      PyObject* obj = PyList_GET_ITEM(given, (Py_ssize_t)k);
      if (THPVariable_Check(obj)) {
        const at::Tensor& tensor = THPVariable_Unpack(obj);
        if (tensor.unsafeGetTensorImpl() == t.impl[r]._unsafe_get_target()) {
          live->push_back(r);
          tensors->push_back(&tensor);
          continue;
        }
      }
    }
    auto strong = t.impl[r].lock();
    if (!strong) continue;
    live->push_back(r);
    held->emplace_back(std::move(strong));
    tensors->push_back(&held->back());
  }
}


// refresh(rows=None, digest=True, tensors=None, report=True) -> (changed, moved, python):
// reads each live row again (`rows`, or all) in one pass. `changed`: (row, digest kept, digest
// now) for rows whose host digest differs from the one kept and that no op event explained
// (left empty without `report`: digests taken as the next baseline after writes that were
// meant, an optimizer step's); `moved`: (row, old record) for rows re-pointed or re-laid out
// since (their span, layout and index follow the tensor now); `python`: live rows whose digest
// or record Python keeps (another device, not plain memory), for Python to compare. With
// `digest`, the kept digests become the ones read now and the explained marks are cleared;
// without, digests and marks are left as they are. `tensors`: a list the caller holds whose
// k-th item, where it is the k-th asked row's very tensor, is read from there (see lock_rows);
// the others through their weak references. A row whose layout token is unchanged is read the
// short way (quick_row); the others are described in full.
PyObject* table_refresh(TableObject* self, PyObject* args) {
  KVGUARD_TRY
  PyObject* rows_arg = Py_None;
  int with_digest = 1;
  PyObject* given_arg = Py_None;
  int report = 1;
  if (!PyArg_ParseTuple(args, "|OpOp:refresh", &rows_arg, &with_digest, &given_arg, &report)) return nullptr;
  if (given_arg != Py_None && !PyList_Check(given_arg)) {
    PyErr_SetString(PyExc_TypeError, "Table.refresh: tensors must be a list or None");
    return nullptr;
  }
  TableData& t = *self->data;
  std::vector<size_t> asked, live;
  if (rows_arg != Py_None && !read_rows(self, rows_arg, &asked)) return nullptr;
  // A copy of the caller's list: its items stay alive while the GIL is released for large
  // digests, whatever another thread does to the list meanwhile.
  PyRef given{given_arg == Py_None ? nullptr : PyList_GetSlice(given_arg, 0, PyList_GET_SIZE(given_arg))};
  if (given_arg != Py_None && given.p == nullptr) return nullptr;
  std::vector<const at::Tensor*> tensors;
  std::vector<at::Tensor> held;
  lock_rows(t, rows_arg == Py_None ? nullptr : &asked, given.p, &live, &tensors, &held);
  std::vector<bool> plain(live.size());
  for (size_t k = 0; k < live.size(); ++k) plain[k] = !(t.flags[live[k]] & kPython);
  std::vector<Described> found;
  std::vector<size_t> python;
  PyObject* moved = PyList_New(0);
  PyObject* changed = PyList_New(0);
  if (moved == nullptr || changed == nullptr) {
    Py_XDECREF(moved);
    Py_XDECREF(changed);
    return nullptr;
  }
  const bool want = with_digest && t.want_digest;
  const DigestApi* api = want ? digest_api() : nullptr;
  const int max_dims = api == nullptr ? 0 : api->max_dims;
  Quick quick[kRefreshChunk];
  uint64_t quick_digest[kRefreshChunk];
  size_t slot[kRefreshChunk];  // a fully described row's place in `found`
  std::vector<const at::Tensor*> slow;
  for (size_t k = 0; k < live.size(); ++k) {
    if (k % kRefreshChunk == 0) {  // the next chunk of rows read again, then compared
      const size_t n = std::min(kRefreshChunk, live.size() - k);
      slow.clear();
      for (size_t i = 0; i < n; ++i) {
        // The next rows' TensorImpls, storages and first elements fetched ahead (see describe_range).
        if (k + i + 16 < live.size()) prefetch_impl(tensors[k + i + 16]->unsafeGetTensorImpl(), 0);
        if (k + i + 8 < live.size()) {
          const c10::TensorImpl* ahead = tensors[k + i + 8]->unsafeGetTensorImpl();
          if (ahead->has_storage()) __builtin_prefetch(ahead->storage().unsafeGetStorageImpl());
        }
        if (k + i + 4 < live.size()) {
          const c10::TensorImpl* ahead = tensors[k + i + 4]->unsafeGetTensorImpl();
          if (ahead->has_storage() && ahead->storage().data() != nullptr)
            __builtin_prefetch(static_cast<const char*>(ahead->storage().data()) +
                               ahead->storage_offset() * (int64_t)ahead->itemsize());
        }
        quick[i] = kDescribe;
        if (plain[k + i]) {
          try {
            quick[i] = quick_row(*tensors[k + i], t.layout[live[k + i]], api, max_dims, want, &quick_digest[i]);
          } catch (...) {
            quick[i] = kDescribe;
          }
        }
        if (quick[i] == kDescribe && plain[k + i]) {
          slot[i] = slow.size();
          slow.push_back(tensors[k + i]);
        }
      }
      if (!slow.empty()) describe_range(slow.data(), slow.size(), [](size_t) { return true; }, &found, want);
    }
    const size_t r = live[k];
    const size_t i = k % kRefreshChunk;
    if (!plain[k]) {
      python.push_back(r);
      continue;
    }
    static const Described kSame = [] {
      Described same;
      same.plain = true;
      return same;
    }();
    const Described& d = quick[i] == kDescribe ? found[slot[i]] : kSame;
    const auto kind = quick[i] == kSameDigested ? Described::kHost
        : quick[i] == kSameNoDigest ? Described::kNone : d.digest_kind;
    const uint64_t now = quick[i] == kDescribe ? d.digest : quick[i] == kSameDigested ? quick_digest[i] : 0;
    const uint64_t layout_now = quick[i] == kDescribe ? d.layout : t.layout[r];
    uint8_t f = t.flags[r];
    const bool digests_known = (f & kDigest) && kind == Described::kHost;
    const bool differs = digests_known && t.digest[r] != now;
    const bool explained = f & kExplained;
    if (with_digest && report && differs && !explained) {
      PyObject* triple = Py_BuildValue("(nKK)", (Py_ssize_t)r, (unsigned long long)t.digest[r],
                                       (unsigned long long)now);
      if (triple == nullptr || PyList_Append(changed, triple) < 0) {
        Py_XDECREF(triple);
        Py_DECREF(moved);
        Py_DECREF(changed);
        return nullptr;
      }
      Py_DECREF(triple);
    }
    if (layout_now != t.layout[r] || !d.plain) {  // (never a row read the short way)
      PyObject* old = record_of_row(self, r);
      if (old == nullptr) {
        Py_DECREF(moved);
        Py_DECREF(changed);
        return nullptr;
      }
      PyObject* pair = Py_BuildValue("(nN)", (Py_ssize_t)r, old);
      if (pair == nullptr || PyList_Append(moved, pair) < 0) {
        Py_XDECREF(pair);
        Py_DECREF(moved);
        Py_DECREF(changed);
        return nullptr;
      }
      Py_DECREF(pair);
      const uint64_t kept = t.digest[r];
      const uint8_t kept_flags = t.flags[r];
      t.set_record(r, d);
      if (!with_digest) {  // digests and marks stay as they were
        t.digest[r] = kept;
        t.flags[r] = (uint8_t)((t.flags[r] & ~(kDigest | kExplained)) | (kept_flags & (kDigest | kExplained)));
      }
      t.index_row((int32_t)r);
      if (d.digest_kind == Described::kDevice || !d.plain) python.push_back(r);
      continue;
    }
    if (kind == Described::kDevice) python.push_back(r);
    if (with_digest) {
      t.digest[r] = now;
      f = (uint8_t)(f & ~(kDigest | kExplained));
      if (kind == Described::kHost) f |= kDigest;
      t.flags[r] = f;
    }
  }
  PyObject* python_list = rows_list(python);
  if (python_list == nullptr) {
    Py_DECREF(changed);
    Py_DECREF(moved);
    return nullptr;
  }
  return Py_BuildValue("(NNN)", changed, moved, python_list);
  KVGUARD_CATCH
}

// repoint(row, tensor): the row now stands for `tensor`'s TensorImpl (after swap_tensors
// exchanged the objects' insides), its record read again, digest and mark kept.
PyObject* table_repoint(TableObject* self, PyObject* args) {
  KVGUARD_TRY
  PyObject *row_obj = nullptr, *obj = nullptr;
  if (!PyArg_ParseTuple(args, "OO:repoint", &row_obj, &obj)) return nullptr;
  size_t r = 0;
  if (!read_row(self, row_obj, &r)) return nullptr;
  if (!THPVariable_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "Table.repoint: expected a tensor");
    return nullptr;
  }
  TableData& t = *self->data;
  if (t.flags[r] & kGone) Py_RETURN_NONE;
  const at::Tensor& tensor = THPVariable_Unpack(obj);
  t.row_of.erase(t.impl[r]._unsafe_get_target(), (int32_t)r);
  t.impl[r] = WeakImpl(tensor.getIntrusivePtr());
  const int32_t displaced = t.row_of.put(tensor.unsafeGetTensorImpl(), (int32_t)r);
  if (displaced >= 0 && displaced != (int32_t)r) t.forget_dead((size_t)displaced);
  std::vector<at::Tensor> one{tensor};
  std::vector<bool> plain{is_plain(self, obj)};
  std::vector<Described> found;
  describe_all(one, plain, &found, false);
  const uint64_t kept = t.digest[r];
  const uint8_t kept_flags = t.flags[r];
  t.set_record(r, found[0]);
  t.digest[r] = kept;
  t.flags[r] = (uint8_t)((t.flags[r] & ~(kDigest | kExplained)) | (kept_flags & (kDigest | kExplained)));
  t.index_row((int32_t)r);
  Py_RETURN_NONE;
  KVGUARD_CATCH
}

// let_go(row): drop the row's weak reference for a moment (torch.utils.swap_tensors refuses
// a TensorImpl with weak references); repoint() gives it back.
PyObject* table_let_go(TableObject* self, PyObject* arg) {
  size_t r = 0;
  if (!read_row(self, arg, &r)) return nullptr;
  TableData& t = *self->data;
  if (!(t.flags[r] & kGone)) {
    t.row_of.erase(t.impl[r]._unsafe_get_target(), (int32_t)r);
    t.impl[r] = WeakImpl(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>());
  }
  Py_RETURN_NONE;
}

bool read_device(PyObject* obj, c10::Device* out) {
  if (!THPDevice_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "Table: expected a torch.device");
    return false;
  }
  *out = ((THPDevice*)obj)->device;
  return true;
}

// meeting(start, stop, device) -> list[int]: live rows whose span shares a byte with
// [start, stop) on `device` (candidates: the caller decides exact overlap).
PyObject* table_meeting(TableObject* self, PyObject* args) {
  KVGUARD_TRY
  unsigned long long lo = 0, hi = 0;
  PyObject* dev_obj = nullptr;
  if (!PyArg_ParseTuple(args, "KKO:meeting", &lo, &hi, &dev_obj)) return nullptr;
  c10::Device dev(c10::kCPU);
  if (!read_device(dev_obj, &dev)) return nullptr;
  std::vector<int32_t> found;
  self->data->meeting((uintptr_t)lo, (uintptr_t)hi, dev, &found);
  std::vector<size_t> rows;
  rows.reserve(found.size());
  for (int32_t r : found) {
    if (!self->data->impl[(size_t)r].expired()) {
      rows.push_back((size_t)r);
    } else {
      self->data->met_dead = true;  // its memory may be another tensor's now: sweep and republish
    }
  }
  return rows_list(rows);
  KVGUARD_CATCH
}

// meets(start, stop, device) -> bool: whether any live row's span meets [start, stop).
PyObject* table_meets(TableObject* self, PyObject* args) {
  PyObject* list = table_meeting(self, args);
  if (list == nullptr) return nullptr;
  const bool any = PyList_GET_SIZE(list) > 0;
  Py_DECREF(list);
  return PyBool_FromLong(any);
}

// met_dead() -> bool: whether a lookup met a dead row since the last call (then sweep, and
// tell the hook: the hook still sends writes to that memory here).
PyObject* table_met_dead(TableObject* self, PyObject*) {
  const bool met = self->data->met_dead;
  self->data->met_dead = false;
  return PyBool_FromLong(met);
}

// sweep() -> list[int]: forget the rows whose tensor died (their TensorImpl objects are let
// go); returns them.
PyObject* table_sweep(TableObject* self, PyObject*) {
  TableData& t = *self->data;
  std::vector<size_t> swept;
  for (size_t r = 0; r < t.impl.size(); ++r) {
    if (!(t.flags[r] & kGone) && t.impl[r].expired()) {
      t.forget(r);
      swept.push_back(r);
    }
  }
  if (!swept.empty()) t.merge_recent();
  return rows_list(swept);
}

// compact() -> list[int]: the rows that are gone are dropped and the others renumbered, in
// order; returns the old number of each row kept (its new number is its position), so a
// table that protects tensor after tensor in a long guard stays as large as what is alive.
PyObject* table_compact(TableObject* self, PyObject*) {
  KVGUARD_TRY
  TableData& t = *self->data;
  std::vector<size_t> kept;
  for (size_t r = 0; r < t.impl.size(); ++r)
    if (!(t.flags[r] & kGone)) kept.push_back(r);
  for (size_t k = 0; k < kept.size(); ++k) {
    const size_t r = kept[k];
    if (r == k) continue;
    t.impl[k] = std::move(t.impl[r]);
    t.layout[k] = t.layout[r];
    t.digest[k] = t.digest[r];
    t.start[k] = t.start[r];
    t.stop[k] = t.stop[r];
    t.device[k] = t.device[r];
    t.flags[k] = t.flags[r];
  }
  const size_t n = kept.size();
  t.impl.erase(t.impl.begin() + (std::ptrdiff_t)n, t.impl.end());
  t.layout.resize(n);
  t.digest.resize(n);
  t.start.resize(n);
  t.stop.resize(n);
  t.device.resize(n, c10::Device(c10::kCPU));
  t.flags.resize(n);
  t.row_of.clear();
  t.row_of.reserve(n);
  t.sorted.clear();
  t.recent.clear();
  for (size_t r = 0; r < n; ++r) {
    t.row_of.put(t.impl[r]._unsafe_get_target(), (int32_t)r);
    t.index_row((int32_t)r, /*batch=*/true);
  }
  t.merge_recent();
  t.live = n;
  return rows_list(kept);
  KVGUARD_CATCH
}

// summary(first=0) -> (any inference tensor, every row has memory or Python keeps it) over
// live rows from `first`.
PyObject* table_summary(TableObject* self, PyObject* args) {
  Py_ssize_t first = 0;
  if (!PyArg_ParseTuple(args, "|n:summary", &first)) return nullptr;
  TableData& t = *self->data;
  bool inference = false, all_memory = true;
  for (size_t r = (size_t)std::max<Py_ssize_t>(first, 0); r < t.impl.size(); ++r) {
    const uint8_t f = t.flags[r];
    if (f & (kGone | kPython)) continue;
    inference = inference || (f & kInference);
    all_memory = all_memory && t.start[r] < t.stop[r];
  }
  return Py_BuildValue("(OO)", inference ? Py_True : Py_False, all_memory ? Py_True : Py_False);
}

// The live rows' spans and TensorImpl addresses from row `first` on (kvguard's write hook
// reads them straight from here: add_protected(table, ...)).
void table_publication(PyObject* obj, size_t first, std::vector<std::pair<uintptr_t, uintptr_t>>* spans,
                       std::vector<uintptr_t>* identities) {
  TableData& t = *((TableObject*)obj)->data;
  for (size_t r = first; r < t.impl.size(); ++r) {
    const uint8_t f = t.flags[r];
    if (f & (kGone | kPython)) continue;
    if (t.start[r] < t.stop[r]) spans->emplace_back(t.start[r], t.stop[r]);
    identities->push_back((uintptr_t)t.impl[r]._unsafe_get_target());
  }
}

// publication(first=0) -> (spans, identities): what table_publication gives, as Python lists
// (for a write-hook backend written in Python).
PyObject* table_publication_py(TableObject* self, PyObject* args) {
  Py_ssize_t first = 0;
  if (!PyArg_ParseTuple(args, "|n:publication", &first)) return nullptr;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  std::vector<uintptr_t> identities;
  table_publication((PyObject*)self, (size_t)std::max<Py_ssize_t>(first, 0), &spans, &identities);
  PyObject* s = PyList_New((Py_ssize_t)spans.size());
  PyObject* i = PyList_New((Py_ssize_t)identities.size());
  if (s == nullptr || i == nullptr) {
    Py_XDECREF(s);
    Py_XDECREF(i);
    return nullptr;
  }
  for (size_t k = 0; k < spans.size(); ++k) {
    PyObject* pair = Py_BuildValue("(KK)", (unsigned long long)spans[k].first, (unsigned long long)spans[k].second);
    if (pair == nullptr) {
      Py_DECREF(s);
      Py_DECREF(i);
      return nullptr;
    }
    PyList_SET_ITEM(s, (Py_ssize_t)k, pair);
  }
  for (size_t k = 0; k < identities.size(); ++k) {
    PyObject* v = PyLong_FromUnsignedLongLong((unsigned long long)identities[k]);
    if (v == nullptr) {
      Py_DECREF(s);
      Py_DECREF(i);
      return nullptr;
    }
    PyList_SET_ITEM(i, (Py_ssize_t)k, v);
  }
  return Py_BuildValue("(NN)", s, i);
}

// digests() -> list[int | None]: each row's host digest, in row order (None: the row keeps none).
PyObject* table_digests(TableObject* self, PyObject*) {
  const TableData& t = *self->data;
  PyObject* out = PyList_New((Py_ssize_t)t.impl.size());
  if (out == nullptr) return nullptr;
  for (size_t r = 0; r < t.impl.size(); ++r) {
    PyObject* v = (t.flags[r] & kDigest) && !(t.flags[r] & kGone)
        ? PyLong_FromUnsignedLongLong(t.digest[r]) : Py_NewRef(Py_None);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, (Py_ssize_t)r, v);
  }
  return out;
}

// set_digests(digests: list[int | None], explained: list[bool]) -> None: rows 0, 1, ... take
// these host digests (None: none) and explained marks, as a Python side kept them.
PyObject* table_set_digests(TableObject* self, PyObject* args) {
  PyObject *digests = nullptr, *explained = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!:set_digests", &PyList_Type, &digests, &PyList_Type, &explained)) return nullptr;
  TableData& t = *self->data;
  const Py_ssize_t n = PyList_GET_SIZE(digests);
  if (n != (Py_ssize_t)t.impl.size() || PyList_GET_SIZE(explained) != n) {
    PyErr_SetString(PyExc_ValueError, "Table.set_digests: one digest and one mark per row");
    return nullptr;
  }
  std::vector<uint64_t> values((size_t)n, 0);
  std::vector<uint8_t> known((size_t)n, 0), marked((size_t)n, 0);
  for (Py_ssize_t i = 0; i < n; ++i) {  // read first: a bad item leaves the table as it was
    PyObject* v = PyList_GET_ITEM(digests, i);
    if (v != Py_None) {
      const unsigned long long d = PyLong_AsUnsignedLongLong(v);
      if (d == (unsigned long long)-1 && PyErr_Occurred()) return nullptr;
      values[(size_t)i] = d;
      known[(size_t)i] = 1;
    }
    const int on = PyObject_IsTrue(PyList_GET_ITEM(explained, i));
    if (on < 0) return nullptr;
    marked[(size_t)i] = (uint8_t)on;
  }
  for (size_t r = 0; r < (size_t)n; ++r) {
    uint8_t f = (uint8_t)(t.flags[r] & ~(kDigest | kExplained));
    if (known[r]) f |= kDigest;
    if (marked[r]) f |= kExplained;
    t.flags[r] = f;
    t.digest[r] = values[r];
  }
  Py_RETURN_NONE;
}

PyObject* table_clear(TableObject* self, PyObject*) {
  self->data->clear();
  Py_RETURN_NONE;
}

// nbytes() -> int: the heap the table holds (capacity of its arrays and map), for benchmarks.
PyObject* table_nbytes(TableObject* self, PyObject*) {
  const TableData& t = *self->data;
  size_t n = t.impl.capacity() * sizeof(WeakImpl) + (t.layout.capacity() + t.digest.capacity()) * 8 +
      (t.start.capacity() + t.stop.capacity() + t.reach.capacity()) * sizeof(uintptr_t) +
      t.device.capacity() * sizeof(c10::Device) + t.flags.capacity() +
      (t.sorted.capacity() + t.recent.capacity()) * sizeof(IndexSpan) +
      t.row_of.nbytes();
  return PyLong_FromSize_t(n);
}

Py_ssize_t table_len(PyObject* self) { return (Py_ssize_t)((TableObject*)self)->data->impl.size(); }

PyObject* table_live(TableObject* self, PyObject*) { return PyLong_FromSize_t(self->data->live); }

PyMethodDef table_methods[] = {
    {"add", (PyCFunction)table_add, METH_O,
     "add(tensors: list) -> (first, again, python)\n\nA row per tensor not protected yet, described "
     "(and digested) in one pass: see kvguard/_native/csrc/table.h."},
    {"tensor", (PyCFunction)table_tensor, METH_O, "tensor(row) -> Tensor | None"},
    {"row_of", (PyCFunction)table_row_of, METH_O, "row_of(tensor) -> int (-1: none)"},
    {"record", (PyCFunction)table_record, METH_O,
     "record(row) -> records.Record (the type set_record_type was handed)"},
    {"flags", (PyCFunction)table_flags, METH_O, "flags(row) -> int"},
    {"set_flag", (PyCFunction)table_set_flag, METH_VARARGS, "set_flag(row, flag, on) -> None"},
    {"set_digest", (PyCFunction)table_set_digest, METH_VARARGS, "set_digest(row, digest | None) -> None"},
    {"refresh", (PyCFunction)table_refresh, METH_VARARGS,
     "refresh(rows=None, digest=True) -> (changed, moved, python)"},
    {"repoint", (PyCFunction)table_repoint, METH_VARARGS, "repoint(row, tensor) -> None"},
    {"let_go", (PyCFunction)table_let_go, METH_O, "let_go(row) -> None: until repoint(row, tensor)"},
    {"meeting", (PyCFunction)table_meeting, METH_VARARGS, "meeting(start, stop, device) -> list[int]"},
    {"meets", (PyCFunction)table_meets, METH_VARARGS, "meets(start, stop, device) -> bool"},
    {"sweep", (PyCFunction)table_sweep, METH_NOARGS, "sweep() -> list[int]: the rows let go"},
    {"met_dead", (PyCFunction)table_met_dead, METH_NOARGS, "met_dead() -> bool (and clears it)"},
    {"compact", (PyCFunction)table_compact, METH_NOARGS,
     "compact() -> list[int]: drop gone rows, renumber the rest; the old number of each, in order"},
    {"summary", (PyCFunction)table_summary, METH_VARARGS, "summary(first=0) -> (inference, all_memory)"},
    {"clear", (PyCFunction)table_clear, METH_NOARGS, "clear() -> None"},
    {"digests", (PyCFunction)table_digests, METH_NOARGS, "digests() -> list[int | None]: per row, in order"},
    {"set_digests", (PyCFunction)table_set_digests, METH_VARARGS,
     "set_digests(digests: list[int | None], explained: list[bool]) -> None: one per row, in order"},
    {"publication", (PyCFunction)table_publication_py, METH_VARARGS,
     "publication(first=0) -> (list[(start, stop)], list[impl address])"},
    {"nbytes", (PyCFunction)table_nbytes, METH_NOARGS, "nbytes() -> int"},
    {"live", (PyCFunction)table_live, METH_NOARGS, "live() -> int: rows whose tensor has not been swept"},
    {nullptr, nullptr, 0, nullptr}};

PySequenceMethods table_as_sequence = {table_len};

PyTypeObject* table_type() {
  static PyTypeObject type = [] {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "kvguard._native.write_hook.Table";
    t.tp_basicsize = sizeof(TableObject);
    t.tp_dealloc = (destructor)table_dealloc;
    t.tp_flags = Py_TPFLAGS_DEFAULT;
    t.tp_doc = "Table(plain_types: tuple[type, ...], digest: bool): a protected set's tensors, one row each "
               "(see kvguard/_native/csrc/table.h).";
    t.tp_methods = table_methods;
    t.tp_new = table_new;
    t.tp_as_sequence = &table_as_sequence;
    return t;
  }();
  return &type;
}

bool is_table(PyObject* obj) { return PyObject_TypeCheck(obj, table_type()); }

}  // namespace
