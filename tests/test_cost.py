"""bench/cost.py: the recipe's GPU-hours from a recipe_memory baseline, by hand on a fixture with the schema
bench/recipe_memory.py writes, and docs/cost.md as the committed baselines give it."""
import json

import pytest

from bench import baseline, cost, recipe_memory
from pipeline.config import load_config

CFG = load_config(cost.RECIPE)
SHAPE = dict(prompts=4, generations=8, micro_batch=2, micro_batches=16, prompt_tokens=1024, max_tokens=32768)
SECONDS = {"push (first)": 20.0, "rollout": 1000.0, "log-probabilities": 100.0, "update": 300.0, "push": 10.0}
COMPONENTS = dict(weights=8, gradients=8, adam=16, root=1, largest_layer=1, largest_parameter=1)


def fixture_baseline(device="NVIDIA H100 80GB HBM3", **changes) -> dict:
    """A recipe_memory baseline as main() writes it: the rows of per_rank (so a change of its schema fails here)."""
    rows = recipe_memory.per_rank([dict(phase=p, seconds=s) for p, s in SECONDS.items()], COMPONENTS, ranks=8)
    return dict(device=device, date="2026-12-01", commit="abc1234", command="python -m bench.recipe_memory",
                title="One rank", rows=rows, components=[], shape=SHAPE) | changes


def test_gpu_hours_of_the_recipe_by_hand():
    m = cost.measured(fixture_baseline(), "recipe_memory_sse_h_2b")
    assert m["kind"] == "H100" and m["seconds"]["update"] == 300.0
    decode, train = 32 * 32768 / 1000, 32 * (1024 + 32768) / 300  # tokens/s per GPU
    assert cost.rates(m) == pytest.approx(dict(decode=decode, train=train))
    r = cost.recipe(CFG)
    assert (r["traces"], r["epochs"], r["steps"], r["prompts"], r["generations"]) == (80000, 5, 230, 32, 8)
    assert sum(r["problems"].values()) == 560 and r["workers"] == dict(sft=8, grpo=8, eval=8)
    h = cost.gpu_hours(m, r)
    ratio = 4.8 / 3.35  # H200 / H100 HBM bandwidth: decoding only
    short = 10 + 1000 * 6000 / 32768 + 400 * (1024 + 6000) / (1024 + 32768)  # one step at a 6,000-token mean
    assert h["SFT"]["H100"] == h["SFT"]["H200"] == pytest.approx(
        (80000 * 5 * 6000 / train / 3600, 80000 * 5 * 10240 / train / 3600))
    assert h["GRPO"]["H100"] == pytest.approx((8 * (230 * short + 20) / 3600, 8 * (230 * 1410 + 20) / 3600))
    assert h["GRPO"]["H200"][1] == pytest.approx(8 * (230 * (1000 / ratio + 410) + 20) / 3600)
    assert h["eval"]["H100"] == pytest.approx((17920 * 6000 / decode / 3600, 17920 * 32768 / decode / 3600))
    assert h["eval"]["H200"][0] == pytest.approx(h["eval"]["H100"][0] / ratio)
    assert h["total"]["H100"][1] == pytest.approx(sum(h[s]["H100"][1] for s in ("SFT", "GRPO", "eval")))
    # measured on an H200: the H100 is derived the other way
    m200 = cost.measured(fixture_baseline(device="NVIDIA H200"), "x")
    assert cost.gpu_hours(m200, r)["eval"]["H100"][0] == pytest.approx(h["eval"]["H100"][0] * ratio)


def test_the_document_fills_in_from_a_baseline_and_names_what_is_missing():
    text = cost.document({"recipe_memory_sse_h_2b": fixture_baseline()}, CFG)
    assert "| step | 1,410 |  | 276 |" in text and "x8 (measured) GPU-hours" in text
    assert "H200 x8 (derived: decoding at 1.43x the speed) GPU-hours" in text and "Missing measurement" not in text
    grpo = "| GRPO | completions of 6,000 tokens / every step at the limit | 141 / 721 | 17.7 / 90.1 | 113 / 566 |"
    assert grpo in text
    empty = cost.document({}, CFG)
    assert "Missing measurement: `bench/results/recipe_memory_sse_h_2b.json` is not committed" in empty
    assert "| GRPO | completions of 6,000 tokens / every step at the limit | needs `recipe_memory_sse_h_2b` |" in empty
    assert "3,800 A100-hours" in empty and "21,504 H800-hours" in empty  # the published recipes stand alone
    cpu = cost.measured(fixture_baseline(device="Intel Xeon, 2 of 2 cores usable"), "recipe_memory_sse_h_2b")
    assert "an H100 or H200 device (it ran on Intel Xeon" in cpu
    no_shape = {k: v for k, v in fixture_baseline().items() if k != "shape"}
    no_shape["rows"] = [r for r in no_shape["rows"] if r["phase"] != "push"]
    assert cost.measured(no_shape, "n").endswith("lacks the `push` row, `shape` (prompts, generations, "
                                                 "prompt_tokens, max_tokens)")
    # another recipe_memory baseline (the all-attention model of the same shape, say) gets its own section
    both = cost.document({"recipe_memory_sse_h_2b": fixture_baseline(),
                          "recipe_memory_attention_2b": fixture_baseline(title="all attention")}, CFG)
    assert "## GPU-hours end to end: recipe_memory_attention_2b" in both and "all attention" in both


def test_recipe_memory_writes_what_the_cost_reads(tmp_path, monkeypatch):
    """The baseline bench.recipe_memory --baseline writes carries the rows and shape bench.cost reads (the
    measurement itself replaced: its phases are the GPU's)."""
    monkeypatch.setattr(baseline, "RESULTS", tmp_path)
    monkeypatch.setattr(baseline, "RUNS", tmp_path / "runs")
    phases = [dict(phase=p, seconds=s) for p, s in SECONDS.items()]
    monkeypatch.setattr(recipe_memory, "measure", lambda *a, **k: dict(phases=phases, components=COMPONENTS,
                                                                       shape=SHAPE))
    recipe_memory.main(["--baseline"])
    written = json.loads((tmp_path / "recipe_memory_sse_h_2b.json").read_text())
    m = cost.measured(dict(written, device="NVIDIA H100 80GB HBM3"), "recipe_memory_sse_h_2b")
    assert m["shape"] == SHAPE and m["seconds"] == SECONDS


def test_docs_cost_is_what_the_committed_baselines_give():
    assert cost.COST.read_text() == cost.document(baseline.load_baselines())
