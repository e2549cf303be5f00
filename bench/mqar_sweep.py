"""Many MQAR training runs at once on one GPU, outside the pipeline (issue 16's exploration rig): the recipe of
configs/mqar_*.yaml before 2026-11-25 (2 layers of width 128, 64 codes, 2 / 4 / 6 / 8 pairs in 4 codes a pair,
batch 64, AdamW 1e-3 cosine with 5 % warm-up, weight decay 0.1, loss on the answers) in a plain loop, so that
seeds and variants can be compared in minutes: when (if ever) each leaves its plateau.

Codes are token ids (one token per code, as the pipeline's tokenizer gives) and batches are drawn fresh.
`fmt` picks the sequence: `elim` each query followed by its value as an input (the pipeline's format until
2026-11-25, which lets a model rule out values already given), `repl` the same with the queried keys drawn with
replacement, `zoo` Zoology's (the value a label only, a random code as the input there; no gaps).

    python bench/mqar_sweep.py all OUTDIR WORKERS DEADLINE_S VARIANT:SEED:STEPS[:key=value,...] ...
    python bench/mqar_sweep.py report OUTDIR [OUT [TAG]]   # OUT/mqar_sweep_<TAG>.{md,json}: bench/results, date

`fmt=config` trains on the rows a pipeline config generates instead (configs/mqar_sse_h.yaml unless
`config=PATH`: its data.sft rows in the order TRL's sampler gives them (shuffled, or grouped by length when the config
says `train_sampling_strategy: group_by_length`), epoch after epoch, scored on its data.eval rows; Zoology's
format from 2026-11-25 on, 4-32 pairs), each code one token id, the vocabulary the codes plus a pad id: the CPU
comparison's recipe, with more seeds than the CPU allows.

`sets=FILE` applies a file of the pipeline's `--set` overrides to that config, one per line: `config=...,
sets=bench/mqar_zoology_lengths.sets` is the comparison at Zoology's lengths (bench/mqar_zoology_lengths.sh).

`run` (one run, what `all` starts per spec) takes the same fields; key=value: lr, wd, bs, fmt, config, sets or an
SSEConfig field. The SSE layers use the torch chunked path (the CPU's), so the math is the pipeline's on CPU.
"""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

BASE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=4,
            head_dim=32, sse_num_heads=4, sse_key_dim=32, sse_value_dim=32, sse_num_partitions=4, sse_top_k=1,
            sse_shared_partition=True, sse_lora_rank=8, max_position_embeddings=512, tie_word_embeddings=True,
            vocab_size=64)
VARIANTS = {
    "transformer": dict(layer_types=["full_attention", "full_attention"], intermediate_size=417),
    "gla": dict(sse_num_partitions=1, sse_shared_partition=False, intermediate_size=390),
    "sse_h": {},
    "sse": dict(layer_types=["linear_attention", "linear_attention"], intermediate_size=352),
    # Every layer GLA (pure SSE's counterpart with one partition and no shared one): the state-capacity pair.
    "gla_pure": dict(layer_types=["linear_attention", "linear_attention"], sse_num_partitions=1,
                     sse_shared_partition=False, intermediate_size=363),
    "sse_dense": dict(sse_top_k=4),
    "sse_h_nobal": dict(sse_balance_loss_coef=0.0),
    "gla_shared": dict(sse_num_partitions=1),
    "sse_h_noshared": dict(sse_shared_partition=False, intermediate_size=390),
}
PAIRS = (2, 4, 6, 8)
EVAL_EVERY = int(os.environ.get("EVAL_EVERY", 800))


def batch(gen, n_rows, device, pairs_of_row=None, fmt="elim"):
    """Zoology rows `k1 v1 .. kn vn q1 a1 .. qn an` right-padded to 32; labels on the answers only."""
    import torch
    L = 4 * max(PAIRS)
    rows = torch.arange(n_rows)
    choice = torch.tensor([pairs_of_row(r) for r in range(n_rows)]) if pairs_of_row else \
        torch.randint(len(PAIRS), (n_rows,), generator=gen)
    npairs = torch.tensor(PAIRS)[choice]
    keys = torch.rand(n_rows, 32, generator=gen).argsort(1)[:, :8]
    values = 32 + torch.rand(n_rows, 32, generator=gen).argsort(1)[:, :8]
    j = torch.arange(8)[None]
    order = torch.rand(n_rows, 8, generator=gen).masked_fill(j >= npairs[:, None], 2.0).argsort(1)
    if fmt == "repl":  # queried keys drawn with replacement: no elimination shortcut
        order = (torch.rand(n_rows, 8, generator=gen) * npairs[:, None]).long()
    ids = torch.zeros(n_rows, L, dtype=torch.long)
    labels = torch.full((n_rows, L), -100, dtype=torch.long)
    live = j < npairs[:, None]
    qk, qv = keys.gather(1, order), values.gather(1, order)
    for col, src in ((2 * j, keys), (2 * j + 1, values), (2 * npairs[:, None] + 2 * j, qk),
                     (2 * npairs[:, None] + 2 * j + 1, qv)):
        ids[rows[:, None].expand(-1, 8)[live], col.expand(n_rows, -1)[live]] = src[live]
    ans = (2 * npairs[:, None] + 2 * j + 1).expand(n_rows, -1)
    labels[rows[:, None].expand(-1, 8)[live], ans[live]] = qv[live]
    if fmt == "zoo":  # Zoology's: the answer is a label only; the input there is a random token
        noise = torch.randint(64, (n_rows, 8), generator=gen)
        ids[rows[:, None].expand(-1, 8)[live], ans[live]] = noise[live]
    mask = (torch.arange(L)[None] < 4 * npairs[:, None]).long()
    return ids.to(device), labels.to(device), mask.to(device), npairs.to(device)


def config_rows(path, sets=None):
    """(train rows, test rows, number of codes, the SFT sampler, positions) of a pipeline MQAR config's generators
    (data.sft, data.eval[0]), each row (code ids, labels, pairs) with the labels the SFT stage gives
    (`tasks.retrieval.answer_labels`); the sampler is the config's `sft.train_sampling_strategy` (TRL's), positions
    its `max_position_embeddings`. `sets`: a file of `--set` overrides, one per line
    (bench/mqar_zoology_lengths.sets)."""
    from pipeline.config import load_config
    from tasks.retrieval import answer_labels, code, code_width, generate_task
    overrides = [line for line in Path(sets).read_text().splitlines() if line.strip()] if sets else []
    cfg = load_config(path, overrides)
    data = cfg.data
    vocab = data.sft.generator.options["vocab_size"]
    id_of = {code(i, code_width(vocab)): i for i in range(vocab)}

    def rows(source):
        gen = source.generator
        out = []
        for row in generate_task(gen.task, gen.num_examples, gen.seed, source.split, gen.options):
            ids = [id_of[c] for c in row["problem"].split()]
            out.append((ids, answer_labels(ids, row["num_pairs"]), row["num_pairs"]))
        return out
    return (rows(data.sft), rows(data.eval[0]), vocab, cfg.sft.trl.get("train_sampling_strategy", "random"),
            cfg.model.config.get("max_position_embeddings", BASE["max_position_embeddings"]))


def code_batch(rows, num_codes, device):
    """(ids, labels, mask, pairs) of config rows, right-padded with id `num_codes`."""
    import torch
    L = max(len(ids) for ids, _, _ in rows)
    ids = torch.full((len(rows), L), num_codes, dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for r, (i, lab, _) in enumerate(rows):
        ids[r, :len(i)], labels[r, :len(i)], mask[r, :len(i)] = torch.tensor(i), torch.tensor(lab), 1
    pairs = torch.tensor([n for _, _, n in rows])
    return ids.to(device), labels.to(device), mask.to(device), pairs.to(device)


def run(variant, seed, steps, out, extra):
    import torch
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from sse_model.configuration_sse import SSEConfig
    from sse_model.modeling_sse import SSEForCausalLM
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lr, wd, bs = float(extra.pop("lr", 1e-3)), float(extra.pop("wd", 0.1)), int(extra.pop("bs", 64))
    fmt = extra.pop("fmt", "elim")
    config_path = extra.pop("config", "configs/mqar_sse_h.yaml")
    sets = extra.pop("sets", None)
    cfg = {**BASE, **VARIANTS[variant], **{k: json.loads(v) for k, v in extra.items()}}
    if fmt == "config":
        train_rows, test_rows, num_codes, sampling, positions = config_rows(config_path, sets)
        cfg["vocab_size"] = num_codes + 1  # the last id pads
        cfg["max_position_embeddings"] = positions
    cfg.setdefault("sse_impl", "chunk_torch_varlen")
    torch.manual_seed(seed)
    model = SSEForCausalLM(SSEConfig(**cfg)).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    nodecay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": nodecay, "weight_decay": 0.0}], lr=lr)
    warm = max(1, int(0.05 * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    gen = torch.Generator().manual_seed(1000 + seed)
    egen = torch.Generator().manual_seed(7)
    if fmt == "config":
        ev = [code_batch(test_rows[i:i + 100], num_codes, device) for i in range(0, len(test_rows), 100)]
        epochs = -(-steps * bs // len(train_rows))  # past one epoch, each further epoch in a fresh order
        if sampling == "group_by_length":  # the Trainer's sampler for it: batches of similar lengths
            from transformers.trainer_pt_utils import get_length_grouped_indices
            lengths = [len(ids) for ids, _, _ in train_rows]
            order = [i for _ in range(epochs) for i in get_length_grouped_indices(lengths, bs, generator=gen)]
        else:
            order = torch.cat([torch.randperm(len(train_rows), generator=gen) for _ in range(epochs)]).tolist()
    else:
        ev = [batch(egen, 800, device, pairs_of_row=lambda r: r % 4, fmt=fmt)]
    curve, evals, t0 = [], [], time.time()

    def evaluate(step):
        model.eval()
        per_row, fq, npairs = [], [], []
        with torch.no_grad():
            for ids, labels, mask, pairs in ev:  # in parts of at most 100 rows: Zoology's long rows are 1024 codes
                pred = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
                tgt = labels[:, 1:]
                ok = (pred == tgt) & (tgt >= 0)
                per_row.append(ok.sum(1).float() / (tgt >= 0).sum(1).float())
                fq.append(ok[torch.arange(len(ids)), (tgt >= 0).int().argmax(1)].float())
                npairs.append(pairs)
            per_row, fq, npairs = torch.cat(per_row), torch.cat(fq), torch.cat(npairs)
            rec = dict(step=step, all=float(per_row.mean()) * 100, first_query=float(fq.mean()) * 100,
                       **{f"p{n}": float(per_row[npairs == n].mean()) * 100 for n in npairs.unique().tolist()},
                       s=round(time.time() - t0, 1))
        model.train()
        evals.append(rec)
        print(variant, seed, rec, flush=True)

    acc = 0.0
    for step in range(1, steps + 1):
        if fmt == "config":
            ids, labels, mask, _ = code_batch([train_rows[i] for i in order[(step - 1) * bs:step * bs]], num_codes,
                                              device)
        else:
            ids, labels, mask, _ = batch(gen, bs, device, fmt=fmt)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step()
        acc += float(loss) if step % 50 == 0 else 0.0
        if step % 200 == 0:
            curve.append((step, round(acc / 4, 4)))
            acc = 0.0
        if step % EVAL_EVERY == 0 or step == steps:
            evaluate(step)
            json.dump(dict(variant=variant, seed=seed, steps=steps, fmt=fmt, lr=lr, wd=wd, bs=bs, config=cfg,
                           sets=sets, sampling=sampling if fmt == "config" else None,
                           params=nparams, curve=curve, evals=evals, device=device), open(out, "w"))


def run_all(outdir, workers, deadline, specs):
    os.makedirs(outdir, exist_ok=True)
    todo, live, t0 = list(specs), [], time.time()
    while todo or live:
        live = [(p, s) for p, s in live if p.poll() is None]
        while todo and len(live) < workers:
            spec = todo.pop(0)
            parts = spec.split(":")
            v, seed, steps = parts[0], parts[1], parts[2]
            extra = parts[3].split(",") if len(parts) > 3 and parts[3] else []
            tag = spec.replace(":", "_").replace(",", "_").replace("=", "").replace("/", "-")
            log = open(f"{outdir}/{tag}.log", "w")
            p = subprocess.Popen([sys.executable, __file__, "run", v, seed, steps, f"{outdir}/{tag}.json", *extra],
                                 stdout=log, stderr=subprocess.STDOUT)
            live.append((p, spec))
        if time.time() - t0 > deadline:
            for p, _ in live:
                p.kill()
            print("deadline: killed", [s for _, s in live], "not started", todo)
            break
        time.sleep(2)


def report(outdir, out="bench/results", tag=None):
    """One row per run: its last evaluation and the first step whose first-query accuracy reached 80 %."""
    import datetime
    rows = []
    for path in sorted(os.listdir(outdir)):
        if path.endswith(".json"):
            d = json.load(open(os.path.join(outdir, path)))
            last = d["evals"][-1]
            bound = next((e["step"] for e in d["evals"] if e["first_query"] >= 80), None)
            fmt = d.get("fmt", "elim") + (", grouped" if d.get("sampling") == "group_by_length" else "")
            rows.append(dict(fmt=fmt, variant=d["variant"], seed=d["seed"], lr=d["lr"], wd=d["wd"],
                             schedule=d["steps"],
                             step=last["step"], first_query=last["first_query"], all=last["all"],
                             **{k: v for k, v in last.items() if k[0] == "p"}, bound_by=bound, device=d["device"]))
    rows.sort(key=lambda r: (r["fmt"], r["variant"], r["schedule"], -r["lr"], r["seed"]))
    pairs = sorted({int(k[1:]) for r in rows for k in r if k[0] == "p"})
    date = datetime.date.today().isoformat()
    lines = [f"# MQAR sweep (bench/mqar_sweep.py), {date}", "",
             "Per-query accuracy in % at the run's last evaluation (800 sequences, 200 per number of pairs; "
             "`config`: the config's test rows); 'bound by': first evaluation (every EVAL_EVERY steps, 800 unless "
             "set) with first-query accuracy >= 80 %. A last step below "
             "the schedule: the run was stopped by its device call's time limit. Device: "
             + ", ".join(sorted({r["device"] for r in rows})) + ".", "",
             "| format | model | seed | lr | weight decay | schedule steps | last step | first query | all | "
             + " | ".join(f"{n} pairs" for n in pairs) + " | bound by |", "| --- " * (10 + len(pairs)) + "|"]
    lines += [f"| {r['fmt']} | {r['variant']} | {r['seed']} | {r['lr']:g} | {r['wd']:g} | {r['schedule']} | "
              f"{r['step']} | {r['first_query']:.1f} | {r['all']:.1f} | "
              + " | ".join(f"{r[f'p{n}']:.1f}" if f"p{n}" in r else "-" for n in pairs)
              + f" | {r['bound_by'] or '-'} |" for r in rows]
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, f"mqar_sweep_{tag or date}.md"), "w").write("\n".join(lines) + "\n")
    json.dump(rows, open(os.path.join(out, f"mqar_sweep_{tag or date}.json"), "w"), indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1] == "report":
        report(sys.argv[2], *sys.argv[3:5])
    elif sys.argv[1] == "run":
        run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
            dict(a.split("=", 1) for a in sys.argv[6:]))
    else:
        run_all(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5:])
