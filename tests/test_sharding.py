"""`trainer.sharding: fsdp` on CPU: two gloo ranks (spawned here; Ray Train would add a minute of start-up on two
cores) train the pipeline's SFT trainer with FSDP2 and must give the loss, gradient norm and weights of one unsharded
rank that sees the same batches, within float32 rounding; the push iterator the GRPO generation hands vLLM gathers
full parameters equal to the trained ones, one at a time.

Two settings make that comparison exact rather than close. `bf16=False`, as the pipeline sets on CPU
(`common_training_args`): TRL's configs default to bf16, which accelerate turns into FSDP2's bfloat16 parameter and
gradient-reduce dtype while the unsharded rank keeps float32, so the sharded run would be a different computation.
Adam's epsilon far above the gradients: Adam's step is invariant to the gradient's scale, so a loss normalised wrongly
across ranks would not show in the weights, and its 1/sqrt(v) amplifies the rounding of small gradient entries (a
sum over one batch of 4 or two of 2) into differences far above float32 rounding; with a large epsilon the step is
nearly linear in the gradient, and the optimizer state is still Adam's, sharded."""
import os
import socket
import types

import pytest
import torch
import torch.multiprocessing as mp
from datasets import Dataset
from transformers import TrainerCallback

from tiny_checkpoints import byte_bpe_tokenizer

STEPS, PER_RANK, SEQ = 3, 2, 24


def tiny_model():
    import sse_model  # noqa: F401
    from sse_model import SSEConfig, SSEForCausalLM

    torch.manual_seed(0)
    config = SSEConfig(vocab_size=len(byte_bpe_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                       num_key_value_heads=2, head_dim=32, sse_num_heads=2, max_position_embeddings=64,
                       # the balance loss is a function of a micro-batch's partition usage, so two ranks' halves
                       # differ from one rank's whole batch under DDP just as under FSDP: off, to compare sharding
                       sse_balance_loss_coef=0.0)
    return SSEForCausalLM(config)


class Losses(TrainerCallback):
    """The loss and the gradient norm (before clipping) logged at every step."""

    def __init__(self, losses: list):
        self.losses = losses

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.losses.append((logs["loss"], logs["grad_norm"]))


def rows(n: int) -> Dataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (n, SEQ), generator=g)
    return Dataset.from_list([{"input_ids": r.tolist(), "labels": r.tolist()} for r in ids])


def train(out: str, world: int, sharding: str, **extra) -> dict:
    """The SFT stage's trainer for STEPS steps of PER_RANK * 2 sequences in all; the loss logged at every step, the
    full weights after, and (sharded) what the GRPO push iterator yields."""
    from trl import SFTConfig
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    from pipeline.stages.sft import SSESFTTrainer
    from pipeline.training import sharding_args

    cfg = types.SimpleNamespace(trainer=types.SimpleNamespace(sharding=sharding))
    losses = []
    args = SFTConfig(output_dir=out, per_device_train_batch_size=PER_RANK * 2 // world, max_steps=STEPS,
                     learning_rate=1e-2, lr_scheduler_type="constant", use_cpu=True, report_to=[], logging_steps=1,
                     save_strategy="no", disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0,
                     bf16=False, adam_epsilon=1.0, **sharding_args(cfg), **extra)
    trainer = SSESFTTrainer(model=tiny_model(), args=args, train_dataset=rows(PER_RANK * 2 * STEPS),
                            processing_class=byte_bpe_tokenizer(), callbacks=[Losses(losses)])
    trainer.train()
    model = trainer.model
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}
    generation = VLLMGeneration.__new__(VLLMGeneration)  # only the push iterator, no engine
    generation.model, generation.accelerator = model, trainer.accelerator
    generation._dist = DistributedBackend(trainer.accelerator)
    pushed = [(name, tensor.clone()) for name, tensor in generation._iter_named_params()]
    return {"losses": losses, "weights": full, "pushed": pushed, "fsdp": trainer.is_fsdp_enabled,
            "local": {n: tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
                      for n, p in model.named_parameters()},
            "adam": sum(v.numel() for s in trainer.optimizer.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim() > 0 and not hasattr(v, "to_local"))
            + sum(v.to_local().numel() for s in trainer.optimizer.state.values() for v in s.values()
                  if hasattr(v, "to_local"))}


def rank_main(rank: int, port: int, out: str, sharding: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = train(os.path.join(out, "run"), world=2, sharding=sharding)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(tmp_path_factory, sharding: str) -> list[dict]:
    out = str(tmp_path_factory.mktemp(sharding))
    mp.spawn(rank_main, args=(free_port(), out, sharding), nprocs=2)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    single = train(str(tmp_path_factory.mktemp("single")), world=1, sharding="none")
    return two_ranks(tmp_path_factory, "fsdp"), single


@pytest.mark.parametrize("sharding", ["fsdp", "none"])
def test_two_ranks_train_like_one_rank(runs, tmp_path_factory, sharding):
    sharded, single = runs
    ranks = sharded if sharding == "fsdp" else two_ranks(tmp_path_factory, "none")  # "none": DDP
    assert all(r["fsdp"] == (sharding == "fsdp") for r in ranks) and not single["fsdp"]
    assert len(single["losses"]) == STEPS
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(single["losses"]), rtol=1e-6, atol=0)
        assert r["weights"].keys() == single["weights"].keys()
        for name, w in single["weights"].items():  # the weights move by about 1e-3 in these steps
            torch.testing.assert_close(r["weights"][name], w, rtol=1e-6, atol=1e-7, msg=name)
    if sharding == "none":
        return
    # each rank holds about half of every parameter and of the Adam state
    total = sum(w.numel() for w in single["weights"].values())
    for r in ranks:
        local = sum(torch.Size(s).numel() for s in r["local"].values())
        assert local <= total / 2 + 64 and r["adam"] <= total + 128, (local, r["adam"], total)
    assert single["adam"] == 2 * total


def test_push_gathers_full_parameters_one_at_a_time(runs):
    sharded, single = runs
    from sse_model.vllm.sync import expected_shapes

    names = [n for n, _ in sharded[0]["pushed"]]
    assert names == list(single["weights"]) and set(names) == set(expected_shapes(tiny_model().config))
    assert all(not hasattr(t, "to_local") for _, t in sharded[0]["pushed"])
    for r in sharded:
        for name, tensor in r["pushed"]:
            assert torch.equal(tensor, r["weights"][name]), name  # the full parameter, not the rank's shard
    torch.testing.assert_close(sharded[0]["weights"], sharded[1]["weights"], rtol=0, atol=0)


@pytest.mark.parametrize("distributed_type", ["FSDP", "MULTI_CPU"])  # as accelerate leaves a GPU rank, a CPU rank
def test_sharded_gradients_are_reduced_in_float32_under_bf16(distributed_type):
    """bf16 gives FSDP2 bfloat16 gathered parameters; the gradients are still summed over the ranks in float32."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from pipeline.trl_seams import ShardedStateMixin

    class Trainer:
        def create_accelerator_and_postprocess(self):
            plugin = None
            if distributed_type == "FSDP":
                plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                plugin.set_mixed_precision("bf16")
            state = types.SimpleNamespace(distributed_type=DistributedType[distributed_type], fsdp_plugin=plugin,
                                          mixed_precision="bf16")
            self.accelerator = types.SimpleNamespace(state=state)

    class Sharded(ShardedStateMixin, Trainer):
        args = types.SimpleNamespace(fsdp_plugin_args={"fsdp_version": 2})

    shared = dict(PartialState._shared_state)
    try:
        trainer = Sharded()
        trainer.create_accelerator_and_postprocess()
    finally:
        PartialState._shared_state.clear()
        PartialState._shared_state.update(shared)
    policy = trainer.accelerator.state.fsdp_plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
