"""A step's peak memory, measured as the README's Benchmarks say: on a CPU, `5` written to
/proc/self/clear_refs resets the process's high-water mark, and VmHWM after the step less VmRSS
before it is the peak above rest (run with MALLOC_MMAP_THRESHOLD_=65536 so freed buffers leave
the process); on a GPU, torch.cuda.max_memory_allocated after a reset."""
from __future__ import annotations

import gc


def proc_status() -> dict[str, int]:
    """The kB fields of /proc/self/status."""
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0])
    return fields


def reset_peak(cuda: bool) -> int:
    """Start measuring: the bytes in use now (the rest the peak is measured above). What earlier
    work (a compile) left in reference cycles is freed first: otherwise whether the collector ran
    before or during the measured step moved its peak (30 MiB, remat at 172 MiB on the GPT-like
    step of bench/budget.py, with a few more objects made while compiling)."""
    gc.collect()
    if cuda:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status()["VmRSS"] * 1024


def peak_bytes(cuda: bool) -> int:
    """The highest bytes in use since reset_peak (rest included)."""
    if cuda:
        import torch

        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return proc_status()["VmHWM"] * 1024
