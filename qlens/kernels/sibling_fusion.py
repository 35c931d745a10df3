"""A graph pass: the one-row quantized linears that read the same row become one op.

In a decode step q/k/v (and an MLP's gate/up) each multiply the same row. Eagerly a
:class:`~qlens.modules.siblings.SiblingGroup` shares their launch; in a compiled graph
:func:`fuse_sibling_linears` rewrites their ``qlens::linear`` nodes (dynamo's graph, before
inductor) into one ``qlens::sibling_linear`` whose output columns the old nodes' users read.
On the H200 the stacked GEMV streams the three or two weights in one launch instead of three
or two, which fills the GPU better on small weights (k/v).

Nodes are fused when they read the same row node, that row is one row of a float dtype with no
gradient (known from the trace), their payloads share a format and input width, all or none
has a bias, and no node between the first and the last of them may write to a tensor in place.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from qlens.kernels.dispatch import ACTIVATION_DTYPES
from qlens.quant.payload_spec import spec_from_key

_LINEAR = torch.ops.qlens.linear
_LINEAR_TARGETS = frozenset({_LINEAR, _LINEAR.default})
# Functions that write into a tensor without the in-place "_" suffix.
_WRITES = frozenset({operator.setitem})


def fuse_sibling_linears(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s sibling one-row ``qlens::linear`` nodes into ``qlens::sibling_linear``
    nodes (in place); the number of nodes replaced."""
    graph = gm.graph
    by_row: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if _is_one_row_linear(node):
            by_row.setdefault(node.args[0], []).append(node)  # type: ignore[arg-type]
    replaced = 0
    for nodes in by_row.values():
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
    if node.op != "call_function" or node.target not in _LINEAR_TARGETS or node.kwargs:
        return False
    if len(node.args) != 4 or not isinstance(node.args[0], fx.Node):
        return False
    row = node.args[0].meta.get("example_value", node.args[0].meta.get("val"))
    return (
        isinstance(row, torch.Tensor)
        and row.dim() >= 1
        and all(isinstance(size, int) for size in row.shape)
        and row.numel() == row.shape[-1]
        and row.dtype in ACTIVATION_DTYPES
        and not row.requires_grad
    )


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


def _fusable(group: Sequence[fx.Node], order: dict[fx.Node, int]) -> bool:
    """Whether the group's inputs exist where its first node stands (attributes may move up)
    and nothing between its first and last node writes in place."""
    first, last = order[group[0]], order[group[-1]]
    for node in group[1:]:
        for source in node.all_input_nodes:
            if order[source] > first and source.op != "get_attr":
                return False
    between = [n for n in order if first < order[n] < last]
    return not any(_may_write(n) for n in between)


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
        for source in node.all_input_nodes:
            if order[source] > order[first]:
                first.prepend(source)
    row = first.args[0]
    tensors = [t for node in group for t in node.args[1]]  # type: ignore[union-attr]
    specs = "\n".join(node.args[2] for node in group)  # type: ignore[misc]
    biases = [node.args[3] for node in group]
    with graph.inserting_before(first):
        fused = graph.call_function(
            torch.ops.qlens.sibling_linear.default, (row, tensors, specs, biases)
        )
        fused.meta = dict(first.meta)
        start = 0
        columns: list[fx.Node] = []
        for node in group:
            width = spec_from_key(node.args[2]).shape[0]  # type: ignore[arg-type]
            columns.append(graph.call_function(torch.narrow, (fused, -1, start, width)))
            start += width
    for node, column in zip(group, columns, strict=True):
        column.meta = dict(node.meta)
        node.replace_all_uses_with(column)
        graph.erase_node(node)
    _drop_stale_example(fused)


def _drop_stale_example(fused: fx.Node) -> None:
    """The fused node's trace value is the first node's (narrower): recompute it."""
    for key in ("example_value", "val"):
        value = fused.meta.get(key)
        if isinstance(value, torch.Tensor):
            specs = fused.args[2].split("\n")  # type: ignore[union-attr]
            width = sum(spec_from_key(s).shape[0] for s in specs)
            fused.meta[key] = value.new_empty((*value.shape[:-1], width))


def fusing_backend(backend: str = "inductor", mode: str | None = None) -> Callable[..., Any]:
    """A ``torch.compile`` backend: :func:`fuse_sibling_linears` on each graph dynamo captures,
    then ``backend`` (``"inductor"`` with the options of ``mode``, as
    ``torch.compile(mode=...)`` sets them, or any backend name dynamo knows)."""

    def compile_graph(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        fuse_sibling_linears(gm)
        if backend == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(
                gm, example_inputs, config_patches=list_mode_options(mode or "default")
            )
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    compile_graph.__name__ = f"qlens_fusing_{backend}"
    return compile_graph
