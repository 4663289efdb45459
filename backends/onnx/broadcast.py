"""A MatMul operand broadcast by an Expand, read unbroadcast (at import).

torch's `matmul` of a 3-D input by a weight folds the input into a matrix where its strides allow,
and else broadcasts the weight over the batch and runs `bmm`: `expand(W.t(), [b, k, n])`,
`view`, `bmm`. A transposed input does not fold: nn.MultiheadAttention with batch_first=True
(its in- and out-projections), an MLP-Mixer's token mixing (`linear(x.transpose(1, 2))`). In
torch the expanded weight is a view (stride 0), free; written to ONNX it is an `Expand`, which
ONNX Runtime materializes: b copies of the weight, and the backward keeps them for the input's
gradient. On a 2-layer nn.MultiheadAttention model at seq 448 that is 336 MiB a layer, 672 of
the step's 691 MiB (the weight is 0.75 MiB).

ONNX's MatMul broadcasts its operands' batch dims itself, so where every reader of the Expand
is a MatMul (through Reshapes that keep the shape and Transposes that keep the batch dims in
place) whose other operand has the batch dims the Expand made, those readers read the weight
itself: the same products, without the copies.
"""
from __future__ import annotations

from engine.ir import Graph, Node, Value

from .canonical import drop_unread, same_activation_type


def read_matmul_broadcasts(graph: Graph) -> int:
    """Rewrite, in place, every Expand that only broadcasts a MatMul operand over batch dims (see
    the module docstring) so that the MatMuls read its input; the Expand and what only it read
    are dropped. Returns how many Expands went."""
    kept = {id(v) for v in graph.outputs}
    gone: list[Node] = []
    for node in graph.nodes:
        if not _only_broadcasts_matmul_operands(node, kept):
            continue
        source, out = node.inputs[0], node.outputs[0]
        gone.append(node)
        gone += _reroot(out, source, len(out.shape) - len(source.shape))
    if gone:
        drop_unread(graph, gone, kept)
    return sum(n.op == "Expand" for n in gone)


def _only_broadcasts_matmul_operands(node: Node, kept: set[int]) -> bool:
    """`node` is an Expand that only broadcasts batch dims, and every path from it ends in a MatMul
    that broadcasts them anyway (through shape-keeping Reshapes and batch-keeping Transposes)."""
    if node.op != "Expand" or len(node.inputs) != 2 or node.inputs[0] is None:
        return False
    source, out = node.inputs[0], node.outputs[0]
    if not same_activation_type(source, out):
        return False
    if source.shape is None or out.shape is None or len(out.shape) < 3 or len(source.shape) < 2:
        return False
    rank, lead = len(out.shape), len(out.shape) - len(source.shape)
    if lead < 0 or tuple(source.shape[-2:]) != tuple(out.shape[-2:]):
        return False    # the matrix itself is broadcast, or grows: not a batch broadcast
    batch = out.shape[:rank - 2]
    if not any(d != 1 for d in batch) or any(d not in (1, b) for d, b in zip(source.shape[:-2], batch[lead:])):
        return False
    stack = [out]
    while stack:
        v = stack.pop()
        if id(v) in kept or not v.users:
            return False
        for user in v.users:
            if user.op == "Reshape" and user.inputs[0] is v and _same_shape(user.outputs[0], v):
                stack.append(user.outputs[0])
            elif user.op == "Transpose" and _keeps_batch(user.attrs.get("perm"), rank):
                stack.append(user.outputs[0])
            elif user.op == "MatMul" and _batch_given(user, v, batch):
                pass
            else:
                return False
    return True


def _same_shape(a: Value, b: Value) -> bool:
    return a.shape is not None and b.shape is not None and tuple(a.shape) == tuple(b.shape)


def _keeps_batch(perm, rank: int) -> bool:
    return perm is not None and len(perm) == rank and all(perm[i] == i for i in range(rank - 2))


def _batch_given(matmul: Node, v: Value, batch: tuple) -> bool:
    """The MatMul's other operand has the batch dims `batch` (aligned from the right), so that the
    product's shape does not depend on `v`'s being broadcast."""
    if len(matmul.inputs) != 2 or (matmul.inputs[0] is v) == (matmul.inputs[1] is v):
        return False
    other = matmul.inputs[1] if matmul.inputs[0] is v else matmul.inputs[0]
    if other is None or other.shape is None or len(other.shape) < len(batch) + 2:
        return False
    return tuple(other.shape[len(other.shape) - 2 - len(batch):-2]) == tuple(batch)


def _reroot(out: Value, source: Value, lead: int) -> list[Node]:
    """The readers of `out` read `source`, which lacks `out`'s `lead` leading (batch) dims:
    Reshapes read through (returned, to be dropped), each Transpose's permutation given the
    source's rank, and the same for what they make."""
    through: list[Node] = []
    for user in list(out.users):
        if user.op == "Reshape":
            through.append(user)
            through += _reroot(user.outputs[0], source, lead)
            continue
        if source is not out:
            user.replace_input(out, source)
            source.users.append(user)
        if user.op == "Transpose":
            user.attrs["perm"] = [p - lead for p in list(user.attrs["perm"])[lead:]]
            made = user.outputs[0]
            made.shape = tuple(source.shape[p] for p in user.attrs["perm"])
            through += _reroot(made, made, lead)
    if source is not out:
        out.users = []
    return through
