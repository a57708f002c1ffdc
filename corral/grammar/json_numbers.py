"""JSON numbers as regex ASTs: the plain grammars, exact digit-range regexes for bounded integers, and exact
decimal-range regexes for bounded numbers.

Integers are written canonically (no leading zeros, no ``-0``): ``-?(0|[1-9][0-9]*)``. A bounded integer becomes a
digit-range regex accepting exactly the integers in ``[lo, hi]``; fractional bounds are rounded inwards exactly
(``Fraction``), so ``minimum: 0.5`` means ``>= 1``.

Bounded numbers (type ``number`` with any of minimum/maximum/exclusive*) are exact, at the price of a narrower
spelling: no exponent and at most ``FRACTION_DIGITS`` fraction digits. ``json.dumps`` writes every float in
``[1e-4, 1e16)`` that way, and 22 digits covers its longest such output. Soundness against a validator that
parses the instance as a binary64 float (``jsonschema`` does): the lower bound is first moved up to the smallest
float ``x`` that satisfies it (``>= lo``, or ``> lo`` when exclusive), then rounded up to the grid of
``FRACTION_DIGITS`` digits. A decimal ``>= x`` rounds to a float ``>= x`` because rounding is monotone and ``x`` is
itself a float, so every accepted text satisfies the bound whether it is parsed as an int or as a float; the upper
bound is symmetric. Left out: exponents in bounded numbers, and ``-0``.
"""

import functools
import math
from fractions import Fraction

from corral.grammar.node_builder import NodeBuilder
from corral.grammar.regex_ast import EMPTY, NOTHING, CharSet, Node

FRACTION_DIGITS = 22
DIGIT = CharSet.of((48, 57))
NONZERO_DIGIT = CharSet.of((49, 57))


@functools.cache
def decimal_digits(low: int, high: int) -> CharSet:
    return CharSet.of((48 + low, 48 + high))


@functools.cache
def hex_digits(low: int, high: int) -> CharSet:
    """Hex digit values ``low..high`` in either case, as JSON's ``\\uXXXX`` allows."""
    ranges = [(48 + d, 48 + d) if d < 10 else (87 + d, 87 + d) for d in range(low, high + 1)]
    ranges += [(55 + d, 55 + d) for d in range(max(low, 10), high + 1)]
    return CharSet.of(*ranges)


def fixed_width_range(b: NodeBuilder, low: list[int], high: list[int], base: int = 10, digits=decimal_digits) -> Node:
    """Digit strings of exactly ``len(low)`` digits whose value lies in ``[low, high]`` (big-endian digit lists)."""
    assert len(low) == len(high) and low <= high, (low, high)
    width = len(low)
    if width == 0:
        return EMPTY
    top = base - 1
    if all(d == 0 for d in low) and all(d == top for d in high):
        return b.repeat(digits(0, top), width, width)
    if low[0] == high[0]:
        return b.concat(digits(low[0], low[0]), fixed_width_range(b, low[1:], high[1:], base, digits))
    options, first, last = [], low[0], high[0]
    if any(low[1:]):
        options.append(b.concat(digits(first, first), fixed_width_range(b, low[1:], [top] * (width - 1), base,
                                                                         digits)))
        first += 1
    if any(d != top for d in high[1:]):
        options.append(b.concat(digits(last, last), fixed_width_range(b, [0] * (width - 1), high[1:], base,
                                                                       digits)))
        last -= 1
    if first <= last:
        options.append(b.concat(digits(first, last), b.repeat(digits(0, top), width - 1, width - 1)))
    return b.alt(options)


def natural_range(b: NodeBuilder, low: int, high: int | None) -> Node:
    """Canonical decimal spellings of the naturals in ``[low, high]`` (``high=None``: unbounded)."""
    assert low >= 0
    if high is not None and high < low:
        return NOTHING
    options = []
    num_low_digits = len(str(low))
    for width in range(num_low_digits, len(str(high)) + 1 if high is not None else num_low_digits + 1):
        start = max(low, 10 ** (width - 1) if width > 1 else 0)
        stop = 10 ** width - 1 if high is None else min(high, 10 ** width - 1)
        if start <= stop:
            options.append(fixed_width_range(b, [int(c) for c in str(start)], [int(c) for c in str(stop)]))
    if high is None:  # every longer natural
        options.append(b.concat(NONZERO_DIGIT, b.repeat(DIGIT, num_low_digits, None)))
    return b.alt(options)


def integer_range(b: NodeBuilder, low: int | None, high: int | None) -> Node:
    """Canonical spellings (no ``-0``) of the integers in ``[low, high]``; None is unbounded."""
    if low is not None and high is not None and low > high:
        return NOTHING
    options = []
    if high is None or high >= 0:
        options.append(natural_range(b, max(low or 0, 0), high))
    if low is None or low < 0:
        options.append(b.concat(CharSet.chars("-"),
                                natural_range(b, 1 if high is None or high >= 0 else -high,
                                              None if low is None else -low)))
    return b.alt(options)


def integer_node(b: NodeBuilder) -> Node:
    return integer_range(b, None, None)


def number_node(b: NodeBuilder) -> Node:
    """Any JSON number: ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?`` (``-0`` included, as JSON allows)."""
    fraction = b.optional(b.concat(CharSet.chars("."), b.repeat(DIGIT, 1, None)))
    exponent = b.optional(b.concat(CharSet.chars("eE"), b.optional(CharSet.chars("+-")), b.repeat(DIGIT, 1, None)))
    natural = b.alt([CharSet.chars("0"), b.concat(NONZERO_DIGIT, b.repeat(DIGIT, 0, None))])
    return b.concat(b.optional(CharSet.chars("-")), natural, fraction, exponent)


# ---- bounds ----------------------------------------------------------------------------------------------------

def integer_bounds(low: Fraction | None, low_strict: bool, high: Fraction | None, high_strict: bool):
    """Exact integer bounds ``(lo, hi)`` from possibly fractional, possibly exclusive bounds."""
    lo = None if low is None else (math.floor(low) + 1 if low_strict else math.ceil(low))
    hi = None if high is None else (math.ceil(high) - 1 if high_strict else math.floor(high))
    return lo, hi


def _float_inside(bound: Fraction, strict: bool, upward: bool) -> Fraction:
    """The nearest binary64 float on the allowed side of ``bound`` (see the module docstring), exactly."""
    direction = math.inf if upward else -math.inf
    value = float(bound)  # may raise OverflowError: the caller turns it into a schema error
    exact = Fraction(value)
    if (exact < bound if upward else exact > bound) or (strict and exact == bound):
        value = math.nextafter(value, direction)
    return Fraction(value)


def number_range(b: NodeBuilder, low: Fraction | None, low_strict: bool, high: Fraction | None,
                 high_strict: bool) -> Node:
    """Spellings (no exponent, at most FRACTION_DIGITS fraction digits) of the numbers within the bounds."""
    scale = 10 ** FRACTION_DIGITS
    lo = None if low is None else math.ceil(_float_inside(low, low_strict, True) * scale)
    hi = None if high is None else math.floor(_float_inside(high, high_strict, False) * scale)
    if lo is not None and hi is not None and lo > hi:
        return NOTHING
    options = []
    if hi is None or hi >= 0:
        options.append(_unsigned_decimal(b, max(lo or 0, 0), hi))
    if lo is None or lo < 0:  # negatives: magnitudes of at least one grid step, so no "-0"
        magnitude_low = 1 if hi is None or hi >= 0 else -hi
        options.append(b.concat(CharSet.chars("-"), _unsigned_decimal(b, max(magnitude_low, 1),
                                                                       None if lo is None else -lo)))
    return b.alt(options)


def _unsigned_decimal(b: NodeBuilder, low: int, high: int | None) -> Node:
    """Non-negative decimals whose value times 10**FRACTION_DIGITS lies in ``[low, high]``."""
    if high is not None and high < low:
        return NOTHING
    scale = 10 ** FRACTION_DIGITS
    low_int, low_frac = divmod(low, scale)
    low_digits = str(low_frac).zfill(FRACTION_DIGITS)
    if high is not None:
        high_int, high_frac = divmod(high, scale)
        high_digits = str(high_frac).zfill(FRACTION_DIGITS)
        if high_int == low_int:
            return b.concat(b.literal(str(low_int)), _fraction_part(b, low_digits, high_digits))
    nines = "9" * FRACTION_DIGITS
    options = [b.concat(b.literal(str(low_int)), _fraction_part(b, low_digits, nines)),
               b.concat(natural_range(b, low_int + 1, None if high is None else high_int - 1),
                        _fraction_part(b, "0" * FRACTION_DIGITS, nines))]
    if high is not None:
        options.append(b.concat(b.literal(str(high_int)), _fraction_part(b, "0" * FRACTION_DIGITS, high_digits)))
    return b.alt(options)


def _fraction_part(b: NodeBuilder, low: str, high: str) -> Node:
    """An optional ``.digits`` whose value ``0.digits`` lies in ``[0.low, 0.high]`` (no fraction means 0)."""
    with_dot = b.concat(CharSet.chars("."), _fraction_digits(b, low, high, 1))
    return b.alt([EMPTY, with_dot]) if low.strip("0") == "" else with_dot


def _fraction_digits(b: NodeBuilder, low: str, high: str, min_len: int) -> Node:
    """Digit strings ``d`` of length ``min_len..len(low)`` with ``0.low <= 0.d <= 0.high``."""
    width = len(low)
    if min_len > width:
        return NOTHING
    low_is_zero, high_is_full = low.strip("0") == "", high.strip("9") == ""
    if low_is_zero and high_is_full:
        return b.repeat(DIGIT, min_len, width)
    if width == 0:
        return NOTHING
    options = [EMPTY] if min_len == 0 and low_is_zero else []  # "" is 0.0, below any nonzero ``low``
    rest_min = max(min_len - 1, 0)
    first, last = int(low[0]), int(high[0])
    if first == last:
        options.append(b.concat(decimal_digits(first, first), _fraction_digits(b, low[1:], high[1:], rest_min)))
    else:
        options.append(b.concat(decimal_digits(first, first),
                                _fraction_digits(b, low[1:], "9" * (width - 1), rest_min)))
        options.append(b.concat(decimal_digits(last, last),
                                _fraction_digits(b, "0" * (width - 1), high[1:], rest_min)))
        if first + 1 <= last - 1:
            options.append(b.concat(decimal_digits(first + 1, last - 1), b.repeat(DIGIT, rest_min, width - 1)))
    return b.alt(options)
