"""Every place the vLLM backend reaches past vLLM's public model API. tests/test_vllm_seams.py has a test per seam
that fails when the installed vLLM changes what it relies on; after upgrading vLLM, run it first.

Where the line is drawn. The public model API is what vLLM's in-tree hybrid models (Qwen3-Next, Nemotron-H, and the
MiniMax-Text-01 and Bailing linear-attention layers ours follows) use through the model-registration plugin
interface: `ModelRegistry`; the layer classes a model file imports (`vllm.model_executor.layers`: linear, layernorm,
rotary embedding, vocabulary embedding, logits processor, `Attention`, `MambaBase`, `mamba_utils`); the model
interfaces (`HasInnerState`, `IsHybrid`) and `models.utils`; `support_torch_compile`; `vllm.config`,
`vllm.distributed`, `current_platform`; the forward context (`get_forward_context`, `static_forward_context`, which
such a layer registers itself in); the backend enum and metadata such a layer returns or reads
(`MambaAttentionBackendEnum`, `LinearAttentionBackend`, `LinearAttentionMetadata`); the weight loaders; and the
`vllm.LLM` front end (generate, `collective_rpc`, `reset_prefix_cache`, `llm_engine.model_config`). Environment
variables vLLM documents for its users to set (VLLM_CPU_KVCACHE_SPACE, VLLM_ENABLE_V1_MULTIPROCESSING: pipeline/
and eval/ set them from the run's config) are configuration, not seams.

Everything past that line is here: a custom op another model's module registers, subclasses of engine-side classes
(the attention metadata builder, the scheduler's cache managers), the registries and maps vLLM keeps for its own
models (`KVCacheSpecRegistry`, `MODELS_CONFIG_MAP`), environment variables set from inside vLLM's processes to steer
its choices, a patched model-runner method, a worker method called by name, private names and fields of vLLM's
internal dataclasses no in-tree model reads. Checked against vLLM 0.32.0 (the CPU build: tests/test_vllm_seams.py,
tests/test_vllm_backend.py) and 0.25.0 (the GPU nodes' release: tests/test_vllm_gpu.py).

Seams, and what each relies on:
- `linear_attention` [the SSE layer's forward]: importing `minimax_linear_attn` registers
  `torch.ops.vllm.linear_attention(hidden_states, output, positions, layer_name)`, a CUDA-graph splitting op that
  calls `_forward(hidden_states=, output=, positions=)` on the layer registered under `layer_name`.
- `attention_backend` [`model.check_servable`]: `vllm.v1.attention.selector.get_attn_backend(head_size, dtype,
  kv_cache_dtype)` names the platform's attention backend, or raises ValueError where there is none.
- `SSEStateBackend` (`SSEStateMetadata`, `SSEStateMetadataBuilder`) [the SSE states' metadata]: vLLM's linear-
  attention backend with a builder subclass; `build(common_prefix_len, common_attn_metadata, fast_build)`,
  `CommonAttentionMetadata.query_start_loc_cpu`, `is_prefilling`, `seq_lens_cpu_upper_bound`; the builder's
  `layer_names` and `vllm_config`; `vllm.utils.torch_utils.async_tensor_h2d`.
- `SSEStatesSpec`, `SSEStatesManager` [scheduler]: `MambaSpec` and `MambaManager` (`mamba_cache_mode`,
  `num_speculative_blocks`, `block_size`, `req_to_blocks`, the leading arguments of `get_num_blocks_to_allocate`,
  `allocate_new_blocks`, `remove_skipped_blocks`).
- `SSEAttentionSpec`, `attention_spec`, `SSEAttentionManager` [scheduler]: `FullAttentionSpec` and
  `FullAttentionManager`; vLLM records new blocks for zeroing only for a spec whose type is exactly its own.
- `register_cache_managers` [plugin]: `KVCacheSpecRegistry.register(spec, manager, uniform_type_base_spec=)` and
  its private `_ensure_registered`.
- `register_engine_config` [plugin]: vLLM calls `MODELS_CONFIG_MAP[architecture].verify_and_update_config(
  vllm_config)` (a `VerifyAndUpdateConfig`) once per engine config, before it sizes the cache.
- `prefer_v2_model_runner` [engine hook, GPU]: vLLM reads `VLLM_USE_V2_MODEL_RUNNER` after the config hook.
- `model_runner` [GRPO's stage log]: an engine's `llm_engine.vllm_config.use_v2_model_runner`.
- `spawn_engine_processes` [plugin, GPU]: vLLM starts its engine processes with the method
  `VLLM_WORKER_MULTIPROC_METHOD` names (`vllm.utils.system_utils.get_mp_context`, after the parent has loaded the
  plugins), and `_maybe_force_spawn` keeps "spawn" when it is set.
- `sampler_without_flashinfer` [plugin]: `VLLM_USE_FLASHINFER_SAMPLER`, which 0.25's sampler reads at import.
- `rewind_seeded_generators_on_cpu` [plugin, CPU]: `CPUModelRunner._sample` runs before `_bookkeeping_sync`, which
  rewinds the seeded generators of `discard_request_mask`'s requests with `gen.set_offset(gen.get_offset() - 4)`.
- `record_routes_per_request` [plugin, with route recording]: the V1 model runner (GPU and CPU) calls
  `_model_forward(input_ids=, positions=, ...)` once per step, with `self.input_batch.req_ids` and
  `self.query_start_loc.np` ([requests + 1] token offsets) describing that step's batch, its tokens in that order,
  and `get_model()` the model.
- `take_routes` [after generate, with route recording]: engine request ids are the front end's request id, or it
  followed by "-" and a suffix (0.32 adds a random one). (It reaches the model through `LLM.apply_model`, public
  API, which for an engine in another process sends the function pickled: vLLM allows that only with
  VLLM_ALLOW_INSECURE_SERIALIZATION=1; GRPO's colocated engine runs in-process.)
- `in_layerwise_reload` [`SSEForCausalLM.load_weights`]: `get_layerwise_info(model).can_load()`.
- `reload_weights` [`sync.push_weights`]: the workers' `reload_weights(weights_iterator=, is_checkpoint_format=)`.
"""
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import numpy as np
import torch

# Importing the module registers torch.ops.vllm.linear_attention (see `linear_attention`).
from vllm.model_executor.layers.mamba.linear import minimax_linear_attn  # noqa: F401
from vllm.utils.math_utils import cdiv
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.linear_attn import (
    LinearAttentionBackend,
    LinearAttentionMetadata,
    LinearAttentionMetadataBuilder,
)
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


# ---------------------------------------------------------------------------------------------- the model's forward
def linear_attention(hidden_states: torch.Tensor, output: torch.Tensor, positions: torch.Tensor,
                     layer_name: str) -> None:
    """Run `_forward(hidden_states=, output=, positions=)` of the layer registered as `layer_name` in the static
    forward context, through vLLM's opaque `linear_attention` custom op: torch.compile does not trace into it and
    vLLM splits its CUDA graphs there, as for every vLLM linear-attention layer (MiniMax-Text-01, Bailing), so the
    stateful part runs eagerly on the step's metadata. The op is registered by MiniMax's layer module, not offered
    as API. vLLM 0.25, 0.32."""
    torch.ops.vllm.linear_attention(hidden_states, output, positions, layer_name)


def attention_backend(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str):
    """The attention backend class vLLM picks on this platform for the head size and dtypes (its
    `supports_head_size`, `get_supported_head_sizes`, `get_name`), so that a checkpoint with a head size the backend
    lacks is refused by name before any kernel sees it; ValueError where the platform has none. vLLM 0.25, 0.32."""
    from vllm.v1.attention.selector import get_attn_backend
    return get_attn_backend(head_dim, dtype, kv_cache_dtype)


@dataclass
class SSEStateMetadata(LinearAttentionMetadata):
    # The prefills' token offsets on the host (num_prefills + 1 of them, from the first prefill token), so the
    # layer can split the prefills into groups of sequences without reading the device.
    prefill_token_offsets: list[int] = field(default_factory=list)
    # Per prefill, on the host: whether it continues a state in its slot (a later chunk, a prefix-cache hit) or
    # starts from nothing; on the device only when the step has both kinds.
    prefill_has_state: list[bool] = field(default_factory=list)
    prefill_has_state_mask: torch.Tensor | None = None


class SSEStateMetadataBuilder(LinearAttentionMetadataBuilder):
    """vLLM's linear-attention metadata (slots, query and sequence lengths; decodes first), plus, from host-side
    lengths, the prefills' token offsets and which of them start from nothing.

    A freed slot keeps its last request's state. A prefill that starts from nothing does not read its slot (its
    final state overwrites it); a request that starts as a decode (a one-token prompt: the batch split counts it
    as one) reads its slot, which is zeroed here, before the forward, costing no device sync and staying out of
    any captured CUDA graph. A request resumed from a prefix cache hit has computed tokens and continues from the
    state vLLM copied into its slot. vLLM 0.25, 0.32; where `is_prefilling` is None every prefill continues from
    its slot.
    """

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SSEStateMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        nd, npf = metadata.num_decodes, metadata.num_prefills
        offsets = (m.query_start_loc_cpu[nd:nd + npf + 1] - m.query_start_loc_cpu[nd]).tolist() if npf else []
        has_state = [True] * npf  # without vLLM's prefill flags every prefill continues from its slot
        if m.is_prefilling is not None:
            query_lens = m.query_start_loc_cpu.diff()
            fresh = m.is_prefilling & (query_lens > 0) & (m.seq_lens_cpu_upper_bound == query_lens)
            has_state = (~fresh[nd:nd + npf]).tolist()
            if bool(fresh[:nd].any()):
                self._zero_slots(metadata.state_indices_tensor, fresh[:nd].nonzero()[:, 0])
        mask = None
        if any(has_state) and not all(has_state):
            mask = async_tensor_h2d(has_state, metadata.state_indices_tensor.device)
        return SSEStateMetadata(**vars(metadata), prefill_token_offsets=offsets, prefill_has_state=has_state,
                                prefill_has_state_mask=mask)

    def _zero_slots(self, slots_of_rows: torch.Tensor, rows: torch.Tensor) -> None:
        # Through pinned memory where the platform has it, so that the copy does not wait for the work queued on
        # the GPU, as a plain `.to` does: that stalled every step that starts requests (`python -m bench.rollouts`).
        slots = slots_of_rows[async_tensor_h2d(rows, slots_of_rows.device)].long()
        context = self.vllm_config.compilation_config.static_forward_context
        for name in self.layer_names:
            context[name].kv_cache[0].index_fill_(0, slots, 0.0)


class SSEStateBackend(LinearAttentionBackend):
    """vLLM's linear-attention backend with `SSEStateMetadataBuilder`. vLLM 0.25, 0.32."""

    @staticmethod
    def get_name() -> str:
        return "SSE_STATE"

    @staticmethod
    def get_builder_cls() -> type[SSEStateMetadataBuilder]:
        return SSEStateMetadataBuilder


# ---------------------------------------------------------------------------------------------- the scheduler
# The hybrid's two cache groups in vLLM's scheduler: vLLM's own bookkeeping, minus its per-step work for a request
# that already holds its blocks. vLLM's scheduler asks every cache group's manager, for every running request on
# every step, whether the request needs blocks (`get_num_blocks_to_allocate`), to allocate them
# (`allocate_new_blocks`) and to free those it no longer needs (`remove_skipped_blocks`). A running request of a
# Transformer gets the first answer at once when prefix caching is on (`SingleTypeKVCacheManager.
# get_num_blocks_to_allocate`'s fast path, for requests whose blocks prefix caching has recorded); vLLM leaves
# prefix caching off for hybrids, so both of a hybrid's groups took the long path, step after step, a host cost
# that grows with the batch and that a decode step of SSE-H, bound by host work, pays in full
# (`python -m bench.rollouts` measures rollouts with these managers). Each spec is vLLM's own under a type of ours
# (grouped with vLLM's: `uniform_type_base_spec`), declared by the model's layers; `register_cache_managers` enters
# both pairs in vLLM's `KVCacheSpecRegistry` in every process vLLM loads the plugin in.

def _same_fields(cls, spec):
    """`spec` as an instance of `cls`, field for field: a spec type of ours from vLLM's, or back (same fields)."""
    return cls(**{f.name: getattr(spec, f.name) for f in fields(spec) if f.init})


@dataclass(frozen=True)
class SSEStatesSpec(MambaSpec):
    """vLLM's MambaSpec for the SSE states, under its own type so that vLLM builds `SSEStatesManager` for it.
    vLLM 0.25, 0.32."""

    @classmethod
    def of(cls, spec: MambaSpec) -> "SSEStatesSpec":
        return _same_fields(cls, spec)


class SSEStatesManager(MambaManager):
    """vLLM's MambaManager; a running request that holds its one state block is answered without its long path.

    With prefix caching off (mamba_cache_mode "none") and no speculative decoding, vLLM gives a request one state
    block, max_model_len tokens long, for its whole life: once the request holds it, the three answers are "no
    block", "no new block" and "nothing to free". Everything else (the first allocation, prefix caching's "align"
    and "all" modes, speculative blocks) is vLLM's MambaManager unchanged. Only the leading arguments every
    supported vLLM passes are read; the rest go to MambaManager as they came. vLLM 0.25, 0.32."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A request holds exactly one block for its whole life: no prefix-cache states, no speculative blocks.
        self.one_block_per_request = self.mamba_cache_mode == "none" and not self.num_speculative_blocks

    def _holds_its_block(self, request_id: str, num_tokens: int) -> bool:
        return (self.one_block_per_request and num_tokens <= self.block_size
                and bool(self.req_to_blocks.get(request_id)))

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, *args, **kwargs) -> int:
        if not new_computed_blocks and self._holds_its_block(request_id, num_tokens):
            return 0
        return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks, *args, **kwargs)

    def allocate_new_blocks(self, request_id, num_tokens, *args, **kwargs):
        if self._holds_its_block(request_id, num_tokens):
            return []
        return super().allocate_new_blocks(request_id, num_tokens, *args, **kwargs)

    def remove_skipped_blocks(self, request_id, num_computed_tokens, *args, **kwargs) -> None:
        # The block holds the state after the last computed token: nothing in it is ever skipped.
        if self._holds_its_block(request_id, num_computed_tokens):
            return
        super().remove_skipped_blocks(request_id, num_computed_tokens, *args, **kwargs)


@dataclass(frozen=True)
class SSEAttentionSpec(FullAttentionSpec):
    """vLLM's FullAttentionSpec for the hybrid's attention layers, under its own type so that vLLM builds
    `SSEAttentionManager` for them. vLLM 0.25, 0.32."""

    @classmethod
    def of(cls, spec: FullAttentionSpec) -> "SSEAttentionSpec":
        return _same_fields(cls, spec)


def attention_spec(spec):
    """An attention layer's cache spec as the hybrid declares it: vLLM's plain FullAttentionSpec becomes
    `SSEAttentionSpec` (its scheduler manager `SSEAttentionManager`); any other spec (sliding window, ...) stays
    vLLM's. vLLM 0.25, 0.32."""
    return SSEAttentionSpec.of(spec) if type(spec) is FullAttentionSpec else spec


class SSEAttentionManager(FullAttentionManager):
    """vLLM's FullAttentionManager; a request that holds blocks and brings no prefix-cache hits is told how many
    more it needs without the long path: cdiv(tokens, block size) minus the blocks it holds, which is what vLLM's
    long path works out for full attention (nothing skipped, no window) and what its fast path answers (the leading
    arguments are read as SSEStatesManager reads them).

    Built over vLLM's own FullAttentionSpec (`SSEAttentionSpec` only picks this class in the registry): vLLM
    records a group's new blocks for zeroing only when its spec's type is exactly one of its own
    (`type(spec) in (FullAttentionSpec, ...)`), and a hybrid's attention pages are its states' pages too: without
    the zeroing a page reused for KV kept a freed state's bytes, and a float32-state engine on a GPU stopped on an
    illegal memory access in its second batch. vLLM 0.25, 0.32."""

    def __init__(self, kv_cache_spec, *args, **kwargs):
        super().__init__(_same_fields(FullAttentionSpec, kv_cache_spec), *args, **kwargs)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, *args, **kwargs) -> int:
        blocks = self.req_to_blocks.get(request_id)
        # (newer vLLMs hand a partial prefix-cache hit a copy-on-write block on its first allocation: long path)
        if blocks and not new_computed_blocks and not getattr(self, "_partial_hit_reqs", None):
            return max(cdiv(num_tokens, self.block_size) - len(blocks), 0)
        return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks, *args, **kwargs)


def register_cache_managers() -> None:
    """Enter both specs and their managers in vLLM's registry (idempotent). vLLM registers its built-in specs
    only into an empty registry, the first time it looks one up; an entry made before that would keep them out,
    so they go in first (the private `_ensure_registered`). vLLM 0.25, 0.32."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SSEStatesSpec, SSEStatesManager, uniform_type_base_spec=MambaSpec)
    KVCacheSpecRegistry.register(SSEAttentionSpec, SSEAttentionManager, uniform_type_base_spec=FullAttentionSpec)


# ---------------------------------------------------------------------------------------------- the engine
def register_engine_config(architecture: str, verify_and_update_config) -> None:
    """Have vLLM call `verify_and_update_config(vllm_config)` for every engine of `architecture`, before it sizes
    the cache and captures CUDA graphs: the hook vLLM's own models use to choose defaults it cannot (an entry of
    `MODELS_CONFIG_MAP`, a `VerifyAndUpdateConfig`), which has no out-of-tree registration. An existing entry
    stays (idempotent). vLLM 0.25, 0.32."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
    if architecture not in MODELS_CONFIG_MAP:
        MODELS_CONFIG_MAP[architecture] = type(f"{architecture}EngineConfig", (VerifyAndUpdateConfig,),
                                               dict(verify_and_update_config=staticmethod(verify_and_update_config)))


def prefer_v2_model_runner() -> bool:
    """Ask vLLM for its V2 GPU model runner unless the user chose one (`VLLM_USE_V2_MODEL_RUNNER`); True when this
    set it. vLLM gives a hybrid the V1 runner unless told; V2 prepares a step's inputs on the GPU, and an SSE-H
    decode step is bound by host work. vLLM reads the variable from the environment after the config hook, in this
    process and the engine processes it starts, so it holds for later engines of this process too. vLLM 0.25."""
    if "VLLM_USE_V2_MODEL_RUNNER" in os.environ:
        return False
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return True


def model_runner(llm) -> str:
    """"V2" or "V1": the model runner an engine chose (vLLM logs it only from its worker, which a stage log of an
    in-process engine does not always get). vLLM 0.25, 0.32."""
    return "V2" if llm.llm_engine.vllm_config.use_v2_model_runner else "V1"


def spawn_engine_processes() -> bool:
    """Make vLLM spawn, not fork, the engine-core and worker processes it starts, unless the user chose
    (`VLLM_WORKER_MULTIPROC_METHOD`); True when this set it. The plugin calls it on GPUs. vLLM forks unless torch
    has initialised CUDA in this process (or it runs in a Ray actor); on the GPU nodes an engine core forked from a
    script that had built its model on the CPU never became ready, silently (issue 74: it waited in its first pinned
    allocation, although the parent's CUDA driver was not initialised at any step of the start), and the same start
    spawned was ready (tests/test_vllm_gpu.py, `test_engine_of_the_recipe_width_starts_from_a_fresh_script`). A
    script that starts an engine needs the `if __name__ == "__main__":` guard, as every spawned start does
    (multiprocessing's error says so where it lacks it). vLLM 0.25, 0.32."""
    if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ:
        return False
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return True


def sampler_without_flashinfer() -> None:
    """Where flashinfer is not installed, tell vLLM's sampler not to use it (`VLLM_USE_FLASHINFER_SAMPLER=0`) unless
    the user set the variable: vLLM lists flashinfer as a CUDA requirement, and 0.25's sampler imports it unguarded
    unless this is 0 (an engine whose logprobs mode is the default dies at start without it). Air-gapped installs
    often leave it out; PyTorch's top-k/top-p sampling is what vLLM falls back to anyway. vLLM 0.25, 0.32."""
    import importlib.util
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


class _RestoreState:
    """Stands in for a CPU generator in vLLM's rewind `gen.set_offset(gen.get_offset() - 4)`: puts back the
    state the generator had before the discarded sample."""

    def __init__(self, generator, state):
        self.generator, self.state = generator, state

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        self.generator.set_state(self.state)


def rewind_seeded_generators_on_cpu() -> None:
    """vLLM samples a token for a request whose prefill is only partly scheduled (chunked prefill), discards it,
    and rewinds the request's seeded generator with `set_offset`, which only CUDA generators have: on the CPU
    build a seeded request whose prefill was split crashed the engine ("CPU Generator does not use offset").
    The CPU runner here saves those generators' states before sampling (`_sample`) and restores them in the
    rewind (`_bookkeeping_sync`) instead, so a seeded request samples the same tokens however its prefill is split
    (GRPO's and eval's per-request seeds rely on that). Patched once per process, on the CPU runner only.
    vLLM 0.32 (CPU build)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_sse_restores_generators", False):
        return
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        generators = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0].tolist()
        self._sse_saved_states = {i: generators[i].get_state() for i in discarded if i in generators}
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        saved, self._sse_saved_states = getattr(self, "_sse_saved_states", {}), {}
        generators = self.input_batch.generators
        self.input_batch.generators = {**generators, **{i: _RestoreState(generators[i], state)
                                                        for i, state in saved.items()}}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators

    CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
    CPUModelRunner._sse_restores_generators = True


# ---------------------------------------------------------------------------------------------- partition routes
# How the routes each request's tokens took get back to the caller (`sse_model.vllm.routes`). The choice: the model
# writes them into a step buffer on the device, the model runner's per-step hook below files them under the step's
# request ids, and the caller takes them after generate through `LLM.apply_model`. vLLM's own per-token extra output,
# the routed-experts return of MoE models (`enable_return_routed_experts`), would carry them in the RequestOutput,
# but it is built for FusedMoE routers: it sizes its buffers from MoE fields of the config (experts, experts per
# token, every layer), binds to MoE router classes, and is a different mechanism in each release (a shared-memory
# buffer keyed by KV slot in 0.25, an auxiliary-output connector in 0.32). A forward never sees request ids, and
# state slots are reused within one generate, so the request ids come from the runner, once per step, on the host.

def record_routes_per_request() -> None:
    """Patch the V1 model runner (GPU and CPU) so that after each step's forward a model with a route recorder
    (`SSEForCausalLM.route_recorder`) is told which request each of the step's tokens belongs to, and at which
    positions: `recorder.end_step(request ids, token offsets, positions)`. Host lists the runner holds anyway and
    device copies: no wait for the device. A model without a recorder costs an attribute lookup a step. vLLM's V2
    runner has neither field, so the engine hook keeps V1 for an engine that records
    (`engine.verify_and_update_config`). Patched once per process. vLLM 0.25, 0.32 (V1 runner)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_sse_records_routes", False):
        return
    GPUModelRunner._model_forward = _filing_routes(GPUModelRunner._model_forward)
    GPUModelRunner._sse_records_routes = True


def _filing_routes(model_forward):
    """The runner's `model_forward`, followed by the recorder's `end_step` for the step it ran."""
    def _model_forward(self, *args, **kwargs):
        out = model_forward(self, *args, **kwargs)
        recorder = getattr(self.get_model(), "route_recorder", None)
        if recorder is not None:
            num_requests = self.input_batch.num_reqs
            recorder.end_step(self.input_batch.req_ids[:num_requests], self.query_start_loc.np[:num_requests + 1],
                              kwargs["positions"])
        return out
    return _model_forward


def _take_model_routes(model) -> dict:
    recorder = getattr(model, "route_recorder", None)
    return {} if recorder is None else recorder.take()


def take_routes(llm, request_ids: list[str]) -> list:
    """The routes [positions, SSE layers, K] the engine recorded for each of `request_ids` (the front end's ids,
    `RequestOutput.request_id`), None for a request it has none of; every recorded route is forgotten. One
    tensor-parallel rank's record is enough: every rank routes with the same logits."""
    recorded = llm.apply_model(_take_model_routes)[0]
    by_front_end_id = {}
    for engine_id, routes in recorded.items():
        by_front_end_id[engine_id] = routes
        by_front_end_id.setdefault(engine_id.rsplit("-", 1)[0], routes)
    return [by_front_end_id.get(request) for request in request_ids]


# ---------------------------------------------------------------------------------------------- weights
def in_layerwise_reload(model: torch.nn.Module) -> bool:
    """Whether vLLM's layerwise `reload_weights` is loading `model` now (its per-module reload record says the
    module can load), the only way a serving engine's weights may change (`SSEForCausalLM.load_weights`).
    vLLM 0.25, 0.32."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    return get_layerwise_info(model).can_load()


def reload_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-named `weights` into every worker of `llm` through the workers' `reload_weights`, which
    restores the loadable parameters, loads every layer and re-runs vLLM's processing after loading (the CPU build
    repacks Linear weights and computes from the packed copy), so each kernel reads the new weights. vLLM's front
    end has no method for it; `collective_rpc` calls the worker method by name. An in-process engine (external
    launcher, or no multiprocessing) gets the iterable itself and consumes it layer by layer. vLLM 0.25, 0.32."""
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
