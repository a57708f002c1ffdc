"""Activation-aware scaling before int4 rounding (corral/engine/awq.py): the scaled model is the same function,
the scales cut the quantized layer's error on activations it was not searched on, and the switch is checked."""

import pytest
import torch

from corral.engine import awq
from corral.engine.config import EngineConfig
from corral.engine.quant import check_group_size, quantize_int4
from corral.engine.weights import load_weights
from corral.errors import InvalidRequestError
from corral.models import load_model_config, resolve_model
from tests.engine.test_weights import corral_logits_of, tiny_llama


def test_the_scaled_weights_are_the_same_model(tmp_path):
    tiny_llama(tmp_path)  # hidden 64, intermediate 96: group 32 divides both
    files = resolve_model(str(tmp_path))
    config = load_model_config(files)
    weights = load_weights(files, config, torch.float32)
    ids = [int(t) for t in torch.randint(3, 128, (300,), generator=torch.Generator().manual_seed(1))]
    scaled = awq.scale_weights(weights, config, ids, group=32, clip_groups=False)
    changed = [name for name in weights if not torch.equal(weights[name], scaled[name])]
    assert any("q_proj" in n for n in changed) and any("up_proj" in n for n in changed)
    assert any("layernorm" in n for n in changed) and any("down_proj" in n for n in changed)
    probe = list(range(3, 90))
    before, after = corral_logits_of(config, weights, probe), corral_logits_of(config, scaled, probe)
    # the scales and their inverses cancel up to float32 rounding of the products they pass through
    assert float((before - after).abs().max()) < 1e-4 * float(before.abs().max())


def test_the_scales_cut_the_error_on_activations_they_were_not_searched_on():
    rng = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=rng)
    loud = torch.ones(256)
    loud[torch.randperm(256, generator=rng)[:8]] = 30.0  # a few channels carry most of the activation, as in LLMs

    def activations(n):
        return torch.randn(n, 256, generator=rng) * loud

    inputs = awq._Inputs(lambda x: x, total=1024)
    for _ in range(4):
        inputs(activations(256))
    s, alpha = awq.best_scale(weight, inputs, group=64, dtype=torch.float32)
    assert alpha > 0
    held_out = activations(1024)
    reference = held_out @ weight.T
    plain = held_out @ quantize_int4(weight, 64).dequantize().T
    scaled = held_out @ (quantize_int4(weight * s, 64).dequantize() / s).T
    assert float((scaled - reference).pow(2).mean()) < 0.8 * float((plain - reference).pow(2).mean())


def test_awq_needs_w4a16():
    with pytest.raises(InvalidRequestError, match="needs quantization w4a16") as caught:
        EngineConfig(quantization="w8a16", awq=True)
    assert caught.value.param == "awq"
    assert EngineConfig(quantization="w4a16", quant_group_size=64, awq=True).awq


def test_the_calibration_text_ships_with_the_package():
    ids = awq.calibration_ids(lambda text: text.split())
    assert len(ids) == 2048 and ids[:2] == ["Acts", "1"]


def test_clipping_keeps_the_least_error_range_of_each_group():
    rng = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 128, generator=rng)
    weight[:, 5] = 9.0  # a lone large weight stretches its groups' ranges: clipping it costs less than the grid
    x = torch.randn(300, 128, generator=rng)
    x[:, 5] *= 0.05  # ... as long as its input is quiet
    ratio = awq.best_clip(weight, x, 32, torch.float32)
    assert ratio.shape == (40, 4) and bool((ratio[:, 0] < 1).all()) and bool((ratio <= 1).all())

    def group_errors(w):
        d = (weight - awq.quantize_int4(w, 32).dequantize()).view(40, 4, 32)
        return torch.einsum("tgk,ngk->tng", x.view(300, 4, 32), d).pow(2).mean(0)

    clipped, plain = group_errors(awq.clip(weight, 32, ratio)), group_errors(weight)
    assert bool((clipped <= plain * (1 + 1e-5)).all()) and float(clipped.sum()) < 0.9 * float(plain.sum())


@pytest.mark.parametrize("total, windows", [(2048, [512] * 4), (300, [256, 44]), (1000, [512, 488])])
def test_the_search_sees_every_stride_th_row_of_the_whole_stream(total, windows):
    inputs = awq._Inputs(lambda x: x, total=total)
    start = 0
    for size in windows:
        inputs(torch.arange(start, start + size, dtype=torch.float32)[:, None].expand(size, 3))
        start += size
    rows = inputs.sample()[:, 0].long().tolist()
    assert rows == list(range(0, total, inputs.stride))
    assert min(total, awq.SEARCH_ROWS // 2) < len(rows) <= awq.SEARCH_ROWS or len(rows) == total


@pytest.mark.parametrize("clip_qk", [True, False])
def test_clipping_stays_in_range_keeps_the_model_close_and_obeys_its_switch(tmp_path, monkeypatch, clip_qk):
    monkeypatch.setattr(awq, "CLIP_QK", clip_qk)
    tiny_llama(tmp_path)
    files = resolve_model(str(tmp_path))
    config = load_model_config(files)
    weights = load_weights(files, config, torch.float32)
    ids = [int(t) for t in torch.randint(3, 128, (300,), generator=torch.Generator().manual_seed(2))]
    scaled = awq.scale_weights(weights, config, ids, group=32, clip_groups=False)
    clipped = awq.scale_weights(weights, config, ids, group=32, clip_groups=True)
    changed = {name.split(".")[-2] for name in weights if not torch.equal(scaled[name], clipped[name])}
    assert bool({"q_proj", "k_proj"} & changed) == clip_qk
    assert changed & {"v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for name in weights:  # clipping only pulls weights toward zero, never past a group's range
        assert bool((clipped[name].abs() <= scaled[name].abs() + 1e-6).all()), name
    probe = list(range(3, 90))
    reference = corral_logits_of(config, scaled, probe)
    drift = (corral_logits_of(config, clipped, probe) - reference).abs().max()
    assert float(drift) < 0.5 * float(reference.abs().max())


def test_a_group_size_that_does_not_divide_the_model_is_refused_before_loading(tmp_path):
    tiny_llama(tmp_path)  # hidden 64, intermediate 96
    config = load_model_config(resolve_model(str(tmp_path)))
    check_group_size(32, config)
    with pytest.raises(InvalidRequestError, match="hidden size") as caught:
        check_group_size(128, config)
    assert caught.value.param == "quant_group_size"
    with pytest.raises(InvalidRequestError, match="intermediate size"):
        check_group_size(64, config)
