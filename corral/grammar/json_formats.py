"""JSON Schema ``format`` values as regexes over the decoded string.

Each regex is the standard's grammar or a strict subset of it, never a superset, so a format-checking validator
never rejects what Corral generates:

- ``date``, ``time``, ``date-time``: RFC 3339, with the real number of days per month and leap years (Feb 29
  only in years divisible by 4, except centuries not divisible by 400). Left out: the leap second ``:60``.
- ``duration``: RFC 3339 appendix A (``P1Y2M``, ``PT5M``, ``P3W``; components in order, ``T`` needs one).
- ``email``: the RFC 5321 dot-atom local part ``@`` a hostname. Left out: quoted local parts, address literals.
- ``hostname``: RFC 1123 labels (alphanumerics and inner hyphens); at most 8 labels of at most 30 characters
  keeps every name within the 253-character limit without a counter.
- ``ipv4``: dotted decimal without leading zeros (as Python's ``ipaddress`` reads it). ``ipv6``: RFC 4291 text
  forms, with an embedded IPv4 tail. Left out: zone identifiers.
- ``uuid``: 8-4-4-4-12 hex digits, either case. ``uri``, ``uri-reference``: RFC 3986; ``iri``,
  ``iri-reference``: RFC 3987 (non-ASCII characters of the BMP). ``json-pointer``, ``relative-json-pointer``.

The other formats some draft defines (``regex``, ``idn-email``, ``idn-hostname``, ``uri-template``) are refused:
validators check them, so ignoring them would let invalid values through. Any other name is an annotation
(JSON Schema 2019-09 and later say so outright; earlier drafts let validators ignore unknown formats): the
caller ignores it and records a warning.
"""

import functools

from corral.grammar.regex_ast import Alt, CharSet, Concat, Node
from corral.grammar.regex_parser import parse_regex

_D2 = "[0-9]{2}"
_YEAR = "[0-9]{4}"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_OFFSET = "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_TIME = f"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?{_OFFSET}"
_NUM = "[0-9]+"
_DUR_TIME = f"T(?:{_NUM}H(?:{_NUM}M(?:{_NUM}S)?)?|{_NUM}M(?:{_NUM}S)?|{_NUM}S)"
_DUR_DATE = f"(?:{_NUM}D|{_NUM}M(?:{_NUM}D)?|{_NUM}Y(?:{_NUM}M(?:{_NUM}D)?)?)(?:{_DUR_TIME})?"
_DURATION = f"P(?:{_DUR_DATE}|{_DUR_TIME}|{_NUM}W)"
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,28}[A-Za-z0-9])?"
_HOSTNAME = f"{_LABEL}(?:\\.{_LABEL}){{0,7}}"
_ATOM = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_EMAIL = f"{_ATOM}(?:\\.{_ATOM})*@{_HOSTNAME}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = f"{_OCTET}(?:\\.{_OCTET}){{3}}"
_H16 = "[0-9A-Fa-f]{1,4}"
_LS32 = f"(?:{_H16}:{_H16}|{_IPV4})"
_IPV6 = "(?:" + "|".join([
    f"(?:{_H16}:){{6}}{_LS32}",
    f"::(?:{_H16}:){{5}}{_LS32}",
    f"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
    f"(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}{_LS32}",
    f"(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}{_LS32}",
    f"(?:(?:{_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}",
    f"(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}",
    f"(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}",
    f"(?:(?:{_H16}:){{0,6}}{_H16})?::",
]) + ")"
_HEX = "[0-9A-Fa-f]"
_UUID = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
_UNRESERVED_ETC = "[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2}"  # unreserved, sub-delims, pct-encoded
_IUNRESERVED_ETC = "[A-Za-z0-9._~!$&'()*+,;=\u00a0-\ud7ff\uf900-\ufdcf\ufdf0-\uffef-]|%[0-9A-Fa-f]{2}"
def _uri_regexes(unreserved: str) -> tuple[str, str]:
    """RFC 3986 URI and relative-ref (RFC 3987 IRI forms when ``unreserved`` holds the non-ASCII ucschars)."""
    pchar = f"(?:{unreserved}|[:@])"
    authority = f"(?:(?:{unreserved}|:)*@)?(?:\\[{_IPV6}\\]|(?:{unreserved})*)(?::[0-9]*)?"
    path_rest = f"(?:/{pchar}*)*"
    tail = f"(?:\\?(?:{pchar}|[/?])*)?(?:#(?:{pchar}|[/?])*)?"
    hier = f"//{authority}{path_rest}|/(?:{pchar}+{path_rest})?"
    return (f"[A-Za-z][A-Za-z0-9+.-]*:(?:{hier}|{pchar}+{path_rest}|){tail}",
            f"(?:{hier}|(?:{unreserved}|@)+{path_rest}|){tail}")


_URI, _RELATIVE_REF = _uri_regexes(_UNRESERVED_ETC)
_IRI, _RELATIVE_IRI = _uri_regexes(_IUNRESERVED_ETC)
_POINTER = "(?:/(?:[^/~]|~[01])*)*"


FORMAT_REGEXES = {
    "date": _DATE,
    "time": _TIME,
    "duration": _DURATION,
    "email": _EMAIL,
    "hostname": _HOSTNAME,
    "ipv4": _IPV4,
    "ipv6": _IPV6,
    "uuid": _UUID,
    "uri": _URI,
    "iri": _IRI,
    "json-pointer": _POINTER,
    "relative-json-pointer": f"(?:0|[1-9][0-9]*)(?:#|{_POINTER})",
}
_REFERENCES = {"uri-reference": (_URI, _RELATIVE_REF), "iri-reference": (_IRI, _RELATIVE_IRI)}
# Every format some draft defines: one that Corral does not compile is refused, never ignored, because validators
# check these. Any other name is an annotation.
STANDARD_FORMATS = frozenset({*FORMAT_REGEXES, "date-time", *_REFERENCES, "idn-email", "idn-hostname", "regex",
                              "uri-template"})


def format_node(name: str) -> Node | None:
    """The decoded-string language of ``format: name``, or None for a format Corral treats as an annotation
    (names come from requests: only Corral's own are built and cached)."""
    if name != "date-time" and name not in _REFERENCES and name not in FORMAT_REGEXES:
        return None
    return _format_node(name)


@functools.cache
def _format_node(name: str) -> Node:
    if name == "date-time":  # composed here: the parser would distribute the date's alternation over the tail
        return Concat((format_node("date"), CharSet.chars("Tt"), format_node("time")))
    if name in _REFERENCES:
        absolute, relative = _REFERENCES[name]
        return Alt((parse_regex(absolute, flavor="python"), parse_regex(relative, flavor="python")))
    return parse_regex(FORMAT_REGEXES[name], flavor="python")
