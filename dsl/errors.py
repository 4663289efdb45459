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
        source = (sources or {}).get(self.loc.file)
        return self.render_lines(source.split("\n") if source is not None else None)

    def render_lines(self, lines: list[str] | None) -> str:
        """`lines`: the file split at "\n", as the parser counts lines (not str.splitlines)."""
        text = f"{self.loc}: error: {self.message}"
        if lines is not None and 1 <= self.loc.line <= len(lines):
            line, column = _window(lines[self.loc.line - 1].rstrip("\r"), self.loc.column)
            text += f"\n    {line}\n    {' ' * (column - 1)}^"
        if self.hint:
            text += f"\n    note: {self.hint}"
        return text


_WIDTH = 100


def _window(line: str, column: int) -> tuple[str, int]:
    """The line as shown under a message (tabs as one space, so the caret lines up), cut to
    about _WIDTH characters around `column` when it is longer; and the caret's column in it."""
    if len(line) <= _WIDTH:
        return _printable(line), column
    start = max(0, min(column - 1 - _WIDTH // 2, len(line) - _WIDTH))
    shown = _printable(line[start:start + _WIDTH])
    prefix = "..." if start else ""
    suffix = "..." if start + _WIDTH < len(line) else ""
    return prefix + shown + suffix, column - start + len(prefix)


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else " " for c in text)


class RuleCompileError(RuleError):
    """One or more diagnostics; `str()` renders them all with their source lines."""

    def __init__(self, diagnostics: list[Diagnostic], sources: dict[str, str] | None = None):
        self.diagnostics = diagnostics
        self.sources = sources or {}
        first = diagnostics[0]
        super().__init__(first.message, first.loc)
        lines: dict[str, list[str]] = {}
        for d in diagnostics:      # each file split once, however many diagnostics it has
            if d.loc.file in self.sources and d.loc.file not in lines:
                lines[d.loc.file] = self.sources[d.loc.file].split("\n")
        self.args = ("\n".join(d.render_lines(lines.get(d.loc.file)) for d in diagnostics),)

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
