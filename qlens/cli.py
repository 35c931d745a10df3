"""The `qlens` command line."""

from __future__ import annotations

import argparse
import sys

DEFAULT_PROMPT = "The capital of France is"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qlens",
        description="Mechanistic interpretability for Hugging Face causal LMs, quantized or not.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = commands.add_parser(
        "report",
        help="run a prompt through a model and summarise predictions and activations",
        description=(
            "Load MODEL, run PROMPT once while caching every hook point, and print the top "
            "next-token predictions, what was captured (hook points, shapes per kind, bytes) "
            "and the residual-stream norm after each layer."
        ),
    )
    report.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="model directory or Hugging Face hub id (read from the local cache); "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    report.add_argument(
        "--prompt", default=DEFAULT_PROMPT, help=f"text to run (default: {DEFAULT_PROMPT!r})"
    )
    report.add_argument(
        "--top-k",
        type=_positive_int,
        default=10,
        metavar="N",
        help="predictions to show (default: 10)",
    )
    report.add_argument(
        "--device", metavar="D", help="device for the model, e.g. cpu or cuda:0 (default: cpu)"
    )
    report.add_argument("--out", metavar="DIR", help="also write DIR/report.json")
    report.set_defaults(handler=run_report)
    return parser


def run_report(args: argparse.Namespace) -> int:
    from qlens.loading import load
    from qlens.models import DEFAULT_MODEL_NAME
    from qlens.report import build_report

    try:
        bridge = load(args.model, device=args.device)
    except (OSError, ValueError, TypeError, ImportError) as error:
        print(f"qlens report: error: cannot load model: {error}", file=sys.stderr)
        return 2
    if bridge.tokenizer is None:
        print(
            f"qlens report: error: {args.model} has no tokenizer, so --prompt cannot be tokenized; "
            "save the tokenizer into the model directory (tokenizer.save_pretrained(directory)).",
            file=sys.stderr,
        )
        return 2
    label = args.model or f"{DEFAULT_MODEL_NAME}, the embedded default"
    report = build_report(bridge, args.prompt, top_k=args.top_k, model_label=label)
    print(report.to_text(), end="")
    if args.out:
        print(f"\nwrote {report.write(args.out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
