"""The vLLM backend on a GPU (issue 13): the default engine starts, and rollouts are exact enough to train on.

Run on a GPU node with vLLM installed (docs/vllm-backend.md, "On a GPU"):

    python -m pytest -m gpu tests/test_vllm_gpu.py -s

The checkpoint is trained here for a few hundred steps on the embedded default's arithmetic (a random model's
near-uniform distributions would hide mismatches), saved in bf16, and served by vLLM with its defaults
(engine-core process, torch.compile, full CUDA graphs for decode batches, chunked prefill). The reference is the
HF model in bf16 on the same GPU, chunked Triton path. Measured values go to bench/runs/vllm_gpu_parity_*.json.
"""
import json
import math
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]
RESULTS: dict = {}
PROMPTS = 8        # prompts per check; lengths spread from a few tokens to a few hundred
MAX_KL = 0.005     # issue 13: mean per-token KL(vLLM sampler || trainer) on sampled rollouts
# Two greedy choices this close are a tie in bf16: logits of magnitude 8-16 are 1/16 apart, and the first runs'
# gaps at divergences were 0, 1/16 and 2/16 (a state bug gives gaps of whole nats).
NEAR_TIE = 0.25

@pytest.fixture(scope="module", autouse=True)
def _one_config(one_triton_config):
    """Every check here runs fla with one config per kernel (tests/conftest.py)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """SSE-H (6 layers of 512, attention at 2 and 5, heads of 128, n4k1 + shared) trained on generated
    arithmetic for 300 steps, saved in bf16 with its tokenizer."""
    from sse_model import SSEConfig, SSEForCausalLM
    from tasks.generator import generate
    from tasks.tokenizer import train_tokenizer

    rows = generate(6000, levels=(1, 2, 3), seed=0)
    texts = [f"{r['problem']}\n{r['solution']}" for r in rows]
    tokenizer = train_tokenizer(texts, vocab_size=384)
    ids = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    T = 512
    data = torch.tensor(ids[: len(ids) // T * T]).view(-1, T).cuda()
    config = SSEConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                       layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=128, attention_qk_norm=True,
                       sse_num_partitions=4, sse_top_k=1, sse_lora_rank=32, max_position_embeddings=4096,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id,
                       sse_impl="chunk_torch_varlen")  # trained without Triton compilation; saved with "auto"
    torch.manual_seed(0)
    model = SSEForCausalLM(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(300):
        batch = data[torch.randint(0, data.shape[0], (16,), device="cuda", generator=g)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    RESULTS["train_loss_last_step"] = float(loss.detach())
    path = tmp_path_factory.mktemp("trained")
    model.config.sse_impl = "auto"
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    held_out = generate(PROMPTS * 4, levels=(1, 2, 3), seed=1, split="test")
    joined = tokenizer("\n".join(f"{r['problem']}\n{r['solution']}" for r in held_out))["input_ids"]
    # from 3 tokens (a problem's start) to a few hundred (several problems and solutions of context)
    lengths = [3, 9, 24, 57, 100, 180, 290, 420]
    return path, [joined[i * 50: i * 50 + n] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def hf(checkpoint):
    from sse_model import SSEForCausalLM
    return SSEForCausalLM.from_pretrained(checkpoint[0], dtype=torch.bfloat16).cuda().eval()


@pytest.fixture(scope="module")
def master(checkpoint):
    """The checkpoint with float32 weights: a float32-master trainer under bf16 autocast, a float32 model without."""
    from sse_model import SSEForCausalLM
    return SSEForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32).cuda().eval()


@pytest.fixture(scope="module")
def engine(checkpoint):
    """vLLM with its defaults, the way a user starts it."""
    from vllm import LLM
    started = time.perf_counter()
    llm = LLM(model=str(checkpoint[0]), gpu_memory_utilization=0.35, seed=0)
    RESULTS["default_engine_start_s"] = time.perf_counter() - started
    vllm_config = llm.llm_engine.vllm_config
    RESULTS["cudagraph_mode"] = str(vllm_config.compilation_config.cudagraph_mode)
    RESULTS["model_runner"] = "V2" if vllm_config.use_v2_model_runner else "V1"
    from sse_model.vllm.engine import state_dtype
    RESULTS["default_state_dtype"] = str(state_dtype(vllm_config.cache_config, vllm_config.model_config.dtype))
    yield llm
    del llm


@pytest.fixture(scope="module")
def small_steps_engine(checkpoint, engine):
    """Chunked prefill in 32-token steps next to decodes, and a cache of 10 blocks. A hybrid request holds one
    block of SSE states plus its attention blocks, so at most 5 run at once (the plugin lowers max_num_seqs to that)
    and each needs a third block once it generates past its first attention block: requests are preempted and
    recomputed."""
    from vllm import LLM
    block = engine.llm_engine.vllm_config.cache_config.block_size
    longest = max(map(len, checkpoint[1]))
    llm = LLM(model=str(checkpoint[0]), gpu_memory_utilization=0.35, seed=0, max_num_batched_tokens=32,
              max_num_seqs=8, enable_chunked_prefill=True, num_gpu_blocks_override=10, enable_prefix_caching=False,
              max_model_len=longest + block + 1, disable_log_stats=False)
    yield llm, block
    del llm


def hf_logprobs(hf, sequences):
    """log p(token | tokens before) from the HF model, one sequence at a time (no padding involved)."""
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], device="cuda")
            logits = hf(ids).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu())
    return out


def greedy(llm, prompts, new_tokens=64, **extra):
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0, prompt_logprobs=0, **extra)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def vllm_logprobs(output):
    """Logprobs vLLM gave to every prompt token after the first and to every generated token."""
    prompt = [lp[t].logprob for lp, t in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])]
    completion = output.outputs[0]
    generated = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
    return torch.tensor(prompt + generated)


def save_results():
    out = REPO / "bench" / "runs"  # raw runs, gitignored (bench/README.md)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    RESULTS.update(date=now.isoformat(timespec="seconds"), device=torch.cuda.get_device_name())
    import vllm
    RESULTS["vllm"] = vllm.__version__
    (out / f"vllm_gpu_parity_{now:%Y%m%d}.json").write_text(json.dumps(RESULTS, indent=2) + "\n")


def test_default_engine_starts_with_full_decode_graphs(engine):
    assert "FULL" in RESULTS["cudagraph_mode"], RESULTS["cudagraph_mode"]
    assert RESULTS["model_runner"] == ("V1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "V2")
    save_results()


def largest(values: list[torch.Tensor], where: list[tuple[int, int]]) -> dict:
    """The five largest of the per-token `values` and where they are ((sequence, position in it), `where` lists
    them in order): a mean or a max carried by a few tokens shows as such."""
    top = torch.cat(values).topk(min(5, sum(v.numel() for v in values)))
    return dict(largest=top.values.tolist(), largest_at=[where[i] for i in top.indices.tolist()])


def greedy_logprob_diffs(llm, hf, prompts) -> tuple[dict, list[list[int]]]:
    """|logprob vLLM - logprob HF| over the prompt tokens and greedy continuations of `prompts`: the summary and the
    sequences (prompt + continuation) it was taken on."""
    outs = greedy(llm, prompts)
    sequences = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outs]
    diffs, where = [], []
    for i, (out, ref) in enumerate(zip(outs, hf_logprobs(hf, sequences))):
        ours = vllm_logprobs(out)
        assert torch.isfinite(ours).all()
        diffs.append((ours - ref).abs())
        where += [(i, j + 1) for j in range(len(ours))]  # the first token has no logprob
    d = torch.cat(diffs)
    return dict(mean=float(d.mean()), p99=float(d.quantile(0.99)), max=float(d.max()), tokens=d.numel(),
                **largest(diffs, where)), sequences


def sampled_kl(llm, hf, prompts) -> tuple[dict, list[list[int]]]:
    """KL(vLLM || HF) per token on tokens vLLM sampled at temperature 1, 8 rollouts per prompt: the k3
    estimator r - 1 - log r with r = p_HF / p_vLLM (unbiased, never negative), as RL frameworks log it. Returns
    the summary, whose `largest_at` gives (rollout, position in it) of the largest values, and the rollouts."""
    from vllm import SamplingParams
    params = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=128, logprobs=0, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sequences, sampled = [], []
    for out in outs:
        for c in out.outputs:
            sequences.append(out.prompt_token_ids + list(c.token_ids))
            sampled.append((len(out.prompt_token_ids), torch.tensor([lp[t].logprob
                                                                     for lp, t in zip(c.logprobs, c.token_ids)])))
    kls, where = [], []
    for i, ((n_prompt, ours), ref) in enumerate(zip(sampled, hf_logprobs(hf, sequences))):
        log_r = ref[n_prompt - 1:] - ours
        kls.append(log_r.exp() - 1 - log_r)
        where += [(i, n_prompt + j) for j in range(len(ours))]
    k = torch.cat(kls)
    return dict(mean=float(k.mean()), p99=float(k.quantile(0.99)), **largest(kls, where), tokens=k.numel(),
                bar=MAX_KL), sequences


def tokens_since(flags: torch.Tensor, position: int) -> int | None:
    """How far before `position` the last set flag of `flags` [position] is (None when none is set)."""
    set_at = flags.nonzero()
    return position - int(set_at[-1]) if len(set_at) else None


def route_record(reference, hf, sequences, largest_at) -> dict:
    """Routes that `reference` and the bf16 `hf` choose differently on `sequences` (top-1 choices close enough for
    the arithmetic's precision to flip them, so also liable to flip between two bf16 engines): their share of
    (SSE layer, token) pairs, how many (over SSE layers and earlier tokens, which the state carries) precede each
    of the largest values at `largest_at`, and how many tokens back the nearest is."""
    from sse_model.diagnostics import routed_partitions
    flipped = [(routed_partitions(reference, seq) != routed_partitions(hf, seq)).any(-1) for seq in sequences]
    return dict(routes_differing_from_bf16_trainer=float(torch.cat([f.flatten() for f in flipped]).float().mean()),
                differing_routes_before_largest=[int(flipped[i][:, :position].sum()) for i, position in largest_at],
                tokens_since_differing_route_before_largest=[tokens_since(flipped[i][:, :position].any(0), position)
                                                             for i, position in largest_at])


def divergence(engine, prompt, ta, tb) -> tuple[int, float | None]:
    """How many tokens two greedy continuations of `prompt` share, and at the first difference the gap between
    `engine`'s logprobs of the two choices (None when they never differ)."""
    from vllm import SamplingParams
    same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
    if same == len(ta):
        return same, None
    probe = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    top = engine.generate([{"prompt_token_ids": list(prompt) + ta[:same]}], probe,
                          use_tqdm=False)[0].outputs[0].logprobs[0]
    other = top[tb[same]].logprob if tb[same] in top else float("-inf")
    return same, top[ta[same]].logprob - other


def test_greedy_and_prompt_logprobs_match_hf(engine, hf, master, checkpoint):
    """The bulk of the tokens must agree: mean and 99th percentile. The max is recorded, not bounded: over the runs
    of 2026-11-27, each on a freshly trained checkpoint, it ranged from 0.09 to 1.32 nats on one token of ~1,400
    while the mean stayed at 0.002-0.004, a heavy tail whose cause is not settled (a top-1 route flipped by bf16
    rounding is the candidate, so the largest values are recorded with the routes a float32 model takes
    differently from the bf16 one before them). A state or kernel bug moves many tokens, which these bars catch."""
    d, sequences = greedy_logprob_diffs(engine, hf, checkpoint[1])
    RESULTS["greedy_logprob_abs_diff"] = d = d | route_record(master, hf, sequences, d["largest_at"])
    save_results()
    assert d["mean"] < 0.02 and d["p99"] < 0.15, d  # the runs: mean 0.002-0.004, p99 0.04-0.05


def test_sampled_rollouts_kl_between_sampler_and_trainer(engine, hf, checkpoint):
    RESULTS["sampled_kl"] = k = sampled_kl(engine, hf, checkpoint[1])[0]
    save_results()
    assert math.isfinite(k["mean"]) and k["mean"] < MAX_KL, k


def test_sampled_kl_against_a_float32_master_trainer(engine, hf, master, checkpoint):
    """model.fp32_master_weights: the trainer keeps float32 weights and computes under bf16 autocast, the engine
    serves the bf16 weights; the same KL bar on the same rollouts. Recorded beside it, to explain a KL carried by a
    few tokens: how often this trainer routes a token elsewhere than the bf16 one, and how many such routes (over
    SSE layers and earlier tokens, which the state carries) precede each of the largest-KL tokens, and how many
    tokens back the nearest of them is."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        k, rollouts = sampled_kl(engine, master, checkpoint[1])
        k |= route_record(master, hf, rollouts, k["largest_at"])
    RESULTS["fp32_master_sampled_kl"] = k
    save_results()
    assert math.isfinite(k["mean"]) and k["mean"] < MAX_KL, k


def test_default_states_are_int16_for_a_bf16_model(engine):
    """vLLM's "auto" state dtype: a bf16 model's SSE states are int16 fixed point (sse_model/vllm/engine.py),
    so the parity checks above ran on them."""
    assert RESULTS["default_state_dtype"] == "torch.int16", RESULTS["default_state_dtype"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_states_of_the_dtype_asked_for(engine, checkpoint, hf, dtype):
    """SSE states stored as asked (vLLM's `mamba_ssm_cache_dtype`; updates stay float32, one rounding per step):
    the same parity checks as the default engine's int16 states, side by side. The greedy logprobs must move off
    the default engine's (the setting reached the states) while staying within the bars."""
    from vllm import LLM
    llm = LLM(model=str(checkpoint[0]), gpu_memory_utilization=0.2, seed=0, mamba_ssm_cache_dtype=dtype)
    moved = max(float((vllm_logprobs(a) - vllm_logprobs(b)).abs().max())
                for a, b in zip(greedy(llm, checkpoint[1]), greedy(engine, checkpoint[1])))
    RESULTS[f"{dtype}_states"] = r = dict(greedy_logprob_abs_diff=greedy_logprob_diffs(llm, hf, checkpoint[1])[0],
                                          sampled_kl=sampled_kl(llm, hf, checkpoint[1])[0],
                                          max_moved_vs_default=moved)
    save_results()
    del llm
    k, d = r["sampled_kl"], r["greedy_logprob_abs_diff"]
    assert moved > 0, f"{dtype} states gave the default engine's logprobs exactly: the setting did not apply"
    assert math.isfinite(k["mean"]) and k["mean"] < MAX_KL and d["mean"] < 0.02, r


def test_identical_requests_never_share_state(engine, checkpoint):
    """Eight greedy requests for one prompt in one batch are eight copies of one rollout, and that rollout is the
    single request's up to a bf16 near-tie: batch 8 runs other GEMM and graph sizes than batch 1, so the sums
    can round differently, but a shared or stale state gives a continuation the model did not nearly choose.
    (Sampled n = 8 rollouts are covered by the KL test: a shared state would put them far from the HF model.)"""
    prompt = checkpoint[1][4]
    single = list(greedy(engine, [prompt])[0].outputs[0].token_ids)
    eight = [list(o.outputs[0].token_ids) for o in greedy(engine, [prompt] * 8)]
    assert all(e == eight[0] for e in eight), "identical requests in one batch diverged from each other"
    agreed, gap = divergence(engine, prompt, single, eight[0])
    RESULTS["identical_requests"] = dict(agreed_tokens=agreed, new_tokens=len(single), tie_gap=gap)
    save_results()
    assert gap is None or gap <= NEAR_TIE, RESULTS["identical_requests"]


def test_chunked_prefill_mixed_batches_and_preemption_match_one_shot(engine, small_steps_engine, checkpoint):
    """The same greedy batch through 32-token prefill chunks mixed with decodes and a cache so small that requests
    are preempted and recomputed gives the one-shot engine's logprobs. bf16 sums in another order can flip a
    greedy near-tie, after which the continuations differ: tokens are compared up to the first difference, and
    there the two engines' choices must have been a near-tie (a state bug gives large logprob gaps instead)."""
    small, block = small_steps_engine
    # past end-of-text too: the trained model stops after an answer, and only sequences that outgrow their first
    # attention block make the small cache preempt
    one_shot = greedy(engine, checkpoint[1], new_tokens=block, ignore_eos=True)
    chunked = greedy(small, checkpoint[1], new_tokens=block, ignore_eos=True)
    preempted = sum(getattr(m, "value", 0) for m in small.llm_engine.get_metrics() if m.name == "vllm:num_preemptions")
    diffs, agreed, tie_gaps = [], [], []
    for a, b in zip(one_shot, chunked):
        ta, tb = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        same, gap = divergence(engine, a.prompt_token_ids, ta, tb)
        n = len(a.prompt_token_ids) - 1 + same  # prompt logprobs and the agreed generated tokens
        diffs.append((vllm_logprobs(a)[:n] - vllm_logprobs(b)[:n]).abs())
        agreed.append(same)
        if gap is not None:
            tie_gaps.append(gap)
    d = torch.cat(diffs)
    RESULTS["small_steps_vs_one_shot"] = dict(mean=float(d.mean()), max=float(d.max()), agreed_tokens=agreed,
                                             tie_gaps=tie_gaps, new_tokens=block, preemptions=preempted,
                                             cache_blocks=small.llm_engine.vllm_config.cache_config.num_gpu_blocks,
                                             block_size=block)
    save_results()
    assert float(d.mean()) < 0.02 and all(gap <= NEAR_TIE for gap in tie_gaps), RESULTS["small_steps_vs_one_shot"]
    assert preempted > 0, "the small cache did not preempt any request; the check would prove nothing"


def test_sleeping_engine_frees_its_memory_and_wakes_with_the_pushed_weights(checkpoint, hf, monkeypatch):
    """GRPO's colocated engine with `grpo.vllm.enable_sleep_mode` (level 2): asleep, it gives back its weights and
    its KV / SSE-state cache; woken, it takes the trainer's weights through the pipeline's push and samples what it
    sampled before it slept (a state slot read from the woken pool without zeroing, or a weight the push missed,
    would change the greedy rollouts), and the parity probe passes."""
    from vllm import LLM

    from sse_model.vllm.sync import logprob_parity, push_weights

    # in this process, as GRPO's engine (vLLM's external launcher): the push hands vLLM's loader the tensors
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(model=str(checkpoint[0]), gpu_memory_utilization=0.3, seed=0, enable_sleep_mode=True)
    before = greedy(llm, checkpoint[1])
    free_awake = torch.cuda.mem_get_info()[0]
    llm.sleep(level=2)
    freed = torch.cuda.mem_get_info()[0] - free_awake
    llm.wake_up()
    push_weights(llm, hf.named_parameters())
    after = greedy(llm, checkpoint[1])
    drift = logprob_parity(llm, hf, checkpoint[1][-1])
    total = torch.cuda.get_device_properties(0).total_memory
    RESULTS["sleep_mode"] = dict(freed_gib=freed / 2**30, engine_share_gib=0.3 * total / 2**30, parity=drift)
    save_results()
    del llm
    assert freed > 0.5 * 0.3 * total, RESULTS["sleep_mode"]  # the cache and weights, most of the engine's share
    assert [list(o.outputs[0].token_ids) for o in after] == [list(o.outputs[0].token_ids) for o in before]
    assert drift < 0.5, RESULTS["sleep_mode"]


# Issue 74 item 5: an engine for the recipe's width, started as a new user starts one: a fresh script, vLLM's
# default multiprocess engine, CUDA graphs and torch.compile. A cold start of this shape takes a minute or two.
START_LIMIT_S = float(os.environ.get("ENGINE_START_LIMIT_S", 420))
START_SCRIPT = """
import sys

import torch


def main(kind, path):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eval.engine import reporting_slow_start

    torch.set_default_dtype(torch.bfloat16)
    shape = dict(hidden_size=1536, intermediate_size=4608, num_attention_heads=12, num_key_value_heads=12)
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, head_dim=128, num_hidden_layers=18,
                                             tie_word_embeddings=False, **shape))
    else:  # the preset's depth and layout
        from sse_model import SSEConfig, SSEForCausalLM
        model = SSEForCausalLM(SSEConfig.from_preset("paper_2b", sse_num_heads=12, **shape))
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(path)
    del model
    with reporting_slow_start(f"the {kind} engine", every_s=60):
        llm = LLM(model=path, skip_tokenizer_init=True, gpu_memory_utilization=0.85, max_num_seqs=256,
                  max_model_len=4608, seed=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])] * 4,
                       SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False))
    print("GENERATED", [len(o.outputs[0].token_ids) for o in out], flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
"""


@pytest.mark.parametrize("kind", ["sse", "qwen3"])
def test_engine_of_the_recipe_width_starts_from_a_fresh_script(kind, tmp_path):
    """A random-weight 18 x 1536 model (SSE-H in the paper's layout, and Qwen3 of the same shape) with
    `skip_tokenizer_init`, 0.85 of the GPU, 256 sequences of 4608 tokens: the engine starts and generates, in a
    process of its own whose parent never touched CUDA through torch, as a user's script (with the main guard that
    a spawned start needs: the plugin makes vLLM spawn on GPUs, `seams.spawn_engine_processes`); a start that
    stalls reports where its processes wait (`eval.engine.reporting_slow_start`) and the test shows that report."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "start_engine.py"
    script.write_text(START_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, str(script), kind, str(tmp_path / kind)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=START_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the {kind} engine did not start and generate in {START_LIMIT_S} s:\n{err[-12000:]}")
    assert proc.returncode == 0 and "GENERATED [16, 16, 16, 16]" in out, err[-12000:]
