"""Sequences packed into one row (TRL's padding-free batches): where they start, and where the attention layers
put each token when they attend per sequence."""
import torch


def attends_per_sequence(config, cu_seqlens, token_mask) -> bool:
    """Packed rows with nothing padded, under SDPA, go to `SSEAttention._per_sequence` instead of through the
    [L, L] document mask that create_causal_mask would build for them (SDPA computes every masked pair too). Flash
    attention reads packed rows from the position ids and flex attention gets a block mask: those keep the
    library's path."""
    return cu_seqlens is not None and token_mask is None and config._attn_implementation == "sdpa"


def packed_row_slots(cu_seqlens: torch.Tensor, L: int) -> tuple[torch.Tensor, int, int]:
    """Where each of a packed row's L tokens goes when its sequences are right-padded into a batch of their own:
    (row of the [sequences * longest] layout per token, number of sequences, longest), once per forward for every
    attention layer."""
    lengths = cu_seqlens.diff()
    S, longest = lengths.numel(), int(lengths.max())
    sequence = torch.repeat_interleave(torch.arange(S, device=cu_seqlens.device), lengths, output_size=L)
    return sequence * longest + torch.arange(L, device=cu_seqlens.device) - cu_seqlens[sequence], S, longest


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor | None:
    """cu_seqlens of sequences packed into one row (position ids restarting at 0, as TRL's padding-free
    collator makes), or None when the row holds one sequence."""
    if position_ids is None or position_ids.shape[0] != 1:
        return None
    starts = (position_ids[0] == 0).nonzero().squeeze(1)
    if starts.numel() <= 1 and (starts.numel() == 0 or int(starts[0]) == 0):
        return None
    T = position_ids.shape[1]
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_tensor([T])])
