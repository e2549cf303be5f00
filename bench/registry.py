"""The operator registry of `python -m bench.op` (as flash-linear-attention's benchmarks/ops/registry.py): every
implementation of the SSE operator and every baseline it is compared with, by name, each a function that builds one
timed call (forward, and backward when asked) for a shape.

SSE paths are `sse_<impl>` for each implementation `kernels.sse_attention(impl=...)` knows (kernels/dispatch.py);
a revision that lacks one (`--base`) reports it as unavailable. Baselines: fla's `chunk_gla` (gated linear
attention, the floor an SSE layer's token mixing is compared with, where fla is installed) and causal SDPA (on CUDA
its FlashAttention backend).
"""
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """One operator call: batch, tokens, heads, key width c, value width d_v, partitions N, routed top-k K."""
    T: int
    B: int = 1
    H: int = 16
    C: int = 128
    DV: int = 128
    N: int = 4
    K: int = 1
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    backward: bool = True


@dataclass(frozen=True)
class Op:
    name: str
    what: str
    build: Callable[[Shape], tuple[Callable[[], None], list[torch.Tensor]]]  # -> (one call, its input leaves)
    cuda_only: bool = False
    needs: str | None = None  # a module that must be importable (fla)
    max_tokens: int | None = None  # B * T above which it is not timed (the float64 token loop)

    def available(self, device: str) -> bool:
        return (not self.cuda_only or device == "cuda") and (self.needs is None
                                                             or importlib.util.find_spec(self.needs) is not None)


OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    if op.name in OPS:
        raise ValueError(f"operator {op.name!r} registered twice")
    OPS[op.name] = op
    return op


def _leaf(s: Shape, *shape, dtype=None) -> torch.Tensor:
    return torch.randn(*shape, device=s.device, dtype=dtype or s.dtype).requires_grad_()


def _call(forward, out_shape, s: Shape, leaves):
    """A call of `forward` and, when the shape asks for it, the backward of a fixed output gradient."""
    grad = torch.randn(*out_shape, device=s.device, dtype=s.dtype)

    def step():
        o = forward()
        if s.backward:
            o.backward(grad)
    return step, leaves


def sse_op(impl: str) -> Callable[[Shape], tuple]:
    def build(s: Shape):
        from kernels import sse_attention
        ins = dict(q=_leaf(s, s.B, s.T, s.H, s.C), k_logits=_leaf(s, s.B, s.T, s.H, s.C),
                   v=_leaf(s, s.B, s.T, s.H, s.DV), log_decay=_leaf(s, s.B, s.T, s.H, s.C),
                   router_logits=_leaf(s, s.B, s.T, s.N, dtype=torch.float32), q_shared=_leaf(s, s.B, s.T, s.H, s.C),
                   k_shared_logits=_leaf(s, s.B, s.T, s.H, s.C))
        # the model's inputs: decay logits with its normaliser (the logsigmoid is inside the timing)
        return _call(lambda: sse_attention(**ins, top_k=s.K, decay_normalizer=16.0, impl=impl)[0],
                     (s.B, s.T, s.H, s.DV), s, list(ins.values()))
    return build


def gla_chunk(s: Shape):
    from fla.ops.gla import chunk_gla
    q, k, v = _leaf(s, s.B, s.T, s.H, s.C), _leaf(s, s.B, s.T, s.H, s.C), _leaf(s, s.B, s.T, s.H, s.DV)
    g = (F.logsigmoid(torch.randn(s.B, s.T, s.H, s.C, device=s.device)) / 16).requires_grad_()
    return _call(lambda: chunk_gla(q, k, v, g)[0], (s.B, s.T, s.H, s.DV), s, [q, k, v, g])


def sdpa_causal(s: Shape):
    q, k, v = (_leaf(s, s.B, s.H, s.T, s.C) for _ in range(3))

    def forward():
        if s.device != "cuda":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _call(forward, (s.B, s.H, s.T, s.C), s, [q, k, v])


for _impl, _what, _cuda in [
        ("triton_indexed", "our chunk kernels reading routed rows by index (the GPU default)", True),
        ("triton_varlen", "our routing and gather around fla's chunk_gla on varlen rows", True),
        ("triton_mask", "fla's chunk_gla once per partition with a routing mask", True),
        ("chunk_torch_varlen", "the chunked torch path on gathered rows (the CPU default)", False),
        ("chunk_torch_mask", "the chunked torch path once per partition with a mask", False),
        ("reference", "the float64 token loop (correctness, not speed)", False)]:
    register(Op(f"sse_{_impl}", _what, sse_op(_impl), cuda_only=_cuda,
                needs="fla" if _impl in ("triton_varlen", "triton_mask") else None,
                max_tokens=1024 if _impl == "reference" else None))
register(Op("gla_chunk", "fla's chunk_gla, gated linear attention on all T tokens", gla_chunk, cuda_only=True,
            needs="fla"))
register(Op("sdpa", "causal softmax attention (FlashAttention backend on CUDA)", sdpa_causal))
