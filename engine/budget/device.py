"""Device profiles: what turns FLOPs, bytes moved and kernel launches into seconds.

A profile is three numbers. The GPU presets are the vendors' dense peak figures (TF32 tensor
cores for matmuls, HBM bandwidth) derated to what a training step sustains, and a launch
cost typical of a CUDA kernel from a compiled graph; the CPU profile is measured on the
machine once and cached (backends/device.py), since CPUs differ too much for a table.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops_per_s: float        # sustained, matmul-dominated
    bytes_per_s: float        # sustained memory bandwidth
    launch_s: float           # fixed cost of one kernel (or one op on a CPU)

    def seconds(self, flops: float, moved: float, kernels: float) -> float:
        return flops / self.flops_per_s + moved / self.bytes_per_s + kernels * self.launch_s

    def to_json(self) -> dict:
        return asdict(self)


PRESETS = {
    # H100 SXM: 495 TFLOP/s TF32 dense, 3.35 TB/s; about 60% and 80% of it sustained.
    "h100": DeviceProfile("h100", 300e12, 2.7e12, 5e-6),
    # H200: the same compute, 4.8 TB/s.
    "h200": DeviceProfile("h200", 300e12, 3.8e12, 5e-6),
    # A100 SXM: 156 TFLOP/s TF32 dense, 2.0 TB/s.
    "a100": DeviceProfile("a100", 95e12, 1.6e12, 6e-6),
    # A conservative CPU for when nothing was measured: two cores of a server.
    "cpu-default": DeviceProfile("cpu-default", 100e9, 10e9, 20e-6),
}


def preset(name: str) -> DeviceProfile:
    from ..errors import ConfigError

    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown device {name!r}; known: {', '.join(sorted(PRESETS))}") from None
