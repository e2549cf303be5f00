"""SILA's token-weighted SFT loss (docs/retrieval.md, "SILA's training tools"): per-token weights from a reference
Transformer's attention, computed once per prepared dataset and cached in the stage directory.

For token j of an example, over every layer l, head h and later query i of the reference (eager attention):

    s_j = sum over l, h, i > j of [A_lhij > threshold] * A_lhij * (i - j),   s_0 = 0 (the attention sink),
    w_j = log(1 + s_j),

then w is scaled so that the example's loss terms weigh 1 on average. A token that later tokens read strongly and
from far away weighs more: it is one the model has to keep in its state. The loss term of input position p (the
step that writes token p into the state and predicts token p + 1) gets w_p. Training blends the weights with 1 as
(1 - e^(-step/tau)) w + e^(-step/tau) (`pipeline.trl_seams.TokenWeightedLossMixin`), so it starts as plain
next-token prediction.

The cache file is keyed by a hash of the examples' token ids and labels, the reference checkpoint (its files' names,
sizes and modification times) and the threshold, so a resumed run reads the weights back instead of recomputing.
"""
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.files import write_atomic

# Attention probabilities held per layer and head while scoring a batch: batch * T * T stays under this, so long
# examples go one at a time.
ATTENTION_BUDGET = 1 << 22
MAX_BATCH = 64


def attention_scores(attn: torch.Tensor, threshold: float, query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probabilities [B, H, T, T] (query i, key j) -> [B, T]: per key j, the sum over heads and later
    queries i > j of the probabilities above `threshold` times the distance i - j. `query_mask` [B, T] (1 = real
    token) leaves out pad queries."""
    T = attn.shape[-1]
    pos = torch.arange(T, device=attn.device)
    distance = (pos[:, None] - pos[None, :]).clamp(min=0).float()  # 0 on and above the diagonal
    kept = torch.where(attn > threshold, attn.float(), 0.0)
    if query_mask is not None:
        kept = kept * query_mask[:, None, :, None].float()
    return torch.einsum("bhij,ij->bj", kept, distance)


def weights_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """Summed scores [..., T] -> log(1 + s) with the sink column (position 0) set to 0."""
    scores = scores.clone()
    scores[..., 0] = 0
    return torch.log1p(scores)


def normalise(weights: torch.Tensor, labels: list[int]) -> torch.Tensor:
    """Scale one example's weights so that its loss terms (position p where label p + 1 is not -100) weigh 1 on
    average; an example whose loss terms all weigh 0 gets weight 1 everywhere."""
    terms = torch.tensor(labels[1:]) != -100
    mean = weights[:-1][terms].mean() if terms.any() else weights.new_zeros(())
    return weights / mean if mean > 0 else torch.ones_like(weights)


@torch.no_grad()
def reference_weights(model, examples: list[list[int]], threshold: float) -> list[torch.Tensor]:
    """w (before normalisation) of every token of each example under `model`, which must run eager attention
    (its attention modules, `*.self_attn`, return the probabilities)."""
    layers = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    state = {}

    def add_scores(module, args, output):
        if not isinstance(output, tuple) or output[1] is None:
            raise ValueError("the reference's attention returned no probabilities: load it with "
                             "attn_implementation='eager'")
        state["scores"] += attention_scores(output[1], threshold, state["mask"])

    hooks = [m.register_forward_hook(add_scores) for m in layers]
    if not hooks:
        raise ValueError(f"the reference {type(model).__name__} has no softmax attention (no *.self_attn modules)")
    device = next(model.parameters()).device
    out = [None] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]))
    try:
        while order:
            longest = len(examples[order[min(len(order), MAX_BATCH) - 1]])
            size = max(1, min(MAX_BATCH, ATTENTION_BUDGET // longest ** 2))
            batch, order = order[:size], order[size:]
            T = max(len(examples[i]) for i in batch)
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            mask = torch.zeros(len(batch), T, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, :len(examples[i])] = torch.tensor(examples[i])
                mask[row, :len(examples[i])] = 1
            state["scores"] = torch.zeros(len(batch), T, device=device)
            state["mask"] = mask.to(device)
            model(input_ids=ids.to(device), attention_mask=state["mask"])
            for row, i in enumerate(batch):
                out[i] = weights_from_scores(state["scores"][row, :len(examples[i])]).cpu()
    finally:
        for h in hooks:
            h.remove()
    return out


@dataclass(frozen=True)
class TokenWeighting:
    """`sft.token_weights` resolved for a run: the reference checkpoint, the threshold and tau, and the folder that
    caches the weights."""

    reference: str
    threshold: float
    tau: float
    cache_dir: Path

    def for_dataset(self, input_ids: list[list[int]], labels: list[list[int]], tokenizer, device) -> list[list[float]]:
        """Normalised weights of every token of each prepared example, from the cache when it has them."""
        path = self.cache_dir / f"token-weights-{self._key(input_ids, labels)}.pt"
        if path.exists():
            saved = torch.load(path, weights_only=True)
            return [w.tolist() for w in saved["weights"].split(saved["lengths"].tolist())]
        reference = self._load_reference(tokenizer, device)
        weights = [normalise(w, lab) for w, lab in
                   zip(reference_weights(reference, input_ids, self.threshold), labels)]
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        saved = io.BytesIO()
        torch.save({"weights": torch.cat(weights), "lengths": torch.tensor([len(w) for w in weights])}, saved)
        write_atomic(path, saved.getvalue())
        return [w.tolist() for w in weights]

    def _load_reference(self, tokenizer, device):
        # Weights are per token of the SFT model's tokenization, so the reference must read the same tokens.
        if AutoTokenizer.from_pretrained(self.reference).get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"sft.token_weights.reference {self.reference}: its tokenizer differs from the SFT "
                             "model's (the weights are per token of the SFT data)")
        model = AutoModelForCausalLM.from_pretrained(self.reference, dtype=torch.float32,
                                                     attn_implementation="eager")
        return model.to(device).eval()

    def _key(self, input_ids, labels) -> str:
        h = hashlib.sha256(f"{self.threshold!r}\n{reference_fingerprint(self.reference)}\n".encode())
        for ids, lab in zip(input_ids, labels):
            h.update(torch.tensor(ids).numpy().tobytes() + b"|" + torch.tensor(lab).numpy().tobytes() + b"\n")
        return h.hexdigest()[:20]


def reference_fingerprint(reference: str) -> str:
    """The checkpoint's identity for the cache key: its files' names, sizes and modification times (a hub id: the
    id itself)."""
    path = Path(reference)
    if not path.is_dir():
        return reference
    files = sorted(p for p in path.iterdir() if p.is_file())
    return f"{path.resolve()}:" + ",".join(f"{p.name}={p.stat().st_size}@{p.stat().st_mtime_ns}" for p in files)


class TokenWeightCollator:
    """Wraps TRL's collator: batches the `token_weights` column like it batches `input_ids` (right-padded with 0,
    or concatenated into one row for padding-free batches)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples):
        weights = [torch.tensor(e["token_weights"], dtype=torch.float32) for e in examples]
        batch = self.collator([{k: v for k, v in e.items() if k != "token_weights"} for e in examples])
        rows = [torch.cat(weights)] if getattr(self.collator, "padding_free", False) else weights
        width = batch["input_ids"].shape[1]
        batch["token_weights"] = torch.stack([F.pad(w, (0, width - len(w))) for w in rows])
        return batch
