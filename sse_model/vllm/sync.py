"""Weight sync from a trainer into a live vLLM engine serving an SSE-H checkpoint, and a parity probe.

    push_weights(llm, model.named_parameters())           # after every optimizer step
    assert logprob_parity(llm, model, probe_ids) < 1e-3     # cheap check that vLLM scores like the trainer

Why not TRL's default (`model.load_weights([(name, tensor)])` one tensor at a time): vLLM processes weights after
loading. Its CPU build repacks every Linear weight for its GEMM kernels and computes from the packed copy (the
lm_head keeps its Parameter, so writing into it succeeds and changes nothing). `push_weights` goes through
vLLM's layerwise `reload_weights` instead, which restores the loadable parameters, loads every layer and
re-runs that processing, so each kernel reads the new weights on every platform. The vLLM model refuses plain
`load_weights` calls on a serving engine, so the stale path fails loudly rather than silently.
"""
from collections.abc import Iterable

import torch


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """The tensors a full push must carry: the HF model's parameters (a tied head is the embedding)."""
    from sse_model.modeling_sse import SSEForCausalLM

    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in SSEForCausalLM(config).named_parameters()}


def push_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Load a full set of HF-named tensors into `llm` (a `vllm.LLM` serving an SSE-H checkpoint, no request in
    flight) and drop its prefix cache, whose KV and SSE states came from the old weights.

    A missing, unknown or misshapen tensor raises ValueError before anything is loaded: a partial push would leave
    weights stale, a failed one half-loaded. With `shapes` ({name: full shape} of what `named_tensors` will yield)
    the check runs on it and the tensors stream: vLLM's reload processes a layer once its tensors have arrived, so a
    sharded trainer that gathers one parameter per step of the iterable never holds the whole model gathered, and
    nothing is gathered (no collective starts) when the check fails. Without it the tensors are collected first.
    """
    from sse_model.vllm import seams  # here, so that importing this module does not import vLLM

    if shapes is None:
        named_tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        shapes = {name: tuple(tensor.shape) for name, tensor in named_tensors}
    config = llm.llm_engine.model_config.hf_config
    want, got = expected_shapes(config), dict(shapes)
    if config.tie_word_embeddings:
        got.pop("lm_head.weight", None)  # a state_dict of a tied model may carry it; the embedding is the head
    if got != want:
        wrong = sorted(n for n in got.keys() & want.keys() if got[n] != want[n])
        raise ValueError(f"push_weights needs exactly the model's parameters: missing "
                         f"{sorted(want.keys() - got.keys())}, unknown {sorted(got.keys() - want.keys())}, "
                         f"wrong shape {wrong}")
    # A list pickles to an engine in another process; a stream reaches only an in-process one (external launcher)
    stream = named_tensors if isinstance(named_tensors, list) else ((n, t.detach()) for n, t in named_tensors)
    seams.reload_weights(llm, stream)
    if not llm.reset_prefix_cache():
        raise RuntimeError("push_weights: vLLM could not reset its prefix cache (requests still running?); cached "
                           "KV and SSE states from the old weights would be reused")


@torch.no_grad()
def logprob_parity(llm, hf_model, token_ids: list[int]) -> float:
    """Max |logprob difference| between vLLM and `hf_model` over the tokens of `token_ids` (each scored given
    the ones before it). Drift means the engine computes with other weights or other math than the trainer."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": list(token_ids)}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([position[token].logprob for position, token in zip(out.prompt_logprobs[1:], token_ids[1:])])
    param = next(hf_model.parameters())
    logits = hf_model(torch.tensor([token_ids], device=param.device)).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids[1:], device=param.device)[:, None])
    return float((ours - theirs[:, 0].cpu()).abs().max())
