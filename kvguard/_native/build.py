"""Builds and loads the compiled write hook (`kvguard._native.write_hook`) for the installed torch.

The extension uses torch's unstable C++ API, so a binary fits one torch build, one CPython
and one platform: it is compiled on first use, from `csrc/write_hook.cpp` shipped with the
package, into a cache directory keyed on all of them, and reused by every later process.

Cache: `$KVGUARD_CACHE_DIR`, else `$XDG_CACHE_HOME/kvguard`, else `~/.cache/kvguard`; one
subdirectory per key. Several processes starting together (ranks) build once: the first
holds a lock on the directory while it compiles, the others wait and then load its result.
A failed build is remembered there (a `failed` file with the reason, the compiler's output
in `build.log`) so later processes do not retry on every start; `KVGUARD_REBUILD=1` forces
a fresh build.

`load()` never raises: without a compiler, on an old torch or on Windows it returns None
and `reason()` says why, and kvguard falls back to its Python engine.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Optional

from kvguard._config import read

MODULE_NAME = "kvguard._native.write_hook"
SOURCE = Path(__file__).parent / "csrc" / "write_hook.cpp"  # the translation unit
HEADERS = tuple(SOURCE.with_name(name) for name in ("describe.h", "python_api.h", "table.h"))  # it includes
# Bump when the compile command below changes, so caches built the old way are not reused.
# 2: the C++ standard is torch's own (C++20 for torch 2.12.1 to 2.15.0's wheels, C++17 for 2.9.1's and 2.11.0's), not always C++17.
_RECIPE = "2"
_COMPILE_TIMEOUT_S = 900.0

_lock = threading.Lock()
_loaded = False
_module: Optional[ModuleType] = None
_reason = "not loaded yet: call load()"


def cache_root() -> Path:
    """The cache directory: `KVGUARD_CACHE_DIR`, else `$XDG_CACHE_HOME/kvguard`, else `~/.cache/kvguard`."""
    explicit = read("KVGUARD_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "kvguard"
    return Path.home() / ".cache" / "kvguard"


def _python_tag() -> str:
    tag = ("cp" if sys.implementation.name == "cpython" else sys.implementation.name)
    tag += f"{sys.version_info.major}{sys.version_info.minor}"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        tag += "t"
    return tag


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "+-._" else "_" for c in text)


def build_dir() -> Path:
    """This torch + CPython + platform + source's directory in the cache (imports torch)."""
    import torch

    git = (getattr(torch.version, "git_version", None) or "unknown")[:12]
    sources = b"".join(path.read_bytes() + b"\0" for path in (SOURCE, *HEADERS))
    digest = hashlib.sha256(sources + b"recipe " + _RECIPE.encode()).hexdigest()[:12]
    parts = (f"torch{torch.__version__}", git, _python_tag(), sysconfig.get_platform(), digest)
    return cache_root() / _safe("-".join(parts))


def _so_name() -> str:
    return "write_hook" + importlib.machinery.EXTENSION_SUFFIXES[0]


def _find_compiler() -> tuple[Optional[list[str]], str]:
    """The compiler command (CXX may carry a launcher or flags, e.g. `ccache g++`), or why not."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        words = shlex.split(cxx)
        found = shutil.which(words[0]) if words else None
        if found is None:
            return None, f"no C++ compiler (CXX={cxx} was not found; set CXX to a C++ compiler)"
        return [found, *words[1:]], ""
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found is not None:
            return [found], ""
    return None, "no C++ compiler (set CXX)"


def _unsupported() -> Optional[str]:
    """Why this platform or torch cannot have the hook, or None (imports torch)."""
    if sys.platform == "win32" or os.name != "posix":
        return f"not supported on {sys.platform}"
    if sys.implementation.name != "cpython":
        return f"not supported on {sys.implementation.name}"
    import torch

    if not hasattr(torch.library, "get_kernel"):
        return f"torch {torch.__version__} lacks the computed-kernel API (needs torch >= 2.9)"
    for path in (SOURCE, *HEADERS):
        if not path.is_file():
            return f"the source {path} is missing from the installed package"
    return None


def cxx_standard() -> str:
    """The C++ standard torch itself was compiled as (`c++20`, `c++17`), which its headers are written for.

    torch 2.14's headers need C++20 (`std::strong_ordering`, `string_view::starts_with`);
    older ones compile as C++17 or C++20. `torch.__config__.show()` names the standard of
    torch's own build (`C++ Version: 202002`, the compiler's `__cplusplus`); C++17 where it
    does not say (imports torch).
    """
    import torch

    try:
        shown = torch.__config__.show()
    except Exception:  # noqa: BLE001 - a build without it compiles as the oldest torch did
        shown = ""
    match = re.search(r"C\+\+ Version: (\d{4})\d\d", shown)
    year = int(match[1]) if match else 2017
    return f"c++{max(year, 2017) % 100:02d}"


def _compile_command(compiler: list[str], output: Path, standard: str) -> list[str]:
    import torch

    from kvguard._torch import dispatch as _dispatch  # imports torch, as this function does

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    # torch.utils.cpp_extension.include_paths() for a CPU extension, without importing that
    # module: on a CUDA build with no CUDA runtime its import logs "No CUDA runtime is found".
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    includes = [torch_include, os.path.join(torch_include, "torch", "csrc", "api", "include"),
                sysconfig.get_paths()["include"]]
    return [
        *compiler, "-O2", f"-std={standard}", "-fPIC", "-shared",
        f"-D_GLIBCXX_USE_CXX11_ABI={_dispatch.cxx11_abi()}",
        "-DTORCH_EXTENSION_NAME=write_hook",
        *(f"-I{p}" for p in includes),
        str(SOURCE), "-o", str(output),
        f"-L{lib_dir}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
        f"-Wl,-rpath,{lib_dir}",
    ]


def _write_text(path: Path, text: str) -> None:
    """Writes atomically, so a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        _unlink(Path(tmp))
        raise


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _run(command: list[str]) -> tuple[bool, str, str]:
    """Runs the compiler: ok, its output, and (when not ok) why, before the log's path."""
    try:
        proc = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=_COMPILE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else ""
        return False, output, f"the compiler timed out after {_COMPILE_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return False, str(exc), f"the compiler could not run ({exc})"
    output = proc.stdout.decode("utf-8", "replace")
    if proc.returncode == 0:
        return True, output, ""
    first = first_error(output)
    return False, output, f"the compiler failed: {first}" if first else "the compiler failed"


def first_error(output: str) -> str:
    """The compiler's first error, on one line and short, with torch's include directory cut off."""
    for line in output.splitlines():
        if re.search(r"\berror\b", line, re.IGNORECASE):
            line = re.sub(r"\S*/include/(?=\S)", "", line.strip())  # .../torch/include/c10/... -> c10/...
            return line if len(line) <= 200 else line[:199] + "…"
    return ""


def _rejects_standard(output: str, standard: str) -> bool:
    """Whether the compiler refused the `-std=` option itself (too old for it), not the code."""
    return f"-std={standard}" in output and re.search(r"unrecognized|invalid value|unknown|not supported",
                                                       output, re.IGNORECASE) is not None


def _compile(directory: Path, compiler: list[str], *, verbose: bool) -> tuple[bool, str]:
    """Compiles into `directory` (the caller holds its lock). Returns ok and where, or why not."""
    so_path = directory / _so_name()
    log = directory / "build.log"
    failed = directory / "failed"
    import torch

    print(f"kvguard: building the compiled write hook for torch {torch.__version__} "
          f"(once per torch version; compiling takes about 45 s, 40 s of CPU) into {directory}",
          file=sys.stderr, flush=True)
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix="write_hook.", suffix=".tmp.so")
    os.close(fd)
    tmp = Path(tmp_name)
    standard = cxx_standard()
    command = _compile_command(compiler, tmp, standard)
    try:
        started, cpu_before = time.monotonic(), _children_cpu()
        ok, output, why = _run(command)
        transcript = shlex.join(command) + "\n\n" + output
        note = ""
        if not ok and standard != "c++17" and _rejects_standard(output, standard):
            # A compiler older than torch's standard: torch <= 2.13's headers still compile as
            # C++17 (2.14's do not, and then the failure names what is missing).
            note = (f" (torch {torch.__version__} was built as {standard.upper()}, which this compiler "
                    f"does not support: {shlex.join(compiler)})")
            command = _compile_command(compiler, tmp, "c++17")
            ok, output, why = _run(command)
            transcript += "\n\n" + shlex.join(command) + "\n\n" + output
        if verbose and output:
            print(output, file=sys.stderr)
        if ok:  # a wait of a minute says when it is over; a failure is said by the caller
            print(f"kvguard: built the compiled write hook in {time.monotonic() - started:.1f} s "
                  f"({_children_cpu() - cpu_before:.1f} s of CPU)", file=sys.stderr, flush=True)
        if not ok:
            why = f"{why}{note}; the whole output is in {log}"
            _write_text(log, transcript)
            _write_text(failed, why)
            return False, why
        os.chmod(tmp, 0o755)  # mkstemp made it private; other users may share the cache
        os.replace(tmp, so_path)
        _unlink(failed)
        _unlink(log)
        return True, str(so_path)
    finally:
        _unlink(tmp)


def _children_cpu() -> float:
    """CPU seconds (user and system) of this process's finished children: the compiler's cost."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _ensure_built(*, force: bool, verbose: bool) -> tuple[bool, str]:
    """Builds unless a usable result is already cached. Returns ok and the `.so` path, or why not."""
    import fcntl

    directory = build_dir()
    so_path = directory / _so_name()
    failed = directory / "failed"
    if not force:
        if so_path.is_file():
            return True, str(so_path)
        if failed.is_file():
            return False, failed.read_text(encoding="utf-8").strip() + " (KVGUARD_REBUILD=1 retries)"
    # A missing compiler is not remembered as a failure: looking for one is cheap, and
    # installing one later should just work.
    compiler, why = _find_compiler()
    if compiler is None:
        return False, why
    started = time.time()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / "lock", "a+b")
    except OSError as exc:
        return False, f"cannot write the cache directory {directory} ({exc}); set KVGUARD_CACHE_DIR"
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        # Another process may have finished while this one waited for the lock.
        if so_path.is_file() and (not force or so_path.stat().st_mtime >= started):
            return True, str(so_path)
        if failed.is_file() and (not force or failed.stat().st_mtime >= started):
            return False, failed.read_text(encoding="utf-8").strip()
        return _compile(directory, compiler, verbose=verbose)


def _import(so_path: str) -> ModuleType:
    existing = sys.modules.get(MODULE_NAME)
    if existing is not None:
        return existing
    spec = importlib.util.spec_from_file_location(MODULE_NAME, so_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {so_path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[MODULE_NAME] = module
    return module


def load() -> Optional[ModuleType]:
    """The `kvguard._native.write_hook` module, built first if needed; None if it cannot be had.

    Never raises. The result (module or None) is cached in the process; `reason()` says why
    it is None.
    """
    global _loaded, _module, _reason
    with _lock:
        if _loaded:
            return _module
        try:
            why = _unsupported()
            if why is not None:
                _reason = why
            else:
                force = rebuild_requested()
                ok, where = _ensure_built(force=force, verbose=False)
                if ok:
                    try:
                        _module = _import(where)
                        _reason = f"loaded from {where}"
                    except Exception as exc:  # noqa: BLE001 - a broken cache entry must not stop the user
                        _reason = f"the built extension {where} failed to load ({exc}); KVGUARD_REBUILD=1 rebuilds it"
                else:
                    _reason = where
        except Exception as exc:  # noqa: BLE001 - never raise from here
            _reason = f"the build failed unexpectedly: {type(exc).__name__}: {exc}"
        _loaded = True
        return _module


def rebuild_requested() -> bool:
    """Whether `KVGUARD_REBUILD` asks for a fresh build (set, and not 0)."""
    return read("KVGUARD_REBUILD") not in ("", "0")


def reason() -> str:
    """Why `load()` returned None (or where the module was loaded from)."""
    return _reason


def build(verbose: bool = False, force: bool = True) -> tuple[bool, str]:
    """Builds the extension now (`force`: even if a build is cached or failed before).

    For `python -m kvguard build`. Returns (True, path of the `.so`) or (False, why not).
    Does not load the module: `check_loads` does.
    """
    try:
        why = _unsupported()
        if why is not None:
            return False, why
        return _ensure_built(force=force, verbose=verbose)
    except Exception as exc:  # noqa: BLE001
        return False, f"the build failed unexpectedly: {type(exc).__name__}: {exc}"


def check_loads(so_path: str) -> Optional[str]:
    """None when the built `.so` at `so_path` imports, else why not (a broken cache entry)."""
    try:
        _import(so_path)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None
