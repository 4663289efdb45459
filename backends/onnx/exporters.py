"""The ways `remat export` and `remat export-gpt` trace a training step before torch.onnx.export
(backends.onnx.torch_export implements them; this module imports no torch, so the CLI's help
can list them). docs/exporters.md says what each emits."""

EXPORTERS = {
    "make-fx": "torch.autograd.grad traced by make_fx with the core ATen decompositions (the default)",
    "aot-joint": "AOTAutograd's joint graph (aot_export_joint_simple), ATen ops as AOTAutograd leaves them",
}


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception from the user's code or from torch's exporters as one short line."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return text if len(text) <= limit else text[:limit] + " ..."
