"""Where a vLLM engine's decode steps spend their time, one generation at a time: a light clock in its worker.

Installed through `LLM.collective_rpc` (it runs in the worker, in the engine-core process or in this one), it wraps
the model runner's `execute_model` and `sample_tokens` and records, for every engine step, the host time of the call
and, on a GPU, a CUDA event on the compute stream before the step's work and one after its sampling; it also sums
the garbage collector's pauses in the worker's process, and profiles the GPU's kernels (torch.profiler) over a
window of decode steps in the middle of the generation. `take` summarises a generation:

- `host_ms`: the median time between the host's calls of two consecutive decode steps (the step period);
- `span_ms`: the median GPU time from a decode step's first event (enqueued when the host starts the step) to its
  sampled tokens; `idle_ms`: the median GPU time from one decode step's sampled tokens to the next step's first
  event, i.e. how long the GPU waited for the host (with async scheduling ~0 while the GPU is the bottleneck);
- `kernel_ms`: GPU kernel time per decode step over the profiled window, and its largest kernels;
- `gc_s`, `gc_full`: the garbage collector's pause time and full (generation 2) collections in the worker;
- `host_profile` (when asked): cProfile's table of the thread `collective_rpc` runs in, which in vLLM 0.25 on a
  GPU (one worker in the engine-core process) is the engine core's: scheduler, model runner and output handling.
  cProfile slows that thread (take no tokens/s from such a run); its shares say where the host's step goes.

bench/rollouts.py uses it with `--step-clock`, to see whether a model's decode steps slow down over an engine's
life on the GPU or on the host. The events cost a few microseconds a step; the profiled window adds two GPU
synchronisations and its tracing (the generation's tokens/s is a little lower than an unclocked run's).
bench/decode.py takes every step's row (`take_steps`) and groups the decode steps by how many requests ran in them.
"""
import cProfile
import gc
import io
import pstats
import statistics
import time

import torch

WINDOW = 32  # decode steps profiled


def new_clock(window_at: int | None = None, host_profile: bool = False) -> dict:
    """A generation's clock: its steps, gc pauses, the profiled window's first decode step and results, and the
    cProfile of its host when asked."""
    return dict(steps=[], decode_steps=0, gc_s=0.0, gc_full=0, window_at=window_at, profiler=None, kernels=None,
                cprofile=cProfile.Profile() if host_profile else None)


def install(worker) -> None:
    """(On the worker) Wrap its model runner's step calls with the clock."""
    runner = worker.model_runner
    cuda = torch.cuda.is_available()
    clock = runner.step_clock = new_clock()

    def event():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

    execute, sample = runner.execute_model, runner.sample_tokens

    def timed_execute(scheduler_output, *args, **kwargs):
        tokens = scheduler_output.total_num_scheduled_tokens
        decode = tokens > 0 and tokens == len(scheduler_output.num_scheduled_tokens)
        clock["decode_steps"] += decode
        if cuda and decode and clock["window_at"] is not None:
            if clock["decode_steps"] == clock["window_at"]:
                start_window(clock)
            elif clock["decode_steps"] == clock["window_at"] + WINDOW:
                stop_window(clock)
        requests = len(scheduler_output.num_scheduled_tokens)
        clock["steps"].append([time.perf_counter(), event(), None, decode, requests])
        return execute(scheduler_output, *args, **kwargs)

    def timed_sample(*args, **kwargs):
        out = sample(*args, **kwargs)
        if clock["steps"]:
            clock["steps"][-1][2] = event()
        return out

    gc_started = []

    def on_gc(phase, info):
        if phase == "start":
            gc_started.append(time.perf_counter())
        elif gc_started:
            clock["gc_s"] += time.perf_counter() - gc_started.pop()
            clock["gc_full"] += info["generation"] == 2

    runner.execute_model, runner.sample_tokens = timed_execute, timed_sample
    gc.callbacks.append(on_gc)
    if cuda:  # the profiler's first start in a process sets up its tracing (slow): not inside a timed generation
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.cuda.synchronize()


def start_window(clock) -> None:
    torch.cuda.synchronize()
    clock["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    clock["profiler"].start()


def stop_window(clock) -> None:
    """Kernel ms per decode step of the window, by kernel."""
    torch.cuda.synchronize()
    prof, clock["profiler"] = clock["profiler"], None
    prof.stop()
    clock["kernels"] = {e.key: e.device_time_total / 1e3 / WINDOW for e in prof.key_averages()
                        if e.device_type.name == "CUDA" and e.device_time_total > 0}


def start(worker, window_at: int, host_profile: bool = False) -> None:
    """(On the worker) Clear the clock for the next generation; profile its decode steps from `window_at` on (and
    its host under cProfile with `host_profile`)."""
    clock = worker.model_runner.step_clock
    clock.update(new_clock(window_at, host_profile))
    if clock["cprofile"]:
        clock["cprofile"].enable()


def take(worker) -> dict:
    """(On the worker) The summary of the steps since `start` (see the module's docstring)."""
    clock = worker.model_runner.step_clock
    host_profile = None
    if clock["cprofile"]:
        profiler, clock["cprofile"] = clock["cprofile"], None
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
        host_profile = out.getvalue()
    if clock["profiler"] is not None:  # a generation shorter than its window
        stop_window(clock)
    rows = [row[:4] for row in step_rows(clock)]
    return dict(summarise(rows, clock["gc_s"], clock["gc_full"], clock["kernels"]), host_profile=host_profile)


def step_rows(clock: dict) -> list[tuple]:
    """(host seconds, GPU ms of the step's first event, GPU ms of its sampled tokens, decode?, requests) per step
    since `start`, the GPU times None off a GPU (relative to the first step's event)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps = clock["steps"]
    first = steps[0][1] if steps else None
    return [(host, first.elapsed_time(begin) if begin else None, first.elapsed_time(end) if begin and end else None,
             decode, requests) for host, begin, end, decode, requests in steps]


def take_steps(worker) -> list[tuple]:
    """(On the worker) Every step since `start` as `step_rows` gives it (bench/decode.py groups them by batch)."""
    return step_rows(worker.model_runner.step_clock)


def summarise(rows, gc_s: float, gc_full: int, kernels: dict | None) -> dict:
    """rows: (host seconds, GPU ms of the step's first event, GPU ms of its sampled tokens, decode?) per step, the
    GPU times None off a GPU; kernels: GPU ms per decode step by kernel over the window, or None."""
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if a[3] and b[3]]

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    summary = dict(steps=len(rows), decode_steps=sum(r[3] for r in rows),
                   host_ms=median((b[0] - a[0]) * 1e3 for a, b in pairs),
                   span_ms=median(a[2] - a[1] if a[2] is not None else None for a, _ in pairs),
                   idle_ms=median(b[1] - a[2] if a[2] is not None else None for a, b in pairs),
                   gc_s=gc_s, gc_full=gc_full, kernel_ms=None, top_kernels=None)
    if kernels:
        summary["kernel_ms"] = sum(kernels.values())
        summary["top_kernels"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:6])
    return summary


def describe(summary: dict) -> str:
    """One line of a report."""
    def ms(value):
        return "n/a" if value is None else f"{value:.2f} ms"
    text = (f"{summary['decode_steps']} decode steps, one every {ms(summary['host_ms'])} (host), GPU span "
            f"{ms(summary['span_ms'])}, GPU idle {ms(summary['idle_ms'])} between steps")
    if summary["kernel_ms"] is not None:
        top = ", ".join(f"{name[:32]} {t:.2f}" for name, t in summary["top_kernels"].items())
        text += f"; kernels {summary['kernel_ms']:.2f} ms a step ({top})"
    return text + f"; gc {summary['gc_s']:.2f} s ({summary['gc_full']} full)"
