"""SILA's training tools (docs/retrieval.md, "SILA's training tools"): the token weights from a reference's attention,
their schedule in the SFT loss, their cache, their config checks, and attention-output alignment after conversion."""
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig

from pipeline import token_weights as tw
from pipeline.config import ConfigError, load_config
from pipeline.stages.sft import SSESFTTrainer
from sse_model.configuration_sse import SSE_LAYER
from sse_model.convert import align_sse_layers, attention_activations, calibration_text, convert, convert_main
from tiny_checkpoints import tiny_source

SMALL = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random Qwen3 (character tokenizer with a chat template) and its SSE-H conversion (layers 1 and 3 kept)."""
    root = tmp_path_factory.mktemp("sila")
    tiny_source("qwen3", root / "source", seed=0, **SMALL)
    convert(root / "source", root / "sse", attention_every=2, calibration_tokens=0, device="cpu")
    return root


def loop_weights(attn, threshold):
    """The weights as written in the docs: a loop over layers, heads, queries and keys."""
    L, H, T = attn.shape[0], attn.shape[1], attn.shape[-1]
    s = [0.0] * T
    for j in range(1, T):  # key 0 is the sink
        for layer in range(L):
            for h in range(H):
                for i in range(j + 1, T):
                    a = float(attn[layer, h, i, j])
                    if a > threshold:
                        s[j] += a * (i - j)
    return torch.tensor([math.log(1 + x) for x in s])


def test_weights_match_a_direct_loop():
    g = torch.Generator().manual_seed(0)
    T = 9
    causal = torch.ones(T, T).tril().bool()
    logits = torch.randn(3, 1, 2, T, T, generator=g) * 2  # layers, batch, heads, queries, keys
    attn = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    for threshold in (0.0, 0.1, 0.3):
        scores = sum(tw.attention_scores(a, threshold) for a in attn)
        torch.testing.assert_close(tw.weights_from_scores(scores)[0], loop_weights(attn[:, 0], threshold))
    # Pad queries count for nothing: the scores of a prefix equal the scores with the rest masked out.
    mask = torch.tensor([[1] * 6 + [0] * 3])
    masked = sum(tw.attention_scores(a, 0.1, mask) for a in attn)
    torch.testing.assert_close(masked[0, :6], sum(tw.attention_scores(a[..., :6, :6], 0.1) for a in attn)[0])

    w = torch.tensor([0.0, 1.0, 3.0, 2.0, 0.5])
    labels = [-100, -100, -100, 7, 8]  # the loss terms are positions 2 and 3
    assert tw.normalise(w, labels)[2:4].mean().item() == pytest.approx(1.0)
    assert torch.equal(tw.normalise(torch.zeros(5), labels), torch.ones(5))


def test_reference_weights_batch_like_single_examples(source):
    reference = AutoModelForCausalLM.from_pretrained(source / "source", attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    examples = [torch.randint(5, 60, (n,), generator=g).tolist() for n in (11, 4, 17)]
    batched = tw.reference_weights(reference, examples, threshold=0.05)
    for ids, w in zip(examples, batched):
        with torch.no_grad():
            attentions = reference(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        scores = sum(tw.attention_scores(a, 0.05) for a in attentions)
        torch.testing.assert_close(w, tw.weights_from_scores(scores)[0], atol=1e-5, rtol=1e-5)


def sft_trainer(root, tmp_path, weighting, **args):
    tokenizer = AutoTokenizer.from_pretrained(root / "sse")
    model = AutoModelForCausalLM.from_pretrained(root / "sse", dtype=torch.float32)
    rows = [{"prompt": [{"role": "user", "content": f"copy {w}"}], "completion": [{"role": "assistant",
                                                                                   "content": f"{w}>{w}."}]}
            for w in ("abc", "hello", "xy", "pqrstuv")]
    config = SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, use_cpu=True, report_to=[],
                       completion_only_loss=True, **{"max_length": 128, **args})
    return SSESFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         token_weights=weighting)


def batch_loss(trainer, step):
    trainer.state.global_step = step
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    return trainer.compute_loss(trainer.model, dict(batch)).detach(), batch  # with gradients, as in training


def test_weighted_loss_schedule(source, tmp_path):
    weighting = tw.TokenWeighting(reference=str(source / "source"), threshold=0.05, tau=10.0, cache_dir=tmp_path)
    plain = sft_trainer(source, tmp_path, None)
    weighted = sft_trainer(source, tmp_path, weighting)
    loss, batch = batch_loss(plain, 0)
    assert "token_weights" not in batch
    weighted_loss, batch = batch_loss(weighted, 0)
    assert torch.equal(weighted_loss, loss)  # step 0: exactly plain next-token prediction

    # Later: each loss term of input position p times (1 - e^(-step/tau)) w_p + e^(-step/tau), with TRL's
    # normalisation (the number of loss tokens, the balance term on top).
    weighted_loss, batch = batch_loss(weighted, 30)
    out = weighted.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logp = out.logits[:, :-1].log_softmax(-1)
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    token_logp = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
    decay = math.exp(-3.0)
    scale = (1 - decay) * batch["token_weights"][:, :-1] + decay
    expected = -(scale * token_logp).sum() / mask.sum() + weighted.model.config.sse_balance_loss_coef * \
        out.balance_loss
    torch.testing.assert_close(weighted_loss, expected.detach(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(weighted_loss, batch_loss(plain, 30)[0])

    # Padding-free batches (one concatenated row) carry the same weights to the same terms.
    free = sft_trainer(source, tmp_path, weighting, padding_free=True, max_length=None)
    free_loss, free_batch = batch_loss(free, 30)
    assert free_batch["input_ids"].shape[0] == 1 and free_batch["token_weights"].shape == free_batch["input_ids"].shape
    torch.testing.assert_close(free_loss, weighted_loss, atol=1e-4, rtol=1e-4)


def test_weights_are_cached_with_the_dataset(source, tmp_path, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(source / "sse")
    ids = [[1, 9, 12, 14, 20, 9, 12], [1, 30, 31, 9]]
    labels = [[-100, -100, -100, 14, 20, 9, 12], [-100, -100, 31, 9]]
    calls = []
    compute = tw.reference_weights
    monkeypatch.setattr(tw, "reference_weights", lambda *a, **k: calls.append(1) or compute(*a, **k))
    weighting = tw.TokenWeighting(reference=str(source / "source"), threshold=0.05, tau=10.0, cache_dir=tmp_path)
    first = weighting.for_dataset(ids, labels, tokenizer, "cpu")
    again = tw.TokenWeighting(**{**weighting.__dict__}).for_dataset(ids, labels, tokenizer, "cpu")
    assert calls == [1] and again == first  # a second preparation (a resumed run) reads the cache
    assert [len(w) for w in first] == [7, 4]
    tw.TokenWeighting(**{**weighting.__dict__, "threshold": 0.2}).for_dataset(ids, labels, tokenizer, "cpu")
    weighting.for_dataset([ids[0]], [labels[0]], tokenizer, "cpu")
    assert calls == [1, 1, 1]  # another threshold or other data: computed again
    assert len(list(tmp_path.glob("token-weights-*.pt"))) == 3


BAD = [
    ("sft: {token_weights: {threshold: 0.1}}", "sft.token_weights.reference: required unless model.init is "
     "'convert' (then convert.source is the reference)"),
    ("sft: {token_weights: {reference: r, threshold: 1.0}}", "sft.token_weights.threshold: must be in [0, 1), got 1.0"),
    ("sft: {token_weights: {reference: r, tau: 0}}", "sft.token_weights.tau: must be positive (steps), got 0"),
    ("sft: {token_weights: {reference: r, tua: 5}}", "sft.token_weights.tua: unknown key (did you mean 'tau'?)"),
    ("sft: {token_weights: {reference: r}, packing: true}", "sft.token_weights: cannot be combined with packing "
     "(weights are computed per example); padding_free batches work"),
    ("sft: {token_weights: {reference: r}, loss_type: dft}", "sft.token_weights: weights the nll loss only, got "
     "loss_type 'dft'"),
    ("convert: {align_steps: -1}", "convert.align_steps: must be at least 0 (0: no alignment), got -1"),
    ("convert: {align_steps: 5, align_lr: 0}", "convert.align_lr: must be positive, got 0"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_config_errors_name_file_and_key(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(f"name: t\nmodel: {{tokenizer: {{train: true}}}}\n{text}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: {message}"
    path.write_text("name: t\nstages: [convert, sft]\nmodel: {init: convert}\nconvert: {source: src}\n"
                    "sft: {token_weights: {}}\n")
    assert load_config(path).sft.token_weights.threshold == 0.1  # the convert source is the default reference


def test_alignment_reduces_heldout_error_and_leaves_other_layers(source, tmp_path):
    reference = AutoModelForCausalLM.from_pretrained(source / "source", dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(source / "sse", dtype=torch.float32).eval()
    before = {k: v.clone() for k, v in converted.state_dict().items()}
    sse_layers = [i for i, kind in enumerate(converted.config.layer_types) if kind == SSE_LAYER]
    heldout = calibration_text(reference, 512, seed=7)

    def heldout_mse():
        with torch.no_grad():
            return {i: torch.nn.functional.mse_loss(converted.model.layers[i].linear_attn(x)[0],
                                                    reference.model.layers[i].self_attn.o_proj(o.flatten(-2))).item()
                    for i, (x, o) in attention_activations(reference, heldout, sse_layers).items()}

    start = heldout_mse()
    errors = align_sse_layers(reference, converted, calibration_text(reference, 2048, seed=1), steps=40, lr=3e-3)
    assert set(errors) == set(sse_layers) and all(after < b for b, after in errors.values())
    end = heldout_mse()
    assert all(end[i] < 0.8 * start[i] for i in sse_layers), (start, end)
    changed = {k for k, v in converted.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(any(k.startswith(f"model.layers.{i}.linear_attn.") for i in sse_layers) for k in changed)

    # The CLI flag: the same conversion, aligned, differs in the SSE layers only.
    assert convert_main(["--from", str(source / "source"), "--to", str(tmp_path / "aligned"), "--attention-every",
                         "2", "--calibration-tokens", "0", "--align-steps", "2", "--align-tokens", "256"]) == 0
    aligned = AutoModelForCausalLM.from_pretrained(tmp_path / "aligned", dtype=torch.float32).state_dict()
    differ = {k for k, v in aligned.items() if not torch.equal(v, before[k])}
    assert differ and all(".linear_attn." in k for k in differ)


def test_measurement_config_is_the_recall_recipe_on_a_converted_model():
    """configs/sila_mqar.yaml trains and evaluates on the recall comparison's MQAR, on other SFT rows than the
    source's, from the converted source."""
    recipe = load_config("configs/mqar_sse_h.yaml")
    cfg = load_config("configs/sila_mqar.yaml", ["sft.token_weights={}", "convert.align_steps=200"])
    assert (load_config("configs/sila_mqar.yaml").data.sft.generator.options == recipe.data.sft.generator.options
            == cfg.data.eval[0].generator.options)
    assert cfg.data.eval == recipe.data.eval and cfg.data.sft.generator.seed != recipe.data.sft.generator.seed
    assert cfg.model.init == "convert" and cfg.stages == ["convert", "sft", "eval"]
    assert cfg.sft.token_weights.reference is None and cfg.convert.align_steps == 200
