"""One rank of a GRPO recipe (configs/sse_h_2b.yaml) on one GPU, phase by phase: the peak memory of the weight push,
the rollout, the log-probabilities and the update, and what sharding the trainer's state over the recipe's ranks
leaves per rank, from the measured component sizes.

    python -m bench.recipe_memory [--config configs/sse_h_2b.yaml] [--set KEY=VALUE ...] [--max-tokens N]
                                  [--prompt-tokens P] [--ranks 8] [--no-engine] [--all-attention]
                                  [--name NAME] [--baseline]

The pipeline's own pieces, in the order a GRPO step runs them with `grpo.vllm.enable_sleep_mode`: the model
(`SSEConfig.from_preset` of `model.config`, random weights in the trainer's dtype: float32 under
`model.fp32_master_weights`, gradient checkpointing as configured, TRL's fused LM head tiled by
`pipeline.trl_seams.set_logprob_chunks`); the colocated engine (`pipeline.rollouts.engine_kwargs`, in this process
through vLLM's external launcher as `SSEVLLMGeneration` builds it, asleep at level 2 until the first push); then
- `push (first)`: the engine wakes and takes the weights (`pipeline.rollouts.push_and_check`: vLLM's layerwise
  reload and the parity probe);
- `rollout`: the rank's completions (`per_device_batch_size` x `gradient_accumulation_steps`, as prompts x
  `num_generations`) of random `--prompt-tokens` prompts, `ignore_eos` so that every one runs to `--max-tokens`
  (default `max_completion_length`, as random weights do); the engine then sleeps (level 2);
- `log-probabilities`: the trainer's no-grad pass over them in micro-batches of `per_device_batch_size` through the
  fused LM head (the old log-probabilities and entropies TRL keeps);
- `update`: one optimizer step (AdamW, fused on a GPU, as the Trainer's default) over the micro-batches, each a
  forward through the fused head, a clipped-ratio surrogate of the log-probabilities (GRPO's loss has the same
  tensors) and a backward, gradients clipped to 1;
- `push`: the engine wakes and takes the updated weights while the trainer holds its Adam state.

Per phase: seconds, `torch.cuda.max_memory_allocated` (reset at its start: this process's tensors, the engine's
included), and the device's used memory (total - free, `torch.cuda.mem_get_info`) sampled on a thread every
`SAMPLE_S`: its peak is what the card must hold. Components: the trainer's weights, gradients and Adam state (their
tensors' bytes), the activations of one micro-batch (peak over the micro-batch less what was allocated before it),
the log-probability pass's working set, the engine's memory awake and asleep (device used, differences).

`--all-attention` runs the same recipe with every layer softmax attention: the project's all-attention model of
the preset's shape, what a user of the pipeline pays without SSE (its baseline is
`recipe_memory_<config>_all_attention` unless `--name` says otherwise).

`per_rank` turns them into the sharded rank's peaks (the arithmetic in its docstring). `--no-engine` (and the CPU,
whose vLLM build has no sleep mode) skips the engine: random completions, no push.
"""
import argparse
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from bench.baseline import REPO, command, now, raw_path, write_baseline

GIB = 2**30
SAMPLE_S = 0.02
RESIDENT = {  # the trainer's state each phase holds: gradients exist only inside the update (zero_grad frees them)
    "push (first)": ("weights",), "rollout": ("weights", "adam"), "log-probabilities": ("weights", "adam"),
    "update": ("weights", "gradients", "adam"), "push": ("weights", "adam")}


def rank_shape(cfg) -> dict:
    """One rank's share of a GRPO step: its completions as prompts x generations, in micro-batches."""
    g = cfg.grpo
    micro, accumulation, n = g.per_device_batch_size, g.trl["gradient_accumulation_steps"], g.trl["num_generations"]
    completions = micro * accumulation
    if completions % n:
        raise ValueError(f"{completions} completions per rank do not hold whole groups of {n}")
    return dict(prompts=completions // n, generations=n, micro_batch=micro, micro_batches=accumulation)


def model_config(cfg, all_attention: bool = False):
    """The recipe's model config: `model.config`'s preset with its other keys over it; with `all_attention`, every
    layer softmax attention."""
    from sse_model import SSEConfig
    from sse_model.configuration_sse import ATTENTION_LAYER

    kwargs = dict(cfg.model.config)
    preset = kwargs.pop("preset", None)
    config = SSEConfig.from_preset(preset, **kwargs) if preset else SSEConfig(**kwargs)
    if all_attention:
        config.layer_types = [ATTENTION_LAYER] * config.num_hidden_layers
    return config


def used() -> int | None:
    """The device's used bytes (total - free), or None off a GPU."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


class Meter:
    """Phases and their memory (the module's docstring)."""

    def __init__(self):
        self.phases = []

    @contextmanager
    def phase(self, name: str):
        cuda = torch.cuda.is_available()
        row = dict(phase=name)
        peak, stop = [used() or 0], threading.Event()

        def sample():
            while not stop.wait(SAMPLE_S):
                peak[0] = max(peak[0], used())
        thread = threading.Thread(target=sample, daemon=True) if cuda else None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            row["allocated_at_start"] = torch.cuda.memory_allocated()
            thread.start()
        started = time.perf_counter()
        try:
            yield row
        finally:
            if cuda:
                torch.cuda.synchronize()
            row["seconds"] = time.perf_counter() - started
            if cuda:
                stop.set()
                thread.join()
                row.update(peak_allocated=torch.cuda.max_memory_allocated(), device_peak=max(peak[0], used()),
                           device_end=used())
            self.phases.append(row)
            print(f"phase {name}: {row}", flush=True)  # a run stopped later still shows the phases it finished


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def fsdp_units(model) -> dict:
    """Bytes in the compute dtype (bf16) of what FSDP2 gathers (pipeline.training.sharding_args): each decoder layer
    a unit, the rest (embeddings, head, final norm) the root unit."""
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    total = sum(p.numel() for p in model.parameters())
    return dict(largest_layer=2 * max(layers), root=2 * (total - sum(layers)),
                largest_parameter=max(p.numel() * p.element_size() for p in model.parameters()))


def start_engine(cfg, model, path: str):
    """The colocated engine as `SSEVLLMGeneration._init_vllm` builds it (in this process, external launcher), asleep
    at level 2 when the config asks for sleep mode. Its checkpoint is the trainer's random weights in bf16 (the
    engine's dtype; the first push loads the trainer's own)."""
    from trl.trainer.utils import ensure_master_addr_port
    from vllm import LLM

    from pipeline.rollouts import engine_kwargs
    model.save_pretrained(path, state_dict={k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    for key in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(key, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    ensure_master_addr_port()
    kwargs = engine_kwargs(cfg, path)
    engine = LLM(**kwargs, distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs")
    if kwargs["enable_sleep_mode"]:
        engine.sleep(level=2)
    return engine, kwargs["enable_sleep_mode"]


def push(engine, sleeping: bool, model, cfg, parity_ids: list[int]) -> float | str:
    """The pipeline's push (wake first when asleep, as `SSEVLLMGeneration.sync_weights`); the parity, or the
    drift error's text."""
    from pipeline.rollouts import WeightSyncDrift, push_and_check
    if sleeping:
        torch.cuda.empty_cache()
        engine.wake_up()
    try:
        return push_and_check(engine, model, model.named_parameters(), parity_ids, cfg.grpo.parity_threshold)
    except WeightSyncDrift as e:
        return str(e)


def rollout(engine, shape: dict, prompt_tokens: int, max_tokens: int, vocab: int, cfg, g) -> torch.Tensor:
    """[completions, prompt + max_tokens] token ids: the engine's completions, or random ones without an engine."""
    prompts = [torch.randint(0, vocab, (prompt_tokens,), generator=g) for _ in range(shape["prompts"])]
    if engine is None:
        return torch.cat([torch.cat([p, torch.randint(0, vocab, (max_tokens,), generator=g)])[None]
                          for p in prompts for _ in range(shape["generations"])])
    from vllm import SamplingParams
    t = cfg.grpo.trl
    params = SamplingParams(n=shape["generations"], temperature=t.get("temperature", 1.0), top_p=t.get("top_p", 1.0),
                            max_tokens=max_tokens, ignore_eos=True, detokenize=False, seed=cfg.seed)
    out = engine.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
    rows = [torch.cat([p, torch.tensor(c.token_ids)]) for p, o in zip(prompts, out) for c in o.outputs]
    assert all(len(r) == prompt_tokens + max_tokens for r in rows), "a completion stopped before max_tokens"
    return torch.stack(rows)


def measure(cfg, config, *, max_tokens: int, prompt_tokens: int, use_engine: bool, seed: int = 0) -> dict:
    """Runs the phases (module docstring); returns {"phases": [...], "components": {...}, "shape": {...}}."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from pipeline.training import weights_dtype
    from pipeline.trl_seams import set_logprob_chunks

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shape, g, meter = rank_shape(cfg), torch.Generator().manual_seed(seed), Meter()
    torch.manual_seed(seed)
    with torch.device(device):  # on the GPU before the engine starts, as the Trainer places it
        model = AutoModelForCausalLM.from_config(config, dtype=weights_dtype(cfg))
    engine, sleeping, components = None, False, {}
    tmp = tempfile.TemporaryDirectory()
    if use_engine:
        before = used()
        engine, sleeping = start_engine(cfg, model, tmp.name)
        torch.cuda.empty_cache()
        components["engine asleep"] = used() - before
    if cfg.grpo.trl.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    set_logprob_chunks(cfg.trainer.logprob_chunk_tokens, cfg.trainer.logprob_chunk_vocab)
    add_fused_lm_head(model, temperature=cfg.grpo.trl.get("temperature", 1.0), outputs=("log_probs", "entropy"))
    components.update(weights=tensor_bytes(model.parameters()), **fsdp_units(model))
    parity_ids = torch.randint(0, config.vocab_size, (64,), generator=g).tolist()
    if engine is not None:
        asleep = used()
        with meter.phase("push (first)") as row:
            row["parity"] = push(engine, sleeping, model, cfg, parity_ids)
        components["engine awake"] = used() - asleep if cuda else None
    with meter.phase("rollout") as row:
        ids = rollout(engine, shape, prompt_tokens, max_tokens, config.vocab_size, cfg, g).to(device)
        row["tokens"] = ids.numel()
    if sleeping:
        engine.sleep(level=2)
        torch.cuda.empty_cache()
    labels = ids.clone()
    labels[:, :prompt_tokens] = -100
    micro = [slice(i, i + shape["micro_batch"]) for i in range(0, len(ids), shape["micro_batch"])]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda and cfg.model.dtype == "bfloat16" \
        else nullcontext()
    with meter.phase("log-probabilities") as row, torch.no_grad(), autocast:
        old = torch.cat([model(input_ids=ids[s], labels=labels[s], fused_lm_head=True).log_probs for s in micro])
    if cuda:
        components["log-probability pass"] = meter.phases[-1]["peak_allocated"] - row["allocated_at_start"]
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.grpo.trl["learning_rate"], fused=cuda)
    advantages = torch.randn(len(ids), 1, generator=g).to(device)
    activations = []
    with meter.phase("update"):
        for s in micro:
            at_start = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with autocast:
                out = model(input_ids=ids[s], labels=labels[s], fused_lm_head=True)
            mask = out.label_mask
            ratio = torch.exp(out.log_probs - old[s])
            clipped = torch.clamp(ratio, 1 - 0.2, 1 + 0.28)
            loss = -(torch.minimum(ratio * advantages[s], clipped * advantages[s]) * mask).sum() / mask.sum()
            (loss / len(micro)).backward()
            if cuda:
                activations.append(torch.cuda.max_memory_allocated() - at_start)
        components["gradients"] = tensor_bytes(p.grad for p in model.parameters())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    components["adam"] = tensor_bytes(t for state in optimizer.state.values() for t in state.values()
                                      if torch.is_tensor(t) and t.dim() > 0)
    components["activations, one micro-batch"] = max(activations) if activations else None
    if engine is not None:
        with meter.phase("push") as row:
            row["parity"] = push(engine, sleeping, model, cfg, parity_ids)
    tmp.cleanup()
    return dict(phases=meter.phases, components=components, shape=dict(shape, prompt_tokens=prompt_tokens,
                                                                        max_tokens=max_tokens))


def gathered(phase: str, units: dict) -> int:
    """Bytes a sharded rank gathers in full at once in `phase`: in the trainer's passes the root unit and two
    decoder layers (the one computing and the one prefetched), in the update their gradients too before the
    reduce-scatter, all in the compute dtype; in a push one parameter (float32) at a time."""
    forward = units["root"] + 2 * units["largest_layer"]
    return {"log-probabilities": forward, "update": 2 * forward}.get(phase, units["largest_parameter"]
                                                                      if phase.startswith("push") else 0)


def per_rank(phases: list[dict], components: dict, ranks: int) -> list[dict]:
    """A row per phase: the measured device peak of one unsharded rank, and the peak of one of `ranks` sharded ranks:
    the measured peak less the share of the trainer's resident state (RESIDENT) the other ranks hold, plus what the
    rank gathers in full (`gathered`). Everything else (activations, the engine, the CUDA context) is per rank
    already: each rank runs its own micro-batches and its own engine."""
    rows = []
    for p in phases:
        resident = sum(components[name] for name in RESIDENT[p["phase"]])
        peak = p.get("device_peak")
        sharded = peak - resident * (1 - 1 / ranks) + gathered(p["phase"], components) if peak is not None else None
        rows.append({"phase": p["phase"], "seconds": round(p["seconds"], 1),
                     "torch peak GiB": gib(p.get("peak_allocated")), "device peak GiB": gib(peak),
                     "trainer state GiB": gib(resident), f"device peak GiB, {ranks}-way sharded": gib(sharded)})
    return rows


def component_rows(components: dict, ranks: int) -> list[dict]:
    """The component sizes of one rank today and of one of `ranks` sharded ranks."""
    sharded = {"weights", "gradients", "adam"}
    names = {"weights": "float32 master weights", "gradients": "gradients", "adam": "Adam state",
             "activations, one micro-batch": "activations + fused-head tiles, one micro-batch",
             "log-probability pass": "log-probability pass, one micro-batch", "engine awake": "engine awake",
             "engine asleep": "engine asleep"}
    rows = [{"component": label, "one rank GiB": gib(components.get(key)),
             f"per rank, {ranks}-way GiB": gib(components[key] / ranks if key in sharded else components.get(key))}
            for key, label in names.items() if key in components]
    forward = components["root"] + 2 * components["largest_layer"]
    return rows + [{"component": "gathered FSDP units (root + 2 layers, bf16)", "one rank GiB": 0.0,
                    f"per rank, {ranks}-way GiB": gib(forward)}]


def gib(value) -> float | None:
    return None if value is None else round(value / GIB, 2)


def markdown(title: str, tables: list[list[dict]]) -> str:
    lines = [title]
    for rows in tables:
        lines += ["", "| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
        lines += ["| " + " | ".join("-" if v is None else str(v) for v in r.values()) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    from pipeline.config import load_config

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=REPO / "configs" / "sse_h_2b.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--max-tokens", type=int, help="tokens per completion (default: max_completion_length)")
    p.add_argument("--prompt-tokens", type=int, help="tokens per prompt (default: max_prompt_length)")
    p.add_argument("--ranks", type=int, help="ranks the trainer state is sharded over (default: the config's)")
    p.add_argument("--no-engine", action="store_true", help="no vLLM engine: random completions, no push")
    p.add_argument("--all-attention", action="store_true", help="every layer softmax attention (the comparison)")
    p.add_argument("--name", help="the baseline's configuration name (default: the config file's stem), e.g. for a "
                   "--set variant of the same config")
    p.add_argument("--baseline", action="store_true",
                   help="overwrite bench/results/recipe_memory_<config name>.json")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    ranks = args.ranks or cfg.resources.grpo.num_workers
    started = now()
    found = measure(cfg, model_config(cfg, args.all_attention),
                    max_tokens=args.max_tokens or cfg.grpo.trl["max_completion_length"],
                    prompt_tokens=args.prompt_tokens or cfg.grpo.max_prompt_length,
                    use_engine=torch.cuda.is_available() and not args.no_engine)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    phases, components = per_rank(found["phases"], found["components"], ranks), component_rows(found["components"],
                                                                                               ranks)
    s = found["shape"]
    model = f"{cfg.name}, every layer softmax attention" if args.all_attention else cfg.name
    title = (f"One rank of {args.config.name} ({model}) on {device}: {s['prompts']} prompts x {s['generations']} "
             f"of {s['prompt_tokens']} + {s['max_tokens']} tokens, {s['micro_batches']} micro-batches of "
             f"{s['micro_batch']}; sharded over {ranks} ranks")
    report = dict(date=started.isoformat(timespec="seconds"), device=device, config=str(args.config),
                  overrides=args.overrides, ranks=ranks, **found, rows=phases, component_rows=components)
    raw_path("recipe_memory", "json", started).write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(title, [components, phases])
    raw_path("recipe_memory", "md", started).write_text(text)
    print(text)
    if args.baseline:
        name = args.name or args.config.stem + ("_all_attention" if args.all_attention else "")
        write_baseline(f"recipe_memory_{name}", device=device,
                       command=command("bench.recipe_memory", argv),
                       title=title, rows=phases, components=components, shape=s)
    return report


if __name__ == "__main__":
    main()
