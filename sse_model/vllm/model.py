"""SSE-H for vLLM: Sparse State Expansion layers with per-request state slots, plus paged softmax attention.

Registered out of tree by `sse_model.vllm.plugin`. Checkpoints are the ones `sse_model.SSEForCausalLM` saves;
parameter names are the Hugging Face ones except the stacked `qkv_proj` / `gate_up_proj` / `in_proj` / `low_rank_up`
(`STACKED_PARAMS`).

SSE states live in vLLM's per-request slots, declared by `SSEStates` entries ("mamba-like" `MambaBase` layers): each
holds the states [layers, N + shared, H, c, d_v] (int16 fixed point for a 16-bit model, float32 for a float32 one,
bfloat16 on request: `engine.state_dtype`; an int16 state has four more rows, its column scales and
maxima) of a group of SSE layers (`state_groups`), and vLLM allocates, assigns and frees one slot per request,
exactly as for its linear-attention models (MiniMax, Bailing).
The math is the one `kernels` operator the HF model uses: `kernels.sse_attention` (chunkwise, varlen over the
prefills of a batch, from and to the slot states) and `kernels.sse_decode` (one token per request, in place).
What this file takes from vLLM is its public model API; every reach past it is in `sse_model.vllm.seams`.
"""
import math
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.qwen2 import Qwen2MLP as SSEMLP
from vllm.model_executor.models.utils import extract_layer_index, make_layers, maybe_prefix
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

import kernels
from sse_model import sse_math
from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER, SSEConfig
from sse_model.vllm import seams
from sse_model.vllm.engine import state_dtype
from sse_model.vllm.routes import RouteRecorder, records_routes
from sse_model.vllm.seams import SSEStateBackend, SSEStateMetadata, SSEStatesSpec

# Prefills run in groups of sequences whose float32 states take at most PREFILL_STATES_BYTES; without a bound a step
# prefilling hundreds of sequences (the n rollouts of a GRPO batch) would hold all their states at once, outside
# vLLM's cache and its memory profile (docs/vllm-backend.md, "Prefill memory"). PREFILL_STATE_COPIES per sequence:
# the initial states read from its slot and the final ones, and two more for the chunk kernels' per-chunk states,
# which vLLM's memory profile does not see either (for a 256-token prompt they are about four copies' bytes: its
# partial chunks, float32 sums and bf16 states), so that groups stay the size they had before the states moved in
# one pass.
PREFILL_STATE_COPIES = 4
PREFILL_STATES_BYTES = 1 << 30

# (vLLM parameter, checkpoint parameter, shard): the only names that differ from the HF checkpoint. The first match
# wins, so the SSE layer's q/k/v (stacked with its gate) come before the attention layer's.
STACKED_PARAMS = [
    # the shared partition's own decay gate (`sse_shared_decay`): the last code and the last up-projection
    ("linear_attn.in_proj", "linear_attn.shared_decay_down", -1),
    ("linear_attn.low_rank_up", "linear_attn.shared_decay_up", -1),
    ("linear_attn.in_proj", "linear_attn.q_proj", 0),
    ("linear_attn.in_proj", "linear_attn.k_proj", 1),
    ("linear_attn.in_proj", "linear_attn.v_proj", 2),
    ("linear_attn.in_proj", "linear_attn.g_proj", 3),
    ("linear_attn.in_proj", "linear_attn.gate_up", 3),  # a low-rank gate's bias (its weights: `LOW_RANK_GATE`)
    ("linear_attn.in_proj", "linear_attn.decay_down", 4),
    ("linear_attn.in_proj", "linear_attn.q_shared_down", 5),
    ("linear_attn.in_proj", "linear_attn.k_shared_down", 6),
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
    (".low_rank_up", ".decay_up", 0),
    (".low_rank_up", ".q_shared_up", 1),
    (".low_rank_up", ".k_shared_up", 2),
]


# A low-rank output gate's factors (`sse_output_gate_rank`), loaded as their product W_up W_down into in_proj's gate
# part, as the HF model's fused projections take it: the gate stays one column block of the stacked GEMM.
LOW_RANK_GATE = re.compile(r"(.*\.linear_attn)\.gate_(down|up)\.weight")


class MergedColumnLinear(MergedColumnParallelLinear):
    """vLLM's stacked column-parallel projections (one GEMM), with three additions:
    - parts whose checkpoint has no bias (`biased` False) get a zero one, written when their weight loads so that a
      reload writes it too;
    - the last `replicated` parts are whole on every rank (the SSE layer's narrow projections beside its head-sized
      ones), zero-padded together to a multiple of 8 columns, the padding going to the last part (at an odd width
      Inductor padded a copy of the weight on every call);
    - with `input_sizes`, part i reads only its own slice of the input (a block-diagonal weight: the low-rank
      up-projections, each from its code, as one GEMM instead of three).
    A checkpoint tensor loads by part index (-1: the last)."""

    def __init__(self, input_size: int, output_sizes: list[int], biased: list[bool], *, prefix: str,
                 replicated: int = 0, input_sizes: list[int] | None = None):
        self.biased, self.replicated, self.input_sizes = biased, replicated, input_sizes
        sizes = list(output_sizes)
        if replicated:
            sizes[-1] += -sum(sizes[-replicated:]) % 8
        # A replicated part is declared tp times its size, so that each rank's share of it is all of it.
        tp = get_tensor_model_parallel_world_size()
        sizes = sizes[:len(sizes) - replicated] + [size * tp for size in sizes[len(sizes) - replicated:]]
        super().__init__(input_size, sizes, bias=any(biased), prefix=prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int | None = None):
        """vLLM's loader (biases load with it), taking part -1 as the last too."""
        if loaded_shard_id is not None:
            loaded_shard_id %= len(self.output_sizes)
        super().weight_loader(param, loaded_weight, loaded_shard_id)

    def weight_loader_v2(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int):
        """The weight's loader (vLLM loads the bias with `weight_loader`)."""
        shard = loaded_shard_id % len(self.output_sizes)
        if shard >= len(self.output_sizes) - self.replicated:
            # Padded with zero rows, and repeated so that the rank's slice vLLM takes is the whole of it.
            rows = self.output_partition_sizes[shard] - loaded_weight.shape[0]
            loaded_weight = F.pad(loaded_weight, (0, 0, 0, rows)).repeat(self.tp_size, 1)
        if self.input_sizes:
            start = sum(self.input_sizes[:shard])
            loaded_weight = F.pad(loaded_weight, (start, self.input_size - start - loaded_weight.shape[1]))
        super().weight_loader_v2(param, loaded_weight, shard)
        if self.bias is not None and not self.biased[shard]:
            self.weight_loader(self.bias, loaded_weight.new_zeros(loaded_weight.shape[0]), shard)


def state_groups(config: SSEConfig) -> list[list[int]]:
    """The SSE layers whose states share one vLLM cache entry, in layer order.

    vLLM splits a hybrid's cache entries into groups of equal size, the size being the count of the rarer kind,
    and its scheduler does bookkeeping per request and per group on every step. One entry per SSE layer gives
    (SSE layers / attention layers) + 1 groups: 6 for 10 SSE + 2 attention layers, where that bookkeeping was
    over half of the host time of a decode step at 256 sequences (docs/vllm-backend.md). One entry per attention
    layer, holding the states of its share of the SSE layers, gives 2 whatever the depth. Every entry has the
    same number of layer rows (vLLM groups equal shapes only), so the last may have unused rows.
    """
    sse = [i for i, kind in enumerate(config.layer_types) if kind == SSE_LAYER]
    attention = len(config.layer_types) - len(sse)
    if not attention or not sse:
        return [[i] for i in sse]  # a single kind of layer: vLLM makes one group of all of them anyway
    per_entry = -(-len(sse) // attention)
    return [sse[k:k + per_entry] for k in range(0, len(sse), per_entry)]


def sse_state_shape(config: SSEConfig, tp_size: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """One cache entry's state per request on one tensor-parallel rank: [layers, N + shared, H, c, d_v] (c + 4
    rows for int16 states: `kernels.cache_rows`).

    Partition-major: a decode step touches two of a head's N + shared states (its routed and the shared one), and
    the decode kernel reads and writes those faster when each partition's heads lie side by side than when each
    head's partitions do (the results are identical; `python -m bench.rollouts` measures the decode throughput)."""
    return (len(state_groups(config)[0]), config.num_sse_partitions_with_shared, config.sse_num_heads // tp_size,
            kernels.cache_rows(config.sse_key_dim, dtype), config.sse_value_dim)


def check_servable(config: SSEConfig, vllm_config: VllmConfig) -> None:
    """Refuse, naming the field, a checkpoint this engine cannot run, before any kernel sees it. (SSEConfig
    itself rejects unknown layer types and head sizes outside the list every platform runs.)"""
    def bad(field, why):
        raise ValueError(f"SSEConfig.{field}: {why} (vLLM backend sse_model.vllm.model)")

    tp = vllm_config.parallel_config.tensor_parallel_size
    if SSE_LAYER in config.layer_types and config.sse_num_heads % tp:
        bad("sse_num_heads", f"{config.sse_num_heads} is not divisible by tensor_parallel_size={tp}")
    if config.sse_read_top_k is not None and (vllm_config.device_config.device_type != "cpu"
                                              or config.sse_decode_impl == "triton"):
        bad("sse_num_readers", f"{config.sse_num_readers} != sse_top_k={config.sse_top_k} runs on the torch SSE "
            f"paths only (the CPU engine): the Triton kernels read the partitions they write")
    if ATTENTION_LAYER in config.layer_types:
        if config.num_attention_heads % tp:
            bad("num_attention_heads", f"{config.num_attention_heads} is not divisible by tensor_parallel_size={tp}")
        try:
            backend = seams.attention_backend(config.head_dim, vllm_config.model_config.dtype,
                                              vllm_config.cache_config.cache_dtype)
        except ValueError as e:  # no backend at all on this platform
            bad("head_dim", f"{config.head_dim}: {e}")
        if not backend.supports_head_size(config.head_dim):
            bad("head_dim", f"{config.head_dim} is not a head size of this platform's attention backend "
                f"{backend.get_name()}: {backend.get_supported_head_sizes()}")


class HybridAttention(Attention):
    """vLLM's Attention, its cache spec under `SSEAttentionSpec` (the scheduler's `SSEAttentionManager`)."""

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        return seams.attention_spec(super().get_kv_cache_spec(vllm_config))


class SSEAttention(nn.Module):
    """Softmax attention on vLLM's paged KV cache: RoPE from `rope_parameters`, GQA, optional q/k norms and
    qkv bias (the HF `SSEAttention`)."""

    def __init__(self, config: SSEConfig, cache_config: CacheConfig | None, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False,
                                        prefix=f"{prefix}.o_proj")
        if config.attention_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=config.rope_parameters)
        self.attn = HybridAttention(self.num_heads, self.head_dim, self.head_dim**-0.5,
                                    num_kv_heads=self.num_kv_heads, cache_config=cache_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim)).view(q.shape)
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class SSEStates(nn.Module, MambaBase):
    """A vLLM cache entry holding, per request slot, the states of a group of SSE layers (`state_groups`).

    Created by the group's first SSE layer; every layer of the group finds it by name in vLLM's static forward
    context and works on its own row, `layer_states(row)`."""

    def __init__(self, config: SSEConfig, prefix: str):
        super().__init__()
        vllm_config = get_current_vllm_config()
        self.state_dtype = state_dtype(vllm_config.cache_config, vllm_config.model_config.dtype)
        self.state_shape = sse_state_shape(config, get_tensor_model_parallel_world_size(), self.state_dtype)
        # Mamba-like layers are not registered by vLLM itself; without this entry the layers get no state.
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    # MambaBase: what vLLM allocates per request for this entry, and who builds its metadata.
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR  # one state, copied whole between prefix-cache blocks

    def get_state_shape(self) -> tuple[tuple[int, ...]]:
        return (self.state_shape,)

    def get_state_dtype(self) -> tuple[torch.dtype]:
        return (self.state_dtype,)

    def get_attn_backend(self) -> type[SSEStateBackend]:
        return SSEStateBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> SSEStatesSpec:
        return SSEStatesSpec.of(super().get_kv_cache_spec(vllm_config))  # for the scheduler's SSEStatesManager

    def layer_states(self, row: int) -> torch.Tensor:
        """The states of the group's row-th layer as the kernels take them: a strided [slots, H, N + shared, c, d_v]
        view of the partition-major cache (`sse_state_shape`)."""
        return self.kv_cache[0][:, row].transpose(1, 2)


class SSELinearAttention(nn.Module):
    """The SSE layer (docs/model.md) with its state in a row of an `SSEStates` entry.

    The stacked input projection runs in the compiled graph and its output goes into the opaque custom op, which
    owns the state:
    one step's batch holds decodes first (one token each), then prefills. Decodes go through
    `kernels.sse_decode` on their slots in place; prefills go through varlen `kernels.sse_attention` calls (one
    per group of sequences, `PREFILL_STATES_BYTES`) from their slots' states, which get the final states back, so
    chunked prefill and prefix-cache hits continue where the previous step stopped (new requests start from zero
    states without reading their slots: `SSEStateMetadataBuilder`).
    """

    def __init__(self, config: SSEConfig, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.config, self.prefix = config, prefix
        tp = get_tensor_model_parallel_world_size()
        D, H, c, dv = config.hidden_size, config.sse_num_heads, config.sse_key_dim, config.sse_value_dim
        # The cache entry holding this layer's state: created by the first layer of its group, named after it.
        index = extract_layer_index(prefix)
        group = next(g for g in state_groups(config) if index in g)
        self.state_row = group.index(index)
        self.states_name = prefix.replace(f"layers.{index}.", f"layers.{group[0]}.") + ".states"
        if self.state_row == 0:
            self.states = SSEStates(config, self.states_name)
        self.num_heads, self.value_dim = H // tp, dv
        # The HF SSELayer's projections of x, stacked into one GEMM: q, k, v and the output gate's logits (split
        # over tensor-parallel ranks), then the narrow ones, replicated on every rank: the low-rank codes of the
        # decay and of the shared partition's q and k (zero-padded). Its output goes into the custom op as it is;
        # the op runs the three low-rank up-projections as one GEMM over a block-diagonal weight, and the decode
        # kernel adds the shared partition's low-rank terms itself. Apart, the gate's, the narrow and the
        # up-projection GEMMs were each a launch for a few MB, and packing the op's inputs a copy, on every layer of
        # every decode step (`python -m bench.rollouts`).
        qkv_bias = config.sse_qkv_bias
        self.lora = config.sse_shared_partition and config.sse_lora_rank > 0
        self.shared_decay = config.sse_shared_decay
        self.activation = sse_math.qv_activation(config.sse_qv_activation)
        # Whether the shared partition's q and key logits reach the op as low-rank terms, which the decode kernel
        # adds to q and k itself; with a q / v activation they are summed (and activated) first (`_activated`).
        self.lora_terms = self.lora and config.sse_qv_activation == "none"
        r = config.sse_lora_rank
        code_sizes = ([config.sse_decay_rank] + ([r, r] if self.lora else [])
                      + ([config.sse_decay_rank] if self.shared_decay else []))
        self.in_proj = MergedColumnLinear(D, [H * c, H * c, H * dv, H * dv, *code_sizes],
                                          [qkv_bias, qkv_bias, qkv_bias, config.sse_gate_bias]
                                          + [False] * len(code_sizes),
                                          replicated=len(code_sizes), prefix=f"{prefix}.in_proj")
        start = sum(self.in_proj.output_partition_sizes[:4])
        self.codes = slice(start, start + sum(code_sizes))  # without the padding
        # The router in float32, weights and logits, as the HF model computes it (`kernels.float32_router`
        # says why) and as vLLM's MiniMax-Text-01 computes its MoE gate. Its logits go into the op beside in_proj's
        # output, their bytes as pairs of in_proj's dtype (`_forward` views them back), so that the op keeps
        # vLLM's `linear_attention` signature.
        self.router = ReplicatedLinear(D, config.sse_num_partitions, bias=False, params_dtype=torch.float32,
                                       prefix=f"{prefix}.router")
        # only the decay gates' up-projections have a bias
        self.low_rank_up = MergedColumnLinear(sum(code_sizes), [H * c] * len(code_sizes),
                                              [True] + [False] * 2 * self.lora + [True] * self.shared_decay,
                                              input_sizes=code_sizes, prefix=f"{prefix}.low_rank_up")
        self.o_norm = RMSNorm(dv, eps=config.rms_norm_eps)
        self.o_proj = RowParallelLinear(H * dv, D, bias=False, prefix=f"{prefix}.o_proj")
        self.ops = dict(top_k=config.sse_top_k, row_topk=config.sse_row_topk, read_top_k=config.sse_read_top_k,
                        decay_normalizer=config.sse_decay_normalizer)  # "log_decay" holds the decay logits
        self.prefill_impl = config.sse_impl
        self.decode_impl = config.sse_decode_impl
        self.state_numel = math.prod(sse_state_shape(config, tp, torch.float32)[1:])  # its float32 states of a slot
        self.prefill_group = max(1, PREFILL_STATES_BYTES // (PREFILL_STATE_COPIES * 4 * self.state_numel))
        self.max_num_batched_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        # With route recording (`sse_model.vllm.routes`): the engine's recorder and this layer's index among the
        # SSE layers, set by `SSEForCausalLM`.
        self.route_recorder, self.route_layer = None, None

        # The custom op finds this layer by name in the static forward context.
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The HF `SSELayer.forward` on vLLM's batch layout: x [T, D] -> [T, D]."""
        T = hidden_states.shape[0]
        projected = self.in_proj(hidden_states)[0]
        gate = projected.split(self.in_proj.output_partition_sizes, -1)[3]
        router_logits = self.router(hidden_states.float())[0]
        o = hidden_states.new_zeros(T, self.num_heads, self.value_dim)  # rows past the real tokens stay defined
        seams.linear_attention(torch.cat([projected, router_logits.view(projected.dtype)], -1), o, positions,
                               self.prefix)
        out, _ = self.o_proj(sse_math.gated_output(self.o_norm(o), gate.view_as(o)).view(T, -1))
        return out

    def _forward(self, hidden_states: torch.Tensor, output: torch.Tensor, positions: torch.Tensor) -> None:
        """The custom op's body: `hidden_states` is `in_proj`'s output followed by the float32 router logits'
        bytes, `output` gets o [T, H, d_v]."""
        context = get_forward_context()
        if context.attn_metadata is None:  # a dummy run (memory profile, CUDA graph capture, warm-up): no slots
            if hidden_states.shape[0] >= self.max_num_batched_tokens:
                # vLLM sizes its cache from the peak memory of this batch (the memory profile): what a real step
                # allocates here, the low-rank terms and a prefill group's state copies, is in that peak. (Running
                # the group's prefill instead would also count the GLA's temporaries, but compile and autotune
                # fla's kernels during start-up.)
                low_rank = self.low_rank_up(hidden_states[:, self.codes])[0]
                torch.empty(PREFILL_STATE_COPIES * self.prefill_group * self.state_numel,
                            dtype=torch.float32, device=hidden_states.device)
                del low_rank  # (alive until the state copies were allocated)
            return
        metadata = context.attn_metadata[self.states_name]
        state = context.no_compile_layers[self.states_name].layer_states(self.state_row)
        num_tokens = metadata.num_decode_tokens + metadata.num_prefill_tokens
        width = sum(self.in_proj.output_partition_sizes)
        projected, router = hidden_states[:num_tokens, :width], hidden_states[:num_tokens, width:]
        q, k, v = projected.split(self.in_proj.output_partition_sizes, -1)[:3]
        decay, *low_rank = self.low_rank_up(projected[:, self.codes])[0].split(
            self.low_rank_up.output_partition_sizes, -1)

        def heads(t):
            return t.view(num_tokens, self.num_heads, -1)
        inputs = dict(q=heads(q), k_logits=heads(k), v=heads(v), log_decay=heads(decay),
                      router_logits=router.view(torch.float32))
        if self.shared_decay:
            inputs["log_decay_shared"] = heads(low_rank.pop())
        if self.route_recorder is not None:
            self.route_recorder.write(self.route_layer, inputs["router_logits"])
        if self.config.sse_shared_partition:  # with low-rank terms, their sums with q and k are taken later
            inputs["q_shared"], inputs["k_shared_logits"] = map(heads, low_rank if self.lora else (q, k))
        if self.config.sse_qv_activation != "none":
            inputs = self._activated(inputs)
        self._recur(inputs, metadata, state, output)

    def _activated(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inputs with the q / v activation (`sse_qv_activation`): on q, v and the shared partition's q, which
        is q's sum with its low-rank term taken first (the activation is applied after it), so the shared inputs are
        whole and not low-rank terms (`self.lora_terms`)."""
        act = self.activation
        out = dict(inputs, q=act(inputs["q"]), v=act(inputs["v"]))
        if "q_shared" in inputs:
            q_shared, k_shared = inputs["q_shared"], inputs["k_shared_logits"]
            if self.lora:
                q_shared = sse_math.shared_partition(inputs["q"], q_shared)
                k_shared = sse_math.shared_partition(inputs["k_logits"], k_shared)
            out.update(q_shared=act(q_shared), k_shared_logits=k_shared)
        return out

    def _recur(self, inputs: dict[str, torch.Tensor], metadata: SSEStateMetadata, state: torch.Tensor,
               output: torch.Tensor) -> None:
        """state: this layer's [num_slots, H, N + shared, c, d_v] view of its cache entry (int16, float32 or
        bfloat16; prefills start from float32 copies of their slots' states, `kernels.read_states`). Inputs
        are views into the projections' outputs, with the shared partition's low-rank terms in place of its q and key
        logits when the layer has them; decodes
        write straight into `output`: the decode kernel reads and writes rows at any stride, takes the decay's
        logsigmoid and adds the low-rank terms itself, so a decode step copies none of its inputs or its output and
        launches one kernel per layer."""
        slots = metadata.state_indices_tensor
        nd, npf = metadata.num_decodes, metadata.num_prefills
        if nd:
            step = {name: t[:nd] for name, t in inputs.items()}
            kernels.sse_decode(state, slots[:nd], **step, **self.ops, shared_lora=self.lora_terms, out=output[:nd],
                               impl=self.decode_impl)
        offsets, start = metadata.prefill_token_offsets, metadata.num_decode_tokens
        for first in range(0, npf, self.prefill_group):  # bounded state memory per group (PREFILL_STATES_BYTES)
            last = min(first + self.prefill_group, npf)
            tokens = slice(start + offsets[first], start + offsets[last])
            qsl = metadata.query_start_loc[nd + first:nd + last + 1]
            prefill_slots = slots[nd + first:nd + last].long()
            prefill = {name: t[tokens][None] for name, t in inputs.items()}
            if self.lora_terms:
                prefill["q_shared"] = sse_math.shared_partition(prefill["q"], prefill["q_shared"])
                prefill["k_shared_logits"] = sse_math.shared_partition(prefill["k_logits"], prefill["k_shared_logits"])
            has_state = metadata.prefill_has_state[first:last]
            initial = None
            if any(has_state):
                mask = None if all(has_state) else metadata.prefill_has_state_mask[first:last]
                initial = kernels.read_states(state, prefill_slots, mask, impl=self.decode_impl)
            o, final = kernels.sse_attention(**prefill, **self.ops, initial_state=initial, output_final_state=True,
                                             cu_seqlens=(qsl - qsl[0]).long(), impl=self.prefill_impl)
            kernels.write_states(state, prefill_slots, final, impl=self.decode_impl)
            output[tokens] = o[0]


class SSEDecoderLayer(nn.Module):
    def __init__(self, config: SSEConfig, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.layer_type = config.layer_types[extract_layer_index(prefix)]
        if self.layer_type == SSE_LAYER:
            self.linear_attn = SSELinearAttention(config, vllm_config, prefix=f"{prefix}.linear_attn")
        else:
            self.self_attn = SSEAttention(config, vllm_config.cache_config, prefix=f"{prefix}.self_attn")
        self.mlp = SSEMLP(config.hidden_size, config.intermediate_size, config.hidden_act, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.layer_type == SSE_LAYER:
            mixed = self.linear_attn(hidden_states, positions)
        else:
            mixed = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(mixed, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile
class SSEModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda prefix: SSEDecoderLayer(config, vllm_config, prefix),
            prefix=f"{prefix}.layers")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class SSEForCausalLM(nn.Module, HasInnerState, IsHybrid):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
                              "in_proj": ["q_proj", "k_proj", "v_proj", "g_proj", "decay_down", "q_shared_down",
                                          "k_shared_down", "shared_decay_down"],
                              "low_rank_up": ["decay_up", "q_shared_up", "k_shared_up", "shared_decay_up"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_servable(config, vllm_config)
        self.config = config
        self.model = SSEModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self._serving = False
        self.route_recorder = None
        if records_routes(vllm_config):
            sse = [m for m in self.modules() if isinstance(m, SSELinearAttention)]
            self.route_recorder = RouteRecorder(len(sse), config.sse_top_k,
                                                vllm_config.scheduler_config.max_num_batched_tokens)
            for index, layer in enumerate(sse):
                layer.route_recorder, layer.route_layer = self.route_recorder, index

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # IsHybrid: asked before the layers exist, so computed from the config alone.
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...]]:
        return (sse_state_shape(vllm_config.model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size,
                                cls.get_mamba_state_dtype_from_config(vllm_config)[0]),)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype]:
        return (state_dtype(vllm_config.cache_config, vllm_config.model_config.dtype),)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        return MambaStateCopyFuncCalculator.linear_attention_state_copy_func()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors. On a serving engine only inside vLLM's layerwise reload
        (`sse_model.vllm.sync.push_weights`): a plain call there would write into tensors some kernels no longer
        read (the CPU build computes Linear layers and the lm_head from packed copies) and go stale silently."""
        if self._serving and not seams.in_layerwise_reload(self):
            raise RuntimeError("SSEForCausalLM.load_weights on a serving engine must run inside vLLM's "
                               "reload_weights; use sse_model.vllm.sync.push_weights(llm, named_tensors)")
        params = dict(self.named_parameters(remove_duplicate=False))
        tied = self.config.tie_word_embeddings
        loaded = set()

        def load(target, tensor, *shard):
            if target not in params:
                raise KeyError(f"no parameter {target!r} in the vLLM SSE model for checkpoint tensor {name!r}")
            param = params[target]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, *shard)
            loaded.add(target)

        gate_factors: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if tied and name == "lm_head.weight":
                continue  # the head is the embedding
            if gate := LOW_RANK_GATE.fullmatch(name):
                factors = gate_factors.setdefault(gate[1], {})
                factors[gate[2]] = tensor
                if len(factors) == 2:
                    product = factors["up"].float() @ factors["down"].float()
                    load(f"{gate[1]}.in_proj.weight", product.to(tensor.dtype), 3)
                    del gate_factors[gate[1]]
                continue
            for param_name, weight_name, shard in STACKED_PARAMS:
                if weight_name in name:
                    load(name.replace(weight_name, param_name), tensor, shard)
                    break
            else:
                load(name, tensor)
            if tied and name == "model.embed_tokens.weight":
                # The head shares the embedding's Parameter but is a layer of its own, which a reload restores,
                # loads and repacks (CPU build) separately: it must get the tensor too or it keeps the old one.
                load("lm_head.weight", tensor)
        if gate_factors:
            raise KeyError(f"a low-rank output gate needs both factors in one load: only {sorted(gate_factors)}'s "
                           f"{[sorted(f) for f in gate_factors.values()]}")
        # From the first load on, weights change only through a reload. (Set here rather than in the model-level
        # process_weights_after_loading hook, which vLLM 0.25 never calls.)
        self._serving = True
        return loaded
