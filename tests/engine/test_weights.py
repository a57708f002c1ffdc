"""Weight loading from a local HF folder (safetensors), checked against HF transformers on tiny random Llamas:
untied LM head, GQA, Q/K/V biases off and on, RoPE theta and llama3 / linear scaling; fp32 and bf16. Also the
GGUF rotary un-permute as a round trip of llama.cpp's permutation, and GGUFs written as llama.cpp's converter
writes them: a Llama with llama3 RoPE factors, a Qwen2."""

import json

import numpy as np
import pytest
import torch

from corral.engine.attention import AttentionMetadata, KVCache, PrefillSpan
from corral.engine.model import LlamaModel
from corral.engine.weights import load_weights, unpermute_rotary
from corral.errors import ModelNotFoundError
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


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """What llama.cpp's converter stores as ``rope_freqs.weight`` for a ``llama3`` scaling: per rotary pair, the
    divisor of its frequency (1 for short wavelengths, ``factor`` for long ones, a blend between)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for wavelen in 2 * np.pi / inv_freq:
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(hf_model, path, rope_factors=None, **options) -> None:
    """``hf_model``'s weights in a float32 GGUF laid out as llama.cpp's converter writes a Llama (``arch="qwen2"``:
    a Qwen2), with ``rope_factors`` as its ``rope_freqs.weight`` where given; a tied model without its LM head."""
    pytest.importorskip("gguf")
    from tests.models.kquant_fixture import write_llama_gguf

    cfg = hf_model.config
    tied = cfg.tie_word_embeddings
    write_llama_gguf(str(path), {name: t.float().numpy() for name, t in hf_model.state_dict().items()
                                 if not (tied and name == "lm_head.weight")},
                     layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, ffn=cfg.intermediate_size,
                     heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, vocab=cfg.vocab_size,
                     context=cfg.max_position_embeddings, eos=cfg.eos_token_id, eps=cfg.rms_norm_eps,
                     extra=None if rope_factors is None else {"rope_freqs.weight": rope_factors}, **options)


def tiny_qwen2():
    """A random Qwen2 (tied embedding, Q/K/V biases drawn large, RoPE theta 1e6, head size 64 over one KV head)."""
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, rms_norm_eps=1e-6,
                                      rope_theta=1000000.0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts them at zero, which would test nothing
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return model


def test_a_qwen2_gguf_runs_as_transformers_runs_the_checkpoint(tmp_path, monkeypatch):
    """A Qwen2 GGUF as llama.cpp's converter writes one: its keys named ``qwen2.*``, its Q and K rows as HF has
    them (no rotary permutation), Q/K/V biases, a tied embedding. Read dense, its logits are transformers' own;
    under w4a8 (the float weights quantized at load), the native step with the biases is its torch forward."""
    from tests.engine.test_native_step import assert_native_step_is_the_forward

    monkeypatch.setenv("CORRAL_CACHE_DIR", str(tmp_path))  # converted weights are cached: not in the user's cache
    hf = tiny_qwen2()
    path = tmp_path / "qwen2.gguf"
    write_gguf(hf, path, arch="qwen2", theta=1000000.0)
    files = resolve_model(str(path))
    config = load_model_config(files)
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == ("Qwen2ForCausalLM", True,
                                                                                         True)
    assert (config.rope_theta, config.head_dim, config.num_kv_heads) == (1e6, 64, 1)
    assert config.rms_norm_eps == pytest.approx(1e-6, rel=1e-6)  # a float32 in the file
    ids = [3 + (7 * i) % 250 for i in range(300)]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    got = corral_logits(path, torch.float32, ids)
    assert float((got - expected).abs().max()) < 1e-4
    # a Qwen2 read in a Llama's layout (its Q and K rows un-permuted) is far off: the test tells them apart
    swapped = dict(load_weights(files, config, torch.float32))
    for layer in range(config.num_layers):
        for name, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            for part in ("weight", "bias"):
                key = f"model.layers.{layer}.self_attn.{name}.{part}"
                swapped[key] = torch.from_numpy(unpermute_rotary(swapped[key].numpy(), heads).copy())
    # (measured 1.2e-2 off, against 4.5e-7 as written)
    assert float((corral_logits_of(config, swapped, ids) - expected).abs().max()) > 5e-3
    model = LlamaModel(config, load_weights(files, config, torch.float32, keep_q4=True, keep_q8=True),
                       torch.float32, "w4a8")
    if model.native_step is None:
        pytest.skip("the native module is off or missing")
    assert model.native_step.qkv_bias is not None
    assert_native_step_is_the_forward(model, config, (([200], [], 0), ([90, 300], [20, 33], 0), ([50], [40], 60)),
                                      seed=5, blocks=64, max_len=512)


def test_a_qwen2_gguf_splits_numbers_digit_by_digit():
    """llama.cpp's "qwen2" pre-tokenizer (also its "deepseek-r1-qwen") takes one digit at a time where Llama 3's
    ("llama-bpe") takes up to three: with a merge of "1" and "2", "12" is one token under Llama 3's split and two
    under Qwen2's. Llama 3's also takes a word that is a whole vocabulary entry as that entry, without the merges
    that would make it ("ab" here has none); Qwen2's applies the merges."""
    import tempfile

    from corral.models.tokenizer import load_tokenizer
    from tests.models.kquant_fixture import write_llama_gguf

    pytest.importorskip("gguf")
    hf = tiny_qwen2()
    weights = {name: t.float().numpy() for name, t in hf.state_dict().items() if name != "lm_head.weight"}
    with tempfile.TemporaryDirectory() as tmp:
        encoded = {}
        for pre in ("qwen2", "deepseek-r1-qwen", "llama-bpe"):
            path = f"{tmp}/{pre}.gguf"
            write_llama_gguf(path, weights, layers=2, hidden=128, ffn=96, heads=2, kv_heads=1, vocab=256,
                             context=512, eos=2, arch="qwen2", pre=pre, merges=("1 2",), pieces=("ab",))
            encoded[pre] = load_tokenizer(path).encode("a 12\nab")  # "12": id 254, "ab": id 255, a byte: itself
    split = [ord("a"), ord(" "), ord("1"), ord("2"), ord("\n"), ord("a"), ord("b")]
    assert encoded == {"qwen2": split, "deepseek-r1-qwen": split,
                       "llama-bpe": [ord("a"), ord(" "), 254, ord("\n"), 255]}


def test_a_gguf_with_llama3_scaling_as_its_rope_freqs_matches_transformers(tmp_path):
    """llama.cpp's converter keeps Llama 3.1's ``llama3`` RoPE scaling only as the ``rope_freqs.weight`` tensor:
    a GGUF so written runs as transformers runs the checkpoint, and the same file without that tensor does not."""
    scaling = VARIANTS["llama3 scaling"]["rope_scaling"]
    hf = tiny_llama(tmp_path / "hf", **VARIANTS["llama3 scaling"])
    factors = llama3_rope_factors(10000.0, hf.config.hidden_size // hf.config.num_attention_heads, scaling)
    assert factors.min() == 1.0 and factors.max() == scaling["factor"]  # short, long and blended pairs
    write_gguf(hf, tmp_path / "scaled.gguf", factors)
    write_gguf(hf, tmp_path / "plain.gguf")
    ids = [3 + i % 120 for i in range(240)]  # far past original_max_position_embeddings (32)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    config = load_model_config(resolve_model(str(tmp_path / "scaled.gguf")))
    assert config.rope_scaling == {"freq_factors": tuple(float(f) for f in factors)}
    assert float((corral_logits(tmp_path / "scaled.gguf", torch.float32, ids) - expected).abs().max()) < 1e-4
    # random weights damp what RoPE changes: without the factors, measured 4.5e-3 off (with them, 2e-7)
    assert float((corral_logits(tmp_path / "plain.gguf", torch.float32, ids) - expected).abs().max()) > 2e-3


def test_a_gguf_whose_rope_freqs_do_not_fit_is_refused(tmp_path):
    hf = tiny_llama(tmp_path / "hf")
    half = hf.config.hidden_size // hf.config.num_attention_heads // 2
    for name, factors, message in (("short", np.ones(half - 1, np.float32), "holds 7 factors"),
                                   ("zero", np.zeros(half, np.float32), "not a positive number")):
        write_gguf(hf, tmp_path / f"{name}.gguf", factors)
        with pytest.raises(ModelNotFoundError, match=message):
            load_model_config(resolve_model(str(tmp_path / f"{name}.gguf")))
