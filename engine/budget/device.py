"""Device profiles: what turns FLOPs, bytes moved and kernel launches into seconds.

A profile is a FLOP rate for float32 work, one for 16-bit work, a memory bandwidth, the rate at
which a kernel takes in an operand it reads whole, the fixed cost of one kernel, and the cache a
working set can stay in, with its rate (`cache_bytes`, `cache_bytes_per_s`). The GPU
presets are the vendors' dense peak figures derated to what a training step sustains, and a
launch cost typical of a CUDA kernel from a compiled graph; the CPU profile is measured on the
machine once and cached (backends/device.py), since CPUs differ too much for a table.

Float32 is the trap: PyTorch runs float32 matmuls without TF32 unless the user opts in
(`torch.backends.cuda.matmul.allow_tf32`, `set_float32_matmul_precision("high")`), so an H100
does them at its CUDA cores' 67 TFLOP/s, not its tensor cores' 495. A profile that assumed TF32
made recomputing matmuls look 7x cheaper than it was: on an H100 the planner chose matmul
recomputes that cost 1.6x torch.compile's step at 0.6x its peak. `with_tf32()` gives the
profile for a process that did opt in (backends/device.py asks torch).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops_per_s: float        # sustained, matmul-dominated
    bytes_per_s: float        # sustained memory bandwidth
    launch_s: float           # fixed cost of one kernel (or one op on a CPU)
    half_flops_per_s: float | None = None    # bfloat16/float16 work; None: as float32
    tf32_flops_per_s: float | None = None    # float32 matmuls where TF32 is allowed
    # How fast a kernel takes in an operand it reads whole, a matmul's weight: a chunk region's
    # every slice reads (a CPU's matmul also packs) it again. None: at the memory bandwidth.
    operand_bytes_per_s: float | None = None
    # The working set whose reads and writes stay in the cache, and the rate they go at there.
    # A chunk region's values that one kernel writes and the next reads move at the memory
    # bandwidth when they are whole and larger than this, at the cache's rate when a slice of
    # them fits (`cached_share`). None: not modelled (the GPU presets: unmeasured).
    cache_bytes: int | None = None
    cache_bytes_per_s: float | None = None

    def seconds(self, flops: float, moved: float, kernels: float, half_flops: float = 0.0,
                reread: float = 0.0) -> float:
        """`flops` run at the float32 rate, `half_flops` at the 16-bit one, `reread` bytes of
        whole operands taken in again at the operand rate."""
        return (flops / self.flops_per_s + half_flops / (self.half_flops_per_s or self.flops_per_s)
                + moved / self.bytes_per_s + reread / (self.operand_bytes_per_s or self.bytes_per_s)
                + kernels * self.launch_s)

    @property
    def caches(self) -> bool:
        """Whether the profile models a cache (its size and rate both known)."""
        return bool(self.cache_bytes and self.cache_bytes_per_s)

    def cached_share(self, working: float) -> float:
        """The share of the traffic of a working set of `working` bytes that the cache serves:
        all of it up to `cache_bytes`, `cache_bytes / working` beyond. (This CPU, a copy of
        working sets of 16, 32, 64 and 256 MiB through a 32 MiB last-level cache whose half is
        `cache_bytes`: 114, 49, 40 and 35 GB/s; the share gives 115, 59, 47 and 42.)"""
        if not self.caches or working <= 0:
            return 0.0
        return min(1.0, self.cache_bytes / working)

    def moving_seconds(self, moved: float, share: float) -> float:
        """Seconds `moved` bytes take when `share` of them stay in the cache, the rest at the
        memory bandwidth."""
        cached = share * moved if self.caches else 0.0
        return (moved - cached) / self.bytes_per_s + (cached / self.cache_bytes_per_s if cached else 0.0)

    def with_tf32(self) -> "DeviceProfile":
        """This profile where float32 matmuls may run on TF32 tensor cores."""
        if self.tf32_flops_per_s is None:
            return self
        return replace(self, name=f"{self.name}-tf32", flops_per_s=self.tf32_flops_per_s)

    def to_json(self) -> dict:
        return asdict(self)


PRESETS = {
    # H100 SXM: 67 TFLOP/s float32, 989 bfloat16 and 495 TF32 dense, 3.35 TB/s; about 60% of
    # the compute and 80% of the bandwidth sustained.
    "h100": DeviceProfile("h100", 40e12, 2.7e12, 5e-6, 600e12, 300e12),
    # H200: the same compute, 4.8 TB/s.
    "h200": DeviceProfile("h200", 40e12, 3.8e12, 5e-6, 600e12, 300e12),
    # A100 SXM: 19.5 TFLOP/s float32, 312 bfloat16, 156 TF32 dense, 2.0 TB/s.
    "a100": DeviceProfile("a100", 12e12, 1.6e12, 6e-6, 190e12, 95e12),
    # A conservative CPU for when nothing was measured: two cores of a server.
    "cpu-default": DeviceProfile("cpu-default", 100e9, 10e9, 20e-6),
}


def preset(name: str) -> DeviceProfile:
    from ..errors import ConfigError

    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown device {name!r}; known: {', '.join(sorted(PRESETS))}") from None
