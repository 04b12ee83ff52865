"""Ships `kvguard.pth` and `kvguard.start` at the root of the wheel (site-packages), and
builds the optional `kvguard._native.speedups` extension."""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


def startup_files() -> tuple[tuple[str, str], ...]:
    """(name, text) of the `.pth` and `.start` files, read from kvguard/_activate/pth.py without importing kvguard."""
    spec = importlib.util.spec_from_file_location("_kvguard_pth", os.path.join("kvguard", "_activate", "pth.py"))
    pth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pth)
    return (pth.PTH_NAME, pth.PTH_LINE), (pth.START_NAME, pth.START_LINE)


class build_py_with_startup_files(build_py):
    def run(self) -> None:
        super().run()
        for name, text in startup_files():
            with open(os.path.join(self.build_lib, name), "w", encoding="utf-8") as fh:
                fh.write(text)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        names = ("kvguard.pth", "kvguard.start")
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, n) for n in names]


cmdclass = {"build_py": build_py_with_startup_files}
try:  # editable installs (pip install -e) get the same files, so KVGUARD works there too
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # pragma: no cover - setuptools without PEP 660
    editable_wheel = None


class _AddStartupFiles:
    """Wraps setuptools' editable strategy to write the startup files at the wheel's root."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        result = self.strategy(wheel, files, mapping)
        for name, text in startup_files():
            wheel.writestr(name, text)
        return result

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):
    class editable_wheel_with_startup_files(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _AddStartupFiles(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = editable_wheel_with_startup_files

setup(
    cmdclass=cmdclass,
    # Optional: without a compiler the package installs and uses the same check in Python.
    ext_modules=[Extension("kvguard._native.speedups", ["kvguard/_native/csrc/speedups.c"], optional=True),
                 Extension("kvguard._native.stores", ["kvguard/_native/csrc/stores.c"], optional=True),
                 Extension("kvguard._native.digest", ["kvguard/_native/csrc/digest.c"], optional=True,
                           extra_compile_args=["-O3"])],
)
