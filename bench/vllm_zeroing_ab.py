"""Does zeroing new attention blocks slow SSE-H's rollouts? Both ways in turn, in one engine.

    python bench/vllm_zeroing_ab.py [--shape 1b] [--length 1024] [--rounds 4] [--out bench/results]

vLLM 0.25 zeroes the attention blocks a hybrid allocates (the scheduler hands their ids to the worker, whose
`KVBlockZeroer` clears them before the step) when the kv-cache config says the model has state layers. The engine
runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the scheduler's `needs_kv_cache_zeroing` can be turned
off and on between generations of the same engine: the rollouts of bench/vllm_rollouts.py (32 prompts x 8 of 256
random tokens, `--length` new tokens each, temperature 1) alternate zeroing on / off for `--rounds` rounds (on-off,
then off-on, ...), so a drift of the machine falls on both alike. Each generation's blocks zeroed are counted at
the worker's zeroer, which shows that the switch works. Prints a table and writes vllm_zeroing_ab_<date>.{json,md}.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def zeroer_of(worker):
    runner = worker.model_runner  # vLLM's V2 model runner names it kv_block_zeroer, V1 _kv_block_zeroer
    return getattr(runner, "kv_block_zeroer", None) or runner._kv_block_zeroer


def count_zeroed_blocks(worker) -> None:
    """(On the worker) wrap its zeroer so that it counts the block ids it is given."""
    zeroer = zeroer_of(worker)
    zero = zeroer.zero_block_ids
    zeroer.blocks_zeroed = 0

    def counted(block_ids):
        zeroer.blocks_zeroed += len(block_ids)
        zero(block_ids)
    zeroer.zero_block_ids = counted


def take_zeroed_count(worker) -> int:
    zeroer = zeroer_of(worker)
    count, zeroer.blocks_zeroed = zeroer.blocks_zeroed, 0
    return count


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1b")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoModelForCausalLM

    from vllm_rollouts import Engine, configs

    path = Path(tempfile.mkdtemp()) / "SSE-H"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(configs(args.shape)["SSE-H"], dtype=torch.bfloat16).save_pretrained(path)
    engine = Engine("SSE-H", str(path), argparse.Namespace(lengths=[args.length], n=args.n, prompts=args.prompts))
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.needs_kv_cache_zeroing, "this engine zeroes nothing: no A/B to make"
    engine.llm.collective_rpc(count_zeroed_blocks)

    def run(length, zeroing):
        scheduler.needs_kv_cache_zeroing = zeroing
        tps, _ = engine.run(args.prompts, length)
        return tps, engine.llm.collective_rpc(take_zeroed_count)[0]

    run(64, True)
    run(64, False)
    runs = {True: [], False: []}
    for r in range(args.rounds):
        for zeroing in (True, False) if r % 2 == 0 else (False, True):
            tps, blocks = run(args.length, zeroing)
            runs[zeroing].append(dict(tokens_per_s=tps, blocks_zeroed=blocks))
            print(f"round {r + 1}, zeroing {'on ' if zeroing else 'off'}: {tps:,.0f} tokens/s, "
                  f"{blocks} blocks zeroed", flush=True)
    device = torch.cuda.get_device_name()
    date = datetime.now(timezone.utc)
    median = {z: statistics.median(x["tokens_per_s"] for x in runs[z]) for z in runs}
    lines = [f"# Zeroing new attention blocks, SSE-H ({args.shape}) in one vLLM engine, {device}, "
             f"{date.isoformat(timespec='seconds')}", "",
             f"{args.prompts} prompts x {args.n} x {args.length} tokens per generation, in-process engine; "
             f"{args.rounds} rounds, the two settings in turn.", "",
             "| zeroing | median tokens/s | runs (tokens/s) | blocks zeroed per run |", "| --- | ---: | --- | --- |"]
    for z in (True, False):
        speeds = ", ".join(f"{x['tokens_per_s']:,.0f}" for x in runs[z])
        blocks = ", ".join(str(x["blocks_zeroed"]) for x in runs[z])
        lines.append(f"| {'on' if z else 'off'} | {median[z]:,.0f} | {speeds} | {blocks} |")
    lines += ["", f"on / off: {median[True] / median[False]:.3f}"]
    text = "\n".join(lines)
    print(text, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"vllm_zeroing_ab_{date:%Y%m%d-%H%M}"
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps(dict(device=device, date=date.isoformat(), shape=args.shape,
                                                         length=args.length, prompts=args.prompts, n=args.n,
                                                         runs={"on": runs[True], "off": runs[False]}), indent=1))


if __name__ == "__main__":
    main()
