"""Builds oxccl's C++ torch backend (``oxccl/csrc/backend.cpp``, with the inference ops of
``oxccl/csrc/inference.cpp``) into
``oxccl/_torch_backend*.so`` next to this file, with torch's own extension tooling
(``torch.utils.cpp_extension``; ninja is used when installed, else plain setuptools).

    python -m oxccl.build_torch_ext            # after `pip install ./python` (or maturin develop)

Without it, ``import oxccl.torch`` warns once and uses the Python backend (slower per call).
Rebuild after upgrading torch or oxccl: the backend checks the library's API version.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "_torch_backend"


def target() -> str:
    """Where the built module goes."""
    return os.path.join(HERE, NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def build(verbose: bool = False) -> str:
    """Compiles the extension and returns its path."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension, is_ninja_available

    csrc = os.path.join(HERE, "csrc")
    ext = CppExtension(
        name=f"oxccl.{NAME}",
        sources=[os.path.join(csrc, "backend.cpp"), os.path.join(csrc, "inference.cpp")],
        include_dirs=[csrc],
        extra_compile_args=["-O2", "-g0", "-fvisibility=hidden"],
    )
    with tempfile.TemporaryDirectory(prefix="oxccl-torch-ext-") as tmp:
        lib = os.path.join(tmp, "lib")
        setup(
            name="oxccl-torch-backend",
            ext_modules=[ext],
            cmdclass={"build_ext": BuildExtension.with_options(use_ninja=is_ninja_available())},
            script_args=["-q" if not verbose else "-v", "build_ext", "--build-lib", lib, "--build-temp", tmp],
        )
        built = os.path.join(lib, "oxccl", os.path.basename(target()))
        shutil.move(built, target())
    return target()


if __name__ == "__main__":
    print(build(verbose="-v" in sys.argv[1:]))
