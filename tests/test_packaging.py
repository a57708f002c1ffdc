"""Corral installs like a real package: the sdist carries the native sources, a wheel built from it holds the
compiled module (one per Python version, not abi3), and that wheel works where no compiler is on PATH; an sdist
built where there is no compiler fails loudly. Reuses this environment's dependencies (no downloads)."""

import glob
import os
import platform
import shutil
import subprocess
import sys
import zipfile

import pytest

from corral import native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The fsm subset run against the installed wheel: the native walk against the Python oracle, the token index,
# the term tables, and the native module's own tests.
SUBSET = ["fsm/test_native_walk.py", "fsm/test_token_pieces.py", "fsm/test_token_index.py", "fsm/test_lazy_dfa.py",
          *(f"fsm/test_native_cfg.py::{name}" for name in (  # (the corpus documents are not copied)
              "test_native_masks_equal_the_oracle_along_random_walks",
              "test_the_native_session_bounds_its_configurations_and_its_fuel",
              "test_the_native_session_checks_its_arguments", "test_the_gil_is_released_during_a_native_grammar_mask")),
          "test_native.py"]
# Run again on the x86-64-v2 build with its baseline kernels (what a CPU without AVX2 imports).
BASELINE = ["fsm/test_native_walk.py", "test_native.py", "kernels/test_cpu_ops.py",
            "kernels/test_paged_attention_cpu.py"]
# The oracle tests on toy vocabularies, run with the native module off.
ORACLE = ["fsm/test_token_pieces.py", "fsm/test_token_index.py", "fsm/test_lazy_dfa.py", "fsm/test_cfg_guide.py"]


def _run(args, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env or os.environ.copy(), capture_output=True, text=True, timeout=timeout)


def _no_compiler_env(**extra) -> dict:
    """PATH holds only this interpreter's folder (no cc, c++, g++ there); CC and CXX name nothing."""
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "PYTHONPATH")}
    bin_dir = os.path.dirname(sys.executable)
    assert not any(os.path.exists(os.path.join(bin_dir, c)) for c in ("cc", "gcc", "g++", "c++", "clang"))
    env.update(PATH=bin_dir, CC="/nonexistent/cc", CXX="/nonexistent/c++", **extra)
    return env


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    out = tmp_path_factory.mktemp("sdist")
    built = _run([sys.executable, "setup.py", "-q", "sdist", "-d", str(out)], ROOT)
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = glob.glob(str(out / "corral-*.tar.gz"))
    return path


@pytest.fixture(scope="module")
def installed(sdist, tmp_path_factory):
    """The wheel built from the sdist, installed into a folder of its own (the dependencies are this venv's)."""
    work = tmp_path_factory.mktemp("wheel")
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"),
                  sdist], work)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = glob.glob(str(work / "dist" / "corral-*.whl"))
    site = work / "site"
    done = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                 wheel], work)
    assert done.returncode == 0, done.stderr[-3000:]
    return wheel, site, work


def test_the_wheel_holds_the_built_module_for_this_python(installed):
    wheel, _, _ = installed
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert f"-{tag}-{tag}-" in os.path.basename(wheel)  # one wheel per Python version (the full C API, not abi3)
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("corral/_native.") and n.endswith(".so") for n in names)
    if platform.machine() == "x86_64":  # and the x86-64-v2 build, for CPUs without AVX2
        assert any(n.startswith("corral/_native_baseline.") and n.endswith(".so") for n in names)
    assert not any(n.endswith((".cpp", ".h")) for n in names)
    assert "corral/engine/data/awq-calibration.txt" in names  # --awq calibrates on it at load


def test_the_installed_wheel_passes_the_fsm_subset_without_a_compiler(installed):
    _, site, work = installed
    tests = work / "tests"
    if not tests.exists():  # the tests, away from the source tree, so that only the installed corral imports
        shutil.copytree(os.path.join(ROOT, "tests"), tests, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(os.path.join(ROOT, "pyproject.toml"), work / "pyproject.toml")
    env = _no_compiler_env(PYTHONPATH=str(site), CORRAL_NATIVE="require", CORRAL_CACHE_DIR=str(work / "cache"))
    where = _run([sys.executable, "-c", "import corral, corral._native as n; print(corral.__file__, n.kernel_isa)"],
                 work, env)
    assert where.returncode == 0 and where.stdout.startswith(str(site)), where.stdout + where.stderr
    run = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[f"tests/{t}" for t in SUBSET]],
               work, env, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:]


def test_the_oracle_paths_pass_with_the_native_module_off():
    env = {**os.environ, "CORRAL_NATIVE": "off"}
    run = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[f"tests/{t}" for t in ORACLE]],
               ROOT, env, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout and "skipped" in run.stdout  # the native-only cases skip, the oracle ones run


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the baseline build is x86's")
def test_the_baseline_build_passes_the_native_tests_and_the_kernels_oracle():
    _run_native_tests_under("baseline", "corral._native_baseline", "native-baseline")


@pytest.mark.skipif("avx512f" not in native.cpu_flags() or "avx2" not in native.cpu_flags(),
                    reason="only an AVX-512 CPU can try the AVX2 kernels beside its own")
def test_the_avx2_kernels_pass_the_kernels_oracle_on_an_avx512_cpu():
    """The AVX-512 CPU runs its own kernels; the AVX2 ones, which most CPUs run, are tried here too."""
    _run_native_tests_under("avx2", "corral._native", "native-avx2")


def _run_native_tests_under(build: str, module: str, kernels: str) -> None:
    """CORRAL_NATIVE_BUILD=``build`` loads ``module`` with ``kernels``, and the native tests and kernel oracles pass."""
    env = {**os.environ, "CORRAL_NATIVE_BUILD": build, "CORRAL_NATIVE": "require"}
    code = "from corral import native; s = native.status(); print(s['module'], s['kernels'])"
    which = _run([sys.executable, "-c", code], ROOT, env)
    assert which.stdout.split() == [module, kernels], which.stdout + which.stderr
    run = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[f"tests/{t}" for t in BASELINE]],
               ROOT, env, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:]


def test_an_sdist_build_without_a_compiler_fails_loudly(sdist, tmp_path):
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                  sdist], tmp_path, _no_compiler_env())
    assert built.returncode != 0 and not glob.glob(str(tmp_path / "*.whl"))
    assert "/nonexistent/" in built.stdout + built.stderr  # the compiler it looked for, named
