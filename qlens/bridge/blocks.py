"""TransformerLens-style ``blocks[i]`` views: hook points and HF modules under TL names.

``bridge.blocks[3].attn.hook_pattern`` is the HookPoint ``blocks.3.attn.hook_pattern``;
``bridge.blocks[3].attn.W_Q`` reads that layer's query weights through ``qlens.weights``; any
other attribute of a component is looked up on the HF module it stands for
(``bridge.blocks[3].attn.q_proj``). ``bridge.blocks[3](resid_pre)`` runs that block on a
residual stream, its hooks firing; ``bridge.blocks[3].mlp(x)`` and the norms run their HF
module. The views hold no state of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxtyping import Float, Int
from torch import Tensor, nn

from qlens.hooks import HookPoint

# TL component name -> ResolvedLayer.modules key of the HF module it stands for
_COMPONENT_MODULES = {
    "attn": "attn",
    "mlp": "mlp",
    "ln1": "ln1",
    "ln2": "ln2",
    "ln1_post": "ln1_post",
    "ln2_post": "ln2_post",
}
_ATTN_WEIGHTS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")
_MLP_WEIGHTS = ("W_in", "W_gate", "W_out", "b_in", "b_out")


class ComponentView:
    """One component of one block: its hook points, weights and HF module under TL names."""

    def __init__(
        self,
        name: str,
        points: dict[str, HookPoint],
        module: nn.Module | None,
        weights: dict[str, Callable[[], Any]],
    ) -> None:
        self.name = name
        self.module = module
        self._points = points
        self._weights = weights

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if attr in self._points:
            return self._points[attr]
        if attr in self._weights:
            return self._weights[attr]()
        if self.module is not None and hasattr(self.module, attr):
            return getattr(self.module, attr)
        raise AttributeError(
            f"{self.name} has no hook point, weight or module attribute {attr!r}; hook points "
            f"here: {', '.join(sorted(self._points)) or 'none'}"
        )

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._points, *self._weights})

    def __repr__(self) -> str:
        module = type(self.module).__name__ if self.module is not None else "no module"
        return f"ComponentView({self.name!r}, {module}, {len(self._points)} hook points)"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the HF module (an MLP or a norm) on its input, as TransformerLens runs its
        component. Its hook points fire only inside a forward of the bridge, so a component
        with active hooks is refused, and so is attention, whose HF module needs the
        position embeddings and mask of a forward: run the block instead."""
        block = self.name.rsplit(".", 1)[0]
        if self.name.endswith(".attn") or self.module is None:
            raise TypeError(
                f"{self.name} cannot run on its own: "
                + ("its HF module needs the forward's position embeddings and mask; "
                   if self.module is not None else "it has no HF module; ")
                + f"run the whole block, bridge.{block.replace('.', '[', 1)}](resid_pre)"
            )  # fmt: skip
        active = sorted(name for name, point in self._points.items() if point.is_active)
        if active:
            raise RuntimeError(
                f"{self.name}'s hooks ({', '.join(active)}) fire only in a forward of the "
                f"bridge, not when the module runs alone: remove them, or run the block, "
                f"bridge.{block.replace('.', '[', 1)}](resid_pre)"
            )
        return self.module(*args, **kwargs)


class BlockView(ComponentView):
    """``blocks[i]``: the block's own hook points and its ``attn``/``mlp``/``ln*`` components."""

    def __init__(
        self,
        index: int,
        points: dict[str, HookPoint],
        module: nn.Module,
        components: dict[str, ComponentView],
        run: Callable[..., Tensor],
    ) -> None:
        super().__init__(f"blocks.{index}", points, module, {})
        self.index = index
        self._components = components
        self._run = run

    def __call__(  # type: ignore[override]
        self,
        resid_pre: Float[Tensor, "batch pos d_model"],
        attention_mask: Int[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """The block on the residual stream before it, ``resid_pre``: its ``resid_post``, as
        TransformerLens' ``model.blocks[i](resid)`` gives it (positions from 0, or from
        ``attention_mask``, which marks padding). The block's hooks fire; active hooks of other
        blocks are refused (``Bridge.run_block``)."""
        return self._run(self.index, resid_pre, attention_mask)

    def __getattr__(self, attr: str) -> Any:
        if not attr.startswith("_") and attr in self._components:
            return self._components[attr]
        return super().__getattr__(attr)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._components})


def _weight_reader(bridge: Any, accessor: Callable[..., Any], layer: int) -> Callable[[], Any]:
    return lambda: accessor(bridge, layer)


def build_blocks(bridge: Any) -> tuple[BlockView, ...]:
    """One view per layer, built from ``bridge.hook_names`` and the resolved layer modules."""
    from qlens.weights import accessors

    blocks = []
    for rl in bridge._layers:
        prefix = f"blocks.{rl.index}."
        by_component: dict[str, dict[str, HookPoint]] = {"": {}}
        for name in bridge.hook_names:
            if not name.startswith(prefix):
                continue
            *component, short = name[len(prefix) :].split(".")
            by_component.setdefault(".".join(component), {})[short] = bridge.hook_dict[name]
        components = {}
        for tl_name, key in _COMPONENT_MODULES.items():
            module = rl.modules.get(key)
            if module is None and tl_name not in by_component:
                continue
            names = _ATTN_WEIGHTS if tl_name == "attn" else _MLP_WEIGHTS if tl_name == "mlp" else ()
            weights = {w: _weight_reader(bridge, getattr(accessors, w), rl.index) for w in names}
            components[tl_name] = ComponentView(
                prefix + tl_name, by_component.get(tl_name, {}), module, weights
            )
        blocks.append(BlockView(rl.index, by_component[""], rl.layer, components, bridge.run_block))
    return tuple(blocks)


def build_mod_dict(bridge: Any, blocks: Sequence[BlockView]) -> dict[str, Any]:
    """TL-named modules (``embed``, ``blocks.3.attn``, ``ln_final``...) and every hook point."""
    mods: dict[str, Any] = {"embed": bridge.embed}
    if bridge.pos_embed is not None:
        mods["pos_embed"] = bridge.pos_embed
    for block in blocks:
        mods[block.name] = block.module
        for name, component in block._components.items():
            if component.module is not None:
                mods[f"{block.name}.{name}"] = component.module
    mods["ln_final"] = bridge.ln_final
    mods["unembed"] = bridge.unembed
    mods.update(bridge.hook_dict)
    return mods
