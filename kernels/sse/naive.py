"""SSE as a plain token loop in float64: the ground truth (docs/model.md, "The layer", step by step)."""
import torch

from kernels.gla.naive import segments
from kernels.sse.routing import route, softmax_keys


def sse_reference(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                  row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  route_index=None):
    B, T, H, c = q.shape
    N = router_logits.shape[-1]
    has_shared = q_shared is not None
    P = N + has_shared
    scale = c**-0.5 if scale is None else scale
    out_dtype = v.dtype

    def f64(x):
        return None if x is None else x.double()

    q, k_logits, v, log_decay, router_logits = map(f64, (q, k_logits, v, log_decay, router_logits))
    q_shared, k_shared_logits = f64(q_shared), f64(k_shared_logits)

    weights, index, _ = route(router_logits, top_k, route_index)
    selected = torch.zeros_like(weights, dtype=torch.bool).scatter_(-1, index, True)
    keys, decay = softmax_keys(k_logits, log_decay, row_topk)
    if has_shared:
        keys_s, decay_s = softmax_keys(k_shared_logits, log_decay, row_topk)

    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(segments(B, T, cu_seqlens)):
        S = torch.zeros(H, P, c, v.shape[-1], dtype=torch.float64, device=q.device)
        if initial_state is not None:
            S = initial_state[n].double()
        for t in range(start, end):
            on = selected[b, t][None, :, None, None]          # [1, N, 1, 1]
            w = weights[b, t][None, :, None, None]
            write = keys[b, t][:, None, :, None] * v[b, t][:, None, None, :]  # [H, 1, c, d_v]
            routed = torch.where(on, decay[b, t].exp()[:, None, :, None] * S[:, :N] + w * write, S[:, :N])
            o_t = scale * torch.einsum("hc,hpcv,p->hv", q[b, t], routed, weights[b, t] * selected[b, t])
            parts = [routed]
            if has_shared:
                shared = decay_s[b, t].exp()[..., None] * S[:, N] + keys_s[b, t][..., None] * v[b, t][:, None, :]
                o_t = o_t + scale * torch.einsum("hc,hcv->hv", q_shared[b, t], shared)
                parts.append(shared[:, None])
            S = torch.cat(parts, 1)
            o[b, t] = o_t
        finals.append(S)
    return o.to(out_dtype), (torch.stack(finals) if output_final_state else None)
