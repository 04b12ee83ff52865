// kvguard._native.write_hook: a process-wide hook on every writing op, at C++ speed.
//
// One boxed kernel is stacked on the ADInplaceOrView dispatch key of every operator overload
// whose schema writes an argument (`Tensor(a!)`, `Tensor(a!)?`, `Tensor(a!)[]`), in every
// namespace registered when install() runs, plus the writes schemas do not declare that
// kvguard._torch.ops lists (batch norm's running statistics when training, c10d's in-place
// collectives). ADInplaceOrView is in the default TLS include
// set and is where torch bumps version counters, so every in-place and `out=` call passes it;
// ops that write nothing never reach this code. For the ops training code writes most (see
// FastKernel) the kernel is also registered unboxed, typed by ATen's signature of the op, so
// that a write that needs no judging costs no boxing. The kernel judges only the outermost writing
// op of a thread (a thread-local depth counter), checks the written tensors' storage byte
// ranges against the protected intervals, and calls a Python callback only on a possible hit.
// It then runs the kernel that was there before (stored at install time) or, where there was
// none, redispatches past ADInplaceOrView: autograd and version counters see no difference.
//
// Python API (all called with the GIL; the setters publish atomically to writing threads):
//   install(undeclared=None, c10d_names=None) -> int, uninstall(), installed() -> bool,
//   hook_new() -> int, watch_inference(bool) -> bool,
//   hooked_ops() -> list[str] ("ns::name.overload", "default" for the unnamed overload)
//   set_enabled(bool), enabled() -> bool, set_send_all(bool), writes() -> int
//   set_intervals(list[tuple[int, int]]), set_identities(list[int])
//   add_protected(list[tuple[int, int]], list[int], replace=False): more of both (in any
//     order, with any overlap), or instead of them; add_protected(table, first_row, replace)
//     reads both from a Table's live rows from first_row on
//   Table(plain_types, digest): a protected set's tensors as rows (table.h)
//   admit(table | None, intervals=(), identities=()) -> bool: an optimizer step's parameters
//     (a Table) leave what is published while it runs (less what other guards protect), so its own writes never enter Python (see py_admit)
//   set_watch(callable | None, snapshots=None): called with no arguments before each judged
//     write; with `snapshots`, a list of (containers, held) tuple pairs, only when one of
//     them changed (kvguard._native.speedups's identity check, run here without Python code)
//   describe(tensors, plain_types, digest) -> list: what a protected entry records of each
//     tensor, in one pass (see py_describe)
//   set_callback(callable | None): callback(op_name, written_tensors) on a possible hit,
//     op_name like "aten::mul_.Tensor"; it returns None, or `after`, called as `after()`
//     once the write is done or `after(True)` if the op raised. An exception from watch,
//     callback or after comes out of the op as itself; from watch or callback, before the
//     write.
//
// Before each judged write the watch's containers are compared with their snapshots under the
// GIL, unless every one of them was empty at its snapshot and still is (read without it).
//
// Caveats (see also the notes in kvguard/_native/build.py):
//  - Ops registered after install() are hooked by hook_new() (kvguard calls it at a guard's
//    entry; a dispatcher listener counts registrations, so it is free while there are none).
//  - install() and uninstall() must be called from one thread while no other thread runs
//    torch ops: dispatcher registration is not thread-safe against concurrent dispatch.
//    Toggle with set_enabled() instead (an atomic flag read once per writing op).
//  - The kernel each op had on the key is captured at install(). If another hook on this
//    key was installed before this one and is removed while this one stays, the ops it
//    covered raise a RuntimeError saying so (torch invalidates the captured kernel):
//    remove hooks in the reverse order of installing them (kvguard's engines keep one).
//  - Inference tensors written inside torch.inference_mode() never reach ADInplaceOrView:
//    a second kernel per op on a spare key (kInferenceKey) judges them, on the threads that
//    include that key while they guard an inference tensor (watch_inference).
//  - The binary uses torch's unstable C++ API: it must be built for this torch version,
//    this CPython version and this platform (kvguard/_native/build.py keys its cache on all three).
//
// Build: see kvguard/_native/build.py (one translation unit: this file and the headers beside
// it, describe.h and python_api.h; the compiler called directly).

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>
// the ops given unboxed kernels (FastKernel): their typed signatures
#include <ATen/ops/add_ops.h>
#include <ATen/ops/sub_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/addcmul_ops.h>
#include <ATen/ops/addcdiv_ops.h>
#include <ATen/ops/lerp_ops.h>
#include <ATen/ops/copy_ops.h>
#include <ATen/ops/zero_ops.h>
#include <ATen/ops/fill_ops.h>
#include <ATen/ops/masked_fill_ops.h>
#include <ATen/ops/clamp_ops.h>
#include <ATen/ops/clamp_min_ops.h>
#include <ATen/ops/sqrt_ops.h>
#include <ATen/ops/exp_ops.h>
#include <ATen/ops/relu_ops.h>
#include <ATen/ops/bernoulli_ops.h>
#include <ATen/ops/uniform_ops.h>
#include <ATen/ops/normal_ops.h>
#include <ATen/ops/index_put_ops.h>
#include <ATen/ops/_foreach_add_ops.h>
#include <ATen/ops/_foreach_sub_ops.h>
#include <ATen/ops/_foreach_mul_ops.h>
#include <ATen/ops/_foreach_div_ops.h>
#include <ATen/ops/_foreach_lerp_ops.h>
#include <ATen/ops/_foreach_addcmul_ops.h>
#include <ATen/ops/_foreach_addcdiv_ops.h>
#include <ATen/ops/_foreach_sqrt_ops.h>
#include <ATen/ops/_foreach_neg_ops.h>
#include <ATen/ops/_foreach_maximum_ops.h>
#include <ATen/ops/_foreach_zero_ops.h>
#include <ATen/ops/_foreach_copy_ops.h>
#include <ATen/ops/_fused_adamw_ops.h>
#include <ATen/ops/_fused_adam_ops.h>
#include <ATen/ops/_fused_sgd_ops.h>

#include <structmember.h>

#include <algorithm>
#include <iterator>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "describe.h"    // py_describe: what the protected set records of a batch of tensors
#include "python_api.h"  // borrowed_api, KVGUARD_TRY / KVGUARD_CATCH
#include "table.h"       // Table: a protected set's tensors as rows in C++

namespace {

using Interval = std::pair<uintptr_t, uintptr_t>;
using Intervals = std::vector<Interval>;

// Protected memory in one sorted form.
struct Sorted {
  Intervals intervals;               // sorted, disjoint, non-empty [start, stop) byte ranges
  std::vector<uintptr_t> identities; // sorted TensorImpl addresses (Python's `tensor._cdata`)
  size_t size() const { return intervals.size() + identities.size(); }
};

// What is protected, replaced whole (never changed in place) so that a writing op on any
// thread reads one consistent snapshot while Python publishes the next. The bulk is shared
// from one publication to the next; what was added since it was last merged sits in a
// small second part, so that a placement publishes in proportion to what it added, not to
// everything protected (merged into the bulk once it reaches a sixteenth of it).
struct Protected {
  std::shared_ptr<const Sorted> bulk;
  Sorted recent;
};

// `into` = `a` and `b` merged (each sorted; intervals coalesced, identities deduplicated).
void merge_sorted(const Sorted& a, const Sorted& b, Sorted* into) {
  Intervals all;
  all.reserve(a.intervals.size() + b.intervals.size());
  std::merge(a.intervals.begin(), a.intervals.end(), b.intervals.begin(), b.intervals.end(),
             std::back_inserter(all));
  into->intervals.clear();
  into->intervals.reserve(all.size());
  for (const Interval& iv : all) {  // coalesce overlapping and touching ranges
    if (!into->intervals.empty() && iv.first <= into->intervals.back().second) {
      into->intervals.back().second = std::max(into->intervals.back().second, iv.second);
    } else {
      into->intervals.push_back(iv);
    }
  }
  into->identities.clear();
  into->identities.reserve(a.identities.size() + b.identities.size());
  std::merge(a.identities.begin(), a.identities.end(), b.identities.begin(), b.identities.end(),
             std::back_inserter(into->identities));
  into->identities.erase(std::unique(into->identities.begin(), into->identities.end()), into->identities.end());
}

// Everything `p` protects, in one sorted form.
Sorted flatten(const Protected* p) {
  Sorted out;
  if (p == nullptr) return out;
  static const Sorted kEmpty;
  merge_sorted(p->bulk ? *p->bulk : kEmpty, p->recent, &out);
  return out;
}

// ---- process-global state ------------------------------------------------------------
// Flags are read without the GIL on every writing op; the Python callables are read and
// written only with the GIL held (the has_* flags let the fast path skip taking it).
std::atomic<bool> g_enabled{false};
std::atomic<bool> g_send_all{false};
std::atomic<bool> g_has_callback{false};
std::atomic<bool> g_has_watch{false};
std::atomic<uint64_t> g_writes{0};
std::shared_ptr<const Protected> g_protected;  // std::atomic_load / store_protected() only
// What a writing op reads, without the lock std::atomic_load(shared_ptr) takes: the published
// object's address, and how many threads are reading one (ReadProtected). A replaced object
// is kept (g_retired) until a publication finds no reader: a reader counted before the new
// address was stored may still hold the old one; one counted after reads the new one.
std::atomic<const Protected*> g_protected_raw{nullptr};
std::atomic<int64_t> g_protected_readers{0};
auto* g_retired = new std::vector<std::shared_ptr<const Protected>>();  // with the GIL only

// Counts a writing op's thread as a reader of what is published for the length of a check
// (any thread, no GIL): nothing retired is freed until a publication finds none.
struct Reading {
  Reading() { g_protected_readers.fetch_add(1, std::memory_order_seq_cst); }
  ~Reading() { g_protected_readers.fetch_sub(1, std::memory_order_release); }
  Reading(const Reading&) = delete;
  Reading& operator=(const Reading&) = delete;
};

// The published protected memory, held for one writing op's check.
struct ReadProtected {
  Reading reading;
  const Protected* p = g_protected_raw.load(std::memory_order_seq_cst);
};

// The watch's containers when each of them was empty at its snapshot (autograd's and the data
// guard's queues, a guarded dict that starts empty): then a writing op learns that nothing was
// placed from their sizes alone, without taking the GIL (torch's bindings release it around an
// op) and with no Python code. The snapshots' tuple is held (a reference) for as long as this
// is, and released with the GIL when a publication retires it.
struct Quiet {
  PyObject* snapshots;                   // owned; released in ~Quiet, with the GIL
  std::vector<std::pair<PyObject*, bool>> containers;  // (container, is a list) borrowed from it
  ~Quiet() { Py_XDECREF(snapshots); }
};
std::atomic<const Quiet*> g_quiet_raw{nullptr};
std::shared_ptr<const Quiet> g_quiet;  // with the GIL only
auto* g_quiet_retired = new std::vector<std::shared_ptr<const Quiet>>();  // with the GIL only

// Whether every watched container is still empty, read without the GIL; false: ask with it.
// A size is one aligned word: a store to it on another thread is seen whole or not yet (as a
// placement there may land just after the check with the GIL too); this thread's own
// placements are always seen.
bool watch_quiet() {
  Reading reading;
  const Quiet* quiet = g_quiet_raw.load(std::memory_order_seq_cst);
  if (quiet == nullptr) return false;
  for (const auto& [container, is_list] : quiet->containers) {
    const Py_ssize_t n = is_list
        ? __atomic_load_n(&reinterpret_cast<PyVarObject*>(container)->ob_size, __ATOMIC_RELAXED)
        : __atomic_load_n(&reinterpret_cast<PyDictObject*>(container)->ma_used, __ATOMIC_RELAXED);
    if (n != 0) return false;
  }
  return true;
}

// Makes `snapshots` (a tuple of (containers, held) pairs, or nullptr) the quiet form, where it
// has one. With the GIL.
void publish_quiet(PyObject* snapshots) {
  std::shared_ptr<const Quiet> next;
  if (snapshots != nullptr) {
    auto quiet = std::make_shared<Quiet>();
    bool empty = true;
    for (Py_ssize_t i = 0; empty && i < PyTuple_GET_SIZE(snapshots); ++i) {
      PyObject* pair = PyTuple_GET_ITEM(snapshots, i);
      PyObject* containers = PyTuple_GET_ITEM(pair, 0);
      empty = PyTuple_GET_SIZE(PyTuple_GET_ITEM(pair, 1)) == 0;
      for (Py_ssize_t k = 0; empty && k < PyTuple_GET_SIZE(containers); ++k) {
        PyObject* c = PyTuple_GET_ITEM(containers, k);
        const bool list = PyList_CheckExact(c);
        empty = list || PyDict_CheckExact(c);
        if (empty) quiet->containers.emplace_back(c, list);
      }
    }
    if (empty) {
      Py_INCREF(snapshots);
      quiet->snapshots = snapshots;
      next = std::move(quiet);
    } else {
      quiet->containers.clear();
      quiet->snapshots = nullptr;
    }
  }
  g_quiet_raw.store(next.get(), std::memory_order_seq_cst);
  std::shared_ptr<const Quiet> old = std::move(g_quiet);
  g_quiet = std::move(next);
  if (old != nullptr) g_quiet_retired->push_back(std::move(old));
  if (g_protected_readers.load(std::memory_order_seq_cst) == 0) g_quiet_retired->clear();
}
PyObject* g_callback = nullptr;                 // GIL-protected, owned reference
PyObject* g_watch = nullptr;                    // GIL-protected, owned reference
PyObject* g_watch_snapshots = nullptr;          // GIL-protected, owned; nullptr: always call g_watch

// Registration state, touched only by install()/uninstall() (with the GIL). Heap-allocated
// and never destroyed at exit: deregistering kernels during static destruction could run
// after the dispatcher itself is gone.
std::vector<std::unique_ptr<torch::Library>>* g_libraries = nullptr;
std::vector<c10::RegistrationHandleRAII>* g_fast_handles = nullptr;  // the unboxed kernels' registrations
std::vector<std::string>* g_hooked = nullptr;
std::set<std::string>* g_seen = nullptr;  // every op name looked at by install() or hook_new()

// Inference tensors written inside torch.inference_mode() never reach ADInplaceOrView
// (inference mode drops it from the TLS include set, and inference tensors do not carry
// it). A second kernel per writing op sits on a key nothing else in torch uses, which a
// thread includes in its TLS only while it guards an inference tensor (watch_inference):
// every other thread, and that one otherwise, never reaches it. The key has a
// fallthrough fallback, so ops without our kernel skip it. If something else already
// uses the key (a backend fallback exists), the kernels are not registered.
constexpr c10::DispatchKey kInferenceKey = c10::DispatchKey::DeferredInit;
bool g_inference_hooked = false;
thread_local int t_inference_watchers = 0;
thread_local bool t_inference_included = false;  // by watch_inference, not by someone else

// Registrations since install(), counted by a dispatcher listener, so that hook_new() is
// free while no op was defined (a torch.library.custom_op defined after the first guard).
std::atomic<uint64_t> g_registrations{0};
uint64_t g_registrations_seen = 0;  // with the GIL
std::unique_ptr<c10::RegistrationHandleRAII>* g_listener = nullptr;

class CountRegistrations final : public c10::OpRegistrationListener {
 public:
  void onOperatorRegistered(const c10::OperatorHandle& /*op*/) override {
    g_registrations.fetch_add(1, std::memory_order_relaxed);
  }
  void onOperatorDeregistered(const c10::OperatorHandle& /*op*/) override {}
};

thread_local int t_depth = 0;

struct DepthGuard {
  DepthGuard() { ++t_depth; }
  ~DepthGuard() { --t_depth; }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;
};

struct Gil {
  PyGILState_STATE state;
  Gil() : state(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;
};

bool python_alive() {
  if (!Py_IsInitialized()) return false;
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsFinalizing();
#else
  return !_Py_IsFinalizing();
#endif
}

// Turns the pending Python exception into a C++ exception that torch's Python bindings
// (HANDLE_TH_ERRORS) and its autograd engine hand back to Python unchanged. Needs the GIL.
// Not python_error::persist(): it builds what() from str(exception), and kvguard's guard
// counts reads of a MutationError's message (an error nobody read is raised again at exit).
[[noreturn]] void throw_python_error() {
  python_error err;
  PyErr_Fetch(&err.type, &err.value, &err.traceback);
  const char* type_name =
      err.type != nullptr && PyType_Check(err.type) ? ((PyTypeObject*)err.type)->tp_name : "?";
  err.message = std::string(type_name) + " raised in a kvguard write-hook callback";
  throw std::move(err);
}

// With a Python exception pending: make the C++ exception `context` its __context__, as
// Python does for an exception raised while another is handled. Needs the GIL.
void chain_context(const std::exception_ptr& context) {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  torch::translate_exception_to_python(context);  // sets the Python form of `context`
  PyObject *ctype = nullptr, *cvalue = nullptr, *ctb = nullptr;
  PyErr_Fetch(&ctype, &cvalue, &ctb);
  PyErr_NormalizeException(&ctype, &cvalue, &ctb);
  if (value != nullptr && cvalue != nullptr && value != cvalue) {
    if (ctb != nullptr) PyException_SetTraceback(cvalue, ctb);
    PyException_SetContext(value, cvalue);  // steals the reference
    cvalue = nullptr;
  }
  Py_XDECREF(ctype);
  Py_XDECREF(cvalue);
  Py_XDECREF(ctb);
  PyErr_Restore(type, value, tb);
}

class SilentWarnings final : public c10::WarningHandler {
 public:
  void process(const c10::Warning& /*warning*/) override {}
};

// ---- the placement check ----------------------------------------------------------------

struct SpeedupsApi {
  int version;
  int (*same_values)(PyObject* containers, PyObject* held);
};

const SpeedupsApi* speedups_api() { return borrowed_api<SpeedupsApi>("kvguard._native.speedups._api"); }

// Whether the watch must run: some watched container changed since its snapshot (or there
// is no snapshot to compare, or no C check to compare it with). Needs the GIL.
bool watched_changed() {
  PyObject* snapshots = g_watch_snapshots;
  const SpeedupsApi* api = snapshots == nullptr ? nullptr : speedups_api();
  if (api == nullptr) return true;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(snapshots); ++i) {
    PyObject* pair = PyTuple_GET_ITEM(snapshots, i);
    const int same = api->same_values(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
    if (same != 1) {
      if (same < 0) PyErr_Clear();  // the watch itself decides
      return true;
    }
  }
  return false;
}

// ---- saved rows: what autograd saved, known to the check in C++ --------------------------
// The tensors kvguard's C pack hook (SavedHooks, below) protects, one row each: the bytes its
// elements span and the Saved object that holds it. A row goes the moment its Saved dies
// (autograd released it: its backward ran, or its graph was freed), so a write to memory
// that a freed saved tensor left (backward's gradients reuse it at once) is never a
// candidate, and never enters Python. Rows are keyed by their start; live rows of distinct
// storages never overlap, views of one storage may: a lookup walks back at most as far as
// the longest row reaches.
struct SavedRow {
  uintptr_t stop;
  PyObject* saved;  // borrowed: the row goes before its Saved does
};
std::mutex g_saved_mu;  // the rows, their count's changes and the longest span
std::multimap<uintptr_t, SavedRow>* g_saved_rows = new std::multimap<uintptr_t, SavedRow>();
std::atomic<size_t> g_saved_count{0};
uintptr_t g_saved_longest = 0;

// Whether [lo, hi) meets the elements of a live saved tensor. Any thread.
bool saved_rows_meet(uintptr_t lo, uintptr_t hi) {
  if (hi == 0 || g_saved_count.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(g_saved_mu);
  auto it = g_saved_rows->lower_bound(hi);  // the first row starting at or after hi
  while (it != g_saved_rows->begin()) {
    --it;
    if (it->second.stop > lo) return true;
    if (it->first + g_saved_longest <= lo) break;  // no row starting here or before reaches lo
  }
  return false;
}

void saved_row_add(uintptr_t start, uintptr_t stop, PyObject* saved) {
  std::lock_guard<std::mutex> lock(g_saved_mu);
  g_saved_rows->emplace(start, SavedRow{stop, saved});
  g_saved_longest = std::max(g_saved_longest, stop - start);
  g_saved_count.fetch_add(1, std::memory_order_release);
}

void saved_row_remove(uintptr_t start, PyObject* saved) {
  std::lock_guard<std::mutex> lock(g_saved_mu);
  auto range = g_saved_rows->equal_range(start);
  for (auto it = range.first; it != range.second; ++it) {
    if (it->second.saved == saved) {
      g_saved_rows->erase(it);
      if (g_saved_count.fetch_sub(1, std::memory_order_release) == 1) g_saved_longest = 0;
      return;
    }
  }
}

// ---- the check ---------------------------------------------------------------------------

// Whether `t` could be (part of) a protected tensor: one of the protected identities, or
// storage that overlaps a protected interval. Tensors whose memory cannot be read from
// metadata (no storage, not strided, a data pointer that throws or is null: sparse, meta,
// fake, wrapper subclasses, empty tensors) always are: Python decides by identity.
// Whether `t`'s TensorImpl is one of `sorted`'s identities, or its storage [lo, hi) meets one
// of its intervals.
bool meets(const Sorted& sorted, uintptr_t impl, uintptr_t lo, uintptr_t hi) {
  if (!sorted.identities.empty() &&
      std::binary_search(sorted.identities.begin(), sorted.identities.end(), impl)) {
    return true;
  }
  if (hi == 0 || sorted.intervals.empty()) return false;
  // Intervals are sorted, disjoint and non-empty, so their stops are increasing: the
  // first interval that ends after `lo` is the only one that can start before `hi`.
  auto it = std::upper_bound(sorted.intervals.begin(), sorted.intervals.end(), lo,
                             [](uintptr_t value, const Interval& iv) { return value < iv.second; });
  return it != sorted.intervals.end() && it->first < hi;
}

// Whether `t` could be (part of) a protected tensor: one of the protected identities, or
// storage that overlaps a protected interval. Tensors whose memory cannot be read from
// metadata (no storage, not strided, a data pointer that throws or is null: sparse, meta,
// fake, wrapper subclasses, empty tensors) always are: Python decides by identity.
bool is_candidate(const at::Tensor& t, const Protected* protected_) {
  const uintptr_t impl = reinterpret_cast<uintptr_t>(t.unsafeGetTensorImpl());
  uintptr_t lo = 0, hi = 0;  // hi 0: identities only
  try {
    if (!t.has_storage() || t.layout() != c10::kStrided) return true;
    const c10::Storage& storage = t.storage();
    const void* data = storage.data();  // const access: never materializes a COW storage
    if (data == nullptr) return true;
    const size_t nbytes = storage.nbytes();
    if (nbytes != 0) {
      lo = reinterpret_cast<uintptr_t>(data);
      hi = lo + nbytes;
    }
  } catch (...) {
    return true;
  }
  if (saved_rows_meet(lo, hi)) return true;
  if (protected_ == nullptr) return false;
  return (protected_->bulk && meets(*protected_->bulk, impl, lo, hi)) || meets(protected_->recent, impl, lo, hi);
}

// A new tuple of Python tensors for `tensors` (nullptr with a Python error set). With the GIL.
PyObject* tensor_tuple(const std::vector<at::Tensor>& tensors) {
  PyObject* tuple = PyTuple_New((Py_ssize_t)tensors.size());
  for (size_t i = 0; tuple != nullptr && i < tensors.size(); ++i) {
    PyObject* w = THPVariable_Wrap(tensors[i]);
    if (w == nullptr) {
      Py_CLEAR(tuple);
    } else {
      PyTuple_SET_ITEM(tuple, (Py_ssize_t)i, w);
    }
  }
  return tuple;
}

template <class F>
void for_each_tensor(const c10::IValue& v, F& f) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined()) f(t);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      if (t.defined()) f(t);
    }
  } else if (v.isList()) {  // Tensor?[], Tensor[][]
    for (const c10::IValue& e : v.toListRef()) for_each_tensor(e, f);
  }
}

// `dst.copy_(src)` where both are the same view of the same memory changes nothing: it is
// what Python's `k[-1] += r` does after the in-place add on the view (setitem copies the
// view onto itself).
bool is_self_copy(const at::Tensor& dst, const at::Tensor& src) {
  if (!dst.defined() || !src.defined()) return false;
  if (dst.unsafeGetTensorImpl() == src.unsafeGetTensorImpl()) return true;
  try {
    return dst.dtype() == src.dtype() && dst.device() == src.device() &&
        dst.is_conj() == src.is_conj() && dst.is_neg() == src.is_neg() &&
        dst.sizes() == src.sizes() && dst.strides() == src.strides() &&
        dst.storage_offset() == src.storage_offset() &&
        dst.const_data_ptr() == src.const_data_ptr();
  } catch (...) {
    return false;
  }
}

// Whether `a` and `b` are views of one storage (an argument an op reads that may overlap
// what it writes).
bool shares_storage(const at::Tensor& a, const at::Tensor& b) {
  try {
    return a.defined() && b.defined() && a.has_storage() && b.has_storage() &&
        a.storage().is_alias_of(b.storage());
  } catch (...) {
    return false;
  }
}

// ---- the kernel --------------------------------------------------------------------------

// An argument the op writes; `when` >= 0: only on calls where that bool argument is true.
struct WrittenArg {
  size_t index;
  int when = -1;
};

struct HookKernel final : public c10::OperatorKernel {
  std::string name;               // "ns::name.overload"
  std::vector<WrittenArg> written;
  size_t num_args = 0;
  bool is_copy = false;           // aten::copy_
  std::optional<c10::SafeKernelFunction> original;  // none: redispatch past the key
  c10::DispatchKey key = c10::DispatchKey::ADInplaceOrView;
  bool inference_only = false;    // on kInferenceKey: judges only inference-mode writes to inference tensors
  // Hooked by hook_new() after install(): the op may be deregistered and defined again
  // (a scoped torch.library), leaving this kernel under a new schema.
  bool late = false;

  void redispatch_past(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                       torch::jit::Stack* stack) const {
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, key), stack);
  }

  void call_original(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                     torch::jit::Stack* stack) const {
    if (original.has_value()) {
      try {
        original->callBoxed(op, ks, stack);
      } catch (const c10::Error& e) {
        // Thrown before the kernel runs when the kernel that was under ours at install()
        // has since been deregistered (another hook on this key, removed first).
        if (e.msg().rfind("SafeKernelFunction has been invalidated", 0) != 0) throw;
        if (late) {  // the op it belonged to was deregistered: this is a new op of that name
          redispatch_past(op, ks, stack);
          return;
        }
        TORCH_CHECK(false, "kvguard write hook: the ADInplaceOrView kernel that was under "
                    "kvguard's for ", name, " was removed after kvguard._native.write_hook.install(); "
                    "remove hooks on this key in the reverse order of installing them, or call "
                    "uninstall() and install() again");
      }
    } else {
      redispatch_past(op, ks, stack);
    }
  }

  // Whether this call is one the kernel on kInferenceKey judges: inside inference mode,
  // writing an inference tensor (every other write reaches ADInplaceOrView).
  bool inference_write(const torch::jit::Stack& stack, size_t base) const {
    if (!c10::InferenceMode::is_enabled()) return false;
    bool found = false;
    for_each_written(stack, base, [&](const at::Tensor& t) { found = found || t.is_inference(); });
    return found;
  }

  // Calls f(tensor) for every tensor this call writes.
  template <class F>
  void for_each_written(const torch::jit::Stack& stack, size_t base, F&& f) const {
    for (const WrittenArg& arg : written) {
      if (arg.when >= 0) {
        const c10::IValue& condition = stack[base + (size_t)arg.when];
        if (condition.isBool() && !condition.toBool()) continue;
      }
      for_each_tensor(stack[base + arg.index], f);
    }
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                  torch::jit::Stack* stack) {
    if (!g_enabled.load(std::memory_order_relaxed) || t_depth > 0) {
      call_original(op, ks, stack);
      return;
    }
    if (late && op.schema().arguments().size() != num_args) {  // another op of the same name
      redispatch_past(op, ks, stack);
      return;
    }
    if (inference_only && !inference_write(*stack, stack->size() - num_args)) {
      call_original(op, ks, stack);
      return;
    }
    DepthGuard depth;
    if (!before_write()) {
      call_original(op, ks, stack);
      return;
    }
    const size_t base = stack->size() - num_args;
    if (is_copy && is_self_copy((*stack)[base].toTensor(), (*stack)[base + 1].toTensor())) {
      call_original(op, ks, stack);
      return;
    }
    if (!may_hit([&](auto& f) { for_each_written(*stack, base, f); })) {
      call_original(op, ks, stack);
      return;
    }
    judge_and_run(op, ks, stack);
  }

  // What every judged write does first, on either calling convention (with a DepthGuard held):
  // counted, then the watch (placements protected before the write); false where the write is
  // not judged (a thread that never ran Python).
  static bool before_write() {
    g_writes.fetch_add(1, std::memory_order_relaxed);
    // A thread that never ran Python (gloo's workers completing a collective, autograd's
    // device threads) has no Python caller to name: the op that queued the work was
    // judged where it was called, and a boundary check sees the rest. Not entering
    // Python there also keeps interpreter shutdown out of torch's own threads.
    if (PyGILState_GetThisThreadState() == nullptr) return false;
    if (g_has_watch.load(std::memory_order_relaxed) && !watch_quiet() && python_alive()) {
      Gil gil;
      if (g_watch != nullptr && watched_changed()) {
        PyObject* watch = g_watch;
        Py_INCREF(watch);
        PyObject* r = PyObject_CallNoArgs(watch);
        Py_DECREF(watch);
        if (r == nullptr) throw_python_error();
        Py_DECREF(r);
      }
    }
    return true;
  }

  // Whether some tensor the write reaches may be protected: Python must look. `each(f)` calls
  // f(tensor) for every tensor the call writes.
  template <class Each>
  static bool may_hit(Each&& each) {
    if (!g_has_callback.load(std::memory_order_relaxed)) return false;
    bool hit = false;
    if (g_send_all.load(std::memory_order_relaxed)) {
      auto any = [&](const at::Tensor&) { hit = true; };
      each(any);
    } else {
      ReadProtected protected_;
      auto check = [&](const at::Tensor& t) {
        if (!hit && is_candidate(t, protected_.p)) hit = true;
      };
      each(check);
    }
    return hit && python_alive();
  }

  // A possible hit: Python's callback judges the write (and may stop it), the op runs, then
  // what the callback asked to run after it. The boxed arguments are on `stack`.
  void judge_and_run(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) const {
    const size_t base = stack->size() - num_args;
    PyObject* after = nullptr;
    {
      Gil gil;
      if (g_callback != nullptr) {
        std::vector<at::Tensor> tensors;
        for_each_written(*stack, base, [&](const at::Tensor& t) { tensors.push_back(t); });
        // The arguments it only reads that share a storage with what it writes (a shifted
        // `copy_` from its own view): the judge decides whether their elements overlap.
        // Passed as a third argument only when there are any.
        std::vector<at::Tensor> read;
        for (size_t i = 0; i < num_args; ++i) {
          bool writes_it = false;
          for (const WrittenArg& arg : written) writes_it = writes_it || arg.index == i;
          if (writes_it) continue;
          auto collect = [&](const at::Tensor& r) {  // `torch.add(x, 1, out=x)` reads x where it writes it: none
            bool shares = false;
            for (const at::Tensor& w : tensors) {
              if (is_self_copy(w, r)) return;
              shares = shares || shares_storage(r, w);
            }
            if (shares) read.push_back(r);
          };
          for_each_tensor((*stack)[base + i], collect);
        }
        Py_INCREF(g_callback);
        PyRef callback{g_callback};  // owned refs, released before the GIL (declared after it)
        PyRef py_name{PyUnicode_FromStringAndSize(name.data(), (Py_ssize_t)name.size())};
        PyRef py_tensors{tensor_tuple(tensors)};
        PyRef py_read{read.empty() || py_tensors.p == nullptr ? nullptr : tensor_tuple(read)};
        const bool ok = py_name.p != nullptr && py_tensors.p != nullptr && (read.empty() || py_read.p != nullptr);
        PyObject* result = !ok ? nullptr
            : read.empty() ? PyObject_CallFunctionObjArgs(callback.p, py_name.p, py_tensors.p, nullptr)
                           : PyObject_CallFunctionObjArgs(callback.p, py_name.p, py_tensors.p, py_read.p, nullptr);
        if (result == nullptr) throw_python_error();
        if (result == Py_None) {
          Py_DECREF(result);
        } else if (!PyCallable_Check(result)) {
          PyErr_Format(PyExc_TypeError,
                       "kvguard write hook: the callback for %s returned %R; expected None "
                       "or a callable to run after the write",
                       name.c_str(), result);
          Py_DECREF(result);
          throw_python_error();
        } else {
          after = result;
        }
      }
    }  // the GIL is released while the original kernel runs

    try {
      call_original(op, ks, stack);
    } catch (...) {
      // torch refused the write, maybe after part of it landed: `after(True)` reports what
      // changed, then the op's own exception goes on (the context of one `after` raises).
      std::exception_ptr failure = std::current_exception();
      if (after != nullptr && python_alive()) {
        Gil gil;
        PyObject* r = PyObject_CallOneArg(after, Py_True);
        Py_DECREF(after);
        if (r == nullptr) {
          chain_context(failure);
          throw_python_error();
        }
        Py_DECREF(r);
      }
      std::rethrow_exception(failure);
    }
    if (after != nullptr && python_alive()) {
      Gil gil;
      PyObject* r = PyObject_CallNoArgs(after);
      Py_DECREF(after);
      if (r == nullptr) throw_python_error();
      Py_DECREF(r);
    }
  }
};

// ---- unboxed kernels for the common writing ops ---------------------------------------------
// The kernel above is boxed: the dispatcher packs an op's arguments into a stack of IValues
// to call it, and the original kernel unpacks them again, about 0.2 µs a writing op here
// whether a guard is active or not (the sampled tier's unchecked steps, an optimizer's
// for-loop step: six writes a parameter). For the ops training code writes with most (an
// optimizer's, dropout's, a module's in-place activations, the foreach and fused optimizer
// kernels) the kernel is registered unboxed too, typed by ATen's own signature of the op
// (`at::_ops::<op>::schema`): it makes the same checks on the typed arguments and calls the
// original kernel unboxed, boxing only for a possible hit (Python's judge works on the boxed
// call, as before). The original is the kernel torch had on the key (its unboxed function,
// read out of the SafeKernelFunction that getComputedKernelForDispatchKey returns, whose
// token is still checked before each call), or a redispatch past the key where it had none.

// SafeKernelFunction keeps the kernel (and its validity token) private; explicit template
// instantiation may name private members (the standard's access rule does not apply there).
template <class Tag, typename Tag::type Member>
struct Expose {
  friend typename Tag::type exposed(Tag) { return Member; }
};
struct SafeKernelOf {
  using type = c10::KernelFunction c10::SafeKernelFunction::*;
  friend type exposed(SafeKernelOf);
};
struct SafeTokenOf {
  using type = std::shared_ptr<c10::KernelToken> c10::SafeKernelFunction::*;
  friend type exposed(SafeTokenOf);
};
template struct Expose<SafeKernelOf, &c10::SafeKernelFunction::kernel_>;
template struct Expose<SafeTokenOf, &c10::SafeKernelFunction::token_>;

// Calls f(tensor) for each defined tensor an argument of this type holds (none for others).
template <class T, class F>
void each_typed_tensor(const T& value, F& f) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    if (value.defined()) f(value);
  } else if constexpr (std::is_same_v<D, std::optional<at::Tensor>>) {
    if (value.has_value() && value->defined()) f(*value);
  } else if constexpr (std::is_same_v<D, at::TensorList>) {
    for (const at::Tensor& t : value) {
      if (t.defined()) f(t);
    }
  }
}

template <class T>
constexpr bool is_typed_tensor() {
  using D = std::decay_t<T>;
  return std::is_same_v<D, at::Tensor> || std::is_same_v<D, std::optional<at::Tensor>> ||
      std::is_same_v<D, at::TensorList>;
}

// A boxed entry into a HookKernel: its judge (`judge_and_run`) or its original kernel.
struct BoxedEntry final : public c10::OperatorKernel {
  const HookKernel* core;
  bool judge;
  BoxedEntry(const HookKernel* c, bool j) : core(c), judge(j) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    if (judge) {
      core->judge_and_run(op, ks, stack);
    } else {
      core->call_original(op, ks, stack);
    }
  }
};

template <class Op, class Sig = typename Op::schema>
struct FastKernel;

template <class Op, class R, class... Args>
struct FastKernel<Op, R(Args...)> final : public c10::OperatorKernel {
  std::unique_ptr<HookKernel> core;  // the op's facts and its boxed judge
  c10::OperatorHandle handle;
  c10::KernelFunction original;       // the kernel torch had on the key (valid while `token` is)
  std::shared_ptr<c10::KernelToken> token;  // none: there was none, redispatch past the key
  c10::BoxedKernel judge_boxed, original_boxed;
  uint64_t written_mask = 0;          // argument positions it writes

  FastKernel(std::unique_ptr<HookKernel> c, const c10::OperatorHandle& op)
      : core(std::move(c)), handle(op),
        judge_boxed(c10::BoxedKernel::makeFromFunctor(std::make_unique<BoxedEntry>(core.get(), true))),
        original_boxed(c10::BoxedKernel::makeFromFunctor(std::make_unique<BoxedEntry>(core.get(), false))) {
    if (core->original.has_value()) {
      original = (*core->original).*exposed(SafeKernelOf());
      token = (*core->original).*exposed(SafeTokenOf());
    }
    for (const WrittenArg& arg : core->written) written_mask |= uint64_t(1) << arg.index;
  }

  // Whether the typed kernel serves `core`: every written argument a tensor argument of the
  // signature, written on every call, and the schema the signature's.
  static bool serves(const HookKernel& core, const c10::OperatorHandle& op) {
    constexpr bool tensor_args[] = {is_typed_tensor<Args>()..., false};
    if (op.schema().arguments().size() != sizeof...(Args) || core.late || core.inference_only) return false;
    for (const WrittenArg& arg : core.written) {
      if (arg.when >= 0 || arg.index >= sizeof...(Args) || arg.index >= 64 || !tensor_args[arg.index]) return false;
    }
    return !core.written.empty();
  }

  R run(c10::DispatchKeySet ks, Args... args) const {
    if (token == nullptr) {
      return Op::redispatch(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, core->key),
                            std::forward<Args>(args)...);
    }
    if (token->isValid()) return original.template call<R, Args...>(handle, ks, std::forward<Args>(args)...);
    // torch dropped the kernel under ours: the boxed path says so (or redispatches)
    return c10::impl::BoxedKernelWrapper<R(Args...)>::call(original_boxed, handle, ks, std::forward<Args>(args)...);
  }

  R operator()(c10::DispatchKeySet ks, Args... args) {
    if (!g_enabled.load(std::memory_order_relaxed) || t_depth > 0) return run(ks, std::forward<Args>(args)...);
    DepthGuard depth;
    if (!HookKernel::before_write()) return run(ks, std::forward<Args>(args)...);
    if (core->is_copy && self_copy(args...)) return run(ks, std::forward<Args>(args)...);
    const uint64_t mask = written_mask;
    auto each = [&](auto& f) {
      size_t i = 0;
      ((((mask >> i) & 1) ? each_typed_tensor(args, f) : void(), ++i), ...);
    };
    if (!HookKernel::may_hit(each)) return run(ks, std::forward<Args>(args)...);
    return c10::impl::BoxedKernelWrapper<R(Args...)>::call(judge_boxed, handle, ks, std::forward<Args>(args)...);
  }

  template <class... Rest>
  static bool self_copy(const at::Tensor& dst, const at::Tensor& src, const Rest&...) {
    return is_self_copy(dst, src);
  }
  template <class... Rest>
  static bool self_copy(const Rest&...) {
    return false;
  }
};

// "ns::name.overload" -> registers `core` for that op as a typed kernel; false where it cannot.
using FastRegistration = bool (*)(std::unique_ptr<HookKernel>&, const c10::OperatorHandle&,
                                  std::vector<c10::RegistrationHandleRAII>*);

template <class Op>
bool register_fast(std::unique_ptr<HookKernel>& core, const c10::OperatorHandle& op,
                   std::vector<c10::RegistrationHandleRAII>* handles) {
  using Kernel = FastKernel<Op>;
  if (!Kernel::serves(*core, op)) return false;
  const c10::OperatorName name = op.operator_name();
  const c10::DispatchKey key = core->key;
  auto kernel = std::make_unique<Kernel>(std::move(core), op);
  handles->push_back(c10::Dispatcher::singleton().registerImpl(
      name, key, c10::KernelFunction::makeFromUnboxedFunctor<false, Kernel>(std::move(kernel)),
      c10::impl::CppSignature::make<typename Op::schema>(), nullptr, "kvguard write hook (unboxed)"));
  return true;
}

template <class Op>
std::pair<std::string, FastRegistration> fast_entry() {
  const std::string overload(Op::overload_name);
  return {std::string(Op::name) + "." + (overload.empty() ? std::string("default") : overload), &register_fast<Op>};
}

const std::map<std::string, FastRegistration>& fast_ops() {
  static const auto* table = new std::map<std::string, FastRegistration>{
      fast_entry<at::_ops::add__Tensor>(), fast_entry<at::_ops::add__Scalar>(),
      fast_entry<at::_ops::sub__Tensor>(), fast_entry<at::_ops::sub__Scalar>(),
      fast_entry<at::_ops::mul__Tensor>(), fast_entry<at::_ops::mul__Scalar>(),
      fast_entry<at::_ops::div__Tensor>(), fast_entry<at::_ops::div__Scalar>(),
      fast_entry<at::_ops::addcmul_>(), fast_entry<at::_ops::addcdiv_>(),
      fast_entry<at::_ops::lerp__Scalar>(), fast_entry<at::_ops::lerp__Tensor>(),
      fast_entry<at::_ops::copy_>(), fast_entry<at::_ops::zero_>(),
      fast_entry<at::_ops::fill__Scalar>(), fast_entry<at::_ops::fill__Tensor>(),
      fast_entry<at::_ops::masked_fill__Scalar>(), fast_entry<at::_ops::masked_fill__Tensor>(),
      fast_entry<at::_ops::clamp_>(), fast_entry<at::_ops::clamp_min_>(),
      fast_entry<at::_ops::sqrt_>(), fast_entry<at::_ops::exp_>(), fast_entry<at::_ops::relu_>(),
      fast_entry<at::_ops::bernoulli__float>(), fast_entry<at::_ops::uniform_>(),
      fast_entry<at::_ops::normal_>(), fast_entry<at::_ops::index_put_>(),
      fast_entry<at::_ops::_foreach_add__Scalar>(), fast_entry<at::_ops::_foreach_add__List>(),
      fast_entry<at::_ops::_foreach_add__Tensor>(), fast_entry<at::_ops::_foreach_add__ScalarList>(),
      fast_entry<at::_ops::_foreach_sub__Scalar>(),
      fast_entry<at::_ops::_foreach_mul__Scalar>(), fast_entry<at::_ops::_foreach_mul__List>(),
      fast_entry<at::_ops::_foreach_mul__Tensor>(), fast_entry<at::_ops::_foreach_mul__ScalarList>(),
      fast_entry<at::_ops::_foreach_div__Scalar>(), fast_entry<at::_ops::_foreach_div__List>(),
      fast_entry<at::_ops::_foreach_div__Tensor>(), fast_entry<at::_ops::_foreach_div__ScalarList>(),
      fast_entry<at::_ops::_foreach_lerp__Scalar>(), fast_entry<at::_ops::_foreach_lerp__List>(),
      fast_entry<at::_ops::_foreach_addcmul__Scalar>(), fast_entry<at::_ops::_foreach_addcmul__ScalarList>(),
      fast_entry<at::_ops::_foreach_addcmul__Tensor>(),
      fast_entry<at::_ops::_foreach_addcdiv__Scalar>(), fast_entry<at::_ops::_foreach_addcdiv__ScalarList>(),
      fast_entry<at::_ops::_foreach_addcdiv__Tensor>(),
      fast_entry<at::_ops::_foreach_sqrt_>(), fast_entry<at::_ops::_foreach_neg_>(),
      fast_entry<at::_ops::_foreach_maximum__List>(), fast_entry<at::_ops::_foreach_zero_>(),
      fast_entry<at::_ops::_foreach_copy_>(),
      fast_entry<at::_ops::_fused_adamw_>(), fast_entry<at::_ops::_fused_adam_>(),
      fast_entry<at::_ops::_fused_sgd_>(),
  };
  return *table;
}

bool writes_argument(const c10::AliasInfo* info) {
  if (info == nullptr) return false;
  if (info->isWrite()) return true;
  for (const c10::AliasInfo& contained : info->containedTypes()) {
    if (writes_argument(&contained)) return true;
  }
  return false;
}

bool holds_tensors(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType) return true;
  if (auto opt = type->cast<c10::OptionalType>()) return holds_tensors(opt->getElementType());
  if (auto list = type->cast<c10::ListType>()) return holds_tensors(list->getElementType());
  return false;
}

std::string display_name(const c10::OperatorName& name) {
  return name.name + "." + (name.overload_name.empty() ? std::string("default") : name.overload_name);
}

// ---- the Python API ----------------------------------------------------------------------

// Writes that schemas do not declare, from Python (kvguard._torch holds the tables).
struct UndeclaredRule {
  std::vector<std::string> names;  // parameters written
  std::string when;                // a bool parameter that must be true; empty: always
};

struct ExtraWrites {
  std::map<std::string, UndeclaredRule> undeclared;  // "ns::name" or "ns::name.overload"
  std::vector<std::string> c10d_names;  // written params of c10d's in-place collectives
};

bool read_strings(PyObject* obj, std::vector<std::string>* out, const char* what) {
  PyObject* seq = PySequence_Fast(obj, what);
  if (seq == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const char* text = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
    if (text == nullptr) {
      Py_DECREF(seq);
      return false;
    }
    out->emplace_back(text);
  }
  Py_DECREF(seq);
  return true;
}

// `undeclared`: {op name: (param names, condition param or None)}; `c10d_names`: names.
// None for either reads it from kvguard._torch.ops, which defines both (empty if that cannot be
// imported).
bool read_extra_writes(PyObject* undeclared, PyObject* c10d_names, ExtraWrites* out) {
  PyObject* torch_module = nullptr;
  if (undeclared == Py_None || c10d_names == Py_None) {
    torch_module = PyImport_ImportModule("kvguard._torch.ops");
    if (torch_module == nullptr) PyErr_Clear();
  }
  PyObject* owned_undeclared = nullptr;
  PyObject* owned_names = nullptr;
  if (undeclared == Py_None && torch_module != nullptr) {
    undeclared = owned_undeclared = PyObject_GetAttrString(torch_module, "_UNDECLARED_WRITES");
    if (undeclared == nullptr) PyErr_Clear();
  }
  if (c10d_names == Py_None && torch_module != nullptr) {
    c10d_names = owned_names = PyObject_GetAttrString(torch_module, "_C10D_WRITTEN_NAMES");
    if (c10d_names == nullptr) PyErr_Clear();
  }
  Py_XDECREF(torch_module);
  bool ok = true;
  if (undeclared != nullptr && undeclared != Py_None) {
    PyObject* items = PyMapping_Items(undeclared);
    ok = items != nullptr;
    for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(items); ++i) {
      PyObject *key = nullptr, *names = nullptr, *when = nullptr;
      PyObject* value = nullptr;
      if (!PyArg_ParseTuple(PyList_GET_ITEM(items, i), "UO", &key, &value) ||
          !PyArg_ParseTuple(value, "OO", &names, &when)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError,
                        "install: undeclared must map 'ns::op[.overload]' to (names, when)");
        ok = false;
        break;
      }
      UndeclaredRule rule;
      ok = read_strings(names, &rule.names, "install: undeclared names must be a list of str");
      if (ok && when != Py_None) {
        const char* text = PyUnicode_AsUTF8(when);
        ok = text != nullptr;
        if (ok) rule.when = text;
      }
      if (ok) out->undeclared[PyUnicode_AsUTF8(key)] = std::move(rule);
    }
    Py_XDECREF(items);
  }
  if (ok && c10d_names != nullptr && c10d_names != Py_None) {
    PyObject* listed = PySequence_List(c10d_names);  // sets and frozensets too
    ok = listed != nullptr &&
        read_strings(listed, &out->c10d_names, "install: c10d_names must be strings");
    Py_XDECREF(listed);
  }
  Py_XDECREF(owned_undeclared);
  Py_XDECREF(owned_names);
  return ok;
}

ExtraWrites* g_extra = nullptr;  // what install() read, for hook_new()

// The kernel for one op, or nullptr when its schema (and kvguard's tables) write nothing.
std::unique_ptr<HookKernel> make_kernel(const c10::OperatorHandle& op, const c10::OperatorName& op_name,
                                        const ExtraWrites& extra) {
  const auto ns = op_name.getNamespace();
  const c10::FunctionSchema& schema = op.schema();
  auto kernel = std::make_unique<HookKernel>();
  const auto& arguments = schema.arguments();
  auto position = [&](const std::string& param) -> int {
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (arguments[i].name() == param) return (int)i;
    }
    return -1;
  };
  std::vector<bool> is_written(arguments.size(), false);
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (writes_argument(arguments[i].alias_info()) && holds_tensors(arguments[i].real_type())) {
      kernel->written.push_back({i, -1});
      is_written[i] = true;
    }
  }
  // c10d's in-place collectives declare no writes: their output parameters, by name.
  if (kernel->written.empty() && *ns == "c10d" && !op_name.name.empty() &&
      op_name.name.back() == '_') {
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (std::find(extra.c10d_names.begin(), extra.c10d_names.end(), arguments[i].name()) !=
              extra.c10d_names.end() && holds_tensors(arguments[i].real_type())) {
        kernel->written.push_back({i, -1});
        is_written[i] = true;
      }
    }
  }
  auto rule = extra.undeclared.find(
      op_name.overload_name.empty() ? op_name.name : op_name.name + "." + op_name.overload_name);
  if (rule != extra.undeclared.end()) {
    // A renamed condition parameter leaves `when` -1: every call counts as writing.
    const int when = rule->second.when.empty() ? -1 : position(rule->second.when);
    for (const std::string& param : rule->second.names) {
      const int i = position(param);
      if (i >= 0 && !is_written[(size_t)i] && holds_tensors(arguments[(size_t)i].real_type())) {
        kernel->written.push_back({(size_t)i, when});
        is_written[(size_t)i] = true;
      }
    }
    std::sort(kernel->written.begin(), kernel->written.end(),
              [](const WrittenArg& a, const WrittenArg& b) { return a.index < b.index; });
  }
  if (kernel->written.empty()) return nullptr;
  kernel->num_args = arguments.size();
  kernel->name = display_name(op_name);
  kernel->is_copy = op_name.name == "aten::copy_" && op_name.overload_name.empty() &&
      arguments.size() >= 2;
  return kernel;
}

// Where hook_op registers: one torch::Library per namespace and key.
struct Registrar {
  std::vector<std::unique_ptr<torch::Library>>* libraries;
  std::vector<c10::RegistrationHandleRAII>* fast;  // where the unboxed kernels' registrations go
  std::map<std::pair<std::string, int>, torch::Library*> by_namespace;

  torch::Library* library(const std::string& ns, c10::DispatchKey key) {
    torch::Library*& lib = by_namespace[{ns, (int)key}];
    if (lib == nullptr) {
      libraries->push_back(std::make_unique<torch::Library>(
          torch::Library::IMPL, ns, key, __FILE__, __LINE__));
      lib = libraries->back().get();
    }
    return lib;
  }
};

// Hooks one op (its ADInplaceOrView kernel, and its inference-mode kernel where those are
// registered); whether it writes and was hooked.
bool hook_op(const c10::OperatorName& op_name, const ExtraWrites& extra, Registrar& registrar, bool late) {
  std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findOp(op_name);
  if (!op.has_value() || !op->hasSchema()) return false;
  const auto ns = op_name.getNamespace();
  if (!ns.has_value()) return false;
  std::unique_ptr<HookKernel> kernel = make_kernel(*op, op_name, extra);
  if (kernel == nullptr) return false;
  kernel->late = late;
  std::unique_ptr<HookKernel> inference;
  if (g_inference_hooked && !op->hasKernelForDispatchKey(kInferenceKey)) {
    inference = std::make_unique<HookKernel>();
    inference->name = kernel->name;
    inference->written = kernel->written;
    inference->num_args = kernel->num_args;
    inference->is_copy = kernel->is_copy;
    inference->key = kInferenceKey;
    inference->inference_only = true;
    inference->late = late;
  }
  // The original must be taken before ours is registered: afterwards the computed kernel
  // for the key is ours.
  constexpr auto key = c10::DispatchKey::ADInplaceOrView;
  if (op->hasKernelForDispatchKey(key) && !op->isKernelFallthroughKernel(key)) {
    kernel->original.emplace(op->getComputedKernelForDispatchKey(key));
  }
  const std::string ns_name(*ns);
  const std::string qualified =
      op_name.overload_name.empty() ? op_name.name : op_name.name + "." + op_name.overload_name;
  const auto fast = late || registrar.fast == nullptr ? fast_ops().end() : fast_ops().find(display_name(op_name));
  try {
    if (fast == fast_ops().end() || !fast->second(kernel, *op, registrar.fast)) {
      registrar.library(ns_name, key)->impl(
          qualified.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
    }
  } catch (const c10::Error&) {
    return false;  // an op that refuses a kernel on this key stays unhooked
  }
  if (inference != nullptr) {
    try {
      registrar.library(ns_name, kInferenceKey)->impl(
          qualified.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(inference)));
    } catch (const c10::Error&) {
      // left to the boundary check inside inference mode, as without this kernel
    }
  }
  return true;
}

PyObject* py_install(PyObject*, PyObject* args, PyObject* kwargs) {
  KVGUARD_TRY
  static const char* keywords[] = {"undeclared", "c10d_names", nullptr};
  PyObject* undeclared_arg = Py_None;
  PyObject* c10d_arg = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OO:install", const_cast<char**>(keywords),
                                   &undeclared_arg, &c10d_arg)) {
    return nullptr;
  }
  if (g_libraries != nullptr) return PyLong_FromSize_t(g_hooked->size());
  auto extra = std::make_unique<ExtraWrites>();
  if (!read_extra_writes(undeclared_arg, c10d_arg, extra.get())) return nullptr;
  SilentWarnings silent;  // "Overriding a previously registered kernel": stacking is the point
  c10::WarningUtils::WarningHandlerGuard warning_guard(&silent);
  auto libraries = std::make_unique<std::vector<std::unique_ptr<torch::Library>>>();
  auto hooked = std::make_unique<std::vector<std::string>>();
  auto seen = std::make_unique<std::set<std::string>>();
  auto& dispatcher = c10::Dispatcher::singleton();
  // Counting starts before the op names are read: nothing defined in between is missed.
  auto listener = std::make_unique<c10::RegistrationHandleRAII>(
      dispatcher.addRegistrationListener(std::make_unique<CountRegistrations>()));
  g_registrations_seen = g_registrations.load(std::memory_order_relaxed);
  g_inference_hooked = !dispatcher.hasBackendFallbackForDispatchKey(kInferenceKey);
  if (g_inference_hooked) {
    libraries->push_back(std::make_unique<torch::Library>(
        torch::Library::IMPL, "_", kInferenceKey, __FILE__, __LINE__));
    libraries->back()->fallback(torch::CppFunction::makeFallthrough());
  }
  auto fast_handles = std::make_unique<std::vector<c10::RegistrationHandleRAII>>();
  Registrar registrar{libraries.get(), fast_handles.get(), {}};
  for (const c10::OperatorName& op_name : dispatcher.getAllOpNames()) {
    std::string shown = display_name(op_name);
    if (hook_op(op_name, *extra, registrar, false)) hooked->push_back(shown);
    seen->insert(std::move(shown));
  }
  g_libraries = libraries.release();
  g_fast_handles = fast_handles.release();
  g_hooked = hooked.release();
  g_seen = seen.release();
  g_extra = extra.release();
  g_listener = new std::unique_ptr<c10::RegistrationHandleRAII>(std::move(listener));
  return PyLong_FromSize_t(g_hooked->size());
  KVGUARD_CATCH
}

// hook_new() -> int: hook the writing ops defined since install() (or the last call);
// returns how many. Free while no op was defined. Registers kernels: call it where
// install() may be called (kvguard does at a guard's entry).
PyObject* py_hook_new(PyObject*, PyObject*) {
  KVGUARD_TRY
  if (g_libraries == nullptr) return PyLong_FromLong(0);
  const uint64_t now = g_registrations.load(std::memory_order_relaxed);
  if (now == g_registrations_seen) return PyLong_FromLong(0);
  g_registrations_seen = now;
  SilentWarnings silent;
  c10::WarningUtils::WarningHandlerGuard warning_guard(&silent);
  Registrar registrar{g_libraries, nullptr, {}};  // ops defined later keep the boxed kernel
  long count = 0;
  for (const c10::OperatorName& op_name : c10::Dispatcher::singleton().getAllOpNames()) {
    std::string shown = display_name(op_name);
    if (g_seen->count(shown) != 0) continue;
    std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findOp(op_name);
    if (!op.has_value() || !op->hasSchema()) continue;  // no schema yet: looked at once it has one
    if (hook_op(op_name, *g_extra, registrar, true)) {
      g_hooked->push_back(shown);
      ++count;
    }
    g_seen->insert(std::move(shown));
  }
  return PyLong_FromLong(count);
  KVGUARD_CATCH
}

PyObject* py_uninstall(PyObject*, PyObject*) {
  KVGUARD_TRY
  if (g_libraries != nullptr) {
    SilentWarnings silent;
    c10::WarningUtils::WarningHandlerGuard warning_guard(&silent);
    delete g_listener;
    g_listener = nullptr;
    delete g_fast_handles;  // each handle deregisters its unboxed kernel
    g_fast_handles = nullptr;
    delete g_libraries;  // each Library deregisters its kernels: the originals are back
    g_libraries = nullptr;
    delete g_hooked;
    g_hooked = nullptr;
    delete g_seen;
    g_seen = nullptr;
    delete g_extra;
    g_extra = nullptr;
    g_inference_hooked = false;
  }
  Py_RETURN_NONE;
  KVGUARD_CATCH
}

// watch_inference(on) -> bool: this thread guards an inference tensor (on), or one guard
// fewer does (off). While one does, the thread's TLS includes kInferenceKey, so that
// writes inside torch.inference_mode() reach the inference kernels. Returns whether they
// are registered (False: such writes are left to the boundary checks).
PyObject* py_watch_inference(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  if (!g_inference_hooked) return PyBool_FromLong(0);
  if (on) {
    if (t_inference_watchers++ == 0 && !c10::impl::tls_is_dispatch_key_included(kInferenceKey)) {
      c10::impl::tls_set_dispatch_key_included(kInferenceKey, true);
      t_inference_included = true;
    }
  } else if (t_inference_watchers > 0 && --t_inference_watchers == 0 && t_inference_included) {
    c10::impl::tls_set_dispatch_key_included(kInferenceKey, false);
    t_inference_included = false;
  }
  return PyBool_FromLong(1);
}

PyObject* py_installed(PyObject*, PyObject*) {
  return PyBool_FromLong(g_libraries != nullptr);
}

PyObject* py_hooked_ops(PyObject*, PyObject*) {
  const size_t n = g_hooked == nullptr ? 0 : g_hooked->size();
  PyObject* list = PyList_New((Py_ssize_t)n);
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < n; ++i) {
    const std::string& s = (*g_hooked)[i];
    PyObject* item = PyUnicode_FromStringAndSize(s.data(), (Py_ssize_t)s.size());
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, (Py_ssize_t)i, item);
  }
  return list;
}

PyObject* py_set_enabled(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  g_enabled.store(on != 0, std::memory_order_relaxed);
  Py_RETURN_NONE;
}

PyObject* py_enabled(PyObject*, PyObject*) {
  return PyBool_FromLong(g_enabled.load(std::memory_order_relaxed));
}

PyObject* py_set_send_all(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  g_send_all.store(on != 0, std::memory_order_relaxed);
  Py_RETURN_NONE;
}

bool read_address(PyObject* obj, uintptr_t* out, const char* what) {
  if (!PyLong_Check(obj) || PyBool_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "%s: addresses must be ints, not %.100s", what,
                 Py_TYPE(obj)->tp_name);
    return false;
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(obj);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s: %R is not a valid address", what, obj);
    return false;
  }
  if (v > static_cast<unsigned long long>(UINTPTR_MAX)) {
    PyErr_Format(PyExc_ValueError, "%s: %R is not a valid address", what, obj);
    return false;
  }
  *out = static_cast<uintptr_t>(v);
  return true;
}

// Makes `next` what writing threads read (replaced whole, never changed once published).
// Updates come from Python with the GIL held, so they never race each other.
void store_protected(std::shared_ptr<const Protected> next) {
  const Protected* raw = next.get();
  std::shared_ptr<const Protected> old = std::atomic_exchange(&g_protected, std::move(next));
  g_protected_raw.store(raw, std::memory_order_seq_cst);
  if (old != nullptr) g_retired->push_back(std::move(old));
  // A reader that counted itself after the store above reads `raw`: none left means none
  // holds a retired one (both sides seq_cst: the store, then this load; the count, then its load).
  if (g_protected_readers.load(std::memory_order_seq_cst) == 0) g_retired->clear();
}

void publish(std::shared_ptr<Protected> next) {
  store_protected(std::shared_ptr<const Protected>(std::move(next)));
}

// Reads a sequence of (start, stop) pairs (tuples or lists of two addresses) into `out`,
// leaving out empty ones. `sorted`: they must be sorted and disjoint, each with start <= stop
// (a ValueError otherwise); else any order and any overlap.
bool read_pairs(PyObject* arg, Intervals* out, const char* what, bool sorted) {
  PyObject* seq = PySequence_Fast(arg, "");
  if (seq == nullptr) {
    PyErr_Format(PyExc_TypeError, "%s: expected a list of (start, stop) pairs", what);
    return false;
  }
  out->reserve(out->size() + (size_t)PySequence_Fast_GET_SIZE(seq));
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    PyObject* pair = PyTuple_Check(item) || PyList_Check(item) ? PySequence_Fast(item, "") : nullptr;
    uintptr_t start = 0, stop = 0;
    ok = pair != nullptr && PySequence_Fast_GET_SIZE(pair) == 2;
    if (!ok && !PyErr_Occurred()) {
      PyErr_Format(PyExc_TypeError, "%s: item %zd is a %.100s, expected a (start, stop) pair", what, i,
                   Py_TYPE(item)->tp_name);
    }
    ok = ok && read_address(PySequence_Fast_GET_ITEM(pair, 0), &start, what) &&
        read_address(PySequence_Fast_GET_ITEM(pair, 1), &stop, what);
    Py_XDECREF(pair);
    if (ok && sorted && start > stop) {
      PyErr_Format(PyExc_ValueError, "%s: item %zd has start > stop", what, i);
      ok = false;
    } else if (ok && sorted && !out->empty() && start < out->back().second) {
      PyErr_Format(PyExc_ValueError,
                   "%s: item %zd starts before the previous one stops; intervals must be sorted and disjoint",
                   what, i);
      ok = false;
    }
    if (ok && start < stop) out->emplace_back(start, stop);  // an empty interval overlaps nothing
  }
  Py_DECREF(seq);
  return ok;
}

PyObject* py_set_intervals(PyObject*, PyObject* arg) {
  KVGUARD_TRY
  Intervals intervals;
  if (!read_pairs(arg, &intervals, "set_intervals", /*sorted=*/true)) return nullptr;
  auto bulk = std::make_shared<Sorted>();
  bulk->identities = flatten(std::atomic_load(&g_protected).get()).identities;
  bulk->intervals = std::move(intervals);
  auto next = std::make_shared<Protected>();
  next->bulk = std::move(bulk);
  publish(std::move(next));
  Py_RETURN_NONE;
  KVGUARD_CATCH
}

// Reads a sequence of ints (`tensor._cdata` addresses) into `out`.
bool read_addresses(PyObject* arg, std::vector<uintptr_t>* out, const char* what) {
  PyObject* seq = PySequence_Fast(arg, "");
  if (seq == nullptr) {
    PyErr_Format(PyExc_TypeError, "%s: expected a list of ints (tensor._cdata)", what);
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  out->reserve(out->size() + (size_t)n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    uintptr_t v = 0;
    if (!read_address(PySequence_Fast_GET_ITEM(seq, i), &v, what)) {
      Py_DECREF(seq);
      return false;
    }
    out->push_back(v);
  }
  Py_DECREF(seq);
  return true;
}

// add_protected(intervals, identities, replace=False): the protected set grew (merged into
// what is published in one pass over it, so a placement costs far less than publishing it
// all), or is this (`replace`: sorted and merged here, published at once).
PyObject* py_add_protected(PyObject*, PyObject* args) {
  KVGUARD_TRY
  PyObject *intervals_arg = nullptr, *identities_arg = nullptr;
  int replace = 0;
  if (!PyArg_ParseTuple(args, "OO|p:add_protected", &intervals_arg, &identities_arg, &replace)) {
    return nullptr;
  }
  Intervals added;
  std::vector<uintptr_t> more;
  if (is_table(intervals_arg)) {  // a Table's live rows from row `identities_arg` on: no Python lists
    const Py_ssize_t first = PyLong_AsSsize_t(identities_arg);
    if (first == -1 && PyErr_Occurred()) return nullptr;
    table_publication(intervals_arg, (size_t)std::max<Py_ssize_t>(first, 0), &added, &more);
  } else {
    if (!read_pairs(intervals_arg, &added, "add_protected", /*sorted=*/false)) return nullptr;
    if (!read_addresses(identities_arg, &more, "add_protected")) return nullptr;
  }
  std::sort(added.begin(), added.end());
  std::sort(more.begin(), more.end());
  Sorted fresh;
  merge_sorted(Sorted{std::move(added), std::move(more)}, Sorted(), &fresh);  // coalesced, deduplicated
  auto current = replace ? std::shared_ptr<const Protected>() : std::atomic_load(&g_protected);
  auto next = std::make_shared<Protected>();
  static const Sorted kEmpty;
  const Sorted& bulk = current && current->bulk ? *current->bulk : kEmpty;
  if (current && current->recent.size() + fresh.size() <= 64 + bulk.size() / 16) {
    next->bulk = current->bulk;  // shared: this publication copies only the recent part
    merge_sorted(current->recent, fresh, &next->recent);
  } else {
    auto merged = std::make_shared<Sorted>();
    Sorted pending;
    merge_sorted(current ? current->recent : kEmpty, fresh, &pending);
    merge_sorted(bulk, pending, merged.get());
    next->bulk = std::move(merged);
  }
  publish(std::move(next));
  Py_RETURN_NONE;
  KVGUARD_CATCH
}

// ---- an optimizer step's own writes ------------------------------------------------------
// A step's parameters are known before it runs: admit(table) takes their memory and
// identities (a Table's live rows) out of what is published, so that the step's writes to
// them never reach Python; admit(None) puts back what was published before, unless
// something was published since (then it returns False and the caller publishes anew).
// One admission at a time; with the GIL.
std::shared_ptr<const Protected> g_admit_before;     // what admit(table) replaced
std::shared_ptr<const Protected> g_admit_published;  // what it published instead
bool g_admitting = false;

// The last admission, to publish again as it was when the next one is the same: the same
// table rows (spans and identities, as table_publication lists them), the same memory kept
// for other guards, over the same published object (a training loop's steps, one after the
// other: admit(None) put that object back). Then no step sorts and subtracts its rows again.
struct AdmitCache {
  Intervals spans, kept;                          // as read, unsorted
  std::vector<uintptr_t> identities, kept_ids;    // as read, unsorted
  std::shared_ptr<const Protected> over, result;  // published before it, and by it
};
AdmitCache* g_admit_cache = new AdmitCache();  // with the GIL only

// `into` = `a` less `b` (each sorted and coalesced): the parts of a's intervals that none of
// b's covers, and a's identities that are not b's.
void subtract_sorted(const Sorted& a, const Sorted& b, Sorted* into) {
  into->intervals.clear();
  into->intervals.reserve(a.intervals.size());
  size_t j = 0;
  for (const Interval& iv : a.intervals) {
    uintptr_t lo = iv.first;
    const uintptr_t hi = iv.second;
    while (j < b.intervals.size() && b.intervals[j].second <= lo) ++j;  // behind this and every later one
    for (size_t k = j; lo < hi && k < b.intervals.size() && b.intervals[k].first < hi; ++k) {
      if (b.intervals[k].first > lo) into->intervals.emplace_back(lo, b.intervals[k].first);
      lo = std::max(lo, b.intervals[k].second);
    }
    if (lo < hi) into->intervals.emplace_back(lo, hi);
  }
  into->identities.clear();
  std::set_difference(a.identities.begin(), a.identities.end(), b.identities.begin(), b.identities.end(),
                      std::back_inserter(into->identities));
}

// admit(table | None, intervals=(), identities=()) -> bool: see above. True: admitted (table),
// or put back (None). `intervals` and `identities` stay published whatever the table holds:
// what other guards protect.
PyObject* py_admit(PyObject*, PyObject* args) {
  KVGUARD_TRY
  PyObject *arg = nullptr, *keep_intervals = nullptr, *keep_identities = nullptr;
  if (!PyArg_ParseTuple(args, "O|OO:admit", &arg, &keep_intervals, &keep_identities)) return nullptr;
  if (arg == Py_None) {
    if (!g_admitting) Py_RETURN_FALSE;
    const bool untouched = std::atomic_load(&g_protected) == g_admit_published;
    if (untouched) store_protected(g_admit_before);
    g_admit_before.reset();
    g_admit_published.reset();
    g_admitting = false;
    return PyBool_FromLong(untouched);
  }
  if (!is_table(arg)) {
    PyErr_Format(PyExc_TypeError, "admit: expected a Table or None, not %.100s", Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  if (g_admitting) Py_RETURN_FALSE;
  Intervals kept;
  std::vector<uintptr_t> kept_ids;
  if (keep_intervals != nullptr && !read_pairs(keep_intervals, &kept, "admit", /*sorted=*/false)) return nullptr;
  if (keep_identities != nullptr && !read_addresses(keep_identities, &kept_ids, "admit")) return nullptr;
  Intervals spans;
  std::vector<uintptr_t> identities;
  table_publication(arg, 0, &spans, &identities);
  std::shared_ptr<const Protected> current = std::atomic_load(&g_protected);
  AdmitCache& cache = *g_admit_cache;
  if (cache.result != nullptr && cache.over == current && cache.spans == spans && cache.identities == identities &&
      cache.kept == kept && cache.kept_ids == kept_ids) {
    g_admit_before = std::move(current);
    g_admit_published = cache.result;
    g_admitting = true;
    store_protected(cache.result);
    Py_RETURN_TRUE;
  }
  cache.result.reset();
  cache.over = current;
  cache.spans = spans;
  cache.identities = identities;
  cache.kept = kept;
  cache.kept_ids = kept_ids;
  std::sort(spans.begin(), spans.end());
  std::sort(identities.begin(), identities.end());
  Sorted admitted;
  merge_sorted(Sorted{std::move(spans), std::move(identities)}, Sorted(), &admitted);
  const Sorted all = flatten(current.get());
  auto bulk = std::make_shared<Sorted>();
  subtract_sorted(all, admitted, bulk.get());
  if (!kept.empty() || !kept_ids.empty()) {
    std::sort(kept.begin(), kept.end());
    std::sort(kept_ids.begin(), kept_ids.end());
    Sorted others, less = std::move(*bulk);
    merge_sorted(Sorted{std::move(kept), std::move(kept_ids)}, Sorted(), &others);
    merge_sorted(less, others, bulk.get());
  }
  auto next = std::make_shared<Protected>();
  next->bulk = std::move(bulk);
  std::shared_ptr<const Protected> frozen = std::move(next);
  g_admit_before = std::move(current);
  g_admit_published = frozen;
  g_admitting = true;
  cache.result = frozen;
  store_protected(std::move(frozen));
  Py_RETURN_TRUE;
  KVGUARD_CATCH
}

// same_ids(objects: list, ids: tuple) -> bool: whether id(objects[i]) == ids[i] for every i (and
// the lengths agree): an optimizer's parameters still those its step set was made for, checked
// without a tuple of ints made per step.
PyObject* py_same_ids(PyObject*, PyObject* args) {
  PyObject *objects = nullptr, *ids = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!:same_ids", &PyList_Type, &objects, &PyTuple_Type, &ids)) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(objects);
  if (PyTuple_GET_SIZE(ids) != n) Py_RETURN_FALSE;
  for (Py_ssize_t i = 0; i < n; ++i) {
    void* id = PyLong_AsVoidPtr(PyTuple_GET_ITEM(ids, i));
    if (id == nullptr && PyErr_Occurred()) return nullptr;
    if (id != (void*)PyList_GET_ITEM(objects, i)) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

PyObject* py_set_identities(PyObject*, PyObject* arg) {
  KVGUARD_TRY
  std::vector<uintptr_t> identities;
  if (!read_addresses(arg, &identities, "set_identities")) return nullptr;
  std::sort(identities.begin(), identities.end());
  identities.erase(std::unique(identities.begin(), identities.end()), identities.end());
  auto bulk = std::make_shared<Sorted>();
  bulk->intervals = flatten(std::atomic_load(&g_protected).get()).intervals;
  bulk->identities = std::move(identities);
  auto next = std::make_shared<Protected>();
  next->bulk = std::move(bulk);
  publish(std::move(next));
  Py_RETURN_NONE;
  KVGUARD_CATCH
}

bool set_callable(PyObject* arg, PyObject** slot, std::atomic<bool>* flag, const char* what) {
  if (arg != Py_None && !PyCallable_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "%s: expected a callable or None, not %.100s", what,
                 Py_TYPE(arg)->tp_name);
    return false;
  }
  PyObject* old = *slot;
  if (arg == Py_None) {
    flag->store(false, std::memory_order_relaxed);
    *slot = nullptr;
  } else {
    Py_INCREF(arg);
    *slot = arg;
    flag->store(true, std::memory_order_relaxed);
  }
  Py_XDECREF(old);
  return true;
}

PyObject* py_set_callback(PyObject*, PyObject* arg) {
  if (!set_callable(arg, &g_callback, &g_has_callback, "set_callback")) return nullptr;
  Py_RETURN_NONE;
}

PyObject* py_set_watch(PyObject*, PyObject* args) {
  PyObject *watch = nullptr, *snapshots = Py_None;
  if (!PyArg_ParseTuple(args, "O|O:set_watch", &watch, &snapshots)) return nullptr;
  PyObject* frozen = nullptr;  // a tuple of (containers, held) tuple pairs
  if (snapshots != Py_None) {
    frozen = PySequence_Tuple(snapshots);
    if (frozen == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(frozen); ++i) {
      PyObject* pair = PyTuple_GET_ITEM(frozen, i);
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
          !PyTuple_Check(PyTuple_GET_ITEM(pair, 0)) || !PyTuple_Check(PyTuple_GET_ITEM(pair, 1))) {
        PyErr_SetString(PyExc_TypeError,
                        "set_watch: snapshots must be (containers, held) pairs of tuples");
        Py_DECREF(frozen);
        return nullptr;
      }
    }
  }
  if (!set_callable(watch, &g_watch, &g_has_watch, "set_watch")) {
    Py_XDECREF(frozen);
    return nullptr;
  }
  PyObject* old = g_watch_snapshots;
  g_watch_snapshots = watch == Py_None ? nullptr : frozen;
  if (watch == Py_None) Py_XDECREF(frozen);
  publish_quiet(g_watch_snapshots);
  Py_XDECREF(old);
  Py_RETURN_NONE;
}

PyObject* py_writes(PyObject*, PyObject*) {
  return PyLong_FromUnsignedLongLong(g_writes.load(std::memory_order_relaxed));
}

// candidates(tensors) -> list[int]: the positions of the tensors a write into which the hook
// would hand to its callback now (none while it is off or has none). For writes no op
// dispatches (a compiled graph's kernels): the same test as the hook's, before they run.
PyObject* py_candidates(PyObject*, PyObject* arg) {
  KVGUARD_TRY
  PyRef seq{PySequence_Fast(arg, "candidates() takes a sequence of tensors")};
  if (seq.p == nullptr) return nullptr;
  PyRef out{PyList_New(0)};
  if (out.p == nullptr) return nullptr;
  if (!g_enabled.load(std::memory_order_relaxed) || !g_has_callback.load(std::memory_order_relaxed)) {
    Py_INCREF(out.p);
    return out.p;
  }
  const bool send_all = g_send_all.load(std::memory_order_relaxed);
  std::shared_ptr<const Protected> protected_;
  if (!send_all) protected_ = std::atomic_load(&g_protected);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.p);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq.p, i);
    if (!THPVariable_Check(item)) continue;
    const at::Tensor& t = THPVariable_Unpack(item);
    if (!t.defined() || !(send_all || is_candidate(t, protected_.get()))) continue;
    PyRef position{PyLong_FromSsize_t(i)};
    if (position.p == nullptr || PyList_Append(out.p, position.p) != 0) return nullptr;
  }
  Py_INCREF(out.p);
  return out.p;
  KVGUARD_CATCH
}


// meets_saved(tensors) -> bool: whether a write to one of `tensors` may reach a tensor the C pack
// saved (its storage's bytes meet a live saved row; views share a version counter only within
// one storage): where none does, the judge of a write Python was asked about for another guard
// has no C pack to look at. True for a tensor whose memory cannot be read (Python decides).
PyObject* py_meets_saved(PyObject*, PyObject* arg) {
  KVGUARD_TRY
  PyRef seq{PySequence_Fast(arg, "meets_saved() takes a sequence of tensors")};
  if (seq.p == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.p);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq.p, i);
    if (!THPVariable_Check(item)) Py_RETURN_TRUE;
    const at::Tensor& t = THPVariable_Unpack(item);
    if (!t.defined()) continue;
    uintptr_t lo = 0, hi = 0;
    try {
      if (!t.has_storage() || t.layout() != c10::kStrided) Py_RETURN_TRUE;
      const c10::Storage& storage = t.storage();
      const void* data = storage.data();
      if (data == nullptr) Py_RETURN_TRUE;
      lo = reinterpret_cast<uintptr_t>(data);
      hi = lo + storage.nbytes();
    } catch (...) {
      Py_RETURN_TRUE;
    }
    if (hi > lo && saved_rows_meet(lo, hi)) Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
  KVGUARD_CATCH
}

// ---- autograd's pack and unpack hooks in C ---------------------------------------------------
// kvguard._protect.saved's hooks, for the common case, without a Python frame: SavedHooks'
// pack keeps a Saved (the tensor detached, its version, the user's line that saved it) and
// registers its elements as a saved row (above); unpack makes autograd's version check and
// counts the read. What needs Python is sent to the set's own Python hooks (`py_pack`,
// `py_unpack`, `py_read`): subclasses other than Parameter, Parameters with attributes,
// memory describe() cannot read (sparse, nested, meta, inference tensors), a version
// mismatch (the error's text), and every pack while `fast` is off (no compiled hook
// attached, nested guard_autograd blocks, a closed set). A Saved's entry in the set is made
// only when Python judges a write (`drain`). Everything here runs with the GIL.

constexpr int64_t kNoInt = INT64_MIN;  // read_by / task: None

struct SavedObject {
  PyObject_HEAD
  at::Tensor tensor;       // what autograd reads back: the tensor saved (an input of the node saving
                           // it, as autograd keeps one without hooks) or, where holding that could
                           // close a cycle, an alias detached from it (see keeps_original)
  at::Tensor detached;     // the detached alias Python reads (`.tensor`), made when first asked
  int64_t version;
  PyObject* code;          // the user's frame's code, its line found when asked (`site`)
  int lasti;
  PyObject* site;          // (co_filename, line) or None; nullptr: from `code`, not read yet
  PyObject* saver;         // the rest as kvguard._protect.saved.Saved's (nullptr: None)
  PyObject* writes;        // a list, made when first asked
  PyObject* burst;
  int64_t read_by;
  int64_t task;
  uintptr_t row_start;     // its saved row's key
  PyObject* hooks;         // borrowed: whose row it has (nullptr: none)
  bool drained;            // handed to Python (`SavedHooks.drain`)
  PyObject* weakrefs;
};

PyTypeObject* saved_type();

void saved_unregister(SavedObject* s) {
  if (s->hooks != nullptr) {
    saved_row_remove(s->row_start, (PyObject*)s);
    s->hooks = nullptr;
  }
}

void saved_dealloc(SavedObject* s) {
  saved_unregister(s);
  if (s->weakrefs != nullptr) PyObject_ClearWeakRefs((PyObject*)s);
  Py_CLEAR(s->code);
  Py_CLEAR(s->site);
  Py_CLEAR(s->saver);
  Py_CLEAR(s->writes);
  Py_CLEAR(s->burst);
  s->tensor.~Tensor();
  s->detached.~Tensor();
  Py_TYPE(s)->tp_free((PyObject*)s);
}

// What detach() makes, without the dispatcher: the same storage, sizes and version counter, no autograd meta.
at::Tensor detached_alias(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(), /*allow_tensor_metadata_change=*/true));
}

PyObject* saved_get_tensor(SavedObject* s, void*) {
  if (!s->tensor.defined()) Py_RETURN_NONE;
  if (!s->detached.defined()) {
    try {
      // Made when Python first asks, maybe inside a dispatch mode (Dynamo's fake tensors judging a
      // compiled write): shallow_copy_and_detach would hand the copy to the mode, which refuses a
      // real tensor. No op is anyone's here (the alias is kvguard's), so no mode sees it.
      c10::impl::ExcludeDispatchKeyGuard no_modes(c10::DispatchKey::Python);
      s->detached = detached_alias(s->tensor);
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  return THPVariable_Wrap(s->detached);
}

PyObject* saved_get_version(SavedObject* s, void*) { return PyLong_FromLongLong(s->version); }

PyObject* saved_get_site(SavedObject* s, void*) {
  if (s->site == nullptr) {
    if (s->code == nullptr) Py_RETURN_NONE;
    PyCodeObject* code = (PyCodeObject*)s->code;
    const int line = PyCode_Addr2Line(code, s->lasti);
    s->site = Py_BuildValue("(Oi)", code->co_filename, line);
    if (s->site == nullptr) return nullptr;
    Py_CLEAR(s->code);
  }
  return Py_NewRef(s->site);
}

int saved_set_site(SavedObject* s, PyObject* value, void*) {
  Py_XSETREF(s->site, Py_NewRef(value != nullptr ? value : Py_None));
  Py_CLEAR(s->code);
  return 0;
}

PyObject* saved_get_writes(SavedObject* s, void*) {
  if (s->writes == nullptr && (s->writes = PyList_New(0)) == nullptr) return nullptr;
  return Py_NewRef(s->writes);
}

int saved_set_writes(SavedObject* s, PyObject* value, void*) {
  Py_XSETREF(s->writes, Py_XNewRef(value));
  return 0;
}

PyObject* int_or_none(int64_t v) { return v == kNoInt ? Py_NewRef(Py_None) : PyLong_FromLongLong(v); }

int set_int_or_none(int64_t* into, PyObject* value) {
  if (value == nullptr || value == Py_None) {
    *into = kNoInt;
    return 0;
  }
  const long long v = PyLong_AsLongLong(value);
  if (v == -1 && PyErr_Occurred()) return -1;
  *into = v;
  return 0;
}

PyObject* saved_get_read_by(SavedObject* s, void*) { return int_or_none(s->read_by); }
int saved_set_read_by(SavedObject* s, PyObject* v, void*) { return set_int_or_none(&s->read_by, v); }
PyObject* saved_get_task(SavedObject* s, void*) { return int_or_none(s->task); }
int saved_set_task(SavedObject* s, PyObject* v, void*) { return set_int_or_none(&s->task, v); }

PyObject* object_or_none(PyObject* o) { return Py_NewRef(o != nullptr ? o : Py_None); }
int set_object(PyObject** into, PyObject* value) {
  Py_XSETREF(*into, value == nullptr || value == Py_None ? nullptr : Py_NewRef(value));
  return 0;
}
PyObject* saved_get_saver(SavedObject* s, void*) { return object_or_none(s->saver); }
int saved_set_saver(SavedObject* s, PyObject* v, void*) { return set_object(&s->saver, v); }
PyObject* saved_get_burst(SavedObject* s, void*) { return object_or_none(s->burst); }
int saved_set_burst(SavedObject* s, PyObject* v, void*) { return set_object(&s->burst, v); }

PyObject* saved_get_registered(SavedObject* s, void*) { return PyBool_FromLong(s->hooks != nullptr); }

PyGetSetDef saved_getset[] = {
    {"registered", (getter)saved_get_registered, nullptr, "whether it is a saved row of the write hook", nullptr},
    {"tensor", (getter)saved_get_tensor, nullptr, "the tensor autograd reads back (detached)", nullptr},
    {"version", (getter)saved_get_version, nullptr, "its version when saved", nullptr},
    {"site", (getter)saved_get_site, (setter)saved_set_site, "(co_filename, line) that saved it, or None", nullptr},
    {"saver", (getter)saved_get_saver, (setter)saved_set_saver, "'SigmoidBackward0: result', once named", nullptr},
    {"writes", (getter)saved_get_writes, (setter)saved_set_writes, "writes reported on it", nullptr},
    {"read_by", (getter)saved_get_read_by, (setter)saved_set_read_by, "the node that last unpacked it", nullptr},
    {"burst", (getter)saved_get_burst, (setter)saved_set_burst, "the forward stretch that saved it", nullptr},
    {"task", (getter)saved_get_task, (setter)saved_set_task, "the backward pass that first read it", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject* saved_type() {
  static PyTypeObject type = [] {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "kvguard._native.write_hook.Saved";
    t.tp_basicsize = sizeof(SavedObject);
    t.tp_dealloc = (destructor)saved_dealloc;
    t.tp_flags = Py_TPFLAGS_DEFAULT;
    t.tp_doc = "What kvguard's C pack hook kept of a saved tensor (see kvguard._protect.saved.Saved).";
    t.tp_getset = saved_getset;
    t.tp_weaklistoffset = offsetof(SavedObject, weakrefs);
    return t;
  }();
  return &type;
}

constexpr int kRecentTasks = 64;
constexpr int kRoots = 64;

struct HooksObject {
  PyObject_HEAD
  PyObject* owner;           // the SavedSet
  PyObject* py_pack;         // its Python hooks, for what C leaves to them
  PyObject* py_unpack;
  PyObject* py_read;
  PyObject* internal_files;  // kvguard._protect.frames._internal_files: co_filename -> internal
  PyObject* first_user_line; // kvguard._protect.frames.first_user_line, for a file not in it yet
  PyObject* burst_type;      // kvguard._protect.saved._Burst
  PyObject* parameter_type;  // torch.nn.Parameter
  PyObject* burst;           // the forward stretch saving now (nullptr: none)
  char fast;                 // C packs (else every pack goes to py_pack)
  char backward_since_pack;
  long long bursts, bursts_read, tasks, packed;
  int64_t recent[kRecentTasks];  // backward passes counted last (a ring)
  int recent_count, recent_next;
  std::vector<WeakImpl>* roots;  // recently saved tensors that require grad (a ring)
  int roots_next;
};

PyTypeObject* hooks_type();

void hooks_release_rows(HooksObject* h) {
  std::vector<SavedObject*> mine;
  {
    std::lock_guard<std::mutex> lock(g_saved_mu);
    for (auto it = g_saved_rows->begin(); it != g_saved_rows->end();) {
      SavedObject* s = (SavedObject*)it->second.saved;
      if (s->hooks == (PyObject*)h) {
        mine.push_back(s);
        it = g_saved_rows->erase(it);
        if (g_saved_count.fetch_sub(1, std::memory_order_release) == 1) g_saved_longest = 0;
      } else {
        ++it;
      }
    }
  }
  for (SavedObject* s : mine) s->hooks = nullptr;
}

int hooks_traverse(HooksObject* h, visitproc visit, void* arg) {
  Py_VISIT(h->owner);
  Py_VISIT(h->py_pack);
  Py_VISIT(h->py_unpack);
  Py_VISIT(h->py_read);
  Py_VISIT(h->internal_files);
  Py_VISIT(h->first_user_line);
  Py_VISIT(h->burst_type);
  Py_VISIT(h->parameter_type);
  Py_VISIT(h->burst);
  return 0;
}

int hooks_clear(HooksObject* h) {
  h->fast = 0;
  Py_CLEAR(h->owner);
  Py_CLEAR(h->py_pack);
  Py_CLEAR(h->py_unpack);
  Py_CLEAR(h->py_read);
  Py_CLEAR(h->internal_files);
  Py_CLEAR(h->first_user_line);
  Py_CLEAR(h->burst_type);
  Py_CLEAR(h->parameter_type);
  Py_CLEAR(h->burst);
  return 0;
}

void hooks_dealloc(HooksObject* h) {
  PyObject_GC_UnTrack(h);
  hooks_release_rows(h);
  hooks_clear(h);
  delete h->roots;
  Py_TYPE(h)->tp_free((PyObject*)h);
}

PyObject* hooks_new(PyTypeObject* type, PyObject* args, PyObject*) {
  PyObject *owner, *pack, *unpack, *read, *files, *first, *burst_type, *parameter_type;
  if (!PyArg_ParseTuple(args, "OOOOO!OOO", &owner, &pack, &unpack, &read, &PyDict_Type, &files, &first,
                        &burst_type, &parameter_type)) {
    return nullptr;
  }
  HooksObject* h = (HooksObject*)type->tp_alloc(type, 0);
  if (h == nullptr) return nullptr;
  h->owner = Py_NewRef(owner);
  h->py_pack = Py_NewRef(pack);
  h->py_unpack = Py_NewRef(unpack);
  h->py_read = Py_NewRef(read);
  h->internal_files = Py_NewRef(files);
  h->first_user_line = Py_NewRef(first);
  h->burst_type = Py_NewRef(burst_type);
  h->parameter_type = Py_NewRef(parameter_type);
  h->backward_since_pack = 1;
  h->roots = new std::vector<WeakImpl>();
  return (PyObject*)h;
}

// Whether `obj` is a tensor C packs: a plain Tensor, or a Parameter with no attribute of the
// user's (Python says once that ctx.saved_tensors will not carry them: `_say_attributes`).
bool packs_in_c(HooksObject* h, PyObject* obj) {
  PyTypeObject* type = Py_TYPE(obj);
  if ((PyObject*)type == THPVariableClass) return true;
  if ((PyObject*)type != h->parameter_type) return false;
  PyObject* dict = PyObject_GenericGetDict(obj, nullptr);  // new reference (an empty dict made once)
  if (dict == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool plain = PyDict_Check(dict);
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (plain && PyDict_Next(dict, &pos, &key, &value)) {
    plain = PyUnicode_Check(key) && PyUnicode_GET_LENGTH(key) > 0 && PyUnicode_READ_CHAR(key, 0) == '_' &&
        PyUnicode_CompareWithASCIIString(key, "__fsdp_param__") != 0;
  }
  Py_DECREF(dict);
  return plain;
}

// The innermost frame outside torch, kvguard and wrapt, as kvguard._protect.frames decides:
// its code and last instruction into `s` (the line is read when a report asks), or its
// site from Python when a file is not classified yet. False: a Python error.
bool find_site(HooksObject* h, SavedObject* s) {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    PyObject* internal = PyDict_GetItemWithError(h->internal_files, code->co_filename);
    if (internal == nullptr) {
      Py_DECREF(code);
      if (PyErr_Occurred()) {
        Py_DECREF(frame);
        return false;
      }
      s->site = PyObject_CallOneArg(h->first_user_line, (PyObject*)frame);
      Py_DECREF(frame);
      return s->site != nullptr;
    }
    if (internal == Py_False) {
#if PY_VERSION_HEX >= 0x030B0000
      s->lasti = PyFrame_GetLasti(frame);
      if (s->lasti >= 0) {
        s->code = (PyObject*)code;
      } else {
        s->site = Py_BuildValue("(Oi)", code->co_filename, PyFrame_GetLineNumber(frame));
        Py_DECREF(code);
      }
#else
      s->site = Py_BuildValue("(Oi)", code->co_filename, PyFrame_GetLineNumber(frame));
      Py_DECREF(code);
#endif
      Py_DECREF(frame);
      return s->code != nullptr || s->site != nullptr;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  s->site = Py_NewRef(Py_None);
  return true;
}

// Cleared by the collector (its set died while autograd still called it): no Python hook to call.
PyObject* hooks_gone() {
  PyErr_SetString(PyExc_RuntimeError, "kvguard: the saved-tensor hooks of a guard_autograd that is gone were called");
  return nullptr;
}

// Whether a Saved may hold `t` itself rather than a detached alias: where `t` is not an output of
// the node saving it. An output's grad_fn is that node, so a Saved holding it would close a
// cycle through C++ (tensor -> node -> SavedVariable -> Saved -> tensor) that no collector sees;
// an input's grad_fn is an earlier node (autograd keeps inputs themselves when no hook is set).
// The node saving now is the newest on this thread: made just before its inputs are saved,
// and before its outputs, with no other node made in between where autograd's generated
// nodes (TraceableFunction) save. A custom Function's node (made before its forward, which
// may make nodes), a view, and a tensor from another thread's counter get the alias. Holding `t` spares
// the alias at pack, and at unpack a new Python tensor for it (autograd reads `t`'s own).
bool keeps_original(const at::Tensor& t) {
  // A view's grad_fn is remade when its base is written in place (rebase_history makes a
  // CopySlices after the node writing it): what grad_fn_unsafe reads may be stale.
  if (t.is_view()) return false;
  torch::autograd::Node* fn = torch::autograd::impl::grad_fn_unsafe(t);
  if (fn == nullptr) return true;  // a leaf (a parameter, an input), or a tensor that needs no grad
  if (dynamic_cast<torch::autograd::TraceableFunction*>(fn) == nullptr) return false;
  return fn->sequence_nr() + 1 < at::sequence_number::peek();
}

PyObject* hooks_pack(HooksObject* h, PyObject* obj) {
  if (h->py_pack == nullptr) return hooks_gone();
  if (!h->fast || !packs_in_c(h, obj)) return PyObject_CallOneArg(h->py_pack, obj);
  const at::Tensor& t = THPVariable_Unpack(obj);
  Described d;
  at::Tensor alias;
  int64_t version = 0;
  try {
    describe_tensor(t, d, false, 0);
    if (!d.plain || d.stop == 0 || d.inference) return PyObject_CallOneArg(h->py_pack, obj);
    version = (int64_t)t._version();
    alias = keeps_original(t) ? t : detached_alias(t);
  } catch (...) {
    return PyObject_CallOneArg(h->py_pack, obj);  // Python copes with what threw
  }
  SavedObject* s = (SavedObject*)saved_type()->tp_alloc(saved_type(), 0);
  if (s == nullptr) return nullptr;
  new (&s->tensor) at::Tensor(std::move(alias));
  new (&s->detached) at::Tensor();
  s->version = version;
  s->read_by = s->task = kNoInt;
  if (!find_site(h, s)) {
    Py_DECREF(s);
    return nullptr;
  }
  if (torch::autograd::get_current_graph_task_id() == -1) {  // saved outside backward: its pass counts it
    if (h->backward_since_pack || h->burst == nullptr) {
      PyObject* burst = PyObject_CallNoArgs(h->burst_type);
      if (burst == nullptr) {
        Py_DECREF(s);
        return nullptr;
      }
      h->backward_since_pack = 0;
      Py_XSETREF(h->burst, burst);
      ++h->bursts;
    }
    s->burst = Py_NewRef(h->burst);
  }
  ++h->packed;
  if (t.requires_grad()) {  // a start for the search of savers
    WeakImpl weak(t.getIntrusivePtr());
    if ((int)h->roots->size() < kRoots) {
      h->roots->push_back(std::move(weak));
    } else {
      (*h->roots)[(size_t)h->roots_next] = std::move(weak);
    }
    h->roots_next = (h->roots_next + 1) % kRoots;
  }
  s->row_start = d.start;
  s->hooks = (PyObject*)h;
  saved_row_add(d.start, d.stop, (PyObject*)s);
  return (PyObject*)s;
}

// A backward pass not counted lately: counted now (true).
bool hooks_count_task(HooksObject* h, int64_t task) {
  const int n = std::min(h->recent_count, kRecentTasks);
  for (int i = 0; i < n; ++i)
    if (h->recent[i] == task) return false;
  h->recent[h->recent_next] = task;
  h->recent_next = (h->recent_next + 1) % kRecentTasks;
  ++h->recent_count;
  ++h->tasks;
  return true;
}

PyObject* hooks_count_task_py(HooksObject* h, PyObject* arg) {
  const long long task = PyLong_AsLongLong(arg);
  if (task == -1 && PyErr_Occurred()) return nullptr;
  return PyBool_FromLong(hooks_count_task(h, task));
}

PyObject* g_read_name = nullptr;  // "read", interned

PyObject* hooks_unpack(HooksObject* h, PyObject* obj) {
  if (h->py_unpack == nullptr || h->py_read == nullptr) return hooks_gone();
  if (Py_TYPE(obj) != saved_type()) return PyObject_CallOneArg(h->py_unpack, obj);
  SavedObject* s = (SavedObject*)obj;
  try {
    if (!s->tensor.defined() || (int64_t)s->tensor._version() != s->version)
      return PyObject_CallOneArg(h->py_unpack, obj);  // its error, in PyTorch's words and kvguard's
  } catch (...) {
    return PyObject_CallOneArg(h->py_unpack, obj);
  }
  if (!h->fast) {
    PyObject* r = PyObject_CallOneArg(h->py_read, obj);
    if (r == nullptr) return nullptr;
    Py_DECREF(r);
    return THPVariable_Wrap(s->tensor);
  }
  // As SavedSet.read: its node may now use it as scratch; the first read counts its graph.
  auto node = torch::autograd::get_current_node();
  if (node) s->read_by = (int64_t)node->sequence_nr();
  const int task = torch::autograd::get_current_graph_task_id();
  if (task != -1 && s->task == kNoInt) {
    h->backward_since_pack = 1;
    s->task = task;
    hooks_count_task(h, task);
    if (s->burst != nullptr) {
      if (g_read_name == nullptr && (g_read_name = PyUnicode_InternFromString("read")) == nullptr) return nullptr;
      PyObject* read = PyObject_GetAttr(s->burst, g_read_name);
      if (read == nullptr) return nullptr;
      const int was = PyObject_IsTrue(read);
      Py_DECREF(read);
      if (was < 0) return nullptr;
      if (!was) {
        if (PyObject_SetAttr(s->burst, g_read_name, Py_True) < 0) return nullptr;
        ++h->bursts_read;
      }
    }
  }
  return THPVariable_Wrap(s->tensor);
}

// The Saveds this set's C pack made that Python has no entry for yet, alive; from now on it has.
PyObject* hooks_drain(HooksObject* h, PyObject*) {
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  std::vector<PyObject*> found;
  {
    std::lock_guard<std::mutex> lock(g_saved_mu);
    for (auto& [start, row] : *g_saved_rows) {
      SavedObject* s = (SavedObject*)row.saved;
      if (s->hooks == (PyObject*)h && !s->drained) found.push_back(row.saved);
    }
  }
  for (PyObject* s : found) {
    ((SavedObject*)s)->drained = true;
    if (PyList_Append(out, s) < 0) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

// How many Saveds of this set's C pack are alive, and how many of them Python has no entry for.
PyObject* hooks_alive(HooksObject* h, PyObject*) {
  long long alive = 0, undrained = 0;
  std::lock_guard<std::mutex> lock(g_saved_mu);
  for (auto& [start, row] : *g_saved_rows) {
    SavedObject* s = (SavedObject*)row.saved;
    if (s->hooks == (PyObject*)h) {
      ++alive;
      undrained += !s->drained;
    }
  }
  return Py_BuildValue("(LL)", alive, undrained);
}

PyObject* hooks_roots(HooksObject* h, PyObject*) {
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (const WeakImpl& weak : *h->roots) {
    auto strong = weak.lock();
    if (!strong) continue;
    PyObject* t = THPVariable_Wrap(at::Tensor(std::move(strong)));
    if (t == nullptr || PyList_Append(out, t) < 0) {
      Py_XDECREF(t);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(t);
  }
  return out;
}

// The set closed: its Saveds are no longer rows (autograd may keep them past the block).
PyObject* hooks_release(HooksObject* h, PyObject*) {
  h->fast = 0;
  hooks_release_rows(h);
  h->roots->clear();
  Py_RETURN_NONE;
}

PyMethodDef hooks_methods[] = {
    {"pack", (PyCFunction)hooks_pack, METH_O, "pack(tensor) -> Saved | what the Python pack returns"},
    {"unpack", (PyCFunction)hooks_unpack, METH_O, "unpack(saved) -> Tensor"},
    {"count_task", (PyCFunction)hooks_count_task_py, METH_O,
     "count_task(task: int) -> bool: a backward pass not counted among the last 64 is counted"},
    {"drain", (PyCFunction)hooks_drain, METH_NOARGS,
     "drain() -> list[Saved]: the live Saveds of C packs not drained before"},
    {"alive", (PyCFunction)hooks_alive, METH_NOARGS, "alive() -> (alive, not drained)"},
    {"roots", (PyCFunction)hooks_roots, METH_NOARGS, "roots() -> list[Tensor]: recently saved, requiring grad"},
    {"release", (PyCFunction)hooks_release, METH_NOARGS, "release() -> None: forget every row; packs go to Python"},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef hooks_members[] = {
    {"owner", T_OBJECT, offsetof(HooksObject, owner), READONLY, "the SavedSet"},
    {"fast", T_BOOL, offsetof(HooksObject, fast), 0, "whether packs are made in C"},
    {"backward_since_pack", T_BOOL, offsetof(HooksObject, backward_since_pack), 0, nullptr},
    {"burst", T_OBJECT, offsetof(HooksObject, burst), 0, "the forward stretch saving now"},
    {"bursts", T_LONGLONG, offsetof(HooksObject, bursts), 0, nullptr},
    {"bursts_read", T_LONGLONG, offsetof(HooksObject, bursts_read), 0, nullptr},
    {"tasks", T_LONGLONG, offsetof(HooksObject, tasks), 0, nullptr},
    {"packed", T_LONGLONG, offsetof(HooksObject, packed), READONLY, "tensors C packs protected"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject* hooks_type() {
  static PyTypeObject type = [] {
    PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
    t.tp_name = "kvguard._native.write_hook.SavedHooks";
    t.tp_basicsize = sizeof(HooksObject);
    t.tp_dealloc = (destructor)hooks_dealloc;
    t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
    t.tp_doc = "SavedHooks(owner, pack, unpack, read, internal_files, first_user_line, burst_type, "
               "parameter_type): autograd's pack and unpack hooks in C for a SavedSet (see write_hook.cpp).";
    t.tp_traverse = (traverseproc)hooks_traverse;
    t.tp_clear = (inquiry)hooks_clear;
    t.tp_methods = hooks_methods;
    t.tp_members = hooks_members;
    t.tp_new = hooks_new;
    return t;
  }();
  return &type;
}

PyMethodDef methods[] = {
    {"install", (PyCFunction)(void (*)(void))py_install, METH_VARARGS | METH_KEYWORDS,
     "install(undeclared=None, c10d_names=None) -> int\n\nHook every op overload registered "
     "now that writes an argument (idempotent); returns how many are hooked. Ops registered "
     "later are not hooked.\nBesides the schema's writes: `undeclared` maps 'ns::op' or "
     "'ns::op.overload' to (written param names, a bool param that must be true or None), "
     "and c10d's in-place collectives (`c10d::*_`) write their params named in `c10d_names`; "
     "None reads both from kvguard._torch.\nCall from one thread while no other thread runs "
     "torch ops: registration is not safe against concurrent dispatch."},
    {"uninstall", py_uninstall, METH_NOARGS,
     "uninstall() -> None\n\nRemove the hooks: the original kernels are back."},
    {"installed", py_installed, METH_NOARGS, "installed() -> bool"},
    {"hook_new", py_hook_new, METH_NOARGS,
     "hook_new() -> int\n\nHook the writing ops defined since install() or the last call (a "
     "torch.library.custom_op defined later); returns how many. Free while none was defined. "
     "Registers kernels: the same caveat as install()."},
    {"watch_inference", py_watch_inference, METH_O,
     "watch_inference(on: bool) -> bool\n\nThis thread guards an inference tensor (on) or one "
     "guard fewer does (off): writes inside torch.inference_mode() on this thread are judged "
     "while one does. Returns whether the inference-mode kernels are installed."},
    {"hooked_ops", py_hooked_ops, METH_NOARGS,
     "hooked_ops() -> list[str]\n\nNames of the hooked overloads, 'ns::name.overload'."},
    {"set_enabled", py_set_enabled, METH_O,
     "set_enabled(on: bool) -> None\n\nThe switch: off, a hooked op only calls its original."},
    {"enabled", py_enabled, METH_NOARGS, "enabled() -> bool"},
    {"set_send_all", py_set_send_all, METH_O,
     "set_send_all(on: bool) -> None\n\nCall the callback for every outermost write."},
    {"set_intervals", py_set_intervals, METH_O,
     "set_intervals(intervals: list[tuple[int, int]]) -> None\n\nThe protected byte ranges, "
     "[start, stop), sorted and disjoint."},
    {"set_identities", py_set_identities, METH_O,
     "set_identities(identities: list[int]) -> None\n\nProtected tensors by identity "
     "(`tensor._cdata`): a write to one is a candidate wherever its memory is."},
    {"set_callback", py_set_callback, METH_O,
     "set_callback(callback: Callable[[str, tuple[Tensor, ...]], Optional[Callable[..., "
     "object]]] | None) -> None\n\nCalled on a possible hit with the op's name and every "
     "tensor it writes; may return `after`, called as after() once the write is done or "
     "after(True) if the op raised."},
    {"set_watch", py_set_watch, METH_VARARGS,
     "set_watch(watch: Callable[[], object] | None, snapshots=None) -> None\n\nCalled with "
     "no arguments before every outermost write, while enabled; with `snapshots`, a list of "
     "(containers, held) pairs of tuples, only when kvguard._native.speedups.same_values(containers, "
     "held) is false for one of them."},
    {"add_protected", py_add_protected, METH_VARARGS,
     "add_protected(intervals: list[tuple[int, int]], identities: list[int], replace: bool = "
     "False) -> None\n\nProtect more (any order, any overlap): merged into the published "
     "intervals and identities, or published instead of them (`replace`)."},
    {"same_ids", py_same_ids, METH_VARARGS,
     "same_ids(objects: list, ids: tuple) -> bool\n\nWhether id(objects[i]) == ids[i] for every i, the "
     "lengths equal."},
    {"admit", py_admit, METH_VARARGS,
     "admit(table | None, intervals=(), identities=()) -> bool\n\nAn optimizer step starts (a Table of "
     "its parameters): their memory and identities leave what is published, except `intervals` and "
     "`identities` (what other guards protect), until admit(None), which puts back what was published "
     "before unless something was published since (then False: publish anew). One at a time."},
    {"describe", py_describe, METH_VARARGS,
     "describe(tensors: list, plain_types: tuple[type, ...], digest: bool) -> list\n\nPer "
     "tensor, None (Python must describe it) or a record (the type set_record_type was handed, "
     "fields RECORD_FIELDS): see kvguard/_native/csrc/describe.h."},
    {"set_record_type", py_set_record_type, METH_O,
     "set_record_type(record_type: type) -> None\n\nThe NamedTuple describe() and a Table build "
     "records as (kvguard._protect.records.Record); its _fields must be RECORD_FIELDS."},
    {"writes", py_writes, METH_NOARGS,
     "writes() -> int\n\nHow many outermost writing ops ran while enabled."},
    {"meets_saved", py_meets_saved, METH_O,
     "meets_saved(tensors) -> bool: whether a write to one of them may reach a tensor the C pack saved"},
    {"candidates", py_candidates, METH_O,
     "candidates(tensors) -> list[int]\n\nThe positions of the tensors a write into which the hook "
     "would hand to its callback now (none while it is off or has no callback)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "kvguard._native.write_hook",
    "A process-wide C++ hook on every writing op (the ADInplaceOrView key). Built by "
    "kvguard._native.build for this torch; see kvguard/_native/csrc/write_hook.cpp.",
    -1,
    methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_write_hook(void) {
  PyTypeObject* table = table_type();
  if (PyType_Ready(table) < 0 || PyType_Ready(saved_type()) < 0 || PyType_Ready(hooks_type()) < 0) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  PyObject* fields = record_fields();
  const bool added_fields = fields != nullptr && PyModule_AddObjectRef(module, "RECORD_FIELDS", fields) == 0;
  Py_XDECREF(fields);
  if (!added_fields || PyModule_AddObjectRef(module, "Table", (PyObject*)table) < 0 ||
      PyModule_AddObjectRef(module, "Saved", (PyObject*)saved_type()) < 0 ||
      PyModule_AddObjectRef(module, "SavedHooks", (PyObject*)hooks_type()) < 0 ||
      !add_row_flags(module)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
