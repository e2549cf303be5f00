"""bench/train_step.py's rounds: the models timed in turn, order reversed every other round, and SSE-H's ratio to
the fastest Qwen3 taken round by round (the timings themselves need a GPU node)."""
import types

import pytest
import torch

from bench import train_step


@pytest.fixture
def timed(monkeypatch):
    """`measure` replaced by a log of the calls; each model's tokens/s per round from `speeds`."""
    calls, speeds = [], {}

    def fake(build, T, packed, checkpointing, steps):
        name = build()
        calls.append(name)
        speed = speeds[name][sum(c == name for c in calls) - 1]
        if speed is None:
            raise torch.OutOfMemoryError("fake")
        return dict(tokens_per_s=speed, peak_gib=speed / 1e4, step_ms=[T / speed * 1e3] * steps, host_ms=[1.0] * steps)
    monkeypatch.setattr(train_step, "measure", fake)
    builds = {name: (lambda name=name: name) for name in ("SSE-H", "Qwen3-flex", "Qwen3-fused-norm")}
    return builds, calls, speeds


def test_rounds_alternate_and_pair(timed):
    builds, calls, speeds = timed
    speeds.update({"SSE-H": [100.0, 90.0, 120.0], "Qwen3-flex": [50.0, 95.0, 60.0],
                   "Qwen3-fused-norm": [80.0, 60.0, 100.0]})
    out = train_step.rounds(builds, 8192, False, False, steps=2, count=3)
    assert calls == ["SSE-H", "Qwen3-flex", "Qwen3-fused-norm", "Qwen3-fused-norm", "Qwen3-flex", "SSE-H",
                     "SSE-H", "Qwen3-flex", "Qwen3-fused-norm"]
    # each round against that round's fastest Qwen3 (flex in round 2, fused-norm in rounds 1 and 3)
    assert out["paired"] == [1.25, round(90 / 95, 3), 1.2]
    assert out["SSE-H"]["tokens_per_s"] == 100.0 and out["SSE-H"]["rounds"] == [100, 90, 120]
    assert out["Qwen3-flex"]["peak_gib"] == pytest.approx(95 / 1e4)
    assert len(out["SSE-H"]["step_ms"]) == 6


def test_a_model_out_of_memory_in_any_round_has_no_figure(timed):
    builds, _, speeds = timed
    speeds.update({"SSE-H": [100.0, 100.0], "Qwen3-flex": [50.0, None], "Qwen3-fused-norm": [None, None]})
    out = train_step.rounds(builds, 32768, True, False, steps=1, count=2)
    assert out["Qwen3-flex"] is None and out["Qwen3-fused-norm"] is None
    assert "paired" not in out


def test_a_timing_alone_runs_the_script_in_a_process_of_its_own(monkeypatch):
    """`measure_alone` runs this script with --alone MODEL and the configuration, and reads the timing from the
    last line it prints; a null there is an out-of-memory, a failed process an error with its stderr."""
    import subprocess
    ran, replies = [], ['{"tokens_per_s": 5.0}', "null"]

    def fake_run(argv, **kwargs):
        ran.append(argv)
        if len(ran) == 3:
            return subprocess.CompletedProcess(argv, 1, "", "Traceback: boom")
        return subprocess.CompletedProcess(argv, 0, f"compiling...\n{replies[len(ran) - 1]}\n", "")
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert train_step.measure_alone("SSE-H", 8192, True, False, 4) == {"tokens_per_s": 5.0}
    assert ran[0][1:] == ["-m", "bench.train_step", "--alone", "SSE-H", "--lengths", "8192", "--steps", "4", "--packed"]
    with pytest.raises(torch.OutOfMemoryError):
        train_step.measure_alone("Qwen3-flex", 32768, False, True, 4)
    assert ran[1][-1] == "--checkpointing"
    with pytest.raises(RuntimeError, match="boom"):
        train_step.measure_alone("SSE-H", 8192, False, False, 4)


def test_interleaved_alternates_single_steps_and_pairs_them(monkeypatch):
    """`interleaved`: every model prepared once and warmed up, then one step each in turn, the order reversed every
    other turn; each step is a round of its own, so SSE-H is paired with the Qwen3 steps of its turn."""
    steps = {"SSE-H": [0.5, 0.4, 0.5], "Qwen3-flex": [1.0, 0.8, 1.0], "Qwen3-fused-norm": [0.5, 0.5, 0.4]}
    calls = []

    def fake_prepared(build, T, packed, checkpointing):
        return build(), {"T": T}

    def fake_step(name, kwargs):
        calls.append(name)
        turn = sum(c == name for c in calls) - 2  # -1 for the warm-up step
        return (1.0, 0.1) if turn < 0 else (steps[name][turn], 0.1)
    monkeypatch.setattr(train_step, "prepared", fake_prepared)
    monkeypatch.setattr(train_step, "timed_step", fake_step)
    builds = {name: (lambda name=name: name) for name in steps}
    out = train_step.interleaved(builds, 1000, False, True, steps=3)
    order = ["SSE-H", "Qwen3-flex", "Qwen3-fused-norm"]
    assert calls == order + order + order[::-1] + order
    assert out["SSE-H"]["rounds"] == [2000, 2500, 2000] and out["SSE-H"]["tokens_per_s"] == 2000
    assert out["SSE-H"]["peak_gib"] is None and out["SSE-H"]["host_ms"] == [100.0] * 3
    assert out["paired"] == [1.0, 1.25, 0.8]  # fused-norm is the faster Qwen3 in every turn


def test_interleaved_out_of_memory_gives_no_figures(monkeypatch):
    def fake_prepared(build, T, packed, checkpointing):
        if build() == "Qwen3-flex":
            raise torch.OutOfMemoryError("fake")
        return build(), {}
    monkeypatch.setattr(train_step, "prepared", fake_prepared)
    monkeypatch.setattr(train_step, "timed_step", lambda model, kwargs: (1.0, 0.1))
    builds = {name: (lambda name=name: name) for name in ("SSE-H", "Qwen3-flex")}
    assert train_step.interleaved(builds, 32768, True, False, steps=2) == {"SSE-H": None, "Qwen3-flex": None}


def test_interleave_takes_neither_alone_nor_rounds():
    for flags in (["--alone"], ["--rounds", "3"]):
        with pytest.raises(SystemExit):
            train_step.main(["--interleave", *flags])


def test_compile_builds_models_that_compile_on_their_first_call():
    model = train_step.compiled(lambda: torch.nn.Linear(2, 2))()
    assert isinstance(model, torch.nn.Linear) and model._compiled_call_impl is not None
    with pytest.raises(SystemExit):
        train_step.main(["--compile", "--alone"])


def test_split_times_the_step_asked_for(monkeypatch):
    """`split` with checkpointing measures and prepares the checkpointed step (its table says which), and lists the
    GPU-bound forward and backward, the idle time and the host's queueing per model."""
    asked = []

    class FakeModel:
        def __call__(self, **kwargs):
            return types.SimpleNamespace(loss=types.SimpleNamespace(backward=lambda: None))

        def zero_grad(self, set_to_none):
            pass

    def fake_measure(build, T, packed, checkpointing, steps):
        asked.append(("measure", packed, checkpointing))
        return {"step_ms": [60.0, 62.0, 64.0]}

    def fake_prepared(build, T, packed, checkpointing):
        asked.append(("prepared", packed, checkpointing))
        return FakeModel(), {}
    monkeypatch.setattr(train_step, "measure", fake_measure)
    monkeypatch.setattr(train_step, "prepared", fake_prepared)
    monkeypatch.setattr(train_step, "gpu_bound", lambda model, kwargs, steps: ([(20.0, 40.0)], [(5.0, 10.0)]))
    monkeypatch.setattr(train_step, "timeline", lambda model, kwargs: [(1.0, 1.5)])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    lines = train_step.split({"SSE-H": lambda: None}, 8192, steps=3, checkpointing=True)
    assert asked == [("measure", False, True), ("prepared", False, True)]
    assert lines[0] == "## T = 8192, unpacked, checkpointing on"
    assert "| SSE-H | 62.00 | 60.00 (20.00 + 40.00) | 2.00 | 5.00 / 10.00 |" in lines


def test_free_mixing_layers_mix_no_tokens_and_train_every_projection(monkeypatch):
    """The bound's free layers: a token's output depends on that token alone (the attention layer after them mixes),
    and every parameter gets a gradient, the queries' and keys' projections zero ones (their backward still runs)."""
    tiny = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                vocab_size=100)
    for key, value in tiny.items():
        monkeypatch.setitem(train_step.SHAPE, key, value)
    torch.manual_seed(0)
    model = train_step.free_mixing(train_step.qwen3("sdpa"), layers=range(5))
    ids = torch.randint(0, 100, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    free, mixing = model.model.layers[0].self_attn, model.model.layers[5].self_attn
    assert free.q_proj.weight.grad.abs().max() == 0 and free.v_proj.weight.grad.abs().max() > 0
    assert mixing.q_proj.weight.grad.abs().max() > 0

    outputs = {}
    for i in (0, 5):
        model.model.layers[i].register_forward_hook(lambda m, args, out, i=i: outputs.__setitem__(i, out))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 100
    with torch.no_grad():
        model(input_ids=ids)
        before = dict(outputs)
        model(input_ids=changed)
    moved = {i: (before[i] - outputs[i]).abs().amax(-1)[0].nonzero().flatten().tolist() for i in (0, 5)}
    assert moved[0] == [10] and moved[5] == list(range(10, 32))


def test_paired_gives_sse_and_the_faster_bound_over_the_fastest_qwen3_round_by_round():
    def run(*rounds):
        return dict(rounds=list(rounds))
    out = train_step.paired({"SSE-H": run(90, 120), "free-mixing-bound": run(150, 100),
                             "free-mixing-bound-flex": run(120, 160), "Qwen3-fused-norm": run(100, 80),
                             "Qwen3-flex-fused-norm": run(75, 100)})
    assert out["paired"] == [0.9, 1.2] and out["bound"] == [1.5, 1.6]
    out = train_step.paired({"SSE-H": run(90), "free-mixing-bound": None, "Qwen3": run(100)})
    assert out["paired"] == [0.9] and "bound" not in out  # a bound that ran out of memory bounds nothing
