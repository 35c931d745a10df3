"""TransformerLens' switches for opt-in hooks: ``set_use_split_qkv_input``, ``set_use_attn_in``,
``set_use_hook_mlp_in`` and ``set_use_attn_result``.

A switch lets its hooks be used and makes ``run_with_cache(names_filter=None)`` cache them.
The forward is the same either way: the opt-in values are computed only while hooked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SWITCHED_SUFFIXES: dict[str, tuple[str, ...]] = {
    "use_split_qkv_input": ("attn.hook_q_input", "attn.hook_k_input", "attn.hook_v_input"),
    "use_attn_in": ("hook_attn_in",),
    "use_hook_mlp_in": ("hook_mlp_in",),
    "use_attn_result": ("attn.hook_result",),
}


# switches that cannot both be on, as in TransformerLens
EXCLUSIVE_SWITCHES = {"use_attn_in": "use_split_qkv_input", "use_split_qkv_input": "use_attn_in"}


class HookSwitches:
    """The switches of one bridge; every one starts off, as in TransformerLens."""

    hook_names: list[str]
    cfg: Any
    _switch_state: dict[str, bool]  # set by the bridge: every switch off

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Allow ``attn.hook_q_input``/``hook_k_input``/``hook_v_input`` ``[batch pos head
        d_model]``: per-head copies of the residual, normalized and projected per head."""
        self._set("use_split_qkv_input", use_split_qkv_input)

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Allow ``blocks.{i}.hook_attn_in`` ``[batch pos head d_model]``: one per-head copy
        of the residual feeding q, k and v."""
        self._set("use_attn_in", use_attn_in)

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Allow ``blocks.{i}.hook_mlp_in`` ``[batch pos d_model]``: the MLP norm's input."""
        self._set("use_hook_mlp_in", use_hook_mlp_in)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Cache ``attn.hook_result`` with ``names_filter=None`` (it can be asked for by name
        either way)."""
        self._set("use_attn_result", use_attn_result)

    def _set(self, key: str, value: Any) -> None:
        other = EXCLUSIVE_SWITCHES.get(key)
        if not isinstance(value, bool):
            raise TypeError(f"set_{key} takes True or False, got {value!r}")
        switches = self._switch_state
        if value and other is not None and switches[other]:
            raise ValueError(
                f"{key} and {other} cannot both be on (as in TransformerLens); "
                f"call set_{other}(False) first"
            )
        names = [n for n in self.hook_names if n.endswith(SWITCHED_SUFFIXES[key])]
        if value and not names:
            raise ValueError(
                f"this model has no {', '.join(SWITCHED_SUFFIXES[key])} hooks (its adapter "
                "names no q/k/v or fused qkv projection), so set_" + key + " cannot take effect"
            )
        switches[key] = value
        # TransformerLens code reads the switch from the config, as `model.cfg.use_attn_result`
        self.cfg.record_switch(key, value)

    def _set_switch_from_cfg(self, key: str, value: Any) -> None:
        """``bridge.cfg.<key> = value``: the same as ``bridge.set_<key>(value)``."""
        self._set(key, value)

    def _switched_on_names(self) -> list[str]:
        """The opt-in names whose switch is on, for ``names_filter=None``."""
        suffixes = tuple(
            s for key, on in self._switch_state.items() if on for s in SWITCHED_SUFFIXES[key]
        )
        return [n for n in self.hook_names if suffixes and n.endswith(suffixes)]

    def _switched_off(self, name: str) -> bool:
        """Whether ``name`` needs a switch that is off (``attn.hook_result`` needs none)."""
        return any(
            name.endswith(suffixes) and not self._switch_state[key]
            for key, suffixes in SWITCHED_SUFFIXES.items()
            if key != "use_attn_result"
        )

    def _check_switches(self, active: Iterable[str]) -> None:
        """Hooks on a switched name need its switch on, as in TransformerLens."""
        for name in sorted(active):
            if self._switched_off(name):
                key = next(
                    k for k, suffixes in SWITCHED_SUFFIXES.items() if name.endswith(suffixes)
                )
                raise ValueError(
                    f"hook {name!r} fires only with bridge.set_{key}(True) (as in "
                    "TransformerLens); turn it on first"
                )
