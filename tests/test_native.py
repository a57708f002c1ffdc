"""The native module: the CORRAL_NATIVE switch, the GIL released during a mask, checked buffers, the limits that
hold while decoding, several processes importing it at once, and prompt lookup's n-gram index against its Python
twin."""

import os
import random
import subprocess
import sys

import numpy as np
import pytest

from corral import native
from corral.budget import Budget
from corral.engine.speculation import PyNgramIndex
from corral.errors import GrammarTooComplexError
from corral.fsm import derivatives
from corral.fsm.lazy_dfa import DEAD, LazyDFA
from corral.grammar.regex_parser import parse_regex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_native = pytest.mark.skipif(native.mode() == "off" or native.module() is None,
                                  reason="the native module is off or missing")
TABLES = [pytest.param(derivatives.TermTable, id="python"),
          pytest.param(derivatives.native_table_class, id="native", marks=needs_native)]


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **env})


@needs_native
def test_status_names_the_paths():
    status = native.status()
    assert status["loaded"] and status["mask_path"] == "native" and status["reason"] is None
    flags, forced = native.cpu_flags(), os.environ.get("CORRAL_NATIVE_BUILD", "").strip().lower()
    expected = ("native-baseline" if forced == "baseline" else
                "native-avx512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags and forced != "avx2" else
                "native-avx2" if {"avx2", "fma", "f16c", "bmi2"} <= flags else "native-baseline")
    assert status["kernels"] == expected and "kernels" in status["build"]


def test_off_runs_the_python_paths_and_says_so():
    result = _python("from corral import native; from corral.fsm import derivatives, lazy_dfa\n"
                     "s = native.status(); assert s['mask_path'] == 'python' and s['kernels'] == 'torch', s\n"
                     "assert derivatives.native_table_class() is None\n"
                     "from corral.budget import Budget; from corral.grammar.regex_parser import parse_regex\n"
                     "assert type(lazy_dfa.LazyDFA(parse_regex('ab+'), Budget())) is lazy_dfa.LazyDFA",
                     CORRAL_NATIVE="off")
    assert result.returncode == 0, result.stderr


def test_require_fails_at_start_up_without_the_module():
    # the module made unimportable (as on a machine where the package was copied without its build)
    block = "import sys; sys.modules['corral._native'] = sys.modules['corral._native_baseline'] = None\n"
    result = _python(block + "from corral import native\ntry:\n    native.module()\nexcept native.NativeModuleError "
                     "as e:\n    print('refused:', e)\nelse:\n    raise SystemExit('no error')", CORRAL_NATIVE="require")
    assert result.returncode == 0 and "refused: CORRAL_NATIVE=require" in result.stdout, result.stderr
    serve = _python(block + "from corral.cli import main; raise SystemExit(main(['serve', '--port', '1']))",
                    CORRAL_NATIVE="require")
    assert serve.returncode == 1 and "CORRAL_NATIVE=require" in serve.stderr  # before any model loads


def test_auto_falls_back_with_one_loud_line():
    result = _python("import sys, logging; sys.modules['corral._native'] = sys.modules['corral._native_baseline'] = None\n"
                     "logging.basicConfig()\n"
                     "from corral import native\nassert native.module() is None and native.module() is None\n"
                     "print(native.status()['mask_path'])", CORRAL_NATIVE="auto")
    assert result.returncode == 0 and result.stdout.strip() == "python", result.stderr
    assert result.stderr.count("native module unavailable") == 1 and "pip install -e ." in result.stderr


@needs_native
@pytest.mark.parametrize("setting, value, message", [("CORRAL_QMATMUL_TILE_PAIRS", "yes", "on or off"),
                                                     ("CORRAL_QMATMUL_ISA", "sse", "no such variant")])
def test_a_setting_the_module_refuses_is_an_error_in_every_mode(setting, value, message):
    """Not a fallback to the slow path with a hint to reinstall: what was asked for, named, at start-up."""
    for switch in ("auto", "require"):
        result = _python("from corral import native\ntry:\n    native.module()\nexcept native.NativeModuleError "
                         "as e:\n    print('refused:', e)\nelse:\n    raise SystemExit('no error')",
                         CORRAL_NATIVE=switch, **{setting: value})
        assert result.returncode == 0, result.stderr
        assert f"refused: the native module refused a setting: {setting}={value}: " in result.stdout
        assert message in result.stdout and "pip install" not in result.stdout + result.stderr


def test_a_bad_switch_value_is_an_error():
    result = _python("from corral import native; native.module()", CORRAL_NATIVE="fast")
    assert result.returncode != 0 and "expected one of auto, require, off" in result.stderr


def test_two_processes_import_at_once_on_an_empty_cache(tmp_path):
    code = ("from corral import native; from corral.fsm.compiler import GrammarCompiler\n"
            "assert native.status()['mask_path'] == ('python' if native.mode() == 'off' else 'native')")
    env = {**os.environ, "CORRAL_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err


@needs_native
def test_the_gil_is_released_during_a_mask(vocab_index, released_gil):
    """A hook inside the native walk waits for a Python thread to release it: only possible without the GIL."""
    index = vocab_index("[a-z]+")
    assert released_gil(lambda: index.mask(0))


@needs_native
def test_the_hook_times_out_when_nobody_releases_it(vocab_index):
    module = native.module()
    module._hook_arm(0.05)
    vocab_index("[0-9]+").mask(0)
    assert module._hook_outcome() == 0  # the test above would fail this way if the GIL were held


@pytest.fixture(scope="module")
def vocab_index():
    from corral.fsm.token_index import TokenIndex
    from corral.fsm.vocabulary import Vocabulary
    from corral.models import load_tokenizer

    vocab = Vocabulary.from_tokenizer(load_tokenizer())
    def make(pattern, budget=None, terms=None):
        return TokenIndex(LazyDFA(parse_regex(pattern), budget or Budget(), terms=terms), vocab)

    return make


@pytest.mark.parametrize("table", TABLES)
def test_the_state_cap_holds_while_decoding(table):
    """Compiling makes a handful of states; walking on past the cap raises the typed error that names it."""
    make = table if isinstance(table, type) else table()
    budget = Budget(max_states=40)
    dfa = LazyDFA(parse_regex("[a-z]{0,300}"), budget, terms=make(budget))
    assert dfa.num_states < 40
    state = 0
    with pytest.raises(GrammarTooComplexError, match="cap of 40 states"):
        for _ in range(60):
            state = dfa.step(state, ord("a"))
    assert state != DEAD


@pytest.mark.parametrize("table", TABLES)
def test_a_mask_past_its_fuel_raises_and_the_grammar_stays_usable(table, vocab_index):
    # the native walk and the Python oracle alike (the oracle counts the same new terms in its own table)
    make = table if isinstance(table, type) else table()
    budget = Budget(mask_fuel=5)
    index = vocab_index("([a-z]{1,40}[0-9]){1,20}", budget, make(budget))
    assert (index._native is None) == (make is derivatives.TermTable)
    with pytest.raises(GrammarTooComplexError, match="fuel of 5 new terms"):
        index.mask(0)
    assert index.dfa.terms.budget.mask_fuel == 5
    index.mask_fuel = -1  # with fuel again, the same mask completes
    assert np.asarray(index.mask(0)).any()


@needs_native
def test_the_memory_cap_holds_while_decoding():
    budget = Budget(max_terms=200)
    terms = derivatives.native_table_class()(budget)
    dfa = LazyDFA(parse_regex("([a-z][0-9]){0,100}"), budget, terms=terms)
    assert terms.max_terms == 200
    with pytest.raises(GrammarTooComplexError, match="memory cap of 200 terms"):
        state = 0
        for byte in b"a1" * 100:
            state = dfa.step(state, byte)


@needs_native
def test_kernels_check_their_buffers():
    module = native.module()
    h, w = np.zeros((2, 8), np.float32), np.ones(8, np.float32)
    with pytest.raises(ValueError, match="weight"):
        module.add_rms_norm(h, None, np.ones(7, np.float32), np.zeros_like(h), 1e-5, 1)
    with pytest.raises(TypeError, match="dtype"):
        module.add_rms_norm(h, None, w.astype(np.float64), np.zeros_like(h), 1e-5, 1)
    with pytest.raises((BufferError, ValueError, TypeError)):
        module.add_rms_norm(h, None, w, np.zeros_like(h)[:, ::2], 1e-5, 1)
    q = np.zeros((1, 2, 4), np.float32)
    cache = np.zeros((3, 4, 1, 4), np.float32)
    out = np.zeros((1, 8), np.float32)
    lens = np.array([5], np.int64)
    with pytest.raises(IndexError, match="block id"):
        module.paged_decode(q, cache, cache, np.array([[0, 7]], np.int64), lens, out, 1.0, 1, None, None)
    with pytest.raises(IndexError, match="context length"):
        module.paged_decode(q, cache, cache, np.array([[0, 1]], np.int64), np.array([9], np.int64), out, 1.0, 1,
                            None, None)
    module.paged_decode(q, cache, cache, np.array([[0, 1]], np.int64), lens, out, 1.0, 1, None, None)
    with pytest.raises(IndexError, match="position"):
        module.rope(np.zeros((1, 1, 4), np.float32), np.array([3], np.int64), np.zeros((3, 4), np.float32),
                    np.zeros((3, 4), np.float32), 1)


@needs_native
def test_a_malformed_trie_is_refused():
    module = native.module()
    i32 = lambda *v: np.asarray(v, np.int32)  # noqa: E731
    i64 = lambda *v: np.asarray(v, np.int64)  # noqa: E731
    good = (i32(0, 97, 98), i32(0, 1, 2), i32(3, 3, 3), i32(-1, -1, 5), i64(0, 0, 0), i64(0, 0, 1), i64(1, 1, 1),
            i32(5), i32(1), 1)
    module.Trie(*good)
    with pytest.raises(ValueError, match="out of shape"):
        module.Trie(good[0], i32(0, 1, 3), *good[2:])  # a depth jump: the walk's stack would hold no parent
    with pytest.raises(ValueError, match="outside the mask"):
        module.Trie(*good[:7], i32(40), *good[8:])
    with pytest.raises(ValueError, match="root"):
        module.Trie(*good[:8], i32(2), 1)


# nanobind warns (RuntimeWarning) each time a bare instance is touched, before it refuses it
@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_native_objects_made_without_their_constructor_are_refused():
    """A class's __new__ alone makes an instance with nothing behind it; every use of one is an error, never a
    read of uninitialized memory (the automaton's buffer views are reachable through type())."""
    module = native.module()
    table = derivatives.new_table()
    dfa = module.Dfa(table)
    view_type = type(dfa.buffers()[0])
    with pytest.raises(BufferError, match="no automaton made"):
        memoryview(view_type.__new__(view_type))
    for cls in (module.Table, module.Trie, module.Dfa, module.CfgIndex, module.CfgSession):
        bare = cls.__new__(cls)
        with pytest.raises(TypeError):
            module.Dfa(bare)
        with pytest.raises(TypeError):
            dfa.walk_trie(bare, 0, 0, np.zeros(1, np.uint32), -1)
        with pytest.raises(TypeError):
            module.CfgSession(bare, 1, 1, 1)


def test_the_process_wide_structure_memo_is_bounded(vocab_index, monkeypatch):
    """Past its cap a new structure gets no id: its piece walks plainly, and the mask is the same."""
    pattern = '"[^"\\\\\\x00-\\x1fQ]{0,41}Q"'  # a unit (every character but Q) that no other test repeats
    held = len(derivatives._CANONICAL_KEYS)
    monkeypatch.setattr(derivatives, "MAX_STRUCTURES", held)
    table = derivatives.TermTable()
    assert table.structure(table.repeat(table.byte_set(1 << 200), 3, 977)) is None  # a structure not seen yet
    capped = [np.asarray(vocab_index(pattern).mask(0)).copy()]
    assert len(derivatives._CANONICAL_KEYS) == held
    monkeypatch.setattr(derivatives, "MAX_STRUCTURES", held + 100_000)
    uncapped = np.asarray(vocab_index(pattern).mask(0))
    assert len(derivatives._CANONICAL_KEYS) > held  # with room, its pieces got ids (and took the piece path)
    assert np.array_equal(capped[0], uncapped) and uncapped.any()


@needs_native
def test_a_thread_gives_its_openmp_workers_back():
    """The thread that loaded the model ends its OpenMP workers when the engine thread takes over the compute (two
    live pools on too few cores make every worker sleep between operations, about 2x slower decode)."""
    result = _python(
        "import os, time, torch; from corral import native\n"
        "torch.set_num_threads(2); native.module()\n"
        "tasks = lambda: len(os.listdir('/proc/self/task'))\n"
        "before = tasks(); torch.ones(1 << 22).sum(); during = tasks()\n"
        "native.release_thread_pool(); deadline = time.monotonic() + 10\n"
        "while tasks() >= during and time.monotonic() < deadline: time.sleep(0.01)\n"
        "print(before, during, tasks())\n")
    assert result.returncode == 0, result.stderr
    before, during, after = map(int, result.stdout.split())
    assert during == before + 1 and after == before, (before, during, after)


@needs_native
def test_rows_stay_right_and_old_views_readable_across_a_large_growth():
    # past 4,096 states the native automaton reserves room for its cap and grows in place (no copy); views taken
    # before stay valid, and every move equals the Python automaton's
    budget = Budget(max_states=20_000)
    native_dfa = LazyDFA(parse_regex("[a-z]{0,9000}x"), budget)
    python_dfa = LazyDFA(parse_regex("[a-z]{0,9000}x"), Budget(max_states=20_000), terms=derivatives.TermTable())
    assert hasattr(native_dfa, "native") and not hasattr(python_dfa, "native")
    early = native_dfa.trans  # a view of the rows as they are now (moves derived later may land in it or not)
    state_n = state_p = 0
    for k in range(8000):
        byte = ord("a") + k % 26
        state_n, state_p = native_dfa.step(state_n, byte), python_dfa.step(state_p, byte)
        assert state_n == state_p
        assert native_dfa.accepting[state_n] == python_dfa.accepting[state_p]
    assert native_dfa.num_states > 4096 and len(native_dfa.trans) >= native_dfa.num_states
    now = native_dfa.trans[: len(early)]
    assert np.all((early == now) | (early == -3))  # the old view still reads memory: what it knew, or unbuilt
    assert np.array_equal(early[0], now[0])  # the start row was built whole before it
    assert native_dfa.step(state_n, ord("x")) >= 0 and native_dfa.step(state_n, ord("0")) == DEAD


@needs_native
def test_a_grammar_lexer_past_4096_states_keeps_its_moves():
    from corral.fsm.compiler import GrammarCompiler
    from corral.fsm.vocabulary import Vocabulary
    from corral.grammar.constraint import Constraint

    tokens = [bytes([b]) for b in b"abcx"] + [b"<eos>"]
    vocab = Vocabulary.from_token_bytes(tokens, eos_token_ids=[4])
    guide = GrammarCompiler(vocab, cache_bytes=0).compile(
        Constraint("grammar", 'start: WORD "x"\nWORD: /[abc]{0,6000}/')).new_guide()
    row = np.zeros(1, dtype=np.int32)
    for k in range(5000):  # each position of the counted repeat is a new lexer state
        assert guide.advance(k % 3)
    guide.fill_mask(row)
    assert int(row[0]) & 0b1111 == 0b1111  # a, b, c and x are all allowed, EOS not yet
    assert guide.advance(3) and guide.is_accepting()


def test_cpu_flags_are_x86_flags_alone(monkeypatch):
    """On another CPU the flags are empty: no x86 kernel is chosen or tested there, even where /proc/cpuinfo holds
    an x86 host's flags (qemu-user shows an emulated ARM program the host's file)."""
    import platform

    native.cpu_flags.cache_clear()
    try:
        host = native.cpu_flags()
        monkeypatch.setattr(platform, "machine", lambda: "aarch64")
        native.cpu_flags.cache_clear()
        assert native.cpu_flags() == frozenset() and native.build_for_this_cpu() == "_native"
        if platform.uname().machine in ("x86_64", "AMD64"):
            assert "sse2" in host
    finally:
        monkeypatch.undo()
        native.cpu_flags.cache_clear()


def test_two_openmp_runtimes_are_found_and_said_once(monkeypatch, caplog):
    """torch with an OpenMP runtime of its own (PyPI's aarch64 torch 2.8.0 ships a renamed libgomp beside the
    system's, which the module links) keeps a pool the hand-over cannot end: found in the process's mappings, and
    said once when the hand-over runs."""
    maps = ("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/aarch64-linux-gnu/libgomp.so.1.0.0\n"
            "7f02-7f03 r--p 00001000 08:01 1 /usr/lib/aarch64-linux-gnu/libgomp.so.1.0.0\n"
            "7f04-7f05 r-xp 00000000 08:01 2 /site/torch.libs/libgomp-947d5fa1.so.1.0.0\n"
            "7f06-7f07 rw-p 00000000 00:00 0\n"
            "7f08-7f09 r-xp 00000000 08:01 3 /site/torch/lib/libgompx.so\n")
    assert native.openmp_runtimes(maps) == ["/site/torch.libs/libgomp-947d5fa1.so.1.0.0",
                                            "/usr/lib/aarch64-linux-gnu/libgomp.so.1.0.0"]
    if native.module() is not None:
        assert native.openmp_runtimes(), "the module links an OpenMP runtime: this process maps one"
        monkeypatch.setattr(native, "openmp_runtimes", lambda: ["/a/libgomp.so.1", "/b/libgomp-1234.so.1"])
        monkeypatch.setattr(native, "_warned_runtimes", [])
        with caplog.at_level("WARNING", logger="corral.native"):
            native.release_thread_pool()
            native.release_thread_pool()
        said = [r for r in caplog.records if "OpenMP runtimes are loaded" in r.getMessage()]
        assert len(said) == 1 and "/b/libgomp-1234.so.1" in said[0].getMessage()


@needs_native
@pytest.mark.parametrize("order", [1, 2, 3, 5])
def test_the_native_ngram_index_finds_what_its_python_twin_finds(order):
    """Sequences that grow by 0-6 tokens a call, over vocabularies from 2 ids (every n-gram recurs, and the
    tables grow past their first size) to ids past 2**16, each call with or without a tail (jump-forward's forced
    tokens): the same (length, position) every call, and the same count of indexed tokens."""
    rng = random.Random(order)
    for _ in range(60):
        ours, twin = native.module().NgramIndex(order), PyNgramIndex(order)
        vocab, tokens = rng.choice([2, 3, 7, 50, 70_000, 2**32 - 1]), []
        for _ in range(rng.randint(1, 60)):
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(0, 6)))
            tail = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))] if rng.random() < 0.5 else None
            assert ours.find(tokens, tail) == twin.find(tokens, tail), (tokens, tail)
            assert ours.indexed == twin.indexed == len(tokens)
    index = native.module().NgramIndex(3)
    assert index.find([5], None) == (0, -1) and index.find([], [5]) == (0, -1)
    tokens = [7, 8, 9, 7, 8, 9, 4, 7, 8]
    assert index.find(tokens, None) == (2, 5)  # "4 7 8" never came before; "7 8" last did at 3-4, then 5 ("9")
    assert index.find(tokens, [9]) == (3, 6)  # "7 8 9" last came at 3-5, followed at 6 by "4"


@needs_native
def test_the_native_ngram_index_refuses_what_is_not_a_list_of_token_ids():
    index = native.module().NgramIndex(3)
    for tokens, tail, error in (((1, 2), None, TypeError), ([1, 2], (3,), TypeError), ([1, True], None, TypeError),
                                ([1, -1], None, ValueError), ([2**32], None, ValueError),
                                ([1, 2], [3, 2**40], ValueError)):
        with pytest.raises(error):
            index.find(tokens, tail)
    for order in (0, 9):
        with pytest.raises(ValueError):
            native.module().NgramIndex(order)
