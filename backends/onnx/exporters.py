"""The ways `remat export` and `remat export-gpt` trace a training step before torch.onnx.export
(backends.onnx.torch_export implements them; this module imports no torch, so the CLI's help
can list them). docs/exporters.md says what each emits."""

EXPORTERS = {
    "make-fx": "torch.autograd.grad traced by make_fx with the core ATen decompositions (the default)",
    "aot-joint": "AOTAutograd's joint graph (aot_export_joint_simple), ATen ops as AOTAutograd leaves them",
}


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception from the user's code or from torch's exporters as one short line: the
    innermost of a chain (`raise ... from`), which says what failed. torch.onnx's ConversionError
    says only which of its steps did, and where to read more; its cause names the op."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = f"{type(root).__name__}: {' '.join(str(root).split())}"
    if root is not exc:
        text = f"{type(exc).__name__} from {text}"
    return text if len(text) <= limit else text[:limit] + " ..."
