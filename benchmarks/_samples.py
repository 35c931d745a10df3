"""Random payloads of the library layouts (bitsandbytes 4-bit and LLM.int8, GGUF legacy
blocks, BitNet) built from raw bytes: every code, block scale and padding case, with no library
installed. The tests check the dequantize kernels on them; the benchmarks time them.
"""

from __future__ import annotations

import math

import torch

from qlens.quant.codecs.bitnet import bitnet_format, pack_ternary
from qlens.quant.codecs.bnb import BNB_INT8, bnb_4bit_format
from qlens.quant.codecs.gguf import Q4_1, Q5_1, GgmlType, gguf_format
from qlens.quant.payload import QuantPayload


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def random_bnb_4bit(shape, blocksize: int, nested: bool, seed: int = 0) -> QuantPayload:
    """Random codes, a random 16-entry map and random (optionally nested) absmax."""
    gen = seeded_generator(seed)
    numel = math.prod(shape)
    n_blocks = -(-numel // blocksize)
    data = torch.randint(0, 256, (-(-numel // 2), 1), generator=gen, dtype=torch.uint8)
    extras = {"code": torch.randn(16, generator=gen)}
    layout: dict[str, object] = {"packing": "bitsandbytes"}
    if nested:
        scales = torch.randint(0, 256, (n_blocks,), generator=gen, dtype=torch.uint8)
        extras["nested_absmax"] = torch.rand(-(-n_blocks // 256), generator=gen) * 3
        extras["nested_code"] = torch.randn(256, generator=gen).sort().values
        extras["nested_offset"] = torch.tensor(0.0371)
        layout["nested_blocksize"] = 256
    else:
        scales = torch.rand(n_blocks, generator=gen) * 2
    return QuantPayload(
        bnb_4bit_format("nf4", blocksize), data, tuple(shape), scales, layout=layout, extras=extras
    )


def random_bnb_int8(n: int, k: int, seed: int = 0) -> QuantPayload:
    """Random int8 codes in [-127, 127] and positive per-row ``SCB``."""
    gen = seeded_generator(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scb = torch.rand(n, generator=gen) * 5
    return QuantPayload(BNB_INT8, q, (n, k), scales=scb, layout={"packing": "bitsandbytes"})


def gguf_payload(data: torch.Tensor, ggml_type: GgmlType, shape, **extras) -> QuantPayload:
    """A GGUF payload of raw blocks ``data`` holding a ``shape`` weight."""
    layout = {"packing": "gguf", "ggml_type": ggml_type.type_id}
    return QuantPayload(gguf_format(ggml_type), data, tuple(shape), layout=layout, extras=extras)


def random_gguf(ggml_type: GgmlType, shape, seed: int = 0) -> QuantPayload:
    """Random blocks whose float16 ``d`` (and ``m``) are finite: normal, subnormal, signed."""
    gen = seeded_generator(seed)
    *lead, cols = shape
    n_blocks = math.prod(lead) * cols // 32
    blocks = torch.randint(0, 256, (n_blocks, ggml_type.type_size), generator=gen)
    blocks = blocks.to(torch.uint8)  # drawn as int64: the tests' payloads stay as they were
    n_halfs = 2 if ggml_type in (Q4_1, Q5_1) else 1
    halfs = (torch.randn(n_blocks, n_halfs, generator=gen) * 0.01).to(torch.float16)
    halfs[0, 0] = 3e-7  # a float16 subnormal
    blocks[:, : 2 * n_halfs] = halfs.view(torch.uint8)
    return gguf_payload(blocks.reshape(*lead, -1), ggml_type, shape)


def random_bitnet(
    shape, convention: str, scale_dtype=torch.float32, seed: int = 0, scale: float = 0.8173
) -> QuantPayload:
    """Random ternary weights packed by qlens' own packer (padding rows hold code 1)."""
    ternary = torch.randint(-1, 2, shape, generator=seeded_generator(seed))
    global_scale = torch.tensor([scale], dtype=scale_dtype)
    return QuantPayload(
        bitnet_format(convention), pack_ternary(ternary), shape, global_scale=global_scale
    )
