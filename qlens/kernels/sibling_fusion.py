"""A graph pass: the one-row quantized linears that read the same row become one op.

In a decode step q/k/v (and an MLP's gate/up) each multiply the same row. Eagerly a
:class:`~qlens.modules.siblings.SiblingGroup` shares their launch; in a compiled graph
:func:`fuse_sibling_linears` rewrites their ``qlens::linear`` nodes (dynamo's graph, before
inductor) into one ``qlens::sibling_linear`` whose output columns the old nodes' users read.
The stacked GEMV streams the two or three weights in one launch, which fills the GPU
better on the small ones (k and v).

Nodes are fused when they read the same row (the same node, or nodes computed alike from the
same inputs), that row is one row of a float dtype with no gradient (known from the trace), their
payloads share a format and input width, all or none has a bias, and no node from the first
row read to the last linear may write to a tensor in place.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from qlens.kernels.dispatch import ACTIVATION_DTYPES
from qlens.kernels.ops import stacked_width
from qlens.quant.payload_spec import joined_keys, spec_from_key

_LINEAR = torch.ops.qlens.linear
_LINEARS = frozenset({_LINEAR, _LINEAR.default})  # the targets of a fusable node
_SIBLINGS = torch.ops.qlens.sibling_linear.default  # what they fuse into
# Functions that write into a tensor without the in-place "_" suffix.
_WRITES = frozenset({operator.setitem})
_SAME_VALUE_DEPTH = 8  # how far up two row nodes are compared


def fuse_sibling_linears(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s sibling one-row ``qlens::linear`` nodes into ``qlens::sibling_linear``
    nodes, in place; the number of nodes replaced."""
    graph = gm.graph
    by_row: list[tuple[fx.Node, list[fx.Node]]] = []  # a row node and the linears reading it
    for node in graph.nodes:
        if _is_one_row_linear(node):
            row = node.args[0]
            assert isinstance(row, fx.Node)
            same = next((nodes for r, nodes in by_row if _same_value(r, row)), None)
            if same is None:
                by_row.append((row, [node]))
            else:
                same.append(node)
    replaced = 0
    for _, nodes in by_row:
        for group in _groups(nodes):
            order = {node: i for i, node in enumerate(graph.nodes)}  # fusing moves nodes
            if _fusable(group, order):
                _fuse(graph, group, order)
                replaced += len(group)
    if replaced:
        graph.lint()
        gm.recompile()
    return replaced


def _is_one_row_linear(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _LINEARS or node.kwargs:
        return False
    if len(node.args) != 4 or not isinstance(node.args[0], fx.Node):
        return False
    row = _traced(node.args[0])
    return (
        isinstance(row, torch.Tensor)
        and row.dim() >= 1
        and all(isinstance(size, int) for size in row.shape)
        and row.numel() == row.shape[-1]
        and row.dtype in ACTIVATION_DTYPES
        and not row.requires_grad
    )


def _traced(node: fx.Node) -> object:
    return node.meta.get("example_value", node.meta.get("val"))


def _same_value(a: object, b: object, depth: int = _SAME_VALUE_DEPTH) -> bool:
    """Whether ``a`` and ``b`` are one node, or computed by the same pure calls on the same
    nodes and constants (up to ``depth`` calls up)."""
    if a is b:
        return True
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        if depth == 0 or a.op not in ("call_function", "call_method") or _may_write(a):
            return False
        return (
            a.op == b.op
            and a.target == b.target
            and _same_value(a.args, b.args, depth - 1)
            and _same_value(a.kwargs, b.kwargs, depth - 1)
        )
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_value(x, y, depth) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k], depth) for k in a)
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return False
    return type(a) is type(b) and a == b


def _groups(nodes: Sequence[fx.Node]) -> list[list[fx.Node]]:
    """Runs of up to ``MAX_SIBLINGS`` nodes (in graph order) with the same format, input width
    and bias presence."""
    from qlens.kernels.sibling_gemv import MAX_SIBLINGS  # Triton: the launch's limit

    groups: dict[tuple[Any, ...], list[list[fx.Node]]] = {}
    for node in nodes:
        spec = spec_from_key(node.args[2])  # type: ignore[arg-type]
        key = (spec.format, spec.shape[-1], node.args[3] is None)
        runs = groups.setdefault(key, [[]])
        if len(runs[-1]) == MAX_SIBLINGS:
            runs.append([])
        runs[-1].append(node)
    return [run for runs in groups.values() for run in runs if len(run) > 1]


def _weights(node: fx.Node) -> list[fx.Node]:
    """The nodes of a linear's payload tensors and bias."""
    tensors, bias = node.args[1], node.args[3]
    return [*tensors, *([bias] if isinstance(bias, fx.Node) else [])]  # type: ignore[misc]


def _fusable(group: Sequence[fx.Node], order: dict[fx.Node, int]) -> bool:
    """Whether the later linears' weights exist where the first linear stands (attributes may
    move up) and nothing from the first row read to the last linear writes in place."""
    first, last = order[group[0]], order[group[-1]]
    for node in group[1:]:
        for source in _weights(node):
            if order[source] > first and source.op != "get_attr":
                return False
    # Rows computed alike are equal unless a write falls between their first own computation
    # (not shared by every row) and the last linear.
    chains = [set(_computation(node.args[0])) for node in group]  # type: ignore[arg-type]
    own = set[fx.Node]().union(*chains) - chains[0].intersection(*chains[1:])
    start = min(order[n] for n in own) if own else order[group[0].args[0]]  # type: ignore[index]
    return not any(_may_write(n) for n in order if start < order[n] < last)


def _computation(row: fx.Node, depth: int = _SAME_VALUE_DEPTH) -> list[fx.Node]:
    """``row`` and the calls that computed it, as far up as :func:`_same_value` compares."""
    nodes = [row]
    if depth and row.op in ("call_function", "call_method"):
        for source in row.all_input_nodes:
            nodes += _computation(source, depth - 1)
    return nodes


def _may_write(node: fx.Node) -> bool:
    if node.op in ("placeholder", "get_attr", "output"):
        return False
    if node.target in _WRITES:
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(getattr(target, name)._schema.is_mutable for name in target.overloads())
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    in_place = name.endswith("_") and not (name.startswith("__") and name != "__setitem__")
    return node.op == "call_module" or in_place


def _fuse(graph: fx.Graph, group: Sequence[fx.Node], order: dict[fx.Node, int]) -> None:
    first = group[0]
    for node in group[1:]:  # attributes read later move up to the fused node
        for source in _weights(node):
            if order[source] > order[first]:
                first.prepend(source)
    tensors = [t for node in group for t in node.args[1]]  # type: ignore[union-attr]
    specs = joined_keys([node.args[2] for node in group])  # type: ignore[misc]
    biases = [node.args[3] for node in group]
    with graph.inserting_before(first):
        fused = graph.call_function(_SIBLINGS, (first.args[0], tensors, specs, biases))
        fused.meta = dict(first.meta)
        start = 0
        columns: list[fx.Node] = []
        for node in group:
            width = spec_from_key(node.args[2]).shape[0]  # type: ignore[arg-type]
            columns.append(graph.call_function(torch.narrow, (fused, -1, start, width)))
            start += width
    rows = [node.args[0] for node in group[1:]]
    for node, column in zip(group, columns, strict=True):
        column.meta = dict(node.meta)
        node.replace_all_uses_with(column)
        graph.erase_node(node)
    for row in rows:  # a later linear's own computation of the row, now unread
        _erase_unread(graph, row)
    _widen_traced(fused)


def _erase_unread(graph: fx.Graph, node: object) -> None:
    """Erase ``node`` if nothing reads it and it is a pure call, then its inputs likewise."""
    if (
        not isinstance(node, fx.Node)
        or node.users
        or node.op not in ("call_function", "call_method")
    ):
        return
    if _may_write(node):
        return
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for source in inputs:
        _erase_unread(graph, source)


def _widen_traced(fused: fx.Node) -> None:
    """The fused node's trace value is the first node's (narrower): widen it to all columns."""
    width = stacked_width(fused.args[2])  # type: ignore[arg-type]
    for key in ("example_value", "val"):
        value = fused.meta.get(key)
        if isinstance(value, torch.Tensor):
            fused.meta[key] = value.new_empty((*value.shape[:-1], width))


@dataclass(frozen=True)
class FusingBackend:
    """A ``torch.compile`` backend: :func:`fuse_sibling_linears` on each graph dynamo captures,
    then ``backend`` (``"inductor"`` with the options of ``mode`` and ``options``, as
    ``torch.compile(mode=..., options=...)`` sets them, or any backend name dynamo knows).
    ``torch.compile(model, backend=FusingBackend(), mode="reduce-overhead")`` hands its mode
    and options over (so does transformers' ``CompileConfig(backend=...)``)."""

    backend: str = "inductor"
    mode: str | None = None

    @property
    def __name__(self) -> str:  # what dynamo calls the backend
        return f"qlens_fusing_{self.backend}"

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: list[torch.Tensor],
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Any:
        fuse_sibling_linears(gm)
        mode = mode or self.mode
        if self.backend != "inductor":
            if mode is not None or options:
                raise ValueError(f"mode and options are inductor's; the backend is {self.backend}")
            return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches = {**list_mode_options(mode or "default"), **(options or {})}
        return compile_fx(gm, example_inputs, config_patches=patches)

    def reset(self) -> None:
        """What ``torch._dynamo.reset()`` calls: forget the recorded CUDA graphs."""
        if self.backend == "inductor":
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()


def fusing_backend(backend: str = "inductor", mode: str | None = None) -> FusingBackend:
    """The ``torch.compile`` backend that runs the one-row quantized linears reading the same
    row (q/k/v, gate/up) as one launch, then compiles with ``backend`` (see
    :class:`FusingBackend`)."""
    return FusingBackend(backend, mode)
