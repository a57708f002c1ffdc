"""The ``auto`` rule of the number formats, pinned on faked CPU flags: it reads flags and the model's kind only."""

import pytest

from corral import native
from corral.engine.config import EngineConfig
from corral.engine.formats import resolve
from corral.errors import InvalidRequestError

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_int8", "amx_tile"}
AUTO = EngineConfig(dtype="auto", quantization="auto", kv_cache_dtype="auto")
needs_native = pytest.mark.skipif(native.module() is None, reason="the native module is off or missing")


@pytest.fixture
def without_native(monkeypatch):
    monkeypatch.setattr(native, "module", lambda: None)


@pytest.mark.parametrize("flags, gguf_q4, expected", [
    (AVX2, True, ("float32", "gguf", "float32")),
    (AVX2, False, ("float32", "none", "float32")),
    (AVX512_BF16, True, ("bfloat16", "gguf", "bfloat16")),
    (AMX, True, ("bfloat16", "gguf", "bfloat16")),
    (AMX, False, ("bfloat16", "none", "bfloat16")),
    (frozenset(), True, ("float32", "gguf", "float32")),  # flags unreadable: no fast bf16 assumed
])
def test_auto_without_the_native_module_follows_the_cpu_flags(without_native, flags, gguf_q4, expected):
    formats = resolve(AUTO, gguf_q4, flags)
    assert (formats.dtype, formats.quantization, formats.kv_cache_dtype) == expected
    assert formats.reason  # logged at start-up


@needs_native
@pytest.mark.parametrize("flags", [AVX2, AVX512_BF16, AMX, frozenset()])
def test_auto_runs_q4_ggufs_as_w4a8_on_the_native_module(flags):
    formats = resolve(AUTO, True, flags)
    assert (formats.dtype, formats.quantization, formats.kv_cache_dtype) == ("float32", "w4a8", "bfloat16")
    assert formats.tag == "fp32-w4a8-kvbf16" and "native kernels" in formats.reason
    assert resolve(AUTO, False, flags).quantization == "none"  # nothing to run as shipped
    # Q5, Q6 or Q8_0 linears and no Q4 ones (a Q8_0 or Q5_K_M file): Q8 blocks on the native module
    assert resolve(AUTO, False, flags, gguf_q8=True).quantization == "w4a8"


def test_q8_linears_alone_stay_dense_without_the_native_module(without_native):
    assert resolve(AUTO, False, AVX2, gguf_q8=True).quantization == "none"
    assert resolve(AUTO, True, AVX2, gguf_q8=True).quantization == "gguf"


def test_the_block_kinds_of_a_k_quant_file_are_read():
    from corral.engine.weights import gguf_has_q4, gguf_has_q8, gguf_linear_kinds
    from corral.models import resolve_model
    from tests.models.kquant_fixture import DATA

    files = resolve_model(f"{DATA}/tiny-kquants.gguf")
    assert gguf_linear_kinds(files) == {"Q4_K", "Q5_0", "Q6_K", "Q4_0", "Q8_0", "Q5_K"}
    assert gguf_has_q4(files) and gguf_has_q8(files)


@needs_native
def test_w4a8_runs_float32_activations():
    with pytest.raises(InvalidRequestError, match="w4a8' runs float32 activations"):
        resolve(EngineConfig(dtype="bfloat16", quantization="w4a8"), True, AMX)


def test_w4a8_needs_the_native_module(without_native):
    with pytest.raises(InvalidRequestError, match="runs on the native module"):
        resolve(EngineConfig(quantization="w4a8"), True, AMX)


def test_the_reason_names_the_flag_it_read(without_native):
    assert "avx512_bf16" in resolve(AUTO, True, AVX512_BF16).reason
    assert "neither amx_bf16 nor avx512_bf16" in resolve(AUTO, True, AVX2).reason


def test_explicit_choices_are_kept_whatever_the_cpu():
    config = EngineConfig(dtype="bf16", quantization="w8a16", kv_cache_dtype="int8")
    formats = resolve(config, False, AVX2)
    assert (formats.dtype, formats.quantization, formats.kv_cache_dtype) == ("bfloat16", "w8a16", "int8")
    assert formats.tag == "bf16-w8a16-kvint8"


def test_kv_auto_is_the_activation_dtype():
    assert resolve(EngineConfig(dtype="float32", kv_cache_dtype="auto"), True, AMX).kv_cache_dtype == "float32"


def test_gguf_needs_q4_blocks():
    with pytest.raises(InvalidRequestError, match="needs a GGUF model whose linears are Q4_0, Q4_1 or Q4_K"):
        resolve(EngineConfig(quantization="gguf"), False, AMX)


@pytest.mark.parametrize("field, value, message", [
    ("quantization", "int3", "quantization must be one of"),
    ("kv_cache_dtype", "fp8", "kv_cache_dtype must be one of"),
    ("dtype", "float16", "dtype must be auto or one of"),
    ("quant_group_size", 48, "quant_group_size must be 32, 64 or 128"),
    ("decode_step", "fast", "decode_step must be one of"),
    ("decode_burst", 0, "decode_burst must be an integer from 1 to 16"),
    ("decode_burst", 17, "decode_burst must be an integer from 1 to 16"),
    ("decode_burst", True, "decode_burst must be an integer from 1 to 16"),
    ("deterministic", 1, "deterministic must be a boolean"),
])
def test_bad_format_names_are_refused(field, value, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(**{field: value})
