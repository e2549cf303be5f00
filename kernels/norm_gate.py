"""RMSNorm and the SSE layer's output step before W_o: per-head RMSNorm of the operator's output, its weight, and
the swish output gate, y = w * rmsnorm(o) * silu(g) (docs/model.md, "The layer"). These are the torch twins of
`kernels/triton/norm_gate.py`: the float ops `SSERMSNorm` has always run, and those followed by
`sse_math.gated_output`, under autograd."""
import torch
import torch.nn.functional as F


def rms_norm_torch(x, weight, eps):
    normed = x.float()
    return weight * (normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm_gate_torch(o, weight, gate, eps):
    return rms_norm_torch(o, weight, eps) * F.silu(gate)
