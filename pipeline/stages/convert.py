"""Stage `convert`: a pretrained Transformer (Qwen2/Qwen3/Llama) turned into SSE-H (sse_model/convert.py)."""
from sse_model.convert import convert


def run(cfg, run_dir, model_path=None) -> dict:
    c = cfg.convert
    out = run_dir.stage_dir("convert") / "model"
    convert(c.source, out, attention_every=None if c.attention_layers else c.attention_every,
            attention_layers=c.attention_layers, partitions=c.partitions, top_k=c.top_k, lora_rank=c.lora_rank,
            align_steps=c.align_steps, align_lr=c.align_lr, align_tokens=c.align_tokens, seed=cfg.seed)
    aligned = f", SSE outputs aligned for {c.align_steps} steps" if c.align_steps else ""
    return {"output": str(out), "summary": f"{c.source} -> SSE-H (N={c.partitions}, K={c.top_k}){aligned}"}
