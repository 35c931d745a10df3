"""Adopting GPTQ / AWQ QuantLinear modules built by hand from the documented layouts; the expected
weight is computed element by element from the integer codes (independent of qlens' unpackers)."""

import pytest
import torch
from torch import nn

from qlens.quant.adopt import adopt_module, is_quantized_module
from qlens.quant.codecs.registry import dequantizer_for

N, K, GROUP = 16, 64, 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8j + AWQ_ORDER[i]


def _to_int32(words):
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _codes(seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=gen)  # [K, N] like the kernels' view
    z = torch.randint(1, 16, (K // GROUP, N), generator=gen)
    s = (torch.rand(K // GROUP, N, generator=gen) * 0.01 + 0.001).to(torch.float16)
    return q, z, s


class QuantLinear(nn.Module):
    def __init__(self, qweight, qzeros, scales, **attrs):
        super().__init__()
        self.in_features, self.out_features, self.bits, self.group_size = K, N, 4, GROUP
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        for name, value in attrs.items():
            setattr(self, name, value)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_v1(act_order):
    q, z, s = _codes(0)
    g_idx = torch.arange(K) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(1))]
    qweight = [[0] * N for _ in range(K // 8)]
    for k in range(K):
        for n in range(N):
            qweight[k // 8][n] |= int(q[k, n]) << (4 * (k % 8))
    qzeros = [[0] * (N // 8) for _ in range(K // GROUP)]
    for g in range(K // GROUP):
        for n in range(N):
            qzeros[g][n // 8] |= (int(z[g, n]) - 1) << (4 * (n % 8))  # v1 stores zero - 1
    module = QuantLinear(
        torch.stack([_to_int32(r) for r in qweight]),
        torch.stack([_to_int32(r) for r in qzeros]),
        s,
        g_idx=g_idx.to(torch.int32),
    )
    assert is_quantized_module(module)
    payload = adopt_module(module)
    assert payload.layout["packing"] == "gptq"
    expected = torch.empty(N, K)
    for k in range(K):
        g = int(g_idx[k])
        expected[:, k] = (q[k] - z[g]).float() * s[g].float()
    assert torch.equal(dequantizer_for("int4")(payload, torch.float32), expected)


def test_awq_gemm():
    q, z, s = _codes(2)

    def pack_columns(values):  # [rows, N] -> int32 [rows, N/8]
        rows = []
        for row in values.tolist():
            words = []
            for j in range(N // 8):
                word = 0
                for i, col in enumerate(AWQ_ORDER):
                    word |= row[8 * j + col] << (4 * i)
                words.append(word)
            rows.append(_to_int32(words))
        return torch.stack(rows)

    module = QuantLinear(pack_columns(q), pack_columns(z), s)
    payload = adopt_module(module)
    assert payload.layout["packing"] == "awq"
    groups = torch.arange(K) // GROUP
    expected = ((q - z[groups]).float() * s[groups].float()).T  # no +1 on AWQ zeros
    assert torch.equal(dequantizer_for("int4")(payload, torch.float32), expected)
