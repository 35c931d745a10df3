"""Few-row packed 4-bit calls with the rows read as they are (``LinearConfig.x_as_is=True``: split
by code position in the kernel's registers, one launch a call) against the rows regrouped by a
copy before the launch (``False``; the default, ``None``, takes the first outside CUDA-graph
capture and the second while a graph captures): per 8B decode layer, and in whole 32-token
forwards. ``--toggle split_sum`` compares K splits summed in the kernel (``split_sum=True``) with
a second, reducing launch (``False``), the rows read as the default says (the default,
``None``, sums in the launch on rows as they are and reduces after the regrouped one).

Per layer and row count (the dispatcher's own launch for those rows, only the toggled field
changed): host and wall microseconds of back-to-back eager calls, the GPU time of a call in a
CUDA graph (the weight copies together larger than L2), and whether both give the same output
bit for bit. Whole models: the wall time of an eager 32-token forward of the 1B and 8B shapes,
bf16 and each scheme both ways, the field switched for every quantized linear at once.

Run on a CUDA GPU from the repository root:
``python -m benchmarks.tuning.few_rows_as_is [--toggle x_as_is|split_sum]
[--schemes int4,nvfp4,mxfp4] [--rows 2,8,16,32,64]``; prints markdown (and writes it to
``$OUT/few_rows_as_is.md`` or ``$OUT/few_rows_split_sum.md`` when ``$OUT`` is set)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from benchmarks._e2e_models import build_model, shapes
from benchmarks._timing import (
    copies_for,
    header,
    host_and_wall_us,
    median_wall_s,
    publish,
    seeded_weight,
    time_graph,
)
from benchmarks.e2e_model import for_each_quantized
from qlens.kernels import LinearConfig
from qlens.quant.payload import QuantPayload

LAYERS = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))
OPTIONS = {"int4": {"group_size": 128}, "nvfp4": {}, "mxfp4": {}}


# Each toggle's field, and the names of its off and on states.
TOGGLES = {
    "x_as_is": ("regrouped", "as is"),
    "split_sum": ("reducing launch", "summed in kernel"),
}


@contextlib.contextmanager
def switched(field: str, on: bool) -> Iterator[None]:
    """Every plan built meanwhile chooses its launches with ``field=on`` (plans keep their
    launches: build the model's plans inside, or clear them)."""
    import qlens.kernels.plan as plan

    chosen = plan._weight_config

    def with_field(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return dataclasses.replace(chosen(*args, **kwargs), **{field: on})

    plan._weight_config = with_field
    try:
        yield
    finally:
        plan._weight_config = chosen


def layer_rows(field: str, schemes: list[str], rows: list[int]) -> list[str]:
    """Markdown rows: each layer, scheme and row count, ``field`` off against on."""
    from qlens.kernels.dispatch import default_config
    from qlens.quant.quantize import quantize_weight

    device = torch.device("cuda")
    lines = []
    for n, k in LAYERS:
        for scheme in schemes:
            payload = quantize_weight(seeded_weight(n, k), scheme, **OPTIONS[scheme])
            for m in rows:
                base = default_config(payload, m, device)
                if base.path != "gemv" or not base.words:
                    continue  # not the packed GEMV's rows
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                (h0, w0, g0, out0), (h1, w1, g1, out1) = (
                    _layer_cells(payload, x, dataclasses.replace(base, **{field: on}))
                    for on in (False, True)
                )
                lines.append(
                    f"| {n} x {k} | {scheme} | {m} | {h0:.1f} | {h1:.1f} | {w0:.1f} | {w1:.1f} | "
                    f"{g0:.1f} | {g1:.1f} | {g0 / g1:.2f}x | {torch.equal(out0, out1)} |"
                )
                print(lines[-1], flush=True)
    return lines


def _layer_cells(
    payload: QuantPayload, x: torch.Tensor, cfg: LinearConfig
) -> tuple[float, float, float, torch.Tensor]:
    """Host and wall microseconds of eager calls, graph microseconds a call (copies of the
    weight together larger than L2), and the output."""
    from qlens.kernels import quantized_linear

    copies = [payload] * copies_for(payload.data.numel() * payload.data.element_size())
    host, wall = host_and_wall_us(lambda: quantized_linear(x, payload, config=cfg))
    graph = time_graph([lambda p=p: quantized_linear(x, p, config=cfg) for p in copies])
    return host, wall, graph, quantized_linear(x, payload, config=cfg)


def model_rows(field: str, schemes: list[str], sizes: list[str], tokens: int) -> list[str]:
    """Markdown rows: the eager forward of ``tokens`` tokens, bf16 and each scheme both ways."""
    return [line for size in sizes for line in _model_size(field, size, schemes, tokens)]


def _model_size(field: str, size: str, schemes: list[str], tokens: int) -> list[str]:
    device = torch.device("cuda")
    shape = shapes(False, None)[size]
    base = build_model(shape, device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.config["vocab_size"], (1, tokens), generator=gen).to(device)
    with torch.no_grad():
        bf16 = median_wall_s(lambda: base(ids), 20, 3)
    lines = [f"| {size} | bf16 | {bf16 * 1e3:.2f} | | 1.00x | |"]
    print(lines[-1], flush=True)

    def run(scheme: str, model: torch.nn.Module) -> None:
        walls = []
        for on in (False, True):
            with switched(field, on), torch.no_grad():
                for module in model.modules():  # plans choose again, with the new rule
                    if hasattr(module, "forget_prepared"):
                        module.forget_prepared()
                walls.append(median_wall_s(lambda: model(ids), 20, 3))
        lines.append(
            f"| {size} | {scheme} | {walls[0] * 1e3:.2f} | {walls[1] * 1e3:.2f} | "
            f"{walls[0] / bf16:.2f}x | {walls[1] / bf16:.2f}x |"
        )
        print(lines[-1], flush=True)

    for_each_quantized(base, schemes, run)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--toggle", choices=tuple(TOGGLES), default="x_as_is")
    parser.add_argument("--schemes", default="int4,nvfp4,mxfp4")
    parser.add_argument("--rows", default="2,8,16,32,64")
    parser.add_argument("--sizes", default="1b,8b")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    schemes, field = args.schemes.split(","), args.toggle
    off, on = TOGGLES[field]
    layers = [
        f"| layer (N x K) | scheme | rows | host us, {off} | host us, {on} | wall us, {off} | "
        f"wall us, {on} | graph us, {off} | graph us, {on} | graph speed-up, {on} | "
        "same output |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *layer_rows(field, schemes, [int(r) for r in args.rows.split(",") if r]),
    ]
    models = [
        f"| shape | model | {args.tokens}-token forward ms, {off} | {on} | vs bf16, {off} | "
        f"vs bf16, {on} |",
        "|---|---|---|---|---|---|",
        *model_rows(field, schemes, args.sizes.split(","), args.tokens),
    ]
    timing = (
        f"layers: the dispatcher's launch for the rows with only {field} changed; host and "
        "wall: median of five rounds of 500 back-to-back eager calls (host without a sync); "
        "graph: median CUDA-graph replay of weight copies together larger than L2, per call. "
        "Models: random-weight Llamas, qlens.quantize, median wall of 20 eager forwards after 3"
    )
    title = {
        "x_as_is": "Few-row packed 4-bit calls: rows read as they are",
        "split_sum": "Few-row packed 4-bit calls: K splits summed in the kernel",
    }[field]
    text = "\n".join([header(title, timing), *layers, "", *models])
    publish(text, "few_rows_as_is.md" if field == "x_as_is" else f"few_rows_{field}.md")


if __name__ == "__main__":
    main()
