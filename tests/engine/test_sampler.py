"""Sampler: each filter samples the distribution it defines (chi-square against a numpy oracle, fixed seeds),
bias and penalties match their formulas exactly, masked tokens are never drawn, seeds are batch-independent."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from corral.engine.sampler import DraftRows, Sampler, SamplingRow, make_generator
from corral.engine.sampling_params import SamplingParams
from corral.kernels import cpu_ops

LOGITS = np.array([2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.5], dtype=np.float64)
NUM_DRAWS = 20_000


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def oracle(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution the documented order defines, written from the definitions, not from the sampler."""
    p = softmax(logits / params.temperature)
    if params.min_p:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
    if params.top_k:
        p = np.where(p >= np.sort(p)[::-1][params.top_k - 1], p, 0.0)
    p = p / p.sum()
    if params.top_p < 1:
        order = np.argsort(-p)
        mass_before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, dtype=bool)
        keep[order[mass_before < params.top_p]] = True
        p = np.where(keep, p, 0.0)
    return p / p.sum()


def draw_counts(params: SamplingParams, seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(NUM_DRAWS, 1)
    rows = [SamplingRow(params, (), (), None)] * NUM_DRAWS
    token_ids = Sampler()(logits, rows).token_ids
    return np.bincount(token_ids, minlength=len(LOGITS))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.7, min_p=0.05, top_k=6, top_p=0.9),
], ids=["t1", "t0.5", "t2", "top_k3", "top_p0.6", "min_p0.2", "all"])
def test_draws_follow_the_defined_distribution(params):
    counts = draw_counts(params, seed=int(1000 * params.temperature + 10 * params.top_k + 100 * params.top_p))
    expected = oracle(LOGITS, params)
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew outside the support: {counts}"
    assert chisquare(counts[support], NUM_DRAWS * expected[support]).pvalue > 1e-3
    if params != SamplingParams():
        # Power: the same draws must reject the untouched softmax, or this test could not tell them apart.
        plain = softmax(LOGITS)
        assert chisquare(counts, NUM_DRAWS * plain).pvalue < 1e-6


def test_bias_and_penalties_match_their_formulas_exactly():
    logits = np.array([1.0, -2.0, 0.5, 3.0, -0.25, 0.0, 2.0, -1.0], dtype=np.float32)
    params = SamplingParams(logit_bias={0: 1.5, 7: -100, 4: 0.75}, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.25)
    prompt, output = (1, 3), (3, 5, 3, 6)
    got = Sampler().process(torch.tensor(logits)[None], [SamplingRow(params, prompt, output, None)])

    expected = logits.copy()
    for token_id, bias in params.logit_bias:
        expected[token_id] += np.float32(bias)
    for token_id in {*prompt, *output}:  # HF: divide positive logits, multiply negative ones, once per token
        expected[token_id] = expected[token_id] / np.float32(1.3) if expected[token_id] > 0 else (
            expected[token_id] * np.float32(1.3))
    for token_id in set(output):  # OpenAI: mu - c * alpha_frequency - [c > 0] * alpha_presence
        expected[token_id] -= np.float32(output.count(token_id)) * np.float32(0.4)
        expected[token_id] -= np.float32(0.25)
    np.testing.assert_array_equal(got[0].numpy(), expected)
    assert not np.array_equal(expected, logits)


def test_bias_never_unmasks_and_penalties_skip_masked_tokens():
    logits = torch.zeros(1, 40)
    bitmask = torch.tensor([[0b1010]], dtype=torch.int32).expand(1, 2).contiguous()
    bitmask[0, 1] = 0
    params = SamplingParams(logit_bias={0: 100, 1: 5}, repetition_penalty=2.0, frequency_penalty=1)
    got = Sampler().process(logits, [SamplingRow(params, (0, 1), (0, 3), None)], bitmask)
    assert torch.nonzero(torch.isfinite(got[0])).flatten().tolist() == [1, 3]
    assert got[0, 1].item() == 5.0 / 2.0 and got[0, 3].item() == -1.0


def test_min_tokens_holds_back_eos_and_stop_ids_unless_the_grammar_allows_nothing_else():
    sampler = Sampler(eos_token_ids=(0,))
    params = SamplingParams(min_tokens=3, stop_token_ids=(2,))
    logits = torch.zeros(1, 8)
    short = sampler.process(logits, [SamplingRow(params, (5,), (4, 4), None)])
    assert torch.isinf(short[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(sampler.process(logits, [SamplingRow(params, (5,), (4, 4, 4), None)])).all()
    only_eos = torch.tensor([[0b1]], dtype=torch.int32)
    forced = sampler.process(logits, [SamplingRow(params, (5,), (), None)], only_eos)
    assert torch.isfinite(forced[0]).nonzero().flatten().tolist() == [0]


def test_greedy_takes_the_processed_argmax_and_reports_raw_logprobs():
    raw = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0, 2.0, 1.0, 0.5]])
    bitmask = torch.tensor([[0b11101100]], dtype=torch.int32)  # token 1, the raw argmax, is masked
    params = SamplingParams(temperature=0, logprobs=3, logit_bias={5: 1.5})
    result = Sampler()(raw, [SamplingRow(params, (), (), None)], bitmask)
    raw_logprobs = torch.log_softmax(raw[0], dim=0)
    assert result.token_ids == [2]
    assert result.logprobs[0] == pytest.approx(raw_logprobs[2].item(), abs=1e-6)
    assert [t for t, _ in result.top_logprobs[0]] == [1, 2, 3]
    assert [v for _, v in result.top_logprobs[0]] == pytest.approx(raw_logprobs[[1, 2, 3]].tolist(), abs=1e-6)
    result = Sampler()(raw, [SamplingRow(SamplingParams(temperature=0, logit_bias={5: 2.5}), (), (), None)],
                       bitmask)
    assert result.token_ids == [5] and result.top_logprobs is None


@pytest.mark.parametrize("temperature", [2.554378748105324e-304, 1e-30, 9e-6])
def test_a_vanishing_temperature_decodes_greedily(temperature):
    # dividing by such a temperature overflows float32 (every logit infinite, then NaN probabilities)
    raw = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0, 2.0, 1.0, 0.5]])
    bitmask = torch.tensor([[0b11101100]], dtype=torch.int32)  # token 1 masked: the allowed argmax is 2
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    rows = [SamplingRow(params, (), (), make_generator(seed)) for seed in range(4)]
    assert Sampler()(raw.repeat(4, 1), rows, bitmask.repeat(4, 1)).token_ids == [2] * 4


def test_padded_columns_are_never_sampled():
    logits = torch.zeros(400, 16)
    logits[:, 10:] = 100.0
    rows = [SamplingRow(SamplingParams(temperature=t), (), (), None) for t in (0, 1.0, 5.0, 50.0)] * 100
    token_ids = Sampler(vocab_size=10)(logits, rows).token_ids
    assert max(token_ids) < 10


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [rows, vocab] -> int32 [rows, ceil(vocab / 32)] in the Vocabulary bitmask layout."""
    padded = np.zeros((allowed.shape[0], -(-allowed.shape[1] // 32) * 32), dtype=bool)
    padded[:, : allowed.shape[1]] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<i4").astype(np.int32)


def test_ten_thousand_constrained_draws_never_hit_a_masked_token():
    vocab_size, width, batch = 2001, 2048, 500
    generator = torch.Generator().manual_seed(0)
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=1.5), SamplingParams(top_p=0.95),
             SamplingParams(top_k=100, temperature=3.0), SamplingParams(min_p=1e-4, temperature=10.0)]
    torch.manual_seed(1)
    num_draws = 0
    for call in range(20):
        allowed = torch.rand(batch, vocab_size, generator=generator) < 0.02
        allowed[:, call] = True  # never an empty row
        # Adversarial logits: every masked token is far more likely than every allowed one.
        logits = torch.where(allowed, -20.0, 20.0) + torch.randn(batch, vocab_size, generator=generator)
        logits = torch.cat([logits, torch.full((batch, width - vocab_size), 50.0)], dim=1)
        bitmask = torch.from_numpy(pack(allowed.numpy()))
        rows = [SamplingRow(kinds[i % len(kinds)], (), (), make_generator(i) if i % 3 else None)
                for i in range(batch)]
        token_ids = torch.tensor(Sampler(vocab_size=vocab_size)(logits, rows, bitmask).token_ids)
        assert allowed[torch.arange(batch), token_ids].all()
        num_draws += batch
    assert num_draws == 10_000


def test_masked_rows_limits_the_mask_to_those_rows():
    logits = torch.zeros(3, 64)
    logits[:, 7] = 50.0
    bitmask = torch.tensor([[1 << 3, 0]] * 3, dtype=torch.int32)
    rows = [SamplingRow(SamplingParams(temperature=0), (), (), None)] * 3
    assert Sampler()(logits, rows, bitmask, torch.tensor([0, 2])).token_ids == [3, 7, 3]


def run_steps(sampler, logits_by_step, rows_of_step, position):
    """Decode ``len(logits_by_step)`` steps, feeding each row's tokens back (penalties see them)."""
    outputs = [[] for _ in rows_of_step]
    for logits in logits_by_step:
        rows = [SamplingRow(params, (1, 2), tuple(out), gen) for (params, gen), out in zip(rows_of_step, outputs)]
        for out, token_id in zip(outputs, sampler(logits[: len(rows)], rows).token_ids):
            out.append(token_id)
    return outputs[position]


def test_same_seed_same_tokens_alone_and_in_a_mixed_batch():
    sampler, steps = Sampler(), 25
    generator = torch.Generator().manual_seed(3)
    base = [torch.randn(6, 1000, generator=generator) for _ in range(steps)]
    seeded = SamplingParams(seed=42, temperature=1.3, top_p=0.9, frequency_penalty=0.5)

    alone = run_steps(sampler, [b[:1] for b in base], [(seeded, make_generator(42))], 0)
    # The same logits row sits at position 3 of a batch of greedy, unseeded and other-seeded rows.
    mixed_logits = [torch.cat([b[1:4], b[:1], b[4:]]) for b in base]
    others = [(SamplingParams(temperature=0), None), (SamplingParams(top_k=5), None),
              (SamplingParams(seed=7, min_p=0.1), make_generator(7)), (SamplingParams(temperature=2.0), None),
              (SamplingParams(seed=42, temperature=0.5), make_generator(42))]
    torch.manual_seed(99)
    mixed = run_steps(sampler, mixed_logits, others[:3] + [(seeded, make_generator(42))] + others[3:], 3)
    assert alone == mixed
    other_seed = run_steps(sampler, [b[:1] for b in base], [(seeded, make_generator(43))], 0)
    assert other_seed != alone


def test_a_row_with_no_allowed_token_gets_no_token_and_the_others_theirs():
    rows = [SamplingRow(SamplingParams(), (), (), None), SamplingRow(SamplingParams(temperature=0), (), (), None)]
    logits = torch.zeros(2, 32)
    logits[1, 5] = 1.0
    result = Sampler()(logits, rows, torch.tensor([[0], [-1]], dtype=torch.int32), [0, 1])
    assert result.token_ids == [-1, 5] and math.isnan(result.logprobs[0]) and math.isfinite(result.logprobs[1])


@pytest.mark.skipif(__import__("corral.native", fromlist=["x"]).module() is None, reason="needs the native module")
def test_the_native_greedy_pass_gives_the_general_paths_tokens_and_logprobs_bit_for_bit(monkeypatch):
    from corral.kernels import cpu_ops

    rng = np.random.default_rng(7)
    vocab, width, rows = 1000, 1024, 6  # padded columns past the vocabulary are never chosen
    sampler, general = Sampler(vocab), Sampler(vocab)
    taken = []
    pick = cpu_ops.greedy_pick

    def counted(*args):
        out = pick(*args)
        taken.append(out is not None)
        return out

    for trial in range(40):
        logits = torch.from_numpy(rng.integers(-6, 6, (rows, width)).astype(np.float32) / 4)  # many ties
        logits[:, vocab:] = 100.0
        logits[rng.random((rows, width)) < 0.1] = float("-inf")
        bits = rng.random((rows, width)) < rng.choice([0.002, 0.05, 0.5, 1.0])
        bits[np.arange(rows), rng.integers(0, vocab, rows)] = True  # every row allows one finite column at least
        bitmask = torch.from_numpy(np.packbits(bits[:, :vocab], axis=1, bitorder="little").view(np.uint8).copy())
        words = np.zeros((rows, (vocab + 31) // 32 * 4), dtype=np.uint8)
        words[:, : bitmask.shape[1]] = bitmask.numpy()
        bitmask = torch.from_numpy(words.view(np.int32))
        for r in range(rows):  # a row's one sure column stays finite
            allowed = np.flatnonzero(bits[r, :vocab])
            logits[r, allowed[0]] = 0.5
        masked_rows = torch.tensor(sorted(rng.choice(rows, rng.integers(1, rows + 1), replace=False)))
        params = SamplingParams(temperature=0, min_tokens=trial % 3)
        batch = [SamplingRow(params, (1, 2), (3,) * (trial % 4), None) for _ in range(rows)]
        monkeypatch.setattr(cpu_ops, "greedy_pick", counted)
        fast = sampler(logits, batch, bitmask, masked_rows)
        monkeypatch.setattr(cpu_ops, "greedy_pick", lambda *args: None)
        slow = general(logits, batch, bitmask, masked_rows)
        assert fast.token_ids == slow.token_ids, trial
        assert fast.logprobs == slow.logprobs, trial  # the same float32 arithmetic
        assert fast.top_logprobs is None and slow.top_logprobs is None
    assert taken and all(taken)  # every batch whose min_tokens was reached took the native pass


@pytest.mark.skipif(__import__("corral.native", fromlist=["x"]).module() is None, reason="needs the native module")
def test_the_native_greedy_pass_leaves_nan_rows_to_the_general_path():
    from corral.kernels import cpu_ops

    logits = torch.tensor([[0.0, float("nan"), 1.0, 2.0], [0.0, 1.0, 3.0, 2.0], [0.0, float("inf"), 1.0, 2.0]])
    assert cpu_ops.greedy_pick(logits, 4, None, None) is None  # the general path decides, as before:
    rows = [SamplingRow(SamplingParams(temperature=0), (), (), None)] * 2 + \
        [SamplingRow(SamplingParams(temperature=0.8, seed=1), (), (), make_generator(1))]
    result = Sampler()(logits, rows)  # torch's argmax picks the NaN, and the +inf row's draw nothing finite
    assert result.token_ids == [-1, 2, -1], "the rows with nothing finite to choose get no token, the other its own"
    assert math.isnan(result.logprobs[0]) and math.isnan(result.logprobs[2])


@pytest.mark.skipif(__import__("corral.native", fromlist=["x"]).module() is None, reason="needs the native module")
def test_the_native_greedy_pass_leaves_rows_with_plus_inf_to_the_general_path():
    from corral.kernels import cpu_ops

    # +inf anywhere makes the log-normalizer inf - inf; masked out or not, the general path decides
    logits = torch.tensor([[0.0, float("inf"), 1.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    assert cpu_ops.greedy_pick(logits, 4, None, None) is None
    bitmask = torch.tensor([[0b1101], [0b1111]], dtype=torch.int32)
    assert cpu_ops.greedy_pick(logits, 4, bitmask, torch.tensor([True, True])) is None
    picked = cpu_ops.greedy_pick(logits[1:], 4, None, None)
    assert picked is not None and picked[0] == [3]


@pytest.mark.skipif(__import__("corral.native", fromlist=["x"]).module() is None, reason="needs the native module")
def test_greedy_verification_by_the_native_pass_equals_the_general_path(monkeypatch):
    from corral.engine.sampler import DraftRows
    from corral.kernels import cpu_ops

    rng = np.random.default_rng(11)
    vocab, width = 500, 512
    pick, taken = cpu_ops.greedy_pick, []

    def counted(*args):
        out = pick(*args)
        taken.append(out is not None)
        return out

    for trial in range(30):
        lengths = [int(k) for k in rng.integers(0, 4, rng.integers(1, 4))]  # drafts of 0-3 tokens
        num_rows = sum(k + 1 for k in lengths)
        logits = torch.from_numpy(rng.integers(-6, 6, (num_rows, width)).astype(np.float32) / 4)  # ties
        bits = rng.random((num_rows, vocab)) < 0.3
        bits[np.arange(num_rows), rng.integers(0, vocab, num_rows)] = True
        words = np.zeros((num_rows, (vocab + 31) // 32 * 4), dtype=np.uint8)
        packed = np.packbits(bits, axis=1, bitorder="little")
        words[:, : packed.shape[1]] = packed
        bitmask = torch.from_numpy(words.view(np.int32).copy())
        masked = torch.tensor(sorted(rng.choice(num_rows, rng.integers(1, num_rows + 1), replace=False)))
        params = SamplingParams(temperature=0, min_tokens=trial % 2)
        rows, drafts, start = [], [], 0
        for k in lengths:
            work = logits[start: start + k + 1].clone()
            for j in range(k + 1):
                if start + j in masked.tolist():
                    work[j, ~torch.from_numpy(np.pad(bits[start + j], (0, width - vocab)))] = float("-inf")
            argmax = work.argmax(dim=1).tolist()
            tokens = [argmax[j] if rng.random() < 0.7 else int(rng.integers(0, vocab)) for j in range(k)]
            drafts.append(DraftRows(start, tokens, bool(rng.random() < 0.8), [False] * k))
            rows += [SamplingRow(params, (1,), (2,) * (trial % 3) + tuple(tokens[:j]), None) for j in range(k + 1)]
            start += k + 1
        monkeypatch.setattr(cpu_ops, "greedy_pick", counted)
        fast = Sampler(vocab).verify(logits, rows, drafts, bitmask, masked)
        monkeypatch.setattr(cpu_ops, "greedy_pick", lambda *args: None)
        monkeypatch.setattr(cpu_ops, "sample_pick", lambda *args, **kwargs: None)  # the torch path's argmax
        slow = Sampler(vocab).verify(logits, rows, drafts, bitmask, masked)
        monkeypatch.undo()
        assert fast == slow, trial  # tokens, acceptances, rows and logprobs, bit for bit
    assert any(taken)  # the native pass ran (min_tokens 1 with no output yet keeps the general path)


def test_an_empty_batch_samples_and_verifies_nothing():
    from corral.kernels import cpu_ops

    empty = torch.empty(0, 8)
    assert Sampler()(empty, []).token_ids == []
    assert Sampler().verify(empty, [], []) == []
    if __import__("corral.native", fromlist=["x"]).module() is not None:
        assert cpu_ops.greedy_pick(empty, 8, None, None) == ([], [])


def test_a_numpy_bitmask_and_a_list_of_rows_sample_as_tensors_do():
    """The engine hands the bitmask as a numpy array and its rows as a list (no torch call on the greedy pass);
    greedy and seeded sampled rows, fast path and general path, take them as they take tensors."""
    rng = np.random.default_rng(5)
    rows, vocab = 5, 300
    logits = torch.from_numpy(rng.normal(size=(rows, vocab)).astype(np.float32))
    words = rng.integers(-2 ** 31, 2 ** 31, size=(rows, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    words[:, 0] |= 1  # every row allows token 0
    masked = [0, 2, 3]
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2),
                   SamplingParams(temperature=0.8, seed=3, top_k=20)):
        def batch():
            return [SamplingRow(params, (1,), (), make_generator(params.seed)) for _ in range(rows)]
        as_numpy = Sampler(vocab)(logits, batch(), words, masked)
        as_tensors = Sampler(vocab)(logits, batch(), torch.from_numpy(words), torch.tensor(masked))
        assert as_numpy == as_tensors, params


def test_a_rows_draw_is_the_same_alone_and_beside_a_row_the_torch_path_takes():
    """A row is drawn by the native pass whatever shares its batch, a row it cannot decide (a penalty past
    float32's range) included: that row alone goes to the torch path."""
    sampler, steps = Sampler(), 25
    generator = torch.Generator().manual_seed(4)
    base = [torch.randn(2, 1000, generator=generator) * 3 for _ in range(steps)]
    plain = SamplingParams(seed=42, temperature=1.3, top_p=0.9, top_k=50, min_p=0.01, frequency_penalty=0.2)
    alone = run_steps(sampler, [b[:1] for b in base], [(plain, make_generator(42))], 0)
    undecided = SamplingParams(seed=7)
    object.__setattr__(undecided, "repetition_penalty", 1e39)  # past the checked bounds: the native pass gives up
    beside = run_steps(sampler, [torch.cat([b[1:], b[:1]]) for b in base],
                       [(undecided, make_generator(7)), (plain, make_generator(42))], 1)
    assert alone == beside and len(set(alone)) > 3  # drawn, not one token over and over


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("penalty", [0.0, 0.5])
def test_parameters_at_the_edges_of_float32_sample_what_they_mean(penalty, native, monkeypatch):
    """top_p below float32's smallest keeps the first token alone; a temperature past its largest makes the
    allowed tokens alike (never a masked one, never a NaN); a top_k past the vocabulary keeps every token. In the
    native pass and in the torch path (the native one turned off)."""
    if not native:
        monkeypatch.setattr(cpu_ops, "sample_pick", lambda *args, **kwargs: None)
        monkeypatch.setattr(cpu_ops, "greedy_pick", lambda *args, **kwargs: None)
    logits = torch.linspace(0.0, 6.0, 64).repeat(40, 1)  # the largest is token 63
    bitmask = torch.tensor([[0x0000FFFF, 0x0F000000]] * 40, dtype=torch.int32)  # tokens 0-15 and 56-59
    tiny_p = SamplingParams(temperature=1.0, top_p=5e-324, frequency_penalty=penalty)
    rows = [SamplingRow(tiny_p, (), (), make_generator(i)) for i in range(40)]
    assert set(Sampler()(logits, rows).token_ids) == {63}
    assert set(Sampler()(logits, rows, bitmask).token_ids) == {59}
    hot = SamplingParams(temperature=1e300, frequency_penalty=penalty, top_k=10**30)
    rows = [SamplingRow(hot, (), (), make_generator(i)) for i in range(40)]
    drawn = Sampler()(logits, rows, bitmask).token_ids
    assert set(drawn) <= {*range(16), *range(56, 60)} and len(set(drawn)) > 5
    verified = Sampler().verify(logits[:3], rows[:3], [DraftRows(0, [57, 58], True, [False, False])], bitmask[:3])
    assert set(verified[0].token_ids) <= {*range(16), *range(56, 60)}  # the draft's rows, the same rules
    monkeypatch.undo()
    tail = torch.tensor([[0.0, 200.0, 0.0, 0.0]])  # far below the max: probability 0, even at u = 0
    assert cpu_ops.sample_pick(tail, 4, None, None, [1.0], [0], [1.0], [0.0], [0.0], [0])[0] == [1]
