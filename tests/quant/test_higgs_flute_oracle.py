"""FLUTE packing against FLUTE's own packers (flute-kernel 0.4.2, ``flute.utils._pack_2bit``,
``_pack_3bit`` and ``_pack_4bit``, plain torch). Installed as a package, flute is imported by
transformers and needs CUDA, so ``scripts/setup.sh`` unpacks only its two pure modules into
``<venv>/oracles/flute``; they are loaded here under a stand-in package providing the names
``utils`` imports from it (the CUDA GEMM, never called)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from qlens.quant.codecs.higgs import pack_flute, unpack_flute

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
