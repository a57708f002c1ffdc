"""The native decode step (``corral/csrc/decode_step.cpp``) against the torch path of the same W4A8 model.

Both run the same kernels on the same weights in the same order, so the claim is bit-for-bit: every sampled
token and every logprob of a greedy run equal, for single sequences and for a batch of 16 whose contexts differ
(the step attends over each one's own blocks), with the prefix cache on."""

import pytest
import torch

from corral import native
from corral.engine import EngineConfig, LLMEngine
from corral.engine.attention import PrefillSpan
from corral.kernels.cpu_ops import buffer
from tests.engine.real_model import PROMPTS, chat, greedy
from tests.models.kquant_fixture import layer_weights

pytestmark = pytest.mark.skipif(native.module() is None, reason="the native module is off or missing")
QUESTIONS = PROMPTS + [f"Name {n} animals that live in the {place}." for n, place in
                       [(2, "sea"), (3, "desert"), (4, "forest"), (5, "mountains"), (2, "arctic"), (3, "jungle"),
                        (4, "river"), (5, "savanna")]]


@pytest.fixture(scope="module")
def engines():
    made = {step: LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="auto", decode_step=step,
                                         num_kv_blocks=256, num_threads=2, decode_burst=4))
            for step in ("native", "torch")}  # bursts of 4: the tests place stops at each place of one
    assert made["native"].runner.decode_path == "native" and made["torch"].runner.decode_path == "torch"
    return made


@pytest.fixture(scope="module")
def sampler_engine():
    """The native step with every token picked by the sampler: no burst, and no pick inside the native call."""
    engine = LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="auto", num_kv_blocks=256,
                                    num_threads=2, decode_burst=1))
    engine._plan_burst = lambda batch: (batch, 0)
    return engine


def assert_same_outputs(engine, oracle, prompts, params) -> None:
    """Both engines' tokens, texts, finish and stop reasons, logprobs and cumulative logprobs for the same
    requests."""
    for a, b in zip(*(e.generate(prompts, params) for e in (engine, oracle))):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason, a.logprobs, a.cumulative_logprob) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason, b.logprobs, b.cumulative_logprob)


def run(engine, prompts, max_tokens=12):
    outs = engine.generate(prompts, greedy(max_tokens, logprobs=3, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_sixteen_prompts_in_one_batch_are_bit_for_bit_the_torch_path(engines):
    prompts = [chat(engines["native"], q) for q in QUESTIONS]
    assert len(prompts) == 16 and len({len(p) for p in prompts}) > 4  # contexts of different lengths
    assert run(engines["native"], prompts) == run(engines["torch"], prompts)


def test_one_sequence_at_a_time_is_the_torch_path(engines):
    prompts = [chat(engines["native"], f"Count from {n} to {n + 5}.") for n in (3, 40, 700)]
    assert [run(engines["native"], [p])[0] for p in prompts] == [run(engines["torch"], [p])[0] for p in prompts]


def test_bad_buffers_are_refused(engines):
    step = engines["native"].runner.model.native_step
    runner = engines["native"].runner
    one = torch.tensor([1])
    table = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        step(torch.tensor([10 ** 7]), torch.tensor([0]), one * 0, table, one, runner.whole_kv.k, runner.whole_kv.v)
    with pytest.raises(IndexError, match="slot outside the cache"):
        step(one, torch.tensor([0]), torch.tensor([10 ** 9]), table, one, runner.whole_kv.k, runner.whole_kv.v)
    with pytest.raises(IndexError, match="context length"):
        step(one, torch.tensor([0]), one * 0, table, torch.tensor([17]), runner.whole_kv.k, runner.whole_kv.v)
    with pytest.raises(ValueError, match="k_cache"):
        step(one, torch.tensor([0]), one * 0, table, one, runner.whole_kv.k[:2], runner.whole_kv.v[:2])
    spare = buffer(torch.zeros(1, dtype=torch.int64))  # never read: the spec is checked first
    with pytest.raises(ValueError, match="spec"):
        native.module().decode_step(buffer(torch.zeros(7, dtype=torch.int64)), 1e-5, *([spare] * 13), 1, None, None,
                                    None)
    with pytest.raises(TypeError):  # a buffer that is None where none may be
        native.module().decode_step(buffer(torch.zeros(8, dtype=torch.int64)), 1e-5, *([None] * 13), 1, None, None,
                                    None)


def test_an_int8_kv_cache_is_written_and_read_as_the_torch_path_does():
    made = [LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="int8", decode_step=step,
                                   num_kv_blocks=64, num_threads=2)) for step in ("native", "torch")]
    assert [e.runner.decode_path for e in made] == ["native", "torch"]
    prompts = [chat(made[0], q) for q in QUESTIONS[:4]]
    assert run(made[0], prompts) == run(made[1], prompts)
    assert torch.equal(made[0].runner.whole_kv.k, made[1].runner.whole_kv.k)  # the same codes
    assert torch.equal(made[0].runner.whole_kv.v_scale, made[1].runner.whole_kv.v_scale)  # and scales


class _SpanKinds:
    """The native step, recording each prompt span it is given as (fresh, beside decodes)."""

    def __init__(self, step):
        self.step, self.kinds = step, set()

    def __call__(self, *args, spans=(), **kwargs):
        decodes = len(args[4]) > 0  # context_lens: one per single-query row
        self.kinds.update((span.context_blocks is None, decodes) for span in spans)
        return self.step(*args, spans=spans, **kwargs)

    def __getattr__(self, name):
        return getattr(self.step, name)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32", "int8"])
def test_prompts_and_mixed_steps_run_in_the_native_step_as_the_torch_path(kv_cache_dtype):
    """Prompt spans in the native step (fresh prompts through the causal kernel over their float32 K/V, chunks
    and prefix-cache hits over the cache), alone and in steps with decodes: the torch path's tokens, logprobs and
    cache contents, bit for bit, and the torch forward never called. A 32-token budget chunks the prompts and
    mixes them with decodes, and 8 sequences at most make the last prompts start beside decodes; the prompts
    that share a system prompt find its blocks cached, and the second round finds whole prompts cached."""
    made = {step: LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype=kv_cache_dtype,
                                         decode_step=step, num_kv_blocks=96, num_threads=2,
                                         max_num_batched_tokens=32, max_num_seqs=8, decode_burst=1))
            for step in ("native", "torch")}
    forwards = []
    runner = made["native"].runner
    runner.model.forward = lambda *args, **kwargs: forwards.append(args) or pytest.fail("the torch forward ran")
    runner.native_step = recorder = _SpanKinds(runner.native_step)
    system = "You are a terse assistant for a class of curious children. Answer in one short line, plainly, " \
             "with no lists, no greetings and no questions back."
    tokenizer = made["native"].tokenizer
    prompts = [chat(made["native"], q, system=system) for q in QUESTIONS[:6]]
    prompts += [tokenizer.encode(f"{n}: {q}" * n) for n, q in enumerate(QUESTIONS[6:10], 1)]  # no shared prefix
    assert min(len(p) for p in prompts[:6]) > 32 and min(len(p) for p in prompts[6:]) < 32
    for _ in range(2):
        assert run(made["native"], prompts, 8) == run(made["torch"], prompts, 8)
        for a, b in zip(runner.whole_kv, made["torch"].runner.whole_kv):
            assert (a is None and b is None) or torch.equal(a, b)
    assert not forwards
    # fresh and over cached context, each alone and beside decodes
    assert recorder.kinds == {(True, False), (True, True), (False, False), (False, True)}


_MIXED_STEP_CHECK = """
import itertools, json, torch
from corral import native
from corral.engine import EngineConfig, LLMEngine, SamplingParams
from corral.engine.model_runner import _NO_LENS, _NO_TABLES
from corral.engine.sequence import Sequence
engine = LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="int8", num_kv_blocks=256,
                                num_threads=2))
runner, blocks, generator = engine.runner, itertools.count(1), torch.Generator().manual_seed(0)
def sequence(tokens, computed):
    seq = Sequence("r", torch.randint(100, 40000, (tokens,), generator=generator).tolist(), SamplingParams())
    seq.block_table = [next(blocks) for _ in range(-(-(tokens + 1) // runner.block_size))]
    seq.num_computed_tokens = computed
    return seq
equal = []
with torch.inference_mode():
    for decodes, prompts, cached in (([], [37], 0), ([90, 200], [20, 33], 0), ([150], [40], 100)):
        seqs = [sequence(n, n - 1) for n in decodes] + [sequence(n + cached, cached) for n in prompts]
        ids, positions, meta = runner.prepare(seqs, [1] * len(decodes) + prompts)
        expected = runner.model.forward(ids, positions, meta, runner.kv_caches)
        group = meta.decodes[0] if meta.decodes else None
        got = runner.native_step(ids, positions, meta.slot_mapping, group.block_tables if group else _NO_TABLES,
                                 group.context_lens if group else _NO_LENS, *runner.whole_kv, spans=meta.prefills)
        equal.append(bool(torch.equal(got, expected)))
print(json.dumps({"isa": native.module().kernel_isa, "equal": equal}))
"""


@pytest.mark.parametrize("variant", ["baseline"] + (
    ["avx2"] if {"avx2", "fma", "f16c", "bmi2"} <= native.cpu_flags() else []))
def test_a_step_with_prompts_is_the_torch_forward_in_every_variant(variant):
    """The kernel variants the other CPUs take (forced here: a process holds one), a fresh prompt alone, fresh
    prompts beside decodes and a chunk over cached context beside a decode, int8 cache: the native step's hidden
    states equal the torch forward's, bit for bit."""
    from tests.kernels.variants import report_in_variant

    env = {"CORRAL_NATIVE_BUILD": variant, "HF_HUB_OFFLINE": "1"}
    if variant == "avx2":
        env["CORRAL_QMATMUL_ISA"] = "avx2"
    report = report_in_variant(_MIXED_STEP_CHECK, **env)
    assert report["isa"].startswith(variant) and report["equal"] == [True] * 3, report


def test_prompt_spans_that_do_not_fit_are_refused(engines):
    runner = engines["native"].runner
    step, kv = runner.model.native_step, runner.whole_kv
    size = runner.block_size
    ids, positions, slots = (torch.tensor(v) for v in ([1, 2, 3], [0, 1, 2], [0, 1, 2]))
    none, empty = torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    span = PrefillSpan
    context = torch.tensor([0])
    cases = [((span(0, 2, None, 2),), ValueError, "must end the batch"),
             ((span(0, 1, None, 1), span(2, 3, None, 1)), ValueError, "one after another"),
             ((span(0, 3, None, 5),), ValueError, "its own tokens only"),
             ((span(0, 3, context, size + 1),), IndexError, "context outside its block table"),
             ((span(0, 3, torch.tensor([10 ** 9]), 3),), IndexError, "block id outside the cache")]
    for spans, error, message in cases:
        with pytest.raises(error, match=message):
            step(ids, positions, slots, none, empty, kv.k, kv.v, spans=spans)
    with pytest.raises(ValueError, match="one entry per row before the spans"):  # lens for the span rows too
        step(ids, positions, slots, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), kv.k, kv.v,
             spans=(span(0, 3, None, 3),))
    assert step(ids, positions, slots, none, empty, kv.k, kv.v, spans=(span(0, 3, None, 3),)).shape == (3, 576)
    engines["native"].block_manager.reset_prefix_cache()  # the call wrote K/V into block 0


def test_the_switch_is_stated_and_native_is_refused_where_it_cannot_run():
    from corral.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="decode_step 'native' needs quantization w4a8"):
        LLMEngine(EngineConfig(quantization="none", dtype="float32", decode_step="native", num_kv_blocks=16))


def native_and_torch(target, model, prompts) -> dict:
    """``run``'s outputs for ``prompts`` from engines on ``model`` (``target``'s vocabulary and settings), one through
    the native step and one through the torch path."""
    import dataclasses

    from corral.engine.model_runner import ModelRunner

    outputs = {}
    for step in ("native", "torch"):
        config = dataclasses.replace(target.config, decode_step=step, num_kv_blocks=128, draft_layers=None)
        runner = ModelRunner(config, model.config, None, model=model)
        assert runner.decode_path == step
        engine = LLMEngine(config, runner=runner, model_config=model.config, vocabulary=target.vocabulary,
                           tokenizer=target.tokenizer)
        outputs[step] = run(engine, prompts)
    return outputs


def test_a_model_cut_to_its_first_layers_steps_natively_as_its_torch_path(engines):
    """Self-speculation's draft model (``LlamaModel.truncated``): the native step over the first 12 layers' slice
    of the weight buffer, with the final norm after them, is bit for bit the torch path of the same 12 layers."""
    target = engines["native"]
    cut = target.runner.model.truncated(12)
    assert cut.config.num_layers == 12 and cut.layers[0] is target.runner.model.layers[0]
    prompts = [chat(target, q) for q in QUESTIONS[:6]]
    outputs = native_and_torch(target, cut, prompts)
    assert outputs["native"] == outputs["torch"]
    assert outputs["native"] != run(target, prompts)  # 12 layers, not 30


def test_the_step_fed_lists_computes_the_tensor_step_then_its_head(engines):
    """The engine's path (:meth:`NativeStep.decode`: the scheduler's lists, each row's whole block table, the LM
    head in the same call) against the tensor call and the head run after it: the same logits, bit for bit, for
    two sequences and for a run of rows on one table (a decode and its draft). The rows write K/V into blocks
    that may hold cached prefixes: the prefix cache is forgotten after."""
    runner = engines["native"].runner
    step, kv = runner.model.native_step, runner.whole_kv
    size = runner.block_size
    cases = [([5, 9], [3, 7], [3, size + 7], [[0, 4, 6], [1]], [4, 8]),
             ([11, 12, 13], [20, 21, 22], [size * 2 + 4, size * 2 + 5, size * 2 + 6], [[3, 2]] * 3, [21, 22, 23])]
    for ids, positions, slots, tables, lens in cases:
        width = max(-(-n // size) for n in lens)
        padded = torch.tensor([table[:width] + [0] * (width - len(table[:width])) for table in tables])
        hidden = step(*(torch.tensor(v) for v in (ids, positions, slots)), padded, torch.tensor(lens), kv.k, kv.v)
        expected = runner.model.lm_head(hidden)
        got = step.decode(ids, positions, slots, tables, lens, 2, kv.k, kv.v)
        assert got.shape == expected.shape and torch.equal(got, expected)
    engines["native"].block_manager.reset_prefix_cache()


def test_the_step_fed_lists_refuses_what_does_not_fit(engines):
    runner = engines["native"].runner
    step, kv = runner.model.native_step, runner.whole_kv
    size = runner.block_size
    with pytest.raises(IndexError, match="context length outside its block table"):  # 2 blocks needed, 1 given
        step.decode([1], [size], [size], [[0]], [size + 1], 2, kv.k, kv.v)
    with pytest.raises(ValueError, match="differ in length"):
        step.decode([1, 2], [0], [0], [[0]], [1], 2, kv.k, kv.v)
    with pytest.raises(TypeError, match="list of lists"):
        step.decode([1], [0], [0], [0], [1], 2, kv.k, kv.v)
    with pytest.raises(TypeError, match="a list of ints"):
        step.decode([1], ["0"], [0], [[0]], [1], 2, kv.k, kv.v)
    with pytest.raises(TypeError, match="a list of ints"):  # ints only: reading one runs no Python code
        step.decode([True], [0], [0], [[0]], [1], 2, kv.k, kv.v)
    assert step.decode([], [], [], [], [], 2, kv.k, kv.v).shape == (0, runner.model.lm_head.out_features)
    with pytest.raises(IndexError, match="block id outside the cache"):
        step.decode([1], [0], [0], [[10 ** 9]], [1], 2, kv.k, kv.v)
    with pytest.raises(TypeError, match="head and logits go together"):
        native.module().decode_step(step._view(step.spec), 1e-5, [1], [0], [0], [[0]], [1], step._view(step.embed_tiles),
                                    step._view(step.layer_tiles), step._view(step.norms),
                                    step._view(runner.model.cos), step._view(runner.model.sin), step._view(kv.k),
                                    step._view(kv.v), buffer(torch.empty(1, runner.model.config.hidden_size)), 1,
                                    None, None, None, step._view(step.head_tiles), None)
    layers = runner.model.config.num_layers  # a kinds table naming no kind, or tiles in super-blocks at K = 576
    for kind, error in ((7, "kinds must be"), (41, "multiple of 256"), (2, "multiple of 256")):
        with pytest.raises(ValueError, match=error):
            native.module().decode_step(step._view(step.spec), 1e-5, [1], [0], [0], [[0]], [1],
                                        step._view(step.embed_tiles), step._view(step.layer_tiles),
                                        step._view(step.norms), step._view(runner.model.cos),
                                        step._view(runner.model.sin), step._view(kv.k), step._view(kv.v),
                                        buffer(torch.empty(1, runner.model.config.hidden_size)), 1, None, None, None,
                                        kinds=buffer(torch.full((layers, 7), kind, dtype=torch.int64)))


def test_greedy_without_logprobs_is_the_torch_path(engines):
    """The greedy sampler's native pass over the step's own logits buffer (no torch call) against the torch
    path's fresh logits: the same tokens and the same cumulative logprob. Both start with nothing cached (a tail
    prefilled over a cached prefix attends through another kernel than a whole prompt, to other last bits)."""
    prompts = [chat(engines["native"], q) for q in QUESTIONS[:5]]
    for engine in engines.values():
        engine.block_manager.reset_prefix_cache()
    outs = {step: engines[step].generate(prompts, greedy(16, ignore_eos=True)) for step in ("native", "torch")}
    for native_out, torch_out in zip(outs["native"], outs["torch"]):
        assert native_out.outputs[0].token_ids == torch_out.outputs[0].token_ids
        assert native_out.outputs[0].cumulative_logprob == torch_out.outputs[0].cumulative_logprob


def test_the_step_keeps_its_output_buffers_up_to_a_bound():
    """Views of one kept buffer per row count, made whole at the start for KEEP_BYTES of rows; a larger step gets
    buffers of its own, so a burst never leaves hundreds of megabytes of logits behind."""
    from corral.engine.model import _StepOutputs

    outputs = _StepOutputs(576, 49152)
    assert outputs.keep_rows == (32 << 20) // (4 * (576 + 49152)) and outputs._capacity == outputs.keep_rows
    one, two = outputs.rows(1), outputs.rows(2)
    assert outputs.rows(1) is one and one[1].data_ptr() == two[1].data_ptr()  # the same buffer, views made once
    big = outputs.rows(outputs.keep_rows + 1)
    assert big[1].shape == (outputs.keep_rows + 1, 49152) and outputs.rows(outputs.keep_rows + 1) is not big
    kept = outputs.rows(outputs.keep_rows)
    assert kept[1].shape[0] == outputs.keep_rows and outputs._capacity == outputs.keep_rows


def test_a_burst_is_its_steps_one_call_each(engines):
    """:meth:`NativeStep.decode_burst` against :meth:`NativeStep.decode` called once a step, each step fed the
    greedy token of the one before: the same logits bit for bit (each sequence's rows together), the same tokens,
    and each token's logprob as the sampler's greedy pass gives it; one sequence and three of different lengths,
    across a block boundary; and a single step with its pick. The rows write K/V into blocks that may hold cached
    prefixes: the prefix cache is forgotten after."""
    from corral.kernels import cpu_ops

    runner = engines["native"].runner
    step, kv = runner.model.native_step, runner.whole_kv
    size, vocab = runner.block_size, engines["native"].sampler.vocab_size
    cases = [([7], [size - 2], [[5, 9]]), ([3, 11, 19], [4, size + 6, 2 * size - 1], [[1], [2, 6], [8, 4, 10]])]
    for ids, positions, tables in cases:
        for steps in (1, 3 if len(ids) > 1 else 5):  # 1: one step with its pick made in the call
            slots = [table[p // size] * size + p % size for table, p in zip(tables, positions)]
            logits, picks, logprobs, decided = step.decode_burst(steps, vocab, ids, positions, slots, tables,
                                                                 [p + 1 for p in positions], 2, kv.k, kv.v)
            assert decided and logits.shape == (len(ids) * steps, runner.model.lm_head.out_features)
            got, rows = logits.clone(), list(ids)
            expected_rows, expected_picks, expected_logprobs = [], [[] for _ in ids], [[] for _ in ids]
            for s in range(steps):
                at = [p + s for p in positions]
                one = step.decode(rows, at, [t[p // size] * size + p % size for t, p in zip(tables, at)], tables,
                                  [p + 1 for p in at], 2, kv.k, kv.v).clone()
                expected_rows.append(one)
                rows, row_logprobs = cpu_ops.greedy_pick(one, vocab, None, None)
                for b, (token, logprob) in enumerate(zip(rows, row_logprobs)):
                    expected_picks[b].append(token)
                    expected_logprobs[b].append(logprob)
            for b in range(len(ids)):
                for s in range(steps):
                    assert torch.equal(got[b * steps + s], expected_rows[s][b])
            assert picks == expected_picks and logprobs == expected_logprobs  # exact: the same float32 pass
    engines["native"].block_manager.reset_prefix_cache()


def test_a_burst_ends_after_a_stop_id_or_an_interrupt(engines):
    """A burst stops after the step whose pick is one of ``end_ids`` (for every row), or after the step during
    which ``interrupt`` became nonzero (here: before the call, so after its first step): the steps made are the
    full burst's first ones, tokens, logprobs and logits alike."""
    import numpy as np

    runner = engines["native"].runner
    step, kv = runner.model.native_step, runner.whole_kv
    size, vocab = runner.block_size, engines["native"].sampler.vocab_size
    ids, positions, tables = [3, 11], [4, size + 6], [[1, 3], [2, 6]]
    slots = [table[p // size] * size + p % size for table, p in zip(tables, positions)]
    args = (ids, positions, slots, tables, [p + 1 for p in positions], 2, kv.k, kv.v)
    logits, picks, logprobs, decided = step.decode_burst(6, vocab, *args)
    full = logits.clone()
    assert decided and [len(row) for row in picks] == [6, 6]
    cases = [([picks[0][0], 10 ** 9], 0, 1), (None, 1, 1), ([10 ** 9], 0, 6), (None, 0, 6)]
    seen = set(row[0] for row in picks)
    for s in range(1, 6):  # a token first picked at a later step ends the burst there (the blocks' state decides)
        fresh = [row[s] for row in picks if row[s] not in seen]
        if fresh:
            cases.append(([fresh[0]], 0, s + 1))
            break
        seen.update(row[s] for row in picks)
    for ends, flag, done in cases:
        interrupt = np.array([flag], dtype=np.int64)
        logits, got, got_logprobs, _ = step.decode_burst(6, vocab, *args, end_ids=ends, interrupt=interrupt)
        assert got == [row[:done] for row in picks] and got_logprobs == [row[:done] for row in logprobs]
        for b in range(2):
            assert torch.equal(logits[b * 6: b * 6 + done], full[b * 6: b * 6 + done])
    # raised by another thread while the call runs (the GIL is released there): the burst ends early
    import threading

    table = [list(range(1, 9))]  # 8 blocks: room for 64 steps from position 4
    long_args = ([3], [4], [table[0][0] * size + 4], table, [5], 2, kv.k, kv.v)
    interrupt = np.zeros(1, dtype=np.int64)
    timer = threading.Timer(0.02, lambda: interrupt.__setitem__(0, 1))
    timer.start()
    try:
        _, got, _, _ = step.decode_burst(64, vocab, *long_args, interrupt=interrupt)
    finally:
        timer.cancel()
    assert interrupt[0] == 1 and 1 <= len(got[0]) < 64, len(got[0])
    with pytest.raises(TypeError, match="end a burst"):
        step.decode_burst(1, vocab, *args, end_ids=[1])
    with pytest.raises(TypeError, match="int64"):
        step.decode_burst(2, vocab, *args, interrupt=np.zeros(1, dtype=np.int32))
    engines["native"].block_manager.reset_prefix_cache()


def test_an_engine_burst_ends_at_eos_and_at_an_interrupt():
    """With bursts of up to 16: a request answered with EOS inside a burst computes no row past it (the burst
    ended there, and its blocks went back); a raised interrupt makes the next burst one token long, and with it
    lowered the bursts are whole again. The tokens are those of an uninterrupted run."""
    engine = LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="auto", num_kv_blocks=64,
                                    num_threads=2, decode_burst=16, speculation=False, jump_forward=False))
    short = chat(engine, "Reply with one word: is the sky blue?")  # answered in 9 tokens, the last EOS
    before = engine.stats()
    (out,) = engine.generate([short], greedy(40))
    stats = engine.stats()
    assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) == 9
    assert stats.num_tokens_computed - before.num_tokens_computed == len(short) + 8  # EOS itself is never input
    assert engine.block_manager.num_used_blocks == 0

    engine.block_manager.reset_prefix_cache()
    prompt = chat(engine, QUESTIONS[1])
    assert len(prompt) % engine.block_manager.block_size != 0  # else the 15 steps' blocks would be none
    engine.add_request("r", prompt, greedy(40, ignore_eos=True))
    engine.step()  # the prompt, and the first token
    engine.burst_interrupt.set()
    (delta,) = engine.step()
    assert len(delta.outputs[0].token_ids) == 2  # one step made before the flag was read
    (seq,) = engine.scheduler.running  # the blocks taken for the other 15 steps went back
    assert len(seq.block_table) == -(-seq.num_computed_tokens // engine.block_manager.block_size)
    engine.burst_interrupt.clear()
    (whole,) = engine.step()
    assert len(whole.outputs[0].token_ids) == 2 + 16
    while engine.has_unfinished_requests():
        (last,) = engine.step()
    engine.block_manager.reset_prefix_cache()
    (single,) = engine.generate([chat(engine, QUESTIONS[1])], greedy(40, ignore_eos=True))
    assert last.outputs[0].token_ids == single.outputs[0].token_ids


def test_a_burst_refuses_what_does_not_fit(engines):
    runner = engines["native"].runner
    step, kv = runner.model.native_step, runner.whole_kv
    size = runner.block_size
    with pytest.raises(IndexError, match="context length outside its block table"):  # step 3 is past block 0
        step.decode_burst(3, 0, [1], [size - 2], [size - 2], [[0]], [size - 1], 2, kv.k, kv.v)
    with pytest.raises(ValueError, match="steps must be 1 to 64"):
        step.decode_burst(65, 0, [1], [0], [0], [[0] * 8], [1], 2, kv.k, kv.v)
    with pytest.raises(ValueError, match="pick_columns"):
        step.decode_burst(2, 10 ** 6, [1], [0], [0], [[0]], [1], 2, kv.k, kv.v)
    with pytest.raises(ValueError, match="at its position's slot"):  # a burst's later slots follow the table
        step.decode_burst(2, 0, [1], [0], [5], [[0]], [1], 2, kv.k, kv.v)
    with pytest.raises(TypeError, match="burst or a pick needs the LM head"):
        native.module().decode_step(step._view(step.spec), 1e-5, [1], [0], [0], [[0]], [1],
                                    step._view(step.embed_tiles), step._view(step.layer_tiles),
                                    step._view(step.norms), step._view(runner.model.cos),
                                    step._view(runner.model.sin), step._view(kv.k), step._view(kv.v),
                                    buffer(torch.empty(1, runner.model.config.hidden_size)), 1, None, None, None,
                                    None, None, 2)


def test_bursts_change_no_output(engines, sampler_engine):
    """An engine that decodes up to 4 greedy tokens per native call against one whose sampler picks every token
    (a native call per token), on the same batches: the same tokens, texts, finish reasons and logprobs, with stop
    strings, stop tokens, ``min_tokens``, top logprobs (whose bursts are verified as drafts), limits that end
    inside a burst, and a seeded sampled request alongside (its draws made in the call too). Bursts must have
    run."""
    from corral.engine.sampling_params import SamplingParams

    burst, plain = engines["native"], sampler_engine
    prompts = [chat(burst, q) for q in QUESTIONS[:6]]
    batches = [
        [greedy(23, ignore_eos=True)],
        [greedy(30, stop=[","]), greedy(17, logprobs=2), greedy(9, min_tokens=5), greedy(40)],
        [greedy(21), SamplingParams(temperature=0.8, seed=3, max_tokens=12), greedy(13, stop_token_ids=[13])],
    ]
    before = burst.stats().num_burst_steps
    for params in batches:
        chosen = prompts[:len(params)]
        for engine in (burst, plain):
            engine.block_manager.reset_prefix_cache()
        assert_same_outputs(burst, plain, chosen, params)
    stats = burst.stats()
    assert stats.num_burst_steps > before and stats.num_burst_tokens >= stats.num_burst_accepted_tokens > 0
    assert plain.stats().num_burst_steps == 0


def test_a_stop_inside_a_burst_ends_it_where_single_steps_end(engines, sampler_engine):
    """One sequence alone (so bursts run) whose stop id, stop string or EOS falls at several places of a 4-token
    burst, and one with both a stop id and a stop string in the same burst: a burst's run of tokens is checked
    once (the first stop id, then the text before it), and must end where the single steps end, with the same
    text, reasons and logprobs."""
    burst, plain = engines["native"], sampler_engine
    prompt = chat(burst, QUESTIONS[0])
    (full,) = plain.generate([prompt], greedy(24, ignore_eos=True))
    tokens, vocab = full.outputs[0].token_ids, burst.vocabulary
    firsts = [k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k]]  # a stop id first met at k
    # bursts of 4 after the prompt's step: token k is at place (k - 1) % 4 of its burst; one stop id per place
    places = {}
    for k in firsts:
        places.setdefault((k - 1) % 4, k)
    pieces = [(k, vocab.token_bytes[tokens[k]].decode(errors="ignore").strip()) for k in firsts]
    words = [(k, w) for k, w in pieces if w and w not in full.outputs[0].text.split(w, 1)[0] + w[:-1]]
    assert len(places) >= 3 and len(words) >= 2, (tokens, pieces)
    cases = [greedy(24, stop_token_ids=[tokens[k]]) for k in places.values()]
    cases += [greedy(24, stop=[w]) for _, w in words[:2]]
    cases += [greedy(24, stop=[words[0][1]], stop_token_ids=[tokens[firsts[-1]]]),
              greedy(24, stop=[words[-1][1]], stop_token_ids=[tokens[firsts[0]]]),
              greedy(24, stop_token_ids=[tokens[firsts[0]]], ignore_eos=True),
              greedy(24, logprobs=0)]
    short = chat(burst, "Reply with one word: is the sky blue?")  # answered in 9 tokens, the last EOS
    cases += [(short, params) for params in (greedy(24), greedy(24, ignore_eos=True),
                                             greedy(24, stop_token_ids=[*vocab.eos_token_ids]))]
    before = burst.stats().num_burst_steps
    for case in cases:
        chosen, params = case if isinstance(case, tuple) else (prompt, case)
        for engine in (burst, plain):  # a prompt read from a quantized KV cache is not the one computed afresh
            engine.block_manager.reset_prefix_cache()
        assert_same_outputs(burst, plain, [chosen], [params])
    assert burst.stats().num_burst_steps > before


def test_sampled_bursts_change_no_output(engines, sampler_engine):
    """Bursts of sampled requests (temperature, top_k, top_p, min_p; no bias, penalty or top logprobs) draw each
    token natively with the uniform the sampler would draw for it, from the request's generator: the same tokens
    and logprobs as the sampler's one step at a time, for a seeded request alone, an unseeded one alone (the same
    global seed before each), and seeded ones beside a greedy one where a stop id ends bursts early for all (the
    uniforms of the steps not made go back to the generators). Sampled bursts must have run."""
    import torch
    from corral.engine.sampling_params import SamplingParams

    burst, plain = engines["native"], sampler_engine
    prompts = [chat(burst, q) for q in QUESTIONS[:3]]

    def sampled(seed, **kwargs):
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=seed, max_tokens=30,
                              ignore_eos=True, logprobs=0, **kwargs)

    plain.block_manager.reset_prefix_cache()
    tokens = plain.generate(prompts, [sampled(7), sampled(5), greedy(30)])[1].outputs[0].token_ids
    stop = next(t for k, t in enumerate(tokens) if k >= 6 and t not in tokens[:k])  # first met at 6 or later
    before = burst.stats().num_burst_steps
    cases = [([prompts[0]], [sampled(11)]), ([prompts[0]], [sampled(None)]),
             (prompts, [sampled(7), sampled(5, stop_token_ids=[stop]), greedy(30)])]
    execute_burst, short = burst.runner.execute_burst, []

    def counted(batch, steps, *rest):  # which bursts ended before their planned steps
        out = execute_burst(batch, steps, *rest)
        short.append(steps > 1 and len(out[2][0]) < steps)
        return out

    burst.runner.execute_burst = counted
    try:
        for chosen, params in cases:
            for engine in (burst, plain):
                engine.block_manager.reset_prefix_cache()
            results = []
            for engine in (burst, plain):
                torch.manual_seed(1234)  # the unseeded request's uniforms come from the global generator
                results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                                 o.outputs[0].stop_reason, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob)
                                for o in engine.generate(chosen, params)])
            assert results[0] == results[1]
    finally:
        del burst.runner.execute_burst
    assert results[0][1][2:4] == ("stop", stop) and len(results[0][1][0]) < 30  # the stop id ended it early
    assert any(short)  # and with it a burst, before the others' last planned step: their uniforms went back
    assert burst.stats().num_burst_steps > before

    # a draw the native pass could not decide (a NaN or +inf in its row): the sampler takes that burst's first step
    execute_burst, undecided = burst.runner.execute_burst, []

    def undecided_draws(batch, steps, columns, ends=None, interrupt=None, draws=None):
        seqs, logits, picks, logprobs, decided = execute_burst(batch, steps, columns, ends, interrupt, draws)
        undecided.append(draws is not None)
        return seqs, logits, picks, logprobs, decided and draws is None

    burst.runner.execute_burst = undecided_draws
    try:
        for engine in (burst, plain):
            engine.block_manager.reset_prefix_cache()
        outs = [[o.outputs[0].token_ids for o in engine.generate(prompts[:2], [sampled(7), greedy(30)])]
                for engine in (burst, plain)]
    finally:
        del burst.runner.execute_burst
    assert outs[0] == outs[1] and any(undecided)


def test_an_interrupted_sampled_burst_gives_its_uniforms_back():
    """An interrupt ends a sampled burst after its first token; the uniforms it drew for the rest go back to the
    request's generator, so the run goes on as an uninterrupted one does."""
    from corral.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="auto", num_kv_blocks=64,
                                    num_threads=2, decode_burst=16, speculation=False, jump_forward=False))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    prompt = chat(engine, QUESTIONS[2])
    (whole,) = engine.generate([prompt], params)
    engine.block_manager.reset_prefix_cache()
    engine.add_request("r", prompt, params)
    engine.step()
    engine.burst_interrupt.set()
    (delta,) = engine.step()
    assert len(delta.outputs[0].token_ids) == 2
    engine.burst_interrupt.clear()
    while engine.has_unfinished_requests():
        (last,) = engine.step()
    assert last.outputs[0].token_ids == whole.outputs[0].token_ids


def test_single_steps_pick_in_the_call_and_change_no_output(engines, sampler_engine):
    """Past 16 sequences no burst runs, but a step of plain greedy decodes still makes its greedy picks in the
    native call: the same tokens, texts, finish reasons and logprobs as the sampler's, for 18 sequences with stop
    strings and limits, with seeded sampled requests among them (drawn in the call with the uniforms the sampler
    would draw), and with a request asking for top logprobs among them (its steps go to the sampler). Such steps
    must have run, and none with the top logprobs."""
    from corral.engine.sampling_params import SamplingParams

    engine = engines["native"]
    prompts = [chat(engine, q) for q in QUESTIONS + ["Name a colour.", "Name a number."]]
    single = []
    execute_burst = engine.runner.execute_burst

    def counted(batch, steps, pick_columns, *rest):
        if steps == 1:
            single.append(any(seq.params.logprobs for seq in batch.seqs))
        return execute_burst(batch, steps, pick_columns, *rest)

    engine.runner.execute_burst = counted
    try:
        for asked in (None, 2, "sampled"):
            params = [greedy(8 + i % 7, stop=["."] if i % 3 == 0 else ()) for i in range(len(prompts))]
            if asked == "sampled":
                params[1::4] = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=9 + i % 5,
                                               logprobs=0) for i in range(len(params[1::4]))]
            else:
                params[5] = greedy(10, logprobs=asked) if asked else params[5]
            for e in (engine, sampler_engine):
                e.block_manager.reset_prefix_cache()
            assert_same_outputs(engine, sampler_engine, prompts, params)
    finally:
        del engine.runner.execute_burst
    assert single and not any(single) and len(prompts) > 16
    engine.block_manager.reset_prefix_cache()


def test_guided_steps_pick_in_the_call_and_change_no_output(engines):
    """Where every guided row's mask waits for its token (a core-bound step), the native call picks every logits
    row, drafts' included, and each grammar then rules on those picks: the same tokens, texts, finish reasons and
    logprobs as the sampler's picks, for guided requests (a JSON schema, and a pattern the model's own tokens keep
    breaking, so rows are picked again under their masks) beside plain ones, with a request asking for top
    logprobs or held by ``min_tokens`` among them (its steps go to the sampler). Steps with picks in the call must
    have run, and steps without."""
    import dataclasses

    from corral.fsm.compiler import GrammarCompiler
    from corral.grammar.constraint import Constraint
    from tests.engine.real_model import PROMPTS

    engine = engines["native"]
    compiler = GrammarCompiler(engine.vocabulary)
    schema = compiler.compile(Constraint("json_schema", {
        "type": "object", "properties": {"full_name_of_the_person": {"type": "string"},
                                         "age_in_whole_years": {"type": "integer"},
                                         "favourite_things": {"type": "array", "items": {"type": "string"}}},
        "required": ["full_name_of_the_person", "age_in_whole_years", "favourite_things"]}))
    pattern = compiler.compile(Constraint("regex", "[0-9]{3}-[a-z]{4}( [A-Z][a-z]+){2,4}"))
    prompts = [chat(engine, q) for q in PROMPTS]
    made, asked = [], []  # what the picking calls gave; whether each step could pick in the call
    execute_picking, picks_in_call = engine.runner.execute_picking, engine._picks_in_call

    def counted(batch, pick_columns):
        out = execute_picking(batch, pick_columns)
        made.append(out[2] is not None)
        return out

    def outputs(picking: bool, params, guides):
        engine.block_manager.reset_prefix_cache()
        if not picking:
            engine._picks_in_call = lambda seqs, deferred: False
        else:
            engine._picks_in_call = lambda seqs, deferred: asked.append(picks_in_call(seqs, deferred)) or asked[-1]
        try:
            outs = engine.generate(prompts, params, [g.new_guide() if g is not None else None for g in guides])
        finally:
            engine.__dict__.pop("_picks_in_call", None)
        return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
                for o in outs for c in o.outputs]

    engine.runner.execute_picking = counted
    engine.defer_masks = True
    config = engine.config
    engine.config = dataclasses.replace(config, draft_row_cost=0.0)  # drafts at full length: many rows per sequence
    try:
        for case in ("guided", "mixed", "asked"):
            guides = [schema if i % 2 else pattern for i in range(len(prompts))]
            params = [greedy(28 + i, stop=["Mary"] if i == 3 else ()) for i in range(len(prompts))]
            if case != "guided":
                guides[::3] = [None] * len(guides[::3])
            if case == "asked":
                params[0] = greedy(20, logprobs=2)
                params[3] = greedy(20, min_tokens=6)
            assert outputs(True, params, guides) == outputs(False, params, guides)
    finally:
        del engine.runner.execute_picking
        engine.defer_masks, engine.config = None, config
    assert any(made) and made.count(True) > len(made) // 2
    assert True in asked and False in asked  # the top-logprob and min_tokens requests' steps went to the sampler
    engine.block_manager.reset_prefix_cache()


def test_unguided_drafts_are_verified_on_the_calls_picks(engines):
    """Plain greedy requests whose prompt-lookup drafts the native call picks row by row: each draft is kept while
    it is its row's pick, as the sampler's verification keeps it, so the tokens, texts, finish and stop reasons,
    cumulative logprobs and draft counts are those of the sampler's verification. Drafts must have been verified
    that way, some kept and some cut."""
    import dataclasses

    engine = engines["native"]
    prompts = [chat(engine, f"Repeat this line {n} times: the {thing} sat on the mat by the door.")
               for n, thing in [(3, "cat"), (4, "dog"), (5, "old man"), (3, "red hat"), (6, "box"), (2, "bird")]]
    params = [greedy(24 + 7 * i, stop=["door"] if i == 2 else ()) for i in range(len(prompts))]
    verified = []  # (tested, accepted) per draft verified on the picks
    verify_picked = engine._verify_picked

    def counted(drafted, picks):
        out = verify_picked(drafted, picks)
        verified.extend((len(draft.tokens), result.num_accepted) for draft, result in out.values())
        return out

    def outputs(picking: bool):
        engine.block_manager.reset_prefix_cache()
        if not picking:
            engine._picks_in_call = lambda seqs, deferred: False
        try:
            outs = engine.generate(prompts, params)
        finally:
            engine.__dict__.pop("_picks_in_call", None)
        return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.num_draft_tokens,
                 c.num_accepted_tokens) for o in outs for c in o.outputs]

    engine._verify_picked = counted
    config = engine.config
    engine.config = dataclasses.replace(config, draft_row_cost=0.0)  # drafts at full length: many rows per sequence
    try:
        assert outputs(True) == outputs(False)
    finally:
        del engine._verify_picked
        engine.config = config
    assert verified and any(a == t for t, a in verified) and any(a < t for t, a in verified), verified
    engine.block_manager.reset_prefix_cache()


def test_health_and_metrics_say_how_many_tokens_a_call_decodes(engines):
    from corral.api.launch import decode_burst

    assert decode_burst(engines["native"]) == 4  # as configured
    assert decode_burst(engines["torch"]) == 1  # the torch path makes a call per op, never a burst
    assert EngineConfig().decode_burst == 8  # the default


def test_no_burst_holds_back_a_waiting_request():
    """With one running sequence allowed, a second request waits; while it does, the running one decodes a token
    a step (a burst would keep the waiting one out that much longer), and it bursts once alone."""
    from corral.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(quantization="w4a8", dtype="auto", kv_cache_dtype="auto", num_kv_blocks=64,
                                    num_threads=2, max_num_seqs=1))
    first, second = (chat(engine, q) for q in QUESTIONS[:2])
    engine.add_request("first", first, greedy(12, ignore_eos=True))
    engine.step()  # the prompt
    engine.add_request("second", second, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while engine.stats().num_waiting:
        before = engine.stats().num_burst_steps
        engine.step()
        assert engine.stats().num_burst_steps == before
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_burst_steps > 0  # the second one, alone


def assert_native_step_is_the_forward(model, config, cases, seed: int, blocks: int = 256,
                                      max_len: int = 1024, threads: int = 2) -> None:
    """Each case (decodes, prompts, cached: token counts) as one step of random sequences, each decode with all but
    its last token computed, each prompt after ``cached`` computed tokens: ``model``'s native step and its torch
    forward on one runner give the same hidden states, bit for bit; and for a step of decodes alone, the engine's
    call (the scheduler's lists, the LM head in the same call) the same logits as the torch head."""
    import itertools

    from corral.engine.model_runner import _NO_LENS, _NO_TABLES, ModelRunner
    from corral.engine.sampling_params import SamplingParams
    from corral.engine.sequence import Sequence

    runner = ModelRunner(EngineConfig(quantization="w4a8", dtype="float32", kv_cache_dtype="float32",
                                      num_kv_blocks=blocks, num_threads=threads, max_model_len=max_len), config, None,
                         model=model)
    numbers, generator = itertools.count(1), torch.Generator().manual_seed(seed)

    def sequence(tokens, computed):
        seq = Sequence("r", torch.randint(1, config.vocab_size, (tokens,), generator=generator).tolist(),
                       SamplingParams())
        seq.block_table = [next(numbers) for _ in range(-(-(tokens + 1) // runner.block_size))]
        seq.num_computed_tokens = computed
        return seq

    with torch.inference_mode():
        for decodes, prompts, cached in cases:
            seqs = [sequence(n, n - 1) for n in decodes] + [sequence(n + cached, cached) for n in prompts]
            ids, positions, meta = runner.prepare(seqs, [1] * len(decodes) + prompts)
            expected = model.forward(ids, positions, meta, runner.kv_caches)
            group = meta.decodes[0] if meta.decodes else None
            got = model.native_step(ids, positions, meta.slot_mapping, group.block_tables if group else _NO_TABLES,
                                    group.context_lens if group else _NO_LENS, *runner.whole_kv, spans=meta.prefills)
            assert torch.equal(got, expected), (decodes, prompts, cached)
            if not prompts and model.native_step.head_tiles is not None:
                logits = model.native_step.decode(ids.tolist(), positions.tolist(), meta.slot_mapping.tolist(),
                                                  [seq.block_table for seq in seqs],
                                                  [p + 1 for p in positions.tolist()], 2, *runner.whole_kv)
                assert torch.equal(logits, model.lm_head(expected)), decodes


def q6_blocks_of(weight: torch.Tensor):
    """``weight`` [N, K] as Q6 blocks the way llama.cpp's Q6_K rounds (an int8 scale per 16 under a float16 d per 32
    here): codes 0..63."""
    from corral.engine.quant import Q6Blocks

    rows, cols = weight.shape
    w = weight.float().view(rows, cols // 32, 2, 16)
    step = w.abs().amax(-1) / 31  # each half block's step, then d so that the larger one's scale is 127
    d = (step.amax(-1) / 127).half().float().clamp_min(2 ** -24)
    sc = torch.round(step / d[..., None]).clamp(-127, 127)
    safe = torch.where(sc == 0, 1.0, sc * d[..., None])
    codes = (torch.round(w / safe[..., None]) + 32).clamp(0, 63)
    return Q6Blocks(codes.to(torch.uint8).view(rows, cols), d, sc.to(torch.int8).view(rows, cols // 16))


def test_a_model_with_q8_linears_among_its_q4_ones_steps_natively_as_its_torch_path(engines):
    """A model whose layers mix Q4, Q5, Q6 and Q8 linears (as a GGUF with Q5/Q6_K/Q8_0 tensors beside its Q4 ones
    loads under w4a8) in different layers and places, a fused gate/up of Q6 parts and fused layers split into parts
    of different kinds among them: the native step runs each at its kind, whole and cut to its first 12 layers
    (self-speculation's slice of the weight buffer), with the same tokens and logprobs as the torch path."""
    from corral.engine.model import LlamaModel
    from corral.engine.quant import Q5Blocks, Q8Blocks, quantize_q8_blocks
    from corral.engine.weights import load_weights
    from corral.models import load_model_config, resolve_model

    target = engines["native"]
    files = resolve_model(None)
    config = load_model_config(files)
    weights = load_weights(files, config, torch.float32, keep_q4=True, keep_q8=True)
    for layer, name in ((2, "self_attn.v_proj"), (5, "mlp.down_proj"), (11, "self_attn.o_proj"), (20, "mlp.up_proj")):
        key = f"model.layers.{layer}.{name}.weight"
        weights[key] = Q8Blocks(*quantize_q8_blocks(weights[key].dequantize()))
    generator = torch.Generator().manual_seed(1)
    for layer, name in ((3, "self_attn.q_proj"), (7, "mlp.down_proj"), (9, "mlp.gate_proj")):
        key = f"model.layers.{layer}.{name}.weight"  # every code's fifth bit used: codes 2q + a random bit, d / 2
        q4 = weights[key]
        extra = torch.randint(0, 2, q4.codes.shape, generator=generator, dtype=torch.uint8)
        weights[key] = Q5Blocks(2 * q4.codes + extra, q4.scale / 2, q4.zero - 4 * q4.scale)  # near the Q4 weights
    for layer, name in ((4, "mlp.down_proj"), (8, "self_attn.o_proj"), (10, "mlp.gate_proj"), (10, "mlp.up_proj")):
        key = f"model.layers.{layer}.{name}.weight"
        weights[key] = q6_blocks_of(weights[key].dequantize())
    model = LlamaModel(config, weights, torch.float32, "w4a8")
    kinds = model.native_step.kinds.tolist()
    # q, k, v, o, gate, up, down: a Q8 value or up projection beside Q4 parts runs split, each part at its kind; a
    # Q5 part makes its Q4 siblings Q5 (the same weights)
    assert (kinds[2], kinds[3], kinds[5], kinds[7], kinds[9], kinds[11], kinds[20], kinds[0]) == (
        [4, 4, 8, 4, 4, 4, 4], [5, 5, 5, 4, 4, 4, 4], [4, 4, 4, 4, 4, 4, 8], [4, 4, 4, 4, 4, 4, 5],
        [4, 4, 4, 4, 5, 5, 4], [4, 4, 4, 8, 4, 4, 4], [4, 4, 4, 4, 4, 8, 4], [4] * 7)
    assert (kinds[4], kinds[8], kinds[10]) == ([4, 4, 4, 4, 4, 4, 6], [4, 4, 4, 6, 4, 4, 4], [4, 4, 4, 4, 6, 6, 4])
    prompts = [chat(target, q) for q in QUESTIONS[:6]]
    for cut in (model, model.truncated(12)):
        outputs = native_and_torch(target, cut, prompts)
        assert outputs["native"] == outputs["torch"]
    assert outputs["native"] != run(target, prompts)  # the cut model: 12 layers, not 30


@pytest.mark.parametrize("heads,kv_heads,head_dim,qkv_bias", [(4, 1, 128, False), (8, 2, 64, False),
                                                                (6, 3, 128, False), (7, 1, 64, True)])
def test_other_llama_shapes_step_natively_as_their_torch_path(heads, kv_heads, head_dim, qkv_bias):
    """Random Llamas of other shapes than the shipped model's (9 heads of 64 over 3 KV heads): a head size of 128
    with 4 queries per KV head (Llama 3.2's), 8 heads of 64 over 2, 6 of 128 over 3, an untied head and Llama 3.1's
    RoPE factors; and a Qwen2 (7 heads of 64 over one, as Qwen2.5-0.5B's 14 over 2, with a Q/K/V bias and no RoPE
    factors). Their W4A8 layers stepped natively give the torch forward's hidden states bit for bit: decodes at
    contexts that take one, two and three attention chunks, prompts beside them, and a chunk over cached context."""
    from corral.engine.model import LlamaModel
    from corral.models import ModelConfig

    hidden, ffn, vocab, layers = heads * head_dim, 768, 320, 2
    factors = tuple(1.0 if i < head_dim // 8 else 8.0 for i in range(head_dim // 2))
    config = ModelConfig("Qwen2ForCausalLM" if qkv_bias else "llama", layers, hidden, ffn, heads, kv_heads, head_dim,
                         vocab, 1024, 1000000.0 if qkv_bias else 500000.0, 1e-6 if qkv_bias else 1e-5, False, 1, (2,),
                         rope_scaling=None if qkv_bias else {"freq_factors": factors}, attention_bias=qkv_bias)
    generator = torch.Generator().manual_seed(heads * 1000 + head_dim)

    def dense(rows, cols):
        return torch.randn(rows, cols, generator=generator) / cols ** 0.5

    def norm():
        return 1 + 0.1 * torch.randn(hidden, generator=generator)

    weights = {"model.embed_tokens.weight": dense(vocab, hidden), "lm_head.weight": dense(vocab, hidden),
               "model.norm.weight": norm()}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update(layer_weights(i, dense, norm, hidden=hidden, heads=heads, kv_heads=kv_heads,
                                     head_dim=head_dim, ffn=ffn))
        if qkv_bias:  # Qwen2's biases are large beside the products: 0.5 here
            weights.update({p + f"self_attn.{x}_proj.bias": 0.5 * torch.randn(rows, generator=generator)
                            for x, rows in (("q", hidden), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim))})
    model = LlamaModel(config, weights, torch.float32, "w4a8")
    assert model.native_step is not None
    assert (model.native_step.qkv_bias is not None) == qkv_bias
    assert_native_step_is_the_forward(model, config, (([200], [], 0), ([300, 700, 41], [], 0),
                                                      ([90, 520], [20, 33], 0), ([50], [40], 300), ([], [130], 0)),
                                      seed=heads)
