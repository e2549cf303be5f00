"""The SSE layer's output step, y = w * rmsnorm(o) * silu(g) per head, in one Triton kernel each way.

Autograd over the torch twin (`kernels/norm_gate.py`) launches about eight elementwise kernels each way and keeps
o's float32 upcast, the normalised o and the gate's products for the backward (about 0.5 GB per SSE layer at 32k
tokens of width 2048); these keep o, the gate and one float32 scale per row. Rows are the [..., D] vectors (one
head's value vector); the forward rounds the normalised o to o's dtype before the weight, as `SSERMSNorm` does.
"""
import torch
import triton
import triton.language as tl

ROWS = 16  # rows per program


@triton.jit(do_not_specialize=["R"])
def _norm_gate_fwd_kernel(o_ptr, w_ptr, g_ptr, y_ptr, rstd_ptr, R, D, eps, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r, d = rows[:, None], tl.arange(0, BLOCK_D)[None, :]
    m = (r < R) & (d < D)
    x = tl.load(o_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    normed = (x * rstd[:, None]).to(o_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * D + d, (w * normed * g * tl.sigmoid(g)).to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + rows, rstd, mask=rows < R)


@triton.jit(do_not_specialize=["R"])
def _norm_gate_bwd_kernel(o_ptr, w_ptr, g_ptr, rstd_ptr, dy_ptr, do_ptr, dg_ptr, dw_ptr, R, D,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """do, dg per row; this program's share of dw (summed over programs by the caller)."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r, d = rows[:, None], tl.arange(0, BLOCK_D)[None, :]
    m = (r < R) & (d < D)
    rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.0)[:, None]
    x_hat = tl.load(o_ptr + r * D + d, mask=m, other=0.0).to(tl.float32) * rstd
    normed = x_hat.to(o_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    d_wn = dy * g * sig  # the gradient of w * normed: silu(g) = g sigmoid(g)
    tl.store(dg_ptr + r * D + d, (dy * w * normed * sig * (1 + g * (1 - sig))).to(dg_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + pid * D + d, tl.sum(d_wn * normed, 0)[None, :], mask=d < D)
    d_x_hat = d_wn * w  # the rounding of normed to o's dtype passes the gradient through
    d_o = rstd * (d_x_hat - x_hat * (tl.sum(d_x_hat * x_hat, 1) / D)[:, None])
    tl.store(do_ptr + r * D + d, d_o.to(do_ptr.dtype.element_ty), mask=m)


class _NormGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, weight, gate, eps):
        D = o.shape[-1]
        o, gate = o.contiguous(), gate.contiguous()
        R = o.numel() // D
        dtype = torch.promote_types(torch.promote_types(weight.dtype, o.dtype), gate.dtype)
        y = torch.empty(o.shape, dtype=dtype, device=o.device)
        rstd = torch.empty(R, dtype=torch.float32, device=o.device)
        if R:
            _norm_gate_fwd_kernel[(triton.cdiv(R, ROWS),)](o, weight, gate, y, rstd, R, D, eps, ROWS,
                                                           triton.next_power_of_2(D))
        ctx.save_for_backward(o, weight, gate, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        o, weight, gate, rstd = ctx.saved_tensors
        D, R = o.shape[-1], rstd.numel()
        d_o, d_gate = torch.empty_like(o), torch.empty_like(gate)
        programs = triton.cdiv(R, ROWS)
        dw = torch.zeros(max(programs, 1), D, dtype=torch.float32, device=o.device)
        if R:
            _norm_gate_bwd_kernel[(programs,)](o, weight, gate, rstd, dy.contiguous(), d_o, d_gate, dw, R, D, ROWS,
                                               triton.next_power_of_2(D))
        return d_o, dw.sum(0).to(weight.dtype), d_gate, None


def norm_gate_triton(o, weight, gate, eps):
    return _NormGate.apply(o, weight, gate, eps)
