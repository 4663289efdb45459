"""Input data for running a model: an `.npz` (given, or saved beside the model), or generated.

Either way the data is checked against the model's inputs before anything runs: every input
present, of the model's element type and shape, each dynamic dim one size across inputs
(and the size `--dim` gave it); generated data is refused, before it is allocated, when it
would not fit in this machine's available memory.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import onnx

from engine.dtypes import DType
from engine.errors import RematError
from engine.ir import Graph, Value
from engine.shapes import evaluate, format_bytes, format_shape, free_dims, is_static

from .dtypes import to_onnx
from .importer import import_model, one_line


def feeds_for(model_path: str | Path, inputs: str | Path | None = None,
              dim_examples: dict[str, int] | None = None, seed: int = 0,
              graph: Graph | None = None) -> dict[str, np.ndarray]:
    """Load `inputs` (npz), else MODEL.inputs.npz beside the model, else make data from the input
    types: small normal floats, zeros for integers (valid as indices and class labels).
    `graph`: the model already imported (with `dim_examples`)."""
    model_path = Path(model_path)
    graph = graph if graph is not None else import_model(model_path, dim_examples)
    path = Path(inputs) if inputs else model_path.with_suffix(".inputs.npz")
    if path.exists():
        feeds = load_inputs(path)
        check_feeds(graph, feeds, str(path), str(model_path), dim_examples or {})
        return feeds
    if inputs:
        raise RematError(f"{path}: no such input file")
    try:
        return generate_inputs(graph, seed)
    except RematError as err:
        raise RematError(f"{model_path}: {err}") from None


def feeds_source(model_path: str | Path, inputs: str | Path | None = None) -> str:
    """Where `feeds_for` takes the data from, in words."""
    path = Path(inputs) if inputs else Path(model_path).with_suffix(".inputs.npz")
    return str(path) if path.exists() else f"the inputs made for {model_path}"


def load_inputs(path: Path) -> dict[str, np.ndarray]:
    """Every array of an `.npz` file (no pickled objects)."""
    if path.is_dir():
        raise RematError(f"{path}: is a directory, not an .npz file of inputs")
    try:
        with np.load(path, allow_pickle=False) as data:
            if not isinstance(data, np.lib.npyio.NpzFile):
                raise RematError(f"{path}: is a single .npy array, not an .npz file of named inputs")
            return {k: data[k] for k in data.files}
    except RematError:
        raise
    except MemoryError:
        raise RematError(f"{path}: its arrays do not fit in memory") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        reason = "pickled objects are not allowed" if "pickle" in str(exc) else one_line(str(exc))
        raise RematError(f"{path}: not a readable .npz file of inputs ({reason})") from None


def numpy_dtype(value: Value) -> np.dtype | None:
    """The numpy dtype of an input, None when the model does not say or numpy has none."""
    if value.dtype is DType.UNKNOWN:
        return None
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(to_onnx(value.dtype)))
    except (KeyError, TypeError, ValueError):
        return None


def check_feeds(graph: Graph, feeds: dict[str, np.ndarray], source: str, model: str,
                given: dict[str, int]) -> None:
    """Raise RematError naming the input when `feeds` (read from `source`) do not fit `model`."""
    missing = [v.name for v in graph.inputs if v.name not in feeds]
    if missing:
        raise RematError(f"{source} has no array for input(s) {', '.join(missing)} of {model} "
                         f"(it has: {', '.join(sorted(feeds)) or 'no arrays'})")
    bound: dict[str, tuple[int, str]] = {}
    for value in graph.inputs:
        array = feeds[value.name]
        want = numpy_dtype(value)
        if want is not None and array.dtype != want:
            raise RematError(f"{source}: input {value.name!r} is {array.dtype}, but {model} "
                             f"takes {value.dtype}")
        if value.shape is None:
            continue
        wrong = (f"{source}: input {value.name!r} has shape {tuple(array.shape)}, but {model} "
                 f"takes {format_shape(value.shape)}")
        if array.ndim != len(value.shape):
            raise RematError(wrong)
        for k, (dim, size) in enumerate(zip(value.shape, array.shape)):
            if is_static(dim):
                if int(dim) != size:
                    raise RematError(f"{wrong} (dim {k} is {size}, not {dim})")
                continue
            if size <= 0:
                raise RematError(f"{wrong} (dim {k}, {dim}, is {size}; dims are positive)")
            if getattr(dim, "is_Symbol", False):
                name = dim.name
                if name in bound and bound[name][0] != size:
                    raise RematError(f"{wrong}: {name} is {size} there but {bound[name][0]} in "
                                     f"input {bound[name][1]!r}")
                if name in given and given[name] != size:
                    raise RematError(f"{wrong}: {name} is {size} there, but --dim {name}={given[name]}")
                bound[name] = (size, value.name)
    sizes = {name: size for name, (size, _) in bound.items()}
    for value in graph.inputs:
        for k, dim in enumerate(value.shape or ()):
            if not is_static(dim) and not getattr(dim, "is_Symbol", False) and free_dims(dim) <= set(sizes):
                size = feeds[value.name].shape[k]
                if evaluate(dim, sizes) != size:
                    raise RematError(f"{source}: input {value.name!r} has {size} in dim {k}, but "
                                     f"{model} takes {dim} = {evaluate(dim, sizes)} there")


def input_shape(value: Value, examples: dict[str, int]) -> tuple[int, ...]:
    """The concrete shape of an input at the example sizes; RematError naming what is missing."""
    if value.shape is None:
        raise RematError(f"input {value.name!r} has no shape; pass --inputs FILE.npz")
    shape = []
    for d in value.shape:
        n = int(d) if is_static(d) else evaluate(d, examples)
        if n is None:
            unknown = sorted(free_dims(d) - set(examples))
            raise RematError(f"input {value.name!r} has dim {d} with no example size; pass "
                             + " ".join(f"--dim {u}=N" for u in unknown) + " or --inputs FILE.npz")
        if n <= 0:
            raise RematError(f"input {value.name!r} has dim {d} = {n} at the example sizes; "
                             f"dims are positive")
        shape.append(n)
    return tuple(shape)


def available_memory() -> int | None:
    """Bytes this machine can still allocate (MemAvailable), None when it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def generate_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    plan = []
    for value in graph.inputs:
        dtype = numpy_dtype(value)
        if dtype is None:
            raise RematError(f"input {value.name!r} has element type {value.dtype}, for which remat "
                             f"cannot make data; pass --inputs FILE.npz")
        shape = input_shape(value, graph.dim_examples)
        plan.append((value, shape, dtype, int(np.prod(shape, dtype=object)) * dtype.itemsize))
    _check_fits(plan)
    rng = np.random.default_rng(seed)
    feeds = {}
    for value, shape, dtype, _ in plan:
        if np.issubdtype(dtype, np.floating):
            feeds[value.name] = (rng.standard_normal(shape) * 0.1).astype(dtype)
        else:
            feeds[value.name] = np.zeros(shape, dtype=dtype)
    return feeds


def _check_fits(plan: list[tuple[Value, tuple[int, ...], np.dtype, int]]) -> None:
    """Refuse inputs that would not fit in memory, before allocating them. Floats are drawn in
    float64 first (two such temporaries for the largest input)."""
    if not plan:
        return
    total = sum(nbytes for *_, nbytes in plan)
    temporary = max((nbytes // dtype.itemsize * 16 for _, _, dtype, nbytes in plan
                     if np.issubdtype(dtype, np.floating)), default=0)
    available = available_memory()
    if available is not None and total + temporary > available:
        value, shape, dtype, nbytes = max(plan, key=lambda p: p[3])
        raise RematError(f"input {value.name!r} of shape {shape} ({dtype}) is {format_bytes(nbytes)}; "
                         f"the inputs need {format_bytes(total + temporary)} to make, more than the "
                         f"{format_bytes(available)} of memory available; give smaller --dim sizes")
