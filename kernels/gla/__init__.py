"""Gated linear attention (GLA), the core every SSE partition reduces to.

S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t
Shapes follow flash-linear-attention: q, k, g [B, T, H, K], v [B, T, H, V]; with `cu_seqlens` B must be 1
and each segment has its own initial/final state [num_segments, H, K, V].
"""
from kernels.gla.chunk import chunk_gla_torch
from kernels.gla.naive import recurrent_gla_reference

__all__ = ["chunk_gla_torch", "recurrent_gla_reference"]
