"""Plans: matches clustered by the op types of what they recompute, and the configs that pick them.

A plan is keyed like ONNX Runtime's memory optimizer keys its subgraphs
(`Gelu+Reshape+`) and has a PlanType: 1 recompute, 2 recompute with compromise, 3 chunk.
Configs use ONNX Runtime's plan strings, `KEY:TYPE:COUNT[,...]` (COUNT -1 for
all occurrences, N for the first N in schedule order), or a JSON list of them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError
from .plan_type import ON_BY_DEFAULT, PlanType
from .shapes import Dim, simplify
from .strategies.chunk import ChunkRegion
from .strategies.recompute import Region



@dataclass
class Plan:
    key: str
    type: PlanType
    occurrences: list[Region | ChunkRegion] = field(default_factory=list)
    requested: int = 0          # 0 off, -1 all, N first N
    applied: int = 0
    extra_seconds: float | None = None   # estimated, every occurrence applied (engine.budget)

    @property
    def frequency(self) -> int:
        return len(self.occurrences)

    @property
    def rules(self) -> list[str]:
        return sorted({r.match.rule.name for r in self.occurrences})

    def saving(self, count: int | None = None) -> Dim:
        regions = self.occurrences if count is None or count < 0 else self.occurrences[:count]
        return simplify(sum((r.net for r in regions), 0))

    def kept_fraction(self) -> float | None:
        """For a compromise: what fraction of the dropped bytes the new stash keeps."""
        saved = simplify(sum((r.saved for r in self.occurrences), 0))
        added = simplify(sum((r.added for r in self.occurrences), 0))
        if not added:
            return 0.0
        try:
            return float(added / saved)
        except TypeError:
            return None

    def config_string(self, count: int = -1) -> str:
        return f"{self.key}:{int(self.type)}:{count}"

    def shapes(self) -> list[tuple[str, int]]:
        """Distinct target shapes with how often each occurs (the seeds' PatternShape rows)."""
        counts: dict[str, int] = {}
        for r in self.occurrences:
            text = " x ".join(str(d) for d in (r.targets[0].shape or ())) or "scalar"
            counts[text] = counts.get(text, 0) + 1
        return sorted(counts.items(), key=lambda kv: -kv[1])


@dataclass(frozen=True)
class ConfigEntry:
    key: str
    type: PlanType
    count: int
    source: str


def parse_config(text: str, source: str = "config") -> list[ConfigEntry]:
    """`KEY:TYPE:COUNT,...`, a JSON list of such strings, or a path to a JSON file holding one.

    A config names at least one plan, each plan once."""
    text = text.strip()
    if not text:
        raise ConfigError(f"{source} is empty: name at least one plan, like Gelu+:1:-1 "
                          "(leave the config out to apply the default plans)")
    if not text.startswith("[") and text.endswith(".json"):
        text, source = _read_config_file(Path(text))
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ConfigError(f"{source}: a JSON config is a list of \"KEY:TYPE:COUNT\" strings")
    else:
        items = [i for i in text.split(",") if i.strip()]
    entries = [_parse_entry(item, f"{source}: entry {k + 1} {item.strip()!r}")
               for k, item in enumerate(items)]
    if not entries:
        raise ConfigError(f"{source} names no plan: name at least one, like Gelu+:1:-1 "
                          "(leave the config out to apply the default plans)")
    first: dict[tuple[str, int], int] = {}
    for k, entry in enumerate(entries):
        earlier = first.setdefault((entry.key, entry.type), k)
        if earlier != k:
            raise ConfigError(f"{entry.source}: plan {entry.key}:{entry.type} is already configured "
                              f"by entry {earlier + 1} {items[earlier].strip()!r}; name each plan once")
    return entries


def _read_config_file(path: Path) -> tuple[str, str]:
    """The text of a config file, which must be non-empty UTF-8 text."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text (a JSON list of "
                          "\"KEY:TYPE:COUNT\" strings)") from None
    if not text:
        raise ConfigError(f"config file {path} is empty; it should hold a JSON list of "
                          "\"KEY:TYPE:COUNT\" strings")
    if any(ord(c) < 32 and c not in "\t\n\r" for c in text):
        raise ConfigError(f"config file {path} is not a text file (it holds control characters)")
    return text, str(path)


def _parse_entry(item: str, where: str) -> ConfigEntry:
    parts = item.strip().rsplit(":", 2)
    if len(parts) != 3 or not parts[0].strip():
        raise ConfigError(f"{where}: expected KEY:TYPE:COUNT, like Gelu+Reshape+:1:-1")
    key, type_text, count_text = parts
    try:
        type_, count = int(type_text), int(count_text)
    except ValueError:
        raise ConfigError(f"{where}: TYPE and COUNT must be integers") from None
    if type_ not in PlanType.__members__.values():
        raise ConfigError(f"{where}: TYPE {type_} is not one of "
                          + ", ".join(f"{t.value} ({t.label})" for t in PlanType))
    if count < -1 or count == 0:
        raise ConfigError(f"{where}: COUNT must be -1 (all) or a positive number")
    return ConfigEntry(key.strip(), PlanType(type_), count, where)


def select(plans: list[Plan], config: list[ConfigEntry] | None, lenient: bool = False) -> None:
    """Set each plan's requested count. With no config every type-1 and type-3 plan is on.
    An entry naming no plan is an error, unless `lenient`: a backend that re-plans a graph it
    has partly rewritten (chunk regions built) skips the plans the rewrite consumed, after
    checking the config against the whole graph once."""
    if config is None:
        for p in plans:
            p.requested = -1 if p.type in ON_BY_DEFAULT else 0
        return
    by_key = {(p.key, p.type): p for p in plans}
    for entry in config:
        plan = by_key.get((entry.key, entry.type))
        if plan is None and lenient:
            continue
        if plan is None:
            same_key = [p for p in plans if p.key == entry.key]
            listing = "\n".join(f"  {p.config_string()}  (frequency {p.frequency})" for p in plans) \
                or "  (none: no rule matched this graph)"
            if same_key:
                raise ConfigError(f"{entry.source}: plan {entry.key} has type "
                                  f"{same_key[0].type}, not {entry.type}; the plans are:\n{listing}")
            raise ConfigError(f"{entry.source} names no plan; the plans are:\n{listing}")
        plan.requested = entry.count
