"""Paged attention: queries of many sequences against K/V stored in fixed-size blocks, read through block tables.

The operation, as reference pseudo-code (one sequence ``s``; its new tokens are the last ``q_len`` of its
``seq_len`` tokens, rows ``query_start_loc[s] ..`` of ``q``)::

    for i in range(q_len):                       # query i sits at position p = seq_len - q_len + i
        for h in range(num_heads):
            g = h // (num_heads // num_kv_heads)  # grouped-query attention: the KV head this head reads
            for j in range(p + 1):               # causal: keys 0..p
                b, o = block_tables[s, j // block_size], j % block_size
                score[j] = scale * dot(q[row, h], k_cache[b, o, g])
            out[row, h] = sum_j softmax(score)[j] * v_cache[b, o, g]

This covers decode (``q_len = 1``), prefill, and prefill over a cached prefix (``q_len < seq_len``) in one
kernel. Shapes: ``q``/``out`` ``[T, heads, D]``; caches ``[num_blocks, block_size, kv_heads, D]``;
``block_tables`` int32 ``[S, max_blocks]``; ``seq_lens`` and ``query_start_loc`` (``[S + 1]``) int32. An int8
cache comes with ``k_scale``/``v_scale`` float32 ``[num_blocks, block_size, kv_heads]``: a key is
``k_cache[b, o, g] * k_scale[b, o, g]`` (a value likewise), dequantized as it is loaded.

:func:`paged_attention_torch` is the twin: the pure-torch statement of the pseudo-code above, used as the test
oracle. Triton runs on CUDA tensors (and on CPU tensors under ``TRITON_INTERPRET=1``, for tests only: the
interpreter is about 100x slower than torch, and its bf16 ``tl.dot`` is wrong, so the kernel upcasts to
float32 before every dot). The CPU production path is the batched torch code in ``corral.engine.attention``.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional dependency on CPU-only installs
    triton = None


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
                    k_scale=None, v_scale=None) -> torch.Tensor:
    """Dispatch: the Triton kernel for CUDA tensors, the torch twin otherwise."""
    if q.is_cuda:
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                      k_scale=k_scale, v_scale=v_scale)
    return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale)


def paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
                          k_scale=None, v_scale=None) -> torch.Tensor:
    """The twin: a direct reading of the module's pseudo-code, in float32, one sequence at a time."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for s in range(block_tables.shape[0]):
        start, end, seq_len = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(seq_lens[s])
        q_len = end - start
        if q_len == 0:
            continue
        positions = torch.arange(seq_len, device=q.device)
        blocks = block_tables[s].long()[positions // block_size]
        keys = k_cache[blocks, positions % block_size].float()  # [L, kv_heads, D]
        values = v_cache[blocks, positions % block_size].float()
        if k_scale is not None:
            keys = keys * k_scale[blocks, positions % block_size][..., None]
            values = values * v_scale[blocks, positions % block_size][..., None]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # [L, H, D]
        scores = torch.einsum("ihd,jhd->hij", q[start:end].float(), keys) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
                           max_query_len: int | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    """The Triton kernel. ``max_query_len`` (computed when None) sizes the grid without a device sync."""
    assert triton is not None, "triton is not installed"
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16, "head_dim: a power of 2, >= 16"
    assert block_size >= 16 and block_size == triton.next_power_of_2(block_size), "block_size: a power of 2, >= 16"
    assert (k_scale is None) == (v_scale is None) == (k_cache.dtype != torch.int8), "scales go with an int8 cache"
    out = torch.empty_like(q)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = 16
    grid = (block_tables.shape[0], num_heads, triton.cdiv(max_query_len, block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, k_scale if k_scale is not None else k_cache, v_scale if v_scale is not None else v_cache,
        out, block_tables, seq_lens, query_start_loc, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        QUANTIZED=k_scale is not None)
    return out


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tables_ptr, seq_lens_ptr, qsl_ptr,
                                scale, stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_ot, stride_oh,
                                stride_table, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                                BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, QUANTIZED: tl.constexpr):
        seq, head, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        if m_block * BLOCK_M >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        kv_head = head // GROUP
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
        row_ok = rows < q_len
        query_pos = seq_len - q_len + rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        max_score = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # keys past the last query's position are never visible to this tile
        last_visible = tl.minimum(seq_len, seq_len - q_len + (m_block + 1) * BLOCK_M)
        offsets = tl.arange(0, BLOCK_SIZE)
        for page in range(0, tl.cdiv(last_visible, BLOCK_SIZE)):
            block = tl.load(tables_ptr + seq * stride_table + page).to(tl.int64)
            base = block * stride_kb + kv_head * stride_kh
            kv_offsets = base + offsets[:, None] * stride_ko + dims[None, :]
            k = tl.load(k_ptr + kv_offsets).to(tl.float32)  # upcast: the interpreter's bf16 dot is wrong
            v = tl.load(v_ptr + kv_offsets).to(tl.float32)
            if QUANTIZED:  # one float32 scale per (token, KV head): the scales' strides are the cache's / HEAD_DIM
                scale_offsets = block * (stride_kb // HEAD_DIM) + offsets * (stride_ko // HEAD_DIM) + kv_head
                k = k * tl.load(ks_ptr + scale_offsets)[:, None]
                v = v * tl.load(vs_ptr + scale_offsets)[:, None]
            scores = tl.dot(q, tl.trans(k)) * scale
            key_pos = page * BLOCK_SIZE + offsets
            visible = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < seq_len)
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(max_score, tl.max(scores, axis=1))
            # subtle: a row with nothing visible yet keeps max -inf; use 0 so exp() sees -inf - 0, not NaN
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            correction = tl.exp(max_score - safe_max)
            weights = tl.exp(scores - safe_max[:, None])
            denom = denom * correction + tl.sum(weights, axis=1)
            acc = acc * correction[:, None] + tl.dot(weights, v)
            max_score = new_max
        out = acc / tl.where(denom == 0, 1.0, denom)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
