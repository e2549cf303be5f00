"""How close a converted SSE-H model starts to its source Transformer:

    python bench/convert.py [--families qwen3,qwen2,llama] [--train-seconds 120] [--out bench/results]

No network here, so the sources are tiny models built on the spot:
- random-weight Qwen3, Qwen2 and Llama models (checks the plumbing; their perplexity is meaningless),
- the same architectures trained for `--train-seconds` on the CPU on generated text (additions, key-value recall
  and copying, character-level), so that attention matters and perplexity means something.
For each, the conversion (one attention layer in every six kept) is compared with the source:
- mixer cosine: per SSE layer, the SSE layer's output vs the attention output it replaces, both fed the source's
  hidden states (text the source samples itself, another seed than calibration),
- hidden cosine: per layer, the converted model's residual stream vs the source's on the same text,
- perplexity on held-out generated text, with ablations of the initialisation (docs/conversion.md).
Writes bench/results/convert_<date>_<host>_<families>.{json,md}.
"""
import argparse
import copy
import datetime
import json
import math
import os
import platform
import random
import string
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name  # noqa: E402
from sse_model import convert as conv  # importing sse_model registers sse_hybrid with the Auto classes
from sse_model.configuration_sse import SSE_LAYER

FAMILIES = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}
ALPHABET = string.ascii_lowercase + string.digits + "+=:?>. \n"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ALPHABET, plus pad/bos/eos and chat markers, with a chat template."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   additional_special_tokens=SPECIAL_TOKENS[3:], chat_template=CHAT_TEMPLATE)


def generate_text(num_chars: int, seed: int) -> str:
    """Lines of three tasks, each needing attention to earlier characters: 'a+b=c.', 'k:v ... k?v.', 'copy w>w.'."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < num_chars:
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randrange(1000), rng.randrange(1000)
            line = f"{a}+{b}={a + b}."
        elif kind == 1:
            pairs = {k: rng.randrange(10) for k in rng.sample(string.ascii_lowercase, 5)}
            key = rng.choice(list(pairs))
            line = " ".join(f"{k}:{v}" for k, v in pairs.items()) + f" {key}?{pairs[key]}."
        else:
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randrange(3, 9)))
            line = f"copy {word}>{word}."
        lines.append(line + "\n")
        size += len(line) + 1
    return "".join(lines)[:num_chars]


def text_batch(tokenizer, batch: int, length: int, seed: int) -> torch.Tensor:
    ids = tokenizer(generate_text(batch * length, seed))["input_ids"]
    return torch.tensor(ids[: batch * length]).view(batch, length)


def tiny_source(family: str, path, *, hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=32,
                seed=0, **overrides):
    """A random-weight `family` model with the character tokenizer, saved to `path`; returns the model."""
    torch.manual_seed(seed)
    tokenizer = char_tokenizer()
    config = FAMILIES[family](
        vocab_size=64, hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=1024, tie_word_embeddings=family == "qwen3", pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **overrides)
    model = AutoModelForCausalLM.from_config(config).eval()
    save_source(model, tokenizer, path)
    return model


def save_source(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=True, temperature=0.7,
                     max_new_tokens=64).save_pretrained(path)


def train(model, tokenizer, seconds: float, seed: int = 0, batch: int = 16, length: int = 128) -> dict:
    """AdamW on freshly generated text (never the held-out seeds) for `seconds` of wall time."""
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    start, step, losses = time.time(), 0, []
    while time.time() - start < seconds:
        x = text_batch(tokenizer, batch, length, seed=10_000 + step)
        for group in opt.param_groups:  # warm up, then decay linearly over the time budget
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 50) * max(0.1, 1 - (time.time() - start) / seconds)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step += 1
    model.eval()
    tail = losses[-20:]
    return dict(steps=step, seconds=round(time.time() - start, 1), final_loss=round(sum(tail) / len(tail), 3))


@torch.no_grad()
def perplexity(model, ids) -> float:
    logits = model(input_ids=ids).logits
    return math.exp(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).item())


@torch.no_grad()
def hidden_states(model, ids) -> list[torch.Tensor]:
    """The residual stream after every decoder layer."""
    out, hooks = [], [layer.register_forward_hook(lambda m, a, o: out.append(o[0] if isinstance(o, tuple) else o))
                      for layer in model.model.layers]
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return out


def mean_cosine(a, b) -> float:
    return F.cosine_similarity(a.float(), b.float(), dim=-1).mean().item()


@torch.no_grad()
def mixer_cosines(source, model, ids) -> dict[int, float]:
    """Per SSE layer: its output vs the replaced attention's (after o_proj), both on the source's hidden states."""
    sse_layers = [i for i, kind in enumerate(model.config.layer_types) if kind == SSE_LAYER]
    acts = conv.attention_activations(source, ids, sse_layers)
    return {i: mean_cosine(model.model.layers[i].linear_attn(x)[0],
                           source.model.layers[i].self_attn.o_proj(attn_out.flatten(-2)))
            for i, (x, attn_out) in acts.items()}


@torch.no_grad()
def ablations(source, config, calibration_ids) -> dict:
    """The initialisation with one choice changed at a time (all in float32, in memory)."""
    sse_layers = [i for i, kind in enumerate(config.layer_types) if kind == SSE_LAYER]
    data_free = conv.convert_model(source, config)
    acts = conv.attention_activations(source, calibration_ids, sse_layers)

    def variant(*steps):
        model = copy.deepcopy(data_free)
        for i, (x, attn_out) in acts.items():
            for step in steps:
                step(model.model.layers[i].linear_attn, x, attn_out)
        return model

    def decay_near_one(layer, x, attn_out):
        layer.decay_up.bias.fill_(conv.DECAY_BIASES[-1])

    def output_zero(layer, x, attn_out):  # silu(0) = 0: the SSE layers add nothing, i.e. attention removed
        layer.g_proj.bias.zero_()

    def offset(layer, x, attn_out):
        conv.fit_query_offset(layer, x)

    return {
        "data-free (calibration_tokens=0)": data_free,
        "no query offset": variant(conv.fit_decay, conv.fit_gate),
        "decay near 1 for every head": variant(offset, decay_near_one, conv.fit_gate),
        "gate silu(g)=1 (no RMS match)": variant(offset, conv.fit_decay),
        "attention layers removed": variant(output_zero),
    }


def measure(name: str, src_dir: Path, workdir: Path, heldout, calibration_tokens: int, seed: int) -> dict:
    source = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32).eval()
    dst = workdir / f"{name}-sse"
    start = time.time()
    config = conv.convert(src_dir, dst, calibration_tokens=calibration_tokens, seed=seed, device="cpu")
    convert_seconds = time.time() - start
    converted = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    probe = conv.calibration_text(source, 1024, seed=seed + 1)  # the source's own text, unseen by calibration
    src_hidden, dst_hidden = hidden_states(source, probe), hidden_states(converted, probe)
    result = dict(
        source=name, layer_types=config.layer_types, convert_seconds=round(convert_seconds, 1),
        mixer_cosine={i: round(c, 3) for i, c in mixer_cosines(source, converted, probe).items()},
        hidden_cosine=[round(mean_cosine(a, b), 3) for a, b in zip(src_hidden, dst_hidden)],
        perplexity={"source": perplexity(source, heldout), "converted (default)": perplexity(converted, heldout)})
    calibration_ids = conv.calibration_text(source, calibration_tokens, seed)
    for label, model in ablations(source, config, calibration_ids).items():
        result["perplexity"][label] = perplexity(model, heldout)
        if label == "data-free (calibration_tokens=0)":
            result["mixer_cosine_data_free"] = {i: round(c, 3) for i, c in mixer_cosines(source, model, probe).items()}
    result["perplexity"] = {k: round(v, 3) for k, v in result["perplexity"].items()}
    return result


def markdown(report: dict) -> str:
    lines = [f"# Conversion benchmark ({report['date']}, {report['machine']['host']})", "",
             f"Machine: {report['machine']['cpu']}, {report['machine']['threads']} torch threads, load average "
             f"{report['machine']['load_before']} before / {report['machine']['load_after']} after. torch "
             f"{report['machine']['torch']}, transformers {report['machine']['transformers']}.", "",
             "Sources are tiny local models (no network): random weights, or trained on the CPU on generated text "
             "(see `bench/convert.py`). One attention layer in every six kept; the rest are SSE layers "
             f"(N=4, K=1, shared partition, LoRA 64), calibrated on {report['calibration_tokens']} tokens the source "
             "sampled itself.", ""]
    for r in report["results"]:
        lines += [f"## {r['source']}", ""]
        if "training" in r:
            t = r["training"]
            lines += [f"Trained {t['steps']} steps in {t['seconds']} s, final training loss {t['final_loss']} "
                      f"nats/char.", ""]
        sse = list(r["mixer_cosine"])
        lines += ["| layer | " + " | ".join(str(i) for i in range(len(r["hidden_cosine"]))) + " |",
                  "| --- |" + " --- |" * len(r["hidden_cosine"]),
                  "| kind | " + " | ".join("SSE" if t == SSE_LAYER else "attn" for t in r["layer_types"]) + " |",
                  "| mixer cosine (default) | " + " | ".join(
                      str(r["mixer_cosine"].get(i, "")) for i in range(len(r["hidden_cosine"]))) + " |",
                  "| mixer cosine (data-free) | " + " | ".join(
                      str(r["mixer_cosine_data_free"].get(i, "")) for i in range(len(r["hidden_cosine"]))) + " |",
                  "| hidden cosine (default) | " + " | ".join(str(c) for c in r["hidden_cosine"]) + " |", "",
                  f"Mean mixer cosine over SSE layers: "
                  f"{sum(r['mixer_cosine'][i] for i in sse) / max(1, len(sse)):.3f} (default), "
                  f"{sum(r['mixer_cosine_data_free'][i] for i in sse) / max(1, len(sse)):.3f} (data-free). "
                  f"Conversion took {r['convert_seconds']} s.", "",
                  "| model | perplexity (held-out) |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in r["perplexity"].items()]
        lines.append("")
    return "\n".join(lines)


def machine_info() -> dict:
    import transformers
    return dict(host=platform.node(), cpu=cpu_name(), threads=torch.get_num_threads(),
                torch=torch.__version__, transformers=transformers.__version__,
                load_before=round(os.getloadavg()[0], 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-seconds", type=float, default=120.0, help="CPU training time per trained source")
    parser.add_argument("--families", default="qwen3,qwen2,llama", help="architectures to build and convert")
    parser.add_argument("--calibration-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = dict(date=datetime.datetime.now().isoformat(timespec="minutes"), machine=machine_info(),
                  calibration_tokens=args.calibration_tokens, train_seconds=args.train_seconds, results=[])
    tokenizer = char_tokenizer()
    heldout = text_batch(tokenizer, 8, 256, seed=1)  # the training stream uses seeds from 10000 on
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for family in args.families.split(","):
            for trained in (False, True):
                name = f"{family}-{'trained' if trained else 'random'}"
                model = tiny_source(family, tmp / name)
                training = None
                if trained:
                    training = train(model, tokenizer, args.train_seconds)
                    save_source(model, tokenizer, tmp / name)
                result = measure(name, tmp / name, tmp, heldout, args.calibration_tokens, seed=0)
                if training:
                    result["training"] = training
                print(json.dumps(result), flush=True)
                report["results"].append(result)
    report["machine"]["load_after"] = round(os.getloadavg()[0], 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"convert_{datetime.datetime.now():%Y%m%d-%H%M}_{platform.node()}_{args.families.replace(',', '-')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
