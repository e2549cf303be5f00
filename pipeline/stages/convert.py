"""Stage `convert`: a pretrained Transformer (Qwen2/Qwen3/Llama) turned into SSE-H (sse_model/convert.py)."""
from sse_model.convert import convert


def run(cfg, run_dir, model_path=None) -> dict:
    c = cfg.convert
    out = run_dir.stage_dir("convert") / "model"
    convert(c.source, out, attention_every=None if c.attention_layers else c.attention_every,
            attention_layers=c.attention_layers, partitions=c.partitions, top_k=c.top_k, lora_rank=c.lora_rank,
            seed=cfg.seed)
    return {"output": str(out), "summary": f"{c.source} -> SSE-H (N={c.partitions}, K={c.top_k})"}
