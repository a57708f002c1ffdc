"""Incremental detokenization and stop strings, one sequence at a time, O(token length) per token.

Text is built from the Vocabulary's exact token bytes through an incremental UTF-8 decoder, so a character
split across tokens appears once its last byte arrives, and no re-decoding of the whole output ever happens.
Stop strings are searched only in the window the new text could complete; the text is cut before the stop
string. While a stop string could still be completing, its possible start is held back from streaming
(``visible_text``), so a client never sees text that is later taken back. What this leaves out: tokenizer
normalisation on decode (SentencePiece's leading-space strip), which changes text the grammar constrained.
"""

import codecs

from corral.fsm.vocabulary import Vocabulary


class IncrementalDetokenizer:
    def __init__(self, vocabulary: Vocabulary, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.vocabulary, self.stop = vocabulary, stop
        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.stopped_by: str | None = None

    def add_token(self, token_id: int) -> str | None:
        """Append ``token_id``'s text; return the stop string it completed (text then ends before it), or None."""
        assert self.stopped_by is None, "no token may follow a stop string"
        if self.skip_special_tokens and token_id in self.vocabulary.special_ids:
            return None
        start = len(self.text)
        self.text += self._decoder.decode(self.vocabulary.token_bytes[token_id])
        return self._find_stop(start)

    def add_tokens(self, token_ids: list[int]) -> tuple[int, str | None]:
        """:meth:`add_token` for each of ``token_ids`` in turn until one completes a stop string: (how many were
        added, that stop string or None). With no stop strings the run's bytes go through the decoder in one call,
        which gives the text of one call per token (an incremental decoder holds a split character either way)."""
        if self.stop:
            for i, token_id in enumerate(token_ids):
                stop = self.add_token(token_id)
                if stop is not None:
                    return i + 1, stop
            return len(token_ids), None
        assert self.stopped_by is None, "no token may follow a stop string"
        table = self.vocabulary.token_bytes
        special = self.vocabulary.special_ids if self.skip_special_tokens else ()
        self.text += self._decoder.decode(b"".join([table[t] for t in token_ids if t not in special]))
        return len(token_ids), None

    def _find_stop(self, start: int) -> str | None:
        best = None
        for stop in self.stop:
            # a match must end inside the new text, so it starts at most len(stop) - 1 characters earlier
            at = self.text.find(stop, max(0, start - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.stopped_by = best[1]
        return best[1]

    def finish(self) -> None:
        """Flush a trailing incomplete character (as U+FFFD) at the end of the sequence."""
        if self.stopped_by is None:
            self.text += self._decoder.decode(b"", final=True)

    def visible_text(self, finished: bool) -> str:
        """The text safe to stream now: everything once finished, else all but a possible stop-string start."""
        if finished or not self._hold:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]

    def visible_since(self, start: int, finished: bool) -> tuple[str, int]:
        """What :meth:`visible_text` holds past its first ``start`` characters, and where that ends: a stream's
        next piece, copied alone. (The visible text only grows: a stop string found later starts past what was
        visible, since the characters it could start in were held back.)"""
        end = len(self.text) if finished or not self._hold else max(0, len(self.text) - self._hold)
        return self.text[start:end], max(start, end)
