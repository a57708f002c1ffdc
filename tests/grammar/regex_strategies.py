"""Hypothesis strategies for regexes and the texts they are tried on, shared by the regex tests."""

from hypothesis import strategies as st

ATOMS = ["a", "b", "-", ".", "[ab]", "[^a]", "[a-c]", "\\d", "\\W", "\\s", "\\x61", "\\u0062", "[\\]a]", "\\.",
         "[.-]", "é", "\\n"]
QUANTIFIERS = ["", "", "*", "+", "?", "{2}", "{1,}", "{0,2}", "*?", "{1,3}?", "??"]


def regexes():
    """Python-flavoured patterns of a few atoms, groups and quantifiers, optionally anchored."""
    atom = st.sampled_from(ATOMS)

    def extend(inner):
        group = st.builds(lambda r, kind: f"({kind}{r})", inner, st.sampled_from(["", "?:"]))
        piece = st.builds(lambda r, q: r + q, st.one_of(atom, group), st.sampled_from(QUANTIFIERS))
        seq = st.lists(piece, min_size=1, max_size=4).map("".join)
        return st.lists(seq, min_size=1, max_size=3).map("|".join)

    body = st.recursive(atom, extend, max_leaves=8)
    return st.builds(lambda pre, r, post: pre + r + post, st.sampled_from(["", "^"]), body,
                     st.sampled_from(["", "$"]))


TEXTS = st.text(alphabet="ab-.1 \né_", max_size=8)
