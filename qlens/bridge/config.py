"""BridgeConfig: the architecture facts of a wrapped model, in TransformerLens vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from qlens.bridge.adapters.base import Adapter, NormType, PositionalType

_DEFAULT_ATTRS: dict[str, tuple[str, ...]] = {
    "d_model": ("hidden_size",),
    "n_heads": ("num_attention_heads",),
    "n_kv_heads": ("num_key_value_heads", "num_attention_heads"),
    "d_mlp": ("intermediate_size", "ffn_dim"),
    "d_vocab": ("vocab_size",),
    "n_ctx": ("max_position_embeddings",),
    "act_fn": ("hidden_activation", "hidden_act", "activation_function"),
    "n_experts": ("num_local_experts", "num_experts"),
    "experts_per_token": ("num_experts_per_tok",),
}


SWITCH_FIELDS = ("use_attn_result", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in")
SETTABLE_FIELDS = ("default_prepend_bos", "default_padding_side", *SWITCH_FIELDS)


@dataclass
class BridgeConfig:
    """Architecture facts; ``n_experts``/``experts_per_token`` are 0 for dense models.

    As in TransformerLens, the tokenization defaults (``default_prepend_bos``,
    ``default_padding_side``) can be set, and setting a ``use_*`` switch calls the bridge's
    ``set_use_*`` (same checks, same effect); the architecture facts are read-only.

    Also answers the names TransformerLens code reads (``n_key_value_heads``, ``d_vocab_out``,
    ``device``, ``dtype``, ``original_architecture``...); ``device`` and ``dtype`` are read from
    the wrapped model when asked, so they follow ``bridge.to(...)``.
    """

    model_type: str
    family: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int | None
    act_fn: str | None
    eps: float
    normalization_type: NormType
    norm_weight_offset: float
    positional_embedding_type: PositionalType
    rotary_dim: int | None  # dimensions of each head that rotary rotates (GPT-NeoX: a part)
    parallel_attn_mlp: bool
    gated_mlp: bool
    n_experts: int
    experts_per_token: int
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    sliding_window: int | None
    attention_sinks: bool
    tie_word_embeddings: bool
    # tokenization defaults for strings, as TransformerLens' cfg names them
    default_prepend_bos: bool = True
    default_padding_side: Literal["left", "right"] = "right"
    original_architecture: str | None = None  # the HF class, e.g. "LlamaForCausalLM"
    model_name: str | None = None  # the checkpoint's name, its hub id's or folder's last part
    tokenizer_prepends_bos: bool | None = None  # None: no tokenizer
    attn_only: bool = False
    use_attn_result: bool = False
    use_split_qkv_input: bool = False
    use_attn_in: bool = False
    use_hook_mlp_in: bool = False
    n_devices: int = 1
    # (device, dtype) of the wrapped model, read when asked
    model_placement: Callable[[], tuple[torch.device, torch.dtype]] | None = field(
        default=None, repr=False, compare=False
    )
    # the bridge's set_use_* switch, by field name (set by the bridge)
    switch_setter: Callable[[str, bool], None] | None = field(
        default=None, repr=False, compare=False
    )

    def __setattr__(self, name: str, value: Any) -> None:
        fields = self.__dataclass_fields__
        if name in fields and name not in self.__dict__:  # __init__
            object.__setattr__(self, name, value)
        elif name in SWITCH_FIELDS:
            if self.switch_setter is None:
                raise ValueError(f"this config is not attached to a bridge, so cfg.{name} is fixed")
            self.switch_setter(name, value)  # records the value through record_switch
        elif name == "default_prepend_bos":
            if not isinstance(value, bool):
                raise TypeError(f"cfg.default_prepend_bos takes True or False, got {value!r}")
            object.__setattr__(self, name, value)
        elif name == "default_padding_side":
            if value not in ("left", "right"):
                raise ValueError(f"cfg.default_padding_side takes 'left' or 'right', got {value!r}")
            object.__setattr__(self, name, value)
        elif name in fields or hasattr(type(self), name):
            raise AttributeError(
                f"cfg.{name} is a fact of the wrapped model and cannot be set; the settable "
                f"fields are {', '.join(SETTABLE_FIELDS)}"
            )
        else:
            raise AttributeError(
                f"BridgeConfig has no field {name!r}; the settable fields are "
                f"{', '.join(SETTABLE_FIELDS)}"
            )

    def record_switch(self, name: str, value: bool) -> None:
        """Record a ``use_*`` switch the bridge has checked and applied."""
        object.__setattr__(self, name, value)

    @property
    def n_key_value_heads(self) -> int:
        """TransformerLens' name for ``n_kv_heads``."""
        return self.n_kv_heads

    @property
    def d_vocab_out(self) -> int:
        """Size of the unembedding's output (the vocabulary)."""
        return self.d_vocab

    @property
    def device(self) -> str:
        """Where token ids go (the embedding's device), as TransformerLens' string."""
        return str(self._placement()[0])

    @property
    def dtype(self) -> torch.dtype:
        """The wrapped model's floating dtype (its compute dtype when quantized)."""
        return self._placement()[1]

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        if self.model_placement is None:
            raise ValueError("this config is not attached to a model, so it has no device or dtype")
        return self.model_placement()


def _lookup(config: Any, adapter: Adapter, key: str) -> Any:
    override = adapter.config_attrs.get(key)
    if callable(override):
        return override(config)
    for attr in (override,) if override is not None else _DEFAULT_ATTRS.get(key, ()):
        value = getattr(config, attr, None)
        if value is not None:
            return value
    return None


def resolve_flag(config: Any, flag: bool | str) -> bool:
    """An adapter fact given as a bool or as the name of a boolean config attribute."""
    return bool(getattr(config, flag)) if isinstance(flag, str) else flag


def _rotary_dim(hf_config: Any, adapter: Adapter, d_head: int) -> int | None:
    if adapter.positional_embedding_type != "rotary":
        return None
    rope = getattr(hf_config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return int(d_head * (factor if isinstance(factor, (int, float)) else 1.0))


def build_config(hf_config: Any, adapter: Adapter, n_layers: int, eps: float) -> BridgeConfig:
    """Read the architecture facts from the HF config, guided by the adapter; ``eps`` is the
    final norm's epsilon (read from the module, as some configs do not record it)."""
    d_model = int(_lookup(hf_config, adapter, "d_model"))
    n_heads = int(_lookup(hf_config, adapter, "n_heads"))
    head_dim = getattr(hf_config, "head_dim", None)
    is_moe = adapter.layer.router is not None
    n_ctx = _lookup(hf_config, adapter, "n_ctx")
    d_head = int(head_dim) if head_dim else d_model // n_heads
    return BridgeConfig(
        model_type=str(hf_config.model_type),
        family=adapter.family,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(_lookup(hf_config, adapter, "n_kv_heads")),
        d_head=d_head,
        d_mlp=int(_lookup(hf_config, adapter, "d_mlp")),
        d_vocab=int(_lookup(hf_config, adapter, "d_vocab")),
        n_ctx=int(n_ctx) if n_ctx is not None else None,
        act_fn=adapter.act_fn or _lookup(hf_config, adapter, "act_fn"),
        eps=eps,
        normalization_type=adapter.normalization_type,
        norm_weight_offset=adapter.norm_weight_offset,
        positional_embedding_type=adapter.positional_embedding_type,
        rotary_dim=_rotary_dim(hf_config, adapter, d_head),
        parallel_attn_mlp=resolve_flag(hf_config, adapter.parallel_attn_mlp),
        gated_mlp=adapter.gated_mlp,
        n_experts=int(_lookup(hf_config, adapter, "n_experts") or 0) if is_moe else 0,
        experts_per_token=int(_lookup(hf_config, adapter, "experts_per_token") or 0)
        if is_moe
        else 0,
        attn_logit_softcapping=getattr(hf_config, "attn_logit_softcapping", None),
        final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
        sliding_window=getattr(hf_config, "sliding_window", None),
        attention_sinks=adapter.family == "gpt_oss",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        default_prepend_bos=adapter.default_prepend_bos,
        original_architecture=(getattr(hf_config, "architectures", None) or [None])[0],
        model_name=_model_name(hf_config),
    )


def _model_name(hf_config: Any) -> str | None:
    """The checkpoint's short name, as TransformerLens' ``cfg.model_name``: the last part of
    the hub id or folder it was loaded from (``HuggingFaceTB/SmolLM2-135M`` -> ``SmolLM2-135M``),
    None for a model built from a config."""
    source = str(getattr(hf_config, "name_or_path", "") or "").rstrip("/\\")
    return source.replace("\\", "/").rsplit("/", 1)[-1] or None
