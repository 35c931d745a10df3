"""The `qlens` command line."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

DEFAULT_PROMPT = "The capital of France is"
# A 4-bit and an 8-bit scheme: together about 10-40 s of quantization on 2 CPU cores.
DEFAULT_SCHEMES = ("mxfp4", "fp8-block")
NO_QUANT = "none"


def build_parser() -> argparse.ArgumentParser:
    from qlens.quant.quantize import SCHEMES

    parser = argparse.ArgumentParser(
        prog="qlens",
        description="Mechanistic interpretability for Hugging Face causal LMs, quantized or not.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = commands.add_parser(
        "report",
        help="compare a model with its quantized copies: weights, predictions, drift, heads",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Load MODEL, quantize copies of it with each --quant scheme, run PROMPT through every\n"
            "version and print:\n"
            "  - a quantization audit: every weight, readable or not, its format, bits per weight\n"
            "    and bytes, with totals and the compression ratio against the float dtype;\n"
            "  - the top next-token predictions of each version;\n"
            "  - per-layer drift of each quantized copy from the reference on the prompt\n"
            "    (residual cosine and relative error, logit-lens KL; output KL, top-1 agreement);\n"
            "  - the induction and previous-token heads of each version, found on a repeated\n"
            "    random-token sequence;\n"
            "  - what one cached run captured, and the residual-stream norm per layer.\n"
            "A model loaded already quantized is reported with its own quantization (there is no\n"
            "float reference to drift from). Progress goes to stderr; exit status 2 on bad input."
        ),
        epilog="quantization schemes (default settings; qlens.quantize() takes more options):\n"
        + "\n".join(f"  {name:<10} {_default_settings(about)}" for name, about in SCHEMES.items()),
    )
    report.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="model directory or Hugging Face hub id (read from the local cache); "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    report.add_argument(
        "--quant",
        nargs="+",
        type=_scheme,
        metavar="SCHEME",
        help=f"quantization schemes to compare with the float model ({', '.join(SCHEMES)}), "
        f"or '{NO_QUANT}' for none (default: {' '.join(DEFAULT_SCHEMES)} for a float model, "
        "none for a model that is already quantized); give MODEL before --quant",
    )
    report.add_argument(
        "--prompt", default=DEFAULT_PROMPT, help=f"text to run (default: {DEFAULT_PROMPT!r})"
    )
    report.add_argument(
        "--top-k",
        type=_positive_int,
        default=10,
        metavar="N",
        help="predictions to show per version (default: 10)",
    )
    report.add_argument(
        "--device", metavar="D", help="device for the model, e.g. cpu or cuda:0 (default: cpu)"
    )
    report.add_argument(
        "--out",
        metavar="DIR",
        help="also write DIR/report.html (self-contained, plots inline), DIR/report.json and "
        "the plots as DIR/*.png (DIR is created if needed)",
    )
    report.add_argument(
        "--no-progress", action="store_true", help="do not show progress bars on stderr"
    )
    report.set_defaults(handler=run_report)
    return parser


def run_report(args: argparse.Namespace) -> int:
    from qlens.loading import load
    from qlens.models import DEFAULT_MODEL_NAME
    from qlens.report import build_report
    from qlens.report.variants import is_quantized

    schemes = args.quant
    if schemes is not None and NO_QUANT in schemes and len(schemes) > 1:
        return _fail(f"--quant {NO_QUANT} cannot be combined with schemes ({' '.join(schemes)})")
    if args.out:
        problem = _unwritable_reason(Path(args.out))
        if problem:
            return _fail(f"cannot write to --out {args.out}: {problem}")
    if args.device:
        problem = _device_problem(args.device)
        if problem:
            return _fail(problem)
    try:
        bridge = load(args.model, device=args.device)
    except (OSError, ValueError, TypeError, ImportError) as error:
        return _fail(f"cannot load model: {error}")
    if bridge.tokenizer is None:
        return _fail(
            f"{args.model} has no tokenizer, so --prompt cannot be tokenized; "
            "save the tokenizer into the model directory (tokenizer.save_pretrained(directory))."
        )
    if schemes is None:
        schemes = [] if is_quantized(bridge) else list(DEFAULT_SCHEMES)
    elif schemes == [NO_QUANT]:
        schemes = []
    label = args.model or f"{DEFAULT_MODEL_NAME}, the embedded default"
    try:
        report = build_report(
            bridge,
            args.prompt,
            schemes=schemes,
            top_k=args.top_k,
            model_label=label,
            progress=not args.no_progress,
        )
    except ValueError as error:
        return _fail(str(error))
    print(report.to_text(), end="")
    if args.out:
        try:
            written = report.write(args.out)
        except OSError as error:
            return _fail(f"cannot write to --out {args.out}: {error}")
        print(f"\nwrote {', '.join(str(p) for p in written[:2])} and {len(written) - 2} PNG files")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


def _fail(message: str) -> int:
    print(f"qlens report: error: {message}", file=sys.stderr)
    return 2


def _unwritable_reason(directory: Path) -> str | None:
    """Why files cannot be written into ``directory`` (created if missing), or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".qlens-write-test-"):
            pass
    except OSError as error:
        return error.strerror or str(error)
    if not os.access(directory, os.W_OK):
        return "permission denied"
    return None


def _device_problem(text: str) -> str | None:
    """Why ``--device text`` cannot be used here, or None."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as error:
        return f"invalid --device {text!r}: {error}"
    available = getattr(getattr(torch, device.type, None), "is_available", None)
    if device.type != "cpu" and callable(available) and not available():
        return (
            f"--device {text}: this torch build ({torch.__version__}) sees no {device.type} "
            "device; use --device cpu"
        )
    return None


def _default_settings(description: str) -> str:
    """A scheme's description without the options the command line does not expose."""
    return description.split(";")[0].split(", or ")[0]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _scheme(text: str) -> str:
    from qlens.quant.quantize import SCHEMES

    if text != NO_QUANT and text not in SCHEMES:
        raise argparse.ArgumentTypeError(
            f"unknown quantization scheme {text!r}; known schemes: {', '.join(SCHEMES)} "
            f"(or '{NO_QUANT}')"
        )
    return text
