"""Token-by-token GLA recurrence: the ground truth the chunked paths are tested against."""
import torch


def segments(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every independent sequence."""
    if cu_seqlens is None:
        return [(b, 0, seq_len) for b in range(batch)]
    if batch != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {batch}")
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def recurrent_gla_reference(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Exact GLA in float64; returns (o in q's dtype, final state in float64 or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g = (x.double() for x in (q, k, v, g))
    o = torch.zeros(B, T, H, V, dtype=torch.float64, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(segments(B, T, cu_seqlens)):
        S = torch.zeros(H, K, V, dtype=torch.float64, device=q.device)
        if initial_state is not None:
            S = initial_state[n].double()
        for t in range(start, end):
            S = g[b, t].exp()[..., None] * S + k[b, t][..., None] * v[b, t][:, None, :]
            o[b, t] = scale * torch.einsum("hk,hkv->hv", q[b, t], S)
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    return o.to(out_dtype), final
