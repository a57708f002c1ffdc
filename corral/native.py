"""The native module (``corral._native``, built when the package is installed) and the one switch over it.

``CORRAL_NATIVE`` says how Corral may run:

- ``auto`` (the default): the native module when it imports; when it does not, one warning at start-up that
  names the reason, and the Python mask core and torch kernels run instead (several times slower: MaskBench's
  TBM p99 is 3-5x the native one, and some schemas then run out of their compile budget);
- ``require``: a missing or broken native module is an error at start-up (``corral serve`` exits);
- ``off``: the native module is not loaded; the Python paths run. For tests of the oracle paths.

The module is never compiled at run time: ``pip install .`` (or ``-e .``) builds it through setuptools
(``setup.py``), on x86 twice: ``corral._native`` for x86-64-v3 and ``corral._native_baseline`` for x86-64-v2; the
CPU's flags choose which one imports. :func:`status` is what ``/health`` and ``/metrics`` report.
"""

import functools
import importlib
import logging
import os
import platform
import re
import threading

log = logging.getLogger(__name__)

MODES = ("auto", "require", "off")


class NativeModuleError(RuntimeError):
    """``CORRAL_NATIVE=require`` and the native module cannot be imported, or a setting the module reads when it
    loads (``CORRAL_NATIVE``, ``CORRAL_QMATMUL_ISA``, ``CORRAL_QMATMUL_TILE_PAIRS``) names what it cannot run."""


_lock = threading.Lock()
_loaded: list = []  # [module or None, the reason it is None]


def mode() -> str:
    value = os.environ.get("CORRAL_NATIVE", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise NativeModuleError(f"CORRAL_NATIVE={value!r}: expected one of {', '.join(MODES)}")
    return value


def module():
    """``corral._native``, or None where the switch is off or the module cannot be imported (``require`` raises
    instead). The first call decides for the life of the process."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.extend(_load())
    found, reason = _loaded
    if found is None and mode() == "require":
        raise NativeModuleError(f"CORRAL_NATIVE=require, but the native module is unavailable: {reason}")
    return found


# What x86-64-v3 adds to v2, as /proc/cpuinfo spells it (abm: LZCNT).
_V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})


def build_for_this_cpu() -> str:
    """The module this CPU runs: ``_native`` (x86-64-v3, or any non-x86 build) or ``_native_baseline``.
    ``CORRAL_NATIVE_BUILD=baseline`` takes the baseline build, with its baseline kernels, on any x86 CPU (tests
    run it so that the build other machines import is not shipped untried)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "_native"
    if os.environ.get("CORRAL_NATIVE_BUILD", "").strip().lower() == "baseline":
        return "_native_baseline"
    return "_native" if _V3_FLAGS <= cpu_flags() else "_native_baseline"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The x86 CPU's feature flags as /proc/cpuinfo spells them; empty on any other CPU (an ARM kernel lists
    "Features" there, and qemu-user shows an emulated ARM program the x86 host's file) and where it cannot be read."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def _load() -> tuple:
    chosen = mode()
    if chosen == "off":
        log.info("CORRAL_NATIVE=off: the Python mask core and the torch kernels run")
        return None, "turned off by CORRAL_NATIVE=off"
    try:
        _native = importlib.import_module(f"corral.{build_for_this_cpu()}")
    except ImportError as exc:
        cause = exc  # a failure inside the module's initialization comes wrapped, raised from the real one
        while isinstance(cause.__cause__, ImportError):
            cause = cause.__cause__
        if str(cause).startswith("CORRAL_"):  # a setting it refused: what was asked for, not a missing build
            raise NativeModuleError(f"the native module refused a setting: {cause}") from exc
        reason = (f"{cause}. The module is built when the package is installed: reinstall with `pip install -e .` "
                  "(or `make test`, which does it) on a machine with a C++17 compiler and Python's headers")
        if chosen == "auto":
            log.warning("native module unavailable, running the Python mask core and the torch kernels, several "
                        "times slower: %s", reason)
        return None, reason
    return _native, None


def release_thread_pool() -> None:
    """End the calling thread's OpenMP workers, when it hands its compute to another thread for good (the engine
    thread): with two pools alive on a machine with fewer cores than their workers, OpenMP puts every worker to
    sleep between parallel regions, and torch's and the kernels' small operations then wait tens of microseconds
    each to wake them (a single-client decode step took 1.8x as long). Workers come back if this thread runs a
    parallel region again. A no-op without the native module. Where torch brought an OpenMP runtime of its own (a
    second library: PyPI's aarch64 torch 2.8.0 ships a renamed libgomp), only the module's pool ends here and the
    two runtimes keep a pool each; that is said once, loudly."""
    found = module()
    if found is not None:
        found.release_thread_pool()
        runtimes = openmp_runtimes()
        if len(runtimes) > 1 and not _warned_runtimes:
            _warned_runtimes.append(runtimes)
            log.warning("%d OpenMP runtimes are loaded (%s): torch's worker pool and the native kernels' are apart, "
                        "so a thread's hand-over leaves one alive and decode steps may run up to about 2x slower on "
                        "a machine with few cores; a torch build that uses the system's libgomp avoids it",
                        len(runtimes), ", ".join(runtimes))


_warned_runtimes: list = []
_OPENMP = re.compile(r"/lib(gomp|iomp5|omp)([-.][^/]*)?\.so[^/]*$")


def openmp_runtimes(maps: str | None = None) -> list[str]:
    """The OpenMP runtime libraries mapped into this process (from /proc/self/maps, or ``maps``' text), sorted;
    empty where that cannot be read."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return []
    return sorted({path for line in maps.splitlines() if (path := line.split(maxsplit=5)[-1]) and
                   path.startswith("/") and _OPENMP.search(path)})


def status() -> dict:
    """Which paths run: the switch, whether the module loaded (and why not), the mask path, the kernels' ISA."""
    try:
        found = module()
    except NativeModuleError:
        found = None
    reason = _loaded[1]
    return {"mode": mode(), "loaded": found is not None, "reason": reason,
            "module": found.__name__ if found is not None else None,
            "mask_path": "native" if found is not None else "python",
            "kernels": f"native-{found.kernel_isa}" if found is not None else "torch",
            "qmatmul": f"native-{found.qmatmul_isa}" if found is not None else None,
            # why a CPU with AMX runs the VNNI products instead (None where AMX runs or the CPU has none)
            "qmatmul_amx_refused": getattr(found, "qmatmul_amx_refused", None),
            "build": found.build_info if found is not None else None}
