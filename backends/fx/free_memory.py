"""What the device a step runs on has free when it compiles: the `free` budget (engine.budget.spec).

The remat backend compiles a graph at its first call, with the parameters and the batch already
on the device, so what is free then is what the step may take, less what the run allocates after
the compile: the optimizer's state, made at its first `step()` (Adam and AdamW: two tensors the
size of each trainable parameter). That is the default reserve (`optimizer_reserve`); `free-SIZE`
keeps SIZE back instead.
"""
from __future__ import annotations

from pathlib import Path

import torch

CGROUP = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
_NO_LIMIT = 2**60          # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


class FreeMemoryUnknown(Exception):
    """This device's free memory cannot be read."""


def free_bytes(device: torch.device) -> int:
    """The bytes a step on `device` can still allocate. CUDA: what the driver has free plus what
    PyTorch's caching allocator holds unused, within the cap that
    `torch.cuda.set_per_process_memory_fraction` puts on the allocator. CPU (Linux): the kernel's
    MemAvailable, within the memory cgroup's limit (a container's)."""
    if device.type == "cuda":
        return _cuda_free(device)
    if device.type == "cpu":
        return _cpu_free()
    raise FreeMemoryUnknown(f"the free memory of a {device.type} device is not known to remat "
                            f"(it reads CUDA's and, on Linux, the CPU's)")


def _cuda_free(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    cached = torch.cuda.memory_reserved(device) - allocated
    available = free + cached
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1.0:
        available = min(available, int(fraction * total) - allocated)
    return max(0, available)


def _cpu_free() -> int:
    try:
        meminfo = MEMINFO.read_text()
    except OSError:
        raise FreeMemoryUnknown("the CPU's free memory is read from /proc/meminfo, which this system "
                                "does not have") from None
    available = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                      if line.startswith("MemAvailable:")), None)
    if available is None:
        raise FreeMemoryUnknown("/proc/meminfo has no MemAvailable line")
    limit = _cgroup_room()
    return available if limit is None else min(available, limit)


def _cgroup_room() -> int | None:
    """What the memory cgroups this process is in still allow: the least, over its own cgroup and
    each above it (a SLURM job's, a container's, a systemd slice's), of the limit less the usage,
    the page cache the kernel can drop (inactive files) not counted as used, as `docker stats`
    counts it. None where no cgroup has a limit."""
    rooms = [room for room in map(_room, _cgroup_dirs()) if room is not None]
    return min(rooms) if rooms else None


def _cgroup_dirs() -> list[tuple[Path, bool]]:
    """The memory cgroup directories of this process, its own first, each with whether it is
    cgroup v2's (one hierarchy, `0::/path`) or v1's memory controller (`N:memory:/path`)."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        v2 = controllers == "" and (CGROUP / "cgroup.controllers").exists()
        if v2 or "memory" in controllers.split(","):
            base = CGROUP if v2 else CGROUP / "memory"
            own = base / path.lstrip("/")
            return [(d, v2) for d in (own, *own.parents) if d == base or base in d.parents]
    return []


def _room(place: tuple[Path, bool]) -> int | None:
    """One cgroup's limit less its usage (without its inactive page cache); None without a limit."""
    folder, v2 = place
    limit_file, usage_file, inactive_key = (
        ("memory.max", "memory.current", "inactive_file") if v2 else
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    try:
        limit_text = (folder / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            return None
        usage = int((folder / usage_file).read_text())
        stat = folder / "memory.stat"
        inactive = 0
        if stat.exists():
            fields = dict(line.split() for line in stat.read_text().splitlines() if len(line.split()) == 2)
            inactive = int(fields.get(inactive_key, 0))
    except (OSError, ValueError):
        return None         # no limit there (the root has no files), or an unreadable one: none known
    return max(0, int(limit_text) - (usage - inactive))


def trainable_bytes(example_inputs) -> dict[int, int]:
    """The bytes of each trainable parameter among a compile's inputs, by identity."""
    return {id(t): t.numel() * t.element_size() for t in example_inputs
            if isinstance(t, torch.nn.Parameter) and t.requires_grad}


def optimizer_reserve(parameters: dict[int, int]) -> int:
    """Twice the bytes of the trainable parameters (`trainable_bytes`): the state Adam and AdamW
    allocate at their first step, which comes after the compile."""
    return 2 * sum(parameters.values())


def input_device(example_inputs) -> torch.device:
    """The device of a compile's tensor inputs: the first on a GPU, else the CPU."""
    devices = [t.device for t in example_inputs if isinstance(t, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))
