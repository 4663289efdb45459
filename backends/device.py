"""The device profile a training step runs on: a GPU preset by name, or this CPU, measured once.

The planner needs three numbers (engine.budget.device): sustained FLOP/s, memory bandwidth
and the fixed cost of one kernel. GPUs are looked up by name (H100, H200, A100); a CPU is
measured with numpy (a float32 matmul, a large copy) and torch's small-op overhead where
torch is installed, then cached in `$XDG_CACHE_HOME/remat/` (default `~/.cache/remat/`) so
the measurement runs once per machine.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from engine.budget.device import PRESETS, DeviceProfile, preset


def cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "remat" / f"cpu-profile-{platform.node() or 'host'}.json"


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
    try:
        import torch

        x = torch.ones(16)
        launch = _best(lambda: [torch.add(x, x) for _ in range(1000)]) / 1000
    except ImportError:
        launch = 20e-6
    # An eager op costs about a microsecond here, but a compiled kernel starts and joins a thread
    # pool and a chunk slice is a subgraph call: 10 us is the floor the planner assumes.
    return DeviceProfile("cpu", flops, bandwidth, max(launch, 10e-6))


def cpu_profile() -> DeviceProfile:
    path = cache_file()
    try:
        return DeviceProfile(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    profile = measure_cpu()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile.to_json()))
    except OSError:
        pass            # a read-only home: measure again next time
    return profile


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

        gpu = torch.cuda.get_device_name(torch.device(name)).lower()
        profile = next((p for key, p in PRESETS.items() if key in gpu), PRESETS["h100"])
        # float32 matmuls run on TF32 tensor cores only where this process allowed it.
        return profile.with_tf32() if torch.backends.cuda.matmul.allow_tf32 else profile
    return preset(name)
