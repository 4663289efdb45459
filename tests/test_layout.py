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
