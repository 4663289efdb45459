"""Comparing a run's outputs with a reference's: relative to the reference's largest magnitude.

numpy only: both backends' runs (ONNX Runtime's arrays, torch's tensors as arrays) and
`remat measure --compare` compare the same way.
"""
from __future__ import annotations

import numpy as np

from ..errors import RematError


def max_relative_error(a: dict[str, np.ndarray], b: dict[str, np.ndarray], a_name: str = "the first model",
                       b_name: str = "the second model") -> tuple[float, str]:
    """Largest |a-b| / max|b| over the outputs both have, and which output it was. Outputs in
    common of different shapes, or none in common, are a RematError naming both output lists.
    A NaN or infinity in one output where the other has a finite value is an infinite error."""
    common = [name for name in a if name in b]
    if not common:
        raise RematError(f"{a_name} and {b_name} have no output in common to compare "
                         f"({a_name}: {', '.join(a) or 'none'}; {b_name}: {', '.join(b) or 'none'})")
    worst, where = 0.0, common[0]
    for name in common:
        x, y = np.asarray(a[name], np.float64), np.asarray(b[name], np.float64)
        if x.shape != y.shape:
            raise RematError(f"output {name!r} has shape {x.shape} in {a_name} but {y.shape} in "
                             f"{b_name}; they cannot be compared")
        err = relative_error(x, y)
        if err >= worst:
            worst, where = err, name
    return worst, where


def relative_error(x: np.ndarray, y: np.ndarray) -> float:
    """max |x - y| / max |y| over the finite elements; NaN against NaN (or the same infinity)
    agrees, a non-finite element on one side only is an infinite error."""
    if not y.size:
        return 0.0
    finite = np.isfinite(x) & np.isfinite(y)
    same_nonfinite = (np.isnan(x) & np.isnan(y)) | ((x == y) & ~finite)
    if not np.all(finite | same_nonfinite):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(y[finite]).max()), 1e-12)
    return float(np.abs(x[finite] - y[finite]).max() / scale)
