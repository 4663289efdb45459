"""A memory budget as users write it: bytes with a unit (`400MiB`, `1.5 GiB`), a fraction of
the original graph's estimated peak (`0.6`), or `free` (`free-2GiB`): what the device the step runs
on has free when it compiles, less a reserve, which only a backend that compiles on the device can
measure (`Budget.on_device`)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..guards import SIZE_UNITS
from ..shapes import format_bytes

_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_FREE = re.compile(r"^\s*free\s*(?:-\s*(.+?))?\s*$", re.IGNORECASE)

# Of what is free, left to the allocator: its rounding of each block and fragmentation (PyTorch's
# caching allocator can fail a request with more than that reserved but split), and to the
# estimate's own error (measured within 1.05x of the budget on an H100).
FREE_HEADROOM = 0.10
# A free budget is rounded down to a multiple of 1/64 of its largest power of two (at least 1 MiB:
# 256 MiB at 20 GiB): the free memory moves by a few MiB between compiles, and the budget is part
# of the compile's cache key (backends.fx.compile.RematPass.uuid).
FREE_STEPS = 64

UNRESOLVED_FREE = ("budget {budget!r} is the memory free on the device the step runs on, which "
                   "torch.compile's remat backend measures when it compiles; a graph rewritten ahead of "
                   "its run has no device yet: give bytes (400MiB) or a fraction of the peak (0.6)")


@dataclass(frozen=True)
class Budget:
    bytes: int | None = None        # an absolute limit
    fraction: float | None = None   # of the original's estimated peak
    ratio: float | None = None      # of the layers' stashed activations to recompute (engine.budget.layers)
    free: bool = False              # the device's free memory less `reserve`, resolved by on_device
    reserve: int | None = None      # of a free budget: bytes kept back (None: the backend's default)
    # Bytes the planner keeps below the limit: what a backend found its simulation of this graph
    # low by, once it compiled it (backends.fx.compile: Inductor's account of its code).
    cut: int = 0

    def limit(self, original_peak: int) -> int:
        """Bytes, for a size or a fraction (a ratio needs the layers: engine.budget.layers.ratio_target;
        a free budget the device: on_device)."""
        if self.ratio is not None:
            raise ValueError("a ratio's limit depends on the layers: use engine.budget.layers.ratio_target")
        if self.free:
            raise ConfigError(UNRESOLVED_FREE.format(budget=str(self)))
        return self.bytes if self.bytes is not None else int(self.fraction * original_peak)

    def on_device(self, free: int, default_reserve: int) -> "Budget":
        """A free budget in bytes, given the bytes the device has free: less the reserve (the one
        written, else `default_reserve`, what the backend expects the run to allocate after the
        compile), less FREE_HEADROOM, rounded down (FREE_STEPS); at least 1 byte (a device too
        full for the step is the planner's BudgetError, which names the lowest peak there is)."""
        if not self.free:
            raise ValueError("on_device resolves a free budget")
        reserve = default_reserve if self.reserve is None else self.reserve
        usable = int(max(0, free - reserve) * (1 - FREE_HEADROOM))
        granule = max(2**20, (1 << max(0, usable.bit_length() - 1)) // FREE_STEPS)
        return Budget(bytes=max(1, usable // granule * granule))

    def __str__(self) -> str:
        if self.bytes is not None:
            return f"{self.bytes / 2**20:.1f} MiB"
        if self.fraction is not None:
            return f"{self.fraction:g}x the original peak"
        if self.free:
            return "free" if self.reserve is None else f"free-{format_bytes(self.reserve).replace(' ', '')}"
        return f"ratio {self.ratio:g} of the layers' activations"

    def planned_for(self, limit: int) -> int:
        """The bytes the planner plans for, under a resolved `limit`: less the cut."""
        return max(1, limit - self.cut)


def parse_ratio(value: str | float) -> Budget:
    """`--ratio R`: the fraction, in (0, 1], of the layers' activations to recompute."""
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"ratio {value!r}: expected a number in (0, 1], like 0.5") from None
    if not math.isfinite(ratio) or not 0 < ratio <= 1:
        raise ConfigError(f"ratio {value!r}: the fraction of the layers' activations to recompute is in (0, 1]")
    return Budget(ratio=ratio)


def parse_budget(text: str | int | float | Budget) -> Budget:
    """`400MiB`, `2GB`, `123456789` (bytes, an int), a fraction in (0, 1] (`0.6`), or `free`
    (`free-2GiB`: keeping 2 GiB back)."""
    if isinstance(text, Budget):
        return text
    if isinstance(text, bool):
        raise ConfigError(f"budget {text!r}: give bytes with a unit (400MiB) or a fraction of the peak (0.6)")
    if isinstance(text, int):
        return _bytes(float(text), repr(text))
    if isinstance(text, float):
        return _fraction(text, repr(text))
    free = _FREE.match(str(text))
    if free is not None:
        if free.group(1) is None:
            return Budget(free=True)
        return Budget(free=True, reserve=_size(free.group(1), text))
    m = _BUDGET.match(str(text))
    if m is None:
        raise ConfigError(f"budget {text!r}: expected bytes with a unit (400MiB, 1.5GiB), a fraction "
                          f"of the original's peak (0.6), or the device's free memory (free, free-2GiB)")
    number, unit = float(m.group(1)), m.group(2)
    if not unit:
        if number <= 1:
            return _fraction(number, text)
        if not number.is_integer():
            raise ConfigError(f"budget {text!r}: a fraction of the peak is at most 1, and a size needs a "
                              f"unit (400MiB) or is a whole number of bytes")
        return _bytes(number, text)
    if unit not in SIZE_UNITS:
        raise ConfigError(f"budget {text!r}: unknown unit {unit!r}; units: {', '.join(SIZE_UNITS)}")
    return _bytes(number * SIZE_UNITS[unit], text)


def _size(part: str, text: str) -> int:
    """The bytes of `free-SIZE`'s SIZE: a number with a unit, or a whole number of bytes (0 too)."""
    m = _BUDGET.match(part)
    number = None if m is None else float(m.group(1))
    unit = "B" if m is None or not m.group(2) else m.group(2)
    if m is None or unit not in SIZE_UNITS or (not m.group(2) and not number.is_integer()):
        raise ConfigError(f"budget {text!r}: `free-SIZE` keeps SIZE back from the free memory: a size with "
                          f"a unit ({', '.join(SIZE_UNITS)}), like free-2GiB")
    value = number * SIZE_UNITS[unit]
    if not math.isfinite(value) or value >= 2**63:
        raise ConfigError(f"budget {text!r}: the size kept back must be below 8 EiB")
    return int(value)


def _bytes(value: float, text: str) -> Budget:
    if not math.isfinite(value) or value < 1 or value >= 2**63:
        raise ConfigError(f"budget {text}: must be a positive size below 8 EiB")
    return Budget(bytes=int(value))


def _fraction(value: float, text: str) -> Budget:
    if not math.isfinite(value) or not 0 < value <= 1:
        raise ConfigError(f"budget {text}: a fraction of the original's peak is in (0, 1]")
    return Budget(fraction=value)
