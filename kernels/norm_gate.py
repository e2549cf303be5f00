"""The SSE layer's output step before W_o: per-head RMSNorm of the operator's output, its weight, and the swish
output gate, y = w * rmsnorm(o) * silu(g) (docs/model.md, "The layer"). This is the torch twin of
`kernels/triton/norm_gate.py`: the same float ops as `SSERMSNorm` followed by `sse_math.gated_output`, under
autograd."""
import torch
import torch.nn.functional as F


def norm_gate_torch(o, weight, gate, eps):
    x = o.float()
    normed = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return normed * F.silu(gate)
