"""Diagnostics in the form compilers use: `file:line:col: error: message`, the line, a caret."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import RuleError, SourceLocation


@dataclass
class Diagnostic:
    message: str
    loc: SourceLocation
    hint: str = ""

    def render(self, sources: dict[str, str] | None = None) -> str:
        text = f"{self.loc}: error: {self.message}"
        source = (sources or {}).get(self.loc.file)
        if source is not None:
            lines = source.splitlines()
            if 1 <= self.loc.line <= len(lines):
                line = lines[self.loc.line - 1].expandtabs(1)
                text += f"\n    {line}\n    {' ' * (self.loc.column - 1)}^"
        if self.hint:
            text += f"\n    note: {self.hint}"
        return text


class RuleCompileError(RuleError):
    """One or more diagnostics; `str()` renders them all with their source lines."""

    def __init__(self, diagnostics: list[Diagnostic], sources: dict[str, str] | None = None):
        self.diagnostics = diagnostics
        self.sources = sources or {}
        first = diagnostics[0]
        super().__init__(first.message, first.loc)
        self.args = ("\n".join(d.render(self.sources) for d in diagnostics),)

    def __str__(self) -> str:
        return self.args[0]


def did_you_mean(name: str, candidates: list[str] | set[str] | frozenset[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(candidates), n=3, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in candidates}
        if name.lower() in lowered:
            close = [lowered[name.lower()]]
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
