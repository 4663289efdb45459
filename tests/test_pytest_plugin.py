"""`pytest --remat-rules FILE` on rule files outside the repository, no test code: a correct
activation rule passes on both backends; a rule file that declares a cumulative sum pointwise
fails, naming the shrunk graph and the plan that broke it."""
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

SILU = """# SiLU written by hand, x * sigmoid(x): keep x, recompute the product in backward.
use std.ops

rule recompute_silu priority 25 {
  match {
    y = Mul{x, Sigmoid(x)}
    require saved(y) and bytes(y) >= 64 KiB
  }
  rewrite {
    recompute y
  }
}
"""

# A false op fact: each element of a cumulative sum reads every element before it along its
# axis, so slices along that axis are not independent; this file says they are.
RUNNING_TOTAL = """# Wrong on purpose: a cumulative sum declared pointwise, and sliced along its axis.
use std.ops

chunkable pointwise CumSum

rule chunk_running_total {
  match {
    y = CumSum(x, axis)
    require bytes(y) >= 1 MiB
  }
  rewrite {
    chunk over x along -1 into 4
  }
}
"""


def test_user_rule_files_are_property_tested_with_no_test_code(tmp_path):
    assert any(e.value == "engine.testing.plugin" for e in entry_points(group="pytest11")), \
        "the pytest11 entry point is missing: reinstall remat (make .venv/.installed)"
    (tmp_path / "silu.rule").write_text(SILU)
    (tmp_path / "running_total.rule").write_text(RUNNING_TOTAL)
    env = dict(os.environ, CI="1")
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "--remat-rules", "silu.rule", "running_total.rule",
                          "-p", "no:cacheprovider", "-rA", "-q"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout
    assert run.returncode == 1, out[-3000:] + run.stderr[-2000:]
    assert "PASSED silu.rule::recompute_silu[onnx]" in out and "PASSED silu.rule::recompute_silu[fx]" in out, out
    assert "FAILED running_total.rule::chunk_running_total[onnx]" in out, out
    # the failure names the shrunk graph and the plan
    assert "the rules changed the numbers on onnx" in out
    # (at the forward's cumsum or its gradient's: either is a region of the wrong rule)
    assert re.search(r"the plan that broke it: CumSum\+:3:-1 \(rule chunk_running_total at n_d?cumsum", out), out
    assert "= CumSum(%x" in out and "Failing test case" in out
    # the fx backend's graph has aten::cumsum, which the rule does not name: skipped, and said so
    assert "chunk_running_total never fired on fx" in out
