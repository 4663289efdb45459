"""A memory budget as users write it: bytes with a unit (`400MiB`, `1.5 GiB`) or a fraction of
the original graph's estimated peak (`0.6`)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..guards import SIZE_UNITS

_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class Budget:
    bytes: int | None = None        # an absolute limit
    fraction: float | None = None   # of the original's estimated peak
    ratio: float | None = None      # of the layers' stashed activations to recompute (engine.budget.layers)

    def limit(self, original_peak: int) -> int:
        """Bytes, for a size or a fraction (a ratio needs the layers: engine.budget.layers.ratio_target)."""
        if self.ratio is not None:
            raise ValueError("a ratio's limit depends on the layers: use engine.budget.layers.ratio_target")
        return self.bytes if self.bytes is not None else int(self.fraction * original_peak)

    def __str__(self) -> str:
        if self.bytes is not None:
            return f"{self.bytes / 2**20:.1f} MiB"
        if self.fraction is not None:
            return f"{self.fraction:g}x the original peak"
        return f"ratio {self.ratio:g} of the layers' activations"


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
    """`400MiB`, `2GB`, `123456789` (bytes, an int), or a fraction in (0, 1] (`0.6`)."""
    if isinstance(text, Budget):
        return text
    if isinstance(text, bool):
        raise ConfigError(f"budget {text!r}: give bytes with a unit (400MiB) or a fraction of the peak (0.6)")
    if isinstance(text, int):
        return _bytes(float(text), repr(text))
    if isinstance(text, float):
        return _fraction(text, repr(text))
    m = _BUDGET.match(str(text))
    if m is None:
        raise ConfigError(f"budget {text!r}: expected bytes with a unit (400MiB, 1.5GiB) or a fraction "
                          f"of the original's peak (0.6)")
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


def _bytes(value: float, text: str) -> Budget:
    if not math.isfinite(value) or value < 1 or value >= 2**63:
        raise ConfigError(f"budget {text}: must be a positive size below 8 EiB")
    return Budget(bytes=int(value))


def _fraction(value: float, text: str) -> Budget:
    if not math.isfinite(value) or not 0 < value <= 1:
        raise ConfigError(f"budget {text}: a fraction of the original's peak is in (0, 1]")
    return Budget(fraction=value)
