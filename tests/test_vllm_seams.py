"""One test per seam of sse_model/vllm/seams.py: each checks that the vLLM internal the seam relies on still exists
with the shape it assumes, and that the seam does what it says, without starting an engine (the engines of
tests/test_vllm_backend.py exercise the seams end to end). After upgrading vLLM, run this first: a failure names
the seam that broke.

The cache-manager tests also run against another vLLM release's scheduler on any machine, e.g. the GPU nodes' 0.25
(its scheduler modules import without a GPU):

    unzip -q WHEELHOUSE/part-*/vllm-stripped-*.zip 'vllm/*' -d /tmp/vllm025
    PYTHONPATH=/tmp/vllm025:. python -m pytest -q tests/test_vllm_seams.py -k "cache_managers or _manager_seam"
"""
import importlib.util
import inspect
import os
import random
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from sse_model.vllm import seams


def source(obj) -> str:
    return inspect.getsource(obj)


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


# ---------------------------------------------------------------------------------------------- the model's forward
def test_linear_attention_seam():
    """vLLM's `linear_attention` op finds the layer by name among the forward context's layers and calls its
    `_forward` with the tensors by name; through the seam, the op reaches the registered layer and its output."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.mamba.linear import minimax_linear_attn

    op = minimax_linear_attn.linear_attention
    assert parameters(op) == ["hidden_states", "output", "positions", "layer_name"]
    assert "no_compile_layers[layer_name]" in source(op)
    assert "_forward(hidden_states=hidden_states, output=output, positions=positions)" in source(op)

    class Layer(torch.nn.Module):
        def _forward(self, hidden_states, output, positions):
            output.copy_(hidden_states * positions[:, None])

    vllm_config = VllmConfig()
    vllm_config.compilation_config.static_forward_context["model.layers.0.linear_attn"] = Layer()
    x, positions, out = torch.randn(3, 4), torch.arange(3.0), torch.zeros(3, 4)
    with set_forward_context(None, vllm_config):
        seams.linear_attention(x, out, positions, "model.layers.0.linear_attn")
    assert torch.equal(out, x * positions[:, None])


def test_attention_backend_seam():
    """`get_attn_backend(head_size, dtype, kv_cache_dtype, ...)` gives the platform's backend class, which says
    which head sizes it runs (what `check_servable` reports)."""
    from vllm.v1.attention.selector import get_attn_backend

    assert parameters(get_attn_backend)[:3] == ["head_size", "dtype", "kv_cache_dtype"]
    with set_current_vllm_config(VllmConfig()):
        backend = seams.attention_backend(64, torch.float32, "auto")
    assert backend.supports_head_size(64) and 64 in backend.get_supported_head_sizes()
    assert not backend.supports_head_size(65) and isinstance(backend.get_name(), str)


def test_state_backend_seam():
    """The builder overrides `build(common_prefix_len, common_attn_metadata, fast_build)` and reads the host-side
    fields of `CommonAttentionMetadata` and the builder's `layer_names` and `vllm_config`. On a step of a fresh
    one-token request (a decode), a continuing decode, a fresh prefill and a later chunk: the decodes come first,
    the prefills' offsets are on the host, only the later chunk continues from its slot, and only the fresh
    decode's slot is zeroed."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.linear_attn import LinearAttentionMetadataBuilder

    assert parameters(LinearAttentionMetadataBuilder.build) == ["self", "common_prefix_len", "common_attn_metadata",
                                                                 "fast_build"]
    assert {"query_start_loc_cpu", "is_prefilling", "seq_lens_cpu_upper_bound"} <= {
        f.name for f in fields(CommonAttentionMetadata)}
    assert seams.SSEStateBackend.get_builder_cls() is seams.SSEStateMetadataBuilder

    spec = MambaSpec(shapes=((2, 3),), dtypes=(torch.float32,), block_size=64,
                     mamba_type=MambaAttentionBackendEnum.LINEAR, mamba_cache_mode="none")
    vllm_config = VllmConfig()
    cache = torch.ones(5, 2, 3)  # slots
    vllm_config.compilation_config.static_forward_context["states"] = SimpleNamespace(kv_cache=[cache])
    builder = seams.SSEStateMetadataBuilder(spec, ["states"], vllm_config, torch.device("cpu"))
    query_lens, seq_lens = [1, 1, 5, 4], [1, 10, 5, 12]  # fresh decode, decode, fresh prefill, later chunk
    starts = torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq, num_reqs=4, num_actual_tokens=11,
        max_query_len=5, max_seq_len=12, block_table_tensor=torch.tensor([[3], [1], [0], [4]], dtype=torch.int32),
        slot_mapping=torch.zeros(11, dtype=torch.int64), is_prefilling=torch.tensor([True, False, True, True]),
        seq_lens_cpu_upper_bound=seq)
    metadata = builder.build(0, common)
    assert isinstance(metadata, seams.SSEStateMetadata)
    assert (metadata.num_decodes, metadata.num_prefills) == (2, 2)
    assert metadata.prefill_token_offsets == [0, 5, 9] and metadata.prefill_has_state == [False, True]
    assert metadata.prefill_has_state_mask.tolist() == [False, True]
    assert cache[3].eq(0).all() and cache[[0, 1, 2, 4]].eq(1).all()


# ---------------------------------------------------------------------------------------------- the scheduler
MAX_LEN = 4096
STATES = MambaSpec(shapes=((2, 5, 32, 32),), dtypes=(torch.int16,), block_size=MAX_LEN,
                   mamba_type=MambaAttentionBackendEnum.LINEAR, mamba_cache_mode="none")
ATTENTION = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)


def manager(spec):
    """The manager vLLM's registry builds for `spec`, as its scheduler builds it (with zeroing records on where the
    release has them), over a pool with room for every live request at full length."""
    seams.register_cache_managers()
    pool = BlockPool(num_gpu_blocks=MAX_LEN // spec.block_size * 24, enable_caching=False, hash_block_size=16)
    tokens = ("max_in_flight_tokens" if "max_in_flight_tokens" in parameters(get_manager_for_kv_cache_spec)
              else "max_num_batched_tokens")
    zeroing = ({"needs_kv_cache_zeroing": True}
               if "needs_kv_cache_zeroing" in parameters(SingleTypeKVCacheManager.__init__) else {})
    return get_manager_for_kv_cache_spec(spec, **{tokens: 256}, max_model_len=MAX_LEN, block_pool=pool,
                                         enable_caching=False, kv_cache_group_id=1, scheduler_block_size=MAX_LEN,
                                         **zeroing)


def call(m, method: str, values: dict):
    """`m.method(...)` with the arguments vLLM's base class names, in its order, from `values`: a release that
    adds a required argument the managers here do not know fails here, by name."""
    signature = inspect.signature(getattr(SingleTypeKVCacheManager, method))
    args = []
    for name, p in list(signature.parameters.items())[1:]:
        if name in values:
            args.append(values[name])
        else:
            assert p.default is not p.empty, f"{method} takes an argument the test does not know: {name}"
            break
    return getattr(m, method)(*args)


def same_answers_as_vllm(spec, ours_cls, base_manager, our_manager) -> int:
    """Our manager and vLLM's, side by side over 3,000 random scheduler steps of prefill chunks, decodes, finished
    and preempted requests with prefix caching off: every answer, block table, free-block count and list of new
    blocks to zero alike. Returns how many calls came from requests that already held blocks (the fast path)."""
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
        values = dict(request_id=rid, num_tokens=done + new, new_computed_blocks=[], total_computed_tokens=done,
                      num_local_computed_tokens=done, num_computed_tokens=done, processed_computed_tokens=done,
                      num_prompt_tokens=prompt[rid], num_tokens_main_model=done + new)
        answers = []
        for m in (theirs, mine):
            call(m, "remove_skipped_blocks", values)
            n = call(m, "get_num_blocks_to_allocate", values)
            blocks = call(m, "allocate_new_blocks", values)
            answers.append((n, [b.block_id for b in blocks], [b.block_id for b in m.req_to_blocks[rid]],
                            m.block_pool.get_num_free_blocks(), m.take_new_block_ids()))  # the last: to zero
        assert answers[0] == answers[1], (step, rid, answers)
        computed[rid] = done + new
    return fast


def test_states_manager_seam():
    """`MambaManager` has the attributes `SSEStatesManager` reads, `SSEStatesSpec` is vLLM's MambaSpec field for
    field, and over thousands of scheduler steps the fast path gives MambaManager's answers."""
    ours = seams.SSEStatesSpec.of(STATES)
    assert isinstance(ours, MambaSpec) and all(getattr(ours, f.name) == getattr(STATES, f.name)
                                               for f in fields(STATES))
    m = manager(ours)
    assert (m.mamba_cache_mode, m.num_speculative_blocks, m.block_size) == ("none", 0, MAX_LEN)
    assert m.one_block_per_request and isinstance(m.req_to_blocks, dict)
    assert same_answers_as_vllm(STATES, seams.SSEStatesSpec, MambaManager, seams.SSEStatesManager) > 1000


def test_attention_manager_seam():
    """`SSEAttentionSpec` is vLLM's FullAttentionSpec field for field, `attention_spec` renames only that exact type,
    the manager holds vLLM's own spec type (vLLM 0.25 records new blocks for zeroing by the spec's exact type), and
    over thousands of scheduler steps the fast path gives FullAttentionManager's answers and blocks to zero."""
    ours = seams.attention_spec(ATTENTION)
    assert type(ours) is seams.SSEAttentionSpec and all(getattr(ours, f.name) == getattr(ATTENTION, f.name)
                                                        for f in fields(ATTENTION))
    window = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16, sliding_window=64)
    assert seams.attention_spec(window) is window
    assert type(manager(ours).kv_cache_spec) is FullAttentionSpec
    assert same_answers_as_vllm(ATTENTION, seams.SSEAttentionSpec, FullAttentionManager,
                                seams.SSEAttentionManager) > 1000


def test_register_cache_managers_seam():
    """`KVCacheSpecRegistry.register(spec, manager, uniform_type_base_spec=)` and the private `_ensure_registered`,
    which fills the registry with vLLM's own specs only while it is empty: after registering (twice), vLLM's specs
    and ours map to their managers and ours group with vLLM's."""
    assert "uniform_type_base_spec" in parameters(KVCacheSpecRegistry.register)
    assert "_REGISTRY_KVCACHESPEC_LIST" in source(KVCacheSpecRegistry._ensure_registered)
    seams.register_cache_managers()
    seams.register_cache_managers()  # idempotent
    for spec, ours_cls, base_manager, our_manager in [
            (STATES, seams.SSEStatesSpec, MambaManager, seams.SSEStatesManager),
            (ATTENTION, seams.SSEAttentionSpec, FullAttentionManager, seams.SSEAttentionManager)]:
        assert KVCacheSpecRegistry.get_manager_class(ours_cls.of(spec)) is our_manager
        assert KVCacheSpecRegistry.get_manager_class(spec) is base_manager
        assert KVCacheSpecRegistry.get_uniform_type_base_spec(ours_cls.of(spec)) is type(spec)


# ---------------------------------------------------------------------------------------------- the engine
def test_register_engine_config_seam():
    """vLLM looks the engine's architecture up in `MODELS_CONFIG_MAP` and calls its
    `verify_and_update_config(vllm_config)`; the seam's entry does that with our function, and leaves an existing
    entry alone."""
    from vllm.config.vllm import VllmConfig as VllmConfigClass
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    hook = source(VllmConfigClass.try_verify_and_update_config)
    assert "MODELS_CONFIG_MAP.get(architecture" in hook and "cls.verify_and_update_config(self)" in hook
    seen = []
    try:
        seams.register_engine_config("SeamTestForCausalLM", seen.append)
        seams.register_engine_config("SeamTestForCausalLM", lambda config: None)  # an existing entry stays
        entry = MODELS_CONFIG_MAP["SeamTestForCausalLM"]
        assert issubclass(entry, VerifyAndUpdateConfig)
        entry.verify_and_update_config("config")
        assert seen == ["config"]
    finally:
        MODELS_CONFIG_MAP.pop("SeamTestForCausalLM", None)


def test_prefer_v2_model_runner_seam(monkeypatch):
    """vLLM reads `VLLM_USE_V2_MODEL_RUNNER` from the environment when asked (not cached at import); the seam sets
    it when unset and never overrides a user's choice."""
    import vllm.envs as envs

    assert "VLLM_USE_V2_MODEL_RUNNER" in envs.environment_variables
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    assert seams.prefer_v2_model_runner() and os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert envs.environment_variables["VLLM_USE_V2_MODEL_RUNNER"]() is True
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not seams.prefer_v2_model_runner() and os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_model_runner_seam():
    """An engine's config says which model runner it took, as `use_v2_model_runner`."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    assert "use_v2_model_runner" in dir(VllmConfig)
    for v2, name in ((True, "V2"), (False, "V1")):
        llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(use_v2_model_runner=v2)))
        assert seams.model_runner(llm) == name


@pytest.mark.parametrize("installed", [False, True])
def test_sampler_without_flashinfer_seam(monkeypatch, installed):
    """vLLM reads `VLLM_USE_FLASHINFER_SAMPLER`; without flashinfer the seam sets it to 0 unless the user set it,
    and with flashinfer leaves it alone."""
    import vllm.envs as envs

    assert "VLLM_USE_FLASHINFER_SAMPLER" in envs.environment_variables
    find_spec = importlib.util.find_spec

    def find(name, *args):
        return (object() if installed else None) if name == "flashinfer" else find_spec(name, *args)
    monkeypatch.setattr(importlib.util, "find_spec", find)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    seams.sampler_without_flashinfer()
    assert os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") == (None if installed else "0")
    assert envs.environment_variables["VLLM_USE_FLASHINFER_SAMPLER"]() is installed
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    seams.sampler_without_flashinfer()
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


def test_spawn_engine_processes_seam(monkeypatch):
    """vLLM takes its start method from `VLLM_WORKER_MULTIPROC_METHOD` in `get_mp_context`, after
    `_maybe_force_spawn`, which keeps "spawn"; the seam sets spawn when unset and never overrides the user."""
    import vllm.envs as envs
    from vllm.utils import system_utils

    assert "VLLM_WORKER_MULTIPROC_METHOD" in envs.environment_variables
    assert "_maybe_force_spawn()" in source(system_utils.get_mp_context)
    assert "envs.VLLM_WORKER_MULTIPROC_METHOD" in source(system_utils.get_mp_context)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    assert seams.spawn_engine_processes() and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    system_utils._maybe_force_spawn()
    assert envs.VLLM_WORKER_MULTIPROC_METHOD == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert not seams.spawn_engine_processes() and envs.VLLM_WORKER_MULTIPROC_METHOD == "fork"


def test_rewind_seeded_generators_on_cpu_seam(monkeypatch):
    """The CPU runner inherits the GPU runner's step: `_sample(...)` before `_bookkeeping_sync(...)`, which rewinds
    the generators of the requests `discard_request_mask` marks with `gen.set_offset(gen.get_offset() - 4)`, which
    a CPU generator refuses. Patched over stand-ins doing what vLLM's do, the seam puts a discarded request's
    generator back where it was before the sample and leaves the others as they are."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    step = source(GPUModelRunner)
    assert step.index("self._sample(") < step.index("self._bookkeeping_sync(")
    bookkeeping = source(GPUModelRunner._bookkeeping_sync)
    assert "self.discard_request_mask.np[:num_reqs]" in bookkeeping
    assert "self.input_batch.generators.get(int(i))" in bookkeeping
    assert "gen.set_offset(gen.get_offset() - 4)" in bookkeeping
    assert "_sample" not in vars(CPUModelRunner) or vars(CPUModelRunner).get("_sse_restores_generators")
    with pytest.raises(RuntimeError):
        torch.Generator().set_offset(0)  # why the seam exists

    def sample(self):  # vLLM's: one draw from every request's generator
        return {i: torch.rand(1, generator=g).item() for i, g in self.input_batch.generators.items()}

    def rewind(self):  # vLLM's rewind of the discarded requests' generators
        for i in np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)

    monkeypatch.setattr(CPUModelRunner, "_sample", sample)
    monkeypatch.setattr(CPUModelRunner, "_bookkeeping_sync", rewind)
    monkeypatch.setattr(CPUModelRunner, "_sse_restores_generators", False, raising=False)
    seams.rewind_seeded_generators_on_cpu()
    seams.rewind_seeded_generators_on_cpu()  # once per process
    generators = {0: torch.Generator().manual_seed(1), 1: torch.Generator().manual_seed(2)}
    runner = SimpleNamespace(input_batch=SimpleNamespace(generators=generators, num_reqs=2),
                             discard_request_mask=SimpleNamespace(np=np.array([True, False])))
    first = CPUModelRunner._sample(runner)
    CPUModelRunner._bookkeeping_sync(runner)
    again = CPUModelRunner._sample(runner)
    assert again[0] == first[0] and again[1] != first[1]
    assert runner.input_batch.generators is generators


# ---------------------------------------------------------------------------------------------- weights
def test_in_layerwise_reload_seam():
    """`get_layerwise_info(module).can_load()`: false for a loaded model, true while vLLM's layerwise reload has
    set the model up for loading (`record_metadata_for_reloading`, then `initialize_layerwise_reload`)."""
    from vllm.model_executor.model_loader.reload import layerwise

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not seams.in_layerwise_reload(model)
    layerwise.record_metadata_for_reloading(model)
    layerwise.initialize_layerwise_reload(model)
    assert seams.in_layerwise_reload(model)


def test_reload_weights_seam():
    """The workers' `reload_weights` (CPU and GPU) takes `weights_iterator` and `is_checkpoint_format`, and its
    model runner re-runs the processing after loading; the seam calls it by name on every worker."""
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert hasattr(CPUWorker, "reload_weights")
    assert {"weights_iterator", "is_checkpoint_format"} <= set(parameters(GPUModelRunner.reload_weights))
    calls = []
    llm = SimpleNamespace(collective_rpc=lambda method, kwargs: calls.append((method, kwargs)))
    weights = [("model.norm.weight", torch.ones(2))]
    seams.reload_weights(llm, weights)
    assert calls == [("reload_weights", dict(weights_iterator=weights, is_checkpoint_format=True))]


def test_record_routes_per_request_seam():
    """The V1 runner calls `_model_forward(input_ids=, positions=, ...)` once per step, after `_prepare_inputs` has
    set `query_start_loc.np` for the step's requests `input_batch.req_ids`; the CPU runner keeps that method. The
    patched forward files a recording model's step under those ids and positions."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from sse_model.vllm.routes import RouteRecorder

    step = source(GPUModelRunner.execute_model)
    assert "self._model_forward(" in step and "positions=positions" in step
    assert "self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens" in source(GPUModelRunner._prepare_inputs)
    assert "_model_forward" not in vars(CPUModelRunner) and isinstance(vars(InputBatch)["req_ids"], property)
    seams.record_routes_per_request()
    assert GPUModelRunner._sse_records_routes

    recorder = RouteRecorder(num_layers=1, top_k=1, max_tokens=8)
    runner = SimpleNamespace(get_model=lambda: SimpleNamespace(route_recorder=recorder),
                             query_start_loc=SimpleNamespace(np=np.array([0, 2, 3, 3])),
                             input_batch=SimpleNamespace(num_reqs=2, req_ids=["a-1234abcd", "b-99999999", "old"]))
    recorder.write(0, torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]]))  # the step's 3 tokens' router logits
    forward = seams._filing_routes(lambda self, **kwargs: "out")
    assert forward(runner, input_ids=None, positions=torch.tensor([5, 6, 0])) == "out"
    routes = recorder.take()
    assert routes["a-1234abcd"].tolist() == [[[-1]]] * 5 + [[[1]], [[0]]]  # positions 0-4 computed elsewhere
    assert routes["b-99999999"].tolist() == [[[1]]] and set(routes) == {"a-1234abcd", "b-99999999"}
    assert recorder.take() == {}


def test_take_routes_seam():
    """The engine's request ids are the front end's, or it followed by "-" and a suffix."""
    from vllm.v1.engine.input_processor import InputProcessor

    assert 'request.request_id = f"{request.external_req_id}-{random_uuid():.8}"' in source(InputProcessor)
    table = np.zeros((3, 1, 1), dtype=np.int16)

    class Engine:
        def apply_model(self, func):  # vLLM's: the function on every worker's model
            return [func(SimpleNamespace(route_recorder=SimpleNamespace(
                take=lambda: {"7-0a1b2c3d": table, "8": table + 1})))]
    routes = seams.take_routes(Engine(), ["8", "7", "9"])
    assert routes[0].tolist() == (table + 1).tolist() and routes[1] is table and routes[2] is None
