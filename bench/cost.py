"""What the paper recipe costs: GPU-hours of configs/sse_h_2b.yaml end to end (SFT, GRPO, evaluation) on 8 H100s and
on 8 H200s, from the measured phases of one GRPO rank (bench/results/recipe_memory_*.json, written by
`python -m bench.recipe_memory --baseline`) and published length statistics, beside published RL recipes.

`python -m bench.report` writes it to docs/cost.md with docs/performance.md (`--check` compares). Nothing in the
document is typed by hand: the recipe's sizes come from the config, the times from the baselines, the published
figures from the constants below (each with where it is stated), and every assumption is listed in the document.
Where the baseline is absent, or lacks a phase or its shape, the document says which and leaves those cells empty.
"""
from bench.baseline import REPO

RECIPE = REPO / "configs" / "sse_h_2b.yaml"
COST = REPO / "docs" / "cost.md"
PREFIX, EXPECTED = "recipe_memory_", "recipe_memory_sse_h_2b"
PHASES = ("rollout", "log-probabilities", "update", "push")  # one GRPO step; "push (first)" happens once

# Published figures the estimate rests on.
UPDATE_1 = "https://huggingface.co/blog/open-r1/update-1"
UPDATE_2 = "https://huggingface.co/blog/open-r1/update-2"
DEEPSCALER = ("https://pretty-radio-b75.notion.site/DeepScaleR-Surpassing-O1-Preview-with-a-1-5B-Model-by-Scaling-RL-"
              "19681902c1468005bed8ca303013a4e2")
POLARIS = ("https://honorable-payment-890.notion.site/POLARIS-A-POst-training-recipe-for-scaling-reinforcement-"
           "Learning-on-Advanced-ReasonIng-modelS-1dfa954ff7c38094923ec7772bf447a1")
JUSTRL = "https://arxiv.org/abs/2512.16649"
JUSTRL_SCRIPT = "https://github.com/thunlp/JustRL/blob/main/train/examples/justrl/run_scaling_ssh_distill.sh"
MEAN_RESPONSE = 6_000  # tokens: DeepSeek-R1's mean response (Open R1 Update #1, on OpenThoughts' problems)
DEEPSCALER_8K = (5_500, 3_500)  # tokens: DeepScaleR's mean response length at the start and end of its 8K stage
OPENR1_LIMIT, OPENR1_SHORT, OPENR1_SHORT_SHARE = 16_384, 8_192, 0.75  # Update #2: traces up to 16k; 75% under 8k
TRACE_BOUND = OPENR1_SHORT_SHARE * OPENR1_SHORT + (1 - OPENR1_SHORT_SHARE) * OPENR1_LIMIT
OPENR1_DEFAULT_ROWS = 93_733  # the dataset card's `default` split, where data.sft.limit is unset
BENCHMARK_PROBLEMS = {"aime24": 30, "aime25": 30, "math500": 500, "amc23": 40}
# NVIDIA's SXM datasheets: the same dense bf16 tensor peak (989 TFLOPS) on both; HBM bandwidth in TB/s.
HBM_TBPS = {"H100": 3.35, "H200": 4.8}
KINDS = ("H100", "H200")
PUBLISHED = [  # RL recipes: GPU-hours as reported (hours, or GPUs x days)
    dict(recipe="DeepScaleR-1.5B-Preview", start="DeepSeek-R1-Distill-Qwen-1.5B",
         rl="GRPO, 40k problems, 8K then 16K then 24K context", gpu="A100", hours=3_800,
         reported="3,800 A100 hours", source=f"[blog]({DEEPSCALER})"),
    dict(recipe="JustRL-DeepSeek-1.5B", start="DeepSeek-R1-Distill-Qwen-1.5B",
         rl="GRPO, DAPO-Math-17k, 15,360-token responses, 4,000+ steps", gpu="A800-80GB", gpus=32, days=15,
         reported="32 GPUs, ~15 days", source=f"[paper]({JUSTRL}), [training script]({JUSTRL_SCRIPT}) (4 nodes x 8 "
                                              "GPUs); the ~15 days as quoted in summaries of the paper, not checked "
                                              "against its text"),
    dict(recipe="POLARIS-4B-Preview", start="Qwen3-4B", rl="700 steps, 40K then 48K then 52K context",
         gpu="H800", gpus=32, days=28, reported="32 GPUs, 28 days", source=f"[blog]({POLARIS})")]


def kind(device: str) -> str | None:
    return next((k for k in KINDS if k in device), None)


def measured(b: dict | None, name: str) -> dict | str:
    """The phase seconds, shape and GPU kind of a recipe_memory baseline, or the sentence naming what it lacks."""
    if b is None:
        return f"`bench/results/{name}.json` is not committed"
    seconds = {r["phase"]: r["seconds"] for r in b["rows"]}
    lacks = [f"the `{p}` row" for p in PHASES if p not in seconds]
    if "shape" not in b:
        lacks.append("`shape` (prompts, generations, prompt_tokens, max_tokens)")
    if kind(b["device"]) is None:
        lacks.append(f"an H100 or H200 device (it ran on {b['device']})")
    if lacks:
        return f"`bench/results/{name}.json` lacks " + ", ".join(lacks)
    return dict(seconds=seconds, shape=b["shape"], kind=kind(b["device"]))


def step_seconds(m: dict, mean: float | None) -> dict:
    """One rank's GRPO step by phase: as measured (every completion at max_tokens) when `mean` is None, else each
    phase scaled to completions of `mean` tokens: the rollout by generated tokens, the log-probabilities and the
    update by row tokens (prompt + completion), the push not at all."""
    s, p, length = m["seconds"], m["shape"]["prompt_tokens"], m["shape"]["max_tokens"]
    generated = 1.0 if mean is None else min(mean, length) / length
    rows = 1.0 if mean is None else (p + min(mean, length)) / (p + length)
    return {"rollout": s["rollout"] * generated, "log-probabilities": s["log-probabilities"] * rows,
            "update": s["update"] * rows, "push": s["push"]}


def rates(m: dict) -> dict:
    """Tokens per second per GPU: the rollout's generated tokens (decode), the update's row tokens (training)."""
    sh = m["shape"]
    completions = sh["prompts"] * sh["generations"]
    return dict(decode=completions * sh["max_tokens"] / m["seconds"]["rollout"],
                train=completions * (sh["prompt_tokens"] + sh["max_tokens"]) / m["seconds"]["update"])


def recipe(cfg) -> dict:
    """The recipe's sizes from its config."""
    g, e = cfg.grpo, cfg.eval
    problems = {name: BENCHMARK_PROBLEMS.get(name) for name in (d if isinstance(d, str) else d.name
                                                                 for d in cfg.data.eval)}
    if e.limit is not None:
        problems = {k: v if v is None else min(v, e.limit) for k, v in problems.items()}
    return dict(traces=cfg.data.sft.limit or OPENR1_DEFAULT_ROWS, epochs=cfg.sft.epochs,
                sft_length=cfg.sft.trl.get("max_length"), steps=g.steps,
                prompts=g.per_device_batch_size * g.trl["gradient_accumulation_steps"] * cfg.resources.grpo.num_workers
                // g.trl["num_generations"], generations=g.trl["num_generations"],
                limit=g.trl["max_completion_length"], prompt_limit=g.max_prompt_length, n=e.n, problems=problems,
                eval_tokens=e.max_tokens,
                workers={s: getattr(cfg.resources, s).num_workers for s in ("sft", "grpo", "eval")})


def gpu_hours(m: dict, r: dict) -> dict:
    """{stage: {gpu kind: (at the mean, at the bound)}} GPU-hours; `m` measured on one kind, the other derived
    (assumption 8: decode scales with HBM bandwidth, the rest is equal)."""
    decode_speedup = {k: HBM_TBPS[k] / HBM_TBPS[m["kind"]] for k in KINDS}
    rate = rates(m)
    sft = [r["traces"] * r["epochs"] * length / rate["train"] / 3600 for length in (MEAN_RESPONSE, TRACE_BOUND)]
    once = m["seconds"].get("push (first)", 0.0)
    out = {"SFT": {k: tuple(sft) for k in KINDS}, "GRPO": {}, "eval": {}}
    completions = r["n"] * sum(v or 0 for v in r["problems"].values())
    for k in KINDS:
        grpo = []
        for mean in (MEAN_RESPONSE, None):
            step = step_seconds(m, mean)
            step["rollout"] /= decode_speedup[k]
            grpo.append(r["workers"]["grpo"] * (r["steps"] * sum(step.values()) + once) / 3600)
        out["GRPO"][k] = tuple(grpo)
        out["eval"][k] = tuple(completions * length / (rate["decode"] * decode_speedup[k]) / 3600
                               for length in (MEAN_RESPONSE, r["eval_tokens"]))
    out["total"] = {k: tuple(sum(out[s][k][i] for s in ("SFT", "GRPO", "eval")) for i in (0, 1)) for k in KINDS}
    return out


def num(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def recipe_lines(r: dict) -> list[str]:
    problems = ", ".join(f"{k} ({num(v) if v else 'size unknown'})" for k, v in r["problems"].items())
    completions = r["n"] * sum(v or 0 for v in r["problems"].values())
    rows = [["SFT", f"{num(r['traces'])} OpenR1-Math traces x {num(r['epochs'])} epochs, packed into "
                    f"{num(r['sft_length'])}-token rows", f"{r['workers']['sft']}"],
            ["GRPO", f"{r['steps']} steps of {r['prompts']} DeepScaleR prompts x {r['generations']} completions, "
                     f"up to {num(r['prompt_limit'])} + {num(r['limit'])} tokens", f"{r['workers']['grpo']}"],
            ["eval", f"avg@{r['n']} on {problems}: {num(completions)} completions of up to "
                     f"{num(r['eval_tokens'])} tokens", f"{r['workers']['eval']}"]]
    return ["## The recipe", "", f"From `{RECIPE.relative_to(REPO)}`:", ""] + table(["stage", "work", "GPUs"], rows)


def step_lines(name: str, b: dict, m: dict) -> list[str]:
    sh = m["shape"]
    p, length = sh["prompt_tokens"], sh["max_tokens"]
    full, short = step_seconds(m, None), step_seconds(m, MEAN_RESPONSE)
    how = {"rollout": f"generated tokens: {num(MEAN_RESPONSE)} / {num(length)}",
           "log-probabilities": f"row tokens: ({num(p)} + {num(MEAN_RESPONSE)}) / ({num(p)} + {num(length)})",
           "update": "row tokens, as above", "push": "nothing (the weights)"}
    rows = [[ph, num(full[ph]), how[ph], num(short[ph])] for ph in PHASES]
    rows.append(["step", num(sum(full.values())), "", num(sum(short.values()))])
    rate = rates(m)
    completions = sh["prompts"] * sh["generations"]
    return [f"### {b['title']}", "",
            f"[`bench/results/{name}.json`](../bench/results/{name}.json): {b['device']}, {b['date']}, commit "
            f"{b['commit']}, `{b['command']}`", ""] + table(
        ["phase", f"measured s ({completions} x ({num(p)} + {num(length)}) tokens)", "scales with",
         f"s at a {num(MEAN_RESPONSE)}-token mean"], rows) + [
        "", f"Once per run: `push (first)`, {num(m['seconds'].get('push (first)'))} s. Rates per GPU: "
            f"{num(rate['decode'])} generated tokens/s in the rollout ({completions} sequences at once), "
            f"{num(rate['train'])} training tokens/s in the update."]


def hours_lines(m: dict | None, r: dict, missing: str = "") -> list[str]:
    measured_kind = m["kind"] if m else None

    def head(k):
        if m is None:
            return f"{k} x8"
        if k == measured_kind:
            return f"{k} x8 (measured)"
        return f"{k} x8 (derived: decoding at {num(HBM_TBPS[k] / HBM_TBPS[measured_kind])}x the speed)"

    hours = gpu_hours(m, r) if m else None
    what = {"SFT": f"traces of {num(MEAN_RESPONSE)} / {num(TRACE_BOUND)} tokens",
            "GRPO": f"completions of {num(MEAN_RESPONSE)} tokens / every step at the limit",
            "eval": f"completions of {num(MEAN_RESPONSE)} / {num(r['eval_tokens'])} tokens", "total": ""}
    rows = []
    for stage in ("SFT", "GRPO", "eval", "total"):
        row = [stage, what[stage]]
        for k in KINDS:
            if hours is None:
                row += [f"needs {missing}", "-"]
                continue
            stages = ("SFT", "GRPO", "eval") if stage == "total" else (stage,)
            lo, hi = hours[stage][k]
            wall = [sum(hours[s][k][i] / r["workers"][s.lower()] for s in stages) for i in (0, 1)]
            row += [f"{num(lo)} / {num(hi)}", f"{num(wall[0])} / {num(wall[1])}"]
        rows.append(row)
    header = ["stage", "lengths: mean / bound"]
    for k in KINDS:
        header += [f"{head(k)} GPU-hours", "wall-clock hours"]
    lines = ["GPU-hours and wall-clock hours (one stage after another, each on its GPUs) at the mean length and at "
             "the bound (assumptions 3 to 7):", ""]
    return lines + table(header, rows)


def published_lines() -> list[str]:
    rows = []
    for p in PUBLISHED:
        hours = p.get("hours") or p["gpus"] * p["days"] * 24
        rows.append([p["recipe"], p["start"], p["rl"], p["reported"], f"{num(hours)} {p['gpu']}-hours", p["source"]])
    return table(["recipe", "starts from", "RL", "reported", "GPU-hours", "source"], rows)


def assumptions(r: dict) -> list[str]:
    completions = r["n"] * sum(v or 0 for v in r["problems"].values())
    items = [
        f"A step of the {r['workers']['grpo']}-rank run takes one rank's time: each rank generates, scores and "
        "trains on its own completions, in lockstep. The baseline runs one unsharded rank, so FSDP's all-gathers "
        "and reduce-scatters (and SFT's gradient all-reduce) are not in the table.",
        "How each phase scales with the completion length: the rollout with the tokens generated, the "
        "log-probabilities and the update with the row tokens (prompt + completion), the weight push not at all. "
        "SSE layers cost the same per token at any length; the attention layers cost more per token the longer "
        "the context (decode reads a KV cache that grows, training attention is quadratic). A per-sequence cost "
        "that is convex in the length and zero at zero is at most linear from the full-length measurement, so "
        "the linear scaling overestimates shorter completions; docs/performance.md's training-step tables show "
        "SSE-H's tokens/s roughly flat from 4k to 32k tokens, so it overestimates little.",
        "GRPO, at the mean vs at the bound: TRL pads every completion of a rank's batch to the longest, and vLLM "
        "decodes a rank's completions together, so a step lasts as long as its longest completion and trains on "
        "rows of that length. A step in which any of the rank's completions runs to the limit costs the measured "
        "step (the bound). The mean column is what steps cost if generating and training took time in proportion "
        "to the tokens generated (a padding-free, length-bucketed or asynchronous pipeline, which this one is "
        "not); the recipe's cost lies between the two, at the bound while truncated completions are common.",
        f"Mean completion length {num(MEAN_RESPONSE)} tokens: DeepSeek-R1's mean response on OpenThoughts' "
        f"problems ([Open R1 Update #1]({UPDATE_1})), the model whose traces the SFT stage imitates. DeepScaleR "
        f"reports its mean response length falling from {num(DEEPSCALER_8K[0])} to {num(DEEPSCALER_8K[1])} tokens "
        f"over its 8K-context stage ([blog]({DEEPSCALER})). The same mean is used for evaluation.",
        f"SFT tokens: traces x epochs x trace length, with no padding (packing, padding-free) and no truncation "
        f"(traces are at most {num(OPENR1_LIMIT)} tokens, rows {num(r['sft_length'])}); the problem statements' "
        f"tokens are not counted. OpenR1-Math-220k's mean trace length is not published: the mean column takes "
        f"R1's {num(MEAN_RESPONSE)}, the bound {num(TRACE_BOUND)} = {OPENR1_SHORT_SHARE} x {num(OPENR1_SHORT)} + "
        f"{1 - OPENR1_SHORT_SHARE} x {num(OPENR1_LIMIT)}, from [Open R1 Update #2]({UPDATE_2}) (traces generated up "
        f"to 16k tokens; 75% of problems solved in under 8k).",
        "SFT throughput: the measured update phase's training tokens/s (forward and backward through the fused LM "
        "head with gradient checkpointing, float32 master weights, AdamW), on rows of prompt + completion. SFT's "
        "packed rows hold several traces whose attention stays within each trace, which costs less, so this rate "
        "is conservative.",
        f"Evaluation: {num(completions)} completions (n x the benchmarks' problems), generated at the measured "
        f"rollout rate ({r['prompts'] * r['generations'] // r['workers']['grpo']} sequences at once on one GPU); "
        "the evaluation engine queues all its completions and may run more at once, so this rate is conservative. "
        "Prompt prefill is not counted.",
        f"H200 from H100 (or back): both SXM parts have the same dense bf16 tensor peak, and HBM bandwidth of "
        f"{HBM_TBPS['H100']} and {HBM_TBPS['H200']} TB/s. The log-probabilities, the update, SFT and the push are "
        f"taken as equal on both; decoding (rollout, evaluation), bound by memory bandwidth, as faster by the full "
        f"ratio {num(HBM_TBPS['H200'] / HBM_TBPS['H100'])}, which is the most it can gain, so the derived H200 "
        f"figure is its cheapest (or the derived H100 figure its dearest).",
        "Not counted: engine starts, model loading, checkpoint saves, reward scoring (on the CPU), data loading, "
        "the init stage, restarts after failures.",
        "The published recipes are RL only, from an already distilled or reasoning model, on other GPUs (A100 and "
        "A800: 312 dense bf16 TFLOPS; H800: H100's compute with less interconnect); their GPU-hours are as "
        "reported, not converted to H100 hours."]
    return [f"{i}. {text}" for i, text in enumerate(items, 1)]


def document(baselines: dict[str, dict], cfg=None) -> str:
    """docs/cost.md from the baselines and the recipe's config."""
    if cfg is None:
        from pipeline.config import load_config
        cfg = load_config(RECIPE)
    r = recipe(cfg)
    names = sorted({EXPECTED, *(n for n in baselines if n.startswith(PREFIX))})
    found = {n: measured(baselines.get(n), n) for n in names}
    lines = ["# What the recipe costs", "",
             "Generated by `python -m bench.report` (bench/cost.py) from `configs/sse_h_2b.yaml`, the "
             "`recipe_memory_*` baselines in `bench/results/` (`python -m bench.recipe_memory --baseline`) and the "
             "published figures named below; edit those, never this file. Every number below rests on the "
             "assumptions at the end.", ""] + recipe_lines(r)
    for name, m in found.items():
        lines += ["", f"## GPU-hours end to end: {name}", ""]
        if isinstance(m, str):
            lines += [f"Missing measurement: {m}. Run `python -m bench.recipe_memory --baseline` on an H100 or an "
                      f"H200 (engine on), then `python -m bench.report`; the tables below fill in from its `rows` "
                      f"(`seconds` of {', '.join(PHASES)} and `push (first)`), its `shape` and its `device`.", ""]
            lines += hours_lines(None, r, f"`{name}`")
            continue
        lines += step_lines(name, baselines[name], m) + [""] + hours_lines(m, r)
    lines += ["", "## Published recipes", ""] + published_lines()
    lines += ["", "## Assumptions", ""] + assumptions(r)
    return "\n".join(lines) + "\n"
