"""SamplingParams: the per-request decoding knobs, frozen and checked on construction.

Ranges follow the OpenAI API where it defines one (penalties in [-2, 2], logit bias in [-100, 100], at most 20
top logprobs) and vLLM elsewhere. A bad value raises :class:`InvalidRequestError` naming the parameter, so the
API answers 400 with ``param`` set. A beam-search request carries :class:`BeamSearchParams` instead (the engine
runs its beams as a group, see ``corral.engine.beam_search``). Left out: ``best_of``, a strategy over the engine
(``corral.engine.best_of_n``) rather than a per-token knob.
"""

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from corral.errors import InvalidRequestError

MAX_LOGPROBS = 20
OUTPUT_KINDS = ("cumulative", "delta", "final")
MAX_LOGIT_BIAS = 100.0
# HF-style: positive logits are divided by it and negative ones multiplied, so a value far from 1 overflows them to
# inf (the row would then end its sequence as if the model had given no finite logit); the API's bounds
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def make_logit_bias(bias: Mapping[int | str, float] | None) -> tuple[tuple[int, float], ...]:
    """The hashable form of an OpenAI ``logit_bias`` dict (keys may be token-id strings), sorted by token id."""
    if not bias:
        return ()
    for token_id in bias:  # int() would also take "1_0", " 7 " and other scripts' digits
        if isinstance(token_id, str) and not (token_id.isascii() and token_id.isdigit()):
            raise InvalidRequestError(f"logit_bias keys are token ids written in digits, got {token_id!r}",
                                      param="logit_bias")
    try:
        return tuple(sorted((int(token_id), float(value)) for token_id, value in bias.items()))
    except (TypeError, ValueError) as err:
        raise InvalidRequestError(f"logit_bias must map token ids to numbers: {err}", param="logit_bias") from err


# Temperatures below this decode greedily, as vLLM's do: dividing logits by them overflows float32 (a request at
# 1e-300 made every logit infinite), and a draw that sharp is the argmax anyway.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request.

    ``temperature`` 0 (or anything below ``GREEDY_BELOW``) means greedy. ``top_k`` 0 and ``top_p`` 1 and
    ``min_p`` 0 turn those filters off.
    ``logprobs``: None returns none; 0 the chosen token's logprob; k also the k most likely tokens. Logprobs are
    those of the model's raw distribution, before any mask, bias, penalty or temperature.
    ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before that many output tokens (unless the
    grammar allows nothing else). ``seed`` makes the request's draws independent of the rest of the batch.
    ``jump_forward`` and ``speculation`` turn drafts on or off for this request (None: the engine's setting);
    neither changes the tokens a request gets, only how many forward passes produce them.
    ``output_kind``: ``cumulative`` gives an output after every step that advanced the request, each holding all
    it has produced so far; ``delta`` gives the same outputs holding only what is new since the request's previous
    one (token ids, text and logprobs; the counters and ``cumulative_logprob`` stay totals), so the last step of a
    long stream costs what its first did (for streaming); ``final`` gives the finished output alone, so a caller
    that waits for the whole answer costs nothing per step (no output built, no thread woken).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    jump_forward: bool | None = None  # draft the spans the grammar forces; None: the engine's default
    speculation: bool | None = None  # draft by prompt lookup; None: the engine's default
    output_kind: str = "cumulative"  # or "delta", "final"

    def __post_init__(self):
        # Normalise containers to tuples so the params stay hashable; values are never derived or rewritten.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", make_logit_bias(self.logit_bias))
        for name in ("stop", "stop_token_ids", "logit_bias"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        self._validate()

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        _require(_is_number(self.temperature) and self.temperature >= 0, "temperature",
                 f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
                 f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k",
                 f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
                 f"min_p must be in [0, 1], got {self.min_p!r}")
        _require(self.seed is None or _is_int(self.seed), "seed", f"seed must be an integer, got {self.seed!r}")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 f"stop must be non-empty strings, got {self.stop!r}")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        self._validate_bias_and_penalties()
        for name in ("jump_forward", "speculation"):
            value = getattr(self, name)
            _require(value is None or isinstance(value, bool), name, f"{name} must be a boolean, got {value!r}")
        _require(self.output_kind in OUTPUT_KINDS, "output_kind",
                 f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                 "logprobs", f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    def _validate_bias_and_penalties(self) -> None:
        for item in self.logit_bias:
            ok = (isinstance(item, tuple) and len(item) == 2 and _is_int(item[0]) and item[0] >= 0
                  and _is_number(item[1]) and abs(item[1]) <= MAX_LOGIT_BIAS)
            _require(ok, "logit_bias", f"logit_bias entries must be (token id >= 0, value in "
                                       f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]), got {item!r}")
        token_ids = [token_id for token_id, _ in self.logit_bias]
        _require(len(set(token_ids)) == len(token_ids), "logit_bias", "logit_bias names a token id twice")
        low, high = REPETITION_PENALTY_RANGE
        _require(_is_number(self.repetition_penalty) and low <= self.repetition_penalty <= high, "repetition_penalty",
                 f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @functools.cached_property
    def unshaped(self) -> bool:
        """No bias and no penalty: once ``min_tokens`` is reached, the token depends on the masked logits, the
        temperature, the filters and one uniform alone. Read at every step of every row, so computed once (not a
        field: equality and hash are the fields')."""
        return not self.logit_bias and not self.has_penalties

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Unshaped and greedy, with no top logprobs: the token is the argmax of the masked logits once
        ``min_tokens`` is reached, and nothing else is asked."""
        return self.is_greedy and not self.logprobs and self.unshaped


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class BeamSearchParams:
    """How to run one beam-search request: keep the ``beam_width`` best beams each step, score a finished
    hypothesis ``cumulative_logprob / length ** length_penalty`` (``length``: its output tokens, EOS included),
    and with ``early_stopping`` end as soon as ``beam_width`` hypotheses are finished."""

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool = False

    def __post_init__(self):
        _require(_is_int(self.beam_width) and self.beam_width >= 1, "beam_width",
                 f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _require(_is_number(self.length_penalty), "length_penalty",
                 f"length_penalty must be a finite number, got {self.length_penalty!r}")
        _require(isinstance(self.early_stopping, bool), "early_stopping",
                 f"early_stopping must be a boolean, got {self.early_stopping!r}")
