"""A pipeline spec as users write it (JSON), parsed into dataclasses and checked field by field.

    {"stages": 4, "microbatches": 4, "schedule": "1f1b", "memory_per_stage": 20,
     "layers": {"count": 32, "forward": 1, "backward": 2, "activation": 1.25,
                "options": [{"name": "checkpoint", "activation": 0.125, "extra": 1}]}}

Memory is a number of GB (10**9 bytes) or a string with a unit (`"300MiB"`); time is in any one
unit (the seed's: one layer's forward). A layer's own figures are its unchecked option; its
`options` add to that. Optional per layer: `weights` (parameters and gradients), `optimizer`
(its state), `workspace` (what its forward and backward need beyond the held bytes while they
run), `output` (what a stage ending with it keeps per micro-batch in flight: its output). `layers` is one object (with a `count`) or a list of them, in model order.
In place of `layers`, `model` names a model to measure the figures from (backends.pipeline): the
engine only checks its shape here.

Every error names the field (`layers[2].options[0].extra: ...`).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..guards import SIZE_UNITS

GB = 10**9
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
UNCHECKED = "none"


@dataclass(frozen=True)
class Option:
    """One way to run a layer: the bytes it holds per micro-batch in flight, the time it adds to
    a micro-batch's forward and backward, and what its forward and backward need on top of the
    held bytes while they run (one layer at a time)."""

    name: str
    activation: float       # bytes
    extra: float = 0.0      # time
    workspace: float = 0.0  # bytes
    plans: tuple[tuple[str, int, int], ...] = ()    # measured options: (plan key, type, occurrences) it applies


@dataclass(frozen=True)
class Layer:
    """A layer's figures. `options[0]` is the layer run as is (named `none`)."""

    forward: float
    backward: float
    options: tuple[Option, ...]
    weights: float = 0.0      # bytes: parameters and their gradients
    optimizer: float = 0.0    # bytes: optimizer state
    name: str = ""
    output: float = 0.0       # bytes a stage ending with this layer holds per micro-batch in flight

    @property
    def static(self) -> float:
        return self.weights + self.optimizer

    def time(self, option: int) -> float:
        return self.forward + self.backward + self.options[option].extra


@dataclass(frozen=True)
class ModelSource:
    """`"model": {...}`: a model the backend measures the layers' figures from."""

    name: str
    sizes: dict[str, int] = field(default_factory=dict)     # the model's own constructor sizes
    tiers: tuple[str, ...] = ()
    device: str = "cpu"
    optimizer: str = "sgd"    # sgd (no state), momentum (one copy of the weights), adam (two)


@dataclass(frozen=True)
class PipelineSpec:
    stages: int                       # devices (pipeline ranks)
    microbatches: int
    schedule: str
    virtual_stages: int               # model chunks per device (interleaved-1f1b), else 1
    memory: tuple[float, ...]         # bytes, one limit per device
    layers: tuple[Layer, ...] = ()
    model: ModelSource | None = None
    time_unit: str = "layer forwards"
    source: str = "spec"              # where the spec came from, for messages

    @property
    def chunks(self) -> int:
        """Contiguous pieces the layers are split into: virtual stage c runs on device c % stages."""
        return self.stages * self.virtual_stages


def load_spec(path: str | Path) -> PipelineSpec:
    """Read and check a JSON spec file; a syntax error names `file:line:col`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    return parse_spec(data, str(path))


_TOP = ("stages", "microbatches", "schedule", "virtual_stages", "memory_per_stage", "layers", "model")
_LAYER = ("count", "name", "forward", "backward", "activation", "weights", "optimizer", "workspace", "output",
          "options")
_OPTION = ("name", "activation", "extra", "workspace")
_MODEL = ("name", "tiers", "device", "optimizer")
OPTIMIZERS = {"sgd": 0, "momentum": 1, "adam": 2}    # copies of the weights the optimizer keeps


def parse_spec(data: object, source: str = "spec") -> PipelineSpec:
    """A PipelineSpec from a parsed JSON object; ConfigError naming the field otherwise."""
    where = _Where(source)
    obj = where.object(data, "", _TOP)
    stages = where.integer(obj, "stages", minimum=1)
    microbatches = where.integer(obj, "microbatches", minimum=1)
    schedule = obj.get("schedule", "1f1b")
    if schedule not in SCHEDULES:
        raise where.error("schedule", f"expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if schedule == "interleaved-1f1b":
        virtual = where.integer(obj, "virtual_stages", minimum=2, default=2)
        rounds = max(1, microbatches // stages)
        if microbatches % rounds:
            raise where.error("microbatches", f"interleaved-1f1b runs micro-batches in rounds of "
                                              f"{microbatches // rounds}; {microbatches} is not a multiple of "
                                              f"{rounds} rounds")
    else:
        if "virtual_stages" in obj and obj["virtual_stages"] != 1:
            raise where.error("virtual_stages", f"only interleaved-1f1b has virtual stages, not {schedule}")
        virtual = 1
    if schedule == "1f1b" and microbatches < stages:
        raise where.error("microbatches", f"1f1b needs at least as many micro-batches as stages ({stages}), "
                                          f"got {microbatches}")
    memory = where.limits(obj, stages)
    if ("layers" in obj) == ("model" in obj):
        raise where.error("", "give either `layers` (each layer's figures) or `model` (a model to measure "
                              "them from), not " + ("both" if "layers" in obj else "neither"))
    if "model" in obj:
        return PipelineSpec(stages, microbatches, schedule, virtual, memory, (), where.model(obj["model"]),
                            "s", source)
    layers = where.layers(obj["layers"])
    spec = PipelineSpec(stages, microbatches, schedule, virtual, memory, layers, None, "layer forwards", source)
    check_layer_count(spec)
    return spec


def check_layer_count(spec: PipelineSpec) -> None:
    if len(spec.layers) < spec.chunks:
        what = f"{spec.stages} stages" + (f" x {spec.virtual_stages} virtual stages" if spec.virtual_stages > 1
                                          else "")
        raise ConfigError(f"{spec.source}: layers: {len(spec.layers)} layer(s) cannot fill {what}: every "
                          f"stage needs at least one")


class _Where:
    """Field checks that name the offending field in their errors."""

    def __init__(self, source: str):
        self.source = source

    def error(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {path + ': ' if path else ''}{message}")

    def object(self, value: object, path: str, allowed: tuple[str, ...]) -> dict:
        if not isinstance(value, dict):
            raise self.error(path, f"expected a JSON object, got {_kind(value)}")
        for key in value:
            if key not in allowed:
                raise self.error(_join(path, key), f"unknown field; fields here: {', '.join(allowed)}")
        return value

    def _absent(self, obj: dict, key: str, name: str, default, what: str) -> bool:
        """Whether the field is left out (and has a default); an error if it may not be."""
        if key in obj:
            return False
        if default is None:
            raise self.error(name, f"missing ({what})")
        return True

    def integer(self, obj: dict, key: str, path: str = "", minimum: int = 0, default: int | None = None) -> int:
        name = _join(path, key)
        if self._absent(obj, key, name, default, "a whole number"):
            return default
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise self.error(name, f"expected a whole number, got {_kind(value)}")
        if value < minimum:
            raise self.error(name, f"must be at least {minimum}, got {value}")
        return value

    def number(self, obj: dict, key: str, path: str, default: float | None = None) -> float:
        name = _join(path, key)
        if self._absent(obj, key, name, default, "a number"):
            return default
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(name, f"expected a number, got {_kind(value)}")
        if value < 0:
            raise self.error(name, f"must not be negative, got {value}")
        return float(value)

    def memory(self, obj: dict, key: str, path: str, default: float | None = None) -> float:
        """Bytes, from a number of GB or a string with a unit."""
        name = _join(path, key)
        if self._absent(obj, key, name, default, "GB, or a size with a unit such as \"300MiB\""):
            return default
        return self._size(obj[key], name)

    def _size(self, value: object, name: str) -> float:
        if isinstance(value, str):
            m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]+)\s*", value)
            if m is None or m.group(2) not in SIZE_UNITS:
                raise self.error(name, f"expected GB (a number) or a size with a unit ({', '.join(SIZE_UNITS)}), "
                                       f"got {value!r}")
            return float(m.group(1)) * SIZE_UNITS[m.group(2)]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(name, f"expected GB (a number) or a size with a unit such as \"300MiB\", "
                                   f"got {_kind(value)}")
        if value < 0:
            raise self.error(name, f"must not be negative, got {value}")
        return float(value) * GB

    def limits(self, obj: dict, stages: int) -> tuple[float, ...]:
        key = "memory_per_stage"
        if key not in obj:
            raise self.error(key, "missing: each device's memory (GB, or a list of one per stage)")
        value = obj[key]
        if isinstance(value, list):
            if len(value) != stages:
                raise self.error(key, f"a list gives one limit per stage: expected {stages}, got {len(value)}")
            limits = tuple(self._size(v, f"{key}[{i}]") for i, v in enumerate(value))
        else:
            limits = (self._size(value, key),) * stages
        for i, limit in enumerate(limits):
            if limit <= 0:
                raise self.error(key, f"stage {i}'s limit must be positive")
        return limits

    def layers(self, value: object) -> tuple[Layer, ...]:
        entries = [("layers", value)] if isinstance(value, dict) else \
            [(f"layers[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else None
        if not entries:
            raise self.error("layers", f"expected an object (with `count`) or a non-empty list of objects, "
                                       f"got {_kind(value)}")
        out: list[Layer] = []
        for path, entry in entries:
            obj = self.object(entry, path, _LAYER)
            count = self.integer(obj, "count", path, minimum=1, default=1)
            out += [self.layer(obj, path)] * count
        return tuple(out)

    def layer(self, obj: dict, path: str) -> Layer:
        name = obj.get("name", "")
        if not isinstance(name, str):
            raise self.error(_join(path, "name"), f"expected a string, got {_kind(name)}")
        workspace = self.memory(obj, "workspace", path, 0.0)
        options = [Option(UNCHECKED, self.memory(obj, "activation", path), 0.0, workspace)]
        raw = obj.get("options", [])
        if not isinstance(raw, list):
            raise self.error(_join(path, "options"), f"expected a list of objects, got {_kind(raw)}")
        for i, entry in enumerate(raw):
            where = f"{_join(path, 'options')}[{i}]"
            o = self.object(entry, where, _OPTION)
            option_name = o.get("name")
            if not isinstance(option_name, str) or not option_name.strip():
                raise self.error(_join(where, "name"), "missing (a non-empty string)")
            if option_name in (x.name for x in options):
                raise self.error(_join(where, "name"), f"{option_name!r} is already an option of this layer"
                                 + (" (`none` is the layer as is)" if option_name == UNCHECKED else ""))
            options.append(Option(option_name, self.memory(o, "activation", where), self.number(o, "extra", where),
                                  self.memory(o, "workspace", where, workspace)))
        return Layer(self.number(obj, "forward", path), self.number(obj, "backward", path), tuple(options),
                     self.memory(obj, "weights", path, 0.0), self.memory(obj, "optimizer", path, 0.0), name,
                     self.memory(obj, "output", path, 0.0))

    def model(self, value: object) -> ModelSource:
        if not isinstance(value, dict):
            raise self.error("model", f"expected a JSON object, got {_kind(value)}")
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise self.error("model.name", "missing (the model to measure, such as \"gpt\")")
        tiers = value.get("tiers", [])
        if not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers):
            raise self.error("model.tiers", f"expected a list of tier names, got {_kind(tiers)}")
        device = value.get("device", "cpu")
        if not isinstance(device, str):
            raise self.error("model.device", f"expected a device name (cpu, h100, ...), got {_kind(device)}")
        optimizer = value.get("optimizer", "sgd")
        if optimizer not in OPTIMIZERS:
            raise self.error("model.optimizer", f"expected one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
        sizes = {}
        for key, size in value.items():
            if key in _MODEL:
                continue
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise self.error(f"model.{key}", f"expected a positive whole number (a size of the model), "
                                                 f"got {_kind(size)}")
            sizes[key] = size
        return ModelSource(name, sizes, tuple(tiers), device, optimizer)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    return repr(value) if not isinstance(value, str) else f"the string {value!r}"
