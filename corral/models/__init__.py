"""Model artifacts: where the weights live, what the model is, and its tokenizer. No torch here.

This is its own small package rather than part of ``engine/`` because the FSM layer needs the tokenizer's
vocabulary without importing torch, and the API needs the chat template. Weight loading (torch) is in
``corral.engine.weights``.
"""

from corral.models.config import ModelConfig, load_model_config
from corral.models.files import ModelFiles, resolve_model
from corral.models.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ModelConfig", "ModelFiles", "Tokenizer", "load_model_config", "load_tokenizer", "resolve_model"]
