"""SSE as a plain token loop in float64: the ground truth (docs/model.md, "The layer", step by step).

Two options follow the SSE authors' layer (flash-linear-attention PR #882 at 741fbbf, fla/layers/sse.py, SSEGLA's
mask path): `log_decay_shared`, the shared partition's own log-decay (else it decays as the routed ones), and
`read_top_k`, the partitions a token reads when it differs from the `top_k` it writes: a partition read but not
written keeps its state (no decay) and adds w_p q S_p to the output."""
import torch

from kernels.gla.naive import segments
from kernels.sse.routing import route_read_write, softmax_keys, written_and_read


def sse_reference(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                  row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  log_decay_shared=None, read_top_k=None, route_index=None):
    B, T, H, c = q.shape
    N = router_logits.shape[-1]
    has_shared = q_shared is not None
    P = N + has_shared
    scale = c**-0.5 if scale is None else scale
    out_dtype = v.dtype

    def f64(x):
        return None if x is None else x.double()

    q, k_logits, v, log_decay, router_logits = map(f64, (q, k_logits, v, log_decay, router_logits))
    q_shared, k_shared_logits, log_decay_shared = map(f64, (q_shared, k_shared_logits, log_decay_shared))

    weights, index, _, writes, reads = route_read_write(router_logits, top_k, read_top_k, route_index)
    written, read = written_and_read(index, writes, reads, N)
    keys, decay = softmax_keys(k_logits, log_decay, row_topk)
    if has_shared:
        keys_s, decay_s = softmax_keys(k_shared_logits, log_decay if log_decay_shared is None else log_decay_shared,
                                       row_topk)

    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64, device=q.device)
    finals = []
    for n, (b, start, end) in enumerate(segments(B, T, cu_seqlens)):
        S = torch.zeros(H, P, c, v.shape[-1], dtype=torch.float64, device=q.device)
        if initial_state is not None:
            S = initial_state[n].double()
        for t in range(start, end):
            on = written[b, t][None, :, None, None]           # [1, N, 1, 1]
            w = weights[b, t][None, :, None, None]
            write = keys[b, t][:, None, :, None] * v[b, t][:, None, None, :]  # [H, 1, c, d_v]
            routed = torch.where(on, decay[b, t].exp()[:, None, :, None] * S[:, :N] + w * write, S[:, :N])
            o_t = scale * torch.einsum("hc,hpcv,p->hv", q[b, t], routed, weights[b, t] * read[b, t])
            parts = [routed]
            if has_shared:
                shared = decay_s[b, t].exp()[..., None] * S[:, N] + keys_s[b, t][..., None] * v[b, t][:, None, :]
                o_t = o_t + scale * torch.einsum("hc,hcv->hv", q_shared[b, t], shared)
                parts.append(shared[:, None])
            S = torch.cat(parts, 1)
            o[b, t] = o_t
        finals.append(S)
    return o.to(out_dtype), (torch.stack(finals) if output_final_state else None)
