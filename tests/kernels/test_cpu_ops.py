"""The fused CPU ops against the torch expressions they replace in the model (the fallback path), float32 and
bfloat16: RoPE and the residual add round exactly as torch does; RMSNorm may differ only through the order of
its sum of squares, SiLU only through its exp (both within one bf16 rounding step)."""

import platform

import numpy as np
import pytest
import torch

from corral.engine.model import apply_rope, rms_norm, silu_mul
from corral.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(torch.float32), reason="native module off or missing: kernels unavailable")

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 64, 300]  # 300 x 576 crosses the size where the kernels go parallel


def close(dtype):
    # one bf16 step (2^-8 relative) for a rounding that went the other way; float32 a few ulp
    return dict(rtol=2 ** -7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)


def assert_rarely_differs(got, expected):
    """In bf16 a different last float32 bit changes the rounded result only near a rounding boundary."""
    if got.dtype == torch.bfloat16:
        mismatched = (got != expected).float().mean().item()
        assert mismatched < 0.01, f"{mismatched:.2%} of the outputs differ from torch's"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_equals_add_then_torch_norm(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 576, generator=gen).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    summed = h + delta
    expected = rms_norm(summed, weight, 1e-5)
    got = cpu_ops.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, summed), "the residual add is done in place and rounds as torch's add"
    torch.testing.assert_close(got, expected, **close(dtype))
    assert_rarely_differs(got, expected)
    torch.testing.assert_close(cpu_ops.add_rms_norm(h.clone(), None, weight, 1e-5), rms_norm(h, weight, 1e-5),
                               **close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_in_place_equals_torch_rope_on_a_strided_view(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)  # Q | K | V, as the model has
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    positions = torch.randint(0, 2048, (rows,), generator=gen)
    angles = torch.outer(torch.arange(2048, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    expected = apply_rope(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    untouched = qkv[:, (heads + kv_heads) * dim:].clone()
    cpu_ops.rope_(qk, positions, cos, sin)
    torch.testing.assert_close(qk, expected, rtol=0, atol=0)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], untouched), "V must not be touched"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_equals_torch(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (3 * torch.randn(rows, 2 * 1536, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # the exp's clamps and zero
    expected, got = silu_mul(gate_up), cpu_ops.silu_mul(gate_up)
    torch.testing.assert_close(got, expected, **close(dtype))
    assert_rarely_differs(got, expected)


@pytest.mark.parametrize("rows", [1, 64])  # one thread, and a team of two
def test_silu_mul_flushes_only_its_own_subnormal_results(rows):
    """On x86 the SiLU runs with results flushed to zero (subnormals cost Intel cores a microcode assist each): a
    result under the smallest normal float is 0, and the calling thread gets its own float mode back, subnormals
    and all. Other CPUs keep the subnormal results (kernels_impl.h: FlushToZero)."""
    gate_up = torch.randn(rows, 2 * 1536)
    gate_up[0, :2] = torch.tensor([1e-39, 2.0])  # silu(1e-39) = 5e-40, subnormal
    gate_up[0, 1536: 1538] = torch.tensor([1.0, 1e-39])  # silu(2) * 1e-39 also
    got = cpu_ops.silu_mul(gate_up)
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert got[0, 0].item() == 0.0 and got[0, 1].item() == 0.0
    else:
        assert 0.0 < got[0, 0].item() < 1.2e-38 and 0.0 < got[0, 1].item() < 1.2e-38
    torch.testing.assert_close(got[:, 2:], silu_mul(gate_up)[:, 2:], rtol=1e-5, atol=1e-6)
    assert (torch.tensor([1e-30]) * torch.tensor([1e-10])).item() != 0.0  # 1e-40: this thread still has them



@pytest.mark.parametrize("rows, width, n", [(1, 49152, 49152), (3, 1000, 997), (16, 49152, 49152), (2, 40, 1)])
def test_log_normalizers_equal_torch_logsumexp(rows, width, n):
    torch.manual_seed(rows + n)
    logits = torch.randn(rows, width) * 8
    logits[0, : n // 2] = float("-inf")  # masked columns add nothing
    got = cpu_ops.log_normalizers(logits, n)
    expected = torch.logsumexp(logits[:, :n], dim=-1)
    assert torch.allclose(got, expected, rtol=2e-6, atol=0)



def test_log_normalizers_of_a_row_with_nothing_allowed_is_minus_infinity_and_odd_inputs_fall_back():
    logits = torch.full((2, 8), float("-inf"))
    logits[1, 3] = 2.5
    assert cpu_ops.log_normalizers(logits, 8).tolist() == [float("-inf"), 2.5]
    assert cpu_ops.log_normalizers(logits.double(), 8) is None  # torch's logsumexp then runs
    assert cpu_ops.log_normalizers(torch.randn(4, 8)[:, :4], 4) is None  # not contiguous


_GREEDY_CHECK = """
import json, sys, numpy as np, torch
from corral import native
from corral.kernels import cpu_ops
rng = np.random.default_rng(3)
wrong = []
for trial in range(60):
    rows, n = int(rng.integers(1, 9)), int(rng.choice([1, 63, 64, 65, 1000, 4099, 49152]))
    width = n + int(rng.integers(0, 40))
    logits = torch.from_numpy(rng.integers(-8, 8, (rows, width)).astype(np.float32) / 4)  # ties everywhere
    logits[:, n:] = 100.0  # padding past the vocabulary is never chosen
    logits[torch.from_numpy(rng.random((rows, width)) < 0.2)] = float("-inf")
    for r in range(rows):  # one clear winner, anywhere in the row (past the first chunks too), sometimes twice
        at = int(rng.integers(0, n))
        logits[r, at] = 3.0
        if rng.random() < 0.5:
            logits[r, int(rng.integers(at, n))] = 3.0
    picked = cpu_ops.greedy_pick(logits, n, None, None)
    expected = [int(np.argmax(row)) for row in logits[:, :n].numpy()]  # numpy's argmax: the first largest
    lse = torch.logsumexp(logits[:, :n], dim=-1)
    if picked is None or picked[0] != expected or not torch.allclose(
            torch.tensor(picked[1]), logits[torch.arange(rows), expected] - lse, rtol=2e-6, atol=2e-6):
        wrong.append(trial)
print(json.dumps({"isa": native.module().kernel_isa, "wrong": wrong}))
"""


@pytest.mark.parametrize("variant", [None, "baseline"] + (
    ["avx2"] if {"avx2", "fma", "f16c", "bmi2"} <= __import__("corral.native", fromlist=["x"]).cpu_flags() else []))
def test_the_greedy_pass_picks_the_first_largest_column_in_every_variant(variant):
    """Unmasked rows of every width around the 64-column chunks the first-largest search tests at once, with the
    largest anywhere and tied: the first of them, and its logit less torch's logsumexp."""
    from tests.kernels.variants import report_in_variant

    report = report_in_variant(_GREEDY_CHECK, **({"CORRAL_NATIVE_BUILD": variant} if variant else {}))
    assert (variant is None or report["isa"].startswith(variant)) and report["wrong"] == [], report


# One random logits row for the draw checks: a width from `widths`, rounded (tied) values with chance `ties`, and
# with chance `masked` a bitmask allowing some columns (at least one): (n, logits [1, n], allowed, bitmask or None).
_RANDOM_ROW = """
def random_row(rng, widths, ties, masked):
    n = int(rng.choice(widths))
    values = rng.standard_normal(n) * float(rng.choice([0.5, 2.0, 6.0]))
    if rng.random() < ties:
        values = np.round(values)
    logits = torch.from_numpy(values.astype(np.float32))[None]
    allowed, bitmask = np.ones(n, bool), None
    if rng.random() < masked:
        allowed = rng.random(n) < float(rng.choice([0.01, 0.3, 0.9]))
        allowed[int(rng.integers(n))] = True
        bits = np.zeros(32 * ((n + 31) // 32), np.uint64)
        bits[:n] = allowed
        bitmask = (bits.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32)
        bitmask = bitmask.view(np.int32)[None]
    return n, logits, allowed, bitmask
"""

_DRAW_CHECK = """
import json, numpy as np, torch
from corral import native
from corral.engine.sampler import _draw, _filtered_probs
from corral.engine.sampling_params import SamplingParams
from corral.kernels import cpu_ops
""" + _RANDOM_ROW + """
rng = np.random.default_rng(5)
wrong, near = [], 0
for trial in range(400):
    n, logits, allowed, bitmask = random_row(rng, [5, 64, 1000, 49152], 0.3, 0.5)  # ties at the cuts too
    params = SamplingParams(temperature=float(rng.choice([0.3, 0.7, 1.0, 1.5])), top_k=int(rng.choice([0, 1, 5, 50])),
                            top_p=float(rng.choice([1.0, 0.95, 0.8, 0.3])), min_p=float(rng.choice([0.0, 0.05, 0.2])))
    u, top_n = float(rng.random()), int(rng.choice([0, 1, 5, 20]))
    got = cpu_ops.sample_pick(logits, n, bitmask, [0] if bitmask is not None else None, [params.temperature],
                              [params.top_k], [params.top_p], [params.min_p], [u], [top_n])
    if got is not None:  # the raw distribution's most likely: torch's topk values, the lower id first among equals
        values, order = torch.sort(logits[0], descending=True, stable=True)
        lse = float(torch.logsumexp(logits[0], 0))  # the log-normalizer's error bounds theirs (below)
        want_top = list(zip(order[:top_n].tolist(), (values[:top_n] - lse).tolist()))
        if [i for i, _ in got[2][0]] != [i for i, _ in want_top] or \
                any(abs(a - b) > 1e-5 * max(1.0, abs(lse)) for (_, a), (_, b) in zip(got[2][0], want_top)):
            wrong.append([trial, "top logprobs"])
    work = logits.clone()
    work[0, ~torch.from_numpy(allowed)] = float("-inf")
    probs = _filtered_probs(work / params.temperature, [params]).double()
    want = int(_draw(probs, torch.tensor([u], dtype=torch.float64))[0])
    token = got[0][0] if got is not None else -1
    # the native log-normalizer sums 49k exps in float32 over 4-16 lanes: 1e-5 of it (the baseline's 4 lanes
    # measured 8e-6)
    lse = float(torch.logsumexp(logits[0], 0))
    logprob_ok = got is not None and abs(got[1][0] - (float(logits[0, token]) - lse)) < 1e-5 * max(1.0, abs(lse))
    if token == want and logprob_ok:
        continue
    cdf = probs[0].cumsum(0)
    target, slack = u * float(cdf[-1]), 1e-5 * float(cdf[-1])
    low = float(cdf[token - 1]) if token > 0 else 0.0
    # only a target within float32 rounding of the boundary between two tokens' mass may go the other way
    if logprob_ok and probs[0, token] > 0 and low - slack <= target <= float(cdf[token]) + slack:
        near += 1
    else:
        wrong.append([trial, token, want])
print(json.dumps({"isa": native.module().kernel_isa, "wrong": wrong, "near": near}))
"""


@pytest.mark.parametrize("variant", [None, "baseline"] + (
    ["avx2"] if {"avx2", "fma", "f16c", "bmi2"} <= __import__("corral.native", fromlist=["x"]).cpu_flags() else []))
def test_the_native_draw_is_the_torch_samplers_in_every_variant(variant):
    """Rows of 5 to 49,152 columns, masked or not, tied or not, under temperatures, top_k, top_p and min_p: the
    token the torch path's filters and inverse-CDF draw give for the same uniform, and its logprob, except where
    the uniform lands within float32 rounding of a boundary between two tokens' cumulative mass (counted, and few)."""
    from tests.kernels.variants import report_in_variant

    report = report_in_variant(_DRAW_CHECK, **({"CORRAL_NATIVE_BUILD": variant} if variant else {}))
    assert (variant is None or report["isa"].startswith(variant)) and report["wrong"] == [], report
    assert report["near"] <= 4, report


_SHAPED_CHECK = """
import json, numpy as np, torch
from corral import native
from corral.engine.sampler import Sampler, SamplingRow, _draw, _filtered_probs
from corral.engine.sampling_params import SamplingParams
from corral.engine.sequence import Sequence
from corral.kernels import cpu_ops
""" + _RANDOM_ROW + """
rng, tally_rng = np.random.default_rng(11), np.random.default_rng(12)
wrong, near, shaped = [], 0, 0
for trial in range(300):
    # ties, which a rounding that differs from torch's would break differently
    n, logits, allowed, bitmask = random_row(rng, [7, 64, 1000, 49152], 0.4, 0.4)
    span = min(n, 40)  # prompt and output from few ids, so that they repeat
    prompt = rng.integers(0, span, int(rng.integers(1, 30))).tolist()
    output = rng.integers(0, span, int(rng.integers(0, 60))).tolist()
    bias = {int(t): float(rng.choice([-100.0, -3.5, 0.25, 2.0, 100.0]))
            for t in rng.integers(0, n + 5, int(rng.choice([0, 1, 5, 30])))}  # ids past n name no column
    params = SamplingParams(
        temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])), top_k=int(rng.choice([0, 1, 5, 50])),
        top_p=float(rng.choice([1.0, 0.95, 0.8, 0.3])), min_p=float(rng.choice([0.0, 0.05])),
        logit_bias=bias, repetition_penalty=float(rng.choice([1.0, 1.1, 0.8, 1.5])),
        frequency_penalty=float(rng.choice([0.0, 0.5, -0.7, 2.0])),
        presence_penalty=float(rng.choice([0.0, 0.3, -1.0])), max_tokens=200,
        min_tokens=int(rng.choice([0, 100])), stop_token_ids=tuple(int(t) for t in rng.integers(0, n, 2)))
    seq = Sequence("r", prompt, params)
    seq.token_ids += output[: len(output) // 2]
    draft = output[len(output) // 2:]  # a verified row's output: the sequence's, then draft tokens
    row = SamplingRow(params, *seq.spans(draft), None)
    sampler = Sampler(vocab_size=n, eos_token_ids=(int(rng.integers(0, n)),))
    shaping = sampler.shaping(row)
    shaped += shaping is not None
    u, top_n = float(rng.random()), int(rng.choice([0, 3]))
    lists = ([0.0 if params.is_greedy else params.temperature], [params.top_k], [params.top_p], [params.min_p], [u],
             [top_n])
    got = cpu_ops.sample_pick(logits, n, bitmask, [0] if bitmask is not None else None, *lists, [shaping])
    # the same row with its prompt and output read from a tally (caught up before on part of them, at times)
    tally = cpu_ops.token_tally()
    if tally_rng.random() < 0.5:
        tally.catch_up(seq.token_ids, len(prompt), int(tally_rng.integers(0, len(seq.token_ids) + 1)))
    tallied = sampler.shaping(SamplingRow(params, *seq.spans(draft), None, tally))
    if cpu_ops.sample_pick(logits, n, bitmask, [0] if bitmask is not None else None, *lists, [tallied]) != got:
        wrong.append([trial, "tallied"])
    work = sampler.process(logits, [row], torch.from_numpy(bitmask) if bitmask is not None else None,
                           torch.tensor([0]) if bitmask is not None else None)
    token = got[0][0] if got is not None else -1
    if not torch.isfinite(work).any():
        continue
    if params.is_greedy:
        if token != int(torch.argmax(work[0])):  # torch's argmax: the first largest, as the native pass
            wrong.append([trial, "greedy", token, int(torch.argmax(work[0]))])
        continue
    probs = _filtered_probs(work / params.temperature, [params]).double()
    want = int(_draw(probs, torch.tensor([u], dtype=torch.float64))[0])
    if token == want:
        continue
    cdf = probs[0].cumsum(0)
    target, slack = u * float(cdf[-1]), 1e-5 * float(cdf[-1])
    low = float(cdf[token - 1]) if token > 0 else 0.0
    if token >= 0 and probs[0, token] > 0 and low - slack <= target <= float(cdf[token]) + slack:
        near += 1
    else:
        wrong.append([trial, token, want])
print(json.dumps({"isa": native.module().kernel_isa, "wrong": wrong, "near": near, "shaped": shaped}))
"""


@pytest.mark.parametrize("variant", [None, "baseline"] + (
    ["avx2"] if {"avx2", "fma", "f16c", "bmi2"} <= __import__("corral.native", fromlist=["x"]).cpu_flags() else []))
def test_the_native_draw_shapes_rows_as_the_torch_sampler_does_in_every_variant(variant):
    """Rows with a logit bias (ids past the vocabulary too), repetition, frequency and presence penalties over a
    prompt, an output and draft tokens that repeat, and min_tokens holding stops back, masked or not, greedy (tied
    logits, where a rounding unlike torch's would pick another column) and sampled: the torch path's token for the
    same uniform, except within float32 rounding of a boundary between two tokens' mass; and the same draw
    (token, logprob, top logprobs) where a token tally stands for the prompt and output."""
    from tests.kernels.variants import report_in_variant

    report = report_in_variant(_SHAPED_CHECK, **({"CORRAL_NATIVE_BUILD": variant} if variant else {}))
    assert (variant is None or report["isa"].startswith(variant)) and report["wrong"] == [], report
    assert report["near"] <= 4 and report["shaped"] > 250, report


def test_the_native_draw_checks_its_shaping():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])

    def pick(shaping, temperature=0.0):
        return cpu_ops.sample_pick(logits, 4, None, None, [temperature], [0], [1.0], [0.0], [0.5], [0], [shaping])

    assert pick(((), ((1, -5.0),), 1.0, 0.0, 0.0, (), ()))[0] == [2]  # biased down past the next one
    assert pick(((1,), (), 1.0, 0.0, 0.0, (), ()))[0] == [2]  # a stop held back while others are allowed
    seen = (([1, 1, 1], 0, 3),)
    assert pick(((), (), 4.0, 0.0, 0.0, seen, ()))[0] == [2]  # 3 / 4 < 2
    assert pick(((), (), 1.0, 0.9, 0.0, (), seen))[0] == [2]  # 3 - 3 x 0.9 < 2
    assert pick(((), (), 1.0, 0.0, 1.5, (), seen))[0] == [2]  # present: 3 - 1.5 < 2
    assert pick(((), (), 1.0, 0.0, 1.5, (), (([1, 1, 1], 0, 0),)))[0] == [1]  # an empty run counts nothing
    assert pick(((), ((9, 100.0),), 1.0, 0.0, 0.0, (), ()))[0] == [1]  # past n: no column
    assert pick(((), (), 1e-39, 0.0, 0.0, seen, ())) is None  # 3 / 1e-39 is +inf: the torch path decides
    assert pick(((), (), 1e39, 0.0, 0.0, seen, ())) is None  # a penalty past float32's range: the same
    tally = cpu_ops.token_tally()  # a tally of the prompt and output [1, 1, 1], then a draft's run
    assert pick(((), (), 4.0, 0.0, 0.0, (), (), (tally, [1, 1, 1], 1, 3)))[0] == [2]  # 3 / 4 < 2
    # twice in the output (from split 1): 3 - 0.8 > 2; once more in a draft: 3 - 1.2 < 2
    assert pick(((), (), 1.0, 0.4, 0.0, (), (), (tally, [1, 1, 1], 1, 3)))[0] == [1]
    assert pick(((), (), 1.0, 0.4, 0.0, (), (([1], 0, 1),), (tally, [1, 1, 1], 1, 3)))[0] == [2]
    assert pick(((), (), 1.0, 0.4, 0.0, (), (), (tally, [1, 1, 1], 0, 3)))[0] == [2]  # three times from split 0
    assert pick(((), (), 1.0, 0.4, 0.0, (), (), None))[0] == [1]  # no tally, no runs: nothing counted
    import enum

    np = pytest.importorskip("numpy")  # numpy's floats and int subclasses are numbers and ids
    one = enum.IntEnum("Stop", {"ONE": 1}).ONE
    assert pick(((one,), ((1, np.float64(-5.0)),), np.float64(1.0), np.float64(0.0), np.float64(0.0), (), ()))[0] \
        == [2]
    for bad, error in [(((-1,), (), 1.0, 0.0, 0.0, (), ()), ValueError),
                       (((True,), (), 1.0, 0.0, 0.0, (), ()), TypeError),
                       (((), ((1, 1.0), (1, 2.0)), 1.0, 0.0, 0.0, (), ()), ValueError),
                       (((), (), 0.0, 0.0, 0.0, (), ()), ValueError),
                       (((), (), 1.1, 0.0, 0.0, (([1], 0, 2),), ()), IndexError),
                       (((), (), 1.1, 0.0, 0.0, (([1.0], 0, 1),), ()), TypeError),
                       (((), (), 1.0, 0.0, 0.0, ()), ValueError),
                       (((), (), 1.1, 0.0, 0.0, (), (), ("tally", [1], 0, 1)), TypeError),
                       (((), (), 1.1, 0.0, 0.0, (), (), (tally, [1], 0)), TypeError),
                       (((), (), 1.1, 0.0, 0.0, (), (), (tally, [1], 0, 2)), IndexError)]:
        with pytest.raises(error):
            pick(bad)
        assert pick(((), ((2, 5.0),), 1.0, 0.0, 0.0, (), ()))[0] == [2]  # a call after a failed one is clean
    # rows side by side: each one's edits, as it gets them alone
    rows = torch.tensor([[0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0], [1.0, 0.0, 2.5, 3.0]])
    shapings = [((), (), 4.0, 0.0, 0.0, seen, ()), None, ((3,), ((2, 1.0),), 1.0, 0.0, 1.0, (), (([2, 0], 0, 2),))]
    together = cpu_ops.sample_pick(rows, 4, None, None, [0.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3, [0.5] * 3,
                                   [0] * 3, shapings)[0]
    alone = [cpu_ops.sample_pick(rows[i:i + 1], 4, None, None, [0.0], [0], [1.0], [0.0], [0.5], [0],
                                 [shapings[i]])[0][0] for i in range(3)]
    assert together == alone == [2, 1, 2]  # 3 / 4 < 2; unshaped; 2.5 + 1 - 1 > 1 - 1 with the stop held back


def test_a_token_tally_counts_what_its_list_gained_and_counts_again_where_the_list_is_not_the_one_it_counted():
    """Each id of the prompt and output once, with its output count, caught up as the list grows past every
    resize of its table; a shorter stop, another list or another split counts again from the start; ids outside
    0 .. 2^31 are passed over; a bad item raises and leaves the tally to count again."""
    rng = np.random.default_rng(4)

    def expected(tokens, split, stop):
        counts = {t: 0 for t in tokens[:stop] if 0 <= t < 2 ** 31}
        for t in tokens[split:stop]:
            if 0 <= t < 2 ** 31:
                counts[t] += 1
        return counts

    tally = cpu_ops.token_tally()
    tokens = rng.integers(0, 50, 20).tolist()
    for stop in (8, 8, 12, 20):
        tally.catch_up(tokens, 8, stop)
        assert tally.counts() == expected(tokens, 8, stop) and tally.num_tokens == stop
    for _ in range(3000):  # thousands of distinct ids: the table grows many times
        tokens.append(int(rng.integers(0, 5000)))
        if rng.random() < 0.3:
            tally.catch_up(tokens, 8, len(tokens))
    tally.catch_up(tokens, 8, len(tokens))
    want = expected(tokens, 8, len(tokens))
    assert tally.counts() == want and tally.num_seen == len(want)
    assert tally.num_counted == len(set(tokens[8:]))
    tally.catch_up(tokens, 8, 10)  # shorter: counted again
    assert tally.counts() == expected(tokens, 8, 10)
    other = list(tokens)
    other[0] = 4999
    tally.catch_up(other, 8, len(other))  # another list, however alike
    assert tally.counts() == expected(other, 8, len(other))
    tally.catch_up(other, 3, len(other))  # split elsewhere
    assert tally.counts() == expected(other, 3, len(other))
    odd = [-5, 2 ** 31, 2 ** 40, 7, 7]
    tally.catch_up(odd, 1, 5)
    assert tally.counts() == {7: 2} and tally.num_tokens == 5
    bad = [1, 2, 3.0, 4]
    with pytest.raises(TypeError):
        tally.catch_up(bad, 0, 4)
    bad[2] = 3
    tally.catch_up(bad, 0, 4)
    assert tally.counts() == {1: 1, 2: 1, 3: 1, 4: 1}
    for args, error in [((bad, 0, 5), IndexError), ((bad, 5, 2), IndexError), ((bad, 0, -1), IndexError), ((tuple(bad), 0, 4), TypeError)]:
        with pytest.raises(error):
            tally.catch_up(*args)


def test_the_native_draw_takes_greedy_rows_skips_rows_and_checks_its_lists():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0], [0.0, float("nan"), 0.0, 0.0]])
    ids, logprobs, tops = cpu_ops.sample_pick(logits[:2], 4, None, None, [0.0, -1.0], [0, 0], [1.0, 1.0],
                                              [0.0, 0.0], [0.5, 0.5], [2, 2])
    assert ids == [1, -2] and abs(logprobs[0] - float(3.0 - torch.logsumexp(logits[0], 0))) < 1e-6
    assert [i for i, _ in tops[0]] == [1, 2] and tops[1] == []  # ties: the lower id first; a skipped row: none
    assert cpu_ops.sample_pick(logits, 4, None, None, [1.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3, [0.5] * 3,
                               [0] * 3) is None
    with pytest.raises(ValueError, match="out of range"):
        cpu_ops.sample_pick(logits[:1], 4, None, None, [1.0], [0], [0.0], [0.0], [0.5], [0])
    with pytest.raises(ValueError, match="one number per row"):
        cpu_ops.sample_pick(logits[:2], 4, None, None, [1.0], [0, 0], [1.0, 1.0], [0.0, 0.0], [0.5, 0.5], [0, 0])
    with pytest.raises(ValueError, match="out of range"):
        cpu_ops.sample_pick(logits[:1], 4, None, None, [1.0], [0], [1.0], [0.0], [1.0], [0])
    with pytest.raises(ValueError, match="out of range"):
        cpu_ops.sample_pick(logits[:1], 4, None, None, [1.0], [0], [1.0], [0.0], [0.5], [21])


def test_one_rows_masked_pick_is_the_greedy_pass_over_that_row_alone():
    """``greedy_pick_row`` (a deferred guided row's masked pick, made on a view of its row) gives what
    ``greedy_pick`` of the one-row slice gives, for a registered buffer and a plain tensor, and None where that
    would be None (a NaN in the row, no allowed column) or the arguments do not fit (a row out of range, a
    bitmask of another width)."""
    rng = np.random.default_rng(3)
    n, rows = 1000, 6
    logits = torch.from_numpy(rng.standard_normal((rows, n + 24)).astype(np.float32))  # wider than the vocabulary
    logits[4, 10] = float("nan")
    registered = torch.empty_like(logits)
    registered.copy_(logits)
    cpu_ops.register_buffer(registered)
    words = (n + 31) // 32
    for trial in range(40):
        row = int(rng.integers(rows))
        bitmask = rng.integers(-2 ** 31, 2 ** 31, size=(1, words), dtype=np.int64).astype(np.int32)
        bitmask &= rng.integers(0, 2, size=(1, words)).astype(np.int32) * -1  # some words allow nothing
        if trial % 10 == 0:
            bitmask[:] = 0
        want = cpu_ops.greedy_pick(logits[row:row + 1], n, bitmask, [0])
        want = None if want is None else (want[0][0], want[1][0])
        for source in (logits, registered):
            assert cpu_ops.greedy_pick_row(source, row, n, bitmask) == want, (trial, row)
    assert cpu_ops.greedy_pick_row(logits, rows, n, bitmask) is None
    assert cpu_ops.greedy_pick_row(logits, -1, n, bitmask) is None
    assert cpu_ops.greedy_pick_row(logits, 0, n, np.zeros((1, words + 1), np.int32)) is None
