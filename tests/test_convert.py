"""Conversion of tiny random Qwen2 (q/k/v bias), Qwen3 (q/k norm, tied head) and Llama (RoPE scaling)
checkpoints built here into SSE-H: exactness of kept layers, loading and generating, calibration, bad input,
the CLI, and vLLM through the plugin."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config

from sse_model import SSEForCausalLM  # importing sse_model registers sse_hybrid with the Auto classes
from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER
from sse_model.convert import (
    DECAY_BIASES,
    attention_activations,
    calibration_text,
    convert,
    convert_main,
    sse_core_output,
)
from tiny_checkpoints import tiny_source

SOURCES = {
    "qwen2": dict(),
    "qwen3": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                   "original_max_position_embeddings": 256}),
    "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
}
SMALL = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{family: (path, model)}: random float32 checkpoints with GQA, tokenizer, chat template, generation config."""
    root = tmp_path_factory.mktemp("sources")
    return {family: (root / family, tiny_source(family, root / family, seed=i, **SMALL, **overrides))
            for i, (family, overrides) in enumerate(SOURCES.items())}


def prompt_ids(batch=2, length=12, seed=0):
    return torch.randint(5, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(SOURCES))
def test_all_attention_conversion_reproduces_source_logits(sources, family, tmp_path):
    path, source = sources[family]
    convert(path, tmp_path / "dst", attention_every=1, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32)
    assert isinstance(model, SSEForCausalLM) and set(model.config.layer_types) == {ATTENTION_LAYER}
    assert model.config.rope_parameters == source.config.rope_parameters
    ids = prompt_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, source(input_ids=ids).logits, rtol=0, atol=1e-5)
    greedy = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, **greedy), source.generate(ids, **greedy))


@pytest.mark.parametrize("family", list(SOURCES))
def test_default_conversion_loads_generates_and_keeps_tokenizer(sources, family, tmp_path):
    path, source = sources[family]
    dst = tmp_path / "dst"
    config = convert(path, dst, attention_every=2, calibration_tokens=0, device="cpu")
    assert config.layer_types == [SSE_LAYER, ATTENTION_LAYER] * 2
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    assert isinstance(model, SSEForCausalLM) and model.config.tie_word_embeddings == (family == "qwen3")

    # SSE layers carry the attention's projections, K/V heads repeated for grouped-query attention
    sse, attn = model.model.layers[0].linear_attn, source.model.layers[0].self_attn
    torch.testing.assert_close(sse.o_proj.weight, attn.o_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(sse.v_proj.weight.view(4, 32, 128), attn.v_proj.weight.view(2, 32, 128)
                               .repeat_interleave(2, 0), rtol=0, atol=0)
    # kept layers, embeddings and head are the source's
    for name, tensor in source.state_dict().items():
        if not name.startswith(("model.layers.0.self_attn", "model.layers.2.self_attn")):
            torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0, msg=name)

    ids = prompt_ids()
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss) and out.logits.shape == (2, 12, 64)
    generated = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert generated.shape == (2, 18)

    tokenizer, src_tokenizer = AutoTokenizer.from_pretrained(dst), AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "1+2"}]
    assert (tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == src_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert (dst / "generation_config.json").read_text() == (path / "generation_config.json").read_text()


def test_calibration_matches_each_heads_decay_and_output_scale(sources, tmp_path):
    path, source = sources["qwen3"]
    convert(path, tmp_path / "dst", attention_layers=[3], calibration_tokens=32, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32)
    # the same text the conversion sampled (seed 0), and what the source's attention did with it
    x, attn_out = attention_activations(source, calibration_text(source, 32, seed=0), [1])[1]
    layer = model.model.layers[1].linear_attn
    assert set(layer.decay_up.bias.tolist()) <= set(DECAY_BIASES) and not layer.decay_up.weight.any()
    assert not layer.g_proj.weight.any()
    with torch.no_grad():
        gated = layer.o_norm(sse_core_output(layer, x)) * torch.nn.functional.silu(layer.g_proj.bias).view(4, 32)

    def rms(t):
        return t.pow(2).mean((0, 1)).sqrt()

    torch.testing.assert_close(rms(gated), rms(attn_out), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case, message", [
    ("gpt2", "cannot convert model_type 'gpt2': supported model types are llama, qwen2, qwen3"),
    ("head_dim", "cannot convert a model with head_dim 16: SSE-H key/value and attention heads must have a size "
                 "vLLM runs, one of (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)"),
    ("index", "attention layer index 4 is out of range for a model with 4 layers (valid: 0 to 3)"),
    ("negative", "attention layer index -1 is out of range for a model with 4 layers (valid: 0 to 3)"),
])
def test_bad_input_is_named(sources, tmp_path, case, message):
    path, kwargs = sources["llama"][0], {}
    if case == "gpt2":
        path = tmp_path / "gpt2"
        GPT2Config(n_layer=2, n_embd=64, n_head=2).save_pretrained(path)
    elif case == "head_dim":
        path = tmp_path / "small_heads"
        tiny_source("qwen3", path, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    else:
        kwargs["attention_layers"] = [1, 4] if case == "index" else [-1]
    with pytest.raises(ValueError) as err:
        convert(path, tmp_path / "dst", calibration_tokens=0, device="cpu", **kwargs)
    assert str(err.value) == message
    assert not (tmp_path / "dst").exists()


def test_cli(sources, tmp_path, capsys):
    path = sources["qwen2"][0]
    assert convert_main(["--from", str(path), "--to", str(tmp_path / "dst"), "--attention-layers", "1,3",
                         "--partitions", "2", "--top-k", "2", "--lora-rank", "4", "--calibration-tokens", "0"]) == 0
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["layer_types"] == [SSE_LAYER, ATTENTION_LAYER] * 2
    assert (config["sse_num_partitions"], config["sse_top_k"], config["sse_lora_rank"]) == (2, 2, 4)
    assert config["attention_bias"] and config["architectures"] == ["SSEForCausalLM"]
    # the model's code beside the weights: loadable with trust_remote_code=True without sse-rl (sse_model/hub_code.py)
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_sse.SSEForCausalLM"
    assert (tmp_path / "dst" / "modeling_sse.py").exists()

    with pytest.raises(SystemExit) as exit_:
        convert_main(["--from", str(path), "--to", str(tmp_path / "bad"), "--attention-layers", "9"])
    assert exit_.value.code == 2
    assert ("sse-rl convert: error: attention layer index 9 is out of range for a model with 4 layers (valid: 0 to 3)"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_:
        convert_main(["--from", str(tmp_path / "missing"), "--to", str(tmp_path / "bad")])
    assert exit_.value.code == 2
    assert (f"sse-rl convert: error: {tmp_path / 'missing'} is neither a checkpoint directory nor a hub model id "
            "(org/name)" in capsys.readouterr().err)
    with pytest.raises(SystemExit):  # one way of choosing layers at a time
        convert_main(["--from", str(path), "--to", str(tmp_path / "bad"), "--attention-layers", "1",
                      "--attention-every", "2"])


VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=4,
          kv_cache_memory_bytes=64 << 20)
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[2])]
outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3])), use_tqdm=False)
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_converted_checkpoint_generates_in_vllm_like_hf(sources, tmp_path):
    path = sources["qwen3"][0]
    convert(path, tmp_path / "dst", attention_every=2, calibration_tokens=0, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32)
    prompts, new_tokens = prompt_ids(batch=3, length=9, seed=1).tolist(), 12
    expected = [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)[0, 9:].tolist()
                for p in prompts]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(tmp_path / "dst"), json.dumps(prompts),
                          str(new_tokens)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS "):]) == expected


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints of the SSE authors' own model (flash-linear-attention PR #882 at 741fbbf, fla/models/sse/ and
# fla/layers/sse.py), built here in their save_pretrained layout and checked against tests/authors_sse.py, a
# plain-torch transcription of their model.

AUTHORS_VARIANTS = {
    "hybrid_w2_r2": {},
    "reads_differ_tied_qkv_bias": dict(num_writer=1, num_reader=3, tie_word_embeddings=True,
                                       attn={"layers": [0, 2], "num_heads": 2, "num_kv_heads": 2, "qkv_bias": True,
                                             "window_size": None, "rope_theta": 500.0}),
    "sse_only_expand_v": dict(attn=None, expand_v=2.0, num_sparse_partition=6, num_writer=2, num_reader=1),
}


@pytest.mark.parametrize("variant", list(AUTHORS_VARIANTS))
def test_authors_checkpoint_converts_to_the_same_logits(tmp_path, variant):
    """`sse-rl convert` on a checkpoint of the authors' model writes an sse_hybrid checkpoint whose logits equal
    the authors' model's within float32 rounding, on a batch and through generation's incremental decoding; its
    balance loss is their aux loss (summed over layers, divided by K)."""
    from authors_sse import AUTHORS_CONFIG, authors_forward, save_authors_checkpoint
    cfg, weights = save_authors_checkpoint(tmp_path / "authors", {**AUTHORS_CONFIG, **AUTHORS_VARIANTS[variant]})
    assert convert_main(["--from", str(tmp_path / "authors"), "--to", str(tmp_path / "dst")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32).eval()
    config = model.config
    assert (config.sse_qv_activation, config.sse_shared_decay, config.sse_balance_loss_norm) == (
        "silu", True, "sum_over_layers_div_k")
    assert (config.sse_top_k, config.sse_num_readers) == (cfg["num_writer"], cfg["num_reader"])
    ids = prompt_ids(batch=2, length=23, seed=3) % cfg["vocab_size"]
    with torch.no_grad():
        want, want_aux = authors_forward(ids, cfg, weights)
        out = model(input_ids=ids)
        torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        torch.testing.assert_close(out.balance_loss, want_aux, rtol=1e-5, atol=0)
        # incremental decoding (the operator's decode step) continues the same function
        cache = model(input_ids=ids[:, :-3], use_cache=True).past_key_values
        for t in range(ids.shape[1] - 3, ids.shape[1]):
            step = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            torch.testing.assert_close(step.logits[:, 0], want[:, t], rtol=1e-5,
                                       atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("option, value, message", [
    ("linear_attn_type", "gdn", "linear_attn_type='gdn'"),
    ("use_short_conv", True, "use_short_conv=True"),
    ("num_v_heads", 8, "num_v_heads=8"),
    ("use_output_gate", False, "use_output_gate=False"),
    ("attn", {"layers": [1], "num_heads": 2, "num_kv_heads": 2, "qkv_bias": False, "window_size": 64,
              "rope_theta": 1e4}, "attn.window_size=64"),
])
def test_authors_options_sse_h_lacks_are_named(tmp_path, capsys, option, value, message):
    """The CLI refuses them (exit 2), naming the option."""
    from authors_sse import AUTHORS_CONFIG, save_authors_checkpoint
    save_authors_checkpoint(tmp_path / "authors", {**AUTHORS_CONFIG, option: value})
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--from", str(tmp_path / "authors"), "--to", str(tmp_path / "dst")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_authors_unknown_weight_is_named(tmp_path):
    """A tensor the conversion does not map (an option it does not know) is an error naming the tensor."""
    from safetensors.torch import load_file, save_file

    from authors_sse import save_authors_checkpoint
    from sse_model.convert_authors import convert_authors_checkpoint
    save_authors_checkpoint(tmp_path / "authors")
    tensors = load_file(tmp_path / "authors" / "model.safetensors")
    tensors["model.layers.0.attn.q_conv1d_shared.weight"] = torch.zeros(64, 1, 4)
    save_file(tensors, tmp_path / "authors" / "model.safetensors")
    with pytest.raises(ValueError, match="q_conv1d_shared"):
        convert_authors_checkpoint(tmp_path / "authors", tmp_path / "dst")
