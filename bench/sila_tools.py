"""SILA's training tools on a small CPU case (docs/retrieval.md, "SILA's training tools"): a tiny Transformer trained
here on MQAR until it recalls, converted to SSE-H, then SFT through the pipeline with and without each tool.

    python bench/sila_tools.py source [--device cpu|cuda] [--steps N]   # the Transformer: runs/sila-source/model
    python bench/sila_tools.py run [--only NAME,...]                      # sse-rl run configs/sila_mqar.yaml per arm
    python bench/sila_tools.py report [--tag DATE]                        # bench/results/sila_tools_<tag>.{md,json}

The task is configs/sila_mqar.yaml's: the recall comparison's MQAR in Zoology's format (256 codes, 4 to 32 pairs,
every key queried, each value a label only; configs/mqar_sse_h.yaml). The source is a Qwen3 of the comparison's
Transformer shape (2 layers, hidden 128, 4 heads of 32, MLP 417) with the tokenizer the pipeline trains for these
rows (one token per code), trained with the loss on the answers only, as the pipeline's SFT: on this format it
binds keys to values by step 750 of its 3000 (docs/retrieval.md), where on the earlier prose format (a chat prompt
and a `\boxed{}` answer; bench/results/sila_tools_2026-11-24.md) a Transformer of this size only ever copied.

Arms (each `sse-rl run configs/sila_mqar.yaml --set ...`: convert, SFT, eval of the converted and the SFT model):
  baseline      conversion with the default calibration, plain SFT
  weights       SFT with `sft.token_weights` (reference: the source Transformer)
  weights-tau20 the same with tau 20 steps instead of 200 (full strength before the baseline's recall returns)
  align         conversion with `convert.align_steps`, plain SFT
  align+weights both
`report` adds, per arm, the held-out answer perplexity and query accuracy of the converted and of the SFT model,
the source's, the SFT loss curve (how soon the arm recovers recall), each SSE layer's error against the attention it
replaced, and each tool's paired difference in the eval's accuracy against the baseline.
"""
import argparse
import datetime
import json
import math
import os
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_name  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from tasks.loaders import code_text, code_token_ids  # noqa: E402
from tasks.retrieval import answer_labels, generate_task  # noqa: E402
from tasks.tokenizer import train_tokenizer  # noqa: E402

CONFIG = ROOT / "configs" / "sila_mqar.yaml"
SOURCE = ROOT / "runs" / "sila-source" / "model"
TRANSFORMER = ROOT / "configs" / "mqar_transformer.yaml"
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "tie_word_embeddings")
ARMS = {
    "baseline": [],
    "weights": ["sft.token_weights={}"],
    # tau 200 (the default) leaves the weights at a third of their strength by step 80, where the baseline binds
    "weights-tau20": ["sft.token_weights={tau: 20}"],
    "align": ["convert.align_steps=200"],
    "align+weights": ["convert.align_steps=200", "sft.token_weights={}"],
}


def task() -> dict:
    """The MQAR options of configs/sila_mqar.yaml (its SFT and eval rows)."""
    return load_config(CONFIG).data.sft.generator.options


def encode(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """Token ids of a row's code sequence and its labels (each query's value at its answer slot), as SFT sees them."""
    ids = code_token_ids(tokenizer, code_text(row["problem"]))
    return ids, answer_labels(ids, row["num_pairs"])


def padded(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """input_ids, attention_mask and labels (-100 off the loss) of a right-padded batch."""
    T = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), T), pad_id)
    labels = torch.full((len(examples), T), -100)
    for row, (seq, lab) in enumerate(examples):
        ids[row, :len(seq)] = torch.tensor(seq)
        labels[row, :len(seq)] = torch.tensor(lab)
    return ids, torch.arange(T) < torch.tensor([len(seq) for seq, _ in examples])[:, None], labels


@torch.no_grad()
def evaluate_lm(model, tokenizer, rows: list[dict], device="cpu", batch=64) -> dict:
    """Held-out perplexity per answer (the SFT loss's terms) and per-query accuracy, teacher-forced: the share of
    queries whose value is the model's greedy prediction at the query (the eval stage's measure), by pairs."""
    examples = [encode(tokenizer, r) for r in rows]
    nll, right = 0.0, {}
    for start in range(0, len(examples), batch):
        part = examples[start:start + batch]
        ids, mask, labels = padded(part, tokenizer.pad_token_id)
        logits = model(input_ids=ids.to(device), attention_mask=mask.long().to(device)).logits.float().cpu()
        logits, labels = logits[:, :-1], labels[:, 1:]  # the prediction at a query is its answer slot's label
        on = labels != -100
        nll -= logits.log_softmax(-1)[on].gather(-1, labels[on][:, None]).sum().item()
        hits = logits.argmax(-1) == labels
        for row in range(len(part)):
            right.setdefault(rows[start + row]["num_pairs"], []).extend(hits[row][on[row]].tolist())
    queries = sum(len(r) for r in right.values())
    return {"perplexity_answer": math.exp(nll / queries),
            "query_accuracy": sum(map(sum, right.values())) / queries,
            "query_accuracy_by_num_pairs": {p: sum(r) / len(r) for p, r in sorted(right.items())}}


def train_source(args) -> dict:
    """The tiny Transformer: a Qwen3 trained on MQAR rows of seed `args.seed` (the arms' SFT rows have another
    seed), the loss on the answers only, saved with its tokenizer to `args.out` (its accuracy log beside it)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    torch.manual_seed(args.seed)
    options = task()
    train = generate_task("mqar", args.steps * args.batch, args.seed, "train", options)
    heldout = generate_task("mqar", 400, args.seed + 1, "test", options)
    # The comparison's Transformer: its shape, and the tokenizer its init stage trains on its SFT rows.
    recipe = load_config(TRANSFORMER)
    shape = {k: recipe.model.config[k] for k in SHAPE_KEYS}
    tokenizer = train_tokenizer((code_text(r["problem"]) for r in train[:recipe.data.sft.generator.num_examples]),
                                vocab_size=recipe.model.tokenizer.vocab_size,
                                model_max_length=shape["max_position_embeddings"])
    config = Qwen3Config(
        vocab_size=len(tokenizer), **shape,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    random.Random(args.seed).shuffle(train)
    warmup = max(1, args.steps // 20)
    log, started = [], time.time()
    for step in range(args.steps):
        for group in optimizer.param_groups:  # linear warmup over 5 %, cosine decay: the SFT recipe's schedule
            group["lr"] = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        rows = train[step * args.batch:(step + 1) * args.batch]
        ids, mask, labels = padded([encode(tokenizer, r) for r in rows], tokenizer.pad_token_id)
        loss = model(input_ids=ids.to(args.device), attention_mask=mask.long().to(args.device),
                     labels=labels.to(args.device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            log.append({"step": step + 1, "loss": loss.item(), "seconds": round(time.time() - started, 1),
                        **evaluate_lm(model, tokenizer, heldout, args.device)})
            model.train()
            print(json.dumps(log[-1]), flush=True)
    out = Path(args.out)
    model.eval().to("cpu").save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    summary = {"device": args.device, "steps": args.steps, "batch": args.batch, "lr": args.lr,
               "seconds": round(time.time() - started, 1),
               "parameters": sum(p.numel() for p in model.parameters()), "log": log}
    (out.parent / "source.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.tar:
        with tarfile.open(args.tar, "w:gz") as tar:
            tar.add(out.parent, arcname=out.parent.name)
    return summary


def run_arms(args) -> None:
    """`sse-rl run configs/sila_mqar.yaml` per arm, skipping finished runs."""
    source = Path(args.source).resolve()
    for arm in args.only.split(",") if args.only else ARMS:
        sets = [f"name=sila-{arm.replace('+', '-')}", f"convert.source={source}", *ARMS[arm]]
        command = [str(ROOT / ".venv" / "bin" / "sse-rl"), "run", str(CONFIG), *[a for s in sets for a in ("--set", s)]]
        print(" ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=ROOT)


def load_arm(run_dir: Path, heldout: list[dict]) -> dict:
    """An arm's eval results for the converted and the SFT model, the held-out answer perplexity of both, stage
    times."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sse_model  # noqa: F401  (registers sse_hybrid)
    from bench.mqar_compare import stage_seconds

    out = {"run": run_dir.name, "seconds": stage_seconds(run_dir)}
    for model in ("convert", "sft"):
        path = run_dir / model / ("model" if model == "convert" else "final")
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        lm_result = evaluate_lm(lm, AutoTokenizer.from_pretrained(path), heldout)
        out[model] = {**eval_results(run_dir / "eval" / model), "perplexity_answer": lm_result["perplexity_answer"]}
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out["sft_loss"] = {r["step"]: r["loss"] for r in logged if r.get("stage") == "sft" and "loss" in r}
    manifest = json.loads((run_dir / "manifest.json").read_text())
    out["summaries"] = {stage: info.get("summary") for stage, info in manifest["stages"].items()}
    return out


@torch.no_grad()
def mixer_errors(source, converted, ids) -> dict[int, float]:
    """Per SSE layer: mean squared error between its output and the replaced attention's (after o_proj), both fed
    the source's hidden states on `ids` (what alignment minimises)."""
    from sse_model.configuration_sse import SSE_LAYER
    from sse_model.convert import attention_activations

    layers = [i for i, kind in enumerate(converted.config.layer_types) if kind == SSE_LAYER]
    return {i: torch.nn.functional.mse_loss(converted.model.layers[i].linear_attn(x)[0],
                                            source.model.layers[i].self_attn.o_proj(o.flatten(-2))).item()
            for i, (x, o) in attention_activations(source, ids, layers).items()}


def eval_results(folder: Path) -> dict:
    """The eval stage's query accuracy (overall and by number of pairs, with 95 % intervals) and, per problem, the
    query accuracy of its one greedy sample (for paired differences)."""
    (dataset, m), = json.loads((folder / "metrics.json").read_text()).items()
    problems = {}
    for line in (folder / f"{dataset}.samples.jsonl").read_text().splitlines():
        if line.strip():
            sample = json.loads(line)
            problems[sample["id"]] = {"num_pairs": sample["num_pairs"], "query_accuracy":
                                      sum(sample["query_correct"]) / len(sample["query_correct"])}
    return {"dataset": dataset, "query_accuracy": m["query_accuracy"], "query_accuracy_ci95": m["query_accuracy_ci95"],
            "by_num_pairs": m["query_accuracy_by_num_pairs"], "problems": problems}


def report(args) -> dict:
    """bench/results/sila_tools_<tag>.{json,md} from the runs of every arm and the source."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.metrics import paired_change
    from sse_model.convert import calibration_text

    rows = load_config(CONFIG).data.eval[0].generator  # the eval stage's rows: the source is scored on them too
    heldout = generate_task("mqar", rows.num_examples, rows.seed, "test", rows.options)
    source = Path(args.source)
    src = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    result = {"date": args.tag, "machine": cpu_name(), "torch_threads": torch.get_num_threads(),
              "source": {**json.loads((source.parent / "source.json").read_text()),
                         **evaluate_lm(src, AutoTokenizer.from_pretrained(source), heldout)},
              "arms": {}, "differences": []}
    result["source"].pop("log", None)
    for arm in ARMS:
        run_dir = ROOT / "runs" / f"sila-{arm.replace('+', '-')}"
        if list(run_dir.glob("eval/sft/metrics.json")):
            result["arms"][arm] = load_arm(run_dir, heldout)
    # Held-out text the source samples (seeds 0 and 1 went to calibration and alignment).
    probe = calibration_text(src, 2048, seed=7)
    for r in result["arms"].values():
        converted = AutoModelForCausalLM.from_pretrained(ROOT / "runs" / r["run"] / "convert" / "model",
                                                         dtype=torch.float32).eval()
        r["convert"]["mixer_mse"] = mixer_errors(src, converted, probe)
    base = result["arms"].get("baseline")
    for arm, r in result["arms"].items():
        for model in ("convert", "sft"):
            if base is None or arm == "baseline" or (model == "convert" and "align" not in arm):
                continue
            pa, pb = r[model]["problems"], base[model]["problems"]
            ids = sorted(set(pa) & set(pb))
            c = paired_change([pb[i]["query_accuracy"] for i in ids], [pa[i]["query_accuracy"] for i in ids])
            result["differences"].append({"arm": arm, "model": model, "problems": len(ids), "difference": c["change"],
                                          "ci95": list(c["change_ci95"])})
    for r in result["arms"].values():
        for model in ("convert", "sft"):
            r[model].pop("problems")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"sila_tools_{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return result


def markdown(result: dict) -> str:
    from bench.mqar_compare import pct
    s = result["source"]
    pairs = sorted({int(p) for p in s["query_accuracy_by_num_pairs"]})
    lines = [f"# SILA's training tools on MQAR (CPU), {result['date']}", "",
             f"Machine: {result['machine']}. Task: configs/sila_mqar.yaml (MQAR in Zoology's format, "
             f"{'/'.join(map(str, pairs))} pairs); 'eval' is the pipeline's teacher-forced per-query accuracy on "
             "its 400 test sequences with the 95 % bootstrap interval over sequences; perplexity is per answer (the "
             "SFT loss's terms) on the same sequences.", "",
             f"Source: Qwen3, {s['parameters']:,} parameters, {s['steps']} steps of {s['batch']} on {s['device']} "
             f"({s['seconds']:.0f} s, lr {s['lr']}): per-query accuracy {pct(s['query_accuracy'])} % ("
             + " / ".join(pct(s["query_accuracy_by_num_pairs"][p]) for p in s["query_accuracy_by_num_pairs"])
             + f" by pairs), answer perplexity {s['perplexity_answer']:.3f}.", "",
             "| arm | model | eval, % (95 % CI) | " + " | ".join(f"{p} pairs" for p in pairs)
             + " | perplexity (answer) | stage s |", "| --- " * (5 + len(pairs)) + "|"]
    for arm, r in result["arms"].items():
        for model in ("convert", "sft"):
            m = r[model]
            by = {g["num_pairs"]: g for g in m["by_num_pairs"]}
            low, high = m["query_accuracy_ci95"]
            cells = [f"{pct(by[p]['accuracy'])}" if p in by else "" for p in pairs]
            seconds = r["seconds"].get(model)
            lines.append(f"| {arm} | {'converted' if model == 'convert' else 'after SFT'} | "
                         f"{pct(m['query_accuracy'])} ({pct(low)}-{pct(high)}) | " + " | ".join(cells) +
                         f" | {m['perplexity_answer']:.3f} | {'' if seconds is None else f'{seconds:.0f}'} |")
    shown = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 300]
    lines += ["", "SFT loss (TRL's logged loss: the mean over the answers of the steps since the previous log) at step,"
              " and the first logged step below 0.1:", "",
              "| arm | " + " | ".join(map(str, shown)) + " | below 0.1 |", "| --- " * (2 + len(shown)) + "|"]
    for arm, r in result["arms"].items():
        loss = {int(step): value for step, value in r["sft_loss"].items()}
        below = next((t for t in sorted(loss) if loss[t] < 0.1), None)
        lines.append(f"| {arm} | " + " | ".join(f"{loss[t]:.3g}" if t in loss else "" for t in shown)
                     + f" | {below or 'never'} |")
    mse = next(iter(result["arms"].values()))["convert"]["mixer_mse"]
    lines += ["", "Converted models: per SSE layer, mean squared error of its output against the replaced attention's "
              "(after o_proj), both on the source's hidden states, on 2048 held-out tokens the source sampled:", "",
              "| arm | " + " | ".join(f"layer {i}" for i in mse) + " |", "| --- " * (1 + len(mse)) + "|"]
    for arm, r in result["arms"].items():
        lines.append(f"| {arm} | " + " | ".join(f"{e:.4g}" for e in r["convert"]["mixer_mse"].values()) + " |")
    if result["differences"]:
        lines += ["", "Paired differences against the baseline arm (points of %, same problems, 95 % interval):", "",
                  "| arm | model | difference (95 % CI) |", "| --- | --- | --- |"]
        for d in result["differences"]:
            lines.append(f"| {d['arm']} | {d['model']} | {100 * d['difference']:+.1f} "
                         f"({100 * d['ci95'][0]:+.1f} to {100 * d['ci95'][1]:+.1f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("source", help="train the tiny Transformer")
    s.add_argument("--device", default="cpu")
    # 3000 steps of 64 at lr 1e-3: the schedule under which the comparison's Transformer bound in 2 of 2 seeds
    # (by step 1750; docs/retrieval.md, "Seeds and schedules on a GPU").
    s.add_argument("--steps", type=int, default=3000)
    s.add_argument("--batch", type=int, default=64)
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--eval-every", type=int, default=250)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default=str(SOURCE))
    s.add_argument("--tar", default=None, help="also pack the source's folder into this .tar.gz")
    r = sub.add_parser("run", help="the pipeline runs of the arms")
    r.add_argument("--only", default=None, help=f"comma-separated arms of {', '.join(ARMS)}")
    r.add_argument("--source", default=str(SOURCE))
    p = sub.add_parser("report", help="tables from the runs")
    p.add_argument("--source", default=str(SOURCE))
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--tag", default=datetime.date.today().isoformat(), help="file name suffix")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    {"source": train_source, "run": run_arms, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
