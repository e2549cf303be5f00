"""Convert a checkpoint of the SSE authors' own model into SSE-H: the exact same function, in the project's format.

    convert_authors_checkpoint("path/to/fla-sse", "runs/sse-h")      # or `sse-rl convert --from DIR --to DST`

The authors' code is flash-linear-attention pull request #882 (head 741fbbf, not merged; BICLab/SpikingBrain2.0 ships
the same): `fla/models/sse/{configuration_sse,modeling_sse}.py` and `fla/layers/sse.py`. Its models save with
transformers' `save_pretrained` as model_type "sse": a config.json with keys such as num_sparse_partition,
num_writer, num_reader, linear_attn_type and an `attn` dict for the softmax-attention layers, and safetensors
weights named `model.embeddings`, `model.layers.i.{attn_norm,attn,mlp_norm,mlp}`, `model.norm`, `lm_head`.

Their GLA-flavoured SSE layer (SSEGLA) is SSE-H's layer with the authors' options (docs/model.md, "The authors'
layer"): SiLU on q and v, the shared partition's own decay gate (gk_proj.0; the routed partitions' is gk_proj.1),
a low-rank output gate (g_proj.0 / g_proj.1), num_reader partitions read and num_writer written, and the balance
loss summed over layers and divided by K. Their low-rank q / k term (lora_q_proj, lora_k_proj) is on the routed
partitions, ours on the shared one; the two are exact reparameterisations of each other:
    routed q = (W_q + U D) x,   shared q = routed q + (-U) (D x)  =  W_q x
so W_q of SSE-H is their W_q + U D (formed in float64, rounded once) and the shared LoRA is (D, -U): the logits
agree within float32 rounding (tests/test_convert.py, against a plain-torch transcription of their model).
What SSE-H cannot express is refused, naming the option: the GDN flavour, short convolutions, GVA heads, no output
gate, sliding-window attention, activations other than swish.
"""
import json
import logging
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER, SSEConfig
from sse_model.convert import TOKENIZER_FILES
from sse_model.hub_code import save_model_code
from sse_model.modeling_sse import SSEForCausalLM

logger = logging.getLogger(__name__)

AUTHORS_MODEL_TYPE = "sse"
# fla's SSEGLA takes these from its own defaults, not from the config (fla/layers/sse.py at 741fbbf).
GATE_LOW_RANK_DIM, GATE_LOGIT_NORMALIZER = 16, 16.0


def is_authors_checkpoint(path) -> bool:
    """Whether `path` is a local directory whose config.json says model_type "sse" (the authors' model)."""
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == AUTHORS_MODEL_TYPE


def _refuse(option, value, why):
    raise ValueError(f"cannot convert the SSE authors' checkpoint with {option}={value!r}: {why}")


def config_from_authors(raw: dict) -> SSEConfig:
    """The SSEConfig of SSE-H that computes what the authors' config.json `raw` describes (or a ValueError naming
    the option SSE-H lacks)."""
    if raw.get("linear_attn_type", "gla") != "gla":
        _refuse("linear_attn_type", raw["linear_attn_type"], "SSE-H has the GLA flavour of SSE only (SSEGLA), "
                "not the gated delta rule (SSEGDN)")
    if raw.get("use_short_conv", False):
        _refuse("use_short_conv", True, "SSE-H has no short convolutions on q and k")
    if not raw.get("use_output_gate", True):
        _refuse("use_output_gate", False, "SSE-H's layer always has its output gate")
    if raw.get("hidden_act", "swish") != "swish":
        _refuse("hidden_act", raw["hidden_act"], "SSE-H's MLPs use swish (silu)")
    H, c = raw.get("num_heads", 6), raw.get("head_dim", 256)
    if raw.get("num_v_heads") not in (None, H):
        _refuse("num_v_heads", raw["num_v_heads"], f"SSE-H has as many value heads as key heads (num_heads={H})")
    dv = c * raw.get("expand_v", 1.0)
    if dv != int(dv):
        _refuse("expand_v", raw["expand_v"], f"head_dim * expand_v = {dv} is not an integer")
    dv = int(dv)
    N, writers, readers = (raw.get(k, d) for k, d in (("num_sparse_partition", 4), ("num_writer", 2),
                                                       ("num_reader", 2)))
    D, layers = raw.get("hidden_size", 2048), raw.get("num_hidden_layers", 24)
    intermediate = raw.get("intermediate_size")
    if intermediate is None:  # fla's GatedMLP: 2/3 of hidden_ratio x hidden, rounded up to a multiple of 256
        intermediate = int(D * (raw.get("hidden_ratio") or 4) * 2 / 3)
        intermediate = 256 * math.ceil(intermediate / 256)
    attn = raw.get("attn") or {}
    if attn.get("window_size") is not None:
        _refuse("attn.window_size", attn["window_size"], "SSE-H's softmax attention is not windowed")
    if attn.get("qk_norm"):
        _refuse("attn.qk_norm", True, "fla's SSE blocks build their attention without q/k norms")
    heads = attn.get("num_heads", 1)
    return SSEConfig(
        vocab_size=raw.get("vocab_size", 32000), hidden_size=D, intermediate_size=intermediate,
        num_hidden_layers=layers,
        layer_types=[ATTENTION_LAYER if i in attn.get("layers", []) else SSE_LAYER for i in range(layers)],
        hidden_act="silu", rms_norm_eps=raw.get("norm_eps", 1e-6),
        initializer_range=raw.get("initializer_range", 0.02),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        max_position_embeddings=raw.get("max_position_embeddings", 2048), pad_token_id=raw.get("pad_token_id"),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        # fla's Attention: head_dim = hidden_size / num_heads, q/k/v biases from qkv_bias, default RoPE
        num_attention_heads=heads, num_key_value_heads=attn.get("num_kv_heads") or heads, head_dim=D // heads,
        attention_bias=attn.get("qkv_bias", False),
        rope_parameters={"rope_type": "default", "rope_theta": float(attn.get("rope_theta", 10000.0))},
        sse_num_heads=H, sse_key_dim=c, sse_value_dim=dv, sse_num_partitions=N, sse_top_k=writers,
        sse_num_readers=readers, sse_shared_partition=True, sse_lora_rank=dv, sse_decay_rank=GATE_LOW_RANK_DIM,
        sse_decay_normalizer=GATE_LOGIT_NORMALIZER, sse_qkv_bias=False, sse_gate_bias=False,
        sse_qv_activation="silu", sse_shared_decay=True, sse_output_gate_rank=dv,
        sse_balance_loss_norm="sum_over_layers_div_k", sse_balance_loss_coef=raw.get("aux_loss_coef", 0.01),
        architectures=["SSEForCausalLM"])


# SSE layer weights whose names change and nothing else: theirs (under model.layers.i.attn.) -> ours (linear_attn.)
SSE_RENAMES = {"v_proj": "v_proj", "e_proj": "router", "gk_proj.0.0": "shared_decay_down",
               "gk_proj.0.1": "shared_decay_up", "gk_proj.1.0": "decay_down", "gk_proj.1.1": "decay_up",
               "g_proj.0": "gate_down", "g_proj.1": "gate_up", "o_norm": "o_norm", "o_proj": "o_proj"}
BLOCK_RENAMES = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "mlp": "mlp"}


def state_dict_from_authors(tensors: dict[str, torch.Tensor], config: SSEConfig) -> dict[str, torch.Tensor]:
    """SSE-H's state dict from the authors' tensors (module docstring); any tensor left over is an error naming
    it (an option this conversion does not know)."""
    out = {"model.embed_tokens.weight": tensors.pop("model.embeddings.weight"),
           "model.norm.weight": tensors.pop("model.norm.weight")}
    if "lm_head.weight" in tensors:
        out["lm_head.weight"] = tensors.pop("lm_head.weight")
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name in list(tensors):
        if m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name):
            by_layer.setdefault(int(m[1]), {})[m[2]] = tensors.pop(name)
    for i, weights in sorted(by_layer.items()):
        ours = f"model.layers.{i}"
        for theirs, mine in BLOCK_RENAMES.items():
            for name in [n for n in weights if n.startswith(f"{theirs}.")]:
                out[f"{ours}.{mine}{name[len(theirs):]}"] = weights.pop(name)
        attn = {name[len("attn."):]: t for name, t in weights.items() if name.startswith("attn.")}
        weights = {name: t for name, t in weights.items() if not name.startswith("attn.")}
        if config.layer_types[i] == ATTENTION_LAYER:
            out |= {f"{ours}.self_attn.{name}": attn.pop(name) for name in list(attn)
                    if name.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj")}
        else:
            for which in ("q", "k"):  # their low-rank term moved to the shared partition (module docstring)
                dense, down, up = (attn.pop(f"{n}.weight") for n in (f"{which}_proj", f"lora_{which}_proj.0",
                                                                      f"lora_{which}_proj.1"))
                out |= {f"{ours}.linear_attn.{which}_proj.weight":
                        (dense.double() + up.double() @ down.double()).to(dense.dtype),
                        f"{ours}.linear_attn.{which}_shared_down.weight": down,
                        f"{ours}.linear_attn.{which}_shared_up.weight": -up}
            for theirs, mine in SSE_RENAMES.items():
                for name in [n for n in attn if n.rsplit(".", 1)[0] == theirs]:
                    out[f"{ours}.linear_attn.{mine}.{name.rsplit('.', 1)[1]}"] = attn.pop(name)
        left = [f"model.layers.{i}.attn.{n}" for n in attn] + [f"model.layers.{i}.{n}" for n in weights]
        if left:
            raise ValueError(f"cannot convert the SSE authors' checkpoint: no SSE-H weight for {left[:5]}")
    if tensors:
        raise ValueError(f"cannot convert the SSE authors' checkpoint: no SSE-H weight for {sorted(tensors)[:5]}")
    return out


def load_authors_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `src` (one file or save_pretrained's shards)."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} holds no *.safetensors weights (the authors' save_pretrained layout)")
    return {name: t for f in files for name, t in load_file(f).items()}


def convert_authors_checkpoint(src, dst) -> SSEConfig:
    """Write the `sse_hybrid` checkpoint (in the source's dtype, with its tokenizer files) that computes what the
    authors' checkpoint at `src` computes; returns its config."""
    src = Path(src)
    raw = json.loads((src / "config.json").read_text())
    config = config_from_authors(raw)
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    model = SSEForCausalLM(config)
    state = state_dict_from_authors(load_authors_tensors(src), config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if not (config.tie_word_embeddings and n == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"the SSE authors' checkpoint at {src} does not map onto SSE-H: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    config.dtype = dtype
    model.to(getattr(torch, dtype)).save_pretrained(dst)
    save_model_code(dst)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, Path(dst) / name)
    logger.info("converted the SSE authors' checkpoint %s -> %s: %d SSE layers, attention layers %s", src, dst,
                config.layer_types.count(SSE_LAYER),
                [i for i, kind in enumerate(config.layer_types) if kind == ATTENTION_LAYER])
    return config
