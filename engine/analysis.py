"""Forward/backward split, stashed activations, liveness and estimated peak memory."""
from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field, replace

from .errors import GraphError
from .ir import Graph, Node, Value, captured_values
from .shapes import Dim, evaluate, simplify


@dataclass
class Analysis:
    """What one training graph keeps alive between its forward and backward parts."""

    graph: Graph
    forward_outputs: list[Value]
    forward: set[int]                     # ids of forward nodes
    stashed: list[Value]                  # forward values read by backward nodes, schedule order
    position: dict[int, int] = field(repr=False, default_factory=dict)  # node id -> index
    first_backward: int = 0               # index of the first backward node
    constant: set[int] = field(repr=False, default_factory=set)  # ids of values computed from constants only

    def is_forward(self, node: Node) -> bool:
        return id(node) in self.forward

    def is_constant(self, value: Value) -> bool:
        """Computed from constants alone (shape arithmetic and the like): free to read anywhere."""
        return id(value) in self.constant

    def is_stashed(self, value: Value) -> bool:
        return id(value) in self._stashed_ids

    def __post_init__(self) -> None:
        self._stashed_ids = {id(v) for v in self.stashed}

    def stashed_bytes(self) -> Dim:
        return simplify(sum((v.nbytes or 0) for v in self.stashed))


def resolve_forward_outputs(graph: Graph, names: Sequence[str] | None) -> list[Value]:
    if not graph.outputs:
        raise GraphError("the graph has no outputs, so it has no forward part")
    if not names:
        return [graph.outputs[0]]
    by_name = {v.name: v for v in graph.values()}
    missing = [n for n in names if n not in by_name]
    if missing:
        outs = ", ".join(v.name for v in graph.outputs[:10])
        raise GraphError(f"forward output(s) {', '.join(missing)} not found in the graph; "
                         f"its outputs are: {outs}{'...' if len(graph.outputs) > 10 else ''}")
    return [by_name[n] for n in names]


def analyze(graph: Graph, forward_outputs: Sequence[str] | None = None) -> Analysis:
    """Forward = the ancestors of the forward outputs (by default the first output, the loss)."""
    fwd_outs = resolve_forward_outputs(graph, forward_outputs)
    forward: set[int] = set()
    stack = [v.producer for v in fwd_outs if v.producer is not None]
    while stack:
        node = stack.pop()
        if id(node) in forward:
            continue
        forward.add(id(node))
        stack.extend(v.producer for v in node.reads() if v.producer is not None)
    position = graph.node_index()
    stashed = []
    constant = constant_values(graph)
    outputs = {id(v) for v in graph.outputs}  # kept to the end anyway: not a cost of backward
    for node in graph.nodes:
        if id(node) not in forward:
            continue
        for out in node.outputs:
            if (id(out) not in constant and id(out) not in outputs
                    and any(id(u) not in forward for u in out.users)):
                stashed.append(out)
    backward_positions = [position[id(n)] for n in graph.nodes if id(n) not in forward]
    return Analysis(graph, fwd_outs, forward, stashed, position,
                    min(backward_positions, default=len(graph.nodes)), constant)


# Ops whose result depends on their input's shape, never its data.
SHAPE_OPS = frozenset({"Shape", "Size", "aten::sym_size", "aten::sym_numel"})


def constant_values(graph: Graph) -> set[int]:
    """Ids of values that do not depend on tensor data: Constant nodes, shapes (SHAPE_OPS), and
    what is computed from those alone. They are tiny and readable anywhere, so a recompute
    region reads them instead of recomputing them."""
    constant: set[int] = set()
    for node in graph.nodes:
        if node.subgraphs:
            continue
        if node.op in SHAPE_OPS or all(id(v) in constant for v in node.present_inputs()):
            constant.update(id(o) for o in node.outputs)
    return constant


@dataclass
class Liveness:
    birth: dict[int, int]   # value id -> node index producing it (-1: input or weight)
    death: dict[int, int]   # value id -> last node index reading it (len(nodes): graph output)


def liveness(graph: Graph) -> Liveness:
    birth: dict[int, int] = {}
    death: dict[int, int] = {}
    end = len(graph.nodes)
    for v in list(graph.inputs) + list(graph.initializers):
        birth[id(v)] = -1
    for i, node in enumerate(graph.nodes):
        for out in node.outputs:
            birth[id(out)] = i
            death.setdefault(id(out), i)
        for v in node.reads():
            death[id(v)] = i
    for v in graph.outputs:
        death[id(v)] = end
    return Liveness(birth, death)


@dataclass
class PeakEstimate:
    peak_bytes: int | None        # at the example dims; None if a dim has no example value
    peak_index: int               # step of `order` (for the schedule: the node) at which the peak is reached
    live_at_peak: list[Value]     # a value per buffer alive at the peak (views are their base's buffer)
    curve: list[int] = field(default_factory=list, repr=False)   # bytes in use during each step of `order`
    order: list[Node] = field(default_factory=list, repr=False)  # the order simulated
    arena_bytes: int | None = None   # the packed arena's size, when the model packs one (MemoryModel.arena)

    @property
    def peak_node(self) -> Node | None:
        return self.order[self.peak_index] if 0 <= self.peak_index < len(self.order) else None


@dataclass(frozen=True)
class MemoryModel:
    """How a runtime places a graph's tensors, for `simulate_peak`. The defaults are plain liveness:
    each value its own buffer from the step that makes it to the last step that reads it, graph
    outputs to the end, inputs and weights not counted (they exist before the step starts).

    A backend describes its runtime with the other fields (backends/onnx/ort_order.py has ONNX
    Runtime's): which ops return a view of their input (`alias_ops`), which write over an input
    they read last (`inplace_ops`), whether a freed buffer is handed to the next output of the
    same shape (`reuse_same_shape`, as ONNX Runtime's allocation planner does), and whether the
    buffers are packed into one arena that keeps its high-water mark (`arena`: best fit in
    allocation order, the way ONNX Runtime's memory pattern lays out a run). Buffers that live
    outside the arena (graph outputs with `outputs_in_arena=False`, values `apart` says so of)
    count while they live. `transient` adds a node's own scratch bytes during its step.
    A node with a `body` subgraph runs as an ONNX Loop: its body's peak for one iteration, the
    carried values handed from one iteration to the next, and the scan outputs of every
    iteration kept until they are stacked at the end (`loop_bytes`).
    """

    alias_ops: frozenset[str] = frozenset()
    inplace_ops: frozenset[str] = frozenset()
    reuse_same_shape: bool = False
    arena: bool = False
    alignment: int = 1
    outputs_in_arena: bool = True
    transient: Callable[[Node, Callable[[Value], int]], int] | None = None
    size_of: Callable[[Value], int | None] | None = None      # bytes where it returns a number, else nbytes
    apart: Callable[[Value], bool] | None = None              # allocated on its own, outside the arena
    known_shape: Callable[[Value], bool] | None = None        # shape known to the planner (reuse needs it)
    order_of: Callable[[Graph], Sequence[Node]] | None = None  # execution order of a subgraph
    # What a freed buffer must match to be handed to a new value, where the runtime's rule is not
    # ONNX Runtime's same-shape one (Inductor's: dtype and storage size). Giving it turns reuse on;
    # None for a value means it never takes a freed buffer.
    reuse_key: Callable[[Value], Hashable | None] | None = None
    # Hand a freed buffer over only where holding it until then keeps the walk without reuse under
    # its own peak (Inductor's wrapper, AllocateLine.should_reuse_buffer); the next step always may.
    # That walk counts no `transient` bytes: the runtime's own estimate does not see into a call's
    # body (Inductor's, memory.estimate_peak_memory, counts an invoke_subgraph by its outputs), so
    # it holds a freed buffer across a chunk's slices wherever their outputs leave room, and the
    # body's peak then comes on top of it.
    reuse_keeps_peak: bool = False
    # The program a node belongs to, where a backend plans parts of the order apart (Inductor: the
    # forward graph and the backward graph): `reuse_keeps_peak` judges by the part's own peak.
    scope: Callable[[Node], Hashable] | None = None
    # The inputs a node's output may be written over where the node reads them last (a backend's
    # in-place kernels: Inductor's); by default the first input of an op in `inplace_ops`.
    overwrites: Callable[[Node], Sequence[Value]] | None = None
    # The fused kernel a node runs in (None: its own), for `reuse_keeps_peak`: the runtime's own
    # estimate, which that judges by, steps by kernel, consecutive nodes of one kernel at once,
    # their outputs all made before any input is freed.
    kernel: Callable[[Node], Hashable | None] | None = None


class _Buffer:
    __slots__ = ("size", "apart", "first", "last_read", "uses", "values", "key", "freed")

    def __init__(self, size: int, apart: bool, first: int, value: Value, key):
        self.size, self.apart, self.first = size, apart, first
        self.last_read = -1
        self.freed = -1
        self.uses = 0
        self.values = [value]
        self.key = key


def simulate_peak(graph: Graph, order: Sequence[Node] | None = None, alias_ops: Collection[str] = (),
                  model: MemoryModel | None = None, dim_examples: dict[str, int] | None = None) -> PeakEstimate:
    """Live bytes at each step of `order` (default: the schedule, `graph.nodes`), and the peak.

    `alias_ops` adds to `model.alias_ops`: their outputs are views that keep their base alive
    (an op named in either spelling: the IR's, or the backend's `native_op`). Inputs and weights are not counted. The curve is one number per step: the buffers alive
    during the step (its outputs made, its inputs not yet freed), plus the node's transient
    bytes; with an arena, the arena's high-water mark so far stands for the buffers in it.
    """
    model = model or MemoryModel()
    examples = graph.dim_examples if dim_examples is None else {**dim_examples, **graph.dim_examples}
    order = list(graph.nodes if order is None else order)
    aliases = frozenset(alias_ops) | model.alias_ops
    steps = len(order)
    unknown = False

    def size(v: Value) -> int:
        nonlocal unknown
        if model.size_of is not None:
            given = model.size_of(v)
            if given is not None:
                return given
        if v.nbytes is None:
            return 0
        n = evaluate(v.nbytes, examples)
        if n is None:
            unknown = True
            return 0
        return int(n)

    outputs = {id(v) for v in graph.outputs}
    uses: dict[int, int] = {}
    last_read: dict[int, int] = {}
    reads_of: list[list[Value]] = []
    for i, node in enumerate(order):
        reads = list(node.present_inputs())
        captured = {id(v): v for sub in node.subgraphs.values() for v in captured_values(sub)}
        reads.extend(captured.values())
        reads_of.append(reads)
        for v in reads:
            uses[id(v)] = uses.get(id(v), 0) + 1
            last_read[id(v)] = i
        for o in _present_outputs(node):
            uses[id(o)] = uses.get(id(o), 0) + 1
    for v in graph.outputs:
        uses[id(v)] = uses.get(id(v), 0) + 1

    buffer_of: dict[int, _Buffer | None] = {}
    buffers: list[_Buffer] = []
    freelist: list[_Buffer] = []       # most recently freed first
    transient = [0] * steps
    phases: dict[int, tuple[int, int]] = {}   # step of a Loop -> (while it iterates, at its end)

    def reuse_key(v: Value) -> tuple | None:
        """What a freed buffer must match to be handed to `v`: its shape and element size, if the
        planner knows the shape (scalars are never reused)."""
        if model.reuse_key is not None:
            return model.reuse_key(v)
        known = model.known_shape(v) if model.known_shape is not None else _static(v)
        return (tuple(v.shape), v.dtype.itemsize) if known and v.shape else None

    held: list[int] | None = None        # the walk without reuse, plus what reuse holds so far
    ceiling: list[int] = []              # by step: the highest point of the walk without reuse in its scope
    if model.reuse_keeps_peak:
        steps_run, step_of = _kernel_steps(order, model.kernel)
        plain = simulate_peak(graph, steps_run, alias_ops, replace(model, reuse_key=None, reuse_same_shape=False,
                                                                 reuse_keeps_peak=False, overwrites=None,
                                                                 inplace_ops=frozenset(), kernel=None,
                                                                 transient=None),
                              dim_examples)
        held = [plain.curve[k] for k in step_of]
        scopes = [model.scope(node) if model.scope is not None else None for node in order]
        highest: dict[Hashable, int] = {}
        for scope, bytes_ in zip(scopes, held):
            highest[scope] = max(highest.get(scope, 0), bytes_)
        ceiling = [highest[scope] for scope in scopes]

    def may_reuse(free: _Buffer, i: int, nbytes: int) -> bool:
        if held is None or free.freed + 1 >= i:
            return True
        if nbytes + max(held[free.freed + 1:i]) > ceiling[i]:
            return False
        for k in range(free.freed + 1, i):
            held[k] += nbytes
        return True

    def new_buffer(v: Value, i: int, apart: bool) -> _Buffer:
        b = _Buffer(size(v), apart, i, v, reuse_key(v))
        buffers.append(b)
        return b

    def overwritten(node: Node, o: Value) -> _Buffer | None:
        """The buffer `node` writes its output `o` over: an input it reads last, of `o`'s size."""
        if model.overwrites is not None:
            candidates = model.overwrites(node)
        else:
            candidates = node.inputs[:1] if node.op in model.inplace_ops else ()
        for v in candidates:
            b = buffer_of.get(id(v)) if v is not None else None
            if b is not None and b.uses == 1 and not b.apart and _same_size(v, o, model, size):
                return b
        return None

    for i, node in enumerate(order):
        for k, o in enumerate(_present_outputs(node)):
            base = node.inputs[0] if node.inputs else None
            if id(o) in outputs and not model.outputs_in_arena:
                b = new_buffer(o, i, apart=True)
            elif (node.op in aliases or node.native_op in aliases) and base is not None:
                b = buffer_of.get(id(base))
                if b is not None:
                    b.values.append(o)
            elif k == 0 and (b := overwritten(node, o)) is not None:
                b.values.append(o)
            elif model.apart is not None and model.apart(o):
                b = new_buffer(o, i, apart=True)
            else:
                b = None
                key = reuse_key(o) if model.reuse_same_shape or model.reuse_key is not None else None
                if key is not None:
                    for j, free in enumerate(freelist):
                        if free.key == key and free.size == size(o):
                            if may_reuse(free, i, free.size):
                                b = freelist.pop(j)
                                b.values.append(o)
                            break
                if b is None:
                    b = new_buffer(o, i, apart=False)
            buffer_of[id(o)] = b
            if b is not None:
                b.uses += uses.get(id(o), 0)
        for v in reads_of[i] + list(_present_outputs(node)):
            b = buffer_of.get(id(v))
            if b is None:
                continue
            if id(v) in last_read:
                b.last_read = max(b.last_read, last_read[id(v)])
            b.uses -= 1
            if b.uses == 0:
                b.freed = i
                freelist.insert(0, b)
        transient[i] = model.transient(node, size) if model.transient is not None else 0
        if node.subgraphs:
            loop = _subgraph_bytes(node, model, examples, size)
            if loop is None:
                unknown = True
            else:
                phases[i] = loop

    end = steps - 1
    spans: list[tuple[int, int, _Buffer]] = []
    for b in buffers:
        last = end if any(id(v) in outputs for v in b.values) else max(b.last_read, b.first)
        spans.append((b.first, last, b))
    delta = [0] * (steps + 1)
    arena_delta = [0] * (steps + 1)
    for first, last, b in spans:
        delta[first] += b.size
        delta[last + 1] -= b.size
        if model.arena and not b.apart:
            arena_delta[first] += b.size
            arena_delta[last + 1] -= b.size
    hwm = _arena_high_water(spans, steps, model.alignment) if model.arena else None
    made = [0] * steps           # bytes of the buffers each step makes outside the arena
    for first, last, b in spans:
        if b.apart or hwm is None:
            made[first] += b.size
    curve, running, in_arena = [], 0, 0
    for i in range(steps):
        running += delta[i]
        in_arena += arena_delta[i]
        held = running - in_arena + hwm[i] if hwm is not None else running
        value = held + transient[i]
        if i in phases:
            # While a Loop's iterations run, its own outputs do not exist yet (nor, in an arena,
            # has anything touched their pages); they are made at its end.
            during, after = phases[i]
            before = running - in_arena + (hwm[i - 1] if i else 0) if hwm is not None else running
            value = max(before - made[i] + during, held + after) + transient[i]
        curve.append(value)
    peak_at = max(range(steps), key=curve.__getitem__) if steps else 0
    peak = curve[peak_at] if steps else 0
    at_peak = [b.values[0] for first, last, b in spans if first <= peak_at <= last and b.size]
    return PeakEstimate(None if unknown else peak, peak_at, at_peak, curve, order,
                        hwm[-1] if hwm else (0 if model.arena else None))


def _kernel_steps(order: list[Node], kernel: Callable[[Node], Hashable | None] | None
                  ) -> tuple[list[Node], list[int]]:
    """`order` with each run of consecutive nodes of one kernel as one node (all its members'
    inputs and outputs; the first member's name and meta), and, by node of `order`, its step
    there. The graph's nodes are not changed: the joined nodes are new and registered nowhere."""
    steps: list[Node] = []
    step_of: list[int] = []
    runs: list[list[Node]] = []
    last = None
    for node in order:
        key = kernel(node) if kernel is not None and not node.subgraphs else None
        if key is not None and key == last:
            runs[-1].append(node)
        else:
            runs.append([node])
        last = key
        step_of.append(len(runs) - 1)
    for run in runs:
        if len(run) == 1:
            steps.append(run[0])
            continue
        first = run[0]
        steps.append(Node(first.op, [v for m in run for v in m.inputs], [o for m in run for o in _present_outputs(m)],
                          name=first.name, meta={**first.meta, "unnamed_outputs": ()}))
    return steps, step_of


def _present_outputs(node: Node) -> list[Value]:
    unnamed = set(node.meta.get("unnamed_outputs", ()))
    return [o for k, o in enumerate(node.outputs) if k not in unnamed]


def _same_size(a: Value, b: Value, model: MemoryModel, size: Callable[[Value], int]) -> bool:
    """Whether the planner can tell `a` and `b` take the same bytes (both shapes known): at
    symbolic sizes, the same formula, not two that only agree at the example sizes."""
    known = model.known_shape or _static
    if not (known(a) and known(b) and size(a) == size(b)):
        return False
    return a.nbytes is None or b.nbytes is None or simplify(a.nbytes - b.nbytes) == 0


def _static(v: Value) -> bool:
    return v.shape is not None and all(isinstance(d, int) for d in v.shape)


def _arena_high_water(spans: list[tuple[int, int, "_Buffer"]], steps: int, alignment: int) -> list[int]:
    """High-water mark of the arena after each step, buffers placed by best fit in allocation order
    (ONNX Runtime's MemPatternPlanner: the smallest gap between placed blocks that fits, else
    after the block with the highest offset), freed after their last step."""
    allocs: dict[int, list[int]] = {}
    frees: dict[int, list[int]] = {}
    sizes = []
    for k, (first, last, b) in enumerate(spans):
        if b.apart:
            sizes.append(0)
            continue
        sizes.append(-(-b.size // alignment) * alignment if alignment > 1 else b.size)
        allocs.setdefault(first, []).append(k)
        frees.setdefault(last, []).append(k)
    blocks: list[tuple[int, int, int]] = []      # (offset, size, span index), by offset
    hwm, out = 0, []
    for i in range(steps):
        for k in allocs.get(i, ()):
            need = sizes[k]
            best, waste, current = None, None, 0
            offset = blocks[-1][0] + blocks[-1][1] if blocks else 0
            for j, (off, sz, _) in enumerate(blocks):
                if off >= current:
                    gap = off - current
                    if gap >= need and (waste is None or gap - need < waste):
                        best, waste, offset = j, gap - need, current
                current = off + sz
            if best is None:
                blocks.append((offset, need, k))
            else:
                blocks.insert(best, (offset, need, k))
            hwm = max(hwm, offset + need)
        out.append(hwm)
        gone = set(frees.get(i, ()))
        if gone:
            blocks = [blk for blk in blocks if blk[2] not in gone]
    return out


def loop_bytes(node: Node, body_peak: int, size: Callable[[Value], int]) -> tuple[int, int]:
    """What an ONNX Loop holds besides its inputs and outputs: (while its last iteration runs: the
    body's peak, the carried values the previous iteration handed over, the scan outputs of the
    iterations before; at its end: the last iteration's carried values and every iteration's scan
    outputs, not yet freed while they are copied into the Loop's outputs). The trip count is the
    first input's constant value; one computed in the graph (a dynamic model's slice count, from
    `Shape`) is what the scan outputs say, their whole over one iteration's, and more than one
    without them (a loop that runs once needs no Loop: the carried values' hand-over is counted)."""
    body = node.subgraphs["body"]
    carried_count = max(0, len(node.inputs) - 2)
    carried = sum(size(v) for v in body.outputs[1:1 + carried_count])
    scans = sum(size(v) for v in body.outputs[1 + carried_count:])
    if node.inputs and node.inputs[0] is not None and node.inputs[0].ints:
        trip = max(1, int(node.inputs[0].ints[0]))
    else:
        ratios = [size(whole) / size(piece) for whole, piece in zip(node.outputs[carried_count:],
                                                                      body.outputs[1 + carried_count:])
                  if size(piece) > 0 and size(whole) > 0]
        trip = max(2, round(max(ratios))) if ratios else 2
    during = body_peak + (carried if trip > 1 else 0) + (trip - 1) * scans
    after = carried + trip * scans
    return during, after


def _subgraph_bytes(node: Node, model: MemoryModel, examples: dict[str, int],
                    size: Callable[[Value], int]) -> tuple[int, int] | None:
    """(while the node runs its subgraphs, at its end), None if a subgraph's size is unknown.
    A Loop as `loop_bytes`; another node with subgraphs (If, Scan) as its largest subgraph."""
    peaks = {}
    for key, sub in node.subgraphs.items():
        order = model.order_of(sub) if model.order_of is not None else sub.nodes
        peaks[key] = simulate_peak(sub, order, (), model, examples).peak_bytes
    if any(p is None for p in peaks.values()):
        return None
    if "body" in node.subgraphs and node.op_type == "Loop":
        return loop_bytes(node, peaks["body"], size)
    return max(peaks.values(), default=0), 0


def estimate_peak(graph: Graph, alias_ops: Collection[str] = ()) -> PeakEstimate:
    """Peak of the activations live across the schedule (inputs and weights excluded).

    Outputs of ops in `alias_ops` (views) are counted as free: the backends keep
    them as aliases of their input. A Loop counts its body's peak for one iteration and its
    carried and scan outputs (`loop_bytes`). `simulate_peak` with the schedule as the order;
    a backend that runs the graph in another order simulates that order instead
    (backends/onnx/ort_order.py: ONNX Runtime's).
    """
    return simulate_peak(graph, graph.nodes, alias_ops)
