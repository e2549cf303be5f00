"""Check the plugin's cache-group managers against another vLLM release's scheduler code, on any machine: the
registry entries resolve, and SSEStatesManager / SSEAttentionManager give MambaManager's / FullAttentionManager's
answers, block tables and new blocks to zero over 3,000 random steps of prefill chunks, decodes, finished and
preempted requests, with prefix caching off (sse_model/vllm_state_cache.py).

    unzip -q WHEELHOUSE/part-*/vllm-stripped-*.zip 'vllm/*' -d /tmp/vllm025    # the GPU node's vLLM 0.25
    PYTHONPATH=/tmp/vllm025:. python scripts/check_vllm_cache_managers.py

The scheduler's modules import without a GPU. vLLM 0.32 (the CPU build) is covered live by
tests/test_vllm_backend.py's preemption test; this script's manager construction follows 0.25's signature.
"""
import random
from dataclasses import fields

import torch
import vllm
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager, get_manager_for_kv_cache_spec
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from sse_model import vllm_state_cache
from sse_model.vllm_state_cache import SSEAttentionManager, SSEAttentionSpec, SSEStatesManager, SSEStatesSpec

print("vllm", vllm.__version__, vllm.__file__)
vllm_state_cache.register()
vllm_state_cache.register()  # idempotent
MAX_LEN = 4096
mamba = MambaSpec(shapes=((2, 5, 32, 32),), dtypes=(torch.int16,), block_size=MAX_LEN,
                  mamba_type=MambaAttentionBackendEnum.LINEAR, mamba_cache_mode="none")
attn = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
CASES = [(mamba, SSEStatesSpec, MambaManager, SSEStatesManager),
         (attn, SSEAttentionSpec, FullAttentionManager, SSEAttentionManager)]
for spec, ours_cls, base_manager, our_manager in CASES:
    ours = ours_cls.of(spec)
    assert isinstance(ours, type(spec)) and all(getattr(ours, f.name) == getattr(spec, f.name) for f in fields(spec))
    assert KVCacheSpecRegistry.get_manager_class(ours) is our_manager
    assert KVCacheSpecRegistry.get_manager_class(spec) is base_manager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(ours) is type(spec)


def manager(spec):
    blocks = MAX_LEN // spec.block_size * 24  # room for every live request at full length
    pool = BlockPool(num_gpu_blocks=blocks, enable_caching=False, hash_block_size=16)
    return get_manager_for_kv_cache_spec(spec, max_num_batched_tokens=256, max_model_len=MAX_LEN, block_pool=pool,
                                         enable_caching=False, kv_cache_group_id=1, scheduler_block_size=MAX_LEN)


for spec, ours_cls, base_manager, our_manager in CASES:
    theirs, mine = manager(spec), manager(ours_cls.of(spec))
    assert type(mine) is our_manager and type(theirs) is base_manager
    rng = random.Random(0)
    computed, prompt = {}, {}
    fast = 0
    for step in range(3000):
        live = list(computed)
        if not live or (len(live) < 20 and rng.random() < 0.3):  # a new request
            rid = f"r{step}"
            computed[rid], prompt[rid] = 0, rng.randint(1, 600)
            live.append(rid)
        rid = rng.choice(live)
        done = computed[rid]
        new = min(rng.randint(1, 256), prompt[rid] - done) if done < prompt[rid] else 1  # prefill chunk or decode
        if done + new > MAX_LEN or rng.random() < 0.01:  # finished or preempted: freed
            for m in (theirs, mine):
                m.free(rid)
            del computed[rid]
            continue
        fast += bool(mine.req_to_blocks.get(rid))
        answers = []
        for m in (theirs, mine):
            m.remove_skipped_blocks(rid, done, prompt[rid])
            n = m.get_num_blocks_to_allocate(rid, done + new, [], done, done + new)
            blocks = m.allocate_new_blocks(rid, done + new, done + new)
            answers.append((n, [b.block_id for b in blocks], [b.block_id for b in m.req_to_blocks[rid]],
                            m.block_pool.get_num_free_blocks(), m.take_new_block_ids()))  # the last: to zero
        assert answers[0] == answers[1], (step, rid, answers)
        computed[rid] = done + new
    print(f"OK: 3000 scheduler steps, {fast} calls of running requests answered alike by {base_manager.__name__} "
          f"and {our_manager.__name__}")
