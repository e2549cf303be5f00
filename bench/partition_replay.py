"""What partition replay changes (docs/pipeline.md, "Partition replay and routing health"): a checkpoint samples
long rollouts in vLLM with its routes recorded, and the HF trainer model scores the sampled tokens twice, with its
own routes and replaying the engine's. Per mode: route flips per 1k tokens (token x SSE layer pairs whose set of
partitions differs from the engine's, per 1000 tokens: in the routes the forward used, and in the trainer's own
top-K of its router logits, which replay overrides), the sampler-vs-trainer KL on the sampled tokens (k3, as
`sampling/kl_rollout_trainer`) and the largest |delta log-probability|.

    python -m bench.partition_replay CHECKPOINT [--prompts 8] [--max-tokens 4096] [--dtype bfloat16]
                                     [--positions N] [--name NAME --baseline]

Prints a markdown table. The checkpoint is an SSE-H one (a GRPO or SFT run's `final/`); its tokenizer's chat
template wraps the built-in math prompts (`--prompt-file`: one prompt per line instead). Rollouts run to
--max-tokens (`--stop-at-eos` lets them end early), at temperature 1 and top_p 1, as GRPO samples. `--positions N`
sets the model's `max_position_embeddings` to N in the engine and the trainer alike, so that a checkpoint trained on
short sequences (the embedded default's ends at 512) samples long rollouts: rotary positions have no weights, and
past its training length the model runs out of distribution, which is what long rollouts from such a model are.
"""
import argparse
import os
import sys

import torch

from bench.baseline import command, write_baseline

PROMPTS = [
    "What is the sum of the first 100 positive integers? Explain step by step.",
    "A train travels 240 km in 3 hours. How long does it take to travel 400 km at the same speed?",
    "Find all real x such that x^2 - 5x + 6 = 0, and check each answer.",
    "How many ways can 5 books be arranged on a shelf if two of them must stay together?",
    "Prove that the product of two odd integers is odd.",
    "What is the remainder when 2^100 is divided by 7?",
    "A rectangle has perimeter 30 and area 56. What are its sides?",
    "Compute 17 * 23 - 19 * 21 without a calculator, showing your work.",
]


def prompt_ids(tokenizer, text):
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
    return tokenizer.encode(text)


@torch.no_grad()
def score(model, prompt, completion, routes=None):
    """(log-probabilities of the completion's tokens, the model's own top-K [SSE layers, T, K])."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)
    out = model(ids, partition_routes=None if routes is None else routes[None].to(device))
    logp = torch.log_softmax(out.logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(-1, ids[0, len(prompt):, None])[:, 0].cpu(), out.partition_choices[:, 0].cpu()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompts", type=int, default=8, help="rollouts (one per prompt)")
    p.add_argument("--prompt-file", help="one prompt per line instead of the built-in math prompts")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--stop-at-eos", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--positions", type=int, help="the model's max_position_embeddings, in engine and trainer")
    p.add_argument("--name", default="checkpoint", help="the checkpoint's name in the baseline's configuration")
    p.add_argument("--baseline", action="store_true", help="overwrite bench/results/partition_replay_<name>.json")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The engine in this process, as GRPO's colocated one: the routes are taken from its model directly.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if device == "cpu":
        torch.set_num_threads(1)  # an in-process CPU engine thrashes with more (docs/vllm-backend.md, on CPU)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from pipeline.partition_routes import route_flips
    from pipeline.trl_seams import rollout_kl
    from sse_model import SSEForCausalLM
    from sse_model.vllm import seams

    texts = open(args.prompt_file).read().splitlines() if args.prompt_file else PROMPTS
    texts = [texts[i % len(texts)] for i in range(args.prompts)]
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    prompts = [prompt_ids(tokenizer, t) for t in texts]
    positions = {} if args.positions is None else {"max_position_embeddings": args.positions}
    llm = LLM(model=args.checkpoint, dtype=args.dtype, seed=args.seed, enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization, hf_overrides=positions,
              max_model_len=max(map(len, prompts)) + args.max_tokens, additional_config={"sse_record_routes": True})
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, logprobs=0, seed=args.seed,
                              ignore_eos=not args.stop_at_eos)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], sampling, use_tqdm=False)
    routes = seams.take_routes(llm, [o.request_id for o in outputs])

    model = SSEForCausalLM.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype), **positions)
    model = model.to(device).eval()
    totals = {mode: dict(used=0, own=0, tokens=0, sampler=[], trainer=[]) for mode in ("own routes", "replayed")}
    for prompt, out, recorded in zip(prompts, outputs, routes, strict=True):
        completion = list(out.outputs[0].token_ids)
        sampler = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, completion)])
        table = torch.full((len(prompt) + len(completion), *recorded.shape[1:]), -1, dtype=torch.long)
        table[:len(recorded)] = torch.from_numpy(recorded.astype("int64"))
        for mode, replay in (("own routes", None), ("replayed", table)):
            trainer, choices = score(model, prompt, completion, replay)
            engine = table.transpose(0, 1)  # [SSE layers, T, K], as the choices
            used = choices if replay is None else torch.where(engine >= 0, engine, choices)
            t = totals[mode]
            t["used"] += int(route_flips(used[:, None], table[None], None)[0].sum())
            t["own"] += int(route_flips(choices[:, None], table[None], None)[0].sum())
            t["tokens"] += len(prompt) + len(completion)
            t["sampler"].append(sampler)
            t["trainer"].append(trainer)
    sampled = sum(len(o.outputs[0].token_ids) for o in outputs)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    rows = []
    for mode, t in totals.items():
        sampler, trainer = torch.cat(t["sampler"]), torch.cat(t["trainer"])
        rows.append({"trainer forward": mode,
                     "route flips / 1k tokens (used)": round(1000 * t["used"] / t["tokens"], 3),
                     "route flips / 1k tokens (own top-K)": round(1000 * t["own"] / t["tokens"], 3),
                     "sampler-vs-trainer KL": float(rollout_kl(sampler, trainer, torch.ones_like(sampler))),
                     "max abs delta logprob": float((sampler - trainer).abs().max())})
    title = f"{args.checkpoint}: {len(prompts)} rollouts, {sampled} sampled tokens, {args.dtype}, {device_name}"
    print(title)
    print("| " + " | ".join(rows[0]) + " |\n|" + " ---: |" * len(rows[0]))
    for r in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    if args.baseline:
        write_baseline(f"partition_replay_{args.name}", device=device_name, title=title, rows=rows,
                       command=command("bench.partition_replay", argv))


if __name__ == "__main__":
    main()
