"""The ways `remat export` and `remat export-gpt` trace a training step before torch.onnx.export
(backends.onnx.torch_export implements them; this module imports no torch, so the CLI's help
can list them). docs/exporters.md says what each emits."""

EXPORTERS = {
    "make-fx": "torch.autograd.grad traced by make_fx with the core ATen decompositions (the default)",
    "aot-joint": "AOTAutograd's joint graph (aot_export_joint_simple), ATen ops as AOTAutograd leaves them",
}
