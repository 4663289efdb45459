"""remat's core: the shared IR, analysis, matching and rewriting. Imports neither torch nor onnx."""
from .apply import Planning, Result, apply, plan
from .ir import Graph, Node, Value
from .matcher import explain, match
from .patterns import RuleSet

__all__ = ["Graph", "Node", "Value", "RuleSet", "Planning", "Result", "apply", "plan", "match", "explain"]
