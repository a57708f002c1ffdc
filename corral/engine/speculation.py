"""Drafts: the tokens a sequence proposes to advance by in one step, checked by the model in the same pass.

Two sources, both free of a second model:

- **Jump-forward** (forced spans): the bytes the guide forces next (``Guide.forced_bytes``: a JSON key and its
  quotes and colon, a closing bracket, the rest of an enum member once it is chosen), cut into tokens by the
  model's tokenizer (by longest match over the vocabulary where its split does not fit), each checked against
  the guide. The last token of a span that ends before a real choice is backed off: a longer token could spell
  it together with what follows (``"`` when ``",`` is a token, a space that merges with the next word).
- **Prompt lookup** (n-grams): the longest suffix of the text so far (up to :data:`MAX_NGRAM` tokens) that
  occurred before, in the prompt or the output, proposes what followed it there. Extraction and editing tasks
  copy long runs this way. Every proposed token is checked against the guide first, so a token the grammar
  forbids is never drafted.

A draft changes nothing the model would produce: the engine verifies it against the constrained target
distribution (:meth:`corral.engine.sampler.Sampler.verify`), keeps the accepted prefix and one token of its own,
and rolls the rest back (KV, guide, hashes, detokenizer never saw it).

How long a draft is. A draft token costs one more row in the step, and the i-th brings a token only if the
i - 1 before it were accepted, which happens with probability about ``a**i`` for the sequence's acceptance rate
``a`` of that kind of draft (jump-forward, and lookup by the length of the suffix that matched, are counted apart,
over the tokens verification reached, with decayed counts and a prior of 1/2). A step over B rows costs about
``F + B*r``: a fixed part (the weights streamed once, the loop) and a part per row. Without drafts each of S
decoding sequences pays ``(F + S*r) / S`` per token; a draft row pays for itself when its expected tokens are
worth more than its cost, ``a**i * (F + S*r) / S > r``, that is ``a**i >= price(S) = S*c / (1 - c + S*c)`` with
``c = r / (F + r)``, the draft row's share of a whole step at batch 1 (``draft_row_cost``, 0.25 measured here).
So the price is 0.25 alone, 0.57 at 4 sequences, 0.84 at 16 and 0.96 at 64: as the batch grows drafts stop, except
where they are almost always accepted. A draft takes the largest ``k`` with ``a**k >= price``, and a kind of draft
whose rate falls below it stops for that sequence. A stopped lookup length keeps learning from shadows: what it
would have drafted is compared with the tokens that came instead, and recorded as a verification would record
it (no row is spent), so it drafts again once its text turns repetitive, and a length whose prior is below the
price (at 4 sequences and more) starts where its text earns it.
Jump-forward needs pricing too: where the model would rather write something else, its constrained argmax is
usually a shorter token than the tokenizer's split of the forced bytes (``P`` where ``Presentation`` is forced).

The price may depend on the batch because drafts never change a request's tokens: verification draws each token
from the same row with the same uniform as a run without drafts (see
:meth:`~corral.engine.sampler.Sampler.verify`), so a seeded request gives the same tokens in any batch, drafted
or not, as far as the model's rows are batch-independent: bit for bit in W4A8's native kernels; torch's dense
products may differ in the last bits with the number of rows.

A third source, a draft model (a smaller model, or the target's own first layers), lives in
:mod:`corral.engine.draft_model`: a sequence that neither source drafts for asks it, when its tokens pay at their
higher price. Left out: drafts for beams.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from corral import native
from corral.engine.sampler import DraftRows, SamplingRow, sampling_row
from corral.engine.sequence import Sequence
from corral.fsm.guide import Guide
from corral.fsm.vocabulary import Vocabulary

MAX_NGRAM = 3  # the longest suffix prompt lookup matches
MAX_FORCED_TOKENS = 32  # a jump-forward span's tokens per step
# forced spans the tokenizer has cut, kept by the drafter: a grammar forces the same spans again and again (a
# schema's keys and punctuation), and a tokenizer call is dear right after a forward (its data are cold)
MAX_CACHED_SPANS, MAX_CACHED_SPAN_BYTES = 4096, 256
_DECAY = 0.8  # acceptance counts decay by this per verification, so the rate follows the text


def draft_price(num_decoding: int, row_cost: float) -> float:
    """The acceptance probability a draft token needs to pay for its row when ``num_decoding`` sequences decode
    (see above): ``S*c / (1 - c + S*c)``."""
    s = max(1, num_decoding) * row_cost
    return s / (1.0 - row_cost + s)


@dataclass
class Rate:
    """Decayed counts of draft tokens that verification reached and accepted."""
    accepted: float = 0.0
    reached: float = 0.0

    @property
    def value(self) -> float:
        return (self.accepted + 1.0) / (self.reached + 2.0)

    def length(self, cap: int, price: float) -> int:
        """The largest k <= cap with value**k >= price (0 when even one token does not pay)."""
        a, k = self.value, 0
        while k < cap and a ** (k + 1) >= price:
            k += 1
        return k

    def record(self, num_reached: int, num_accepted: int) -> None:
        self.reached = self.reached * _DECAY + num_reached
        self.accepted = self.accepted * _DECAY + num_accepted


class PyNgramIndex:
    """Prompt lookup's index of one sequence's tokens, in Python: what the native module's ``NgramIndex`` computes
    (this is its oracle, and what runs with the native module off). For each n up to ``order``, every n-gram maps
    to the position right after its latest occurrence."""

    def __init__(self, order: int):
        self.order, self.indexed = order, 0  # tokens[:indexed] are registered
        self._grams: list[dict[tuple[int, ...], int]] = [{} for _ in range(order)]

    def find(self, tokens: list[int], tail: list[int] | None) -> tuple[int, int]:
        """Register every n-gram of ``tokens`` (which only grow between calls) that ends before its last token
        and is not registered yet; then (n, end) for the longest n whose last n items of ``tokens + tail`` were
        registered, ``end`` the position in ``tokens`` right after their latest occurrence; (0, -1) for none."""
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in range(1, min(self.order, end) + 1):
                self._grams[n - 1][tuple(tokens[end - n: end])] = end
        self.indexed = max(self.indexed, len(tokens))
        context = tokens + tail if tail else tokens
        for n in range(min(self.order, len(context)), 0, -1):
            end = self._grams[n - 1].get(tuple(context[-n:]))
            if end is not None:
                return n, end
        return 0, -1


def ngram_index(order: int = MAX_NGRAM):
    """A sequence's n-gram index: the native one (a few hash probes a step, 60-75 bytes a token where a dict of
    tuples took 260-300), or its Python twin where the native module is off."""
    module = native.module()
    return module.NgramIndex(order) if module is not None else PyNgramIndex(order)


@dataclass
class SpecState:
    """Per sequence: the n-gram index of its tokens and its acceptance rates."""
    ngrams: "PyNgramIndex" = field(default_factory=lambda: ngram_index())  # or the native NgramIndex
    forced: Rate = field(default_factory=Rate)
    # prompt lookup's tokens, by the length of the suffix that matched (index n - 1): a one-token match is weak
    # evidence and a three-token one strong, so each sizes its drafts by its own record
    lookup: list[Rate] = field(default_factory=lambda: [Rate() for _ in range(MAX_NGRAM)])
    lookup_order: int = 0  # the matched suffix's length behind this step's lookup tokens (0: none)
    model: Rate = field(default_factory=Rate)  # a draft model's tokens (corral/engine/draft_model.py)
    # a stopped match length's shadow draft: (that length, the sequence's length then, the tokens it would have
    # drafted), checked against the tokens that came instead (see Drafter.shadow)
    shadow: tuple[int, int, list[int]] | None = None

    def record(self, num_tested: int, num_forced: int, num_accepted: int, by_model: bool = False) -> None:
        """A verified draft: ``num_tested`` tokens, the first ``num_forced`` of them jump-forward ones and the
        rest prompt lookup's (of :attr:`lookup_order`; or, ``by_model``, a draft model's), of which the first
        ``num_accepted`` were kept (the token after them was reached too, the rest not)."""
        reached = min(num_tested, num_accepted + 1)
        forced_reached, forced_accepted = min(num_forced, reached), min(num_forced, num_accepted)
        if forced_reached:
            self.forced.record(forced_reached, forced_accepted)
        if reached > forced_reached and (by_model or self.lookup_order):
            rate = self.model if by_model else self.lookup[self.lookup_order - 1]
            rate.record(reached - forced_reached, num_accepted - forced_accepted)


@dataclass(frozen=True)
class Draft:
    """What one sequence proposes this step: ``tokens``, of which the first ``num_forced`` came from the guide's
    forced span and the rest from prompt lookup."""
    tokens: list[int]
    num_forced: int


class Drafter:
    """Proposes drafts over one vocabulary. Stateless apart from its byte → token table and the tokenizer's cuts of
    the forced spans it has met (the engine thread's alone, as the drafter is)."""

    def __init__(self, vocab: Vocabulary, encode: Callable[[str], list[int]] | None = None):
        """``encode``: the model's tokenizer (text → ids, no special tokens), which cuts forced spans the way
        the model saw text cut; without it spans are cut by longest match over ``vocab``."""
        self.vocab, self.encode = vocab, encode
        by_bytes: dict[bytes, int] = {}
        for token_id, text in enumerate(vocab.token_bytes):
            if text and token_id not in vocab.special_ids and token_id not in vocab.eos_token_ids:
                by_bytes.setdefault(text, token_id)
        self._by_bytes = by_bytes
        self._longest = max((len(b) for b in by_bytes), default=1)
        self._cut: dict[bytes, list[int]] = {}  # span -> _encoded(span), bounded by MAX_CACHED_SPANS

    def propose(self, tokens: list[int], guide: Guide | None, state: SpecState, *, forced_cap: int,
                lookup_cap: int | tuple[int, ...], room: int) -> Draft:
        """A draft of at most ``room`` tokens after ``tokens``: up to ``forced_cap`` tokens of the guide's forced
        span, then prompt-lookup tokens, at most ``lookup_cap`` of them (per matched suffix length n, at index
        n - 1; one int for every length). The guide is left where it was; ``state.lookup_order`` says which
        length matched."""
        forced = self.forced_tokens(guide, min(room, forced_cap)) if forced_cap and guide is not None else []
        caps = (lookup_cap,) * MAX_NGRAM if isinstance(lookup_cap, int) else lookup_cap
        caps = tuple(min(cap, room - len(forced)) for cap in caps)
        lookup: list[int] = []
        state.lookup_order = 0
        if max(caps) > 0:
            lookup = self._lookup(tokens, forced, state, caps, guide)
        return Draft(forced + lookup, len(forced))

    def propose_all(self, decoding: list[Sequence], config, max_model_len: int,
                    model_cost: float | None = None) -> list[tuple[Sequence, int]]:
        """Set ``draft`` on each of ``decoding`` (the sequences that decode this step, beams left out) under
        ``config``'s switches (a request's own switches win), priced for this many decoding sequences. Returns
        the sequences left without a draft that a draft model's tokens would pay for, at ``model_cost`` (a draft
        model step's share of a step; None: there is no draft model), with the most tokens each may draft."""
        price = draft_price(len(decoding), config.draft_row_cost)
        # a shadow is worth its lookup where a rate could yet pay: a record of every token accepted, at its most
        shadows = price < best_rate(config.num_speculative_tokens)
        wanted: list[tuple[Sequence, int]] = []
        for seq in decoding:
            seq.draft, seq.num_draft_forced, seq.draft_by_model = [], 0, False
            params = seq.params
            jump = config.jump_forward if params.jump_forward is None else params.jump_forward
            lookup = config.speculation if params.speculation is None else params.speculation
            # one token of every step is the model's own: a draft leaves room for it
            room = min(params.max_tokens - seq.num_output_tokens, max_model_len - len(seq)) - 1
            if room <= 0 or not (jump and seq.guide is not None or lookup):
                continue
            if seq.spec is None:
                seq.spec = SpecState()
            if seq.spec.shadow is not None:
                settle_shadow(seq.token_ids, seq.spec)
            # a forced span needs a guide; a rate's length is only worth reading where its kind of draft is on
            forced_cap = seq.spec.forced.length(MAX_FORCED_TOKENS, price) if jump and seq.guide is not None else 0
            lookup_cap = tuple([rate.length(config.num_speculative_tokens, price) for rate in seq.spec.lookup]) \
                if lookup else (0,) * MAX_NGRAM
            if seq.spec.shadow is not None and lookup_cap[seq.spec.shadow[0] - 1]:
                seq.spec.shadow = None  # its length drafts again (a smaller batch): its drafts are recorded, not both
            if forced_cap or max(lookup_cap):
                draft = self.propose(seq.token_ids, seq.guide, seq.spec, forced_cap=forced_cap,
                                     lookup_cap=lookup_cap, room=room)
                seq.draft, seq.num_draft_forced = draft.tokens, draft.num_forced
                if seq.guide is not None:  # the forced span and the lookup tokens were each taken on a guide copy
                    seq.allowed_draft = (seq.draft, len(seq.token_ids))
            if not seq.draft and lookup and shadows and seq.spec.shadow is None:
                self.shadow(seq.token_ids, seq.guide, seq.spec, lookup_cap, min(room, config.num_speculative_tokens))
            if not seq.draft and lookup and model_cost is not None:  # the draft model's turn
                cap = min(seq.spec.model.length(config.num_speculative_tokens, price + model_cost), room)
                if cap > 0:
                    wanted.append((seq, cap))
        return wanted

    # -- jump-forward ---------------------------------------------------------------------------------------
    def forced_tokens(self, guide: Guide, room: int) -> list[int]:
        span = guide.forced_bytes()
        if not span:
            return []
        probe, out, at = guide.probe(), [], 0  # a limit reached while probing stays with the probe
        limit = min(room, MAX_FORCED_TOKENS)
        for token in self._encoded(span):  # the tokenizer's own split first: what the model was trained on
            if len(out) == limit or not probe.advance(token):
                break
            out.append(token)
            at += len(self.vocab.token_bytes[token])
        if not out:
            probe = guide.probe()
        while at < len(span) and len(out) < limit:
            token = self._longest_allowed(span, at, probe)
            if token is None:
                break
            out.append(token)
            at += len(self.vocab.token_bytes[token])
        # back off a last token that ends the span exactly, unless nothing can follow it
        if out and at == len(span) and not probe.is_finished():
            out.pop()
        return out

    def _encoded(self, span: bytes) -> list[int]:
        """The tokenizer's tokens for the longest whole-character prefix of ``span``, if they spell it exactly
        (read only: a cached list is shared)."""
        if self.encode is None:
            return []
        tokens = self._cut.get(span)
        if tokens is None:
            tokens = self._encode_span(span)
            if len(span) <= MAX_CACHED_SPAN_BYTES:
                if len(self._cut) >= MAX_CACHED_SPANS:
                    self._cut.clear()
                self._cut[span] = tokens
        return tokens

    def _encode_span(self, span: bytes) -> list[int]:
        for cut in range(len(span), max(len(span) - 4, 0), -1):
            try:
                text = span[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            tokens = self.encode(text)
            spelled = b"".join(self.vocab.token_bytes[t] for t in tokens if 0 <= t < self.vocab.size)
            return tokens if spelled == span[:cut] else []
        return []

    def _longest_allowed(self, span: bytes, at: int, probe: Guide) -> int | None:
        """The longest token spelling ``span[at:at + n]`` that ``probe`` accepts; ``probe`` advances by it."""
        for n in range(min(len(span) - at, self._longest), 0, -1):
            token = self._by_bytes.get(span[at: at + n])
            if token is None:
                continue
            if probe.advance(token):
                return token
            probe.rollback(1)
            if probe.is_error():  # a limit, not a refusal: stop drafting here
                return None
        return None

    # -- prompt lookup --------------------------------------------------------------------------------------
    def _lookup(self, tokens: list[int], forced: list[int], state: SpecState, caps: tuple[int, ...],
                guide: Guide | None) -> list[int]:
        """What followed the longest matching suffix of the text and ``forced`` after it, up to its length's cap
        (none when that cap is 0: a shorter match is weaker evidence still)."""
        n, start = state.ngrams.find(tokens, forced or None)
        if n == 0:
            return []
        draft = tokens[start: start + caps[n - 1]]
        if guide is not None:
            draft = self._allowed_prefix(draft, forced, guide)
        state.lookup_order = n if draft else 0
        return draft

    def shadow(self, tokens: list[int], guide: Guide | None, state: SpecState, caps: tuple[int, ...],
               length: int) -> None:
        """Where the longest matching suffix's length is stopped (its cap 0: its record is below the price), keep
        the ``length`` tokens it would have drafted as ``state.shadow``, to be checked against the tokens that come
        instead. A stopped length is never verified, so without this its record would never change again: text
        that turns repetitive (a list, a table, code) would go undrafted for the rest of the sequence."""
        if length <= 0:
            return
        n, start = state.ngrams.find(tokens, None)
        if n and caps[n - 1] == 0:
            draft = tokens[start: start + length]
            if guide is not None:  # a token the grammar forbids is never drafted, so never counted against
                draft = self._allowed_prefix(draft, [], guide)
            if draft:
                state.shadow = (n, len(tokens), draft)

    @staticmethod
    def _allowed_prefix(draft: list[int], forced: list[int], guide: Guide) -> list[int]:
        """The longest prefix of ``draft`` the guide accepts after ``forced`` (checked on a copy)."""
        probe = guide.probe()
        for token in forced:
            probe.advance(token)
        kept = 0
        for token in draft:
            if not probe.advance(token):
                break
            kept += 1
        return draft[:kept]


def best_rate(length: int) -> float:
    """The most a :class:`Rate` reaches when every record is ``length`` tokens, all accepted (its counts settle at
    ``length / (1 - _DECAY)``)."""
    most = max(1, length) / (1.0 - _DECAY)
    return (most + 1.0) / (most + 2.0)


def settle_shadow(tokens: list[int], state: SpecState) -> None:
    """Check ``state.shadow`` against the tokens that came after it, once they decide it: the record of its match
    length gets what a verification of that draft would have given (the tokens kept up to the first that differs,
    and that one reached). Acceptance of a single proposed token is the chance the model's own token is that
    token, so the record learns the same rate as from real drafts, greedy or sampled, with no row spent."""
    order, at, draft = state.shadow
    came = tokens[at: at + len(draft)]
    kept = 0
    while kept < len(came) and came[kept] == draft[kept]:
        kept += 1
    if kept == len(came) < len(draft):
        return  # every token so far agrees, and the rest have not come yet
    state.shadow = None
    state.lookup[order - 1].record(min(len(draft), kept + 1), kept)


# ---- verification input --------------------------------------------------------------------------------------
class DraftBatch(NamedTuple):
    """What :meth:`~corral.engine.sampler.Sampler.verify` takes for the drafted sequences of one step."""
    seqs: list[Sequence]
    drafts: list[DraftRows | None]  # per sequence; None: its grammar allows no token even before the draft
    rows: list[SamplingRow]  # per verified row: the sequence's params, with the draft tokens before that row
    logits_rows: list[int]  # the rows of the drafted sequences' logits these are
    bitmask: np.ndarray | None  # as the sampler takes it (see Sampler.__call__)
    masked_rows: list[int] | None


def draft_batch(drafted: list[tuple[Sequence, int]], masks: dict[int, np.ndarray]) -> DraftBatch:
    """``drafted``: (sequence, its first row in the drafted logits); ``masks``: a guided sequence's
    ``[1 + len(draft), words]`` rows (its mask here and after each draft token). A row that allows nothing ends
    what can be tested: the draft tokens before it are tested, and no token is drawn after them. A sampled row's
    ``forced`` flags are read from its masks; a greedy row's verification never reads them (all False). The
    bitmask is one sequence's own mask rows where it alone is verified (no copy), else its rows copied in."""
    seqs, drafts, rows, logits_rows, blocks = [], [], [], [], []
    for seq, first in drafted:
        mask = masks.get(seq.seq_id)
        tested, final = len(seq.draft), True
        if mask is not None and not (live := mask.any(axis=1)).all():
            tested, final = int(np.argmin(live)), False
        seqs.append(seq)
        if tested == 0 and not final:
            drafts.append(None)
            continue
        count, start = tested + int(final), len(rows)
        if mask is not None and not seq.params.is_greedy:
            forced = [single_token(mask[j]) for j in range(tested)]
        else:
            forced = [False] * tested
        drafts.append(DraftRows(start, seq.draft[:tested], final, forced))
        draft = seq.draft
        rows.extend([sampling_row(seq, draft[:j]) for j in range(count)])
        logits_rows.extend(range(first, first + count))
        if mask is not None:
            blocks.append((start, mask[:count]))
    if not blocks:
        return DraftBatch(seqs, drafts, rows, logits_rows, None, None)
    if len(blocks) == 1 and len(blocks[0][1]) == len(rows):  # one guided sequence alone: its rows as they are
        bitmask = blocks[0][1]
    else:
        bitmask = np.zeros((len(rows), blocks[0][1].shape[1]), dtype=np.int32)
        for start, block in blocks:
            bitmask[start:start + len(block)] = block
    masked = [i for start, block in blocks for i in range(start, start + len(block))]
    return DraftBatch(seqs, drafts, rows, logits_rows, bitmask, masked)


def single_token(words: np.ndarray) -> bool:
    """Whether a bitmask row allows exactly one token."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return False
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    return word & (word - 1) == 0
