"""Read a GGUF file's metadata into plain Python values and list its tensors (the ``gguf`` package parses).

Opening is memory-mapped; parsing the 98 MB SmolLM2 file takes about 4 s on the development machine, so each
path is parsed once per process and what was read is cached: the metadata as plain values and the tensors'
descriptions (their data memory-mapped views). The reader itself is not kept. It holds a numpy memmap view, with
its own ``__dict__``, for every part of every metadata array (a length and the bytes of each of the tokenizer's
49,152 tokens and 48,900 merges): about half a million objects that the garbage collector walks at every full
collection (close to 200 ms holding the GIL here, every stream stalled) and that nothing reads after loading.
"""

import functools
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from corral.errors import ModelNotFoundError


@functools.cache
def _contents(path: str) -> tuple[dict[str, Any], tuple[ReaderTensor, ...]]:
    try:
        reader = GGUFReader(path, "r")
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot read GGUF file {path}: {exc}") from exc
    metadata = {key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    return metadata, tuple(reader.tensors)


def gguf_tensors(path: str) -> tuple[ReaderTensor, ...]:
    """The tensors of a GGUF file: name, type, shape and data (a view of the memory-mapped file) of each."""
    return _contents(path)[1]


def _field_value(field) -> Any:
    kinds = field.types
    if kinds[0] == GGUFValueType.ARRAY:
        if kinds[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])
    if kinds[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]]
    return value.item() if value.size == 1 else value.tolist()


def gguf_metadata(path: str) -> dict[str, Any]:
    """All key/value metadata of a GGUF file: strings, numbers, lists of strings, numpy arrays of numbers."""
    return _contents(path)[0]
