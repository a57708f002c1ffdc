"""The native module, built by setuptools when the package is installed (``pip install .``, ``pip install -e .``,
``pip wheel .``): metadata lives in pyproject.toml, this file only declares the extension.

One module holds the mask core and the CPU kernels, built twice on x86: ``corral._native`` for x86-64-v3 (AVX2,
FMA, BMI2: what the development machines and nearly every server since 2015 have) and ``corral._native_baseline``
for x86-64-v2 (SSE4.2, POPCNT). ``corral/native.py`` imports the one this CPU runs, by its flags: a v2-only build
was about 7% slower on MaskBench's masks than a host-tuned one, and the v3 build measured level with that. Inside each, the kernels pick
their instruction-set variant when the module loads. Nothing is compiled at run time. The bindings are nanobind's,
compiled into each build from nanobind's sources; the mask core reads Python ints through CPython's full C API, so a
wheel is built per Python version, not abi3.
"""

import os
import platform
from concurrent.futures import ThreadPoolExecutor

import nanobind
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = ["module.cpp", "terms.cpp", "kernels.cpp", "kernels_baseline.cpp", "kernels_avx2.cpp", "kernels_avx512.cpp",
           "qmatmul.cpp", "qmatmul_scalar.cpp", "qmatmul_avx2.cpp", "qmatmul_avx512.cpp", "qmatmul_amx.cpp",
           "decode_step.cpp", "cfg.cpp", "ngram.cpp"]
X86 = platform.machine().lower() in ("x86_64", "amd64")
# Not -ffast-math: linking with it pulls in crtfastmath, whose constructor turns on flush-to-zero and
# denormals-are-zero for the whole process when the module loads (numpy, torch and every test after it would lose
# subnormal floats). -fassociative-math, asked for on its own, lets reductions end in a tree of vector adds.
FLAGS = ["-std=c++17", "-O3", "-g0", "-fno-wrapv", "-fopenmp", "-fvisibility=hidden", "-fno-math-errno",
         "-fno-trapping-math",
         "-fno-signed-zeros", "-fassociative-math"]
# nanobind, the binding library, is compiled into each build from its own sources (nb_combined.cpp, the way its
# documentation describes builds without CMake), with the flags it asks for: NB_BUILD, no strict aliasing.
NB_SOURCE = os.path.join(nanobind.source_dir(), "nb_combined.cpp")
NB_INCLUDES = [nanobind.include_dir(), os.path.join(nanobind.source_dir(), os.pardir, "ext", "robin_map", "include")]
NB_FLAGS = ["-DNB_BUILD", "-fno-strict-aliasing", "-ffunction-sections", "-fdata-sections"]
# (module name, target flags): the first is the one a CPU with its features imports
BUILDS = ([("_native", ["-march=x86-64-v3", "-mtune=generic"]),
           ("_native_baseline", ["-march=x86-64-v2", "-mtune=generic"])] if X86 else [("_native", [])])


def build_jobs() -> int:
    """Compilers run at once: ``CORRAL_BUILD_JOBS``, else one per core this process may use."""
    asked = os.environ.get("CORRAL_BUILD_JOBS", "")
    if asked:
        if not asked.isdigit() or int(asked) < 1:
            raise SystemExit(f"CORRAL_BUILD_JOBS must be a positive integer, got {asked!r}")
        return int(asked)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class BuildExt(build_ext):
    """Each build compiles its objects in a folder of its own: the two builds share their sources, and one
    folder would hand the second build the first one's objects (compiled for the other target). nanobind's
    library is compiled there too, for the build's target, and linked in. The builds go one after the other
    (setuptools' ``--parallel`` would run them on threads that share ``build_temp``), and each build's sources
    compile in parallel, one compiler per core: the install's native build took about 2 minutes on one core
    of a 2-core machine."""

    def build_extensions(self):
        self.parallel = None
        super().build_extensions()

    def build_extension(self, ext):
        shared, serial = self.build_temp, self.compiler.compile
        self.build_temp = os.path.join(shared, ext.name)
        with ThreadPoolExecutor(build_jobs()) as pool:
            binding = pool.submit(serial, [NB_SOURCE], output_dir=self.build_temp, macros=ext.define_macros,
                                  include_dirs=NB_INCLUDES, extra_postargs=[*ext.extra_compile_args, *NB_FLAGS])

            def compile_each(sources, *args, **kwargs):  # the compiler's own call, a job per source, in order
                done = [pool.submit(serial, [source], *args, **kwargs) for source in sources]
                objects = [obj for job in done for obj in job.result()]
                ext.extra_objects = binding.result()  # linked in after the module's own objects
                return objects

            self.compiler.compile = compile_each
            try:
                super().build_extension(ext)
            finally:
                self.build_temp, self.compiler.compile = shared, serial


def extension(name: str, target: list[str]) -> Extension:
    kernels = "baseline, avx2, avx512, amx" if X86 else "baseline"
    info = f"{' '.join(target) or 'the compiler default target'}; kernels: {kernels}"
    return Extension(
        f"corral.{name}",
        sources=[f"corral/csrc/{source}" for source in SOURCES],
        depends=[f"corral/csrc/{header}" for header in ("arrays.h", "automata.h", "common.h", "kernels.h",
                                                          "kernels_impl.h", "qmatmul.h", "row_table.h")],
        include_dirs=NB_INCLUDES,
        language="c++",
        extra_compile_args=[*FLAGS, *target],
        extra_link_args=["-fopenmp", "-Wl,--gc-sections"],
        # NB_DOMAIN: each build keeps its own nanobind registry, apart from the other build's and from any other
        # nanobind module in the process (xgrammar is one), whose types could otherwise meet Corral's
        define_macros=[("CORRAL_BUILD_INFO", f'"{info}"'), ("CORRAL_MODULE", name), ("NB_DOMAIN", f"corral{name}")],
    )


setup(ext_modules=[extension(name, target) for name, target in BUILDS], cmdclass={"build_ext": BuildExt})
