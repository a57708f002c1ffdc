"""The native module, built by setuptools when the package is installed (``pip install .``, ``pip install -e .``,
``pip wheel .``): metadata lives in pyproject.toml, this file only declares ``corral._native``.

One module holds the mask core and the CPU kernels. It targets the ISA baseline (x86-64-v2 on x86: SSE4.2 and
POPCNT, every x86 server CPU since 2009); the kernels are compiled a second time for AVX2/FMA/F16C and the module
picks the variant from the CPU's features when it loads. Nothing is compiled at run time. The module uses
CPython's full C API (static types, vectorcall), so a wheel is built per Python version, not abi3.
"""

import os
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = ["module.cpp", "terms.cpp", "kernels.cpp", "kernels_baseline.cpp", "kernels_avx2.cpp"]
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
BASELINE = ["-march=x86-64-v2", "-mtune=generic"] if X86 else []
# Not -ffast-math: linking with it pulls in crtfastmath, whose constructor turns on flush-to-zero and
# denormals-are-zero for the whole process when the module loads (numpy, torch and every test after it would lose
# subnormal floats). -fassociative-math, asked for on its own, lets reductions end in a tree of vector adds.
FLAGS = ["-std=c++17", "-O3", "-g0", "-fopenmp", "-fvisibility=hidden", "-fno-math-errno", "-fno-trapping-math",
         "-fno-signed-zeros", "-fassociative-math", *BASELINE]
BUILD_INFO = f"{' '.join(BASELINE) or 'compiler default target'}; kernels: baseline{', avx2' if X86 else ''}"


class ParallelBuildExt(build_ext):
    """The sources compile side by side (one per core)."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1


setup(
    ext_modules=[Extension(
        "corral._native",
        sources=[f"corral/csrc/{name}" for name in SOURCES],
        depends=[f"corral/csrc/{name}" for name in ("common.h", "kernels.h", "kernels_impl.h")],
        language="c++",
        extra_compile_args=FLAGS,
        extra_link_args=["-fopenmp"],
        define_macros=[("CORRAL_BUILD_INFO", f'"{BUILD_INFO}"')],
    )],
    cmdclass={"build_ext": ParallelBuildExt},
)
