"""Comparing a run's outputs with a reference's: relative to the reference's largest magnitude.

numpy only: both backends' runs (ONNX Runtime's arrays, torch's tensors as arrays) and
`remat measure --compare` compare the same way.
"""
from __future__ import annotations

import numpy as np

from ..errors import RematError


# An output whose largest magnitude is below this fraction of the largest output's is rounding
# noise (an attention key bias's gradient is zero in exact arithmetic: ALBERT's read 3.6e-12
# against gradients of 8, BERT's 3e-12 against 1), and is compared against that fraction instead.
NOISE_FLOOR = 1e-6


def noise_floor(reference: dict[str, np.ndarray]) -> float:
    """NOISE_FLOOR times the largest finite magnitude of the reference's outputs."""
    largest = 0.0
    for value in reference.values():
        y = np.abs(np.asarray(value, np.float64))
        finite = y[np.isfinite(y)]
        if finite.size:
            largest = max(largest, float(finite.max()))
    return NOISE_FLOOR * largest


def relative_errors(a: dict[str, np.ndarray], b: dict[str, np.ndarray], a_name: str = "the first model",
                    b_name: str = "the second model") -> dict[str, float]:
    """Each output both have: max |a-b| over max |b| (at least `noise_floor(b)`). Outputs in
    common of different shapes, or none in common, are a RematError naming both output lists.
    A NaN or infinity in one output where the other has a finite value is an infinite error."""
    common = [name for name in a if name in b]
    if not common:
        raise RematError(f"{a_name} and {b_name} have no output in common to compare "
                         f"({a_name}: {', '.join(a) or 'none'}; {b_name}: {', '.join(b) or 'none'})")
    floor = noise_floor({name: b[name] for name in common})
    errors = {}
    for name in common:
        x, y = np.asarray(a[name], np.float64), np.asarray(b[name], np.float64)
        if x.shape != y.shape:
            raise RematError(f"output {name!r} has shape {x.shape} in {a_name} but {y.shape} in "
                             f"{b_name}; they cannot be compared")
        errors[name] = relative_error(x, y, floor)
    return errors


def max_relative_error(a: dict[str, np.ndarray], b: dict[str, np.ndarray], a_name: str = "the first model",
                       b_name: str = "the second model") -> tuple[float, str]:
    """The largest of `relative_errors` and which output it was."""
    errors = relative_errors(a, b, a_name, b_name)
    where = max(errors, key=lambda name: errors[name])
    return errors[where], where


def relative_error(x: np.ndarray, y: np.ndarray, floor: float = 0.0) -> float:
    """max |x - y| / max |y| (at least `floor`) over the finite elements; NaN against NaN (or the
    same infinity) agrees, a non-finite element on one side only is an infinite error."""
    if not y.size:
        return 0.0
    finite = np.isfinite(x) & np.isfinite(y)
    same_nonfinite = (np.isnan(x) & np.isnan(y)) | ((x == y) & ~finite)
    if not np.all(finite | same_nonfinite):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(y[finite]).max()), floor, 1e-12)
    return float(np.abs(x[finite] - y[finite]).max() / scale)
