"""SSE-H on Hugging Face transformers (issue 2): config, registration, checkpoints, padding, packing, generation."""
import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.exc import InductorError
from transformers import AutoConfig, AutoModelForCausalLM, modeling_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kernels
from conftest import rel_err
from sse_model import SSEConfig, SSEForCausalLM, modeling_sse, packing
from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER

HYBRID = [SSE_LAYER, ATTENTION_LAYER, SSE_LAYER]


def tiny_config(**overrides):
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, layer_types=HYBRID,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, sse_num_heads=2, sse_key_dim=16,
                sse_value_dim=16, sse_num_partitions=4, sse_top_k=2, sse_lora_rank=4, pad_token_id=0)
    return SSEConfig(**{**base, **overrides})


BASELINES = {
    "sse_n4k2": {},
    "sse_row_sparse": dict(sse_num_partitions=8, sse_top_k=2, sse_row_topk=4),
    "gla": dict(sse_num_partitions=1, sse_top_k=1, sse_shared_partition=False, layer_types=[SSE_LAYER] * 3),
    "transformer": dict(layer_types=[ATTENTION_LAYER] * 3),
    # the SSE authors' layer (flash-linear-attention PR #882 at 741fbbf, fla/layers/sse.py SSEGLA), reading one
    # partition more than it writes
    "authors": dict(sse_qv_activation="silu", sse_shared_decay=True, sse_num_readers=3, sse_output_gate_rank=8,
                    sse_balance_loss_norm="sum_over_layers_div_k"),
}


def model_for(name, seed=0, **overrides):
    torch.manual_seed(seed)
    return SSEForCausalLM(tiny_config(**{**BASELINES[name], **overrides})).eval()


def test_registered_with_auto_classes(tmp_path):
    cfg = AutoConfig.for_model("sse_hybrid", **BASELINES["gla"], vocab_size=50, hidden_size=64,
                               num_hidden_layers=3, num_attention_heads=2, head_dim=32)
    assert isinstance(cfg, SSEConfig)
    model = AutoModelForCausalLM.from_config(cfg)
    assert isinstance(model, SSEForCausalLM)


@pytest.mark.parametrize("name", list(BASELINES))
def test_save_and_load_safetensors(tmp_path, name):
    model = model_for(name)
    ids = torch.randint(1, 97, (2, 11))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "sse_hybrid"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is SSEForCausalLM
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_trl_reference_model_loader_reads_a_checkpoint(tmp_path):
    """GRPO with beta > 0 builds its reference model with TRL's `create_model_from_path`, which probes
    `config.auto_map`; the reference must be the checkpoint's model, weights included."""
    from trl.trainer.utils import create_model_from_path
    model = model_for("sse_n4k2")
    model.save_pretrained(tmp_path)
    assert "auto_map" not in json.loads((tmp_path / "config.json").read_text())
    reference = create_model_from_path(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(1, 97, (2, 11))
    assert type(reference) is SSEForCausalLM and torch.equal(reference(ids).logits, model(ids).logits)


@pytest.mark.parametrize("overrides,field", [
    (dict(layer_types=[SSE_LAYER, "mamba2", SSE_LAYER]), "layer_types"),
    (dict(layer_types=[SSE_LAYER] * 2), "layer_types"),
    (dict(head_dim=16), "head_dim"),
    (dict(sse_top_k=5), "sse_top_k"),
    (dict(sse_row_topk=17), "sse_row_topk"),
    (dict(num_key_value_heads=3, num_attention_heads=2), "num_key_value_heads"),
    (dict(sse_qv_activation="gelu"), "sse_qv_activation"),
    (dict(sse_shared_decay=True, sse_shared_partition=False), "sse_shared_decay"),
    (dict(sse_num_readers=5), "sse_num_readers"),
    (dict(sse_num_readers=3, sse_impl="triton_indexed"), "sse_num_readers"),
    (dict(sse_output_gate_rank=0), "sse_output_gate_rank"),
    (dict(sse_balance_loss_norm="sum"), "sse_balance_loss_norm"),
])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"SSEConfig.{field}"):
        tiny_config(**overrides)


def test_attention_free_model_accepts_any_attention_head_dim():
    tiny_config(**BASELINES["gla"], head_dim=16)


@pytest.mark.parametrize("name", list(BASELINES))
def test_loss_is_cross_entropy_plus_balance(name):
    model = model_for(name)
    ids = torch.randint(1, 97, (2, 13))
    out = model(ids, labels=ids)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    if name == "transformer":
        assert out.balance_loss is None and torch.allclose(out.loss, ce)
        return
    n_sse = model.config.layer_types.count(SSE_LAYER)
    assert out.partition_usage.shape == (n_sse, model.config.sse_num_partitions)
    assert torch.allclose(out.partition_usage.sum(-1), torch.full((n_sse,), float(model.config.sse_top_k)))
    assert torch.allclose(out.loss, ce + 0.01 * out.balance_loss)
    out.loss.backward()
    if model.config.sse_num_partitions > 1:  # with one partition the router weight is softmax([x]) = 1, a constant
        router = next(m for m in model.modules() if hasattr(m, "router")).router
        assert router.weight.grad.abs().sum() > 0


def test_authors_options_default_to_the_project_layer():
    """Defaults keep today's model: same parameters, and the same logits bit for bit as a model whose config spells
    the defaults out."""
    ids = torch.randint(1, 97, (2, 13))
    spelled = dict(sse_qv_activation="none", sse_shared_decay=False, sse_num_readers=2, sse_output_gate_rank=None,
                   sse_balance_loss_norm="mean_over_layers")
    a, b = model_for("sse_n4k2"), model_for("sse_n4k2", **spelled)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    assert torch.equal(a(ids).logits, b(ids).logits)
    assert a.config.sse_num_writers == a.config.sse_top_k == 2 and a.config.sse_read_top_k is None


def test_authors_options_each_change_the_model():
    """Each option is used: switched on alone (same seed otherwise) it changes the logits, or for the balance
    normalisation the loss term: summed over the SSE layers and divided by K instead of their mean."""
    ids = torch.randint(1, 97, (2, 13))
    base = model_for("sse_n4k2")(ids)
    for option in (dict(sse_qv_activation="silu"), dict(sse_num_readers=3)):
        assert not torch.allclose(model_for("sse_n4k2", **option)(ids).logits, base.logits), option
    shared_decay = model_for("sse_n4k2", sse_shared_decay=True)
    names = {n for n, _ in shared_decay.named_parameters()}
    assert {f"model.layers.0.linear_attn.shared_decay_{p}" for p in ("down.weight", "up.weight", "up.bias")} <= names
    layer = shared_decay.model.layers[0].linear_attn
    with torch.no_grad():
        layer.shared_decay_up.bias.fill_(-3.0)
    assert not torch.allclose(shared_decay(ids).logits, base.logits)
    gate = model_for("sse_n4k2", sse_output_gate_rank=8).model.layers[0].linear_attn
    assert not hasattr(gate, "g_proj") and gate.gate_down.weight.shape == (8, 64)
    summed = model_for("sse_n4k2", sse_balance_loss_norm="sum_over_layers_div_k")(ids)
    n_sse = HYBRID.count(SSE_LAYER)
    assert torch.allclose(summed.balance_loss, base.balance_loss * n_sse / 2)


def test_low_rank_gate_and_shared_decay_match_their_modules():
    """The fused projections with a low-rank gate (its product W_up W_down) give the modules' gate, and the
    layer's gradients reach both factors and the shared decay gate."""
    model = model_for("authors")
    layer = model.model.layers[0].linear_attn
    x = torch.randn(2, 7, 64)
    fused = kernels.sse_input_projections(x, layer.num_heads, layer.projection_weights())
    by_modules = layer.projections_by_modules(x)
    assert rel_err(fused.gate, by_modules.gate) < 1e-6
    model(torch.randint(1, 97, (2, 9)), labels=torch.randint(1, 97, (2, 9))).loss.backward()
    for m in (layer.gate_down, layer.gate_up, layer.shared_decay_down, layer.shared_decay_up):
        assert m.weight.grad is not None and m.weight.grad.abs().sum() > 0


def test_balance_loss_ignores_pad_tokens():
    model = model_for("sse_n4k2")
    ids = torch.randint(1, 97, (1, 9))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    mask = (padded != 0).long()
    alone, with_pad = model(ids), model(padded, attention_mask=mask)
    assert torch.allclose(alone.balance_loss, with_pad.balance_loss, atol=1e-6)
    assert torch.allclose(alone.partition_usage, with_pad.partition_usage)


def test_sse_layer_uses_the_dispatched_operator():
    """A float64 model through the chunked path equals the same model through the token-loop reference."""
    ids = torch.randint(1, 97, (2, 17))
    logits = {impl: model_for("sse_row_sparse", sse_impl=impl).double()(ids).logits
              for impl in ["reference", "chunk_torch_varlen", "chunk_torch_mask"]}
    assert torch.allclose(logits["chunk_torch_varlen"], logits["reference"], rtol=0, atol=1e-10)
    assert torch.allclose(logits["chunk_torch_mask"], logits["reference"], rtol=0, atol=1e-10)


def left_padded(seqs):
    """Left-padded ids and mask; the pads are random tokens (not a zero-embedded pad id, whose hidden states stay
    zero through the layers and would hide a pad that leaked into a state)."""
    T = max(len(s) for s in seqs)
    ids = torch.randint(1, 97, (len(seqs), T))
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):], mask[i, T - len(s):] = s, 1
    return ids, mask


@pytest.mark.parametrize("name", list(BASELINES))
def test_left_padding_matches_each_sequence_alone(name):
    model = model_for(name)
    seqs = [torch.randint(1, 97, (n,)) for n in (12, 5, 1)]
    ids, mask = left_padded(seqs)
    logits = model(ids, attention_mask=mask).logits
    for i, s in enumerate(seqs):
        alone = model(s[None]).logits[0]
        assert torch.allclose(logits[i, -len(s):], alone, atol=1e-5), (name, i)


@pytest.mark.parametrize("name", list(BASELINES))
def test_packed_sequences_do_not_leak(name):
    model = model_for(name)
    seqs = [torch.randint(1, 97, (n,)) for n in (7, 1, 10)]
    packed = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    logits = model(packed, position_ids=positions).logits[0]
    start = 0
    for s in seqs:
        assert torch.allclose(logits[start:start + len(s)], model(s[None]).logits[0], atol=1e-5)
        start += len(s)
    # a mask with nothing padded changes nothing, in the attention layers as in the SSE layers
    with_mask = model(packed, attention_mask=torch.ones_like(packed), position_ids=positions).logits[0]
    assert torch.equal(with_mask, logits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["sse_n4k2", "transformer"])
def test_packed_row_gradients_match_the_document_mask(name, device, monkeypatch):
    """A packed row under SDPA attends within each sequence by padding the sequences into a batch of their own
    (`attends_per_sequence`): its loss and gradients are those of the dense document mask it replaces. On a GPU
    the two take different SDPA kernels (no mask against a mask), so they agree to float32 rounding only, and
    the SSE layers run the torch path: the Triton kernels' TF32 products round the two paths' inputs (1e-7
    apart) to values up to 1e-3 apart, which would hide what this compares (measured: 3e-5 of the gradients)."""
    lengths = (7, 1, 10, 3, 64)
    ids = torch.randint(1, 97, (1, sum(lengths)), device=device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)

    def loss_and_grads(model):
        loss = model.to(device)(ids, position_ids=positions, labels=ids).loss
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    per_sequence = loss_and_grads(model_for(name, sse_impl="chunk_torch_varlen").train())
    monkeypatch.setattr(packing, "attends_per_sequence", lambda *args: False)  # back to the [L, L] mask
    document_mask = loss_and_grads(model_for(name, sse_impl="chunk_torch_varlen").train())
    assert rel_err(per_sequence[0], document_mask[0]) < 1e-5
    assert rel_err(per_sequence[1], document_mask[1]) < 1e-5


@pytest.mark.parametrize("name", list(BASELINES))
def test_incremental_decoding_equals_full_forward(name):
    """Greedy generation on a left-padded batch: each step's logits equal a full forward over the same tokens."""
    model = model_for(name)
    ids, mask = left_padded([torch.randint(1, 97, (n,)) for n in (9, 4, 6)])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    full_mask = torch.cat([mask, torch.ones(3, 12, dtype=torch.long)], 1)
    full = model(out.sequences, attention_mask=full_mask, use_cache=False).logits
    T = ids.shape[1]
    for step, step_logits in enumerate(out.logits):
        assert torch.allclose(step_logits, full[:, T - 1 + step], atol=1e-4), (name, step)


def test_generation_state_is_float32_under_bfloat16():
    model = model_for("sse_n4k2").to(torch.bfloat16)
    ids = torch.randint(1, 97, (2, 6))
    out = model(ids, use_cache=True)
    state = out.past_key_values.sse_state(0)
    assert state.dtype == torch.float32
    assert state.shape == (2, 2, 5, 16, 16)
    step = model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    assert step.logits.dtype == torch.bfloat16 and torch.isfinite(step.logits).all()


def test_paper_2b_parameter_counts():
    with torch.device("meta"):
        model = SSEForCausalLM(SSEConfig.from_preset("paper_2b"))
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    assert abs(total / 2.0e9 - 1) < 0.05, total
    assert abs((total - embedding) / 1.3e9 - 1) < 0.05, total - embedding


def test_sse_parameters_do_not_grow_with_partitions_beyond_the_router():
    def count(n):
        with torch.device("meta"):
            model = SSEForCausalLM(SSEConfig.from_preset("paper_2b", sse_num_partitions=n))
        return sum(p.numel() for p in model.parameters())

    cfg = SSEConfig.from_preset("paper_2b")
    n_sse = cfg.layer_types.count(SSE_LAYER)
    assert count(16) - count(4) == (16 - 4) * cfg.hidden_size * n_sse


def test_fresh_shared_partition_starts_from_the_routed_projections():
    """The shared partition's LoRA up-projections start at zero, so q_shared = q and k_shared = k at init."""
    layer = model_for("sse_n4k2").model.layers[0].linear_attn
    assert torch.count_nonzero(layer.q_shared_up.weight) == 0 and torch.count_nonzero(layer.k_shared_up.weight) == 0
    assert layer.q_shared_down.weight.abs().sum() > 0


def test_router_logits_are_float32_whatever_the_compute_dtype():
    """The router's logits are x @ W.T in float32 from the layer's own x and W: in a bf16 model (the bf16 values
    multiplied exactly), and under bf16 autocast of a float32 model (not rounded through bf16 as the other
    projections are)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64)
    bf16 = model_for("sse_n4k2").to(torch.bfloat16).model.layers[0].linear_attn
    logits = bf16.project(x.bfloat16())[0]["router_logits"]
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(x.bfloat16().float(), bf16.router.weight.float()))
    fp32 = model_for("sse_n4k2").model.layers[0].linear_attn
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inputs, gate = fp32.project(x)
    assert inputs["q"].dtype == gate.dtype == torch.bfloat16 and inputs["router_logits"].dtype == torch.float32
    assert rel_err(inputs["router_logits"], F.linear(x, fp32.router.weight)) < 1e-6


@pytest.mark.gpu
def test_router_logits_on_cuda_are_one_gemm_with_float32_output(monkeypatch):
    """On CUDA a bf16 model's router logits come from one GEMM of the bf16 x and W with float32 output when no
    gradient is recorded (`kernels.float32_router`), and are the float32 product up to the order of its sum; with a
    gradient to record they come from the float32 copies as on the CPU."""
    torch.manual_seed(0)
    x = torch.randn(3, 257, 2048, device="cuda").bfloat16()
    w = torch.randn(4, 2048, device="cuda").bfloat16()
    want = F.linear(x.double(), w.double())
    calls = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(k.get("out_dtype")) or mm(*a, **k))
    fast = kernels.float32_router(x, w)
    assert calls == [torch.float32]
    recorded = kernels.float32_router(x.requires_grad_(), w)
    assert calls == [torch.float32] and recorded.requires_grad
    for logits in (fast, recorded):
        assert logits.dtype == torch.float32 and logits.shape == (3, 257, 4)
        assert rel_err(logits, want) < 1e-6


@pytest.mark.parametrize("lora, padded", [(3, False), (0, False), (3, True)])
def test_input_projections_gradients_in_float64(lora, padded):
    """The fused input projections' hand-written backward is the derivative of its forward (gradcheck over x and every
    weight and bias, with and without the shared partition's low-rank terms, and with pad tokens, whose v it
    zeroes). The node itself: the public function pads the decay logits with +inf, where differences are NaN."""
    from kernels.modules.projections import _InputProjections
    torch.manual_seed(0)
    D, H, c, dv, N, r = 6, 2, 3, 2, 3, 2

    def t(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    shared = (t(lora, D), t(H * c, lora), t(lora, D), t(H * c, lora)) if lora else (None,) * 4
    pad = torch.tensor([[True, False, False], [False, False, True]])[..., None, None] if padded else None
    args = (t(2, 3, D), H, pad, t(H * c, D), t(H * c), t(H * c, D), t(H * c), t(H * dv, D), t(H * dv), t(H * dv, D),
            t(H * dv), t(N, D), t(r, D), t(H * c, r), t(H * c), *shared)
    assert torch.autograd.gradcheck(lambda *a: [y for y in _InputProjections.apply(*a)[:8]
                                                if y is not None], args)


def test_input_projections_refuse_weights_modified_in_place():
    """The projections keep their weights by reference (`kernels.kept_weights`), not as saved tensors: a weight
    changed in place between the forward and the backward (an optimizer step in between) is refused as autograd
    refuses a modified saved tensor; changed before the forward, it is simply the weight."""
    layer = SSEForCausalLM(tiny_config()).model.layers[0].linear_attn
    x = torch.randn(2, 5, 64, requires_grad=True)
    inputs, gate = layer.project(x)
    with torch.no_grad():
        layer.k_proj.weight.mul_(1.5)
    with pytest.raises(RuntimeError, match=r"weight 2 of .* modified by an in-place operation"):
        (inputs["k_logits"].sum() + gate.sum()).backward()
    layer.zero_grad()
    inputs, gate = layer.project(x)  # the same modified weight, now before the forward
    (inputs["k_logits"].sum() + gate.sum()).backward()
    assert layer.k_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_input_projections_match_the_modules(dtype, autocast):
    """One autograd node for all of the SSE layer's input projections gives what the layer's modules give under
    autograd (`projections_by_modules`): the same outputs (the wide ones and the router bit for bit) and gradients
    in every input's dtype that differ by the order x's gradient is summed in (float32, bf16, and a float32 model
    under bf16 autocast)."""
    torch.manual_seed(0)
    layer = SSEForCausalLM(tiny_config(sse_qkv_bias=True, sse_gate_bias=True)).model.layers[0].linear_attn.to(dtype)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(2, 7, 64, dtype=dtype)
    weights = [p for name, p in layer.named_parameters() if not name.startswith(("o_norm", "o_proj"))]
    dys = None
    results = []
    for by_modules in (False, True):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext():
            if by_modules:
                outs = layer.projections_by_modules(leaf)
            else:
                outs = kernels.sse_input_projections(leaf, layer.num_heads, layer.projection_weights())
        dys = dys or [torch.randn_like(o) for o in outs]
        grads = torch.autograd.grad(outs, [leaf, *weights], dys)
        results.append((outs, grads))
    (outs, grads), (want_outs, want_grads) = results
    for i, (a, b) in enumerate(zip(outs, want_outs)):
        assert a.dtype == b.dtype
        assert torch.equal(a, b) if i in (0, 1, 2, 3, 7) else rel_err(a, b) < 1e-5 + 1e-2 * (a.dtype != torch.float32)
    tolerance = 1e-5 if dtype == torch.float32 and not autocast else 2e-2
    for a, b in zip(grads, want_grads):
        assert a.dtype == b.dtype and a.shape == b.shape and rel_err(a, b) < tolerance


def test_wrapped_projections_run_their_own_forward():
    """A projection wrapped by an adapter (as PEFT wraps q_proj) is not a plain nn.Linear: the layer runs the
    modules, so the adapter's output is what the operator gets, and no low-rank term is kept as a recipe."""
    class Adapter(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base, self.weight = base, base.weight

        def forward(self, x):
            return self.base(x) * 2.0

    torch.manual_seed(0)
    layer = model_for("sse_n4k2").model.layers[0].linear_attn
    x = torch.randn(2, 5, 64)
    recipes = []
    plain = layer.project(x, recipes=recipes)[0]
    assert len(recipes) == 3  # the decay logits, the shared partition's q and key logits
    layer.q_proj = Adapter(layer.q_proj)
    recipes = []
    wrapped = layer.project(x, recipes=recipes)[0]
    assert recipes == []
    assert torch.equal(wrapped["q"], 2.0 * plain["q"]) and torch.equal(wrapped["v"], plain["v"])


# flex_attention runs on CPU without gradients; flash attention needs a GPU (pytest -m gpu).
ATTENTION_IMPLEMENTATIONS = ["sdpa", "flex_attention", pytest.param("flash_attention_2", marks=pytest.mark.gpu)]


def with_attention(name, attn_implementation):
    """(model under `attn_implementation`, the same weights under eager attention, tolerance); flash attention
    runs in bfloat16 on the GPU."""
    device, dtype, tolerance = "cpu", torch.float32, 1e-5
    if attn_implementation.startswith("flash"):
        # an optional package (the GPU node's wheelhouse has none): transformers refuses the implementation without it
        pytest.importorskip("flash_attn", reason="flash_attention_2 needs the flash-attn package")
        device, dtype, tolerance = "cuda", torch.bfloat16, 2e-2
    models = []
    for implementation in (attn_implementation, "eager"):
        model = model_for(name).to(device, dtype)
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        models.append(model)
    return *models, tolerance


@pytest.mark.parametrize("name", ["sse_n4k2", "transformer"])
@pytest.mark.parametrize("attn_implementation", ATTENTION_IMPLEMENTATIONS)
@torch.no_grad()
def test_attention_implementations_match_eager(name, attn_implementation):
    """Unpadded batch, left-padded batch (real tokens only) and a packed row: the same logits as eager attention."""
    model, eager, tolerance = with_attention(name, attn_implementation)
    device = model.device
    ids = torch.randint(1, 97, (3, 13), device=device)
    assert rel_err(model(ids).logits, eager(ids).logits) < tolerance

    ids, mask = left_padded([torch.randint(1, 97, (n,)) for n in (12, 5, 1)])
    ids, mask = ids.to(device), mask.to(device)
    real = mask.bool()
    padded_logits = model(ids, attention_mask=mask).logits[real]
    assert rel_err(padded_logits, eager(ids, attention_mask=mask).logits[real]) < tolerance

    lengths = (7, 1, 10)
    packed = torch.randint(1, 97, (1, sum(lengths)), device=device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    packed_logits = model(packed, position_ids=positions).logits
    assert rel_err(packed_logits, eager(packed, position_ids=positions).logits) < tolerance
    # and no sequence sees the one before it
    assert rel_err(packed_logits[:, 8:], eager(packed[:, 8:]).logits) < tolerance


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["sse_n4k2", "transformer"])
@pytest.mark.parametrize("attn_implementation", ["eager", *ATTENTION_IMPLEMENTATIONS])
@torch.no_grad()
def test_attention_implementations_decode_like_eager(request, name, attn_implementation, padded):
    """Cached greedy generation: every step's logits equal eager attention's full forward (no cache) over the same
    tokens."""
    if padded and attn_implementation == "flex_attention":
        # Qwen3 fails the same way: the padding mask with a cache offset does not compile on CPU.
        request.applymarker(pytest.mark.xfail(raises=InductorError, strict=True,
                                              reason="torch 2.13's CPU flex attention kernel fails to compile"))
    model, eager, tolerance = with_attention(name, attn_implementation)
    lengths = (9, 4, 6) if padded else (9, 9, 9)
    ids, mask = left_padded([torch.randint(1, 97, (n,)) for n in lengths])
    ids, mask = ids.to(model.device), mask.to(model.device)
    steps = 6
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    full_mask = torch.cat([mask, torch.ones_like(mask[:, :steps])], 1)
    full = eager(out.sequences, attention_mask=full_mask, use_cache=False).logits
    T = ids.shape[1]
    assert len(out.logits) == steps
    for step, step_logits in enumerate(out.logits):
        assert rel_err(step_logits, full[:, T - 1 + step]) < tolerance, step


def recording(seen, attention_function):
    """`attention_function`, noting the mask and the position ids each call gets."""
    def record(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs.get("position_ids")))
        return attention_function(module, query, key, value, attention_mask, **kwargs)
    return record


@pytest.mark.parametrize("name", ["sse_n4k2", "transformer"])
def test_sdpa_gets_no_mask_for_an_unpadded_batch(monkeypatch, name):
    """Prefill and cached decoding of an unpadded batch leave causality to SDPA's is_causal: no [B, 1, T, S]
    mask is built, so SDPA can take its flash kernel."""
    seen = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", recording(seen, sdpa_attention_forward))
    model = model_for(name)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(1, 97, (2, 11))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    n_attention = model.config.layer_types.count(ATTENTION_LAYER)
    assert len(seen) == 3 * n_attention
    assert all(mask is None for mask, _ in seen)

    seen.clear()
    ids, mask = left_padded([torch.randint(1, 97, (n,)) for n in (6, 3)])
    model(ids, attention_mask=mask)
    assert [mask.shape for mask, _ in seen] == [(2, 1, 6, 6)] * n_attention  # padding does need the library's mask


def test_flash_attention_gets_packed_rows_through_position_ids(monkeypatch):
    """The CPU half of the flash path: a packed row reaches the flash_attention_2 function with no mask and with
    position ids that split it where the sequences start (flash attention's varlen cu_seqlens)."""
    seen = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", recording(seen, sdpa_attention_forward))
    model = model_for("sse_n4k2")
    monkeypatch.setattr(model.config, "_attn_implementation_internal", "flash_attention_2")
    lengths = (7, 1, 10)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    model(torch.randint(1, 97, (1, sum(lengths))), position_ids=positions)
    assert len(seen) == 1
    mask, position_ids = seen[0]
    assert mask is None
    (cu_seqlens, _), _ = prepare_fa_kwargs_from_position_ids(position_ids)
    assert cu_seqlens.tolist() == [0, 7, 8, 18]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["sse_n4k2", "transformer"])
def test_gradient_checkpointing_gives_the_same_gradients(name, reentrant):
    """With use_cache at its default (on), checkpointed layers must not write a cache twice on recompute. Reentrant
    checkpointing (which TRL forces for PEFT under DeepSpeed ZeRO-3) takes the layers' keyword arguments bound."""
    ids = torch.randint(1, 97, (2, 13))
    grads = []
    for checkpointing in (False, True):
        model = model_for(name).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert rel_err(grads[1], grads[0]) < 1e-5


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_model_trains_as_eager(device, checkpointing, monkeypatch):
    """torch.compile of the model (TRL's `torch_compile`) gives the eager step's loss and gradients, and never
    traces an SSE layer: the layers run eagerly inside the compiled model (traced on an H200, the step ended in an
    illegal memory access). CPU: dynamo and AOTAutograd without code generation (aot_eager); GPU: inductor, which
    compiles the RMSNorms' torch twin where eager runs their Triton kernel: the SSE kernels' TF32 products turn
    those 1e-7 differences into up to 1e-3 (measured: 1.2e-4 of the gradients)."""
    traced = []
    real = modeling_sse.kernels.sse_attention

    def recorded(*args, **kwargs):
        traced.append(torch.compiler.is_compiling())
        return real(*args, **kwargs)
    monkeypatch.setattr(modeling_sse.kernels, "sse_attention", recorded)
    ids = torch.randint(1, 97, (2, 40), device=device)
    steps = []
    for compiled in (False, True):
        model = model_for("sse_n4k2").to(device).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compiled:
            torch._dynamo.reset()
            model.compile(backend="inductor" if device == "cuda" else "aot_eager")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        steps.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    torch._dynamo.reset()
    assert traced and not any(traced)
    assert rel_err(steps[1][0], steps[0][0]) < 1e-5
    assert rel_err(steps[1][1], steps[0][1]) < (1e-3 if device == "cuda" else 1e-5)


@pytest.mark.parametrize("kwargs, offload, replays", [
    ({"use_reentrant": False}, False, True),
    ({"use_reentrant": True}, False, False),  # checkpoint takes no context_fn there
    ({"use_reentrant": False, "context_fn": "caller's"}, False, False),  # e.g. selective checkpointing: kept
    ({"use_reentrant": False}, True, False),  # the kept outputs would stay on the GPU
], ids=["non-reentrant", "reentrant", "caller-context", "offload"])
def test_checkpointed_sse_layers_replay_the_operator_where_checkpoint_allows(kwargs, offload, replays, monkeypatch):
    """Under transformers' non-reentrant checkpointing each SSE layer's checkpoint gets the `contexts` of a
    `kernels.CheckpointReplay` of its own, which the layer passes to its operator (the indexed operator's
    recomputation replays the first forward: tests/test_triton_kernels.py), the attention layers' nothing; a
    reentrant checkpoint, the caller's own context_fn or transformers' offloading keeps checkpoint as given. Each
    trains (offloading needs pinned memory)."""
    from torch.utils import checkpoint as torch_checkpoint
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    if kwargs.get("context_fn") == "caller's":
        kwargs = dict(kwargs, context_fn=lambda: create_selective_checkpoint_contexts([]))
    given, operator_replays = [], []
    real, real_attention = torch_checkpoint.checkpoint, kernels.sse_attention

    def recorded(fn, *args, **kw):
        replay = getattr(kw.get("context_fn"), "__self__", None)
        given.append(replay if isinstance(replay, kernels.CheckpointReplay) else None)
        return real(fn, *args, **kw)
    # transformers calls checkpoint through the name it imported; the model compares with torch's
    monkeypatch.setattr(modeling_utils, "checkpoint", recorded)
    monkeypatch.setattr(torch_checkpoint, "checkpoint", recorded)
    monkeypatch.setattr(kernels, "sse_attention",
                        lambda *a, replay, **kw: operator_replays.append(replay) or real_attention(*a, **kw))
    model = model_for("sse_n4k2").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, offload=offload)
    assert kernels.CheckpointReplay.applies_to(model.model._gradient_checkpointing_func) == replays
    if offload:  # its pinned host memory needs an accelerator to run
        return
    ids = torch.randint(1, 97, (2, 13))
    model(input_ids=ids, labels=ids).loss.backward()
    sse = [t == SSE_LAYER for t in model.config.layer_types]
    assert [r is not None for r in given] == [replays and s for s in sse], given
    assert len(set(map(id, filter(None, given)))) == sum(r is not None for r in given)  # one replay per layer call
    # each SSE layer's operator got its checkpoint's replay, in the forward and (in reverse) in the recomputation
    layer_replays = [r for r in given if r is not None]
    assert operator_replays == (layer_replays + layer_replays[::-1] if replays else [None] * len(operator_replays))
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("lora", [4, 0])
def test_cheap_inputs_are_recomputed_in_the_backward_bit_for_bit(dtype, padded, lora, monkeypatch):
    """The SSE layer keeps its decay logits, shared-partition q / key logits and W_o's input as recipes
    (`recomputed_when_saved`) where its operator or W_o saves them: the backward makes them again, and every
    gradient equals the one of a layer that kept them. An outer saved-tensor hook (as gradient checkpointing
    installs) turns the recipes off. Which of the operator's inputs a path saves as they are is the path's own (the
    Triton path's, all: tests/test_triton_kernels.py); W_o always saves its input, so the output step runs again
    and its output's memory is free between the forward and the backward. (Recipes apply above
    RECIPES_ABOVE_BYTES; this layer's tensors are tiny, so the bar is lowered to every size.)"""
    monkeypatch.setattr("kernels.modules.recompute.RECIPES_ABOVE_BYTES", -1)
    torch.manual_seed(0)
    layer = SSEForCausalLM(tiny_config(sse_lora_rank=lora)).model.layers[0].linear_attn.to(dtype)
    x = torch.randn(2, 9, 64, dtype=dtype)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    dy = torch.randn(2, 9, 64, dtype=dtype)
    norm_gate, calls = kernels.norm_gate, []

    def counted(*args, **kwargs):  # keeps a weak reference to the output's memory
        y = norm_gate(*args, **kwargs)
        calls.append(y.untyped_storage()._weak_ref())
        return y
    monkeypatch.setattr(kernels, "norm_gate", counted)

    def grads(recompute):
        calls.clear()
        leaf = x.clone().requires_grad_()
        identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with contextlib.nullcontext() if recompute else identity:
            y, _ = layer(leaf, token_mask=mask if padded else None)
        made, freed = len(calls), torch.UntypedStorage._expired(calls[0])
        out = torch.autograd.grad(y, [leaf, *layer.parameters()], dy, allow_unused=True)
        return out, (made, len(calls) - made, freed)

    kept, counts = grads(recompute=False)
    assert counts == (1, 0, False)
    recomputed, counts = grads(recompute=True)
    assert counts == (1, 1, True)  # W_o's input freed after the forward, made again in the backward
    for a, b in zip(recomputed, kept):
        assert (a is None and b is None) or torch.equal(a, b)


def test_recipes_up_to_their_size_bar_are_kept(monkeypatch):
    """Up to RECIPES_ABOVE_BYTES (the recipes' tensors together) the block keeps them: no saved-tensor hook, the
    backward makes nothing again; one byte above, it does."""
    x = torch.randn(4, 8, requires_grad=True)
    made = []

    def recipe():
        made.append(1)
        return x.detach() * 2
    for bar, remade in ((x.numel() * 4, 0), (x.numel() * 4 - 1, 1)):
        made.clear()
        monkeypatch.setattr("kernels.modules.recompute.RECIPES_ABOVE_BYTES", bar)
        y = x * 2  # 128 bytes
        with kernels.recomputed_when_saved([(y, recipe)]):
            z = y.sin().sum()  # sin saves y
        z.backward()
        assert len(made) == remade


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_step_is_the_norm_then_the_gate(dtype):
    """The HF layer's fused output step (`kernels.norm_gate`, its torch twin on CPU) is o_norm then
    `sse_math.gated_output`, the modules the vLLM model runs, bit for bit, gradients included."""
    from sse_model import sse_math
    torch.manual_seed(0)
    layer = SSEForCausalLM(tiny_config()).model.layers[0].linear_attn.to(dtype)
    layer.o_norm.weight.data.normal_()
    x, o = torch.randn(2, 7, 64, dtype=dtype), torch.randn(2, 7, 2, 16, dtype=dtype, requires_grad=True)
    gate = layer.g_proj(x).view(2, 7, 2, 16)
    fused = layer.output(o, gate)
    plain = layer.o_proj(sse_math.gated_output(layer.o_norm(o), gate).reshape(2, 7, -1))
    assert torch.equal(fused, plain)
    dy = torch.randn_like(fused)
    wrt = (o, layer.o_norm.weight)
    for a, b in zip(torch.autograd.grad(fused, wrt, dy), torch.autograd.grad(plain, wrt, dy)):
        assert torch.equal(a, b)
