"""The device profile a training step runs on: a GPU preset by name, or this CPU, measured once.

The planner needs six numbers (engine.budget.device): sustained FLOP/s, memory bandwidth, the
rate at which a matmul takes in an operand it is given whole, the fixed cost of one kernel, and
the cache a working set stays in with its rate. GPUs are looked up by name (H100, H200, A100); a
CPU is measured with numpy (a float32 matmul, a large copy, a copy that fits the last-level
cache, whose size the OS gives), and, where torch is installed, with torch's small-op overhead and
its matmul's cost of a weight read again by slices, then cached in `$XDG_CACHE_HOME/remat/`
(default `~/.cache/remat/`) so the measurement runs once per machine.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from pathlib import Path

from engine.budget.device import PRESETS, DeviceProfile, preset


def cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    # v2: profiles cached before session 48 may have been measured on fake tensors (measure_cpu).
    return base / "remat" / f"cpu-profile-v2-{platform.node() or 'host'}.json"


def _best(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu() -> DeviceProfile:
    import numpy as np

    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    flops = 2 * n ** 3 / _best(lambda: a @ a)
    big = np.ones(16 * 2 ** 20, dtype=np.float32)        # 64 MiB
    out = np.empty_like(big)
    bandwidth = 2 * big.nbytes / _best(lambda: np.copyto(out, big))
    cache, cache_rate = _cache(np, bandwidth)
    try:
        import torch
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:
        launch, operand = 20e-6, None
    else:
        # Measured on real tensors: the torch backend plans inside AOTAutograd, whose fake tensor
        # mode would make these fake, each op a Python dispatch and each matmul computing nothing
        # (a profile measured so, and cached, had a launch of 224 us and an operand rate 5-8x
        # this machine's; its plans weighed every chunk slice at 22x its cost).
        with _disable_current_modes():
            x = torch.ones(16)
            launch = _best(lambda: [torch.add(x, x) for _ in range(1000)]) / 1000
            operand = _operand_rate(torch)
    # An eager op costs about a microsecond here, but a compiled kernel starts and joins a thread
    # pool and a chunk slice is a subgraph call: 10 us is the floor the planner assumes.
    return DeviceProfile("cpu", flops, bandwidth, max(launch, 10e-6), operand_bytes_per_s=operand,
                         cache_bytes=cache, cache_bytes_per_s=cache_rate)


def last_level_cache() -> int | None:
    """Bytes of the CPU's last-level data cache, as the OS gives it (Linux's sysfs, else sysconf);
    None where it does not."""
    best: tuple[int, int] | None = None
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(root.glob("index*")) if root.is_dir() else []:
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit() and (best is None or level > best[0]):
            best = (level, int(digits) * scale)
    if best is not None:
        return best[1]
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if size and size > 0:
            return size
    return None


def _cache(np, bandwidth: float) -> tuple[int | None, float | None]:
    """(the working set that stays in the cache, the rate of a copy within it). Half the
    last-level cache: a slice's values share it with what streams past them (here, a copy of a
    16 MiB working set ran at 114 GB/s through the 32 MiB cache, one of 32 MiB at 49, with the
    memory's 40). (None, None) where the OS gives no size, or a copy in the cache is not faster."""
    size = last_level_cache()
    if not size:
        return None, None
    working = size // 2
    a = np.ones(working // 2 // 4, dtype=np.float32)       # it and its copy: the working set
    out = np.empty_like(a)
    repeats = max(1, (256 * 2 ** 20) // a.nbytes)
    rate = 2 * a.nbytes * repeats / _best(lambda: [np.copyto(out, a) for _ in range(repeats)])
    return (working, rate) if rate > 1.2 * bandwidth else (None, None)


def _operand_rate(torch, rows: int = 1024, slices: int = 8) -> float | None:
    """How fast torch's matmul takes in an operand it is given whole, as a chunk region's slices
    give it the loss's weight (32 MiB): the time the loss's two products (the logits,
    `h @ W.T`, and their gradient's, `g @ W`) take in `slices` slices of `rows / slices` rows
    beyond their time whole, per byte of the weight read again. None where slicing costs
    nothing measurable."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32768, 256, generator=gen)
    h, g = torch.randn(rows, 256, generator=gen), torch.randn(rows, 32768, generator=gen)
    # Into buffers made once: fresh ones of the whole product's size would be paged in anew
    # (glibc maps every block over 32 MiB), a cost of its own that this is not about.
    logits, grad = torch.empty(rows, 32768), torch.empty(rows, 256)
    step = rows // slices
    pairs = [(h[i:i + step], g[i:i + step], logits[i:i + step], grad[i:i + step]) for i in range(0, rows, step)]
    whole = _best(lambda: (torch.mm(h, weight.t(), out=logits), torch.mm(g, weight, out=grad)), repeats=3)
    sliced = _best(lambda: [(torch.mm(a, weight.t(), out=c), torch.mm(b, weight, out=d)) for a, b, c, d in pairs],
                   repeats=3)
    extra = sliced - whole
    if extra <= 0:
        return None
    return 2 * (slices - 1) * weight.nbytes / extra


# This process's measurement where it was not cached (the machine was busy): measured once a process.
_UNCACHED: list[DeviceProfile] = []


def cpu_profile() -> DeviceProfile:
    """This CPU's profile: cached, else measured. A measurement taken while other work keeps the
    cores busy is used by this process but not cached, and the next process measures again: under
    load the rates come out low and unevenly so (a test run on both cores of this machine measured
    126 GFLOP/s of 253, a launch 73 us of 10 and an operand rate 8x the idle one), and a cached
    profile would carry that into every later plan."""
    path = cache_file()
    try:
        cached = json.loads(path.read_text())
        # A profile cached before remat measured all it now does is measured again.
        if set(cached) == {f.name for f in dataclasses.fields(DeviceProfile)}:
            return DeviceProfile(**cached)
    except (OSError, ValueError, TypeError):
        pass
    if _UNCACHED:
        return _UNCACHED[0]
    profile = measure_cpu()
    if busy():
        _UNCACHED.append(profile)
        return profile
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile.to_json()))
    except OSError:
        pass            # a read-only home: measure again next time
    return profile


def busy() -> bool:
    """Whether other work keeps at least half of this process's cores busy: the one-minute load
    average less this process's own core is at least half the cores it may run on."""
    try:
        load = os.getloadavg()[0]
    except OSError:     # pragma: no cover - no load average on this platform
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return load - 1 >= cores / 2


def profile_for(device: str | DeviceProfile | None) -> DeviceProfile:
    """`cpu` (measured), a preset name (`h100`, `h200`, `a100`), `cuda` (the current GPU by its
    name), or a profile as it is; None is the CPU."""
    if isinstance(device, DeviceProfile):
        return device
    name = (device or "cpu").lower()
    if name == "cpu":
        return cpu_profile()
    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            from engine.errors import ConfigError

            raise ConfigError(f"device {device!r}: this machine has no CUDA device; to plan for one "
                              f"without it, name its profile: {', '.join(sorted(PRESETS))}")
        gpu = torch.cuda.get_device_name(torch.device(name)).lower()
        profile = next((p for key, p in PRESETS.items() if key in gpu), PRESETS["h100"])
        # float32 matmuls run on TF32 tensor cores only where this process allowed it.
        return profile.with_tf32() if torch.backends.cuda.matmul.allow_tf32 else profile
    return preset(name)
