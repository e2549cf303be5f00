"""SSEConfig: the hybrid of Sparse State Expansion layers and softmax-attention layers.

`layer_types` lists every layer as "linear_attention" (an SSE layer) or "full_attention" (softmax attention),
the convention transformers and vLLM use for hybrids. Two baselines come from the config alone:
GLA (sse_num_partitions=1, sse_top_k=1, sse_shared_partition=False) and a Transformer (every layer attention).
"""
from typing import ClassVar

from transformers import PreTrainedConfig

SSE_LAYER, ATTENTION_LAYER = "linear_attention", "full_attention"
# How the SSE layers' balance terms combine: their mean (the project's), or their sum over K (the SSE authors').
BALANCE_LOSS_NORMS = ("mean_over_layers", "sum_over_layers_div_k")
# Head sizes vLLM's CPU attention accepts; keeping to them lets every checkpoint run in the CPU build too.
ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

PRESETS = {
    # The paper's 2B SSE-H, n4k1: 18 layers, attention at 5, 11, 17, untied 151,936-token vocabulary; the SSE layer is
    # the authors' (flash-linear-attention PR #882 at 741fbbf, fla/layers/sse.py SSEGLA; docs/model.md, "The
    # authors' layer"): SiLU on q and v, the shared partition's own decay gate, low-rank q / k term and output gate of
    # rank head_v_dim (128), balance loss summed over layers and divided by K.
    # MLP width 6912 (3 x hidden) puts the counts at ~1.97B total / ~1.27B non-embedding (paper: ~2B / 1.3B).
    # 40,960 positions: the recipe's 32k-token rollouts after prompts of up to 8k (Qwen3's choice for the same).
    "paper_2b": dict(
        vocab_size=151936, hidden_size=2304, intermediate_size=6912, num_hidden_layers=18,
        layer_types=[ATTENTION_LAYER if i % 6 == 5 else SSE_LAYER for i in range(18)],
        num_attention_heads=18, num_key_value_heads=18, head_dim=128,
        sse_num_heads=18, sse_key_dim=128, sse_value_dim=128, sse_num_partitions=4, sse_top_k=1,
        sse_shared_partition=True, sse_lora_rank=128, tie_word_embeddings=False, max_position_embeddings=40960,
        sse_qv_activation="silu", sse_shared_decay=True, sse_output_gate_rank=128,
        sse_balance_loss_norm="sum_over_layers_div_k",
    ),
}


def default_layer_types(num_layers: int, attention_every: int = 6) -> list[str]:
    """One attention layer after every `attention_every - 1` SSE layers (indices 5, 11, ... for 6)."""
    return [ATTENTION_LAYER if i % attention_every == attention_every - 1 else SSE_LAYER for i in range(num_layers)]


class SSEConfig(PreTrainedConfig):
    model_type = "sse_hybrid"
    keys_to_ignore_at_inference = ["past_key_values"]
    # A config built in code names no remote code (the checkpoints the pipeline writes do: sse_model/hub_code.py).
    # TRL reads `config.auto_map` when it builds GRPO's reference model from a checkpoint (beta > 0), and
    # transformers 5 configs have no such attribute unless remote code set one.
    auto_map: ClassVar[dict] = {}

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 12
    layer_types: list[str] | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # softmax attention layers
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    attention_bias: bool = False
    attention_qk_norm: bool = False
    attention_dropout: float = 0.0
    rope_parameters: dict | None = None
    # SSE layers (docs/model.md); None means "same as the attention layers"
    sse_num_heads: int | None = None
    sse_key_dim: int | None = None
    sse_value_dim: int | None = None
    sse_num_partitions: int = 4
    sse_top_k: int = 1
    sse_shared_partition: bool = True
    sse_lora_rank: int = 64
    sse_row_topk: int | None = None
    sse_decay_rank: int = 16
    sse_decay_normalizer: float = 16.0
    sse_qkv_bias: bool | None = None  # biases on the SSE q/k/v projections; None: as attention_bias
    sse_gate_bias: bool = False  # a bias on g_proj; conversion from Transformers starts the gate at a constant
    sse_balance_loss_coef: float = 0.01
    sse_impl: str = "auto"
    sse_decode_impl: str = "auto"  # kernels.sse_decode implementation (HF generate and the vLLM backend)
    # The SSE authors' layer (docs/model.md, "The authors' layer"; flash-linear-attention PR #882 at 741fbbf,
    # fla/layers/sse.py SSEGLA). The defaults are the project's layer as it was.
    sse_qv_activation: str = "none"   # "silu": SiLU on q (both partitions' q) and v, as SSEGLA
    sse_shared_decay: bool = False    # the shared partition gets its own low-rank decay gate (SSEGLA's gk_proj[0])
    sse_num_readers: int | None = None  # partitions each token reads (num_reader); None: sse_top_k, the ones written
    sse_output_gate_rank: int | None = None  # a low-rank output gate g_up(g_down(x)) of this rank; None: dense g_proj
    sse_balance_loss_norm: str = "mean_over_layers"  # or "sum_over_layers_div_k", the authors' normalisation

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.sse_num_heads = self.sse_num_heads or self.num_attention_heads
        self.sse_key_dim = self.sse_key_dim or self.head_dim
        self.sse_value_dim = self.sse_value_dim or self.head_dim
        if self.sse_qkv_bias is None:
            self.sse_qkv_bias = self.attention_bias
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        super().__post_init__(**kwargs)
        self.check()

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "SSEConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown SSEConfig preset {name!r}; known: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def num_sse_partitions_with_shared(self) -> int:
        return self.sse_num_partitions + int(self.sse_shared_partition)

    # The authors' name for the number of partitions each token writes (num_writer): sse_top_k itself.
    @property
    def sse_num_writers(self) -> int:
        return self.sse_top_k

    @sse_num_writers.setter
    def sse_num_writers(self, value: int):
        self.sse_top_k = value

    @property
    def sse_read_top_k(self) -> int | None:
        """The partitions each token reads when they are not the ones it writes (the operators' `read_top_k`),
        else None."""
        readers = self.sse_num_readers
        return None if readers is None or readers == self.sse_top_k else readers

    def check(self):
        """Fail at construction, naming the field, rather than deep inside a kernel later."""
        def bad(field, why):
            raise ValueError(f"SSEConfig.{field}: {why}")

        if len(self.layer_types) != self.num_hidden_layers:
            bad("layer_types", f"has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}")
        for i, kind in enumerate(self.layer_types):
            if kind not in (SSE_LAYER, ATTENTION_LAYER):
                bad("layer_types", f"entry {i} is {kind!r}; use {SSE_LAYER!r} (SSE) or {ATTENTION_LAYER!r}")
        if ATTENTION_LAYER in self.layer_types:
            if self.head_dim not in ATTENTION_HEAD_DIMS:
                bad("head_dim", f"{self.head_dim} is not an attention head size vLLM runs everywhere "
                    f"{ATTENTION_HEAD_DIMS}")
            if self.num_attention_heads % self.num_key_value_heads:
                bad("num_key_value_heads", f"{self.num_key_value_heads} does not divide "
                    f"num_attention_heads={self.num_attention_heads}")
        if not 1 <= self.sse_top_k <= self.sse_num_partitions:
            bad("sse_top_k", f"must be in [1, sse_num_partitions={self.sse_num_partitions}], got {self.sse_top_k}")
        if self.sse_row_topk is not None and not 1 <= self.sse_row_topk <= self.sse_key_dim:
            bad("sse_row_topk", f"must be in [1, sse_key_dim={self.sse_key_dim}] or null, got {self.sse_row_topk}")
        if self.sse_shared_partition and self.sse_lora_rank < 0:
            bad("sse_lora_rank", f"must be >= 0, got {self.sse_lora_rank}")
        if self.sse_qv_activation not in ("none", "silu"):
            bad("sse_qv_activation", f"must be 'none' or 'silu', got {self.sse_qv_activation!r}")
        if self.sse_shared_decay and not self.sse_shared_partition:
            bad("sse_shared_decay", "needs sse_shared_partition=True (it is the shared partition's decay)")
        if self.sse_num_readers is not None and not 1 <= self.sse_num_readers <= self.sse_num_partitions:
            bad("sse_num_readers", f"must be in [1, sse_num_partitions={self.sse_num_partitions}] or null, "
                f"got {self.sse_num_readers}")
        if self.sse_read_top_k is not None and self.sse_impl.startswith("triton"):
            bad("sse_num_readers", f"{self.sse_num_readers} != sse_top_k={self.sse_top_k} (the partitions written) "
                f"runs only on the torch SSE paths; sse_impl={self.sse_impl!r} reads the partitions it writes")
        if self.sse_output_gate_rank is not None and self.sse_output_gate_rank < 1:
            bad("sse_output_gate_rank", f"must be >= 1 or null, got {self.sse_output_gate_rank}")
        if self.sse_balance_loss_norm not in BALANCE_LOSS_NORMS:
            bad("sse_balance_loss_norm", f"must be one of {BALANCE_LOSS_NORMS}, got {self.sse_balance_loss_norm!r}")
