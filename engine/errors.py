"""Errors the engine raises; each names where the problem is."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceLocation:
    """A place in a rule file: 1-based line and column."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


class RematError(Exception):
    """Base of every error remat reports to a user (printed without a traceback)."""


class GraphError(RematError):
    """A graph is malformed; the message names the node and shows its neighbours."""


class ConfigError(RematError):
    """A plan string or config file names nothing, or is malformed."""


class RuleError(RematError):
    """A rule cannot be compiled or applied; carries the rule's location when known."""

    def __init__(self, message: str, location: SourceLocation | None = None):
        self.message = message
        self.location = location
        super().__init__(f"{location}: error: {message}" if location else message)
