"""The SSE layer's input projections fused into one autograd node (`sse_input_projections`), and its router's
float32 logits (`float32_router`).

    q, k, v, gate = x W^T + b                                      (bias optional)
    codes = x [W_decay_down; W_q_shared_down; W_k_shared_down]^T       (one GEMM; the low-rank ones with the LoRA)
    decay logits = codes_decay W_decay_up^T + b_decay_up             (+inf at pad tokens)
    q_shared = q + codes_q W_q_shared_up^T,  k_shared = k + codes_k W_k_shared_up^T   (with the LoRA)
    router logits = x W_router^T in float32
    v = 0 at pad tokens

Why one node: as separate modules these were ~40 autograd nodes per layer and x's gradient came as 6 products summed
by 5 bf16 adds, and the SSE layer's host time bounds short training steps (`python -m bench.train_step` at 8k
tokens). Here the forward is one GEMM over the concatenated weights and the backward takes x's gradient and the
weights' from one GEMM each over the projections' concatenated gradients, with no autograd bookkeeping in between.
Gradients are those of the same modules up to the order of the sums (float64 gradcheck and the modules' autograd
in tests/test_model.py).
"""
import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import kept_weights


class ProjectionWeights(NamedTuple):
    """The weights [out, in] and biases [out] (None where absent) of the SSE layer's projections of x. q, k and the
    decay logits have heads x c outputs, v and the gate heads x d_v; the router N; the shared partition's low-rank
    (LoRA) terms, all None without them, rank r."""
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    router: torch.Tensor
    decay_down: torch.Tensor
    decay_up: torch.Tensor
    decay_up_bias: torch.Tensor | None
    q_shared_down: torch.Tensor | None = None
    q_shared_up: torch.Tensor | None = None
    k_shared_down: torch.Tensor | None = None
    k_shared_up: torch.Tensor | None = None


class SSEProjections(NamedTuple):
    """What the SSE operator and the output step take from x: [B, T, heads, -1] each (router logits [B, T, N],
    float32); q_shared and k_shared_logits None without the low-rank terms. q, k, v and the gate are column blocks
    of one GEMM's output, so not contiguous: their readers take them as token rows
    (`kernels.triton.common.token_rows`)."""
    q: torch.Tensor
    k_logits: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor
    decay_logits: torch.Tensor
    q_shared: torch.Tensor | None
    k_shared_logits: torch.Tensor | None
    router_logits: torch.Tensor


def sse_input_projections(x: torch.Tensor, heads: int, weights: ProjectionWeights, *, pad: torch.Tensor | None = None,
                          recipes: list | None = None) -> SSEProjections:
    """Every projection the SSE layer makes of x [B, T, D], as one autograd node (module docstring). Pad tokens
    (`pad` [B, T, 1, 1] bool) get v = 0 and decay logits +inf (log-decay 0), which leaves every state untouched.

    Appends to `recipes` how to make the decay logits and the shared partition's q and key logits again from the
    low-rank codes the node keeps anyway (`kernels.recomputed_when_saved`), bit for bit: the same ops on the same
    inputs, under the forward's autocast. Under autocast the node's ops cast as nn.Linear's would, and its
    backward runs in the outputs' dtype with the gradients cast back to each input's."""
    q, k, v, gate, decay, q_shared, k_shared, router, codes = _InputProjections.apply(x, heads, pad, *weights)
    sizes = _code_sizes(weights)

    def padded(logits):
        return logits if pad is None else logits.masked_fill(pad, float("inf"))
    decay = padded(decay)
    if recipes is not None:
        device = x.device.type
        autocast, autocast_dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)

        def made_again(term, *args):  # the backward that runs a recipe is not in the forward's autocast
            with torch.autocast(device, autocast_dtype) if autocast else contextlib.nullcontext():
                return term(codes, sizes, *args)
        recipes.append((decay, lambda: padded(
            made_again(_low_rank_term, 0, weights.decay_up, weights.decay_up_bias, heads))))
        if q_shared is not None:
            recipes += [(q_shared, lambda: made_again(_shared_term, 1, weights.q_shared_up, q)),
                        (k_shared, lambda: made_again(_shared_term, 2, weights.k_shared_up, k))]
    return SSEProjections(q, k, v, gate, decay, q_shared, k_shared, router)


def float32_router(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits F.linear(x, W) in float32 (float64 for float64 inputs), whatever the model's dtype and
    autocast; vLLM's SSE layer computes the same (`SSELinearAttention.router`).

    Why: a top-1 choice between near-tied logits flips when the logits are rounded to bf16, and the trainer and the
    engine round different near ties differently (their inputs differ in the last bits), after which the token's
    state update goes to another partition; float32 logits flip several times fewer routes than bf16 ones on the
    embedded default's checkpoints (docs/model.md).

    On CUDA with x and W both 16-bit and no gradient to record, one GEMM reads them as they are and accumulates and
    writes in float32 (`out_dtype`): their products are exact in float32, so the logits are the float32 ones up to
    the order of the sum, without making a float32 copy of x. That GEMM has no derivative, so a graph that needs one
    takes the float32 copies."""
    if (x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
    dtype = torch.promote_types(x.dtype, torch.float32)
    if torch.is_autocast_enabled(x.device.type):  # entering autocast's context costs the host; only when it is on
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), weight.to(dtype))
    return F.linear(x.to(dtype), weight.to(dtype))


def _code_sizes(weights: ProjectionWeights) -> list[int]:
    """The widths of the low-rank codes: the decay's rank, then the shared q's and keys' where present."""
    lora = weights.q_shared_down is not None
    return [weights.decay_down.shape[0]] + ([weights.q_shared_down.shape[0], weights.k_shared_down.shape[0]]
                                            if lora else [])


def _low_rank_term(codes, sizes, i, weight, bias, heads):
    """The i-th low-rank term [B, T, heads, -1] from the stacked codes [B, T, sum(sizes)]: written once for the node
    and for the recipes that make its terms again, so that the two match bit for bit. The bias goes into the GEMM's
    epilogue (addmm), where F.linear over the codes' strided slice would add it in a kernel of its own."""
    B, T, _ = codes.shape
    code = codes.split(sizes, -1)[i].reshape(B * T, -1)
    term = code @ weight.t() if bias is None else torch.addmm(bias, code, weight.t())
    return term.view(B, T, heads, -1)


def _shared_term(codes, sizes, i, weight, routed):
    """The shared partition's q or key logits [B, T, H, -1], `sse_math.shared_partition(routed, the i-th low-rank
    term)` as one GEMM that adds routed in its epilogue (addmm): no low-rank tensor and no add kernel. Written once
    for the node and its recipes (bit for bit)."""
    B, T, heads, d = routed.shape
    code = codes.split(sizes, -1)[i].reshape(B * T, -1)
    return torch.addmm(routed.reshape(B * T, -1), code, weight.t()).view(B, T, heads, d)


class _InputProjections(torch.autograd.Function):
    """`sse_input_projections`' node: x, heads, pad and the `ProjectionWeights` as positional arguments (autograd
    tracks only those). Returns its projections before the decay's padding, and the codes [B, T, sum of ranks],
    which the recipes make the low-rank terms again from (not differentiable). Saves x and the codes for the
    backward (the modules kept them too) and keeps the weights on ctx (`kernels.kept_weights`: no saved-tensor
    hooks for them under checkpointing)."""

    @staticmethod
    def forward(ctx, x, heads, pad, *weights):
        w = ProjectionWeights(*weights)
        B, T, D = x.shape
        lora = w.q_shared_down is not None
        downs = [w.decay_down] + ([w.q_shared_down, w.k_shared_down] if lora else [])
        sizes = _code_sizes(w)
        # x's projections as one GEMM, y = x [W_q; W_k; W_v; W_gate; downs]^T: q, k, v, the gate and the codes are
        # column blocks of y (rows of y.shape[-1] values, which every kernel reading them takes as their token
        # stride), where a GEMM each cost the host ~25 torch calls a forward, twice with checkpointing. The weights'
        # concatenation is a copy per call, cheap next to the GEMM.
        weight = torch.cat([w.q, w.k, w.v, w.gate, *downs])
        biases = (w.q_bias, w.k_bias, w.v_bias, w.gate_bias)
        x2 = x.reshape(B * T, D)
        if all(b is None for b in biases):
            y = x2 @ weight.t()
        else:
            bias = torch.cat([weight.new_zeros(wt.shape[0]) if b is None else b
                              for wt, b in zip((w.q, w.k, w.v, w.gate), biases)] + [weight.new_zeros(sum(sizes))])
            y = torch.addmm(bias, x2, weight.t())
        q, k, v, gate, codes = y.view(B, T, -1).split([w.q.shape[0], w.k.shape[0], w.v.shape[0], w.gate.shape[0],
                                                       sum(sizes)], -1)
        q, k, v, gate = (t.view(B, T, heads, -1) for t in (q, k, v, gate))
        if pad is not None:  # in y: a zeroed copy of v would leave y's v block kept by the other blocks' saves
            v.masked_fill_(pad, 0.0)
        decay = _low_rank_term(codes, sizes, 0, w.decay_up, w.decay_up_bias, heads)
        q_shared = k_shared = None
        if lora:
            q_shared = _shared_term(codes, sizes, 1, w.q_shared_up, q)
            k_shared = _shared_term(codes, sizes, 2, w.k_shared_up, k)
        router = float32_router(x, w.router)
        ctx.mark_non_differentiable(codes)
        ctx.save_for_backward(x, codes, pad)
        kept_weights.keep(ctx, *w)
        return q, k, v, gate, decay, q_shared, k_shared, router, codes

    @staticmethod
    def backward(ctx, dq, dk, dv, dgate, ddecay, dq_shared, dk_shared, drouter, _):
        x, codes, pad = ctx.saved_tensors
        w = ProjectionWeights(*kept_weights.kept(ctx))
        lora = w.q_shared_down is not None
        dtype = codes.dtype  # the forward's compute dtype (autocast's, or the model's)
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        decay_code, *shared_codes = codes.reshape(-1, codes.shape[-1]).split(_code_sizes(w), -1)

        def rows(dy):  # [B, T, ...] -> [B * T, features] in the compute dtype
            return dy.reshape(x2.shape[0], -1).to(dtype)

        def weight_grads(dy, weight, bias, inputs):  # of y = inputs weight^T + bias
            return (dy.t() @ inputs).to(weight.dtype), None if bias is None else dy.sum(0).to(bias.dtype)
        if lora:  # q_shared = q + ..., so q's gradient gets q_shared's (and k's k_shared's)
            dq, dk = dq + dq_shared, dk + dk_shared
        if pad is not None:  # pad tokens' v is 0 whatever x
            dv = dv.masked_fill(pad, 0.0)
        # The low-rank up projections, then every projection of x.
        ups = [(rows(ddecay), w.decay_up, w.decay_up_bias, decay_code)]
        if lora:
            ups += [(rows(dq_shared), w.q_shared_up, None, shared_codes[0]),
                    (rows(dk_shared), w.k_shared_up, None, shared_codes[1])]
        up_grads = [weight_grads(*up) for up in ups]
        # x's projections as one: dY = [dq dk dv dgate d_codes] against W = [W_q; W_k; W_v; W_gate; downs] gives
        # x's gradient (the router's product added in the same GEMM) and those weights' in two GEMMs, where one GEMM
        # per weight and one per product ran ~40 torch calls on the host, at the cost of copying dY and W once.
        # The router's few columns stay out of dY: with them its width is not a multiple of 8, and cuBLAS's fast
        # kernels want 16-byte aligned rows (the ranks of the low-rank terms are multiples of 8 in every config
        # here; `python -m bench.train_step` measured the unaligned width's cost).
        weights = [w.q, w.k, w.v, w.gate, w.decay_down] + ([w.q_shared_down, w.k_shared_down] if lora else [])
        widths = [wt.shape[0] for wt in weights]
        dy = torch.cat([rows(dq), rows(dk), rows(dv), rows(dgate)] + [d_up @ wt.to(dtype) for d_up, wt, _, _ in ups],
                       -1)
        d_router = rows(drouter)
        dx = torch.addmm(d_router @ w.router.to(dtype), dy, torch.cat(weights).to(dtype))
        dw_q, dw_k, dw_v, dw_gate, *dw_downs = (g.to(wt.dtype) for g, wt in zip((dy.t() @ x2).split(widths), weights))
        biases = (w.q_bias, w.k_bias, w.v_bias, w.gate_bias)
        db_q, db_k, db_v, db_gate = (None,) * 4
        if any(b is not None for b in biases):
            db_q, db_k, db_v, db_gate = (None if b is None else db.to(b.dtype)
                                         for db, b in zip(dy[:, :sum(widths[:4])].sum(0).split(widths[:4]), biases))
        shared = (dict(q_shared_down=dw_downs[1], q_shared_up=up_grads[1][0], k_shared_down=dw_downs[2],
                       k_shared_up=up_grads[2][0]) if lora else {})
        grads = ProjectionWeights(dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_gate, db_gate,
                                  (d_router.t() @ x2).to(w.router.dtype), dw_downs[0], *up_grads[0], **shared)
        return (dx.view(x.shape).to(x.dtype), None, None, *grads)
