"""SILA's training tools on a small CPU case (docs/retrieval.md, "SILA's training tools"): a tiny Transformer trained
here on MQAR, converted to SSE-H, then SFT through the pipeline with and without each tool.

    python bench/sila_tools.py source [--device cpu|cuda] [--steps N]   # the Transformer: runs/sila-source/model
    python bench/sila_tools.py run [--only NAME,...]                      # sse-rl run configs/sila_mqar.yaml per arm
    python bench/sila_tools.py report [--tag DATE]                        # bench/results/sila_tools_<tag>.{md,json}

The task is the pipeline's MQAR generator in configs/sila_mqar.yaml's form (32 codes, 1 to 4 pairs, one query; the
prompt template and answer format of every pipeline task). The source is a Qwen3 of the SSE-H configs' shape (4
layers, hidden 128, 4 heads of 32) with its own BPE tokenizer, trained on whole rendered conversations (loss on
every token). Its tokenizer drops spaces, so a code is one and the same token in the pairs, the query and the
answer, and a value follows its key directly (with the pipeline's tokenizer ` ak` and `ak` are two tokens, one of
the suspects of docs/retrieval.md's comparison that stayed at chance).

Arms (each `sse-rl run configs/sila_mqar.yaml --set ...`: convert, SFT, eval of the converted and the SFT model):
  baseline      conversion with the default calibration, plain SFT
  weights       SFT with `sft.token_weights` (reference: the source Transformer)
  align         conversion with `convert.align_steps`, plain SFT
  align+weights both
`report` adds, per arm, the held-out perplexity of the converted and of the SFT model (per answer token: the SFT
loss's tokens, and per token of the whole conversation), the source's and the converted models' accuracy, and the
eval's accuracy with its 95 % bootstrap interval and each tool's paired difference against the baseline.
"""
import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.prompts import build_prompt  # noqa: E402
from tasks.retrieval import generate_task  # noqa: E402
from tasks.tokenizer import BOS, CHAT_TEMPLATE, EOS, IM_START, PAD, SPECIAL_TOKENS  # noqa: E402

CONFIG = ROOT / "configs" / "sila_mqar.yaml"
SOURCE = ROOT / "runs" / "sila-source" / "model"
# The task of configs/sila_mqar.yaml (kept equal by tests/test_sila_tools.py).
MQAR = {"vocab_size": 32, "num_queries": 1,
        "mix": [{"context_length": 2 * p + 1, "num_pairs": p} for p in (1, 2, 3, 4)]}
ARMS = {
    "baseline": [],
    "weights": ["sft.token_weights={}"],
    "align": ["convert.align_steps=200"],
    "align+weights": ["convert.align_steps=200", "sft.token_weights={}"],
}


def conversation(row: dict) -> list[dict]:
    return build_prompt(row["problem"]) + [{"role": "assistant", "content": row["solution"]}]


def build_tokenizer(rows: list[dict]):
    """A byte-level BPE with the pipeline's chat template and special tokens (tasks/tokenizer.py) that drops
    spaces: `ag av` is `ag`, `av`, and a code is the same token in the pairs, the query and the answer. Decoded text
    has no spaces (`Theansweris\\boxed{av}.`), which the exact grading of `\\boxed{}` does not see: the answer
    is one code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Split(" ", behavior="removed"),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["system\nuser\nassistant\n"] + [m["content"] for r in rows for m in conversation(r)],
                            trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
                                   padding_side="left")


def encode(tokenizer, row: dict) -> tuple[list[int], int]:
    """Token ids of the whole conversation and the length of its prompt (through the assistant turn's opening)."""
    prompt = tokenizer.apply_chat_template(build_prompt(row["problem"]), add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    return list(tokenizer.apply_chat_template(conversation(row), tokenize=True, return_dict=False)), len(prompt)


def padded(examples: list[tuple[list[int], int]], pad_id: int, answer_only: bool):
    """input_ids, attention_mask and labels (-100 off the loss) of a right-padded batch."""
    T = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), T), pad_id)
    labels = torch.full((len(examples), T), -100)
    for row, (seq, prompt) in enumerate(examples):
        ids[row, :len(seq)] = torch.tensor(seq)
        start = prompt if answer_only else 1
        labels[row, start:len(seq)] = ids[row, start:len(seq)]
    return ids, torch.arange(T) < torch.tensor([len(seq) for seq, _ in examples])[:, None], labels


@torch.no_grad()
def evaluate_lm(model, tokenizer, rows: list[dict], device="cpu", batch=64) -> dict:
    """Held-out perplexity per answer token (the SFT loss's tokens: the assistant turn) and per token of the whole
    conversation, and the share of rows whose answer code is the model's greedy next token at its place."""
    examples = [encode(tokenizer, r) for r in rows]
    code_ids = [tokenizer.convert_tokens_to_ids(r["answer"]) for r in rows]
    sums = {"answer": [0.0, 0], "all": [0.0, 0]}
    right = {}
    for start in range(0, len(examples), batch):
        part = examples[start:start + batch]
        ids, mask, _ = padded(part, tokenizer.pad_token_id, answer_only=False)
        logits = model(input_ids=ids.to(device), attention_mask=mask.long().to(device)).logits.float().cpu()
        logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        for row, (seq, prompt) in enumerate(part):
            lp = logp[row, :len(seq) - 1]
            sums["all"][0] -= lp.sum().item()
            sums["all"][1] += len(lp)
            sums["answer"][0] -= lp[prompt - 1:].sum().item()
            sums["answer"][1] += len(lp[prompt - 1:])
            code = code_ids[start + row]
            at = seq.index(code, prompt)  # the code in the answer, `\boxed{` before it
            hit = int(logits[row, at - 1].argmax().item() == code)
            right.setdefault(rows[start + row]["num_pairs"], []).append(hit)
    return {"perplexity_answer": math.exp(sums["answer"][0] / sums["answer"][1]),
            "perplexity_all": math.exp(sums["all"][0] / sums["all"][1]),
            "next_token_accuracy": sum(map(sum, right.values())) / len(rows),
            "next_token_accuracy_by_num_pairs": {p: sum(r) / len(r) for p, r in sorted(right.items())}}


def train_source(args) -> dict:
    """The tiny Transformer: a Qwen3 trained on MQAR conversations (loss on every token, or with --answer-only on
    the assistant turn), saved with its tokenizer to `args.out` (its accuracy log beside it)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    torch.manual_seed(args.seed)
    train = generate_task("mqar", args.examples, args.seed, "train", MQAR)
    heldout = generate_task("mqar", 400, args.seed + 1, "test", MQAR)
    tokenizer = build_tokenizer(train[:4000])
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    examples = [encode(tokenizer, r) for r in train]
    log, started = [], time.time()
    for step in range(args.steps):
        for group in optimizer.param_groups:  # linear warmup, cosine decay
            group["lr"] = args.lr * min(1.0, (step + 1) / 200) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        start = (step * args.batch) % (len(examples) - args.batch)
        ids, mask, labels = padded(examples[start:start + args.batch], tokenizer.pad_token_id, args.answer_only)
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
               "answer_only": args.answer_only,
               "examples": args.examples, "seconds": round(time.time() - started, 1),
               "parameters": sum(p.numel() for p in model.parameters()), "log": log}
    (out.parent / "source.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.tar:
        with tarfile.open(args.tar, "w:gz") as tar:
            tar.add(out.parent, arcname=out.parent.name)
    return summary


def run_arms(args) -> None:
    """`sse-rl run configs/sila_mqar.yaml` per arm (one thread per stage), skipping finished runs."""
    source = Path(args.source).resolve()
    for arm in args.only.split(",") if args.only else ARMS:
        sets = [f"name=sila-{arm.replace('+', '-')}", f"convert.source={source}", *ARMS[arm]]
        command = [str(ROOT / ".venv" / "bin" / "sse-rl"), "run", str(CONFIG), *[a for s in sets for a in ("--set", s)]]
        print(" ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def load_arm(run_dir: Path, heldout: list[dict]) -> dict:
    """An arm's eval results for the converted and the SFT model, the held-out perplexities of both, stage times."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sse_model  # noqa: F401  (registers sse_hybrid)
    from bench.mqar_compare import stage_seconds

    out = {"run": run_dir.name, "seconds": stage_seconds(run_dir)}
    for model in ("convert", "sft"):
        path = run_dir / model / ("model" if model == "convert" else "final")
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[model] = {**eval_results(run_dir / "eval" / model),
                      **evaluate_lm(lm, AutoTokenizer.from_pretrained(path), heldout)}
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

    heldout = generate_task("mqar", 400, 1, "test", MQAR)
    source = Path(args.source)
    src = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    result = {"date": args.tag, "machine": f"{platform.machine()}, {platform.processor() or platform.system()}, "
              f"{os.cpu_count()} cores", "torch_threads": torch.get_num_threads(),
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
    lines = [f"# SILA's training tools on MQAR (CPU), {result['date']}", "",
             f"Machine: {result['machine']}; one torch thread per stage. Task: MQAR, 32 codes, 1 to 4 pairs, one "
             "query (configs/sila_mqar.yaml); held-out rows of the test split. Perplexity per answer token (the "
             "assistant turn, SFT's loss) and per token of the whole conversation; 'next-token' is the share of "
             "held-out rows whose answer code is the greedy next token; 'eval' is the pipeline's greedy "
             "generation accuracy (400 test problems) with its 95 % bootstrap interval.", "",
             f"Source: Qwen3, {s['parameters']:,} parameters, {s['steps']} steps of {s['batch']} on {s['device']} "
             f"({s['seconds']:.0f} s, lr {s['lr']}): perplexity {s['perplexity_answer']:.3f} (answer) / "
             f"{s['perplexity_all']:.2f} (all), next-token {pct(s['next_token_accuracy'])} %.", "",
             "| arm | model | eval, % (95 % CI) | 1 pair | 2 pairs | 3 pairs | 4 pairs | next-token % | "
             "perplexity (answer) | perplexity (all) | stage s |", "| --- " * 11 + "|"]
    for arm, r in result["arms"].items():
        for model in ("convert", "sft"):
            m = r[model]
            by = {g["num_pairs"]: g for g in m["by_num_pairs"]}
            low, high = m["query_accuracy_ci95"]
            cells = [f"{pct(by[p]['accuracy'])}" if p in by else "" for p in (1, 2, 3, 4)]
            seconds = r["seconds"].get(model)
            lines.append(f"| {arm} | {'converted' if model == 'convert' else 'after SFT'} | "
                         f"{pct(m['query_accuracy'])} ({pct(low)}-{pct(high)}) | " + " | ".join(cells) +
                         f" | {pct(m['next_token_accuracy'])} | {m['perplexity_answer']:.3f} | "
                         f"{m['perplexity_all']:.2f} | {'' if seconds is None else f'{seconds:.0f}'} |")
    lines += ["", "Converted models: per SSE layer, mean squared error of its output against the replaced attention's "
              "(after o_proj), both on the source's hidden states, on 2048 held-out tokens the source sampled:", "",
              "| arm | " + " | ".join(f"layer {i}" for i in next(iter(result["arms"].values()))["convert"]["mixer_mse"])
              + " |", "| --- " * (1 + len(next(iter(result["arms"].values()))["convert"]["mixer_mse"])) + "|"]
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
    s.add_argument("--steps", type=int, default=3000)
    s.add_argument("--batch", type=int, default=32)
    s.add_argument("--lr", type=float, default=2e-3)
    s.add_argument("--examples", type=int, default=100_000)
    s.add_argument("--eval-every", type=int, default=500)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--answer-only", action="store_true",
                   help="loss on the answer only, as Zoology's MQAR (trained on every token the source never bound)")
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
