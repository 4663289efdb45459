"""A progress line on long steps when stdout is a terminal, nothing otherwise."""
import io
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import onnx

from backends.progress import ERASE, progress
from training_graphs import Layer, build_mlp

ROOT = Path(__file__).resolve().parent.parent


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_line_shows_the_step_and_its_time_then_goes():
    out = Terminal()
    with progress("measuring m.onnx", out):
        time.sleep(0.7)
    text = out.getvalue()
    assert text.startswith(f"{ERASE}remat: measuring m.onnx... 0 s") and "m.onnx... 1 s" in text
    assert text.endswith(ERASE)


def test_nothing_when_stdout_is_not_a_terminal():
    out = io.StringIO()
    with progress("measuring m.onnx", out):
        pass
    assert out.getvalue() == ""


def test_the_command_line_shows_it_on_a_terminal_only(tmp_path):
    model, _ = build_mlp(8, [Layer(16, "Gelu")], dims=(4,), examples={})
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    command = [sys.executable, "-m", "backends.cli", "analyze", str(path)]
    piped = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert piped.returncode == 0 and "remat: planning" not in piped.stdout and "\r" not in piped.stdout
    leader, follower = pty.openpty()
    proc = subprocess.Popen(command, stdout=follower, stderr=subprocess.PIPE, cwd=ROOT)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(leader)
    shown = b"".join(chunks).decode()
    assert proc.returncode == 0
    assert f"remat: planning {path}... 0 s" in shown and shown.index(ERASE) < shown.index("Stashed activations")
