"""The eval stage's state diagnostics: `sse_model.diagnostics.state_entropy` on the evaluated problems, each
prompt followed by the model's first sample, as a per-layer, per-partition table (`state.md`) and metrics."""
import json
import math

import torch

from eval.runner import samples_path
from tasks import prompts
from tasks.loaders import code_token_ids, load_benchmark


def state_report(model_dir: str, datasets: list, out_dir, problems: int) -> dict[str, list[list[float]]] | None:
    """{dataset: [SSE layer][partition] entropy in nats} over the first `problems` problems of each dataset
    (written to out_dir/state.md), or None for a model without SSE layers."""
    from transformers import AutoTokenizer

    from sse_model import SSEConfig, SSEForCausalLM
    from sse_model.configuration_sse import SSE_LAYER
    from sse_model.diagnostics import state_entropy
    if SSE_LAYER not in SSEConfig.from_pretrained(model_dir).layer_types:
        return None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = SSEForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    report = {}
    for spec in datasets:
        name, rows = load_benchmark(spec, problems)
        first = {}
        with open(samples_path(out_dir, name)) as f:
            for line in f:
                sample = json.loads(line)
                first.setdefault(sample["id"], sample["completion"])
        if "sequence" in rows.column_names:  # Zoology-format MQAR: the model read the whole code sequence
            sequences = [code_token_ids(tokenizer, row["sequence"]) for row in rows if row["id"] in first]
        else:
            sequences = [prompts.prompt_token_ids(tokenizer, row["prompt"])
                         + tokenizer(first[row["id"]], add_special_tokens=False)["input_ids"]
                         for row in rows if row["id"] in first]  # eval.limit may have left fewer problems
        if sequences:
            report[name] = state_entropy(model, sequences).tolist()
    (out_dir / "state.md").write_text(markdown(report, model.config) + "\n")
    return report


def markdown(report: dict, config) -> str:
    from sse_model.configuration_sse import SSE_LAYER
    layer_ids = [i for i, kind in enumerate(config.layer_types) if kind == SSE_LAYER]
    c = min(config.sse_key_dim, config.sse_value_dim)
    partitions = [f"p{i}" for i in range(config.sse_num_partitions)] + ["shared"] * config.sse_shared_partition
    lines = [f"Singular-value entropy (nats, at most ln {c} = {math.log(c):.2f}) of each "
             "SSE partition's state after prompt + first sample, mean over heads and problems "
             "(docs/retrieval.md, \"State diagnostics\"); 0 = a partition nothing was routed to."]
    for name, layers in report.items():
        lines += ["", f"| {name}: layer | " + " | ".join(partitions) + " |",
                  "| --- |" + " ---: |" * len(partitions)]
        lines += [f"| {layer} | " + " | ".join(f"{h:.2f}" for h in row) + " |" for layer, row in zip(layer_ids, layers)]
    return "\n".join(lines)
