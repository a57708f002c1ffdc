"""Sampler: from a batch of next-token logits to one token per row, under each row's SamplingParams.

The order, after vLLM's, is fixed and every step is a row-wise function of that row alone:

1. raw logprobs: ``log_softmax`` of the model's logits (what ``logprobs`` and ``top_logprobs`` report);
2. the grammar's bitmask (rows in ``masked_rows``, or every row when it is None), and ``min_tokens``, which
   masks EOS and ``stop_token_ids`` while the output is shorter, unless the grammar allows nothing else;
3. ``logit_bias``: ``l[t] += bias[t]``;
4. penalties: repetition HF-style over prompt and output (``l / p`` if ``l > 0`` else ``l * p``), then
   frequency and presence OpenAI-style over the output (``l -= count * f + (count > 0) * pr``);
5. temperature: ``l / T``; T = 0 is greedy (argmax of step 4, no filter, no draw);
6. ``min_p`` (keep ``p >= min_p * max p``), ``top_k`` (keep the k largest), ``top_p`` (keep the smallest
   prefix of the sorted distribution whose mass reaches ``top_p``), each on what the previous one kept;
   tokens tied with the last kept one are kept too;
7. sample: inverse CDF over ``softmax(l)`` with one uniform per row. A masked token has probability exactly 0
   and can never be drawn. A row with a ``generator`` draws its uniform from it alone, so a seeded row gives
   the same tokens in any batch.

Every row runs steps 1-7 in one native pass (``cpu_ops.greedy_pick`` for a greedy row with nothing but its mask,
``cpu_ops.sample_pick`` otherwise, which takes the hold-back, bias and penalties as a few column edits: see
:meth:`Sampler.shaping`), in every batch and when it verifies a draft, so its token never depends on what shares
the batch. The torch ops here are the oracle the native pass is tested against (the same token, except where the
uniform lands within float32 rounding of a boundary between two tokens' cumulative mass), and the path where the
native one cannot decide (a NaN or +inf in a row, logits it cannot take, no native module). Columns of ``logits``
past ``vocab_size`` (a padded lm_head) are never sampled. The caller's logits are not modified. Left out: beam search and best-of-n, which are strategies built on top of this (see beam_search.py).
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from corral.engine.sampling_params import SamplingParams
from corral.engine.sequence import Sequence as SequenceState
from corral.engine.sequence import TokenSpan
from corral.kernels import cpu_ops
from corral.kernels.bitmask import apply_token_bitmask_


class SamplingRow(NamedTuple):
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    # the sequence's cpu_ops.token_tally, where the two spans are its Sequence.spans() (None: the penalties read them)
    tally: object = None


def sampling_row(seq: "SequenceState", draft: Sequence[int] = ()) -> SamplingRow:
    """The row of ``seq`` with ``draft`` after its output: its tokens read in place, and the tally its penalties
    read, made at its first sampled step, so that they cost what its distinct tokens number, not its length."""
    if seq.tally is None and seq.params.has_penalties:
        seq.tally = cpu_ops.token_tally()
    return SamplingRow(seq.params, *seq.spans(draft), seq.generator, seq.tally)


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each chosen token
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, the params.logprobs most likely; None if no row asks


class DraftRows(NamedTuple):
    """One sequence's draft in a :meth:`Sampler.verify` batch: ``tokens[j]`` is tested on logits row
    ``start + j``; when ``final``, row ``start + len(tokens)`` gives the token after a fully accepted draft.
    ``forced[j]``: that row's grammar mask allows ``tokens[j]`` alone (read for a sampled row only; a greedy row's
    are all False)."""
    start: int
    tokens: list[int]
    final: bool
    forced: list[bool]


class Verified(NamedTuple):
    token_ids: list[int]  # the accepted draft tokens, then the model's own token unless the draft ran out of rows
    num_accepted: int
    rows: list[int]  # the logits row each token was chosen on
    logprobs: list[float]  # raw logprob of each token on its row
    top_logprobs: list[list[tuple[int, float]]] | None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-row generator for a seeded request (None when unseeded: the row uses torch's global RNG). Any int
    seeds it, taken modulo 2**64 as torch takes a negative one: a request's siblings draw with its seed plus their
    index, which passes torch's range from a seed near its top."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)
    return generator


class Sampler:
    """Stateless apart from its vocabulary facts. ``vocab_size``: the tokenizer's size when the logits are
    padded wider (None: every column is a token). ``eos_token_ids``: what ``min_tokens`` holds back."""

    def __init__(self, vocab_size: int | None = None, eos_token_ids: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None = None,
                 masked_rows: torch.Tensor | None = None) -> SampleResult:
        """Sample one token per row of ``logits`` ``[len(rows), width]``. ``bitmask``: int32
        ``[len(rows), words]`` in the Vocabulary layout; ``masked_rows``: the rows it applies to. The engine hands
        them as a numpy array and a list (no torch call where the greedy pass takes them); tensors work too. A row
        whose logits leave no finite value to choose (a NaN or +inf from the model where its mask, if any, allows
        it; or a mask that allows nothing) gets id -1 and a NaN logprob: the engine ends that sequence alone."""
        if rows and all(self._only_masked_greedy(row) for row in rows):  # one native pass per row: the same result
            # first, with no torch call (a step's caches are cold): the native side checks the logits' shape
            picked = cpu_ops.greedy_pick(logits, self.vocab_size or logits.shape[1], bitmask, masked_rows)
            if picked is not None:
                assert len(picked[0]) == len(rows), "one logits row per SamplingRow"
                return SampleResult(picked[0], picked[1], None)
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per SamplingRow"
        vocab_size = self.vocab_size or logits.shape[1]
        assert vocab_size <= logits.shape[1], f"vocab_size {vocab_size} > logits width {logits.shape[1]}"
        if not rows:
            return SampleResult([], [], None)
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        uniforms = draw_uniforms([rows[i].generator for i in random_rows]) if random_rows else []
        # Every row is drawn natively, whatever shares its batch, so its token does not depend on the batch; a row
        # the native pass cannot decide (a NaN or +inf in its logits) gets the torch path's draw, alone.
        picked = self._native_draws(logits, rows, random_rows, uniforms, bitmask, masked_rows)
        asked = any(row.params.logprobs for row in rows)
        if picked is not None and -1 not in picked[0]:
            return SampleResult(picked[0], picked[1], picked[2] if asked else None)
        bitmask, masked_rows = _as_tensors(bitmask, masked_rows)
        raw, log_normalizer, top_logprobs = self._raw_logprobs(logits, rows)
        work = self.process(logits, rows, bitmask, masked_rows)
        poisoned = (torch.isnan(work) | torch.isposinf(work)).any(dim=-1)  # before _choose consumes it
        token_ids = self._choose(work, rows, uniforms)

        chosen = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        finite = (torch.isfinite(work.gather(1, chosen[:, None])).squeeze(1) & ~poisoned).tolist()
        chosen_raw = raw.gather(1, chosen[:, None]).squeeze(1).float()
        logprobs = (chosen_raw - log_normalizer).tolist()
        for i, ok in enumerate(finite):  # nothing finite to choose: no token (the native pass never decides these)
            if not ok:
                token_ids[i], logprobs[i] = -1, float("nan")
                if top_logprobs is not None:
                    top_logprobs[i] = []
        if picked is not None:  # the rows the native pass decided keep its draws
            for i, token in enumerate(picked[0]):
                if token >= 0:
                    token_ids[i], logprobs[i] = token, picked[1][i]
                    if top_logprobs is not None:
                        top_logprobs[i] = picked[2][i]
        return SampleResult(token_ids, logprobs, top_logprobs)

    def shaping(self, row: SamplingRow) -> tuple | None:
        """The row's steps 2-4 beyond its mask as the native pass takes them (see ``cpu_ops.sample_pick``): None
        when it has none (no bias, no penalty, ``min_tokens`` reached), else (the stop ids held back, the bias
        pairs, the three penalties, the token runs the repetition penalty reads, those the others count)."""
        params = row.params
        held = len(row.output_token_ids) < params.min_tokens
        if params.unshaped and not held:
            return None
        hold = (*self.eos_token_ids, *params.stop_token_ids) if held else ()
        if row.tally is not None and params.has_penalties:  # the tally stands for the prompt and output
            (tokens, split, stop), draft = row.output_token_ids.runs()
            return (hold, params.logit_bias, params.repetition_penalty, params.frequency_penalty,
                    params.presence_penalty, (draft,), (draft,), (row.tally, tokens, split, stop))
        output = _runs(row.output_token_ids)
        seen = _runs(row.prompt_token_ids) + output if params.repetition_penalty != 1 else ()
        counted = output if params.frequency_penalty or params.presence_penalty else ()
        return (hold, params.logit_bias, params.repetition_penalty, params.frequency_penalty, params.presence_penalty,
                seen, counted)

    def _native_draws(self, logits, rows, random_rows: list[int], uniforms: list[float], bitmask,
                      masked_rows) -> tuple[list[int], list[float], list[list[tuple[int, float]]]] | None:
        """The native pass over every row, with the uniforms drawn for ``random_rows``: id -1 for a row it cannot
        decide; None where it cannot take the arrays (the torch path then decides those)."""
        row_uniform = dict(zip(random_rows, uniforms))
        uniform = [row_uniform.get(i, 0.0) for i in range(len(rows))]
        top_n = [row.params.logprobs or 0 for row in rows]
        shaping = [self.shaping(row) for row in rows]
        return cpu_ops.sample_pick(logits, self.vocab_size or logits.shape[1], bitmask, masked_rows,
                                   *draw_parameters([row.params for row in rows], logits.shape[1]), uniform, top_n,
                                   shaping if any(entry is not None for entry in shaping) else None, partial=True)

    @staticmethod
    def _only_masked_greedy(row: SamplingRow) -> bool:
        """Whether the row's token is the argmax of its masked logits alone: greedy, no top logprobs, no bias, no
        penalty, ``min_tokens`` reached (steps 1, 3, 4 and the hold-back of step 2 change nothing)."""
        params = row.params
        return params.plain_greedy and (not params.min_tokens or len(row.output_token_ids) >= params.min_tokens)

    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None = None,
                masked_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 2-4: a float32 copy of ``logits[:, :vocab_size]`` with the bitmask, ``min_tokens``,
        ``logit_bias`` and penalties applied. Greedy decoding takes its argmax; beam search its log_softmax."""
        vocab_size = self.vocab_size or logits.shape[1]
        work = logits[:, :vocab_size].to(torch.float32, copy=True)
        if bitmask is not None:
            apply_token_bitmask_(work, bitmask, masked_rows)
        self._hold_back_stops(work, rows)
        self._apply_bias_and_penalties(work, rows)
        return work

    def verify(self, logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[DraftRows],
               bitmask: torch.Tensor | None = None, masked_rows: torch.Tensor | None = None) -> list[Verified]:
        """Check each draft against the target distribution of its rows (steps 1-6 above, each row with the
        draft tokens before it in its output), keep the accepted prefix and choose one token after it.

        Greedy rows accept a draft token iff it is the argmax, and then take the argmax. Sampled rows apply the
        rejection rule of speculative sampling (Leviathan et al.) to a draft that proposes one token with
        certainty, in its coupled form: each position draws from ``p`` with one uniform and the draft is kept
        while the draws match it, so ``d`` is accepted with probability ``p(d)`` and a rejected position's token
        is a draw from ``p`` without ``d``. Each row spends one uniform from its generator per output token, as
        the plain path does: with batch-invariant logits a seeded request gives the tokens of a run without
        drafts, and in every case the same distribution."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per SamplingRow"
        if not drafts:
            return []
        if all(self._only_masked_greedy(row) for row in rows):  # one native pass per row, as in __call__
            picked = cpu_ops.greedy_pick(logits, self.vocab_size or logits.shape[1], bitmask, masked_rows)
            if picked is not None:
                # every chosen token is its row's argmax: its logprob is the row's
                return [verified_on_picks(draft, *picked) for draft in drafts]
        raw, log_normalizer, top_logprobs = self._raw_logprobs(logits, rows)
        tensors = _as_tensors(bitmask, masked_rows)
        width, vocab_size = logits.shape[1], self.vocab_size or logits.shape[1]
        work: list[torch.Tensor] = []  # the torch path's steps 2-4, where the native pass cannot decide a row
        probs: dict[int, torch.Tensor] = {}

        def processed() -> torch.Tensor:
            if not work:
                work.append(self.process(logits, rows, *tensors))
            return work[0]

        def torch_probs(at: int) -> torch.Tensor:  # a row's filtered probabilities, float64, not normalised
            if at not in probs:
                tempered = processed()[at:at + 1] / _float32_temperature(rows[at].params)
                probs[at] = _filtered_probs(tempered, [rows[at].params]).to(torch.float64)[0]
            return probs[at]

        bad_rows: list[list[bool]] = []

        def poisoned() -> list[bool]:  # per row: a NaN or +inf where its mask allows it
            if not bad_rows:
                work = processed()
                bad_rows.append((torch.isnan(work) | torch.isposinf(work)).any(dim=-1).tolist())
            return bad_rows[0]

        greedy = [row.params.is_greedy for row in rows]
        argmax = None
        if any(greedy):  # every greedy row's token in one native pass (the others skipped), as __call__ picks it
            picked = cpu_ops.sample_pick(logits, vocab_size, bitmask, masked_rows, [0.0 if g else -1.0 for g in greedy],
                                         [0] * len(rows), [1.0] * len(rows), [0.0] * len(rows), [0.0] * len(rows),
                                         [0] * len(rows), [self.shaping(row) if g else None
                                                           for row, g in zip(rows, greedy)])
            if picked is not None:
                argmax = picked[0]
            else:  # a row with nothing finite to choose gets no token (-1), as in __call__
                argmax = [-1 if bad else token for token, bad in
                          zip(torch.argmax(processed(), dim=-1).tolist(), poisoned())]
        masked = _row_set(tensors[1], len(rows)) if bitmask is not None else set()

        def draw(at: int, u: float) -> int:  # natively, as the plain path draws the row
            params, sub = rows[at].params, at in masked
            picked = cpu_ops.sample_pick(logits[at:at + 1], vocab_size, bitmask[at:at + 1] if sub else None,
                                         [0] if sub else None, [params.temperature], [int(min(params.top_k, width))],
                                         [params.top_p], [params.min_p], [u], [0], [self.shaping(rows[at])])
            if picked is not None:
                return picked[0][0]
            return -1 if poisoned()[at] else _draw_one(torch_probs(at), u)

        def possible(at: int, token: int) -> bool:  # p(token) > 0 where the mask allows that token alone
            # the one allowed token is the largest: no filter drops it, and bias and penalties are finite edits
            # (the min_tokens hold-back keeps a stop id that is the only token allowed)
            return math.isfinite(float(logits[at, token]))

        out = []
        for draft in drafts:
            row = rows[draft.start]
            if row.params.is_greedy:
                chosen, accepted = _verify_greedy(draft, argmax)
            else:
                chosen, accepted = _verify_sampled(draft, draw, possible, row.generator)
            picked = [r for _, r in chosen]
            logprobs = [(raw[r, t].float() - log_normalizer[r]).item() if t >= 0 else float("nan")
                        for t, r in chosen]  # as __call__ does
            top = [top_logprobs[r] for r in picked] if top_logprobs is not None else None
            out.append(Verified([t for t, _ in chosen], accepted, picked, logprobs, top))
        return out

    def _raw_logprobs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]):
        """Step 1: the raw logits (tokenizer columns), each row's log-normalizer, and the top logprobs asked for."""
        raw = logits[:, : self.vocab_size or logits.shape[1]]
        log_normalizer = cpu_ops.log_normalizers(logits, raw.shape[1])
        if log_normalizer is None:
            log_normalizer = torch.logsumexp(raw.float(), dim=-1)
        return raw, log_normalizer, self._top_logprobs(raw, log_normalizer, rows)

    def _top_logprobs(self, raw: torch.Tensor, log_normalizer: torch.Tensor,
                      rows: Sequence[SamplingRow]) -> list[list[tuple[int, float]]] | None:
        k_max = max((row.params.logprobs or 0) for row in rows)
        if k_max == 0:
            return None
        values, ids = torch.topk(raw.float(), min(k_max, raw.shape[1]), dim=-1)
        values = (values - log_normalizer[:, None]).tolist()
        ids = ids.tolist()
        return [list(zip(ids[i], values[i]))[: row.params.logprobs or 0] for i, row in enumerate(rows)]

    def _hold_back_stops(self, work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        for i, row in enumerate(rows):
            if len(row.output_token_ids) >= row.params.min_tokens:
                continue
            stop_ids = [t for t in {*self.eos_token_ids, *row.params.stop_token_ids} if t < work.shape[1]]
            if not stop_ids:
                continue
            stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=work.device)
            num_allowed = int(torch.isfinite(work[i]).sum())
            num_allowed_stops = int(torch.isfinite(work[i, stop_ids]).sum())
            # subtle: a grammar that allows only EOS here outranks min_tokens; masking it would leave nothing.
            if num_allowed > num_allowed_stops:
                work[i, stop_ids] = float("-inf")

    def _apply_bias_and_penalties(self, work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        vocab_size = work.shape[1]
        for i, row in enumerate(rows):
            params = row.params
            if params.logit_bias:
                # The API checks ids against the vocabulary; here an id past it simply has no column.
                pairs = [(t, b) for t, b in params.logit_bias if t < vocab_size]
                if pairs:
                    ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=work.device)
                    work[i].index_add_(0, ids, torch.tensor([b for _, b in pairs], dtype=work.dtype,
                                                            device=work.device))
            if params.has_penalties:
                self._apply_penalties(work[i], row)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
        params, vocab_size, device = row.params, logits.shape[0], logits.device
        if params.repetition_penalty != 1:
            seen = torch.tensor([*row.prompt_token_ids, *row.output_token_ids], dtype=torch.long, device=device)
            seen = torch.unique(seen[seen < vocab_size])
            values = logits[seen]
            p = params.repetition_penalty
            logits[seen] = torch.where(values > 0, values / p, values * p)
        if (params.frequency_penalty or params.presence_penalty) and len(row.output_token_ids):
            output = torch.tensor(list(row.output_token_ids), dtype=torch.long, device=device)
            ids, counts = torch.unique(output[output < vocab_size], return_counts=True)
            logits[ids] -= counts.float() * params.frequency_penalty
            logits[ids] -= params.presence_penalty

    def _choose(self, work: torch.Tensor, rows: Sequence[SamplingRow], uniforms: list[float]) -> list[int]:
        """Greedy rows take the argmax of ``work``; the others are drawn with ``uniforms``, one per drawn row in
        order (``work`` is consumed)."""
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return torch.argmax(work, dim=-1).tolist()
        all_random = len(random_rows) == len(rows)
        token_ids = None if all_random else torch.argmax(work, dim=-1)
        index = torch.tensor(random_rows, dtype=torch.long, device=work.device)
        params = [rows[i].params for i in random_rows]
        tempered = work if all_random else work.index_select(0, index)  # in place when every row is drawn
        tempered.div_(torch.tensor([_float32_temperature(p) for p in params], device=work.device)[:, None])
        probs = _filtered_probs(tempered, params)
        drawn = _draw(probs, torch.tensor(uniforms, dtype=torch.float64, device=work.device))
        if all_random:
            return drawn.tolist()
        token_ids[index] = drawn
        return token_ids.tolist()


def _runs(tokens: Sequence[int]) -> tuple:
    """``tokens`` as the native pass reads them: runs ``(list or tuple, start, stop)``, in place for a span."""
    if isinstance(tokens, TokenSpan):
        return tokens.runs()
    if not isinstance(tokens, (list, tuple)):
        tokens = list(tokens)
    return ((tokens, 0, len(tokens)),)


def _as_tensors(bitmask, masked_rows) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The bitmask and its rows as the general path's torch ops take them (a numpy array and a list become
    tensors; tensors and None pass)."""
    if isinstance(bitmask, np.ndarray):
        bitmask = torch.from_numpy(bitmask)
    if isinstance(masked_rows, list):
        masked_rows = torch.tensor(masked_rows, dtype=torch.long)
    return bitmask, masked_rows


def _float32_temperature(params: SamplingParams) -> float:
    """The temperature as float32 holds it: one past its range would be infinite, and a masked logit (-inf)
    over infinity is NaN; the largest float32 instead divides every allowed logit to about 0 (all alike)."""
    return min(params.temperature, _FLOAT32_MAX)


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _row_set(masked_rows: torch.Tensor | None, num_rows: int) -> set[int]:
    """The rows a bitmask applies to, as a set (None: every row)."""
    if masked_rows is None:
        return set(range(num_rows))
    if masked_rows.dtype == torch.bool:
        masked_rows = masked_rows.nonzero().flatten()
    return set(masked_rows.tolist())


def _uniform(generator: torch.Generator | None) -> float:
    """One U[0, 1) in float64, from ``generator`` when the row has one (as :func:`draw_uniforms` draws it)."""
    if generator is None:
        return torch.rand(1, dtype=torch.float64).item()
    return torch.rand(1, dtype=torch.float64, device=generator.device, generator=generator).item()


def verified_on_picks(draft: DraftRows, argmax: list[int], row_logprobs: list[float]) -> Verified:
    """A greedy row's verification from each row's argmax and that argmax's logprob (the greedy pass's picks):
    the draft kept while it is the argmax, then the argmax."""
    chosen, accepted = _verify_greedy(draft, argmax)
    return Verified([t for t, _ in chosen], accepted, [r for _, r in chosen], [row_logprobs[r] for _, r in chosen],
                    None)


def _verify_greedy(draft: DraftRows, argmax: list[int]) -> tuple[list[tuple[int, int]], int]:
    """((token, row) chosen, draft tokens accepted): the draft while it is the argmax, then the argmax."""
    chosen = []
    for j, token in enumerate(draft.tokens):
        best = argmax[draft.start + j]
        chosen.append((best, draft.start + j))
        if best != token:
            return chosen, j
    if draft.final:
        at = draft.start + len(draft.tokens)
        chosen.append((argmax[at], at))
    return chosen, len(draft.tokens)


def _verify_sampled(draft: DraftRows, draw, possible, generator: torch.Generator | None) \
        -> tuple[list[tuple[int, int]], int]:
    """((token, row) chosen, draft tokens accepted): each row draws its token (``draw(row, u)``) with one uniform,
    as the plain path draws it, and the draft is kept while the draws match it. For a draft that proposes one
    token with certainty this is the rejection rule itself: the draft token is accepted with probability p(d), and
    a rejected position's token is a draw from p without d. A position whose mask allows the draft token alone
    (``possible(row, token)``: p(d) = 1) spends its uniform without the draw."""
    chosen = []
    for j, token in enumerate(draft.tokens):
        at = draft.start + j
        u = _uniform(generator)
        if draft.forced[j] and possible(at, token):
            chosen.append((token, at))
            continue
        drawn = draw(at, u)
        chosen.append((drawn, at))
        if drawn != token:
            return chosen, j
    if draft.final:
        at = draft.start + len(draft.tokens)
        chosen.append((draw(at, _uniform(generator)), at))
    return chosen, len(draft.tokens)


def _draw_one(p: torch.Tensor, u: float) -> int:
    return int(_draw(p[None], torch.tensor([u], dtype=torch.float64))[0])


def draw_parameters(params: Sequence[SamplingParams], width: int) -> tuple[list, list, list, list]:
    """The native draw's temperature (0: greedy), top_k (bounded by the logits' ``width``: past it every column is
    kept, as with 0), top_p and min_p, one of each per row."""
    return ([0.0 if p.is_greedy else p.temperature for p in params], [int(min(p.top_k, width)) for p in params],
            [p.top_p for p in params], [p.min_p for p in params])


def draw_uniforms(generators: Sequence[torch.Generator | None]) -> list[float]:
    """One U[0, 1) per row, in float64: a seeded row takes it from its own generator alone (per-request
    generators are CPU ones), the others from torch's global generator, which draws one for every row."""
    uniforms = torch.rand(len(generators), dtype=torch.float64).tolist()
    for j, generator in enumerate(generators):
        if generator is not None:
            uniforms[j] = torch.rand(1, dtype=torch.float64, device=generator.device, generator=generator).item()
    return uniforms


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, one token per row: the first token whose cumulative mass exceeds ``u * total``.

    That token has a strictly larger cumulative mass than its predecessor, so its probability is > 0: a masked
    token (probability exactly 0) is never drawn. The sum runs in float64 so that 150k tiny probabilities do
    not drift the tail of the distribution.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    total = cdf[:, -1:]
    # subtle: u * total can round up to total itself, which no token exceeds; step one ulp below it.
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # Only a row with no allowed token (all NaN) runs off the end; the caller gives that row no token (-1).
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """min_p, then top_k (in place on the tempered logits), then the softmax, then top_p (zeroing
    probabilities; the draw needs no renormalisation). Rows match ``params``."""
    device, neg_inf = logits.device, float("-inf")
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p), which needs no softmax.
        threshold = logits.max(dim=-1).values + torch.log(min_p)  # log(0) = -inf keeps every token
        logits.masked_fill_(logits < threshold[:, None], neg_inf)
    top_k = torch.tensor([min(p.top_k, logits.shape[1]) for p in params], device=device)  # any int is >= 0
    if bool((top_k > 0).any()):
        k = top_k.clamp(max=logits.shape[1])
        largest = torch.topk(logits, int(k.max()), dim=-1).values
        kth = largest.gather(1, (k - 1).clamp(min=0)[:, None]).masked_fill((k == 0)[:, None], neg_inf)
        logits.masked_fill_(logits < kth, neg_inf)
    probs = torch.softmax(logits, dim=-1)
    # a top_p below float32's range keeps the first token alone, as a float32 one just above 0 does
    top_p = torch.tensor([p.top_p for p in params], device=device).clamp_(min=torch.finfo(torch.float32).tiny)
    if bool((top_p < 1).any()):
        probs.masked_fill_(probs < _top_p_smallest_kept(probs, top_p), 0.0)
    return probs


def _top_p_smallest_kept(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[rows, 1]``: the probability of the last token top_p keeps (0 for rows with top_p = 1).

    A full sort of 49k-150k columns costs far more than the rest of the sampler, and the nucleus is usually a
    few dozen tokens, so this looks at the largest k only, growing k until those k hold ``top_p`` of the mass.
    On CPU, once a row is bound to need more than 1,024 tokens (a flat distribution), one numpy sort replaces
    the rest of the growing: torch's CPU sort and large-k topk measured 10-60x slower than numpy's sort (one
    row of 152k: ~48 ms against ~1-2.5 ms), and every k on the way was paid for too.
    """
    k = min(64, probs.shape[1])
    while True:
        largest = torch.topk(probs, k, dim=-1).values
        cumulative = torch.cumsum(largest, dim=-1)
        short = (cumulative[:, -1] < top_p) & (top_p < 1)
        if k == probs.shape[1] or not bool(short.any()):
            break
        # Every token past the k-th holds at most the k-th's probability: a lower bound on the tokens needed.
        if probs.is_cpu and bool((short & (k + (top_p - cumulative[:, -1]) / largest[:, -1] > 1024)).any()):
            largest, cumulative = _sorted_and_cumulative_cpu(probs)
            break
        k = min(4 * k, probs.shape[1])
    # Keep a token while the mass before it is < top_p: the first token always stays.
    keep = ((cumulative - largest) < top_p[:, None]) & (largest > 0)
    smallest = largest.masked_fill(~keep, float("inf")).min(dim=-1, keepdim=True).values
    return smallest.masked_fill((top_p >= 1)[:, None], 0.0)


def _sorted_and_cumulative_cpu(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of float32 ``probs`` sorted largest first, and its running sum: what ``topk`` and ``cumsum``
    give at k = every column, in numpy. The same values bit for bit: torch's CPU ``cumsum`` also accumulates
    float32 in float64 and rounds each sum to float32."""
    ascending = probs.numpy().copy()
    ascending.sort(axis=-1)
    largest = ascending[:, ::-1].copy()
    cumulative = largest.cumsum(axis=-1, dtype="float64").astype("float32")
    return torch.from_numpy(largest), torch.from_numpy(cumulative)
