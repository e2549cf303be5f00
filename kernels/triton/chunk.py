"""The SSE chunkwise training path on GPU: our routing + gather/scatter kernels around a chunked GLA core.

The GLA core defaults to flash-linear-attention's `chunk_gla` (imported on first use, so this module imports
without fla); tests on CPU pass `gla=kernels.gla.chunk_gla_torch` to check our kernels under the interpreter.
Layouts (docs/model.md, "Equivalences"; the same as kernels/sse/chunk.py, which is their torch twin):
- varlen: K + shared rows per token, grouped by (segment, partition) by the counting sort in `routing.py`,
  one GLA call over S * (N + shared) segments. Work ~ (K + shared) tokens.
- mask: N + shared rows per token at t * P + p, unselected ones inactive, partitions folded into heads,
  one GLA call over the original segments. Work ~ (N + shared) tokens, no sort.
State layout [segments, H, N + shared, c, d_v] <-> the GLA's [segments * P, H, c, d_v] (varlen) or
[segments, P * H, c, d_v] (mask): both are the same memory after a transpose of H and P.
"""
import torch

from kernels.sse.routing import selection_scores
from kernels.triton.expand import collect, expand
from kernels.triton.routing import route_topk, route_varlen


def fla_chunk_gla(q, k, v, g, **kwargs):
    from fla.ops.gla import chunk_gla
    return chunk_gla(q, k, v, g, **kwargs)


def _sse_triton(layout, q, k_logits, v, log_decay, router_logits, *, top_k, q_shared, k_shared_logits, row_topk,
                scale, initial_state, output_final_state, cu_seqlens, gla, log_decay_shared=None, route_index=None):
    B, T, H, c = q.shape
    N, dv = router_logits.shape[-1], v.shape[-1]
    shared = q_shared is not None
    P, L, device = N + shared, B * T, q.device
    scale = c**-0.5 if scale is None else scale
    bounds = torch.arange(B + 1, device=device) * T if cu_seqlens is None else cu_seqlens
    num_segments = bounds.numel() - 1
    e = router_logits.reshape(L, N)
    chosen = e if route_index is None else selection_scores(route_index.reshape(L, top_k), N)  # what routes
    if layout == "varlen":
        routing = route_varlen(chosen, bounds, top_k, shared)
        pos, gla_cu, part = routing.pos, routing.cu, routing.part
        gla_shape, state_shape = (1, L * (top_k + shared), H), (num_segments * P, H, c, dv)
    else:
        idx = route_topk(chosen, top_k)
        part = torch.full((L, P), -1, dtype=torch.int32, device=device)
        part.scatter_(1, idx.long(), idx)
        if shared:
            part[:, N] = N
        pos = torch.arange(L * P, dtype=torch.int32, device=device).view(L, P)
        gla_cu, gla_shape, state_shape = cu_seqlens, (B, T, P * H), (num_segments, P * H, c, dv)

    def flat(x):
        return None if x is None else x.reshape(L, H, -1)

    rows = expand(*map(flat, (q, k_logits, v, log_decay)), e, flat(q_shared), flat(k_shared_logits), part, pos,
                  pos.numel(), row_topk, flat(log_decay_shared))
    q_rows, k_rows, v_rows, g_rows = (x.view(*gla_shape, -1) for x in rows)
    h0 = None
    if initial_state is not None:  # [S, H, P, c, dv] -> [S, P, H, c, dv], viewed as the GLA wants it
        h0 = initial_state.float().transpose(1, 2).contiguous().view(state_shape)
    o_rows, final = gla(q_rows, k_rows, v_rows, g_rows, scale=scale, initial_state=h0,
                        output_final_state=output_final_state, cu_seqlens=gla_cu)
    o = collect(o_rows.reshape(-1, H, dv), pos, v.dtype).view(B, T, H, dv)
    if final is not None:
        final = final.reshape(num_segments, P, H, c, dv).transpose(1, 2)
    return o, final


def sse_triton_varlen(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                      row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                      log_decay_shared=None, route_index=None, gla=fla_chunk_gla):
    return _sse_triton("varlen", q, k_logits, v, log_decay, router_logits, top_k=top_k, q_shared=q_shared,
                       k_shared_logits=k_shared_logits, row_topk=row_topk, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, gla=gla,
                       log_decay_shared=log_decay_shared, route_index=route_index)


def sse_triton_mask(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                    row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    log_decay_shared=None, route_index=None, gla=fla_chunk_gla):
    return _sse_triton("mask", q, k_logits, v, log_decay, router_logits, top_k=top_k, q_shared=q_shared,
                       k_shared_logits=k_shared_logits, row_topk=row_topk, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, gla=gla,
                       log_decay_shared=log_decay_shared, route_index=route_index)
