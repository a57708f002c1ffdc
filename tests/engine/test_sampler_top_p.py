"""top_p on large vocabularies: the nucleus shortcut (growing topk, or one numpy sort on CPU for a flat
distribution) must find exactly the threshold that the full sort defines, and the draws must follow the oracle."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from corral.engine.sampler import Sampler, SamplingRow, _top_p_smallest_kept
from corral.engine.sampling_params import SamplingParams


def smallest_kept_by_full_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The definition over every column: sort, keep a token while the mass before it is < top_p."""
    largest = torch.sort(probs, dim=-1, descending=True).values
    cumulative = torch.cumsum(largest, dim=-1)
    keep = ((cumulative - largest) < top_p[:, None]) & (largest > 0)
    smallest = largest.masked_fill(~keep, float("inf")).min(dim=-1, keepdim=True).values
    return smallest.masked_fill((top_p >= 1)[:, None], 0.0)


def distributions(num_columns: int, seed: int) -> torch.Tensor:
    """Rows from flat (nucleus ~90% of the columns) to peaked (a few tokens), one with masked (zero) tokens,
    one with ties."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.1, 1.0, 2.0, 3.0, 4.0, 8.0, 0.5, 0.5])[:, None]
    logits = torch.randn(len(scales), num_columns, generator=generator) * scales
    logits[6, ::3] = float("-inf")
    logits[7] = torch.round(logits[7] * 4) / 4  # few distinct values: many ties at the threshold
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("num_columns", [49152, 151936])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_threshold_matches_the_full_sort_exactly(num_columns, p):
    probs = distributions(num_columns, seed=num_columns + int(100 * p))
    top_p = torch.full((len(probs),), p)
    top_p[2] = 1.0  # a row without top_p rides along with the others
    expected = smallest_kept_by_full_sort(probs, top_p)
    assert torch.equal(_top_p_smallest_kept(probs, top_p), expected)
    # The flat row's nucleus is far past 1,024 tokens: the case the numpy sort serves.
    assert int((probs[0] >= expected[0]).sum()) > 1024


def test_peaked_rows_alone_match_the_full_sort():
    probs = distributions(49152, seed=3)[4:6]  # nuclei of a few hundred tokens at most: topk only
    top_p = torch.tensor([0.9, 0.95])
    assert torch.equal(_top_p_smallest_kept(probs, top_p), smallest_kept_by_full_sort(probs, top_p))


def test_flat_distribution_draws_follow_the_oracle():
    # 3,000 near-equal tokens, top_p = 0.5: a nucleus of ~1,500, so the numpy sort decides it.
    num_columns, num_draws, top_p = 3000, 6000, 0.5
    logits = torch.randn(num_columns, generator=torch.Generator().manual_seed(5)) * 0.3
    p = torch.softmax(logits.double(), dim=-1).numpy()
    order = np.argsort(-p)
    keep = np.zeros(num_columns, dtype=bool)
    keep[order[(np.cumsum(p[order]) - p[order]) < top_p]] = True
    expected = np.where(keep, p, 0.0) / p[keep].sum()

    torch.manual_seed(11)
    params = SamplingParams(top_p=top_p)
    token_ids = Sampler()(logits.repeat(num_draws, 1), [SamplingRow(params, (), (), None)] * num_draws).token_ids
    counts = np.bincount(token_ids, minlength=num_columns)
    assert counts[~keep].sum() == 0, "drew a token outside the nucleus"
    # Per-token counts are too small for chi-square: compare 30 bins of tokens, ranked by probability.
    bins = np.array_split(order[: keep.sum()], 30)
    observed = np.array([counts[b].sum() for b in bins])
    assert chisquare(observed, num_draws * np.array([expected[b].sum() for b in bins])).pvalue > 1e-3
    # Power: the same draws must reject the untruncated softmax.
    assert chisquare(np.append(observed, 0), num_draws * np.append([p[b].sum() for b in bins],
                                                                    p[~keep].sum())).pvalue < 1e-6
