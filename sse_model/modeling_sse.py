"""SSE-H for Hugging Face transformers: SSE layers and softmax-attention layers in one decoder.

Parameter names follow Qwen2/Qwen3 (`self_attn.q_proj`, `mlp.gate_proj`, ...) so conversion from those models is a
copy, and the SSE layer lives under `linear_attn` as in transformers' and vLLM's other hybrids.
"""
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# The eager kernel is Qwen3's (same layout and module attributes), so eager means exactly what it means there.
from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

import kernels
from sse_model import packing, sse_math
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
        if sequence_slots is not None:  # packed rows under SDPA (packing.attends_per_sequence)
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
        if config.sse_shared_decay:  # the shared partition's own decay gate, low-rank like the routed one
            self.shared_decay_down = nn.Linear(D, config.sse_decay_rank, bias=False)
            self.shared_decay_up = nn.Linear(config.sse_decay_rank, H * c, bias=True)
        if config.sse_shared_partition and config.sse_lora_rank > 0:
            r = config.sse_lora_rank
            self.q_shared_down = nn.Linear(D, r, bias=False)
            self.q_shared_up = nn.Linear(r, H * c, bias=False)
            self.k_shared_down = nn.Linear(D, r, bias=False)
            self.k_shared_up = nn.Linear(r, H * c, bias=False)
            # The shared partition starts from the routed q/k projections; the LoRA learns its difference.
            self.q_shared_up.zero_init = self.k_shared_up.zero_init = True
        if config.sse_output_gate_rank is None:
            self.g_proj = nn.Linear(D, H * dv, bias=config.sse_gate_bias)
        else:  # a low-rank output gate (the SSE authors' g_proj.0 / g_proj.1)
            self.gate_down = nn.Linear(D, config.sse_output_gate_rank, bias=False)
            self.gate_up = nn.Linear(config.sse_output_gate_rank, H * dv, bias=config.sse_gate_bias)
        self.o_norm = SSERMSNorm(dv, config.rms_norm_eps)
        self.o_proj = nn.Linear(H * dv, D, bias=False)
        # The operators' settings beside `project`'s tensors; "log_decay" holds the decay logits, which the
        # operators turn into log a = logsigmoid(x) / normaliser themselves (the training kernels keep only x).
        self.ops = dict(top_k=config.sse_top_k, row_topk=config.sse_row_topk,
                        decay_normalizer=config.sse_decay_normalizer, read_top_k=config.sse_read_top_k)

    def project(self, x, token_mask=None, recipes=None):
        """(every tensor the SSE operator takes, with `self.ops`; the output gate's logits) from hidden states
        x [B, T, D], all in one autograd node (`kernels.sse_input_projections`). Pad tokens (token_mask 0) get zero
        v and decay logits +inf (log-decay 0), which leaves every state untouched. Appends to `recipes` how to make
        again the inputs that are cheap to (`kernels.recomputed_when_saved`). The authors' options: the shared
        partition's own decay logits (through its modules, beside the node) and SiLU on q and v."""
        pad = None if token_mask is None else ~token_mask[:, :, None, None].bool()
        weights = self.projection_weights()
        p = (self.projections_by_modules(x, pad) if weights is None else
             kernels.sse_input_projections(x, self.num_heads, weights, pad=pad, recipes=recipes))
        act = sse_math.qv_activation(self.config.sse_qv_activation)
        inputs = dict(q=act(p.q), k_logits=p.k_logits, v=act(p.v), log_decay=p.decay_logits,
                      router_logits=p.router_logits)
        if self.config.sse_shared_partition:  # without the LoRA the shared partition's q and key logits are the routed
            inputs["q_shared"] = inputs["q"] if p.q_shared is None else act(p.q_shared)
            inputs["k_shared_logits"] = p.k_logits if p.k_shared_logits is None else p.k_shared_logits
        if self.config.sse_shared_decay:
            decay = self.shared_decay_up(self.shared_decay_down(x)).view(*x.shape[:2], self.num_heads, -1)
            inputs["log_decay_shared"] = decay if pad is None else decay.masked_fill(pad, float("inf"))
        return inputs, p.gate

    def projection_weights(self) -> kernels.ProjectionWeights | None:
        """The projections' weights for the fused node, or None where one of them is wrapped (PEFT adapters,
        quantised layers): those must run their own forward, so they go through the modules."""
        lora = ["q_shared_down", "q_shared_up", "k_shared_down", "k_shared_up"] if hasattr(self, "q_shared_up") else []
        gate = [self.g_proj] if hasattr(self, "g_proj") else [self.gate_down, self.gate_up]
        modules = [self.q_proj, self.k_proj, self.v_proj, *gate, self.router, self.decay_down, self.decay_up]
        if not all(type(m) is nn.Linear for m in modules + [getattr(self, name) for name in lora]):
            return None
        shared = {name: getattr(self, name).weight for name in lora}
        # A low-rank gate enters the node as its product W_up W_down (autograd takes the factors' gradients).
        gate_weight = gate[0].weight if len(gate) == 1 else self.gate_up.weight @ self.gate_down.weight
        return kernels.ProjectionWeights(
            q=self.q_proj.weight, q_bias=self.q_proj.bias, k=self.k_proj.weight, k_bias=self.k_proj.bias,
            v=self.v_proj.weight, v_bias=self.v_proj.bias, gate=gate_weight, gate_bias=gate[-1].bias,
            router=self.router.weight, decay_down=self.decay_down.weight, decay_up=self.decay_up.weight,
            decay_up_bias=self.decay_up.bias, **shared)

    def projections_by_modules(self, x, pad=None) -> kernels.SSEProjections:
        """What `kernels.sse_input_projections` computes, through the projection modules under autograd: the path
        for wrapped modules, and the reference for the fused node's hand-written backward (tests/test_model.py)."""
        B, T, _ = x.shape

        def heads(t):
            return t.view(B, T, self.num_heads, -1)
        q, k, v, gate = (heads(m(x)) for m in (self.q_proj, self.k_proj, self.v_proj, self.gate))
        decay = heads(self.decay_up(self.decay_down(x)))
        if pad is not None:
            v, decay = v.masked_fill(pad, 0.0), decay.masked_fill(pad, float("inf"))
        q_shared = k_shared = None
        if hasattr(self, "q_shared_up"):
            q_shared = sse_math.shared_partition(q, heads(self.q_shared_up(self.q_shared_down(x))))
            k_shared = sse_math.shared_partition(k, heads(self.k_shared_up(self.k_shared_down(x))))
        return kernels.SSEProjections(q, k, v, gate, decay, q_shared, k_shared,
                                      kernels.float32_router(x, self.router.weight))

    def gate(self, x):
        """The output gate's logits: g_proj(x), or g_up(g_down(x)) with a low-rank gate."""
        return self.g_proj(x) if hasattr(self, "g_proj") else self.gate_up(self.gate_down(x))

    def output(self, o, gate):
        """Per-head RMSNorm, swish output gate, output projection."""
        B, T = o.shape[:2]

        def gated():
            return kernels.norm_gate(o, self.o_norm.weight, gate, eps=self.o_norm.eps)
        y = gated()
        with kernels.recomputed_when_saved([(y, gated)]):  # W_o's input, made again from o and the gate kept anyway
            return self.o_proj(y.reshape(B, T, -1))

    # Under torch.compile the layer runs eagerly, a graph break in the compiled model: its autograd nodes keep
    # weights by reference and tensors through saved-tensor hooks and the checkpoint replay, and launch Triton
    # kernels, which dynamo does not trace soundly (a traced SSE-H training step ended in an illegal memory access;
    # tests/test_model.py compiles the model). The compiled graph takes the rest: norms, MLPs, attention, the loss.
    @torch.compiler.disable
    def forward(self, x, *, token_mask=None, cu_seqlens=None, past_key_values=None, replay=None, route_index=None):
        """`replay`: a `kernels.CheckpointReplay` when this call runs inside torch's checkpoint with its contexts
        (`SSEModel.forward`), which lets the operator's recomputation replay the first forward. `route_index`
        [B, T, K]: the partitions each token selects (partition replay, `kernels.replayed_selection`), whole sequences
        only."""
        recipes = []
        inputs, gate = self.project(x, token_mask, recipes)
        state = past_key_values.sse_state(self.layer_idx) if past_key_values is not None else None
        if state is not None and x.shape[1] == 1:
            step = {name: t[:, 0] for name, t in inputs.items()}
            slots = torch.arange(x.shape[0], device=x.device)
            # updates the cached state in place
            o = kernels.sse_decode(state, slots, **step, **self.ops, impl=self.config.sse_decode_impl)[:, None]
        else:
            if route_index is not None:
                route_index = kernels.replayed_selection(route_index, inputs["router_logits"], self.ops["top_k"])
            with kernels.recomputed_when_saved(recipes):
                o, final = kernels.sse_attention(**inputs, **self.ops, initial_state=state,
                                                 output_final_state=past_key_values is not None,
                                                 cu_seqlens=cu_seqlens, replay=replay, route_index=route_index,
                                                 impl=self.config.sse_impl)
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
                attention_mask=None, replay=None, route_index=None, **kwargs):
        router_logits = None
        h = self.input_layernorm(x)
        if self.layer_type == SSE_LAYER:
            h, router_logits = self.linear_attn(h, token_mask=token_mask, cu_seqlens=cu_seqlens,
                                                past_key_values=past_key_values, replay=replay,
                                                route_index=route_index)
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


@dataclass
class SSEModelOutput(ModelOutput):
    last_hidden_state: torch.FloatTensor | None = None
    past_key_values: SSECache | None = None
    balance_loss: torch.FloatTensor | None = None      # over SSE layers (sse_balance_loss_norm), unscaled
    partition_usage: torch.FloatTensor | None = None  # [num SSE layers, N] fraction of tokens per partition
    partition_choices: torch.LongTensor | None = None  # [num SSE layers, B, T, K] each token's top-K partitions


@dataclass
class SSECausalLMOutput(ModelOutput):
    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    past_key_values: SSECache | None = None
    balance_loss: torch.FloatTensor | None = None      # over SSE layers (sse_balance_loss_norm), unscaled
    partition_usage: torch.FloatTensor | None = None  # [num SSE layers, N] fraction of tokens per partition
    partition_choices: torch.LongTensor | None = None  # [num SSE layers, B, T, K] each token's top-K partitions


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
        checkpointed = self.gradient_checkpointing and self.training
        # A cache written in the forward would be written again when checkpointed layers recompute it.
        use_cache = (self.config.use_cache if use_cache is None else use_cache) and not checkpointed
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
        cu_seqlens = packing.packed_segments(position_ids) if packable else None

        # position_ids reach the attention function too: flash attention reads packed rows from them.
        layer_kwargs = dict(past_key_values=past_key_values, position_ids=position_ids, cu_seqlens=cu_seqlens,
                            token_mask=None if token_mask is None else token_mask[:, -T:], **kwargs)
        if self.rotary_emb is not None:
            layer_kwargs["position_embeddings"] = self.rotary_emb(x, position_ids)
            # create_causal_mask looks for packed rows only when given neither a 2D mask nor a cache, so it gets
            # the mask only when something is padded and the cache only once it holds tokens: the choices the SSE
            # layers make too (token_mask, cu_seqlens).
            if packing.attends_per_sequence(self.config, cu_seqlens, token_mask):
                layer_kwargs.update(attention_mask=None, sequence_slots=packing.packed_row_slots(cu_seqlens, T))
            else:
                layer_kwargs["attention_mask"] = create_causal_mask(
                    config=self.config, inputs_embeds=x, attention_mask=token_mask,
                    past_key_values=past_key_values if past_len else None,
                    position_ids=position_ids if packable else None)
        router_logits = []
        # [B, T, SSE layers, K] partitions to select instead of the router's top-K (partition replay; -1: its own)
        routes = kwargs.pop("partition_routes", None)
        sse_layer = 0
        # torch's non-reentrant checkpoint, as transformers sets it up by default, lets an SSE layer's recomputation
        # take the operator's tables and output from the first forward (kernels/checkpoint_replay.py).
        replays = checkpointed and kernels.CheckpointReplay.applies_to(self._gradient_checkpointing_func)
        for layer in self.layers:
            bound = layer_kwargs
            if routes is not None and layer.layer_type == SSE_LAYER:
                bound = dict(layer_kwargs, route_index=routes[:, :, sse_layer])
                sse_layer += 1
            if not checkpointed:
                x, r = layer(x, **bound)
            elif replays and layer.layer_type == SSE_LAYER:
                replay = kernels.CheckpointReplay()
                call = functools.partial(layer.__call__, **bound, replay=replay)
                x, r = self._gradient_checkpointing_func(call, x, context_fn=replay.contexts)
            else:
                # The layer's keyword arguments bound as transformers' layers bind them: reentrant checkpoint takes
                # none of its own but `preserve_rng_state`.
                x, r = self._gradient_checkpointing_func(functools.partial(layer.__call__, **bound), x)
            if r is not None:
                router_logits.append(r)
        if past_key_values is not None:
            past_key_values.seen_tokens += T
        aux, usage, choices = None, None, None
        if router_logits:
            stacked = torch.stack(router_logits)
            choices = stacked.detach().topk(self.config.sse_top_k, -1).indices
            aux, usage = kernels.balance_loss(stacked, self.config.sse_top_k, layer_kwargs["token_mask"], choices,
                                      self.config.sse_balance_loss_norm)
        return SSEModelOutput(last_hidden_state=self.norm(x), past_key_values=past_key_values, balance_loss=aux,
                              partition_usage=usage, partition_choices=choices)


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
                                 balance_loss=out.balance_loss, partition_usage=out.partition_usage,
                                 partition_choices=out.partition_choices)
