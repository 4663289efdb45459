"""Package boundaries that the design fixes."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_engine_and_dsl_import_neither_torch_nor_onnx():
    code = ("import sys, engine, engine.apply, engine.report, dsl.loader; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'onnx', 'onnxruntime'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_every_shipped_rule_file_explains_itself():
    for path in (ROOT / "rules").rglob("*.rule"):
        first = path.read_text().lstrip().splitlines()[0]
        assert first.startswith("#"), f"{path} should open with a comment saying what it does and why"


# Kinds of file the repository holds: source, rules, docs and build files. Anything generated
# (models, inputs, profiles, plots, logs) is ignored, never tracked.
TRACKED_SUFFIXES = {".py", ".sh", ".rule", ".lark", ".md", ".toml"}
TRACKED_NAMES = {"Makefile", ".gitignore", "run"}


def test_nothing_generated_is_tracked():
    listed = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT)
    if listed.returncode != 0:
        import pytest

        pytest.skip("not a git checkout")
    files = [Path(f) for f in listed.stdout.splitlines()]
    assert files, "git ls-files listed nothing"
    odd = [str(f) for f in files if f.suffix not in TRACKED_SUFFIXES and f.name not in TRACKED_NAMES]
    assert not odd, f"generated or unexpected files are tracked: {odd}"
