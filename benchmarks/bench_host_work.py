"""Host work per event: the µs kvguard adds per dispatched op, per saved tensor and per optimizer parameter.

On a GPU a small kernel finishes in a few µs, so every µs of host work per op shows in a
launch-bound step; the real-model benchmark (`bench_real_models.py`) gives ratios that hide
it behind slow CPU kernels. This one isolates each event, in one process, with each target
on and off, as µs per event:

    inplace     a loop of `x.add_(1.0)` on a 16-float tensor nobody protects: what every writing
                op pays with the write hook installed and no guard (`idle`: the sampled tier's
                unchecked intervals), and with each kind's guard active (`autograd`, `weights`,
                `data`, `all`), against torch as it ships (`off`: no hook installed)
    saved       a chain of `y = y.sin()` on a leaf that requires grad, then backward (each sin
                saves its input: pack, unpack and release per saved tensor): `autograd` and `all`
                against an empty pair of Python `saved_tensors_hooks` (`py hooks`: autograd's own
                price for any hook on that API), an empty pair of C functions (`c hooks`: the
                same API with no Python frame, the floor of anything that uses it), both with
                the write hook installed as kvguard's run, and `off`
    step        one optimizer step over many small parameters (`torch.optim` as the trainer calls
                it: SGD for-loop, AdamW for-loop, foreach and fused): `weights` and `all` against
                `idle` and `off`, per parameter

Each contender's guards are entered as `KVGUARD_TARGETS` enters them (once, then many events:
`AutogradGuard`, `ModuleGuard` with the optimizer, `DataGuard` after a dataset returned a
sample), around a run of events; entering and leaving are not timed. Every contender of every
round runs in a child forked from one process that imported torch and built the workloads
(so `off` is torch as it ships: no hook was ever installed there). Rounds are interleaved
(the order rotating); a run's time is CPU time with the collector off, a round's figure the
median of 3 runs after four untimed ones, a cell the median over rounds; µs per event is
(contender − off) / events, per round, median over rounds (and beside it, less `idle`: the
write hook installed with no guard, which every other kvguard contender has too).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_host_work.py              # ~4 min
    PYTHONPATH=. .venv/bin/python benchmarks/bench_host_work.py --quick      # smoke, ~10 s
    PYTHONPATH=. .venv/bin/python benchmarks/bench_host_work.py --only saved --rounds 31

Targets (issue 38): per saved tensor ≤ 2 µs added, per in-place op on an unprotected tensor
≤ 1 µs, per optimizer parameter in a step ≤ 1 µs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

TARGETS = {"inplace": 1.0, "saved": 2.0, "step": 1.0}  # µs per event, issue 38

# ── contenders ──────────────────────────────────────────────────────────────────────────────


def _hook(name: str | None) -> None:
    """Leave exactly the write hook `name` installed (None: torch as it ships); untimed."""
    from kvguard._engine import choice as _choice

    before = set(_choice._hook_engines)
    _choice.install_only(name)  # installs it (once per process in a real job)
    if set(_choice._hook_engines) != before:
        gc.collect()


class Dataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """What the data guard protects: a few samples returned before the timed events."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((16,), float(i)), "y": torch.tensor(i)}


@contextlib.contextmanager
def kinds(words: tuple[str, ...], model: torch.nn.Module | None, optimizer: Any) -> Iterator[list[Any]]:
    """The process-wide kinds' guards, entered as `KVGUARD_TARGETS=words` enters them."""
    from kvguard._guard.autograd import AutogradGuard
    from kvguard._guard.data import DataGuard
    from kvguard._guard.module import ModuleGuard

    with contextlib.ExitStack() as stack, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a guard that protected nothing says so at exit
        guards: list[Any] = []
        if "weights" in words and model is not None:
            guard = ModuleGuard([], (), name="weights", action="raise", target="weights")
            guards.append(stack.enter_context(guard))
            guard.add_optimizer(optimizer, [("model", model)], []) if optimizer is not None else \
                guard.add_modules([("model", model)])
        if "data" in words:
            guards.append(stack.enter_context(DataGuard(action="raise", target="data")))
            samples = [Dataset()[i] for i in range(4)]  # protected from the next look on
            guards[-1]._keep = samples
        if "autograd" in words:
            guards.append(stack.enter_context(AutogradGuard(action="raise", target="autograd")))
        yield guards


_C_IDENTITY = r"""
#include <Python.h>
static PyObject* identity(PyObject* self, PyObject* arg) { Py_INCREF(arg); return arg; }
static PyMethodDef methods[] = {{"identity", identity, METH_O, "the argument"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvguard_bench_identity", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kvguard_bench_identity(void) { return PyModule_Create(&module); }
"""


def c_identity() -> Callable[[Any], Any] | None:
    """A METH_O identity in C (built once into a temporary directory): an empty saved-tensor hook with
    no Python frame. None without a C compiler."""
    where = os.path.join(tempfile.gettempdir(), f"kvguard-bench-identity-{sys.implementation.cache_tag}")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = os.path.join(where, "kvguard_bench_identity" + suffix)
    if not os.path.exists(target):
        os.makedirs(where, exist_ok=True)
        source = os.path.join(where, "identity.c")
        with open(source, "w") as f:
            f.write(_C_IDENTITY)
        cc = os.environ.get("CC", "cc")
        cmd = [cc, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", source, "-o", target]
        if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
            return None
    sys.path.insert(0, where)
    try:
        import kvguard_bench_identity  # type: ignore[import-not-found]
    except ImportError:
        return None
    finally:
        sys.path.remove(where)
    return kvguard_bench_identity.identity  # type: ignore[no-any-return]


def _py_identity(t: Any) -> Any:
    return t


# ── workloads ───────────────────────────────────────────────────────────────────────────────


def small_model() -> tuple[torch.nn.Module, Any]:
    """What the weights guard protects in the op and saved rows: a 2-layer MLP and its AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def inplace_run(n: int) -> Callable[[], float]:
    x = torch.zeros(16)

    def run() -> float:
        add_ = x.add_
        t0 = time.process_time()
        for _ in range(n):
            add_(1.0)
        return time.process_time() - t0
    return run


def saved_run(k: int, chains: int = 1) -> tuple[Callable[[], float], int]:
    """`chains` chains of `k` sins, each with its backward, per run; (run, tensors saved per run)."""
    w = torch.randn(16, requires_grad=True)

    def run() -> float:
        t0 = time.process_time()
        for _ in range(chains):
            y = w
            for _ in range(k):
                y = y.sin()
            y.sum().backward()
            w.grad = None
        return time.process_time() - t0
    count = [0]

    def pack(t: Any) -> Any:
        count[0] += 1
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, _py_identity):
        run()
    return run, count[0]


def c_work(rounds: int, n: int = 20_000) -> Optional[float]:
    """µs per saved tensor of kvguard's C pack, unpack and release called directly, less the same
    calls of a C identity: what `guard_autograd` would add per saved tensor if autograd called a
    C++ default hook (it calls Python objects, under the GIL, for any default hook: the `c hooks`
    row is that price). Measured in a forked child (the hook installed there only); None without
    a C compiler."""
    identity = c_identity()
    if identity is None:
        return None

    def enter() -> Any:
        return _with_hook("compiled", lambda: kinds(("autograd",), None, None))

    t = torch.randn(16, requires_grad=True) * 1  # an intermediate, as most saved tensors are

    def run() -> float:
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)  # the guard's C pair
        times = []
        for fns in ((identity, identity), (pack, unpack)):
            p, u = fns
            t0 = time.process_time()
            for _ in range(n):
                saved = p(t)
                u(saved)
                del saved
            times.append(time.process_time() - t0)
        return times[1] - times[0]

    per = [_forked(enter, run) / n * 1e6 for _ in range(rounds)]
    return statistics.median(per)


def step_model(params: int, impl: str) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(64)) for _ in range(params)])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    if impl == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=False)
    elif impl == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    elif impl == "foreach":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    opt.step()  # its state made: every later step is alike
    return model, opt


def step_run(opt: Any, steps: int) -> Callable[[], float]:
    def run() -> float:
        t0 = time.process_time()
        for _ in range(steps):
            opt.step()
        return time.process_time() - t0
    return run


# ── measurement ─────────────────────────────────────────────────────────────────────────────

REPEATS = 3  # timed runs per entry; their median is the round's figure
WARM = 3  # untimed runs before them
KIND_WORDS = {"autograd": ("autograd",), "weights": ("weights",), "data": ("data",),
              "all": ("autograd", "weights", "data")}


def measure(rows: dict[str, tuple[Callable[[], float], int, dict[str, Callable[[], Any]]]],
            rounds: int) -> dict[str, dict[str, list[float]]]:
    """{row: {contender: [seconds per event, per round]}}.

    Each (round, row, contender) runs in a process forked from this one, which imported torch and
    built the workloads but never installed a write hook: a hook installed and removed again in
    one process leaves torch's dispatcher about 10 % slower on autograd's backward here (measured:
    the saved row's `off` read 0.8 µs above `idle`), so `off` must be a process that never had
    one, and the others start from the same state. In the child the contender is entered (its hook
    installed, its guards entered), one untimed run warms it up, the collector runs and is turned
    off, `WARM` more untimed runs follow (the first runs after a collection pay for the memory it
    freed, and a forked child's first writes to its heap copy the pages it shares with this
    process), then `REPEATS` timed runs, whose median is the round's figure.
    """
    out: dict[str, dict[str, list[float]]] = {row: {c: [] for c in enter} for row, (_, _, enter) in rows.items()}
    for r in range(rounds + 1):  # round 0: warm-up, discarded
        for row, (run, events, enter) in rows.items():
            names = list(enter)
            shift = r % len(names)
            for contender in names[shift:] + names[:shift]:
                seconds = _forked(enter[contender], run)
                if r:
                    out[row][contender].append(seconds / events)
    return out


def _forked(enter: Callable[[], Any], run: Callable[[], float]) -> float:
    """The median of `REPEATS` timed runs under `enter()`, in a forked child."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            with enter():
                run()  # untimed: the guard's first look, the hook's first calls
                gc.collect()
                gc.disable()
                for _ in range(WARM):  # untimed: the first runs after a collection pay for the memory it
                    run()  # freed, and a forked child's first writes to its heap's pages copy them

                seconds = statistics.median(run() for _ in range(REPEATS))
                gc.enable()
            os.write(write, repr(seconds).encode())
            code = 0
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not text:
        raise RuntimeError("a contender's run failed (see its traceback above)")
    return float(text)


@contextlib.contextmanager
def _with_hook(name: str | None, inner: Callable[[], Any] = contextlib.nullcontext) -> Iterator[None]:
    _hook(name)
    with inner():
        yield


def contenders(model: torch.nn.Module | None, optimizer: Any, words: list[str],
               extra: dict[str, Callable[[], Any]] | None = None) -> dict[str, Callable[[], Any]]:
    enter: dict[str, Callable[[], Any]] = {"off": lambda: _with_hook(None), "idle": lambda: _with_hook("compiled")}
    enter.update(extra or {})
    for word in words:
        enter[word] = (lambda w=word: _with_hook("compiled", lambda: kinds(KIND_WORDS[w], model, optimizer)))
    return enter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="fewer events and rounds: a smoke run")
    parser.add_argument("--only", default="inplace,saved,step", help="comma-separated of: inplace, saved, step")
    parser.add_argument("--impls", default="sgd,adamw,foreach,fused", help="the step rows' optimizers")
    parser.add_argument("--params", type=int, default=200, help="parameter tensors in the step rows")
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 3 if args.quick else args.rounds
    only = set(args.only.split(","))
    scale = 10 if args.quick else 1
    rows: dict[str, tuple[Callable[[], float], int, dict[str, Callable[[], Any]]]] = {}
    model, opt = small_model()
    if "inplace" in only:
        n = 20_000 // scale
        rows["in-place op, unprotected tensor"] = (
            inplace_run(n), n, contenders(model, opt, ["autograd", "weights", "data", "all"]))
    if "saved" in only:
        run, saved = saved_run(40 if args.quick else 400, 1 if args.quick else 5)
        # The empty pairs run with the write hook installed (idle), as kvguard's do: their figure
        # less idle's is autograd's price for a default hook, kvguard's less theirs its own.
        hooks = {"py hooks": lambda: _with_hook("compiled", lambda: torch.autograd.graph.saved_tensors_hooks(
            _py_identity, _py_identity))}
        identity = c_identity()
        if identity is not None:
            hooks["c hooks"] = lambda: _with_hook("compiled", lambda: torch.autograd.graph.saved_tensors_hooks(
                identity, identity))
        rows["saved tensor (sin chain + backward)"] = (run, saved, contenders(model, opt, ["autograd", "all"], hooks))
    if "step" in only:
        steps = 2 if args.quick else 10
        for impl in args.impls.split(","):
            step_m, step_opt = step_model(args.params // (4 if args.quick else 1), impl)
            n_params = sum(1 for _ in step_m.parameters())
            rows[f"optimizer parameter, {impl} step"] = (
                step_run(step_opt, steps), steps * n_params, contenders(step_m, step_opt, ["weights", "all"]))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    wall = time.time()
    figures = measure(rows, rounds)
    c_only = c_work(rounds) if "saved" in only else None
    _hook(None)
    print(f"\n{rounds} rounds, CPU time, collector off during a run, torch {torch.__version__}, one thread; load "
          f"average {load} → {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.time() - wall:.0f} s\n")
    print("| event | contender | µs per event | µs added (vs off) | vs idle | target | met |")
    print("|---|---|---|---|---|---|---|")
    raw: dict[str, Any] = {}
    for row, per in figures.items():
        off, idle = per["off"], per["idle"]
        target = TARGETS["inplace" if row.startswith("in-place") else "saved" if row.startswith("saved") else "step"]
        for contender, times in per.items():
            median = statistics.median(times) * 1e6
            extra = statistics.median(t - o for t, o in zip(times, off)) * 1e6
            beyond = statistics.median(t - i for t, i in zip(times, idle)) * 1e6
            kvguard_row = contender in ("idle", *KIND_WORDS)
            met = ("yes" if extra <= target else "no") if kvguard_row else ""
            shown = "—" if contender == "off" else f"{extra:+.2f}"
            shown_idle = "—" if contender in ("off", "idle") else f"{beyond:+.2f}"
            print(f"| {row} | {contender} | {median:.2f} | {shown} | {shown_idle} | "
                  f"{'≤ ' + str(target) if kvguard_row else ''} | {met} |")
            raw.setdefault(row, {})[contender] = {"us": median, "added_us": extra, "beyond_idle_us": beyond,
                                                  "rounds": times}
    if c_only is not None:
        print(f"\nkvguard's C pack + unpack + release called directly, less a C identity's calls: {c_only:+.2f} µs "
              "per saved tensor (what guard_autograd would add if autograd called C++ default hooks; the `c hooks` "
              "row is what autograd charges for calling any default hook through Python)")
        raw["c work per saved tensor"] = c_only
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
