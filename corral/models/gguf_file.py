"""Read a GGUF file's metadata into plain Python values (the ``gguf`` package does the parsing).

Opening is memory-mapped; parsing the 98 MB SmolLM2 file takes about 4 s on the development machine, so one
reader per path is cached for the process.
"""

import functools
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from corral.errors import ModelNotFoundError


@functools.cache
def open_gguf(path: str) -> GGUFReader:
    try:
        return GGUFReader(path, "r")
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot read GGUF file {path}: {exc}") from exc


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


@functools.cache
def gguf_metadata(path: str) -> dict[str, Any]:
    """All key/value metadata of a GGUF file: strings, numbers, lists of strings, numpy arrays of numbers."""
    reader = open_gguf(path)
    return {key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}
