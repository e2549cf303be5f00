"""Convert a pretrained Transformer (Llama, Qwen2 / Qwen2.5, Qwen3) into SSE-H. (A checkpoint of the SSE authors'
own model, model_type "sse", is converted exactly by `sse_model.convert_authors`, which `sse-rl convert` picks.)

    convert("Qwen/Qwen3-1.7B", "runs/qwen3-sse", attention_every=6)      # or a local directory
    sse-rl convert --from SRC --to DST [--attention-layers 5,11,17 | --attention-every 6] [--partitions 4 ...]

Layers kept as softmax attention, the MLPs, norms, embeddings and head are copied exactly (RoPE settings, q/k norms,
q/k/v biases and tied embeddings included), so a conversion that keeps every layer reproduces the source's logits.
The other attention layers become SSE layers (docs/model.md) built from the attention they replace.

How an SSE layer is initialised, and why (measurements: docs/conversion.md):
- W_q, W_k, W_v, W_o come from the attention; grouped-query K/V heads are repeated so that SSE query head h uses
  the K/V head attention head h used. Qwen3's q/k RMSNorm weights are folded into the rows of W_q / W_k; the
  per-token normalisation itself is dropped: the SSE output is normalised per head anyway (o_norm), which makes the
  scale of q irrelevant (but for the query offset below), and the key logits' scale is a free temperature of the
  key softmax.
- There is no exact equivalence: attention weighs token s by softmax_s(q . R k_s) (positive, RoPE), SSE by
  q . (decayed softmax-over-rows(k_s)) (any sign, no RoPE). Three things can be matched cheaply, and are fitted per
  SSE layer on calibration text that the source model samples itself (no data set needed):
  * query offset: QUERY_OFFSET x the head's query std is added to the q bias (hence `sse_qkv_bias`), so every read
    weight gets a positive part, as in the "1 + q.k" expansion of exp(q.k) that linear attention rests on; without
    it the sign of q . k_s flips from token to token where attention weights never do.
  * decay: the decay gate starts input-independent (decay_up weight 0) with a per-head bias picked from
    DECAY_BIASES (half-lives of 3 to 12k tokens) as the one whose SSE output has the highest cosine similarity to
    that head's attention output: local heads get short memories, global heads long ones.
  * output gate: g_proj weight 0 and bias b with silu(b) = RMS of the attention output / RMS of the normalised SSE
    output, per channel, so silu(g) is constant and the layer's output has the attention's scale (o_norm weight 1;
    `sse_gate_bias` gives g_proj its bias).
  With calibration off (`calibration_tokens=0`) there is no offset, the heads take the candidate decays in turn and
  silu(g) = 1. Measured alternatives that did worse (decay near 1 for every head, least-squares output scales, a
  normalised key temperature, larger offsets) are in docs/conversion.md.
- The router is small and random (std `initializer_range`): near-uniform routing weights, but top-K choices that
  differ between tokens, so the partitions do not start as copies that get identical gradients.
- LoRA of the shared partition: down-projections small random, up-projections 0, so the shared partition starts
  with the routed partitions' q and k and the LoRA learns the difference; decay_down small random for the same
  reason (decay_up starts at 0).

Optional, off by default (`align_steps=0`): attention-output alignment (one of SILA's training tools), which then
trains every SSE layer by gradient descent to reproduce the replaced attention layer's output on the source's hidden
states (`align_sse_layers`; measured in docs/retrieval.md).
"""
import argparse
import logging
import math
import re
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

import kernels
from sse_model.configuration_sse import ATTENTION_HEAD_DIMS, ATTENTION_LAYER, SSE_LAYER, SSEConfig, default_layer_types
from sse_model.hub_code import save_model_code
from sse_model.modeling_sse import SSEForCausalLM, SSELayer

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# RoPE variants whose frequencies are fixed at load time; SSE-H's attention does not recompute them per sequence.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Decay-gate biases tried per head: log a = logsigmoid(b) / 16 gives half-lives of about 3, 5, 16, 90, 600 and
# 12k tokens, from a local head to one that remembers the whole context.
DECAY_BIASES = (-4.0, -2.0, 0.0, 2.0, 4.0, 7.0)
# Files copied verbatim so the converted checkpoint tokenizes, chats and generates like the source.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
CALIBRATION_LENGTH = 256  # tokens per calibration sequence
# Query offset in units of the head's query std (docs/conversion.md: 0.5 beat 0, 1 and 2).
QUERY_OFFSET = 0.5
ALIGN_BATCH = 8  # calibration sequences per step of attention-output alignment


def source_layout(config) -> dict:
    """What the source's attention carries, or a ValueError naming what SSE-H cannot represent."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"cannot convert model_type {model_type!r}: supported model types are "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if config.hidden_act != "silu":
        raise ValueError(f"cannot convert a {model_type} model with hidden_act={config.hidden_act!r}: "
                         f"SSE-H MLPs use silu")
    # Qwen2 always has q/k/v biases and no o_proj bias; Llama and Qwen3 put `attention_bias` on all four.
    qkv_bias = model_type == "qwen2" or config.attention_bias
    if model_type != "qwen2" and config.attention_bias:
        raise ValueError(f"cannot convert a {model_type} model with attention_bias=True: SSE-H has no o_proj bias")
    if getattr(config, "mlp_bias", False):
        raise ValueError(f"cannot convert a {model_type} model with mlp_bias=True: SSE-H MLPs have no biases")
    sliding = [t for t in getattr(config, "layer_types", None) or [] if t != ATTENTION_LAYER]
    if getattr(config, "use_sliding_window", False) or sliding:
        raise ValueError(f"cannot convert a {model_type} model with sliding-window attention layers")
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"cannot convert rope_type {rope_type!r}: SSE-H supports {', '.join(STATIC_ROPE_TYPES)}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"cannot convert a model with head_dim {head_dim}: SSE-H key/value and attention heads "
                         f"must have a size vLLM runs, one of {ATTENTION_HEAD_DIMS}")
    return dict(qkv_bias=qkv_bias, qk_norm=model_type == "qwen3", head_dim=head_dim)


def choose_layer_types(num_layers: int, attention_every: int | None, attention_layers) -> list[str]:
    """Layer types with the given indices (or one in every `attention_every`) kept as softmax attention."""
    if attention_layers is None:
        if not attention_every or attention_every < 1:
            raise ValueError(f"attention_every must be >= 1, got {attention_every}")
        return default_layer_types(num_layers, attention_every)
    keep = set()
    for i in attention_layers:
        if not 0 <= i < num_layers:
            raise ValueError(f"attention layer index {i} is out of range for a model with {num_layers} layers "
                             f"(valid: 0 to {num_layers - 1})")
        keep.add(i)
    return [ATTENTION_LAYER if i in keep else SSE_LAYER for i in range(num_layers)]


def sse_config_from(src, layout, layer_types, *, partitions, top_k, lora_rank, row_topk, shared_partition):
    return SSEConfig(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers, layer_types=layer_types, hidden_act="silu",
        rms_norm_eps=src.rms_norm_eps, initializer_range=src.initializer_range,
        tie_word_embeddings=src.tie_word_embeddings, max_position_embeddings=src.max_position_embeddings,
        pad_token_id=src.pad_token_id, bos_token_id=src.bos_token_id, eos_token_id=src.eos_token_id,
        num_attention_heads=src.num_attention_heads, num_key_value_heads=src.num_key_value_heads,
        head_dim=layout["head_dim"], attention_bias=layout["qkv_bias"], attention_qk_norm=layout["qk_norm"],
        attention_dropout=getattr(src, "attention_dropout", 0.0), rope_parameters=dict(src.rope_parameters),
        sse_num_heads=src.num_attention_heads, sse_key_dim=layout["head_dim"], sse_value_dim=layout["head_dim"],
        sse_num_partitions=partitions, sse_top_k=top_k, sse_shared_partition=shared_partition,
        sse_lora_rank=lora_rank, sse_row_topk=row_topk, sse_qkv_bias=True, sse_gate_bias=True,
        architectures=["SSEForCausalLM"], dtype=src.dtype)


def repeat_kv_heads(t: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[kv_heads * d, ...] -> [heads * d, ...]: query head h uses K/V head h // (heads / kv_heads), as in GQA."""
    return t.unflatten(0, (num_kv_heads, -1)).repeat_interleave(num_heads // num_kv_heads, 0).flatten(0, 1)


def silu_inverse(y: torch.Tensor) -> torch.Tensor:
    """The b >= -1.28 with silu(b) = y, for y >= 0 (Newton from above the root, where silu is convex)."""
    y = y.double().clamp(min=0)
    b = torch.where(y > 1, y, 2 * y) + 0.5
    for _ in range(40):
        s = torch.sigmoid(b)
        b = b - (b * s - y) / (s * (1 + b * (1 - s)))
    return b.float()


def per_head(values, num_heads: int, dim: int) -> torch.Tensor:
    """One value per head (or one for all heads) repeated over that head's `dim` rows."""
    return torch.as_tensor(values, dtype=torch.float32).expand(num_heads).repeat_interleave(dim)


@torch.no_grad()
def init_sse_layer(layer: SSELayer, attn, config: SSEConfig, generator: torch.Generator):
    """Data-free initialisation of an SSE layer from the attention module it replaces (module docstring)."""
    H, Hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim

    def expand(t):
        return repeat_kv_heads(t, H, Hkv)

    ones = attn.q_proj.weight.new_ones(H * d)
    q_scale = attn.q_norm.weight.repeat(H) if config.attention_qk_norm else ones
    k_scale = attn.k_norm.weight.repeat(H) if config.attention_qk_norm else ones
    layer.q_proj.weight.copy_(attn.q_proj.weight * q_scale[:, None])
    layer.k_proj.weight.copy_(expand(attn.k_proj.weight) * k_scale[:, None])
    layer.v_proj.weight.copy_(expand(attn.v_proj.weight))
    layer.o_proj.weight.copy_(attn.o_proj.weight)
    if attn.q_proj.bias is None:  # the SSE layer has q/k/v biases anyway: calibration offsets the queries
        layer.q_proj.bias.zero_(), layer.k_proj.bias.zero_(), layer.v_proj.bias.zero_()
    else:
        layer.q_proj.bias.copy_(attn.q_proj.bias * q_scale)
        layer.k_proj.bias.copy_(expand(attn.k_proj.bias) * k_scale)
        layer.v_proj.bias.copy_(expand(attn.v_proj.bias))
    for p in (layer.router.weight, layer.decay_down.weight, *[getattr(layer, f"{n}_shared_down").weight
              for n in ("q", "k") if hasattr(layer, "q_shared_down")]):
        p.copy_(torch.randn(p.shape, generator=generator) * config.initializer_range)
    layer.decay_up.weight.zero_()
    layer.decay_up.bias.copy_(per_head([DECAY_BIASES[h % len(DECAY_BIASES)] for h in range(H)], H, d))
    if hasattr(layer, "q_shared_up"):
        layer.q_shared_up.weight.zero_(), layer.k_shared_up.weight.zero_()
    layer.g_proj.weight.zero_()
    layer.g_proj.bias.copy_(silu_inverse(torch.ones(H * d)))
    layer.o_norm.weight.fill_(1.0)


def sse_core_output(layer: SSELayer, x: torch.Tensor) -> torch.Tensor:
    """The SSE operator's output [B, T, H, d_v] (float32) before o_norm, gate and o_proj."""
    o, _ = kernels.sse_attention(**layer.project(x)[0], **layer.ops, impl=layer.config.sse_impl)
    return o.float()


@torch.no_grad()
def fit_query_offset(layer: SSELayer, x: torch.Tensor):
    """Add QUERY_OFFSET x (the head's query std) to every query row: the SSE read weight q . k_s then carries a
    positive part like softmax attention's weights instead of a sign that flips from token to token."""
    q = layer.q_proj(x).float().unflatten(-1, (layer.num_heads, -1))
    layer.q_proj.bias.add_(per_head(QUERY_OFFSET * q.std(-1).mean((0, 1)).cpu(), layer.num_heads, layer.key_dim)
                           .to(layer.q_proj.bias))


@torch.no_grad()
def fit_decay(layer: SSELayer, x: torch.Tensor, attn_out: torch.Tensor):
    """Per head, the DECAY_BIASES entry whose SSE output has the highest cosine similarity to the attention's."""
    scores = []
    for bias in DECAY_BIASES:
        layer.decay_up.bias.fill_(bias)
        scores.append(F.cosine_similarity(sse_core_output(layer, x), attn_out.float(), dim=-1).mean((0, 1)))
    best = torch.tensor(DECAY_BIASES)[torch.stack(scores).argmax(0).cpu()]
    layer.decay_up.bias.copy_(per_head(best, layer.num_heads, layer.key_dim).to(layer.decay_up.bias))


@torch.no_grad()
def fit_gate(layer: SSELayer, x: torch.Tensor, attn_out: torch.Tensor):
    """Constant gate silu(b) = RMS of the attention output / RMS of the normalised SSE output, per channel."""
    def rms(t):
        return t.float().pow(2).mean((0, 1)).sqrt().flatten()

    ratio = rms(attn_out) / rms(layer.o_norm(sse_core_output(layer, x))).clamp(min=1e-6)
    layer.g_proj.bias.copy_(silu_inverse(ratio.cpu()).to(layer.g_proj.bias))


def calibrate_sse_layer(layer: SSELayer, x: torch.Tensor, attn_out: torch.Tensor):
    """x: the replaced attention's input [B, T, D]; attn_out: its output before o_proj [B, T, H, d]."""
    fit_query_offset(layer, x)
    fit_decay(layer, x, attn_out)
    fit_gate(layer, x, attn_out)


@torch.no_grad()
def calibration_text(source, num_tokens: int, seed: int) -> torch.Tensor:
    """Token ids [B, T] (T = min(num_tokens, CALIBRATION_LENGTH)) that the source samples at temperature 1 after
    its BOS token: text from the model's own distribution without any data set."""
    length = min(num_tokens, CALIBRATION_LENGTH)
    config = source.config
    start = config.bos_token_id if config.bos_token_id is not None else config.eos_token_id
    start = start[0] if isinstance(start, list) else start
    torch.manual_seed(seed)
    if start is None:
        start = int(torch.randint(config.vocab_size, ()))
    prompt = torch.full((math.ceil(num_tokens / length), 1), start, dtype=torch.long, device=source.device)
    sampling = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=length - 1,
                                min_new_tokens=length - 1, pad_token_id=start, bos_token_id=start)
    return source.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=sampling)


@torch.no_grad()
def attention_activations(source, ids: torch.Tensor, layers) -> dict[int, tuple]:
    """{layer: (attention input [B, T, D], attention output before o_proj [B, T, H, d])} of the source on `ids`."""
    seen, hooks = {}, []
    for i in layers:
        attn = source.model.layers[i].self_attn
        hooks.append(attn.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: seen.__setitem__((i, "x"), args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True))
        hooks.append(attn.o_proj.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__((i, "o"), args[0])))
    try:
        source(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    H = source.config.num_attention_heads
    return {i: (seen[i, "x"], seen[i, "o"].unflatten(-1, (H, -1))) for i in layers}


@torch.no_grad()
def convert_model(source, config: SSEConfig, *, calibration_ids=None, seed: int = 0) -> SSEForCausalLM:
    """The SSE-H model (float32, on the source's device) for `config`, built from the loaded `source`."""
    sse_layers = [i for i, kind in enumerate(config.layer_types) if kind == SSE_LAYER]
    model = SSEForCausalLM(config).to(source.device).eval()
    replaced = re.compile(r"model\.layers\.(\d+)\.self_attn\.")
    state = {name: t for name, t in source.state_dict().items()
             if not ((m := replaced.match(name)) and config.layer_types[int(m[1])] == SSE_LAYER)}
    new = {f"model.layers.{i}.linear_attn.{name}" for i in sse_layers
           for name, _ in model.model.layers[i].linear_attn.named_parameters()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - new:
        raise ValueError(f"weights of {source.name_or_path} do not map onto SSE-H: unexpected {unexpected[:5]}, "
                         f"missing {sorted(set(missing) - new)[:5]}")
    generator = torch.Generator().manual_seed(seed)
    for i in sse_layers:
        init_sse_layer(model.model.layers[i].linear_attn, source.model.layers[i].self_attn, config, generator)
    if calibration_ids is not None and sse_layers:
        for i, (x, attn_out) in attention_activations(source, calibration_ids, sse_layers).items():
            calibrate_sse_layer(model.model.layers[i].linear_attn, x, attn_out)
    return model


def align_sse_layers(source, model: SSEForCausalLM, ids: torch.Tensor, *, steps: int, lr: float,
                     seed: int = 0) -> dict[int, tuple[float, float]]:
    """SILA's attention-output alignment: train each SSE layer of `model`, one after another, to reproduce the output
    (after o_proj) of the attention layer it replaced, both fed that attention's input in the source on `ids`:
    `steps` Adam steps on the mean squared error, ALIGN_BATCH random sequences of `ids` each, gradients clipped to
    norm 1. Only the SSE layers' parameters change. Returns {layer: (MSE before, MSE after)} over `ids`."""
    sse_layers = [i for i, kind in enumerate(model.config.layer_types) if kind == SSE_LAYER]
    generator = torch.Generator().manual_seed(seed)
    errors = {}
    for i in sse_layers:
        # One layer's activations at a time (a source forward per layer): all layers' at once would hold
        # 2 x layers x tokens x hidden floats, gigabytes for a 1B-class source at the default 8192 tokens.
        (x, attn_out), = attention_activations(source, ids, [i]).values()
        with torch.no_grad():
            target = source.model.layers[i].self_attn.o_proj(attn_out.flatten(-2))
        layer = model.model.layers[i].linear_attn
        params = list(layer.parameters())
        optimizer = torch.optim.Adam(params, lr=lr)
        with torch.no_grad():
            before = F.mse_loss(layer(x)[0], target).item()
        for _ in range(steps):
            batch = torch.randperm(len(ids), generator=generator)[:ALIGN_BATCH].to(x.device)
            loss = F.mse_loss(layer(x[batch])[0], target[batch])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
        with torch.no_grad():
            errors[i] = (before, F.mse_loss(layer(x)[0], target).item())
    return errors


def local_checkpoint(src: str) -> Path:
    """A local directory holding `src`: the path itself, or the hub snapshot of a model id."""
    if Path(src).is_dir():
        return Path(src)
    if src.startswith((".", "/", "~")) or src.count("/") != 1:
        raise FileNotFoundError(f"{src} is neither a checkpoint directory nor a hub model id (org/name)")
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(src, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))


def convert(src, dst, *, attention_every: int | None = 6, attention_layers=None, partitions: int = 4,
            top_k: int = 1, lora_rank: int = 64, row_topk: int | None = None, shared_partition: bool = True,
            calibration_tokens: int = 2048, align_steps: int = 0, align_lr: float = 1e-3, align_tokens: int = 8192,
            seed: int = 0, device: str | None = None) -> SSEConfig:
    """Write an `sse_hybrid` checkpoint converted from the Transformer at `src` (local directory or hub id) to
    `dst` in the source's dtype, with its tokenizer, chat template and generation config; returns the config.
    `attention_layers` (indices) overrides `attention_every`; `calibration_tokens=0` skips calibration;
    `align_steps` > 0 aligns the SSE layers' outputs to the attention's on `align_tokens` tokens the source samples
    (`align_sse_layers`)."""
    src_dir = local_checkpoint(str(src))
    src_config = AutoConfig.from_pretrained(src_dir)
    layout = source_layout(src_config)
    layer_types = choose_layer_types(src_config.num_hidden_layers, attention_every, attention_layers)
    config = sse_config_from(src_config, layout, layer_types, partitions=partitions, top_k=top_k,
                             lora_rank=lora_rank, row_topk=row_topk, shared_partition=shared_partition)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    source = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32).to(device).eval()
    ids = calibration_text(source, calibration_tokens, seed) if calibration_tokens > 0 else None
    model = convert_model(source, config, calibration_ids=ids, seed=seed)
    if align_steps > 0:
        errors = align_sse_layers(source, model, calibration_text(source, align_tokens, seed + 1), steps=align_steps,
                                  lr=align_lr, seed=seed)
        logger.info("aligned the SSE layers' outputs to the attention's (MSE before -> after): %s",
                    ", ".join(f"layer {i} {a:.4g} -> {b:.4g}" for i, (a, b) in errors.items()))
    del source

    dtype = src_config.dtype or torch.float32
    model.to("cpu", dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype).save_pretrained(dst)
    save_model_code(dst)
    copied = [name for name in TOKENIZER_FILES if (src_dir / name).is_file()]
    for name in copied:
        shutil.copyfile(src_dir / name, Path(dst) / name)
    if "tokenizer_config.json" not in copied:
        logger.warning("%s has no tokenizer; %s gets none", src, dst)
    logger.info("converted %s -> %s: attention layers %s, %d SSE layers, calibrated on %d tokens", src, dst,
                [i for i, kind in enumerate(layer_types) if kind == ATTENTION_LAYER],
                layer_types.count(SSE_LAYER), 0 if ids is None else ids.numel())
    return config


def parse_layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--attention-layers takes comma-separated integers, got {text!r}") from err


def convert_main(argv=None) -> int:
    """`sse-rl convert --from SRC --to DST [--attention-layers 5,11,17 | --attention-every 6] [...]`."""
    parser = argparse.ArgumentParser(prog="sse-rl convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="src", required=True,
                        help="Transformer checkpoint (local directory or hub id), or a local checkpoint of the SSE "
                             "authors' fla model (model_type 'sse'), converted as it is: the layer options are its own")
    parser.add_argument("--to", dest="dst", required=True, help="output directory for the sse_hybrid checkpoint")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--attention-layers", type=parse_layers, help="indices kept as softmax attention, e.g. 5,11,17")
    which.add_argument("--attention-every", type=int, default=6,
                       help="keep one attention layer in every N: indices N-1, 2N-1, ... (default 6)")
    parser.add_argument("--partitions", type=int, default=4, help="SSE partitions N (default 4)")
    parser.add_argument("--top-k", type=int, default=1, help="partitions selected per token K (default 1)")
    parser.add_argument("--lora-rank", type=int, default=64, help="shared-partition LoRA rank (default 64)")
    parser.add_argument("--row-topk", type=int, default=None, help="row-sparse keys: rows kept per token")
    parser.add_argument("--calibration-tokens", type=int, default=2048,
                        help="tokens the source samples to fit SSE decays and gates (0: data-free init)")
    parser.add_argument("--align-steps", type=int, default=0,
                        help="Adam steps per SSE layer fitting its output to the replaced attention's (0: off)")
    parser.add_argument("--align-lr", type=float, default=1e-3, help="learning rate of the alignment (default 1e-3)")
    parser.add_argument("--align-tokens", type=int, default=8192,
                        help="tokens the source samples for the alignment (default 8192)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from sse_model.convert_authors import convert_authors_checkpoint, is_authors_checkpoint
    try:
        if is_authors_checkpoint(args.src):
            convert_authors_checkpoint(args.src, args.dst)
            return 0
        convert(args.src, args.dst, attention_every=args.attention_every, attention_layers=args.attention_layers,
                partitions=args.partitions, top_k=args.top_k, lora_rank=args.lora_rank, row_topk=args.row_topk,
                calibration_tokens=args.calibration_tokens, align_steps=args.align_steps, align_lr=args.align_lr,
                align_tokens=args.align_tokens, seed=args.seed, device=args.device)
    except (ValueError, OSError) as err:  # bad input, a missing checkpoint or an unreachable hub
        parser.exit(2, f"sse-rl convert: error: {err}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(convert_main())
