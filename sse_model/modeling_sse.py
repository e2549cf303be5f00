"""SSE-H for Hugging Face transformers: SSE layers and softmax-attention layers in one decoder.

Parameter names follow Qwen2/Qwen3 (`self_attn.q_proj`, `mlp.gate_proj`, ...) so conversion from those models is a
copy, and the SSE layer lives under `linear_attn` as in transformers' and vLLM's other hybrids.
"""
import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# The eager kernel is Qwen3's (same layout and module attributes), so eager means exactly what it means there.
from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

import kernels
from kernels import checkpoint_replay, kept_weights
from sse_model import sse_math
from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER, SSEConfig


class SSERMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, eps=self.eps)


class SSEMLP(nn.Module):
    def __init__(self, config: SSEConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SSERotaryEmbedding(nn.Module):
    def __init__(self, config: SSEConfig):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        if self.rope_type == "default":
            init_fn = self.compute_default_rope_parameters
        else:
            init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: SSEConfig, **kwargs):
        dim = config.head_dim
        base = config.rope_parameters["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def apply_rotary(x, cos, sin):
    """x [B, T, heads, d]; cos/sin [B, T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class SSEAttention(nn.Module):
    """Softmax attention with RoPE, grouped-query heads and optional q/k norms (Qwen3); the kernel is the one
    `config._attn_implementation` names."""

    def __init__(self, config: SSEConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        D, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=False)
        if config.attention_qk_norm:
            self.q_norm = SSERMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = SSERMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, *, position_embeddings, attention_mask, past_key_values=None, sequence_slots=None,
                **kwargs):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward)
        dropout = self.attention_dropout if self.training else 0.0
        if sequence_slots is not None:  # packed rows under SDPA (attends_per_sequence)
            o = self._per_sequence(attention_interface, q, k, v, sequence_slots, dropout)
        else:
            o, _ = attention_interface(self, q, k, v, attention_mask, scaling=self.scaling, dropout=dropout, **kwargs)
        return self.o_proj(o.reshape(B, T, -1))

    def _per_sequence(self, attention_interface, q, k, v, sequence_slots, dropout):
        """Causal attention within each sequence of a packed row: the sequences right-padded into a batch of their
        own, which causal attention needs no mask for (a real query never reaches the padding after it). Costs
        sequences x longest squared instead of the packed row's length squared (14x less on the MQAR SFT rows)."""
        slot, S, longest = sequence_slots

        def padded(x):  # [1, heads, L, d] -> [S, heads, longest, d]
            rows = x[0].transpose(0, 1)
            rows = rows.new_zeros(S * longest, *rows.shape[1:]).index_copy(0, slot, rows)
            return rows.view(S, longest, *rows.shape[1:]).transpose(1, 2)

        o, _ = attention_interface(self, padded(q), padded(k), padded(v), None, scaling=self.scaling, dropout=dropout)
        return o.reshape(S * longest, *o.shape[2:]).index_select(0, slot)[None]  # [1, L, heads, d]


# A block's recipes whose tensors take at most this many bytes together are kept instead (`recomputed_when_saved`):
# at 8k tokens of width 2048 in bf16 the layer's three inputs (96 MiB, one block) and W_o's input (32 MiB, its own
# block; kept up to 24k tokens), whose making again cost each SSE layer ~0.1 ms of GPU work and ~0.2 ms of the
# host's (four launches, and a Python hook on each of the ~25 tensors its operator saves) in a step the host nearly
# bounds (kernels/NOTES.md); at 32k tokens (384 and 128 MiB), where the memory counts, they are made again.
RECIPES_ABOVE_BYTES = 96 * 2**20


@contextlib.contextmanager
def recomputed_when_saved(recipes: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]]):
    """Within the block, autograd keeps a tensor it saves for the backward that is (a view of) one of `recipes`'
    tensors as that tensor's recipe, and the backward makes it again: the same ops on the same inputs, so bit for
    bit. For the SSE layer's cheap products of tensors the backward keeps anyway (its decay logits, the shared
    partition's q and key logits, W_o's input: 4 of the 10 [T, hidden] tensors it kept, 0.5 GiB a layer at 32k
    tokens of width 2048), which its operator and W_o would otherwise keep. Off where another saved-tensor hook is
    active: gradient checkpointing (which recomputes the whole layer) or offloading would lose theirs to ours; and
    where the recipes' tensors take at most RECIPES_ABOVE_BYTES."""
    if (not torch.is_grad_enabled() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
            or sum(t.numel() * t.element_size() for t, _ in recipes) <= RECIPES_ABOVE_BYTES):
        yield
        return
    # No tensor in here: the saved variables keep this hook, and through it what it holds, to the backward.
    by_storage = {t.untyped_storage().data_ptr(): (make, t.dtype, t.storage_offset())
                  for t, make in recipes if t.numel() and t.is_contiguous()}

    def pack(t):
        entry = by_storage.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if entry is None or t.dtype != entry[1]:
            return t
        make, _, offset = entry
        return make, t.shape, t.stride(), t.storage_offset() - offset

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        make, shape, stride, offset = packed
        with torch.no_grad():
            made = make()
        return made.as_strided(shape, stride, made.storage_offset() + offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        try:
            yield
        finally:  # the saved variables keep `pack`: only the recipes they took may keep their inputs alive
            by_storage.clear()


def float32_router(x, weight):
    """Router logits F.linear(x, W) in float32 (float64 for float64 inputs), whatever the model's dtype and
    autocast; vLLM's SSE layer computes the same (`sse_model.vllm.model.SSELinearAttention.router`).

    Why: a top-1 choice between near-tied logits flips when the logits are rounded to bf16, and the trainer and the
    engine round different near ties differently (their inputs differ in the last bits), after which the token's
    state update goes to another partition. On the embedded default's checkpoints, bf16 router logits flipped
    4-10 % of the top-1 routes against float32 and float32 ones 0.5-3 % (bench/route_flips.py).

    On CUDA with x and W both 16-bit and no gradient to record, one GEMM reads them as they are and accumulates and
    writes in float32 (`out_dtype`): their products are exact in float32, so the logits are the float32 ones up to
    the order of the sum, without a float32 copy of x (at 8k tokens of width 2048 on an H200: 19 us of GPU time
    against 103). That GEMM has no derivative, so a graph that needs one takes the float32 copies."""
    if (x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
    dtype = torch.promote_types(x.dtype, torch.float32)
    if torch.is_autocast_enabled(x.device.type):  # entering autocast's context costs the host; only when it is on
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(dtype), weight.to(dtype))
    return F.linear(x.to(dtype), weight.to(dtype))


def _low_rank_term(codes, sizes, i, weight, bias, heads):
    """The i-th low-rank term [B, T, heads, -1] from the stacked codes [B, T, sum(sizes)]: written once for
    SSEInputProjections and for the recipes that make its terms again, so that the two match bit for bit. The
    bias goes into the GEMM's epilogue (addmm): F.linear over the codes' strided slice added it in a kernel of its
    own (38 us a call at 8k tokens on an H200, twice a layer with the recipe)."""
    B, T, _ = codes.shape
    code = codes.split(sizes, -1)[i].reshape(B * T, -1)
    term = code @ weight.t() if bias is None else torch.addmm(bias, code, weight.t())
    return term.view(B, T, heads, -1)


def _shared_term(codes, sizes, i, weight, routed):
    """The shared partition's q or key logits [B, T, H, -1], `sse_math.shared_partition(routed, the i-th low-rank
    term)` as one GEMM that adds routed in its epilogue (addmm): no low-rank tensor and no add kernel (two of each a
    layer, and two more in the recipes). Written once for SSEInputProjections and its recipes (bit for bit)."""
    B, T, heads, d = routed.shape
    code = codes.split(sizes, -1)[i].reshape(B * T, -1)
    return torch.addmm(routed.reshape(B * T, -1), code, weight.t()).view(B, T, heads, d)


class SSEInputProjections(torch.autograd.Function):
    """Every projection the SSE layer makes of its input x [B, T, D], as one autograd node:

        q, k, v, gate = x W^T + b                                  (bias optional)
        codes = x [W_decay_down; W_q_shared_down; W_k_shared_down]^T   (one GEMM; the low-rank ones with the LoRA)
        decay logits = codes_decay W_decay_up^T + b_decay_up
        q_shared = q + codes_q W_q_shared_up^T,  k_shared = k + codes_k W_k_shared_up^T   (with the LoRA)
        router logits = x W_router^T in float32 (`float32_router`)
        v = 0 at pad tokens (`pad` [B, T, 1, 1] bool, or None)

    Returned as [B, T, H, -1] heads (router [B, T, N], codes [B, T, sum of ranks], which the layer's recipes make
    the low-rank terms again from; not differentiable); q, k, v, the gate and the codes are column blocks of one
    tensor, so not contiguous: their readers take them as token rows (`kernels.triton.common.token_rows`). Why one
    node: as separate modules these were ~40 autograd nodes per layer and x's gradient came as 6 products summed by
    5 bf16 adds; the SSE layer's host time bound the 8k training step (kernels/NOTES.md). Here the backward takes
    x's gradient and the weights' from one GEMM each over the projections' concatenated gradients and runs no
    autograd bookkeeping in between. Gradients are those of the same modules up to the order of the sums (float64
    gradcheck and the modules' autograd in tests/test_model.py). Under autocast the forward's ops cast as
    nn.Linear's would, and the backward runs in the outputs' dtype with the gradients cast back to each input's.
    Saves x and the codes for the backward (the modules kept them too) and keeps the weights
    (`kernels.kept_weights`: no saved-tensor hooks for them under checkpointing)."""

    @staticmethod
    def forward(ctx, x, heads, pad, w_q, b_q, w_k, b_k, w_v, b_v, w_gate, b_gate, w_router, w_decay_down, w_decay_up,
                b_decay_up, w_q_shared_down, w_q_shared_up, w_k_shared_down, w_k_shared_up):
        B, T, D = x.shape
        lora = w_q_shared_down is not None
        downs = [w_decay_down] + ([w_q_shared_down, w_k_shared_down] if lora else [])
        sizes = [w.shape[0] for w in downs]
        # x's projections as one GEMM, y = x [W_q; W_k; W_v; W_gate; downs]^T: q, k, v, the gate and the codes are
        # column blocks of y (rows of y.shape[-1] values, which every kernel reading them takes as their token
        # stride), where a GEMM each cost the host ~25 torch calls a forward, twice with checkpointing
        # (kernels/NOTES.md). The weights' concatenation is a copy per call (34 MB at width 2048, ~20 us of GPU).
        weight = torch.cat([w_q, w_k, w_v, w_gate, *downs])
        biases = (b_q, b_k, b_v, b_gate)
        x2 = x.reshape(B * T, D)
        if all(b is None for b in biases):
            y = x2 @ weight.t()
        else:
            bias = torch.cat([weight.new_zeros(w.shape[0]) if b is None else b
                              for w, b in zip((w_q, w_k, w_v, w_gate), biases)] + [weight.new_zeros(sum(sizes))])
            y = torch.addmm(bias, x2, weight.t())
        q, k, v, gate, codes = y.view(B, T, -1).split([w_q.shape[0], w_k.shape[0], w_v.shape[0], w_gate.shape[0],
                                                       sum(sizes)], -1)
        q, k, v, gate = (t.view(B, T, heads, -1) for t in (q, k, v, gate))
        if pad is not None:  # in y: a zeroed copy of v would leave y's v block kept by the other blocks' saves
            v.masked_fill_(pad, 0.0)
        decay = _low_rank_term(codes, sizes, 0, w_decay_up, b_decay_up, heads)
        q_shared = k_shared = None
        if lora:
            q_shared = _shared_term(codes, sizes, 1, w_q_shared_up, q)
            k_shared = _shared_term(codes, sizes, 2, w_k_shared_up, k)
        router = float32_router(x, w_router)
        ctx.mark_non_differentiable(codes)
        ctx.save_for_backward(x, codes, pad)
        kept_weights.keep(ctx, w_q, b_q, w_k, b_k, w_v, b_v, w_gate, b_gate, w_router, w_decay_down, w_decay_up,
                          b_decay_up, w_q_shared_down, w_q_shared_up, w_k_shared_down, w_k_shared_up)
        return q, k, v, gate, decay, q_shared, k_shared, router, codes

    @staticmethod
    def backward(ctx, dq, dk, dv, dgate, ddecay, dq_shared, dk_shared, drouter, _):
        x, codes, pad = ctx.saved_tensors
        (w_q, b_q, w_k, b_k, w_v, b_v, w_gate, b_gate, w_router, w_decay_down, w_decay_up, b_decay_up, w_q_shared_down,
         w_q_shared_up, w_k_shared_down, w_k_shared_up) = kept_weights.kept(ctx)
        lora = w_q_shared_down is not None
        dtype = codes.dtype  # the forward's compute dtype (autocast's, or the model's)
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        sizes = [w_decay_down.shape[0]] + ([w_q_shared_down.shape[0]] * 2 if lora else [])
        decay_code, *shared_codes = codes.reshape(-1, codes.shape[-1]).split(sizes, -1)

        def rows(dy):  # [B, T, ...] -> [B * T, features] in the compute dtype
            return dy.reshape(x2.shape[0], -1).to(dtype)

        def weight_grads(dy, w, b, inputs):  # of y = inputs w^T + b
            return (dy.t() @ inputs).to(w.dtype), None if b is None else dy.sum(0).to(b.dtype)
        if lora:  # q_shared = q + ..., so q's gradient gets q_shared's (and k's k_shared's)
            dq, dk = dq + dq_shared, dk + dk_shared
        if pad is not None:  # pad tokens' v is 0 whatever x
            dv = dv.masked_fill(pad, 0.0)
        # The low-rank up projections, then every projection of x.
        ups = [(rows(ddecay), w_decay_up, b_decay_up, decay_code)]
        if lora:
            ups += [(rows(dq_shared), w_q_shared_up, None, shared_codes[0]),
                    (rows(dk_shared), w_k_shared_up, None, shared_codes[1])]
        up_grads = [weight_grads(*up) for up in ups]
        # x's projections as one: dY = [dq dk dv dgate d_codes] against W = [W_q; W_k; W_v; W_gate; downs] gives
        # x's gradient (the router's product added in the same GEMM) and those weights' in two GEMMs, where one GEMM
        # per weight and one per product ran ~40 torch calls on the host (~0.4 ms of an SSE layer's backward; the
        # host bounds the 8k step with checkpointing, kernels/NOTES.md) at the cost of copying dY and W once.
        # The router's few columns stay out of dY: with them the width was 8388, not a multiple of 8, and the 8k and
        # 32k steps took 11 % longer on an H200 (cuBLAS's fast kernels want 16-byte aligned rows; the ranks of the
        # low-rank terms are multiples of 8 in every config here).
        weights = [w_q, w_k, w_v, w_gate, w_decay_down] + ([w_q_shared_down, w_k_shared_down] if lora else [])
        widths = [w.shape[0] for w in weights]
        dy = torch.cat([rows(dq), rows(dk), rows(dv), rows(dgate)] + [d_up @ w.to(dtype) for d_up, w, _, _ in ups],
                       -1)
        d_router = rows(drouter)
        dx = torch.addmm(d_router @ w_router.to(dtype), dy, torch.cat(weights).to(dtype))
        dw_q, dw_k, dw_v, dw_gate, *dw_downs = (g.to(w.dtype) for g, w in zip((dy.t() @ x2).split(widths), weights))
        dw_router = (d_router.t() @ x2).to(w_router.dtype)
        db_q, db_k, db_v, db_gate = (None,) * 4
        biases = (b_q, b_k, b_v, b_gate)
        if any(b is not None for b in biases):
            db_q, db_k, db_v, db_gate = (None if b is None else db.to(b.dtype)
                                         for db, b in zip(dy[:, :sum(widths[:4])].sum(0).split(widths[:4]), biases))
        shared_grads = (dw_downs[1], up_grads[1][0], dw_downs[2], up_grads[2][0]) if lora else (None,) * 4
        return (dx.view(x.shape).to(x.dtype), None, None, dw_q, db_q, dw_k, db_k, dw_v, db_v, dw_gate, db_gate,
                dw_router, dw_downs[0], *up_grads[0], *shared_grads)


class SSELayer(nn.Module):
    """Sparse State Expansion (docs/model.md): N routed partitions + a shared one, GLA-style decay.

    The state is H x (N + shared) x c x d_v per sequence; the math itself is `kernels.sse_attention`.
    """

    def __init__(self, config: SSEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        D = config.hidden_size
        H, c, dv = config.sse_num_heads, config.sse_key_dim, config.sse_value_dim
        self.num_heads, self.key_dim, self.value_dim = H, c, dv
        bias = config.sse_qkv_bias
        self.q_proj = nn.Linear(D, H * c, bias=bias)
        self.k_proj = nn.Linear(D, H * c, bias=bias)
        self.v_proj = nn.Linear(D, H * dv, bias=bias)
        self.router = nn.Linear(D, config.sse_num_partitions, bias=False)
        self.decay_down = nn.Linear(D, config.sse_decay_rank, bias=False)
        self.decay_up = nn.Linear(config.sse_decay_rank, H * c, bias=True)
        if config.sse_shared_partition and config.sse_lora_rank > 0:
            r = config.sse_lora_rank
            self.q_shared_down = nn.Linear(D, r, bias=False)
            self.q_shared_up = nn.Linear(r, H * c, bias=False)
            self.k_shared_down = nn.Linear(D, r, bias=False)
            self.k_shared_up = nn.Linear(r, H * c, bias=False)
            # The shared partition starts from the routed q/k projections; the LoRA learns its difference.
            self.q_shared_up.zero_init = self.k_shared_up.zero_init = True
        self.g_proj = nn.Linear(D, H * dv, bias=config.sse_gate_bias)
        self.o_norm = SSERMSNorm(dv, config.rms_norm_eps)
        self.o_proj = nn.Linear(H * dv, D, bias=False)
        # The operators' settings beside `project`'s tensors; "log_decay" holds the decay logits, which the
        # operators turn into log a = logsigmoid(x) / normaliser themselves (the training kernels keep only x).
        self.ops = dict(top_k=config.sse_top_k, row_topk=config.sse_row_topk,
                        decay_normalizer=config.sse_decay_normalizer)

    def project(self, x, token_mask=None, recipes=None):
        """(every tensor the SSE operator takes, with `self.ops`; the output gate's logits) from hidden states
        x [B, T, D], all in one autograd node (`SSEInputProjections`). Pad tokens (token_mask 0) get zero v and decay
        logits +inf (log-decay 0), which leaves every state untouched. Appends to `recipes` how to make again the
        inputs that are cheap to (`recomputed_when_saved`)."""
        lora = hasattr(self, "q_shared_up")
        modules = [self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.router, self.decay_down, self.decay_up]
        modules += [self.q_shared_down, self.q_shared_up, self.k_shared_down, self.k_shared_up] if lora else []
        # Wrapped projections (PEFT adapters, quantised layers) must run their own forward, so they go through the
        # modules, and nothing is made again in the backward (the recipes repeat the plain layers' ops).
        plain = all(type(m) is nn.Linear for m in modules)
        pad = None if token_mask is None else ~token_mask[:, :, None, None].bool()
        if plain:
            shared_weights = ((self.q_shared_down.weight, self.q_shared_up.weight, self.k_shared_down.weight,
                               self.k_shared_up.weight) if lora else (None,) * 4)
            q, k, v, gate, decay, q_shared, k_shared, router_logits, codes = SSEInputProjections.apply(
                x, self.num_heads, pad, self.q_proj.weight, self.q_proj.bias, self.k_proj.weight, self.k_proj.bias,
                self.v_proj.weight, self.v_proj.bias, self.g_proj.weight, self.g_proj.bias, self.router.weight,
                self.decay_down.weight, self.decay_up.weight, self.decay_up.bias, *shared_weights)
        else:
            q, k, v, gate, decay, q_shared, k_shared, router_logits = self.projections_by_modules(x)
            v = v if pad is None else v.masked_fill(pad, 0.0)

        def padded_decay(logits):
            return logits if pad is None else logits.masked_fill(pad, float("inf"))
        inputs = dict(q=q, k_logits=k, v=v, log_decay=padded_decay(decay),
                      router_logits=router_logits)
        if self.config.sse_shared_partition:  # without the LoRA the shared partition's q and key logits are the routed
            inputs["q_shared"] = q if q_shared is None else q_shared
            inputs["k_shared_logits"] = k if k_shared is None else k_shared
        if plain and recipes is not None:
            sizes = [self.decay_down.out_features] + ([self.q_shared_down.out_features] * 2 if lora else [])
            device = x.device.type
            autocast, autocast_dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)

            def made_again(term, *args):
                """One of SSEInputProjections' terms made again from its codes, under the forward's autocast (the
                backward that runs this is not in it)."""
                with torch.autocast(device, autocast_dtype) if autocast else contextlib.nullcontext():
                    return term(codes, sizes, *args)
            recipes.append((inputs["log_decay"], lambda: padded_decay(
                made_again(_low_rank_term, 0, self.decay_up.weight, self.decay_up.bias, self.num_heads))))
            if lora:
                recipes += [(q_shared, lambda: made_again(_shared_term, 1, self.q_shared_up.weight, q)),
                            (k_shared, lambda: made_again(_shared_term, 2, self.k_shared_up.weight, k))]
        return inputs, gate

    def projections_by_modules(self, x):
        """What SSEInputProjections computes (but its codes), through the projection modules under autograd: the
        path for wrapped modules, and the reference for the node's hand-written backward (tests/test_model.py)."""
        B, T, _ = x.shape

        def heads(t):
            return t.view(B, T, self.num_heads, -1)
        q, k, v, gate = (heads(m(x)) for m in (self.q_proj, self.k_proj, self.v_proj, self.g_proj))
        q_shared = k_shared = None
        if hasattr(self, "q_shared_up"):
            q_shared = sse_math.shared_partition(q, heads(self.q_shared_up(self.q_shared_down(x))))
            k_shared = sse_math.shared_partition(k, heads(self.k_shared_up(self.k_shared_down(x))))
        return (q, k, v, gate, heads(self.decay_up(self.decay_down(x))), q_shared, k_shared,
                float32_router(x, self.router.weight))

    def output(self, o, gate):
        """Per-head RMSNorm, swish output gate, output projection."""
        B, T = o.shape[:2]

        def gated():
            return kernels.norm_gate(o, self.o_norm.weight, gate, eps=self.o_norm.eps)
        y = gated()
        with recomputed_when_saved([(y, gated)]):  # W_o's input, made again from o and the gate the step keeps
            return self.o_proj(y.reshape(B, T, -1))

    # Under torch.compile the layer runs eagerly, a graph break in the compiled model: its autograd nodes keep
    # weights by reference and tensors through saved-tensor hooks and the checkpoint replay, and launch Triton
    # kernels; traced, an SSE-H training step ended in an illegal memory access on an H200
    # (bench/results/torch_compile_gpu_20261130.md). The compiled graph takes the rest: norms, MLPs, attention
    # layers, the loss.
    @torch.compiler.disable
    def forward(self, x, *, token_mask=None, cu_seqlens=None, past_key_values=None):
        recipes = []
        inputs, gate = self.project(x, token_mask, recipes)
        state = past_key_values.sse_state(self.layer_idx) if past_key_values is not None else None
        if state is not None and x.shape[1] == 1:
            step = {name: t[:, 0] for name, t in inputs.items()}
            slots = torch.arange(x.shape[0], device=x.device)
            # updates the cached state in place
            o = kernels.sse_decode(state, slots, **step, **self.ops, impl=self.config.sse_decode_impl)[:, None]
        else:
            with recomputed_when_saved(recipes):
                o, final = kernels.sse_attention(**inputs, **self.ops, initial_state=state,
                                                 output_final_state=past_key_values is not None,
                                                 cu_seqlens=cu_seqlens, impl=self.config.sse_impl)
            if past_key_values is not None:
                past_key_values.update_recurrent_state(final.float(), self.layer_idx)
        return self.output(o.to(x.dtype), gate), inputs["router_logits"]


class SSEDecoderLayer(nn.Module):
    def __init__(self, config: SSEConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == SSE_LAYER:
            self.linear_attn = SSELayer(config, layer_idx)
        else:
            self.self_attn = SSEAttention(config, layer_idx)
        self.input_layernorm = SSERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = SSERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SSEMLP(config)

    def forward(self, x, *, past_key_values=None, token_mask=None, cu_seqlens=None, position_embeddings=None,
                attention_mask=None, **kwargs):
        router_logits = None
        h = self.input_layernorm(x)
        if self.layer_type == SSE_LAYER:
            h, router_logits = self.linear_attn(h, token_mask=token_mask, cu_seqlens=cu_seqlens,
                                                past_key_values=past_key_values)
        else:
            h = self.self_attn(h, position_embeddings=position_embeddings, attention_mask=attention_mask,
                               past_key_values=past_key_values, **kwargs)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, router_logits


class SSECache(DynamicCache):
    """Recurrent states for SSE layers, KV for attention layers. Counts tokens itself because a model with no
    attention layer (the GLA baseline) has no KV to count."""

    def __init__(self, config: SSEConfig):
        super().__init__(config=config)
        self.seen_tokens = 0

    @property
    def is_compileable(self) -> bool:
        return False  # keeps generate passing the 2D attention mask, which the SSE layers need

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def sse_state(self, layer_idx: int) -> torch.Tensor | None:
        """[B, H, N + shared, c, d_v] float32 state of an SSE layer, or None before its first forward."""
        layer = self.layers[layer_idx]
        return layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None


def balance_loss(router_logits: torch.Tensor, top_k: int, token_mask: torch.Tensor | None):
    """The alpha-free balance term N * sum_i f_i P_i over non-pad tokens, averaged over layers, and the usage f
    [layers, N] for logging, from the SSE layers' router logits stacked [layers, B, T, N] (all layers in one go:
    per layer, these ~15 small ops each way were a visible share of the training step's host time).

    f_i is the fraction of tokens routed to partition i (sums to K), P_i the mean router probability."""
    N = router_logits.shape[-1]
    logits = router_logits.reshape(router_logits.shape[0], -1, N)
    probs = torch.softmax(logits.float(), -1)
    chosen = torch.zeros_like(probs).scatter_(-1, logits.topk(top_k, -1).indices, 1.0)
    if token_mask is None:
        usage, mean_prob = chosen.mean(1), probs.mean(1)
    else:
        weight = token_mask.reshape(1, -1, 1).float()
        count = weight.sum().clamp(min=1)
        usage, mean_prob = (chosen * weight).sum(1) / count, (probs * weight).sum(1) / count
    return N * (usage * mean_prob).sum(-1).mean(), usage.detach()


def attends_per_sequence(config, cu_seqlens, token_mask) -> bool:
    """Packed rows with nothing padded, under SDPA, go to `SSEAttention._per_sequence` instead of through the
    [L, L] document mask that create_causal_mask would build for them (SDPA computes every masked pair too). Flash
    attention reads packed rows from the position ids and flex attention gets a block mask: those keep the
    library's path."""
    return cu_seqlens is not None and token_mask is None and config._attn_implementation == "sdpa"


def packed_row_slots(cu_seqlens: torch.Tensor, L: int) -> tuple[torch.Tensor, int, int]:
    """Where each of a packed row's L tokens goes when its sequences are right-padded into a batch of their own:
    (row of the [sequences * longest] layout per token, number of sequences, longest), once per forward for every
    attention layer."""
    lengths = cu_seqlens.diff()
    S, longest = lengths.numel(), int(lengths.max())
    sequence = torch.repeat_interleave(torch.arange(S, device=cu_seqlens.device), lengths, output_size=L)
    return sequence * longest + torch.arange(L, device=cu_seqlens.device) - cu_seqlens[sequence], S, longest


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor | None:
    """cu_seqlens of sequences packed into one row (position ids restarting at 0, as TRL's padding-free
    collator makes), or None when the row holds one sequence."""
    if position_ids is None or position_ids.shape[0] != 1:
        return None
    starts = (position_ids[0] == 0).nonzero().squeeze(1)
    if starts.numel() <= 1 and (starts.numel() == 0 or int(starts[0]) == 0):
        return None
    T = position_ids.shape[1]
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_tensor([T])])


@dataclass
class SSEModelOutput(ModelOutput):
    last_hidden_state: torch.FloatTensor | None = None
    past_key_values: SSECache | None = None
    balance_loss: torch.FloatTensor | None = None      # mean over SSE layers, before the coefficient
    partition_usage: torch.FloatTensor | None = None  # [num SSE layers, N] fraction of tokens per partition


@dataclass
class SSECausalLMOutput(ModelOutput):
    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    past_key_values: SSECache | None = None
    balance_loss: torch.FloatTensor | None = None      # mean over SSE layers, before the coefficient
    partition_usage: torch.FloatTensor | None = None  # [num SSE layers, N] fraction of tokens per partition


class SSEPreTrainedModel(PreTrainedModel):
    config_class = SSEConfig
    config: SSEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SSEDecoderLayer"]
    _is_stateful = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        # Decided per Linear: transformers initialises each parameter once, children before parents, so a
        # parent-level zeroing would be skipped.
        if getattr(module, "zero_init", False):
            from transformers import initialization as init
            init.zeros_(module.weight)
            return
        super()._init_weights(module)


class SSEModel(SSEPreTrainedModel):
    def __init__(self, config: SSEConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(SSEDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = SSERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = SSERotaryEmbedding(config) if ATTENTION_LAYER in config.layer_types else None
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            # A cache written in the forward would be written again when checkpointed layers recompute it.
            use_cache = False
        if use_cache and past_key_values is None:
            past_key_values = SSECache(self.config)
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        token_mask = None
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            token_mask = attention_mask
        # Only a caller's position ids can describe packed rows; looking for restarts in ours would stop the host
        # (a device-to-host read) on every forward for nothing.
        packable = position_ids is not None and past_len == 0
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(past_len, past_len + T, device=x.device)[None].expand(B, -1)
        cu_seqlens = packed_segments(position_ids) if packable else None

        # position_ids reach the attention function too: flash attention reads packed rows from them.
        layer_kwargs = dict(past_key_values=past_key_values, position_ids=position_ids, cu_seqlens=cu_seqlens,
                            token_mask=None if token_mask is None else token_mask[:, -T:], **kwargs)
        if self.rotary_emb is not None:
            layer_kwargs["position_embeddings"] = self.rotary_emb(x, position_ids)
            # create_causal_mask looks for packed rows only when given neither a 2D mask nor a cache, so it gets
            # the mask only when something is padded and the cache only once it holds tokens: the choices the SSE
            # layers make too (token_mask, cu_seqlens).
            if attends_per_sequence(self.config, cu_seqlens, token_mask):
                layer_kwargs.update(attention_mask=None, sequence_slots=packed_row_slots(cu_seqlens, T))
            else:
                layer_kwargs["attention_mask"] = create_causal_mask(
                    config=self.config, inputs_embeds=x, attention_mask=token_mask,
                    past_key_values=past_key_values if past_len else None,
                    position_ids=position_ids if packable else None)
        router_logits = []
        replay_kwargs = self._checkpoint_replay() if self.gradient_checkpointing and self.training else {}
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                # The layer's keyword arguments bound as transformers' layers bind them: reentrant checkpoint takes
                # none of its own but `preserve_rng_state`.
                call = functools.partial(layer.__call__, **layer_kwargs)
                sse = layer.layer_type == SSE_LAYER
                x, r = self._gradient_checkpointing_func(call, x, **(replay_kwargs if sse else {}))
            else:
                x, r = layer(x, **layer_kwargs)
            if r is not None:
                router_logits.append(r)
        if past_key_values is not None:
            past_key_values.seen_tokens += T
        aux, usage = None, None
        if router_logits:
            aux, usage = balance_loss(torch.stack(router_logits), self.config.sse_top_k, layer_kwargs["token_mask"])
        return SSEModelOutput(last_hidden_state=self.norm(x), past_key_values=past_key_values, balance_loss=aux,
                              partition_usage=usage)

    def _checkpoint_replay(self) -> dict:
        """checkpoint's keyword arguments for an SSE layer: with torch's non-reentrant checkpoint as
        transformers sets it up by default and no `context_fn` of the caller's, the one by which the recomputation
        takes the operator's tables and output from the first forward instead of computing them again
        (`kernels.checkpoint_replay`). Not with transformers' `offload=True` (its own function around checkpoint),
        which moves the saved activations off the GPU: the kept outputs would stay on it."""
        func = self._gradient_checkpointing_func
        keywords = getattr(func, "keywords", {})
        if (getattr(func, "func", None) is torch.utils.checkpoint.checkpoint and keywords.get("use_reentrant") is False
                and "context_fn" not in keywords):
            return {"context_fn": checkpoint_replay.contexts}
        return {}


class SSEForCausalLM(SSEPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate must not build a plain DynamicCache: forward builds an SSECache on first call

    def __init__(self, config: SSEConfig):
        super().__init__(config)
        self.model = SSEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs) -> SSECausalLMOutput:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(out.last_hidden_state[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
            if out.balance_loss is not None and self.config.sse_balance_loss_coef:
                loss = loss + self.config.sse_balance_loss_coef * out.balance_loss
        return SSECausalLMOutput(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                 balance_loss=out.balance_loss, partition_usage=out.partition_usage)
