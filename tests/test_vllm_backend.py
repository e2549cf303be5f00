"""The vLLM backend for SSE-H (issue 4) on the CPU build of vLLM, against the HF model as the reference.

vLLM engines run in one worker subprocess (this file run as a script): in-process engines
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, what TRL's colocate mode uses) start in seconds, but leave process-wide
state behind (distributed groups, torch thread settings), so they stay out of pytest's process. The worker holds
every engine for the whole module and answers (command, args) messages; the references are computed here.
The OpenAI server runs as its own process, started at the top of the module so its ~30 s start overlaps the rest.
"""
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from sse_model import SSEConfig, SSEForCausalLM
from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER

pytestmark = pytest.mark.slow

S, A = SSE_LAYER, ATTENTION_LAYER
BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            sse_num_heads=2, sse_key_dim=32, sse_value_dim=32, sse_lora_rank=8, max_position_embeddings=1024,
            initializer_range=0.05)
CONFIGS = {
    # hybrid n4k1 with every option on: q/k norms, qkv biases, gate bias, non-default RoPE base, untied head
    "n4k1": dict(layer_types=[S, A, S, S], num_hidden_layers=4, sse_num_partitions=4, sse_top_k=1,
                 attention_qk_norm=True, attention_bias=True, sse_gate_bias=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # two attention layers, so each SSE state entry holds one layer and the attention block (sized to hold an
    # entry) stays shorter than the generations: requests outgrow their blocks and get preempted; a shared
    # partition without low-rank terms (its q and k are the routed ones)
    "n8k2_row_sparse": dict(layer_types=[S, A, S, A], num_hidden_layers=4, sse_num_partitions=8, sse_top_k=2,
                            sse_row_topk=8, sse_qkv_bias=True, sse_lora_rank=0),
    "gla": dict(layer_types=[S] * 3, num_hidden_layers=3, sse_num_partitions=1, sse_top_k=1,
                sse_shared_partition=False, tie_word_embeddings=True),
    "transformer": dict(layer_types=[A] * 3, num_hidden_layers=3),
    # the SSE authors' layer (flash-linear-attention PR #882 at 741fbbf, fla/layers/sse.py SSEGLA): SiLU q / v over
    # the shared partition's low-rank terms, its own decay gate, a low-rank output gate, two partitions read and
    # one written (the torch paths of the CPU engine)
    "authors": dict(layer_types=[S, A, S], num_hidden_layers=3, sse_num_partitions=4, sse_top_k=1,
                    sse_num_readers=2, sse_qv_activation="silu", sse_shared_decay=True, sse_output_gate_rank=8),
    # the Triton decode test: every decode feature on (K > 1, shared partition, row-sparse keys), and a hybrid, so
    # vLLM pads the state pages up to the attention page and the kernel gets a strided state cache
    "triton": dict(layer_types=[S, A], num_hidden_layers=2, sse_num_partitions=4, sse_top_k=2, sse_row_topk=8),
    # partition replay: partitions 0 and 1 of every SSE layer have the same router row (`tie_router_rows`), so a
    # trainer whose router is perturbed by a hair routes otherwise than the engine wherever those two lead
    "routes": dict(layer_types=[S, A, S], num_hidden_layers=3, sse_num_partitions=4, sse_top_k=1),
}
COMMON = dict(dtype="float32", max_model_len=512, seed=0, kv_cache_memory_bytes=64 << 20, max_num_seqs=16)
ENGINES = {
    # the production path: torch.compile (the SSE layer is an opaque custom op), prefix caching, default scheduler
    "n4k1": dict(COMMON, max_model_len=1024),
    # chunked prefill in 16-token steps next to decodes; a cache so small that long generations get preempted;
    # prefix caching off, as vLLM 0.25 runs hybrids on a GPU (the CPU build turns it on)
    "n8k2_row_sparse": dict(COMMON, enforce_eager=True, max_num_batched_tokens=16, kv_cache_memory_bytes=1_500_000,
                            max_num_seqs=8, disable_log_stats=False, enable_prefix_caching=False),
    "gla": dict(COMMON, enforce_eager=True),
    "transformer": dict(COMMON, enforce_eager=True),
    "authors": dict(COMMON, enforce_eager=True),
    # bf16 engines of n4k1: vLLM's default states for them (int16 fixed point), and float32 ones. vLLM's CPU build
    # makes every state float32 on CPUs with AVX-512 BF16 whatever "auto" says; the worker hides that feature for
    # the first, as on a CPU without it (a GPU engine's case)
    "n4k1_bf16": dict(COMMON, dtype="bfloat16", enforce_eager=True, hide_avx512_bf16=True),
    "n4k1_bf16_f32_states": dict(COMMON, dtype="bfloat16", enforce_eager=True, mamba_ssm_cache_dtype="float32"),
    # records each request's partition routes (sse_model/vllm/routes.py); chunked prefill, so routes of a prompt
    # come from several steps
    "routes": dict(COMMON, enforce_eager=True, max_num_batched_tokens=32,
                   additional_config={"sse_record_routes": True}),
}
CHECKPOINT_OF = {"n4k1_bf16": "n4k1", "n4k1_bf16_f32_states": "n4k1"}  # engines of another engine's checkpoint
PROMPT_LENGTHS = (1, 5, 17, 40, 64, 121)
NEW_TOKENS = 64
TOL = 1e-4  # float32 logprobs: observed differences are ~1e-6


# ---------------------------------------------------------------------------------------------- worker process
def _serve(read_fd: int, write_fd: int) -> None:
    """Worker main loop: engines by name, HF twins (kept equal to what was pushed) for the parity probe."""
    torch.set_num_threads(1)  # in-process engines share the process; on 2 cores 2 OpenMP threads thrash
    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader.reload import meta

    from sse_model.vllm import model as vllm_model
    from sse_model.vllm import seams
    from sse_model.vllm.plugin import register
    from sse_model.vllm.sync import logprob_parity, push_weights

    # A reload materialises parameters uninitialised; make them NaN, so an element no loader writes (a zero bias
    # of a stacked projection, the zeros of a block-diagonal weight, padding) fails the parity checks every time
    # instead of passing whenever the memory happened to hold zeros.
    materialize = meta.materialize_meta_tensor

    def materialize_as_nan(meta_tensor):
        tensor = materialize(meta_tensor)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor
    meta.materialize_meta_tensor = materialize_as_nan

    # Prefill groups of 3 sequences for n4k1 (N + shared = 5 partitions), 1 for n8k2, 15 for gla: every
    # multi-prompt batch below is split into groups of sequences, as GPU engines split their big prefill batches.
    n4k1_state = BASE["sse_num_heads"] * 5 * BASE["sse_key_dim"] * BASE["sse_value_dim"]
    vllm_model.PREFILL_STATES_BYTES = 3 * vllm_model.PREFILL_STATE_COPIES * 4 * n4k1_state

    engines, twins, steps = {}, {}, {}

    def model_of(name):
        return engines[name].llm_engine.model_executor.driver_worker.model_runner.model

    def sse_layers(name):
        return [m for m in model_of(name).modules() if type(m).__name__ == "SSELinearAttention"]

    def state_of(name, layer):
        """The layer's [slots, H, N + shared, c, d_v] view of the cache entry holding its state."""
        return model_of(name).get_submodule(layer.states_name).layer_states(layer.state_row)

    def start(name, path, kwargs):
        kwargs = dict(kwargs)
        has_avx512_bf16 = torch.cpu._is_avx512_bf16_supported
        if kwargs.pop("hide_avx512_bf16", False):
            torch.cpu._is_avx512_bf16_supported = lambda: False
        try:
            engines[name] = LLM(model=path, **kwargs)
        finally:
            torch.cpu._is_avx512_bf16_supported = has_avx512_bf16
        twins[name] = SSEForCausalLM.from_pretrained(path).eval()
        layers = sse_layers(name)
        if layers:  # record what each step's batch held, at the first SSE layer
            layer, steps[name] = layers[0], []
            recur = layer._recur

            def counting(inputs, md, state, output):
                n, p = md.num_decodes, md.num_prefills
                qsl = md.query_start_loc[n:n + p + 1]
                context = md.seq_lens[n:n + p] - (qsl[1:] - qsl[:-1])
                steps[name].append((n, p, int(context.max()) if p else 0, layer.prefill_group,
                                    int((context == 0).sum())))  # prefills that start from nothing
                return recur(inputs, md, state, output)
            layer._recur = counting
        return [state_of(name, layer).is_contiguous() for layer in layers]

    def generate(name, prompts, sampling, routes=False):
        outs = engines[name].generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**sampling),
                                      use_tqdm=False)
        recorded = seams.take_routes(engines[name], [o.request_id for o in outs]) if routes else [None] * len(outs)
        return [dict(num_cached_tokens=o.num_cached_tokens, routes=None if r is None else r.tolist(),
                     completions=[dict(token_ids=list(c.token_ids),
                                       logprobs=[lp[t].logprob for lp, t in zip(c.logprobs or [], c.token_ids)],
                                       top=[{t: x.logprob for t, x in lp.items()} for lp in c.logprobs or []])
                                  for c in o.outputs]) for o, r in zip(outs, recorded)]

    def push(name, blob, probe):
        tensors, params = load_tensors(blob), dict(twins[name].named_parameters())
        with torch.no_grad():
            for key in tensors.keys() & params.keys():
                if params[key].shape == tensors[key].shape:
                    params[key].copy_(tensors[key])
        stale = logprob_parity(engines[name], twins[name], probe)
        push_weights(engines[name], tensors.items())
        return stale, logprob_parity(engines[name], twins[name], probe)

    def poison(name):
        """Fill every SSE state slot with noise, as if other requests had just used them."""
        engines[name].reset_prefix_cache()
        for layer in sse_layers(name):
            state_of(name, layer).normal_(0.0, 10.0)

    def direct_load(name, key):
        model = engines[name].llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights([(key, twins[name].get_parameter(key).detach())])

    def preemptions(name):
        return sum(m.value for m in engines[name].get_metrics() if m.name == "vllm:num_preemptions")

    def servable(name, overrides):
        """`check_servable` on the engine's config with fields set past SSEConfig's own checks."""
        from vllm.config import set_current_vllm_config

        from sse_model.vllm.model import check_servable
        vllm_config = engines[name].llm_engine.vllm_config
        config = copy.deepcopy(vllm_config.model_config.hf_config)
        for key, value in overrides.items():
            setattr(config, key, value)
        with set_current_vllm_config(vllm_config):
            check_servable(config, vllm_config)

    def registry():
        from vllm import ModelRegistry
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP

        from sse_model.vllm.engine import verify_and_update_config
        register(), register()  # idempotent
        return ("SSEForCausalLM" in ModelRegistry.get_supported_archs()
                and MODELS_CONFIG_MAP["SSEForCausalLM"].verify_and_update_config is verify_and_update_config)

    def cache_groups(name):
        runner = engines[name].llm_engine.model_executor.driver_worker.model_runner
        return [sorted(group.layer_names) for group in runner.kv_cache_config.kv_cache_groups]

    def managers(name):
        return engines[name].llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator \
            .single_type_managers

    checks = {}

    def check_cache_managers(name):
        """From now on, every call the engine's SSEStatesManager or SSEAttentionManager answers by its fast path is
        also put to vLLM's MambaManager or FullAttentionManager, which must give the same answer and change
        nothing; returns the manager classes and modes."""
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager

        from sse_model.vllm.seams import SSEAttentionManager, SSEStatesManager
        counts = checks.setdefault(name, dict(fast=0, disagreed=0, attention_fast=0, attention_disagreed=0))

        def checked(m, method, ours, theirs, fast, key):
            hits = method == "get_num_blocks_to_allocate"  # its third argument: prefix-cache hits

            def call(request_id, tokens, *args, **kwargs):
                if not fast(request_id, tokens) or (hits and args[0]):
                    return ours(m, request_id, tokens, *args, **kwargs)
                counts[key] += 1
                blocks = list(m.req_to_blocks[request_id])
                answer = ours(m, request_id, tokens, *args, **kwargs)
                counts[key.replace("fast", "disagreed")] += (theirs(m, request_id, tokens, *args, **kwargs) != answer
                                                             or m.req_to_blocks[request_id] != blocks)
                return answer
            setattr(m, method, call)
        for m in managers(name):
            if isinstance(m, SSEStatesManager):
                for method in ("get_num_blocks_to_allocate", "allocate_new_blocks", "remove_skipped_blocks"):
                    checked(m, method, getattr(SSEStatesManager, method), getattr(MambaManager, method),
                            m._holds_its_block, "fast")
            elif isinstance(m, SSEAttentionManager):
                checked(m, "get_num_blocks_to_allocate", SSEAttentionManager.get_num_blocks_to_allocate,
                        FullAttentionManager.get_num_blocks_to_allocate,
                        lambda request_id, _, m=m: bool(m.req_to_blocks.get(request_id)), "attention_fast")
        return [(type(m).__name__, getattr(m, "mamba_cache_mode", None), type(m.kv_cache_spec).__name__)
                for m in managers(name)]

    commands = dict(start=start, generate=generate, push=push, poison=poison, direct_load=direct_load,
                    cache_groups=cache_groups, check_cache_managers=check_cache_managers,
                    cache_manager_checks=lambda name: checks[name],
                    state_dtypes=lambda name: [str(state_of(name, layer).dtype) for layer in sse_layers(name)],
                    steps=lambda name: steps.get(name, []), preemptions=preemptions, registry=registry,
                    servable=servable, parity=lambda name, ids: logprob_parity(engines[name], twins[name], ids))
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    while True:
        try:
            command, args = inbox.recv()
        except EOFError:
            return
        try:
            outbox.send(("ok", commands[command](*args)))
        except Exception as e:  # report to the test, keep serving
            outbox.send(("error", f"{type(e).__name__}: {e}"))


class Worker:
    """Client side of `_serve`: a subprocess of this file, talked to over two pipes."""

    def __init__(self, log_path: Path, env: dict[str, str] | None = None):
        theirs_read, ours_write = os.pipe()
        ours_read, theirs_write = os.pipe()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs_read), str(theirs_write)], pass_fds=(theirs_read, theirs_write),
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})})
        os.close(theirs_read), os.close(theirs_write)
        self.inbox, self.outbox = Connection(ours_read, writable=False), Connection(ours_write, readable=False)

    def __call__(self, command, *args, timeout=300):
        self.outbox.send((command, args))
        if not self.inbox.poll(timeout):
            raise TimeoutError(f"vLLM worker: {command} took over {timeout} s\n{self.log_tail()}")
        try:
            status, value = self.inbox.recv()
        except EOFError:
            raise RuntimeError(f"vLLM worker died during {command}\n{self.log_tail()}") from None
        if status == "error":
            raise RuntimeError(value)
        return value

    def log_tail(self, n=4000):
        return self.log_path.read_text()[-n:]

    def close(self):
        self.outbox.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---------------------------------------------------------------------------------------------- fixtures
def make_checkpoint(root: Path, name: str) -> Path:
    from tiny_checkpoints import save_checkpoint
    path = save_checkpoint(root / name, SSEConfig(**{**BASE, **CONFIGS[name]}), seed=len(name))
    if name == "routes":
        tie_router_rows(path)
    return path


def tie_router_rows(path: Path) -> None:
    """Give partition 1 of every SSE layer partition 0's router row: their logits tie exactly."""
    model = SSEForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.layer_type == SSE_LAYER:
                layer.linear_attn.router.weight[1] = layer.linear_attn.router.weight[0]
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_ckpts")
    return {name: make_checkpoint(root, name) for name in ENGINES if name not in CHECKPOINT_OF}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def server(checkpoints, tmp_path_factory):
    """The OpenAI server from the command line (the plugin found through its entry point), started before the
    other tests run; the last test waits for it and talks to it."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    port = free_port()
    # `vllm` beside this interpreter: the command users type (scripts/setup.sh makes it start on the CPU wheel).
    command = [str(Path(sys.executable).with_name("vllm")), "serve", str(checkpoints["n4k1"])]
    proc = subprocess.Popen(
        command + ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
                   "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "sse"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    yield proc, port, log
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def worker(checkpoints, tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("worker") / "worker.log")
    started = set()

    def engine(name):
        if name not in started:
            w("start", name, str(checkpoints[CHECKPOINT_OF.get(name, name)]), ENGINES[name], timeout=600)
            started.add(name)
        return name
    w.engine = engine
    yield w
    w.close()


@pytest.fixture(scope="module")
def hf(checkpoints):
    """The HF models the engines must agree with; reload tests change them and push the change."""
    return {name: SSEForCausalLM.from_pretrained(path).eval() for name, path in checkpoints.items()}


def prompts_for(vocab_size, lengths=PROMPT_LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model, prompts, new_tokens):
    """`SSEForCausalLM.generate` greedy on the left-padded batch."""
    T = max(map(len, prompts))
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = torch.tensor(p), 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[:, T:].tolist()


def assert_matches_hf_greedy(ours, model, prompts, new_tokens):
    """vLLM's greedy completions (worker replies, one per prompt) are HF's greedy `generate` tokens."""
    for prompt, o, t in zip(prompts, ours, hf_greedy(model, prompts, new_tokens), strict=True):
        assert o["completions"][0]["token_ids"] == t, len(prompt)


@torch.no_grad()
def hf_logprobs(model, prompt, completion):
    """Log-probabilities the HF model gives each completion token (teacher forcing)."""
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def greedy(**extra):
    return {**dict(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0), **extra}


# ---------------------------------------------------------------------------------------------- tests
def test_plugin_turns_the_flashinfer_sampler_off_only_without_flashinfer():
    """vLLM 0.25's sampler imports flashinfer unless VLLM_USE_FLASHINFER_SAMPLER=0; the plugin sets that default
    where flashinfer is not installed, and never overrides a user's setting."""
    import importlib.util
    code = ("import os; from sse_model.vllm.plugin import register; register(); "
            "print(os.environ.get('VLLM_USE_FLASHINFER_SAMPLER'))")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_FLASHINFER_SAMPLER"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    missing = importlib.util.find_spec("flashinfer") is None
    assert out.stdout.strip().splitlines()[-1] == ("0" if missing else "None"), out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "VLLM_USE_FLASHINFER_SAMPLER": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "1", out.stderr[-2000:]


def test_model_inspection_needs_no_subprocess(tmp_path):
    """vLLM inspects a lazily registered model class in a fresh Python subprocess the first time on a machine (a
    Python start and a vLLM import in a fresh node's first engine start); the plugin registers the class itself, so
    with an empty vLLM cache the inspection runs in-process and says the model is a hybrid with inner state."""
    code = ("from vllm.model_executor.models import registry; from sse_model.vllm.plugin import register; "
            "register()\n"
            "def refuse(fn): raise AssertionError('model inspection started a subprocess')\n"
            "registry._run_in_subprocess = refuse\n"
            "info = registry.ModelRegistry.models['SSEForCausalLM'].inspect_model_cls()\n"
            "print(info.is_hybrid, info.has_inner_state)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "VLLM_CACHE_ROOT": str(tmp_path)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def engine_config(layer_types, max_num_seqs=1024, **cache):
    """The parts of a VllmConfig the engine-defaults hook reads: a 1B-class SSE-H (16 heads, n4k1 + shared)."""
    from types import SimpleNamespace
    config = SSEConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=len(layer_types),
                       layer_types=layer_types, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       sse_num_partitions=4, sse_top_k=1, sse_lora_rank=64)
    cache = {**dict(num_gpu_blocks_override=None, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9,
                    mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto"), **cache}
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=config, dtype=torch.bfloat16),
                           cache_config=SimpleNamespace(**cache),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs), additional_config={})


def no_runner_choice(monkeypatch):
    """VLLM_USE_V2_MODEL_RUNNER unset for the test and as it was after it, whatever the hook under test sets (a
    plain delenv of an unset variable records nothing to undo)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")


def test_engine_defaults_lower_max_num_seqs_to_the_sequences_whose_states_fit(monkeypatch):
    """vLLM refuses to start a hybrid whose max_num_seqs exceeds its state slots (full decode CUDA graphs); at its
    GPU default of 1024 a 1B-class SSE-H did not start (`python -m bench.rollouts`). The hook lowers it to
    what the cache holds: a sequence of a hybrid takes one block of states and at least one of attention."""
    from vllm.platforms import current_platform

    from sse_model.vllm import engine as hook
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda *_: True)
    monkeypatch.setattr(type(current_platform), "get_device_total_memory", lambda *_: 80 << 30)
    no_runner_choice(monkeypatch)
    layers = [S] * 5 + [A]
    state = hook.state_bytes_per_sequence(engine_config(layers * 4).model_config.hf_config, 1, torch.int16)
    assert state == 20 * 2 * 16 * 5 * (128 + 4) * 128  # int16 (a bf16 model's default), 20 SSE layers, 16 heads, 4
    # partitions + shared, each state's 128 rows and four rows of column scales and maxima

    vllm_config = engine_config(layers * 4)
    hook.verify_and_update_config(vllm_config)
    weights = hook.weight_bytes(vllm_config.model_config.hf_config, torch.bfloat16)
    budget = (80 << 30) * 0.9 * (1 - hook.RESERVED_FRACTION) - weights
    assert vllm_config.scheduler_config.max_num_seqs == int(budget) // state // 2 < 1024

    fits = engine_config(layers * 4, max_num_seqs=64)  # already fits: left alone
    hook.verify_and_update_config(fits)
    assert fits.scheduler_config.max_num_seqs == 64
    blocks = engine_config(layers * 4, num_gpu_blocks_override=10)  # two blocks per sequence
    hook.verify_and_update_config(blocks)
    assert blocks.scheduler_config.max_num_seqs == 5
    pure = engine_config([S] * 4, kv_cache_memory_bytes=100 * 4 * 2 * 16 * 5 * 132 * 128)  # one block each
    hook.verify_and_update_config(pure)
    assert pure.scheduler_config.max_num_seqs == 100
    transformer = engine_config([A] * 4)  # no states: vLLM's own default stands
    hook.verify_and_update_config(transformer)
    assert transformer.scheduler_config.max_num_seqs == 1024

    half = engine_config(layers * 4, mamba_ssm_cache_dtype="bfloat16")  # bfloat16 states: no scale rows
    hook.verify_and_update_config(half)
    assert half.scheduler_config.max_num_seqs == int(budget) // (state * 128 // 132) // 2
    f32 = engine_config(layers * 4, mamba_ssm_cache_dtype="float32")  # float32 states: about half the sequences
    hook.verify_and_update_config(f32)
    assert f32.scheduler_config.max_num_seqs == int(budget) // (state * 2 * 128 // 132) // 2

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda *_: False)
    cpu = engine_config(layers * 4, num_gpu_blocks_override=10)  # the CPU build runs no CUDA graphs
    hook.verify_and_update_config(cpu)
    assert cpu.scheduler_config.max_num_seqs == 1024


def test_engine_defaults_choose_vllms_v2_model_runner_on_a_gpu(monkeypatch):
    """On a GPU the hook asks vLLM for its V2 model runner (GPU-side input preparation; vLLM 0.25 gives hybrids V1
    unless told), the colocated GRPO engine (vLLM's external launcher) included, unless the user chose a runner;
    the CPU build is left alone."""
    from vllm.platforms import current_platform

    from sse_model.vllm import engine as hook
    monkeypatch.setattr(type(current_platform), "get_device_total_memory", lambda *_: 80 << 30)
    no_runner_choice(monkeypatch)
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda *_: False)
    hook.verify_and_update_config(engine_config([S, S, A]))
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda *_: True)
    colocated = engine_config([S, S, A])
    colocated.parallel_config.distributed_executor_backend = "external_launcher"
    hook.verify_and_update_config(colocated)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    hook.verify_and_update_config(engine_config([S, S, A]))
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


@pytest.mark.parametrize("ssm, cache, model, dtype", [
    ("auto", "auto", torch.bfloat16, torch.int16), ("auto", "auto", torch.float16, torch.int16),
    ("auto", "auto", torch.float32, torch.float32), ("bfloat16", "auto", torch.bfloat16, torch.bfloat16),
    ("auto", "bfloat16", torch.float32, torch.bfloat16), ("float32", "bfloat16", torch.bfloat16, torch.float32),
    ("float16", "auto", torch.bfloat16, None), ("auto", "fp8", torch.bfloat16, None)])
def test_state_dtype_follows_vllms_recurrent_state_knobs(ssm, cache, model, dtype):
    """"auto" (vLLM's default) lets the model choose: int16 fixed point for a 16-bit model, float32 for a float32
    one (whose outputs the CPU tests compare with the HF model's to 1e-4)."""
    from types import SimpleNamespace

    from sse_model.vllm.engine import state_dtype
    config = SimpleNamespace(mamba_ssm_cache_dtype=ssm, mamba_cache_dtype=cache)
    if dtype is None:
        with pytest.raises(ValueError, match="SSE states support mamba_ssm_cache_dtype"):
            state_dtype(config, model)
    else:
        assert state_dtype(config, model) == dtype


@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 0), (2, 1)])
def test_stacked_projection_shards_under_tensor_parallelism(monkeypatch, tp, rank):
    """`MergedColumnLinear` on one rank of tp: column-parallel parts hold the rank's rows, replicated parts (the SSE
    layer's narrow projections) all of theirs plus the zero padding to a multiple of 8, parts without a checkpoint
    bias a zero bias, and a block-diagonal stack each part's input slice. Parameters start NaN, so an element no
    loader writes fails. (Engines here run at tp = 1; the rank is faked where vLLM's layers read it.)"""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter
    from vllm.config import VllmConfig, set_current_vllm_config

    from sse_model.vllm import model as vllm_model
    for module in (linear, parameter, vllm_model):
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp)
    for module in (linear, parameter):
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)

    def loaded(layer, weights, biases):
        layer.weight.data.fill_(float("nan"))
        layer.bias.data.fill_(float("nan"))
        for shard, w in enumerate(weights):
            layer.weight.weight_loader(layer.weight, w, -1 if shard == len(weights) - 1 else shard)
        for shard, b in biases.items():
            layer.bias.weight_loader(layer.bias, b, shard)
        return layer.weight.data, layer.bias.data

    def mine(x):
        return x.chunk(tp)[rank]
    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        stacked = vllm_model.MergedColumnLinear(6, [8, 8, 3, 2], [True, True, False, False], replicated=2,
                                                prefix="in_proj")
        up = vllm_model.MergedColumnLinear(6, [4, 4], [True, False], input_sizes=[2, 4], prefix="low_rank_up")
    assert stacked.output_partition_sizes == [8 // tp, 8 // tp, 3, 5]
    w = [torch.randn(8, 6), torch.randn(8, 6), torch.randn(3, 6), torch.randn(2, 6)]
    b = {0: torch.randn(8), 1: torch.randn(8)}
    weight, bias = loaded(stacked, w, b)
    assert torch.equal(weight, torch.cat([mine(w[0]), mine(w[1]), w[2], w[3], torch.zeros(3, 6)]))
    assert torch.equal(bias, torch.cat([mine(b[0]), mine(b[1]), torch.zeros(8)]))
    w = [torch.randn(4, 2), torch.randn(4, 4)]
    b = {0: torch.randn(4)}
    weight, bias = loaded(up, w, b)
    assert torch.equal(weight, torch.cat([torch.cat([mine(w[0]), torch.zeros(4 // tp, 4)], 1),
                                          torch.cat([torch.zeros(4 // tp, 2), mine(w[1])], 1)]))
    assert torch.equal(bias, torch.cat([mine(b[0]), torch.zeros(4 // tp)]))


def test_plugin_entry_point_and_idempotent_registration(worker):
    from importlib.metadata import entry_points
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("sse_model") == "sse_model.vllm.plugin:register"
    assert worker("registry")


@pytest.mark.parametrize("layer_types,groups", [
    ([S, A, S, S], [[0, 2, 3]]),
    ([S] * 5 + [A] + [S] * 5 + [A], [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]),
    ([S] * 5 + [A] + [S] * 4 + [A], [[0, 1, 2, 3, 4], [6, 7, 8, 9]]),  # the last entry has an unused row
    ([S, S, S], [[0], [1], [2]]),
    ([A, A], []),
])
def test_state_groups_one_cache_entry_per_attention_layer(layer_types, groups):
    from sse_model.vllm.model import state_groups
    config = SSEConfig(**{**BASE, "layer_types": layer_types, "num_hidden_layers": len(layer_types)})
    assert state_groups(config) == groups


def test_a_hybrid_has_two_kv_cache_groups(worker):
    """vLLM's scheduler does bookkeeping per request and per cache group on every step: SSE-H gives it one
    group of attention layers and one of SSE state entries, whatever its depth."""
    groups = worker("cache_groups", worker.engine("n4k1"))
    assert groups == [["model.layers.1.self_attn.attn"], ["model.layers.0.linear_attn.states"]] or \
        groups == [["model.layers.0.linear_attn.states"], ["model.layers.1.self_attn.attn"]], groups


@pytest.fixture(scope="module")
def greedy_runs(worker, hf):
    """Per config: vLLM's greedy outputs for a batch of prompts of different lengths, and HF's."""
    runs = {}
    for name in ("n4k1", "n8k2_row_sparse", "gla", "transformer", "authors"):
        prompts = prompts_for(hf[name].config.vocab_size)
        ours = worker("generate", worker.engine(name), prompts, greedy())
        runs[name] = prompts, [o["completions"][0] for o in ours], hf_greedy(hf[name], prompts, NEW_TOKENS)
    return runs


@pytest.mark.parametrize("name", ["n4k1", "n8k2_row_sparse", "gla", "transformer", "authors"])
def test_greedy_matches_hf_generate(greedy_runs, name):
    prompts, ours, theirs = greedy_runs[name]
    for prompt, o, t in zip(prompts, ours, theirs):
        assert o["token_ids"] == t, (name, len(prompt))


@pytest.mark.parametrize("name", ["n4k1", "n8k2_row_sparse", "gla", "transformer", "authors"])
def test_logprobs_match_hf(greedy_runs, hf, name):
    prompts, ours, _ = greedy_runs[name]
    for prompt, o in zip(prompts, ours):
        theirs = hf_logprobs(hf[name], prompt, o["token_ids"])
        assert (torch.tensor(o["logprobs"]) - theirs).abs().max() < TOL, (name, len(prompt))


def test_chunked_prefill_and_mixed_batches_match_one_shot_prefill(greedy_runs, worker):
    """The n8k2 engine prefills at most 16 tokens per step (so prompts continue from their stored state) next to
    the decodes of other requests; its tokens matched HF's one-shot prefill above. Check those batches happened."""
    steps = worker("steps", "n8k2_row_sparse")
    assert any(decodes and prefills for decodes, prefills, *_ in steps), "no mixed prefill/decode batch"
    assert any(context > 0 for _, _, context, *_ in steps), "no prefill continued from a stored state"


@pytest.mark.parametrize("name", ["n4k1", "gla"])
def test_big_prefill_batches_run_in_groups_of_sequences(greedy_runs, worker, name):
    """The worker bounds a prefill group's states to 3 sequences of n4k1 (15 of gla): the batches of 6 prompts
    whose tokens matched HF's above ran as several groups (n4k1) or as one (gla)."""
    steps = worker("steps", name)
    group = steps[0][3]
    assert group == {"n4k1": 3, "gla": 15}[name]
    assert max(prefills for _, prefills, *_ in steps) == len(PROMPT_LENGTHS) - 1  # a 1-token prompt is a decode


def test_preemption_and_recompute_leave_no_stale_state(worker, hf):
    """Generations longer than the tiny cache allows: requests are preempted and recomputed, their slots reused.
    The engine runs with prefix caching off, as vLLM runs a hybrid on a GPU, so the scheduler's SSEStatesManager
    answers running requests by its fast path, as does SSEAttentionManager: each of those answers is checked against
    vLLM's MambaManager or FullAttentionManager. SSEAttentionManager holds vLLM's own FullAttentionSpec: vLLM 0.25
    marks new blocks for zeroing by the spec's exact type (tests/test_vllm_seams.py checks that there)."""
    name = worker.engine("n8k2_row_sparse")
    managers = worker("check_cache_managers", name)
    assert sorted(managers) == [("SSEAttentionManager", None, "FullAttentionSpec"),
                                ("SSEStatesManager", "none", "SSEStatesSpec")], managers
    prompts = prompts_for(hf[name].config.vocab_size, lengths=(3, 40, 17, 120, 64, 1, 33, 80), seed=1)
    ours = worker("generate", name, prompts, greedy(max_tokens=380))
    assert worker("preemptions", name) > 0
    assert_matches_hf_greedy(ours, hf[name], prompts, 380)
    checks = worker("cache_manager_checks", name)
    assert checks["fast"] > 1000 and checks["disagreed"] == 0, checks
    assert checks["attention_fast"] > 500 and checks["attention_disagreed"] == 0, checks


def test_sampling_n8_requests_never_share_state(worker, hf):
    """16 sampled completions at once (2 prompts x n=8): each one's logprobs are what HF gives that completion
    alone, which fails if any request read or wrote another's state."""
    name = worker.engine("n4k1")
    prompts = prompts_for(hf[name].config.vocab_size, lengths=(9, 30), seed=2)
    outs = worker("generate", name, prompts, dict(n=8, temperature=1.0, max_tokens=48, seed=7, logprobs=0))
    for prompt, out in zip(prompts, outs):
        completions = out["completions"]
        assert len(completions) == 8
        assert len({tuple(c["token_ids"]) for c in completions}) > 1, "n=8 samples are all identical"
        for c in completions:
            theirs = hf_logprobs(hf[name], prompt, c["token_ids"])
            assert (torch.tensor(c["logprobs"]) - theirs).abs().max() < TOL


def test_seeded_sampling_is_the_same_however_the_prefill_is_split(worker, hf):
    """The n8k2 engine prefills 16 tokens per step and discards what it samples for a split prefill; vLLM then
    rewinds the seeded request's generator (CUDA generators only: sse_model.vllm.seams restores CPU ones). A
    40-token prompt alone is split 16 + 16 + 8; behind a 30-token prompt, 2 + 15 + 15 + 8. Same seed, same tokens."""
    name = worker.engine("n8k2_row_sparse")
    first, prompt, last = prompts_for(hf[name].config.vocab_size, lengths=(30, 40, 21), seed=4)
    sampling = dict(temperature=1.0, max_tokens=24, ignore_eos=True, seed=11, logprobs=0)
    alone = worker("generate", name, [prompt], sampling)[0]["completions"][0]
    crowded = worker("generate", name, [first, prompt, last], sampling)[1]["completions"][0]
    assert crowded["token_ids"] == alone["token_ids"]
    assert (torch.tensor(alone["logprobs"]) - hf_logprobs(hf[name], prompt, alone["token_ids"])).abs().max() < TOL


def test_int16_states_of_a_bf16_engine_follow_float32_states(worker, hf):
    """A bf16 engine's default states are int16 fixed point (on the GPU the parity module checks them against the
    HF model): the same engine with float32 states gives the same greedy tokens, with logprobs within bf16's
    rounding, up to where a near-tie goes the other way (a random tiny model has many: its logits differ by a few
    hundredths). Wrong scales or rows would move logprobs by whole nats and never stop at a tie."""
    int16, f32 = worker.engine("n4k1_bf16"), worker.engine("n4k1_bf16_f32_states")
    assert set(worker("state_dtypes", int16)) == {"torch.int16"}
    assert set(worker("state_dtypes", f32)) == {"torch.float32"}
    prompts = prompts_for(hf["n4k1"].config.vocab_size)
    agreed, diffs, gaps = 0, [], []
    for ours, theirs in zip(*(worker("generate", engine, prompts, greedy(logprobs=5)) for engine in (int16, f32))):
        a, b = ours["completions"][0], theirs["completions"][0]
        same = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), NEW_TOKENS)
        agreed += same
        diffs.append((torch.tensor(a["logprobs"][:same]) - torch.tensor(b["logprobs"][:same])).abs())
        if same < NEW_TOKENS:  # how far apart the float32-state engine put the two choices
            top = b["top"][same]
            gaps.append(top[b["token_ids"][same]] - top.get(a["token_ids"][same], float("-inf")))
    diffs = torch.cat(diffs)
    print(f"agreed {agreed} of {NEW_TOKENS * len(prompts)} tokens; |delta logprob| max {diffs.max():.1e}, "
          f"mean {diffs.mean():.1e}; gaps at divergences {gaps}")
    assert diffs.max() < 0.1 and diffs.mean() < 0.01 and all(gap < 0.1 for gap in gaps)  # here: 0.037, 0.0037,
    # and gaps of 0-1/128


def test_new_request_starts_from_zero_state(worker, hf):
    """Every slot filled with noise (stale states of earlier requests): new requests still match HF."""
    name = worker.engine("n4k1")
    prompts = prompts_for(hf[name].config.vocab_size, seed=3)
    worker("poison", name)
    ours = worker("generate", name, prompts, greedy())
    assert_matches_hf_greedy(ours, hf[name], prompts, NEW_TOKENS)


def test_a_prefill_group_reads_the_states_of_continued_prompts_only(worker, hf):
    """Every slot poisoned, a prompt cached, then one step prefills it again (a prefix-cache hit: it continues
    from the cached state) beside two new prompts, in one group of 3 sequences: the group reads the continued
    prompt's state and not the new ones' slots, which hold noise or the first request's state. All match HF."""
    name = worker.engine("n4k1")
    shared, a, b = prompts_for(hf[name].config.vocab_size, lengths=(530, 12, 33), seed=6)
    worker("poison", name)
    worker("generate", name, [shared + [5, 6, 7]], greedy(max_tokens=4))
    before = len(worker("steps", name))
    prompts = [shared + [8, 9], a, b]
    ours = worker("generate", name, prompts, greedy(max_tokens=16))
    assert ours[0]["num_cached_tokens"] > 0, "expected a prefix-cache hit"
    assert any(context > 0 and fresh == 2 for _, _, context, _, fresh in worker("steps", name)[before:]), \
        "no step prefilled the continued prompt beside the new ones"
    assert_matches_hf_greedy(ours, hf[name], prompts, 16)


def test_prefix_cache_hit_continues_from_cached_state(worker, hf):
    name = worker.engine("n4k1")
    # hits come in whole blocks, and a hybrid's attention block holds an SSE state entry (512 tokens here)
    shared, = prompts_for(hf[name].config.vocab_size, lengths=(530,), seed=4)
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    first = worker("generate", name, prompts[:1], greedy(max_tokens=16))
    second = worker("generate", name, prompts[1:], greedy(max_tokens=16))
    assert second[0]["num_cached_tokens"] > 0, "expected a prefix-cache hit"
    assert_matches_hf_greedy(first + second, hf[name], prompts, 16)


GROUPS = {
    "embeddings": lambda n: n == "model.embed_tokens.weight",
    "lm_head": lambda n: n == "lm_head.weight",
    "sse_projections": lambda n: ".linear_attn." in n and ".router." not in n,
    "router": lambda n: ".linear_attn.router." in n,
    "attention": lambda n: ".self_attn." in n,
    "mlp": lambda n: ".mlp." in n,
    "norms": lambda n: "norm" in n and ".linear_attn." not in n and ".self_attn." not in n,
    "all": lambda n: True,
}


def perturb_and_push(worker, model, name, group, probe, seed):
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    chosen = [n for n in params if GROUPS[group](n)]
    assert chosen, group
    with torch.no_grad():
        for n in chosen:
            params[n].add_(torch.randn(params[n].shape, generator=g) * 0.05)
    blob = save_tensors({n: p.detach().contiguous() for n, p in params.items()})
    return worker("push", name, blob, probe)


@pytest.mark.parametrize("group", list(GROUPS))
def test_push_weights_reloads_every_group(worker, hf, group):
    """Change one group of weights in the HF model and push the full set: vLLM's scores move (the stale engine
    disagrees with the new HF model) and then agree with the HF model again."""
    name = worker.engine("n4k1")
    probe, = prompts_for(hf[name].config.vocab_size, lengths=(48,), seed=5)
    stale, fresh = perturb_and_push(worker, hf[name], name, group, probe, seed=len(group))
    assert stale > 100 * TOL, f"{group}: the change did not move the scores ({stale})"
    assert fresh < TOL, f"{group}: vLLM disagrees with HF after the push ({fresh})"
    if group == "all":
        prompts = prompts_for(hf[name].config.vocab_size, seed=6)
        ours = worker("generate", name, prompts, greedy())
        assert_matches_hf_greedy(ours, hf[name], prompts, NEW_TOKENS)


@pytest.mark.parametrize("name", ["n8k2_row_sparse", "gla"])
def test_push_weights_into_stacked_projections_with_parts_lacking_a_bias(worker, hf, name):
    """n8k2: q/k/v with biases stacked with an output gate without one; gla: no shared partition, so the
    low-rank up-projection is the decay's alone. Reloaded parameters start as NaN (the worker), so every element
    of the stacked weights and biases must be written by the push."""
    name = worker.engine(name)
    probe, = prompts_for(hf[name].config.vocab_size, lengths=(48,), seed=5)
    stale, fresh = perturb_and_push(worker, hf[name], name, "sse_projections", probe, seed=2)
    assert stale > 100 * TOL and fresh < TOL


def test_push_weights_with_tied_embeddings(worker, hf):
    name = worker.engine("gla")
    probe, = prompts_for(hf[name].config.vocab_size, lengths=(48,), seed=5)
    stale, fresh = perturb_and_push(worker, hf[name], name, "embeddings", probe, seed=1)
    assert stale > 100 * TOL and fresh < TOL


def test_push_weights_refuses_partial_unknown_or_misshapen_sets(worker, hf):
    name = worker.engine("n4k1")
    params = {n: p.detach().contiguous() for n, p in hf[name].named_parameters()}
    probe = [1, 2, 3]
    partial = dict(params)
    partial.pop("lm_head.weight")
    with pytest.raises(RuntimeError, match="missing.*lm_head.weight"):
        worker("push", name, save_tensors(partial), probe)
    with pytest.raises(RuntimeError, match="unknown.*model.bogus"):
        worker("push", name, save_tensors({**params, "model.bogus": torch.zeros(1)}), probe)
    with pytest.raises(RuntimeError, match="wrong shape.*lm_head.weight"):
        worker("push", name, save_tensors({**params, "lm_head.weight": params["lm_head.weight"][:-1]}), probe)
    assert worker("parity", name, probe) < TOL  # nothing was loaded


def test_plain_load_weights_on_a_serving_engine_fails_loudly(worker):
    """TRL's default sync (model.load_weights one tensor at a time) would leave the CPU build's packed lm_head
    stale without an error; the model refuses it instead."""
    name = worker.engine("n4k1")
    with pytest.raises(RuntimeError, match="push_weights"):
        worker("direct_load", name, "lm_head.weight")


@pytest.mark.parametrize("field,config", [
    ("layer_types", dict(layer_types=[S, "mamba2", S])),
    ("head_dim", dict(head_dim=16, num_attention_heads=4)),
])
def test_unservable_checkpoint_fails_at_load_naming_the_field(worker, checkpoints, tmp_path, field, config):
    """A bad config.json stops `vllm.LLM(model=...)` while the config loads, with SSEConfig's message."""
    path = tmp_path / "bad"
    path.mkdir()
    for f in checkpoints["n8k2_row_sparse"].iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    spec = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**spec, **config}))
    with pytest.raises(RuntimeError, match=f"SSEConfig.{field}"):
        worker("start", "bad", str(path), ENGINES["gla"])


def test_head_dim_the_platform_cannot_run_is_refused_naming_the_field(worker):
    """SSEConfig admits only head sizes every platform runs; the model also asks this platform's backend."""
    name = worker.engine("transformer")
    worker("servable", name, {})
    with pytest.raises(RuntimeError, match="SSEConfig.head_dim: 48 is not a head size of this platform"):
        worker("servable", name, {"head_dim": 48})


def test_triton_decode_kernel_inside_the_vllm_model(tmp_path_factory):
    """Decode through `kernels.sse_decode(..., impl="triton")` in the vLLM model, the Triton kernel interpreted
    on CPU (TRITON_INTERPRET=1, set before triton is imported, hence its own worker)."""
    root = tmp_path_factory.mktemp("triton")
    path = make_checkpoint(root, "triton")
    model = SSEForCausalLM.from_pretrained(path).eval()
    prompts = prompts_for(model.config.vocab_size, lengths=(4, 11))
    w = Worker(root / "worker.log", env={"TRITON_INTERPRET": "1"})
    try:
        contiguous = w("start", "triton", str(path), dict(COMMON, enforce_eager=True,
                                                           hf_overrides={"sse_decode_impl": "triton"}), timeout=600)
        assert contiguous == [False], "expected the padded (strided) state view of a hybrid"
        ours = w("generate", "triton", prompts, greedy(max_tokens=8), timeout=600)
    finally:
        w.close()
    assert_matches_hf_greedy(ours, model, prompts, 8)


def test_vllm_serve_answers_an_openai_completion(server):
    proc, port, log = server
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while True:
        assert proc.poll() is None, f"vllm serve exited:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert time.time() < deadline, f"vllm serve not ready after 240 s:\n{log.read_text()[-4000:]}"
        time.sleep(1)
    body = json.dumps(dict(model="sse", prompt="The quick brown fox", max_tokens=8, temperature=0)).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        answer = json.load(r)
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 8


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))


# ---------------------------------------------------------------------------------------------- partition replay
@torch.no_grad()
def teacher_forced(model, prompt, completion, routes=None):
    """(log-probabilities of the completion's tokens, the model's own top-K [T, SSE layers, K]) over prompt +
    completion, with `routes` [T, SSE layers, K] replayed when given."""
    ids = torch.tensor([prompt + completion])
    out = model(ids, partition_routes=None if routes is None else routes[None])
    logp = torch.log_softmax(out.logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0], out.partition_choices[:, 0].permute(1, 0, 2)


def test_partition_replay_follows_the_engines_routes(worker, hf):
    """The engine records every token's partitions per request; a trainer whose router ties break otherwise (a
    perturbation of 1e-5) routes differently and scores the sampled tokens differently, unless it replays the
    engine's routes: then its log-probabilities are the engine's within float32 rounding."""
    trainer = copy.deepcopy(hf["routes"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in trainer.model.layers:
            if layer.layer_type == SSE_LAYER:
                router = layer.linear_attn.router.weight
                router[1] += 1e-5 * torch.randn(router.shape[1], generator=g)
    prompts = prompts_for(trainer.config.vocab_size, lengths=(3, 20, 45), seed=1)
    outs = worker("generate", worker.engine("routes"), prompts,
                  dict(temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0, seed=3), True)
    flips, worst_without, worst_with = 0, 0.0, 0.0
    for prompt, out in zip(prompts, outs):
        completion = out["completions"][0]
        tokens = len(prompt) + len(completion["token_ids"])
        routes = torch.tensor(out["routes"])
        # every token the engine computed (all but the completion's last), for both SSE layers
        assert routes.shape == (tokens - 1, 2, 1) and (routes >= 0).all()
        routes = torch.cat([routes, torch.full((1, 2, 1), -1)])
        engine = torch.tensor(completion["logprobs"])
        own, choices = teacher_forced(trainer, prompt, completion["token_ids"])
        flips += int((choices[:-1] != routes[:-1]).sum())
        worst_without = max(worst_without, float((own - engine).abs().max()))
        replayed, _ = teacher_forced(trainer, prompt, completion["token_ids"], routes)
        worst_with = max(worst_with, float((replayed - engine).abs().max()))
    assert flips > 0 and worst_without > 1e-2, (flips, worst_without)
    assert worst_with < TOL, worst_with
