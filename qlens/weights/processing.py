"""Weight processing: fold norms, center writing weights and the unembedding, fold value biases.

Each function returns a :class:`~qlens.weights.materialize.Processed` holding a new Bridge over a
processed deep copy of the model (``inplace=True`` modifies the given model instead) and a
summary. Logits are unchanged up to float rounding, except ``center_unembed`` which shifts every
position's logits by a constant (log-probabilities are unchanged). Quantized weights are refused
unless ``dequantize=True``; then they are materialized in float (quantized linear layers as
``nn.Linear``, quantized experts as the family's float HF experts class) and the summary (also
logged) lists them with their memory. Hook names are unchanged and still fire.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from qlens.weights import accessors
from qlens.weights.access import read_optional, read_weight
from qlens.weights.accessors import layer_module, qkv_row_indices, required_layer_module
from qlens.weights.materialize import Processed, prepare
from qlens.weights.storage import replace_tensor, write_tensor, write_weight

logger = logging.getLogger(__name__)

_LN1_READERS = ("q", "k", "v", "qkv")
_LN2_READERS = (
    "mlp_in", "mlp_gate", "mlp_up", "mlp_gate_up", "router",
    "shared_mlp_gate", "shared_mlp_up", "shared_expert_gate",
)  # fmt: skip


def process_weights(
    bridge: Any,
    *,
    fold_ln: bool = True,
    center_writing_weights: bool | None = None,
    center_unembed: bool = True,
    fold_value_biases: bool = True,
    dequantize: bool = False,
    inplace: bool = False,
) -> Processed:
    """Apply the TransformerLens processing steps to a copy of the model behind ``bridge``.

    ``center_writing_weights=None`` centers only LayerNorm models (under RMSNorm centering
    would change the outputs). Folding a LayerNorm also centers the weights reading it over
    their input (its input is centered, so outputs are unchanged), as TransformerLens does.
    ``center_unembed`` is skipped, with a warning, for models that softcap their logits. ``fold_value_biases`` is skipped for attention with sinks (GPT-OSS):
    there ``b_V`` contributes ``(1 - p_sink) * b_V @ W_O``, which no constant bias reproduces.
    """
    operation = "process the model's weights"
    result = prepare(bridge, operation, dequantize=dequantize, inplace=inplace)
    new, cfg = result.bridge, result.bridge.cfg
    if center_writing_weights is None:
        center_writing_weights = cfg.normalization_type == "LN"
    if fold_ln:
        _fold_layer_norm(new)
        result.summary.steps.append("fold_layer_norm")
    if center_writing_weights:
        _center_writing_weights(new)
        result.summary.steps.append("center_writing_weights")
    if center_unembed and cfg.final_logit_softcapping:
        logger.warning(
            "center_unembed skipped: this %s model softcaps its logits, so shifting them by a "
            "constant would change its outputs",
            cfg.family,
        )
    elif center_unembed:
        _center_unembed(new)
        result.summary.steps.append("center_unembed")
    if fold_value_biases and not cfg.attention_sinks:
        _fold_value_biases(new)
        result.summary.steps.append("fold_value_biases")
    return result


def fold_layer_norm(bridge: Any, *, dequantize: bool = False, inplace: bool = False) -> Processed:
    """Fold every pre-norm's scale (and LayerNorm bias) into the layers that read its output.

    ln1 -> q/k/v (or fused qkv), ln2 -> MLP input/gate/up (fused gate_up, MoE router, all
    experts, a shared expert and its gate), final norm -> unembedding (untied from the embedding
    first). The norms keep normalizing with an identity affine (Gemma's ``1 + w`` with
    ``w = 0``). Sandwich post-norms and q/k norms act after a projection and are left as they
    are.
    """
    result = prepare(bridge, "fold layer norms", dequantize=dequantize, inplace=inplace)
    _fold_layer_norm(result.bridge)
    result.summary.steps.append("fold_layer_norm")
    return result


def center_writing_weights(
    bridge: Any, *, dequantize: bool = False, inplace: bool = False
) -> Processed:
    """Subtract the mean over ``d_model`` from every weight and bias writing to the residual.

    Only valid before LayerNorm, which removes the mean anyway; RMSNorm models raise.
    """
    _require_layer_norm(bridge, "center writing weights")
    result = prepare(bridge, "center writing weights", dequantize=dequantize, inplace=inplace)
    _center_writing_weights(result.bridge)
    result.summary.steps.append("center_writing_weights")
    return result


def center_unembed(bridge: Any, *, dequantize: bool = False, inplace: bool = False) -> Processed:
    """Subtract the mean over the vocabulary from W_U and b_U (logits shift per position)."""
    result = prepare(bridge, "center the unembedding", dequantize=dequantize, inplace=inplace)
    _center_unembed(result.bridge)
    result.summary.steps.append("center_unembed")
    return result


def fold_value_biases(bridge: Any, *, dequantize: bool = False, inplace: bool = False) -> Processed:
    """Move ``b_V`` into ``b_O`` (``b_O += sum_h b_V[h] @ W_O[h]``): attention rows sum to 1.

    Refused for attention with sinks, whose rows sum to ``1 - p_sink`` (input-dependent).
    """
    if bridge.cfg.attention_sinks:
        raise ValueError(
            "fold_value_biases needs attention patterns whose rows sum to 1; this model's "
            "attention sinks take part of the softmax mass, so the value bias contributes "
            "(1 - p_sink) * b_V @ W_O at each position, with p_sink the sink's probability "
            "there: it depends on the input and cannot be folded into the constant output bias "
            "b_O. The other processing steps (fold_layer_norm, center_unembed) apply; "
            "process_weights skips this one on such models"
        )
    result = prepare(bridge, "fold value biases", dequantize=dequantize, inplace=inplace)
    _fold_value_biases(result.bridge)
    result.summary.steps.append("fold_value_biases")
    return result


# -- implementation -------------------------------------------------------------------------
def _require_layer_norm(bridge: Any, what: str) -> None:
    if bridge.cfg.normalization_type != "LN":
        raise ValueError(
            f"cannot {what} of a {bridge.cfg.normalization_type}Norm model: only LayerNorm "
            "subtracts the mean, so centering would change the outputs"
        )


def _norm_affine(bridge: Any, norm: nn.Module, what: str) -> tuple[Tensor, Tensor | None]:
    """The effective scale ``w`` (with Gemma's offset) and bias of a norm, then reset it."""
    op = f"fold {what}"
    weight = read_optional(norm, "weight", operation=op, owner=bridge)
    bias = read_optional(norm, "bias", operation=op, owner=bridge)
    offset = bridge.cfg.norm_weight_offset
    if weight is None:
        scale = torch.ones(bridge.cfg.d_model)
    else:
        scale = weight.detach().float().clone() + offset
        write_tensor(norm, "weight", torch.full_like(weight, 1.0 - offset))
    if bias is not None:
        bias = bias.detach().float().clone()
        write_tensor(norm, "bias", torch.zeros_like(bias))
    return scale, bias


def _fold_into_linear(bridge: Any, module: nn.Module, scale: Tensor, bias: Tensor | None) -> None:
    op = "fold a norm into the layer reading it"
    weight = read_weight(module, operation=op, owner=bridge)
    dtype = weight.dtype
    w = weight.detach().float().clone()
    folded = w * scale.to(w.device)
    if bridge.cfg.normalization_type == "LN":  # the input is centered: center what reads it
        folded = folded - folded.mean(-1, keepdim=True)
    write_weight(module, folded.to(dtype))
    if bias is not None:
        own = read_optional(module, "bias", operation=op, owner=bridge)
        extra = w @ bias.to(w.device)
        new_bias = extra if own is None else own.detach().float() + extra
        write_tensor(module, "bias", new_bias.to(dtype))


def _require_tensor(module: nn.Module, name: str, op: str, bridge: Any) -> Tensor:
    value = read_optional(module, name, operation=op, owner=bridge)
    if value is None:
        raise ValueError(f"cannot {op}: {type(module).__name__} has no {name} tensor")
    return value


def _fold_into_experts(bridge: Any, module: nn.Module, scale: Tensor, bias: Tensor | None) -> None:
    op = "fold a norm into the MoE experts"
    gate_up = _require_tensor(module, "gate_up_proj", op, bridge)
    in_dim = -2 if getattr(module, "is_transposed", bridge.adapter.experts_weights_in_out) else -1
    w = gate_up.detach().float().clone()
    shape = [1] * w.ndim
    shape[in_dim] = -1
    folded = w * scale.reshape(shape)
    if bridge.cfg.normalization_type == "LN":  # the input is centered: center what reads it
        folded = folded - folded.mean(in_dim, keepdim=True)
    write_tensor(module, "gate_up_proj", folded.to(gate_up.dtype))
    if bias is not None:
        extra = w @ bias if in_dim == -1 else bias @ w
        own = read_optional(module, "gate_up_proj_bias", operation=op, owner=bridge)
        new_bias = extra if own is None else own.detach().float() + extra
        write_tensor(module, "gate_up_proj_bias", new_bias.to(gate_up.dtype))


def _fold_layer_norm(bridge: Any) -> None:
    for layer in range(bridge.cfg.n_layers):
        for norm_field, readers in (("ln1", _LN1_READERS), ("ln2", _LN2_READERS + ("experts",))):
            norm = required_layer_module(bridge, layer, norm_field)
            scale, bias = _norm_affine(bridge, norm, f"layer {layer} {norm_field}")
            for field in readers:
                module = layer_module(bridge, layer, field)
                if module is None:
                    continue
                if field == "experts":
                    _fold_into_experts(bridge, module, scale, bias)
                else:
                    _fold_into_linear(bridge, module, scale, bias)
    _untie_unembed(bridge)
    scale, bias = _norm_affine(bridge, bridge.ln_final, "the final norm")
    _fold_into_linear(bridge, bridge.unembed, scale, bias)


def _untie_unembed(bridge: Any) -> None:
    op = "untie the unembedding from the embedding"
    unembed = read_weight(bridge.unembed, operation=op, owner=bridge)
    embed = read_weight(bridge.embed, operation=op, owner=bridge)
    if unembed.data_ptr() == embed.data_ptr():
        replace_tensor(bridge.unembed, "weight", unembed.detach().clone())
        bridge.model.config.tie_word_embeddings = False


def _center_rows(bridge: Any, module: nn.Module, op: str) -> None:
    """Center a linear layer writing to the residual: mean over its output dim (d_model)."""
    weight = read_weight(module, operation=op, owner=bridge)
    w = weight.detach().float().clone()
    write_weight(module, (w - w.mean(0, keepdim=True)).to(weight.dtype))
    bias = read_optional(module, "bias", operation=op, owner=bridge)
    if bias is not None:
        write_tensor(module, "bias", bias - bias.float().mean().to(bias.dtype))


def _center_embedding(bridge: Any, module: nn.Module, op: str) -> None:
    weight = read_weight(module, operation=op, owner=bridge)
    w = weight.detach().float().clone()
    write_weight(module, (w - w.mean(-1, keepdim=True)).to(weight.dtype))


def _center_writing_weights(bridge: Any) -> None:
    _require_layer_norm(bridge, "center writing weights")
    op = "center weights writing to the residual stream"
    _untie_unembed(bridge)
    _center_embedding(bridge, bridge.embed, op)
    if bridge.pos_embed is not None:
        _center_embedding(bridge, bridge.pos_embed, op)
    for layer in range(bridge.cfg.n_layers):
        _center_rows(bridge, required_layer_module(bridge, layer, "o"), op)
        down = layer_module(bridge, layer, "mlp_down")
        experts = layer_module(bridge, layer, "experts")
        if experts is not None:
            _center_experts(bridge, experts, op)
        elif down is not None:
            _center_rows(bridge, down, op)


def _center_experts(bridge: Any, module: nn.Module, op: str) -> None:
    down = _require_tensor(module, "down_proj", op, bridge)
    out_dim = -1 if getattr(module, "is_transposed", bridge.adapter.experts_weights_in_out) else -2
    w = down.detach().float().clone()
    write_tensor(module, "down_proj", (w - w.mean(out_dim, keepdim=True)).to(down.dtype))
    bias = read_optional(module, "down_proj_bias", operation=op, owner=bridge)
    if bias is not None:
        write_tensor(module, "down_proj_bias", bias - bias.mean(-1, keepdim=True))


def _center_unembed(bridge: Any) -> None:
    op = "center the unembedding"
    _untie_unembed(bridge)
    weight = read_weight(bridge.unembed, operation=op, owner=bridge)
    w = weight.detach().float().clone()
    write_weight(bridge.unembed, (w - w.mean(0, keepdim=True)).to(weight.dtype))
    bias = read_optional(bridge.unembed, "bias", operation=op, owner=bridge)
    if bias is not None:
        write_tensor(bridge.unembed, "bias", bias - bias.float().mean().to(bias.dtype))


def _fold_value_biases(bridge: Any) -> None:
    op = "fold value biases into the output bias"
    for layer in range(bridge.cfg.n_layers):
        b_v = accessors.b_V(bridge, layer, repeat_kv=True)
        if not bool(b_v.any()):
            continue
        w_o = accessors.W_O(bridge, layer)
        o = required_layer_module(bridge, layer, "o")
        delta = torch.einsum("hd,hdm->m", b_v.float(), w_o.float())
        own = read_optional(o, "bias", operation=op, owner=bridge)
        new_bias = delta if own is None else own.float() + delta
        write_tensor(o, "bias", new_bias.to(w_o.dtype))
        v = layer_module(bridge, layer, "v")
        if v is not None:
            bias = _require_tensor(v, "bias", op, bridge)
            write_tensor(v, "bias", torch.zeros_like(bias))
            continue
        qkv = required_layer_module(bridge, layer, "qkv")
        bias = _require_tensor(qkv, "bias", op, bridge).detach().clone()
        bias[qkv_row_indices(bridge, "v", bias.shape[0], layer)] = 0
        write_tensor(qkv, "bias", bias)
