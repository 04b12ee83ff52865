"""Ships `kvguard.pth` and `kvguard.start` at the root of the wheel (site-packages), and
builds the optional `kvguard._speedups` extension."""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class build_py_with_startup_files(build_py):
    def run(self) -> None:
        super().run()
        # Read the file contents from kvguard/_pth.py without importing the package.
        spec = importlib.util.spec_from_file_location("_kvguard_pth", os.path.join("kvguard", "_pth.py"))
        pth = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pth)
        for name, text in ((pth.PTH_NAME, pth.PTH_LINE), (pth.START_NAME, pth.START_LINE)):
            with open(os.path.join(self.build_lib, name), "w", encoding="utf-8") as fh:
                fh.write(text)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        names = ("kvguard.pth", "kvguard.start")
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, n) for n in names]


setup(
    cmdclass={"build_py": build_py_with_startup_files},
    # Optional: without a compiler the package installs and uses the same check in Python.
    ext_modules=[Extension("kvguard._speedups", ["kvguard/_speedups.c"], optional=True)],
)
