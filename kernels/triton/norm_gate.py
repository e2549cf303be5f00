"""RMSNorm, y = w * rmsnorm(x), and the SSE layer's output step, y = w * rmsnorm(o) * silu(g) per head, in one
Triton kernel each way (`rms_norm_triton`, `norm_gate_triton`; the gate is a constexpr switch).

Autograd over the torch twins (`kernels/norm_gate.py`) launches about eight elementwise kernels each way and keeps
x's float32 upcast and the normalised x (and the gate's products) for the backward, 6 bytes an element for a plain
norm: 384 MiB for a 32k x 2048 hidden state, and a model has two norms a layer. These keep x (and the gate) and
one float32 scale per row, which takes those bytes off the peak of a long training step and the launches off a
short one's host time (`python -m bench.train_step` reports both). Rows are the [..., D] vectors (a hidden state,
or one head's value vector); the forward rounds the normalised x to x's dtype before the weight, as `SSERMSNorm`
does.
"""
import torch
import triton
import triton.language as tl

from kernels import kept_weights
from kernels.triton.common import cdiv, pow2, token_rows

ELEMENTS = 2048  # per program: 16 rows of a head (D = 128), one row of a 2048-wide hidden state
BACKWARD_PROGRAMS = 1024  # the backward's programs loop over row blocks, so dw's partial sums stay [<= 1024, D]


@triton.jit
def _gate_at(r, GATE_ROWS, SG, D):
    """Where the gate's row r starts: a token's GATE_ROWS rows (its heads) are contiguous, tokens SG apart."""
    return (r // GATE_ROWS) * SG + (r % GATE_ROWS) * D


@triton.jit(do_not_specialize=["R"])
def _fwd_kernel(x_ptr, w_ptr, g_ptr, y_ptr, rstd_ptr, R, D, GATE_ROWS, SG, eps, HAS_GATE: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r, d = rows[:, None], tl.arange(0, BLOCK_D)[None, :]
    m = (r < R) & (d < D)
    x = tl.load(x_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32) * normed
    if HAS_GATE:
        g = tl.load(g_ptr + _gate_at(r, GATE_ROWS, SG, D) + d, mask=m, other=0.0).to(tl.float32)
        y = y * g * tl.sigmoid(g)
    tl.store(y_ptr + r * D + d, y.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + rows, rstd, mask=rows < R)


@triton.jit(do_not_specialize=["R"])
def _bwd_kernel(x_ptr, w_ptr, g_ptr, rstd_ptr, dy_ptr, dx_ptr, dg_ptr, dw_ptr, R, D, GATE_ROWS, SG,
                HAS_GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """dx (and dg) per row; this program's share of dw (summed over programs by the caller)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    d = tl.arange(0, BLOCK_D)[None, :]
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    dw = tl.zeros([1, BLOCK_D], dtype=tl.float32)
    for start in range(pid * BLOCK_R, R, programs * BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R).to(tl.int64)
        r = rows[:, None]
        m = (r < R) & (d < D)
        rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.0)[:, None]
        x_hat = tl.load(x_ptr + r * D + d, mask=m, other=0.0).to(tl.float32) * rstd
        normed = x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
        d_wn = tl.load(dy_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)  # the gradient of w * normed
        if HAS_GATE:
            g = tl.load(g_ptr + _gate_at(r, GATE_ROWS, SG, D) + d, mask=m, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            tl.store(dg_ptr + r * D + d, (d_wn * w * normed * sig * (1 + g * (1 - sig))).to(dg_ptr.dtype.element_ty),
                     mask=m)
            d_wn = d_wn * g * sig  # silu(g) = g sigmoid(g)
        dw += tl.sum(d_wn * normed, 0)[None, :]
        d_x_hat = d_wn * w  # the rounding of normed to x's dtype passes the gradient through
        d_x = rstd * (d_x_hat - x_hat * (tl.sum(d_x_hat * x_hat, 1) / D)[:, None])
        tl.store(dx_ptr + r * D + d, d_x.to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + pid * D + d, dw, mask=d < D)


def _blocks(D: int) -> tuple[int, int]:
    block_d = pow2(D)
    return max(1, ELEMENTS // block_d), block_d


class _Norm(torch.autograd.Function):
    """y = w * rmsnorm(x) (* silu(gate) when a gate is given) over the last dimension."""

    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        D = x.shape[-1]
        x = x.contiguous()
        # the gate may be a column block of a wider tensor (the SSE layer's projections are one GEMM), read in place
        gate, gate_stride = (None, D) if gate is None else token_rows(gate, gate.dim() - 2)
        gate_rows = 1 if gate is None else gate.shape[-2]
        R = x.numel() // D
        dtype = torch.promote_types(weight.dtype, x.dtype)
        dtype = dtype if gate is None else torch.promote_types(dtype, gate.dtype)
        y = torch.empty(x.shape, dtype=dtype, device=x.device)
        rstd = torch.empty(R, dtype=torch.float32, device=x.device)
        block_r, block_d = _blocks(D)
        if R:
            # without a gate, x stands in for its pointer, which the kernel does not read
            _fwd_kernel[(cdiv(R, block_r),)](x, weight, x if gate is None else gate, y, rstd, R, D, gate_rows,
                                                    gate_stride, eps, gate is not None, block_r, block_d)
        ctx.save_for_backward(x, gate, rstd)
        kept_weights.keep(ctx, weight)
        ctx.gate_layout = gate_rows, gate_stride
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, rstd = ctx.saved_tensors
        (weight,) = kept_weights.kept(ctx)
        D, R = x.shape[-1], rstd.numel()
        block_r, block_d = _blocks(D)
        programs = max(1, min(cdiv(R, block_r), BACKWARD_PROGRAMS))
        d_x = torch.empty_like(x)
        d_gate = None if gate is None else torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        # every program writes its row of partial sums; with no rows there is no launch and they are zero
        dw = (torch.empty if R else torch.zeros)(programs, D, dtype=torch.float32, device=x.device)
        if R:
            gated = gate is not None  # else x and d_x stand in for the gate's pointers, which are not touched
            _bwd_kernel[(programs,)](x, weight, gate if gated else x, rstd, dy.contiguous(), d_x,
                                     d_gate if gated else d_x, dw, R, D, *ctx.gate_layout, gated, block_r, block_d)
        return d_x, dw.sum(0).to(weight.dtype), d_gate, None


def rms_norm_triton(x, weight, eps):
    return _Norm.apply(x, weight, None, eps)


def norm_gate_triton(o, weight, gate, eps):
    return _Norm.apply(o, weight, gate, eps)
