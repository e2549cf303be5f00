"""The hybrid's two cache groups in vLLM's scheduler: vLLM's own bookkeeping, minus its per-step work for a
request that already holds its blocks.

vLLM's scheduler asks every cache group's manager, for every running request on every step, whether the request
needs blocks (`get_num_blocks_to_allocate`), to allocate them (`allocate_new_blocks`) and to free those it no longer
needs (`remove_skipped_blocks`). A running request of a Transformer gets the first answer at once when prefix
caching is on (`SingleTypeKVCacheManager.get_num_blocks_to_allocate`'s fast path, for requests whose blocks prefix
caching has recorded); vLLM leaves prefix caching off for hybrids, so both of a hybrid's groups took the long path,
and at 256 sequences of a 1.5B SSE-H that made the scheduler's `allocate_slots` 2.4x Qwen3's
(bench/results/vllm_v2_runner_20261128.md).

The SSE states (`SSEStatesSpec`, `SSEStatesManager`): with prefix caching off (mamba_cache_mode "none") and no
speculative decoding, vLLM gives a request one state block, max_model_len tokens long, for its whole life: once the
request holds it, the three answers are "no block", "no new block" and "nothing to free", given without the long
path. Everything else (the first allocation, prefix caching's "align" and "all" modes, speculative blocks) is vLLM's
MambaManager unchanged.

The attention layers (`SSEAttentionSpec`, `SSEAttentionManager`): a request that holds blocks and brings no
prefix-cache hits needs cdiv(tokens, block size) minus the blocks it holds, which is what vLLM's long path works out
for full attention (nothing skipped, no window) and what its fast path answers; `SSEAttentionManager` answers so
whatever the prefix-caching setting.

Each spec is vLLM's own under a type of ours (grouped with vLLM's: `uniform_type_base_spec`), declared by the
plugin's layers; `register` enters both pairs in vLLM's `KVCacheSpecRegistry` in every process vLLM loads the
plugin in.
"""
from dataclasses import dataclass, fields

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


def _same_fields(cls, spec):
    """`spec` as an instance of `cls`, field for field: a spec type of ours from vLLM's, or back (same fields)."""
    return cls(**{f.name: getattr(spec, f.name) for f in fields(spec) if f.init})


@dataclass(frozen=True)
class SSEStatesSpec(MambaSpec):
    """vLLM's MambaSpec for the SSE states, under its own type so that vLLM builds `SSEStatesManager` for it."""

    @classmethod
    def of(cls, spec: MambaSpec) -> "SSEStatesSpec":
        return _same_fields(cls, spec)


class SSEStatesManager(MambaManager):
    """vLLM's MambaManager; a running request that holds its one state block is answered without its long path.

    Only the leading arguments every supported vLLM passes are read; the rest go to MambaManager as they came."""

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
    `SSEAttentionManager` for them."""

    @classmethod
    def of(cls, spec: FullAttentionSpec) -> "SSEAttentionSpec":
        return _same_fields(cls, spec)


class SSEAttentionManager(FullAttentionManager):
    """vLLM's FullAttentionManager; a request that holds blocks and brings no prefix-cache hits is told how many
    more it needs without the long path (the leading arguments are read as SSEStatesManager reads them).

    Built over vLLM's own FullAttentionSpec (`SSEAttentionSpec` only picks this class in the registry): vLLM 0.25
    records a group's new blocks for zeroing only when its spec's type is exactly one of its own
    (`type(spec) in (FullAttentionSpec, ...)`), and a hybrid's attention pages are its states' pages too: without
    the zeroing a page reused for KV kept a freed state's bytes, and the float32-state engine on an H200 stopped on
    an illegal address in its second batch (bench/results/vllm_attention_zeroing_20261129.md)."""

    def __init__(self, kv_cache_spec, *args, **kwargs):
        super().__init__(_same_fields(FullAttentionSpec, kv_cache_spec), *args, **kwargs)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, *args, **kwargs) -> int:
        blocks = self.req_to_blocks.get(request_id)
        # (newer vLLMs hand a partial prefix-cache hit a copy-on-write block on its first allocation: long path)
        if blocks and not new_computed_blocks and not getattr(self, "_partial_hit_reqs", None):
            return max(cdiv(num_tokens, self.block_size) - len(blocks), 0)
        return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks, *args, **kwargs)


def register() -> None:
    """Enter both specs and their managers in vLLM's registry (idempotent). vLLM registers its built-in specs
    only into an empty registry, the first time it looks one up; an entry made before that would keep them out,
    so they go in first."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SSEStatesSpec, SSEStatesManager, uniform_type_base_spec=MambaSpec)
    KVCacheSpecRegistry.register(SSEAttentionSpec, SSEAttentionManager, uniform_type_base_spec=FullAttentionSpec)
