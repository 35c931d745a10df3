"""The parts of a TransformerLens ``HookedTransformer`` a Bridge answers to beyond hooks.

* Module behaviour, forwarded to the wrapped HF model (``parameters``, ``state_dict``, ``to``,
  ``eval``...): the bridge is not itself an ``nn.Module``, so its state dict is the model's
  own (same keys) and ``isinstance(x, nn.Module)`` still tells a model from a bridge.
* ``blocks`` / ``mod_dict`` under TL names (``qlens.bridge.blocks``).
* Weight properties (``W_Q``, ``OV``...) read through ``qlens.weights`` — packed weights are
  refused outside ``bridge.dequantized()``. Grouped K/V come per stored kv head, as
  TransformerLens 4 gives them; ``QK``/``OV`` repeat them per query head. Biases a model lacks
  read as zeros.
* Token helpers (``to_single_token``, ``get_token_position``, ``tokens_to_residual_directions``)
  and ``accumulated_bias``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from qlens.bridge.blocks import BlockView, build_blocks, build_mod_dict
from qlens.bridge.token_api import TokenAPI
from qlens.bridge.tokens import tokenizer_prepends_bos
from qlens.weights import accessors, circuits
from qlens.weights.factored import FactoredMatrix


class HeadLabels(list[str]):
    """The heads' labels: a list, as TransformerLens 4's ``all_head_labels`` property gives,
    that also answers a call, as ``HookedTransformer.all_head_labels()`` did."""

    def __call__(self) -> list[str]:
        return list(self)


class ModelAPI(TokenAPI):
    """Mixin for :class:`qlens.bridge.Bridge`; needs ``model``, ``cfg``, ``hook_dict``..."""

    model: nn.Module
    tokenizer: Any
    cfg: Any
    hook_names: list[str]
    hook_dict: dict[str, Any]
    embed: nn.Module
    pos_embed: nn.Module | None
    ln_final: nn.Module
    unembed: nn.Module
    _layers: list[Any]
    _set_switch_from_cfg: Callable[[str, bool], None]

    def _setup_model_api(self) -> None:
        """Attach the live device/dtype and tokenizer facts to ``cfg``; build ``blocks``."""
        prepends = None if self.tokenizer is None else tokenizer_prepends_bos(self.tokenizer)
        devices = {p.device for p in self.model.parameters() if p.device.type != "meta"}
        self.cfg = dataclasses.replace(
            self.cfg,
            tokenizer_prepends_bos=prepends,
            n_devices=max(len(devices), 1),
            model_placement=self._placement,
            switch_setter=self._set_switch_from_cfg,
            original_architecture=self.cfg.original_architecture or type(self.model).__name__,
        )
        self.blocks: tuple[BlockView, ...] = build_blocks(self)
        self.mod_dict: dict[str, Any] = build_mod_dict(self, self.blocks)

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        dtype = getattr(self.model, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        return self._input_device(), dtype

    # -- module behaviour, forwarded to the wrapped model -------------------------------------
    @property
    def device(self) -> torch.device:
        """Where token ids go: the embedding's (execution) device."""
        return self._input_device()

    @property
    def training(self) -> bool:
        return self.model.training

    @property
    def original_model(self) -> nn.Module:
        """The wrapped HF model (TransformerLens' name for it)."""
        return self.model

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.model.parameters(recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.model.named_parameters(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        return self.model.buffers(recurse)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        return self.model.named_buffers(prefix, recurse, remove_duplicate)

    def modules(self) -> Iterator[nn.Module]:
        return self.model.modules()

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
        return self.model.named_modules(prefix=prefix)

    def children(self) -> Iterator[nn.Module]:
        return self.model.children()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped model's state dict (the same keys as ``bridge.model.state_dict()``)."""
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """Move/cast the wrapped model (its own ``to``, with its checks); returns the bridge."""
        self.model.to(*args, **kwargs)
        return self

    def cuda(self, device: int | torch.device | None = None) -> Any:
        self.model.cuda(device)
        return self

    def cpu(self) -> Any:
        self.model.cpu()
        return self

    def half(self) -> Any:
        self.model.half()
        return self

    def float(self) -> Any:
        self.model.float()
        return self

    def bfloat16(self) -> Any:
        self.model.bfloat16()
        return self

    def double(self) -> Any:
        self.model.double()
        return self

    def eval(self) -> Any:
        self.model.eval()
        return self

    def train(self, mode: bool = True) -> Any:
        self.model.train(mode)
        return self

    def requires_grad_(self, requires_grad: bool = True) -> Any:
        self.model.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none)

    # -- weights ------------------------------------------------------------------------------
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return accessors.W_E(self)

    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"]:
        """Learned position embeddings; rotary models have none and raise."""
        return accessors.W_pos(self)

    @property
    def W_E_pos(self) -> Float[Tensor, "d_vocab_plus_n_ctx d_model"]:
        return torch.cat([self.W_E, self.W_pos], dim=0)

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return accessors.W_U(self)

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        return accessors.b_U(self)

    @property
    def W_Q(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        return accessors.W_Q(self)

    @property
    def W_K(self) -> Float[Tensor, "n_layers n_kv_heads d_model d_head"]:
        """Key weights per stored kv head (``n_kv_heads < n_heads`` for grouped-query models)."""
        return accessors.W_K(self)

    @property
    def W_V(self) -> Float[Tensor, "n_layers n_kv_heads d_model d_head"]:
        """Value weights per stored kv head."""
        return accessors.W_V(self)

    @property
    def W_O(self) -> Float[Tensor, "n_layers n_heads d_head d_model"]:
        return accessors.W_O(self)

    @property
    def b_Q(self) -> Float[Tensor, "n_layers n_heads d_head"]:
        return accessors.b_Q(self)

    @property
    def b_K(self) -> Float[Tensor, "n_layers n_kv_heads d_head"]:
        return accessors.b_K(self)

    @property
    def b_V(self) -> Float[Tensor, "n_layers n_kv_heads d_head"]:
        return accessors.b_V(self)

    @property
    def b_O(self) -> Float[Tensor, "n_layers d_model"]:
        return accessors.b_O(self)

    @property
    def W_in(self) -> Float[Tensor, "n_layers *experts d_model d_mlp"]:
        """MLP input (up) weights; MoE layers add an expert dimension."""
        return accessors.W_in(self)

    @property
    def W_gate(self) -> Float[Tensor, "n_layers *experts d_model d_mlp"] | None:
        """Gate weights, or None for a model without a gated MLP (as in TransformerLens)."""
        return accessors.W_gate(self) if self.cfg.gated_mlp else None

    @property
    def W_out(self) -> Float[Tensor, "n_layers *experts d_mlp d_model"]:
        return accessors.W_out(self)

    @property
    def b_in(self) -> Float[Tensor, "n_layers *experts d_mlp"]:
        return accessors.b_in(self)

    @property
    def b_out(self) -> Float[Tensor, "n_layers *experts d_model"]:
        return accessors.b_out(self)

    @property
    def QK(self) -> FactoredMatrix:
        """``W_Q @ W_K^T`` per layer and query head ``[n_layers n_heads d_model d_model]``."""
        return circuits.QK_circuit(self)

    @property
    def OV(self) -> FactoredMatrix:
        """``W_V @ W_O`` per layer and head ``[n_layers n_heads d_model d_model]``."""
        return circuits.OV_circuit(self)

    # -- tokens -------------------------------------------------------------------------------
    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token (no BOS added)."""
        tokens = self.to_tokens(string, prepend_bos=False)[0]
        if tokens.numel() != 1:
            pieces = self.to_str_tokens(tokens)
            raise ValueError(
                f"{string!r} is {tokens.numel()} tokens {pieces}, not one; pass a string that "
                "tokenizes to a single token (mind a leading space)"
            )
        return int(tokens.item())

    def to_single_str_token(self, int_token: int) -> str:
        """The string of one token id."""
        if isinstance(int_token, bool) or not isinstance(int_token, int):
            raise TypeError(f"to_single_str_token takes one token id (an int), got {int_token!r}")
        return str(self.to_str_tokens(torch.tensor([int_token]))[0])

    @property
    def all_head_labels(self) -> HeadLabels:
        """``L{layer}H{head}`` for every attention head, layer by layer."""
        heads = range(self.cfg.n_heads)
        return HeadLabels(f"L{layer}H{h}" for layer in range(self.cfg.n_layers) for h in heads)

    def get_token_position(
        self,
        single_token: str | int | Tensor,
        input: str | Int[Tensor, "*batch pos"],
        mode: str = "first",
        prepend_bos: bool | None = None,
    ) -> int:
        """Position of ``single_token`` (a one-token string or an id) in ``input`` (a string or
        one token sequence ``[pos]``/``[1 pos]``), its first or last occurrence."""
        if mode not in ("first", "last"):
            raise ValueError(f"mode must be 'first' or 'last', got {mode!r}")
        tokens = self.to_tokens(input, prepend_bos) if isinstance(input, str) else input
        if tokens.ndim == 2:
            if tokens.shape[0] != 1:
                raise ValueError(
                    f"input tokens must be one sequence [pos] or [1 pos], got {tuple(tokens.shape)}"
                )
            tokens = tokens[0]
        if isinstance(single_token, str):
            token = self.to_single_token(single_token)
        elif isinstance(single_token, Tensor):
            token = int(single_token.item())
        else:
            token = int(single_token)
        positions = (tokens == token).nonzero()[:, 0]
        if len(positions) == 0:
            raise ValueError(f"token {token} ({single_token!r}) does not occur in the input")
        return int(positions[0 if mode == "first" else -1])

    def tokens_to_residual_directions(
        self, tokens: str | int | Int[Tensor, "*shape"]
    ) -> Float[Tensor, "*shape d_model"]:
        """Unembedding directions ``W_U[:, token]`` of a token (string, id) or token tensor."""
        w_u = self.W_U
        if isinstance(tokens, Tensor) and tokens.numel() > 1:
            return w_u[:, tokens].movedim(0, -1)
        if isinstance(tokens, str):
            token = self.to_single_token(tokens)
        elif isinstance(tokens, Tensor):
            token = int(tokens.item())
        else:
            token = int(tokens)
        return w_u[:, token]

    # -- biases -------------------------------------------------------------------------------
    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[Tensor, " d_model"]:
        """Sum of the attention (and MLP) output biases the residual stream holds before
        ``layer`` (``mlp_input=True``: before layer ``layer``'s MLP, so its ``b_O`` too)."""
        n = self.cfg.n_layers
        if not 0 <= layer <= n:
            raise IndexError(f"layer must be in [0, {n}], got {layer}")
        if mlp_input and layer == n:
            raise ValueError(f"mlp_input=True needs a layer below n_layers={n}, got {layer}")
        total = accessors.b_U(self).new_zeros(self.cfg.d_model)
        for i in range(layer + int(mlp_input)):
            total = total + accessors.b_O(self, i).to(total.device)
            if include_mlp_biases and i < layer:
                if accessors.layer_module(self, i, "experts") is not None:
                    raise ValueError(
                        f"layer {i} is a mixture-of-experts layer: its output bias depends on "
                        "the routing, so there is no accumulated bias; pass "
                        "include_mlp_biases=False"
                    )
                total = total + accessors.b_out(self, i).to(total.device)
        return total
