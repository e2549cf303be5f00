"""The machine a CPU benchmark ran on, for its results file: timings on the shared VMs differ by CPU model (an
Intel Xeon VM ran the CPU SSE operator about 2x slower than an AMD EPYC one, docs/retrieval.md)."""
import os
import platform


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows, and the usable cores."""
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} of {os.cpu_count()} cores usable"
