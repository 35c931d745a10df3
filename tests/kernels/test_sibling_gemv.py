"""One launch for sibling weights' one-row products (``qlens.kernels.sibling_gemv``), in the
Triton interpreter: each sibling's columns equal its own one-row GEMV launched with the same
tile, bit for bit, with and without biases, for every family the GEMVs read."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import SCHEMES, quantized, scheme_id

from qlens.kernels.gemv import prepare_gemv
from qlens.kernels.reference import reference_linear
from qlens.kernels.sibling_gemv import SiblingGemv, sibling_gemv
from qlens.kernels.weights import kernel_weight

CPU = torch.device("cpu")
K = 512


def siblings(case, sizes):
    payloads = [quantized(n, K, case, seed=i) for i, n in enumerate(sizes)]
    return payloads, [kernel_weight(p) for p in payloads]


@pytest.mark.parametrize("case", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("sizes", [(256, 128, 128), (256, 256)], ids=["qkv", "gate-up"])
def test_each_siblings_columns_equal_its_own_gemv(case, sizes):
    payloads, views = siblings(case, sizes)
    x = torch.randn(1, 1, K).bfloat16()
    for has_bias in (False, True):
        biases = [torch.randn(n).bfloat16() for n in sizes] if has_bias else None
        shared = sibling_gemv(views, torch.bfloat16, has_bias, CPU)
        assert isinstance(shared, SiblingGemv), shared
        outputs = shared(x, biases)
        assert [tuple(o.shape) for o in outputs] == [(1, 1, n) for n in sizes]
        for i, (w, out) in enumerate(zip(views, outputs, strict=True)):
            bias = None if biases is None else biases[i]
            own = prepare_gemv(w, 1, torch.bfloat16, has_bias, shared.config, (1, 1, w.n))
            assert torch.equal(out, own(x, bias))
            ref = reference_linear(x.float(), payloads[i], None if bias is None else bias.float())
            assert (out.float() - ref).abs().max() <= 2**-7 * ref.abs().max()  # bf16 output


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes(dtype):
    _, views = siblings(("int4", {"group_size": 128}), (128, 128, 128))
    x = torch.randn(1, K).to(dtype)
    shared = sibling_gemv(views, dtype, False, CPU)
    assert isinstance(shared, SiblingGemv), shared
    for w, out in zip(views, shared(x, None), strict=True):
        assert out.dtype == dtype
        assert torch.equal(out, prepare_gemv(w, 1, dtype, False, shared.config)(x, None))


@pytest.mark.parametrize("case", [("fp8-block", {}), ("fp8-block", {"block_size": (32, 64)})])
def test_fp8_rounded_rows_as_w8a8_reads_one_row(case):
    _, views = siblings(case, (256, 128, 128))
    x = (torch.randn(1, K) * torch.logspace(-6, 3, K)).bfloat16()
    shared = sibling_gemv(views, torch.bfloat16, False, CPU, round_x=True)
    assert isinstance(shared, SiblingGemv), shared
    for w, out in zip(views, shared(x, None), strict=True):
        own = prepare_gemv(w, 1, torch.bfloat16, False, shared.config, round_x=True)
        assert torch.equal(out, own(x, None))
    int4 = siblings(("int4", {"group_size": 128}), (128, 128))[1]
    assert "need a block FP8 weight" in sibling_gemv(int4, torch.bfloat16, False, CPU, round_x=True)


def test_outputs_are_contiguous_views_of_one_tensor():
    _, views = siblings(("fp8-block", {}), (256, 128, 128))
    outputs = sibling_gemv(views, torch.bfloat16, False, CPU)(torch.randn(1, K).bfloat16(), None)
    assert all(o.is_contiguous() for o in outputs)
    assert len({o.untyped_storage().data_ptr() for o in outputs}) == 1


def test_siblings_that_cannot_share_a_launch_say_why():
    _, (int4,) = siblings(("int4", {"group_size": 128}), (128,))
    _, (fp8,) = siblings(("fp8-block", {}), (128,))
    assert "2 to 3 weights" in sibling_gemv([int4], torch.bfloat16, False, CPU)
    assert "2 to 3 weights" in sibling_gemv([int4] * 4, torch.bfloat16, False, CPU)
    assert "is not laid out as" in sibling_gemv([int4, fp8], torch.bfloat16, False, CPU)
    other_k = kernel_weight(quantized(128, 256, ("int4", {"group_size": 128})))
    assert "is not laid out as" in sibling_gemv([int4, other_k], torch.bfloat16, False, CPU)
    _, (narrow,) = siblings(("int4", {"group_size": 128}), (48,))
    reason = sibling_gemv([int4, narrow], torch.bfloat16, False, CPU)
    assert "does not start on a 64-column tile" in reason
