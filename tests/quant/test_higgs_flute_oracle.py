"""FLUTE packing against FLUTE's own packers (flute-kernel 0.4.2, ``flute.utils._pack_2bit``,
``_pack_3bit`` and ``_pack_4bit``, plain torch). Installed as a package, flute is imported by
transformers and needs CUDA, so ``scripts/setup.sh`` unpacks only its two pure modules into
``<venv>/oracles/flute``; they are loaded here under a stand-in package providing the names
``utils`` imports from it (the CUDA GEMM, never called)."""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from qlens.quant.codecs.higgs import (
    dequantize_higgs,
    higgs_format,
    pack_flute,
    split_vector_codes,
    tables2_from_grid,
    unpack_flute,
)
from qlens.quant.payload import QuantPayload

ORACLE_DIR = Path(sys.prefix) / "oracles" / "flute"
ORACLE_PACKAGE = "_flute_pure_torch"


@pytest.fixture(scope="module")
def flute_utils():
    if not (ORACLE_DIR / "utils.py").is_file():
        pytest.skip(f"FLUTE's packers are not unpacked in {ORACLE_DIR} (run scripts/setup.sh)")
    package = types.ModuleType(ORACLE_PACKAGE)
    package.__path__ = [str(ORACLE_DIR)]
    package.qgemm = None  # the CUDA GEMM `utils` imports; the packers do not use it
    package.TEMPLATE_CONFIGS = {}
    sys.modules[ORACLE_PACKAGE] = package
    try:
        for name in ("packbits_utils", "utils"):
            spec = importlib.util.spec_from_file_location(
                f"{ORACLE_PACKAGE}.{name}", ORACLE_DIR / f"{name}.py"
            )
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            setattr(package, name, module)
            spec.loader.exec_module(module)
        yield package.utils
    finally:
        for name in [n for n in sys.modules if n.startswith(ORACLE_PACKAGE)]:
            del sys.modules[name]


@pytest.mark.parametrize(
    "bits,tile_p,k,n",
    [
        (4, 32, 6, 128), (4, 64, 4, 512), (4, 32, 10, 384), (2, 32, 6, 256), (2, 64, 4, 1024),
        (3, 32, 2, 512), (3, 32, 6, 1536),
    ],
)  # fmt: skip
def test_pack_flute_equals_flutes_packer(flute_utils, bits, tile_p, k, n):
    gen = torch.Generator().manual_seed(bits * tile_p + n)
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen)
    packer = {2: flute_utils._pack_2bit, 3: flute_utils._pack_3bit, 4: flute_utils._pack_4bit}[bits]
    expected = packer(codes.to(torch.uint8), tile_P=tile_p)
    got = pack_flute(codes, bits, tile_p)
    assert got.dtype == expected.dtype == torch.int16
    assert torch.equal(got, expected)
    assert torch.equal(unpack_flute(expected, n, bits, tile_p), codes)


@pytest.fixture(scope="module")
def flute_reference_decoder():
    """``vector_dequantize_higgs`` from FLUTE's own test module (plain torch): the reference its
    test asserts the CUDA decoder equals bit for bit (``qgemm`` of the identity, in fp16/bf16).
    Only that function is compiled: the module's imports need CUDA."""
    path = ORACLE_DIR / "reference_higgs.py"
    if not path.is_file():
        pytest.skip(f"FLUTE's reference decoder is not unpacked in {ORACLE_DIR} (run setup.sh)")
    tree = ast.parse(path.read_text())
    (function,) = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "vector_dequantize_higgs"
    ]
    namespace: dict[str, object] = {"torch": torch}
    exec(compile(ast.Module([function], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace["vector_dequantize_higgs"]


@pytest.mark.parametrize(
    "bits,p,tile_p,n,dtype",
    [
        (4, 2, 32, 128, torch.bfloat16), (4, 2, 64, 256, torch.float16),
        (3, 2, 32, 512, torch.bfloat16), (2, 2, 64, 1024, torch.float16),
        (4, 1, 64, 256, torch.float16), (2, 1, 32, 256, torch.bfloat16),
    ],
)  # fmt: skip
def test_dequantize_equals_flutes_reference_decoder(flute_reference_decoder, bits, p, tile_p, n,
                                                    dtype):  # fmt: skip
    """HIGGS vector codes and scales, packed for FLUTE, decode to FLUTE's reference values
    rotated by torchao's CPU Hadamard transform (``matmul_hadU_slow``, its stand-in on the CPU
    for ``fast_hadamard_transform``, which transformers' HIGGS quantizer uses), bit for bit."""
    from torchao.prototype.spinquant.hadamard_utils import matmul_hadU_slow

    k, group, hadamard_size = 256, 64, 128
    gen = torch.Generator().manual_seed(bits * 100 + p * 10 + n)
    codes = torch.randint(0, 1 << (bits * p), (n, k // p), generator=gen, dtype=torch.uint8)
    scales = torch.randn(n, k // group, generator=gen).to(dtype)
    grid = torch.randn(1 << (bits * p), p, generator=gen).to(dtype)
    # FLUTE's decoder on float32 copies: its products of two 16-bit floats are exact, and in
    # the 16-bit dtype (what its CUDA kernel returns) they are those products rounded.
    values = flute_reference_decoder(codes.int(), scales.float(), grid.float())
    assert torch.equal(flute_reference_decoder(codes.int(), scales, grid), values.to(dtype))
    payload = QuantPayload(
        higgs_format(bits, group, dtype),
        pack_flute(split_vector_codes(codes, bits, p), bits, tile_p),
        (n, k),
        scales=scales,
        layout={"packing": "flute", "tile_p": tile_p, "hadamard_size": hadamard_size},
        extras={"tables2": tables2_from_grid(grid, bits)},
    )
    expected = matmul_hadU_slow(values.reshape(-1, hadamard_size), 1, 1).reshape(n, k)
    assert torch.equal(dequantize_higgs(payload, torch.float32), expected)
