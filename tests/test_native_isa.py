"""The native builds run on every CPU they are imported on: code compiled for a wider instruction set than the
build's own target stays inside the kernels that a CPU check chooses.

The x86 wheels hold two builds (setup.py): ``_native_baseline`` for x86-64-v2 and ``_native`` for x86-64-v3, each
with AVX2 and AVX-512 kernels chosen at run time (and AMX tiles, behind a check of their own). A function compiled
under a wider ``#pragma GCC target`` than the build's that runs before that choice (a table built at import, a
load-time check, an inline function that the linker keeps from a kernel file) stops the import with SIGILL on an
older CPU, which this machine's CPU would never show. So the disassembly is read instead: wider instructions may
appear only in functions of the kernels' namespaces, which are named for their instruction set (``avx2``,
``avx512``, ``amx``). Where qemu-user is installed, each build is also imported on an emulated CPU older
than this one (no AVX; AVX2 without AVX-512), and where an arm64 cross compiler is, every source compiles for it."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from corral import native

OBJDUMP = shutil.which("objdump")
pytestmark = pytest.mark.skipif(native.mode() == "off" or native.module() is None,
                                reason="the native module is off or missing")
needs_objdump = pytest.mark.skipif(OBJDUMP is None, reason="objdump (binutils, which the native build needs) is not "
                                   "installed")

# x86-64-v3 over v2: AVX and AVX2 (every VEX mnemonic starts with v), FMA and F16C (so do theirs), BMI1, BMI2, LZCNT
# and MOVBE. tzcnt is left out: it is rep bsf, which every x86-64 runs (g++ emits it for v2 as well); so are verr
# and verw, which are older than x86-64.
V3_ONLY = re.compile(r"^(v(?!err$|erw$)\w+|andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx"
                     r"|lzcnt|movbe)$")
# AVX-512 over v3: its registers (zmm, the mask registers, the vector registers past 15) or mask instructions; and
# AVX-VNNI's VEX forms, which v3 does not have either.
AVX512_OPERAND = re.compile(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b|\{vex\}")
AVX512_MNEMONIC = re.compile(r"^(k\w+|vpdp\w+)$")
AMX = re.compile(r"^(ldtilecfg|sttilecfg|tile\w+|tdp\w+)$")
KERNELS = {"avx2": re.compile(r"::(avx2|avx512|amx)::"), "avx512": re.compile(r"::(avx512|amx)::"),
           "amx": re.compile(r"::amx::")}


def _functions(path: str) -> dict[str, list[tuple[str, str]]]:
    """Each function of the shared library at ``path``, demangled: its instructions as (mnemonic, operands)."""
    listing = subprocess.run([OBJDUMP, "-d", "-C", "--no-show-raw-insn", path], capture_output=True, text=True,
                             check=True, timeout=300).stdout
    functions: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in listing.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            current = functions.setdefault(head.group(1), [])
            continue
        body = re.match(r"^\s+[0-9a-f]+:\t(\S+)\s*(.*)$", line)
        if body and current is not None:
            mnemonic, operands = body.groups()
            if mnemonic in ("rep", "repz", "repnz", "lock", "notrack", "bnd", "data16", "addr32", "cs", "ds"):
                mnemonic, _, operands = operands.partition(" ")  # the prefix's instruction
            current.append((mnemonic, operands))
    return functions


def _wider(functions: dict, isa: str, wider) -> list[str]:
    """The functions outside the ``isa`` kernels' namespaces with an instruction ``wider`` flags (a few each)."""
    found = []
    for name, instructions in functions.items():
        if KERNELS[isa].search(name):
            continue
        bad = [f"{m} {o}".strip() for m, o in instructions if wider(m, o)]
        if bad:
            found.append(f"{name}: {', '.join(bad[:3])}")
    return found


@pytest.fixture(scope="module")
def builds():
    """Each x86 build's functions, read from its file (found, not imported: a build this CPU cannot run is read too)."""
    found = {}
    for name in ("corral._native_baseline", "corral._native"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            pytest.skip(f"{name} is not built (not an x86 install)")
        found[name] = _functions(spec.origin)
    return found


@needs_objdump
def test_the_baseline_build_runs_v3_instructions_only_in_its_kernels(builds):
    functions = builds["corral._native_baseline"]
    assert len(functions) > 1000  # the listing was read
    assert any(KERNELS["avx2"].search(name) and any(V3_ONLY.match(m) for m, _ in body)
               for name, body in functions.items())  # the kernels themselves were found, with their instructions
    assert _wider(functions, "avx2", lambda m, o: bool(V3_ONLY.match(m))) == []


@needs_objdump
@pytest.mark.parametrize("build", ["corral._native_baseline", "corral._native"])
def test_avx512_and_amx_instructions_run_only_in_their_kernels(builds, build):
    functions = builds[build]
    assert any(KERNELS["avx512"].search(name) and any(AVX512_OPERAND.search(o) for _, o in body)
               for name, body in functions.items())
    assert _wider(functions, "avx512", lambda m, o: bool(AVX512_MNEMONIC.match(m) or AVX512_OPERAND.search(o))) == []
    assert _wider(functions, "amx", lambda m, o: bool(AMX.match(m))) == []


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="qemu-x86_64 (Debian's qemu-user) is not installed")
@pytest.mark.parametrize("cpu, build, expected", [
    # SSE4.2 and POPCNT, no AVX. qemu shows the host's /proc/cpuinfo, so the v2 build is named; inside it, the
    # kernels are chosen from the emulated CPUID
    ("Nehalem", "baseline", ["corral._native_baseline", "native-baseline", "native-scalar"]),
    # AVX2, FMA, F16C and BMI2, no AVX-512: the v3 build with its AVX2 kernels and products
    ("Haswell-v4", "", ["corral._native", "native-avx2", "native-avx2"]),
])
def test_each_build_imports_and_picks_its_kernels_on_an_older_cpu(cpu, build, expected):
    if not build and native.build_for_this_cpu() != "_native":
        pytest.skip("this host's /proc/cpuinfo, which qemu shows, names the v2 build")
    code = "from corral import native; s = native.status(); print(s['module'], s['kernels'], s['qmatmul'])"
    env = {k: v for k, v in os.environ.items()
           if k not in ("CORRAL_NATIVE_BUILD", "CORRAL_QMATMUL_ISA", "CORRAL_QMATMUL_TILE_PAIRS")}
    result = subprocess.run(["qemu-x86_64", "-cpu", cpu, sys.executable, "-c", code], capture_output=True,
                            text=True, timeout=600, env={**env, "CORRAL_NATIVE_BUILD": build})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == expected


CROSS = shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(CROSS is None, reason="aarch64-linux-gnu-g++ (Debian's g++-aarch64-linux-gnu) is not installed")
def test_the_sources_compile_for_arm64():
    # setup.py builds one module with no -march on other CPUs: every x86 header and intrinsic must sit behind its
    # guard (the three product files once included <immintrin.h> unguarded, and no ARM install could build)
    import concurrent.futures
    import sysconfig

    import nanobind

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "corral", "csrc")
    includes = [sysconfig.get_paths()["include"], nanobind.include_dir(),
                os.path.join(nanobind.source_dir(), os.pardir, "ext", "robin_map", "include")]
    sources = sorted(f for f in os.listdir(root) if f.endswith(".cpp"))
    assert "qmatmul_amx.cpp" in sources

    def check(source):
        return source, subprocess.run([CROSS, "-std=c++17", "-fopenmp", "-fsyntax-only", *(f"-I{d}" for d in includes),
                                       os.path.join(root, source)], capture_output=True, text=True, timeout=600)

    with concurrent.futures.ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        failed = {source: result.stderr[-1500:] for source, result in pool.map(check, sources) if result.returncode}
    assert failed == {}
