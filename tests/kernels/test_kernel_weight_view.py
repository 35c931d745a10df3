"""The kernels' launch view of a payload is checked once and kept while the payload is unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_cases import quantized

from qlens.kernels.weights import kernel_weight


def test_view_is_kept_until_a_tensor_or_the_layout_changes():
    payload = quantized(32, 256, ("int4", {"group_size": 64}))
    view = kernel_weight(payload)
    assert kernel_weight(payload) is view
    payload.scales = payload.scales.clone()  # another tensor object: checked again
    again = kernel_weight(payload)
    assert again is not view and again.scales is payload.scales
    payload.data.zero_()  # in place: the same tensor, the view still reads it
    assert kernel_weight(payload) is again and bool((again.data == 0).all())
    payload.layout["scale_swizzle"] = "32_4_4"
    with pytest.raises(ValueError, match="scale_swizzle '32_4_4' is not supported"):
        kernel_weight(payload)


def test_copies_get_views_of_their_own_tensors():
    payload = quantized(32, 256, ("fp8-block", {}))
    view = kernel_weight(payload)
    clone = copy.deepcopy(payload)
    assert kernel_weight(clone).data is clone.data and kernel_weight(clone) is not view
    shallow = copy.copy(payload)
    shallow.data = payload.data.clone()
    assert kernel_weight(shallow).data is shallow.data
    assert kernel_weight(payload) is view


def test_bad_payloads_are_checked_on_every_call():
    payload = quantized(32, 256, ("int4", {"group_size": 64}))
    payload.scales = payload.scales[:, :1]
    for _ in range(2):
        with pytest.raises(ValueError, match="scales must have shape"):
            kernel_weight(payload)


def test_a_view_that_copied_is_rebuilt_so_in_place_edits_reach_it():
    payload = quantized(32, 256, ("int4", {"group_size": 64}))
    payload.scales = payload.scales.t().contiguous().t()  # same values, column-major
    view = kernel_weight(payload)
    assert view.scales.is_contiguous() and kernel_weight(payload) is not view
    payload.scales.mul_(2)  # in place, on the payload's own (non-contiguous) tensor
    assert torch.equal(kernel_weight(payload).scales, payload.scales)


def test_a_refused_payload_is_not_rechecked_until_it_changes(monkeypatch):
    import qlens.kernels.weights as weights

    payload = quantized(32, 256, ("int4", {"group_size": 64}))
    payload.layout["packing"] = "gptq"
    first = weights.unsupported_reason(payload)
    assert first is not None and "packing is 'gptq'" in first
    monkeypatch.setattr(weights, "_checked_view", None)  # a re-check would fail
    assert weights.unsupported_reason(payload) == first
    payload.layout["packing"] = "qlens"
    monkeypatch.undo()
    assert weights.unsupported_reason(payload) is None
