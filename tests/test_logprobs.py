"""TRL's fused LM head as the pipeline tiles it (`trainer.logprob_chunk_tokens` x `trainer.logprob_chunk_vocab`,
`pipeline.trl_seams.set_logprob_chunks`): per-token log-probabilities and entropies, and their gradients, equal the
unchunked [T, V] float32 computation within float32 rounding, with tiles small enough that both the tokens and the
vocabulary are split; and a training loss never materialises a [T, V] float32 tensor."""
import pytest
import torch
import trl.kernels.chunked_logprob
import trl.trainer.utils
from trl.trainer.utils import add_fused_lm_head

from pipeline.trl_seams import set_logprob_chunks
from sse_model import SSEConfig, SSEForCausalLM

VOCAB, T = 1000, 40


@pytest.fixture
def chunks():
    saved = trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE, trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
    set_logprob_chunks(16, 128)  # 40 tokens in 3 tiles, 1000 entries in 8
    yield
    set_logprob_chunks(*saved)


def model():
    torch.manual_seed(0)
    return SSEForCausalLM(SSEConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=32, sse_num_heads=2, sse_balance_loss_coef=0.0,
                                    max_position_embeddings=256))


def test_chunked_logprobs_entropy_and_gradients_equal_the_full_logits(chunks):
    fused, plain = model(), model()
    add_fused_lm_head(fused, outputs=("log_probs", "entropy"))
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    out = fused(input_ids=ids, labels=labels, fused_lm_head=True)
    logits = plain(input_ids=ids).logits[:, :-1].float()
    logp = logits.log_softmax(-1)
    mask = labels[:, 1:] != -100
    want = logp.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0] * mask
    entropy = -(logp.exp() * logp).sum(-1) * mask
    torch.testing.assert_close(out.log_probs, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy * mask, entropy, rtol=1e-5, atol=1e-5)
    (out.log_probs.sum() + 0.1 * (out.entropy * mask).sum()).backward()
    (want.sum() + 0.1 * entropy.sum()).backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_fused_loss_never_materialises_full_logits(chunks):
    """The largest float32 tensor of a loss forward and backward is far below [T, V]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    Largest.biggest = max(Largest.biggest, t.numel())
            return out

    fused = model()
    add_fused_lm_head(fused, outputs=("log_probs", "entropy"))
    ids = torch.randint(0, VOCAB, (1, 4 * T), generator=torch.Generator().manual_seed(2))  # [T, V] > the head
    with Largest():
        fused(input_ids=ids, labels=ids, fused_lm_head=True).loss.backward()
    assert VOCAB * 64 <= Largest.biggest < (4 * T - 1) * VOCAB  # the largest: the head's weight and its gradient
