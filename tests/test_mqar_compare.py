"""The recall comparison (docs/retrieval.md, "Three-way comparison"): the configs/mqar_*.yaml runs differ only in
architecture and have matched parameter counts, and bench/recall.py turns their eval outputs into the table,
the paired differences and the plot."""
import json
from pathlib import Path

import pytest

from bench import recall as mqar_compare
from pipeline.config import load_config, resolve

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
VARIANTS = {
    "mqar_sse.yaml": {"layer_types": ["linear_attention"] * 2, "intermediate_size": 352},
    "mqar_gla.yaml": {"sse_num_partitions": 1, "sse_top_k": 1, "sse_shared_partition": False,
                      "intermediate_size": 390},
    "mqar_transformer.yaml": {"layer_types": ["full_attention"] * 2, "intermediate_size": 417},
    "mqar_sse_dense.yaml": {"sse_top_k": 4},
    "mqar_gla_pure.yaml": {"layer_types": ["linear_attention"] * 2, "sse_num_partitions": 1, "sse_top_k": 1,
                           "sse_shared_partition": False, "intermediate_size": 363},
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_differ_from_sse_h_only_in_architecture(name):
    base = resolve(load_config(CONFIGS / "mqar_sse_h.yaml"))
    variant = resolve(load_config(CONFIGS / name))
    assert variant["model"]["config"] == {**base["model"]["config"], **VARIANTS[name]}
    for d in (base, variant):
        d.pop("name"), d["model"].pop("config")
    assert variant == base


def test_parameter_counts_match_within_one_percent():
    from sse_model.configuration_sse import SSEConfig
    from sse_model.modeling_sse import SSEForCausalLM

    counts = {}
    for name in ["mqar_sse_h.yaml", *VARIANTS]:
        model = SSEForCausalLM(SSEConfig(vocab_size=512, **load_config(CONFIGS / name).model.config))
        counts[name] = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert max(counts.values()) / min(counts.values()) < 1.01, counts


def fake_run(root: Path, name: str, correct: dict[int, list[bool]]) -> None:
    """A run folder as the eval stage leaves it (eval.models: [sft]), one query per problem."""
    from eval.metrics import recall_metrics

    out = root / name / "eval" / "sft"
    out.mkdir(parents=True)
    samples = [{"id": f"p{pairs}-{i}", "sample": 0, "correct": ok, "num_pairs": pairs, "context_length": 26,
                "task": "mqar", "query_correct": [ok]} for pairs, oks in correct.items() for i, ok in enumerate(oks)]
    (out / "mqar-2-12.samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (out / "metrics.json").write_text(json.dumps({"mqar-2-12": recall_metrics([[s] for s in samples])}))
    # The manifest holds the driver's time of the whole stage; the worker's result.json its last attempt only.
    (root / name / "manifest.json").write_text(json.dumps(
        {"stages": {"init": {"state": "done"}, "sft": {"state": "done", "seconds": 12.5}}}))
    (root / name / "sft").mkdir()
    (root / name / "sft" / "result.json").write_text(json.dumps({"status": "done", "seconds": 3.0}))


def test_compare_writes_table_differences_and_plot(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    fake_run(runs, "mqar-zoology-transformer", {4: [True] * 40, 16: [True] * 40})
    fake_run(runs, "mqar-zoology-sse-h", {4: [True] * 40, 16: [True] * 20 + [False] * 20})
    fake_run(runs, "mqar-zoology-gla", {4: [True] * 39 + [False], 16: [False] * 40})
    (runs / "mqar-zoology-sse").mkdir()  # a run whose eval stage has not finished
    monkeypatch.setattr("bench.baseline.RESULTS", tmp_path / "results")
    result = mqar_compare.main(["--runs", str(runs), "--out", str(tmp_path / "out"), "--tag", "t", "--baseline"])
    assert list(result["runs"]) == ["Transformer", "SSE-H", "GLA"]  # absent and unfinished runs are left out
    sse = result["runs"]["SSE-H"]
    assert [(g["num_pairs"], g["accuracy"]) for g in sse["by_num_pairs"]] == [(4, 1.0), (16, 0.5)]
    assert sse["seconds"] == {"sft": 12.5} and sse["parameters"] is None
    verdicts = {(d["a"], d["b"], d["num_pairs"]): (round(d["difference"], 3), d["verdict"])
                for d in result["differences"]}
    assert verdicts[("Transformer", "SSE-H", 16)] == (0.5, "a > b")
    assert verdicts[("Transformer", "SSE-H", 4)] == (0.0, "overlap")
    assert verdicts[("SSE-H", "GLA", 16)] == (0.5, "a > b")
    assert verdicts[("SSE-H", "GLA", 4)][1] == "overlap"
    assert not any(d["b"] == "SSE-H dense (K = N)" for d in result["differences"])
    md = (tmp_path / "out" / "recall_t.md").read_text()
    assert "| SSE-H | mqar-zoology-sse-h |  | 12 |  | 75.0 (" in md
    assert "| Transformer | SSE-H | 16 | 40 | +50.0 (" in md
    assert "| copying level | | | | | | 25.0 | 6.2 |" in md  # 1 / n at 4 and 16 pairs
    assert (tmp_path / "out" / "recall_t.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "out" / "recall_t.json").read_text())["differences"] == result["differences"]
    # --baseline: a row per model, with its plot beside it
    baseline = json.loads((tmp_path / "results" / "recall_mqar.json").read_text())
    assert [r["model"] for r in baseline["rows"]] == ["Transformer", "SSE-H", "GLA"]
    assert (tmp_path / "results" / "recall_mqar.png").read_bytes()[:4] == b"\x89PNG"
