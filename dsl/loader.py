"""Load rule files (and the modules they `use`) into one compiled RuleSet."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from engine.errors import SourceLocation
from engine.patterns import RuleSet

from . import ast
from .compiler import Compiler
from .errors import Diagnostic, RuleCompileError
from .parser import parse, too_deep_anywhere

SHIPPED_RULES = Path(__file__).resolve().parent.parent / "rules"


def rule_files(paths: Iterable[str | Path]) -> list[Path]:
    """Files named, and every *.rule under folders named (sorted; `std/` modules only via `use`)."""
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files.extend(f for f in sorted(path.rglob("*.rule")) if "std" not in f.relative_to(path).parts[:-1])
        else:
            files.append(path)
    return files


class _Loader:
    def __init__(self) -> None:
        self.sources: dict[str, str] = {}
        self.parsed: dict[Path, ast.RuleFile] = {}
        self.order: list[ast.RuleFile] = []
        self.diagnostics: list[Diagnostic] = []

    def load(self, path: Path, used_at: SourceLocation | None = None) -> None:
        path = path.resolve()
        if path in self.parsed:
            return
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            loc = used_at or SourceLocation(str(path), 1, 1)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.diagnostics.append(Diagnostic(f"cannot read {path}: {reason}", loc))
            return
        display = _display(path)
        self.sources[display] = text if text.endswith("\n") else text + "\n"
        try:
            file = parse(text, display)
        except RuleCompileError as err:
            self.diagnostics.extend(err.diagnostics)
            return
        self.parsed[path] = file
        for use in file.uses:
            target = self.resolve_use(use.module, path.parent)
            if target is None:
                self.diagnostics.append(Diagnostic(
                    f"cannot find module {use.module!r}", use.loc,
                    f"looked for {use.module.replace('.', '/')}.rule beside this file and in {SHIPPED_RULES}"))
            else:
                self.load(target, use.loc)
        self.order.append(file)

    @staticmethod
    def resolve_use(module: str, base: Path) -> Path | None:
        relative = Path(*module.split(".")).with_suffix(".rule")
        for folder in (base, *base.parents, SHIPPED_RULES):
            candidate = folder / relative
            if candidate.is_file():
                return candidate
        return None


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def load_rules(paths: Iterable[str | Path] | str | Path | None = None) -> RuleSet:
    """Compile the rule files at `paths` (files or folders); the shipped library when None."""
    if paths is None:
        paths = [SHIPPED_RULES]
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    loader = _Loader()
    files = rule_files(paths)
    for f in files:
        if not f.exists():
            loader.diagnostics.append(Diagnostic(f"no such rule file: {f}", SourceLocation(str(f), 1, 1)))
            continue
        loader.load(f)
    if not files and not loader.diagnostics:
        where = ", ".join(str(p) for p in paths)
        loader.diagnostics.append(Diagnostic(f"no .rule files found in {where}", SourceLocation(where, 1, 1)))
    return _compile(loader)


def compile_text(text: str, path: str = "<string>") -> RuleSet:
    """Compile one rule file given as text (its `use` lines resolve against the shipped library)."""
    loader = _Loader()
    loader.sources[path] = text if text.endswith("\n") else text + "\n"
    try:
        file = parse(text, path)
    except RuleCompileError as err:
        raise RuleCompileError(err.diagnostics, loader.sources) from None
    for use in file.uses:
        target = loader.resolve_use(use.module, Path.cwd())
        if target is None:
            loader.diagnostics.append(Diagnostic(f"cannot find module {use.module!r}", use.loc))
        else:
            loader.load(target, use.loc)
    loader.order.append(file)
    return _compile(loader)


def _compile(loader: _Loader) -> RuleSet:
    if loader.diagnostics:
        raise RuleCompileError(loader.diagnostics, loader.sources)
    compiler = Compiler()
    try:
        for file in loader.order:
            compiler.declare(file)
        for order, file in enumerate(loader.order):
            compiler.compile_costs(file, order)
            compiler.compile_replays(file, order)
            compiler.compile_rules(file)
    except RecursionError:      # the last resort: the nesting limits should make this unreachable
        where = loader.order[-1].path if loader.order else "<string>"
        raise RuleCompileError([too_deep_anywhere(where)], loader.sources) from None
    if compiler.diagnostics:
        unique = {(d.loc, d.message): d for d in compiler.diagnostics}
        diags = sorted(unique.values(), key=lambda d: (d.loc.file, d.loc.line, d.loc.column))
        raise RuleCompileError(diags, loader.sources)
    digest = hashlib.sha256()
    for name in sorted(loader.sources):
        digest.update(name.encode() + b"\0" + loader.sources[name].encode() + b"\0")
    scope = compiler.scope
    return RuleSet(compiler.rules, dict(scope.recomputable), frozenset(scope.views),
                   frozenset(scope.nondeterministic), sorted(loader.sources), digest.hexdigest(),
                   dict(scope.chunkable), frozenset(scope.linear_in_gradient),
                   frozenset(scope.additive_in_gradient), dict(compiler.costs), dict(compiler.replays))
