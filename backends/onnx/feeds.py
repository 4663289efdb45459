"""Input data for running a model: the `.inputs.npz` saved beside it, or generated."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from engine.errors import RematError
from engine.shapes import evaluate, is_static

from .importer import import_model


def feeds_for(model_path: str | Path, inputs: str | Path | None = None,
              dim_examples: dict[str, int] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Load `inputs` (npz), else MODEL.inputs.npz beside the model, else make data from the input
    types: small normal floats, zeros for integers (valid as indices and class labels)."""
    model_path = Path(model_path)
    candidates = [Path(inputs)] if inputs else [model_path.with_suffix(".inputs.npz")]
    for path in candidates:
        if path.exists():
            with np.load(path) as data:
                return {k: data[k] for k in data.files}
        if inputs:
            raise RematError(f"{path}: no such input file")
    graph = import_model(model_path, dim_examples)
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in graph.inputs:
        if value.shape is None:
            raise RematError(f"input {value.name!r} has no shape; pass --inputs FILE.npz")
        shape = []
        for d in value.shape:
            n = int(d) if is_static(d) else evaluate(d, graph.dim_examples)
            if n is None:
                raise RematError(f"input {value.name!r} has dim {d} with no example value; "
                                 f"pass --dim {d}=N or --inputs FILE.npz")
            shape.append(n)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(_onnx_type(value.dtype))
        if np.issubdtype(dtype, np.floating):
            feeds[value.name] = (rng.standard_normal(shape) * 0.1).astype(dtype)
        else:
            feeds[value.name] = np.zeros(shape, dtype=dtype)
    return feeds


def _onnx_type(dtype) -> int:
    from .dtypes import to_onnx

    return to_onnx(dtype)
