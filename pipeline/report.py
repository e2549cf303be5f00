"""`runs/<name>/report.md` with PNG plots: SFT loss; GRPO reward (total and per function), accuracy, response
length, KL / clip fraction, routing health and route flips; SSE partition usage; stage table, the eval tables and
each model's SSE state table. Rewritten after every stage."""
import json
import re
from collections import defaultdict

import matplotlib
import matplotlib.pyplot as plt

matplotlib.use("Agg")  # files only, never a window (pyplot picks its backend when the first figure is made)

PLOTS = [  # (file, title, stage, metric-name pattern)
    ("sft_loss.png", "SFT loss", "sft", r"^loss$"),
    ("grpo_reward.png", "GRPO reward (total and per function)", "grpo", r"^reward$|^rewards/[^/]+/mean$"),
    ("grpo_accuracy.png", "Accuracy (training reward and periodic eval)", "grpo",
     r"^rewards/math_accuracy/mean$|^eval/.*avg@\d+$"),
    ("grpo_length.png", "GRPO response length (tokens)", "grpo", r"^completions/(mean|max)_length$"),
    ("grpo_kl_clip.png", "GRPO KL and clip fraction", "grpo", r"^kl$|^clip_ratio/region_mean$"),
    ("grpo_routing.png", "GRPO routing health per SSE layer: usage entropy (nats) and modal set share",
     "grpo", r"^routing/(usage_entropy|modal_set_share)/\d+$"),
    ("grpo_route_flips.png", "GRPO route-flip rate, engine versus trainer (share of routed tokens)", "grpo",
     r"^routing/flip_rate(/\d+)?$"),
]


def series(rows, pattern):
    out = defaultdict(lambda: ([], []))
    for row in rows:
        for key, value in row.items():
            if re.search(pattern, key) and isinstance(value, (int, float)):
                out[key][0].append(row["step"])
                out[key][1].append(value)
    return dict(out)


def trailing_mean(y, window):
    return [sum(y[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(y))]


def plot(path, title, lines, xlabel="optimizer step", window=None):
    """One line per series. With `window`, a long series (GRPO metrics, a few prompts per step) is drawn faintly
    with its trailing mean over `window` points on top, so a trend shows through the noise."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, (x, y) in sorted(lines.items()):
        if window is None or len(x) < 3 * window:
            ax.plot(x, y, label=label, marker="." if len(x) < 30 else None)
            continue
        (raw,) = ax.plot(x, y, alpha=0.3, linewidth=0.8)
        ax.plot(x, trailing_mean(y, window), color=raw.get_color(), label=f"{label} (mean of {window} points)")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_partition_usage(run_dir, rows_by_stage) -> str | None:
    """One panel per SSE layer: the fraction of tokens routed to each partition over training."""
    stages = [s for s in ("sft", "grpo") if any(k.startswith("partition_usage/") for r in rows_by_stage[s] for k in r)]
    if not stages:
        return None
    layers = sorted({int(k.split("/")[1]) for s in stages for r in rows_by_stage[s] for k in r
                     if k.startswith("partition_usage/")})
    fig, axes = plt.subplots(len(stages), len(layers), figsize=(3 * len(layers), 2.6 * len(stages)), squeeze=False)
    for i, stage in enumerate(stages):
        for j, layer in enumerate(layers):
            ax = axes[i][j]
            for key, (x, y) in sorted(series(rows_by_stage[stage], rf"^partition_usage/{layer}/\d+$").items()):
                ax.plot(x, y, label=f"partition {key.rsplit('/', 1)[1]}")
            ax.set_title(f"{stage}: SSE layer {layer}", fontsize=8)
            ax.set_ylim(0, None)
            ax.tick_params(labelsize=7)
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(run_dir.path / "partition_usage.png", dpi=110)
    plt.close(fig)
    return "partition_usage.png"


def write_report(run_dir) -> None:
    rows_by_stage = {stage: run_dir.read_metrics(stage) for stage in ("sft", "grpo", "eval")}
    images = []
    for file, title, stage, pattern in PLOTS:
        lines = series(rows_by_stage[stage], pattern)
        if lines:
            plot(run_dir.path / file, title, lines, window=10 if stage == "grpo" else None)
            images.append((title, file))
    usage = plot_partition_usage(run_dir, rows_by_stage)
    if usage:
        images.append(("SSE partition usage (fraction of tokens, K per token)", usage))

    manifest = run_dir.manifest()["stages"]
    lines = [f"# Run `{run_dir.path.name}`", "", "| stage | state | time (s) | summary |", "| --- | --- | --- | --- |"]
    for stage, entry in manifest.items():
        summary = entry.get("summary") or entry.get("error") or ""
        lines.append(f"| {stage} | {entry['state']} | {entry.get('seconds', '')} | {summary} |")
    eval_dir = run_dir.stage_dir("eval")
    tables = sorted(eval_dir.glob("results.md")) + sorted(eval_dir.glob("*/results.md"))
    for table in tables:
        label = "" if table.parent == eval_dir else f" of the `{table.parent.name}` model"
        lines += ["", f"## Evaluation{label}", "", table.read_text().strip()]
        if (table.parent / "state.md").exists():
            lines += ["", f"### SSE state{label}", "", (table.parent / "state.md").read_text().strip()]
    for title, file in images:
        lines += ["", f"## {title}", "", f"![{title}]({file})"]
    lines += ["", "Metrics: `metrics.jsonl`; resolved config: `config.yaml`; manifest: `manifest.json`.", ""]
    (run_dir.path / "report.md").write_text("\n".join(lines))
    (run_dir.path / "summary.json").write_text(json.dumps(manifest, indent=1, default=str))
