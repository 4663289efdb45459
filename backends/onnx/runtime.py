"""Run ONNX models with ONNX Runtime, and measure a run's peak memory and time.

Peak memory is measured, not estimated (docs/design.md): the run happens in its own
process with MALLOC_MMAP_THRESHOLD_=65536 (so freed buffers go back to the OS),
`5` is written to /proc/self/clear_refs after a warm-up run, and VmHWM is read
after the measured run. The session is the default one (all graph
optimizations, CSE included) with only the CPU arena turned off, because an
arena keeps its high-water mark and would hide what the graph itself needs.
Step time comes from a second process with the default session and allocator:
with the arena off and every large buffer a fresh mapping, a graph that allocates
more often (a Loop's body, once per iteration) would pay page faults that no
user's session pays (measured on the GPT-like step, vocab 32768: with the loss
chunked in a Loop it read 1.13x the original's time that way, 1.09x with the arena on).
Measurement uses the CPU provider, whose memory is the process's; `run` uses
CUDA when ONNX Runtime has it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from engine.errors import RematError
from engine.testing.compare import max_relative_error  # noqa: F401 - where callers import it from


def providers() -> list[str]:
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def make_session(model: onnx.ModelProto | str | Path, threads: int = 1, arena: bool = True,
                 disable_cse: bool = False, cpu_only: bool = False,
                 profile_prefix: str | None = None) -> ort.InferenceSession:
    """A session of `threads` threads; `profile_prefix`: ONNX Runtime's profile of every run is
    written to a file named from it (`end_profiling()` says which), never to the working folder."""
    options = ort.SessionOptions()
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = arena
    options.log_severity_level = 3
    if disable_cse:
        options.add_session_config_entry("optimization.disable_specified_optimizers",
                                         "CommonSubexpressionElimination")
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    try:
        return ort.InferenceSession(source, options,
                                    providers=["CPUExecutionProvider"] if cpu_only else providers())
    except Exception as exc:
        raise RematError(f"{_name(model)}: ONNX Runtime could not load it: {_one_line(exc)}") from None


# Ops whose outputs a graph output cannot hold as a tensor (sequences), or whose shapes a Loop's
# inference leaves to its body.
_NOT_PROBED = frozenset({"Loop", "SplitToSequence", "SequenceConstruct", "SequenceEmpty"})


def inferred_shapes(model: onnx.ModelProto, names: Iterable[str] | None = None) -> dict[str, list]:
    """The shape ONNX Runtime's session infers for each of `names` (by default every value a
    node writes, sequences and Loops aside), read back by declaring them graph outputs of a copy,
    without types: a list of dims, None for an unknown dim, [] for no shape at all (or a scalar).
    Nothing runs. What its allocation planner knows: it reuses a buffer only for a known shape."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    if names is None:
        names = [name for node in probe.graph.node if node.op_type not in _NOT_PROBED for name in node.output if name]
    present = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in dict.fromkeys(names)
                              if name not in present)
    return {o.name: o.shape for o in make_session(probe, cpu_only=True).get_outputs()}


def _name(model: onnx.ModelProto | str | Path) -> str:
    return f"model {model.graph.name!r}" if isinstance(model, onnx.ModelProto) else str(model)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def run(model: onnx.ModelProto | str | Path, feeds: dict[str, np.ndarray],
        threads: int = 1) -> dict[str, np.ndarray]:
    """Outputs by name. One thread by default: ONNX Runtime's scatter-add (embedding
    gradients) sums in a different order run to run with two threads."""
    session = make_session(model, threads=threads)
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    missing = wanted - set(feeds)
    if missing:
        raise RematError(f"{_name(model)}: no data for input(s) {', '.join(sorted(missing))}")
    try:
        results = session.run(names, {k: v for k, v in feeds.items() if k in wanted})
    except Exception as exc:
        raise RematError(f"{_name(model)}: ONNX Runtime failed to run it: {_one_line(exc)}") from None
    return dict(zip(names, results))


@dataclass
class Measurement:
    peak_above_rest: int    # bytes
    rest: int               # bytes, resident after warm-up
    seconds: float          # median step time
    provider: str

    @property
    def peak_mib(self) -> float:
        return self.peak_above_rest / 2**20


def measure(model: onnx.ModelProto | str | Path, feeds: dict[str, np.ndarray],
            repeats: int = 3, threads: int = 1) -> Measurement:
    """Peak memory above rest and step time of one run, in a fresh process."""
    if repeats < 1:
        raise RematError(f"repeats must be at least 1, not {repeats}")
    if threads < 1:
        raise RematError(f"threads must be at least 1, not {threads}")
    data = {}
    for mode in ("peak", "time"):
        data.update(_measured(model, feeds, mode, repeats, threads))
    return Measurement(**data)


def measure_timeline(model: onnx.ModelProto | str | Path, feeds: dict[str, np.ndarray],
                     threads: int = 1):
    """Memory over one step, measured as `measure` measures its peak (its own process,
    MALLOC_MMAP_THRESHOLD_, clear_refs after a warm-up, resident memory above rest): sampled while
    ONNX Runtime runs and placed on the nodes of its profile, in the order it ran them. Returns the
    engine.timeline.MemoryCurve and the step's VmHWM above rest (the peak the samples may miss)."""
    from engine.timeline import MemoryCurve

    data = _measured(model, feeds, "timeline", 1, threads)
    plans = _plans_by_node(model)
    curve = MemoryCurve(f"measured: resident memory, {data['samples']} samples", data["steps"], data["live"],
                        [plans.get(name) for name in data["steps"]], measured=True)
    return curve, data["peak_above_rest"]


def _plans_by_node(model: onnx.ModelProto | str | Path) -> dict[str, str]:
    from .importer import PLAN_KEY

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    return {n.name: p.value for n in proto.graph.node for p in n.metadata_props if p.key == PLAN_KEY}


def _measured(model: onnx.ModelProto | str | Path, feeds: dict[str, np.ndarray], mode: str, repeats: int,
              threads: int) -> dict:
    """One measuring process (measure_child) on `model` and `feeds`; its JSON line. The peak and
    the timeline run with MALLOC_MMAP_THRESHOLD_=65536, so freed buffers leave the process."""
    with tempfile.TemporaryDirectory(prefix="remat-measure-") as tmp:
        model_path = Path(tmp) / "model.onnx"
        if isinstance(model, onnx.ModelProto):
            onnx.save(model, str(model_path))
        else:
            model_path = Path(model).resolve()
            if not model_path.exists():
                raise RematError(f"{model}: no such file")
        feeds_path = Path(tmp) / "feeds.npz"
        np.savez(feeds_path, **feeds)
        env = None if mode == "time" else dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        proc = subprocess.run(
            [sys.executable, "-m", "backends.onnx.measure_child", str(model_path), str(feeds_path),
             str(repeats), str(threads), mode],
            env=env, capture_output=True, text=True, cwd=str(Path(__file__).resolve().parents[2]))
        if proc.returncode != 0:
            raise RematError(f"{_name(model)}: the {mode} measurement failed: {_child_failure(proc)}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def _child_failure(proc: subprocess.CompletedProcess) -> str:
    """Why a measuring process failed, in one line."""
    if proc.returncode < 0:
        reason = f"the process was killed by signal {-proc.returncode}"
        if -proc.returncode == 9:
            reason += " (out of memory?)"
        return reason
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1][-500:] if lines else f"exit status {proc.returncode}"
