"""Fused elementwise CPU ops of the Llama forward: residual add + RMSNorm, RoPE in place, SiLU(gate) * up.

On a 2-core CPU a decode step's elementwise work was dozens of small torch ops per layer, each a pass over
memory plus dispatch, and in bf16 each with its own conversions. These kernels do each group in one pass and
round exactly where the torch expressions they replace round (bf16 after every op HF's modeling code does in
bf16), so their results equal the torch path's up to the order of the RMSNorm sum of squares. The torch
expressions stay as the fallback and as the oracle of ``tests/kernels/test_cpu_ops.py``.

Compiled on first use by :mod:`corral.kernels.cpu_build`; float32 and bfloat16.
"""

import ctypes

import torch

from corral.kernels.cpu_build import PRELUDE, CompiledLibrary

SOURCE = PRELUDE + r"""
static const int64_t PARALLEL_MIN = 1 << 16;  // elements; below this a thread hand-off costs more than it saves

// h[r] += delta[r] (when delta), then out[r] = w * T(h[r] * rsqrt(mean(h[r]^2) + eps)), as HF's LlamaRMSNorm.
template <typename T>
static void add_rms_norm(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t n, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        T* x = h + r * n;
        float ss = 0.0f;
        if (delta) {
            const T* d = delta + r * n;
            #pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; ++i) {
                const float v = round_to(load(x[i]) + load(d[i]), T());
                store(v, x + i);
                ss += v * v;
            }
        } else {
            #pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; ++i) { const float v = load(x[i]); ss += v * v; }
        }
        const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
        T* y = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; ++i) store(load(w[i]) * round_to(load(x[i]) * inv, T()), y + i);
    }
}

// In place on rows of x (row stride `stride` elements, `heads` heads of `dim` each, contiguous within the row):
// x = x * cos + rotate_half(x) * sin, with cos/sin rows [dim] picked by each row's position.
template <typename T>
static void rope(T* x, int64_t stride, const int64_t* positions, const T* cos, const T* sin, int64_t rows,
                 int64_t heads, int64_t dim, int threads) {
    const int64_t half = dim / 2;
    #pragma omp parallel for num_threads(threads) if (rows * heads * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const T* c = cos + positions[r] * dim;
        const T* s = sin + positions[r] * dim;
        for (int64_t h = 0; h < heads; ++h) {
            T* v = x + r * stride + h * dim;
            #pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = load(v[i]), b = load(v[i + half]);
                const float lo = round_to(a * load(c[i]), T()) + round_to(-b * load(s[i]), T());
                const float hi = round_to(b * load(c[i + half]), T()) + round_to(a * load(s[i + half]), T());
                store(lo, v + i);
                store(hi, v + i + half);
            }
        }
    }
}

// out[r] = T(silu(gate[r])) * up[r], where row r of gate_up is [gate (n) | up (n)].
template <typename T>
static void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t n, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * n;
        const T* u = g + n;
        T* y = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float a = load(g[i]);
            store(round_to(a / (1.0f + exp_approx(-a)), T()) * load(u[i]), y + i);
        }
    }
}

#define ENTRIES(SUFFIX, T)                                                                                      \
extern "C" void corral_add_rms_norm_##SUFFIX(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t n, \
                                              float eps, int threads) {                                         \
    add_rms_norm<T>(h, delta, w, out, rows, n, eps, threads);                                                   \
}                                                                                                               \
extern "C" void corral_rope_##SUFFIX(T* x, int64_t stride, const int64_t* positions, const T* cos, const T* sin, \
                                      int64_t rows, int64_t heads, int64_t dim, int threads) {                  \
    rope<T>(x, stride, positions, cos, sin, rows, heads, dim, threads);                                         \
}                                                                                                               \
extern "C" void corral_silu_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t n, int threads) {      \
    silu_mul<T>(gate_up, out, rows, n, threads);                                                                \
}
ENTRIES(f32, float)
ENTRIES(bf16, uint16_t)
"""

_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {}
for _suffix in ("f32", "bf16"):
    _SIGNATURES[f"corral_add_rms_norm_{_suffix}"] = [_P, _P, _P, _P, _I, _I, _F, _N]
    _SIGNATURES[f"corral_rope_{_suffix}"] = [_P, _I, _P, _P, _P, _I, _I, _I, _N]
    _SIGNATURES[f"corral_silu_mul_{_suffix}"] = [_P, _P, _I, _I, _N]
# No fused multiply-adds: torch rounds each product of these expressions before the sum that follows it.
_LIBRARY = CompiledLibrary("cpu_ops", SOURCE, _SIGNATURES, extra_flags=("-ffp-contract=off",))
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def available(dtype: torch.dtype) -> bool:
    """Whether the fused ops serve ``dtype`` here (CPU, compiled library, float32 or bfloat16)."""
    return dtype in _SUFFIX and _LIBRARY.load() is not None


def _entry(name: str, dtype: torch.dtype):
    return getattr(_LIBRARY.load(), f"corral_{name}_{_SUFFIX[dtype]}")


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (when given), then return ``RMSNorm(h) * weight``; ``h`` [rows, n] contiguous."""
    rows, n = h.shape
    assert h.is_contiguous() and weight.is_contiguous() and weight.dtype == h.dtype
    if delta is not None:
        delta = delta.contiguous()
        assert delta.shape == h.shape and delta.dtype == h.dtype
    out = torch.empty_like(h)
    _entry("add_rms_norm", h.dtype)(h.data_ptr(), delta.data_ptr() if delta is not None else None, weight.data_ptr(),
                                    out.data_ptr(), rows, n, eps, torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` [rows, heads, dim] in place (rows may be strided, heads and dims contiguous); ``cos``/``sin``
    [max_position, dim] tables in ``x``'s dtype, ``positions`` int64 [rows]."""
    rows, heads, dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == dim and dim % 2 == 0
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == x.dtype
    positions = positions.contiguous()
    assert positions.dtype == torch.int64 and positions.shape == (rows,)
    _entry("rope", x.dtype)(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows,
                            heads, dim, torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [rows, 2n] = [gate | up] (contiguous); [rows, n]."""
    rows, width = gate_up.shape
    assert gate_up.is_contiguous() and width % 2 == 0
    out = gate_up.new_empty(rows, width // 2)
    _entry("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out
