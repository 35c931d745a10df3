"""Token-by-token decoding through a static KV cache: each token's step (forward, choice of the
next token, bookkeeping) runs as one compiled graph, a CUDA graph on a GPU, on tensors that keep
their addresses, and the host waits for the device only every few tokens.

transformers' ``generate`` with a static cache compiles the forward too, but reads a tensor on the
host after every token (has every sequence ended?) and launches its logits processing around the
graph, so the device idles while the host prepares the next step. Here the host queues the next
step while the device still runs the last one.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from jaxtyping import Int
from torch import Tensor, nn

from qlens.bridge import ActivationCache, Bridge
from qlens.bridge.names import NamesFilter, resolve_names
from qlens.bridge.tokens import token_device
from qlens.decode_recording import DecodeRecorder
from qlens.kernels.sibling_fusion import fusing_backend
from qlens.modules.payload_guards import (
    Signature,
    payload_signature,
    without_payload_tensor_guards,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)
_MAX_EOS_IDS = 8  # end-of-sequence ids a decoder compares each new token with


@dataclass
class _DecodeState:
    """The tensors one batch shape decodes through; their addresses never change."""

    cache: Any
    mask: Tensor  # [batch, max_length] long: 0 on left padding, 1 elsewhere
    tokens: Tensor  # [batch, 1]: the token the next step reads
    positions: Tensor  # [batch, 1]: its position ids
    finished: Tensor  # [batch] bool: the row has produced an end-of-sequence token
    out: Tensor  # [batch, max_length]: the tokens produced, in order
    index: Tensor  # [1]: where the next produced token goes in ``out``
    cursor: Tensor  # [1]: the position of the next token a forward processes
    eos: Tensor  # [n] the end-of-sequence ids (-1 when there are none)
    pad: Tensor  # []: what a finished row produces


@dataclass(frozen=True)
class _Sampling:
    do_sample: bool
    temperature: float
    top_k: int | None


class StaticDecoder:
    """Greedy or sampled decoding of a Hugging Face causal LM (or a :class:`~qlens.Bridge`'s
    model, with its hooks) through a static KV cache of ``max_length`` tokens.

    With ``compile=True`` (the default) one decode step is compiled with ``torch.compile``
    (``fullgraph=True``; on a GPU with inductor, ``mode="reduce-overhead"``: CUDA graphs) the
    first time a batch size is seen, and later steps replay it; the host checks for the end of
    every sequence once every ``sync_every`` tokens. With ``compile_prefill`` (the default when
    compiling) the prompt's forward is compiled too, without CUDA graphs and with the prompt's
    length dynamic, so one graph serves prompts of every length from two tokens; a one-token
    prompt, and a batch size's first prompt (it allocates the cache), run eagerly; a prompt
    forward dynamo cannot compile logs a warning and runs eagerly from then on.
    ``compile_prefill=False`` runs every prompt eagerly and compiles one graph, not two. Hooks
    active when a step is compiled are part of its graph: patching and steering hooks fire at
    every token and over the prompt; hooks that store activations need ``compile=False`` (a
    CUDA graph reuses its outputs' memory). Each hook set, batch size and sampling setting
    compiles once; returning to one reuses its graph. ``fuse_siblings``: in the compiled step,
    the one-row quantized linears that read the same row (q/k/v, gate/up) run as one launch
    (:func:`qlens.fusing_backend`); False gives each its own.

    ``generate`` returns what ``model.generate`` returns for the same greedy call (prompt, then
    the new tokens; rows that ended carry ``pad_token_id``; cut after the step where every row
    has ended).
    """

    def __init__(
        self,
        model: nn.Module | Bridge,
        max_length: int,
        *,
        compile: bool = True,
        backend: str = "inductor",
        mode: str | None = None,
        fuse_siblings: bool = True,
        compile_prefill: bool | None = None,
    ) -> None:
        self._bridge = model if isinstance(model, Bridge) else None
        hf_model = model.model if isinstance(model, Bridge) else model
        if not getattr(hf_model, "_can_compile_fullgraph", False):
            raise ValueError(
                f"{type(hf_model).__name__} does not declare support for a static KV cache "
                "under torch.compile (transformers' _can_compile_fullgraph is False): decode "
                "it with model.generate(...) or Bridge.generate(...) instead"
            )
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
        if not compile and (
            backend != "inductor" or mode is not None or not fuse_siblings or compile_prefill
        ):
            raise ValueError(
                "backend, mode, fuse_siblings and compile_prefill choose how the step and the "
                "prompt compile: pass compile=True"
            )
        if mode is not None and backend != "inductor":
            raise ValueError(f"mode is inductor's; the backend is {backend!r}: leave mode out")
        self.model = hf_model
        self.max_length = max_length
        self._cache_keyword = _cache_keyword(hf_model)
        self._compile = compile
        self._backend = backend
        self._mode = mode
        self._fuse_siblings = fuse_siblings
        self._compile_prefill = compile if compile_prefill is None else compile_prefill
        self._sampling = _Sampling(False, 1.0, None)
        self._state: _DecodeState | None = None
        self._active_hooks = ""  # the names of the bridge hooks the next steps run with
        self._step: Callable[[], None] | None = None
        self._prefill: Callable[[_DecodeState, Tensor, Tensor], Tensor] | None = None
        self._recording = False  # generate_with_cache is running
        self._payloads: Signature | None = None  # of the payloads the compiled steps ran on
        self._recorder: DecodeRecorder | None = None

    def __repr__(self) -> str:
        if not self._compile:
            how = "eager step"
        else:
            options = [self._backend, *([self._mode] if self._mode else [])]
            options += [] if self._fuse_siblings else ["siblings unfused"]
            prompt = "compiled" if self._compile_prefill else "eager"
            how = f"compiled step ({', '.join(options)}), {prompt} prompt"
        over = "Bridge over " if self._bridge is not None else ""
        batch = "no batch yet" if self._state is None else f"batch {self._state.mask.shape[0]}"
        return (
            f"StaticDecoder({over}{type(self.model).__name__}, max_length={self.max_length}, "
            f"{how}, {batch})"
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: Int[Tensor, "batch pos"] | str | list[str],
        max_new_tokens: int,
        *,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        stop_at_eos: bool = True,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        sync_every: int = 16,
    ) -> Int[Tensor, "batch total"]:
        """The prompt ``input_ids`` (left-padded where ``attention_mask`` is 0) followed by up
        to ``max_new_tokens`` new tokens; with ``stop_at_eos`` a row ends at its first
        ``eos_token_id`` (by default the model's generation config's). A row that ended
        produces ``pad_token_id`` (by default that config's, else the first end-of-sequence id,
        else 0). ``do_sample`` draws from the softmax of the logits over ``temperature``, among the
        ``top_k`` most likely tokens when given. The host reads the device every ``sync_every``
        tokens to stop once every row has ended. Over a Bridge, ``input_ids`` may be a string or
        a list of strings, tokenized as ``bridge.to_tokens`` does and left-padded (token ids
        come back; ``bridge.to_string`` reads them)."""
        input_ids, attention_mask = self._token_ids(input_ids, attention_mask)
        _check_call(input_ids, attention_mask, max_new_tokens, self.max_length, sync_every)
        _check_sampling(do_sample, temperature, top_k)
        # The compiled step reads it: dynamo recompiles when it changes.
        self._sampling = _Sampling(do_sample, float(temperature), top_k if do_sample else None)
        eos, pad = self._special_ids(stop_at_eos, eos_token_id, pad_token_id)
        state, positions = self._prepare(input_ids, attention_mask, eos, pad)

        self._active_hooks = _active_hook_names(self._bridge)
        hooked = self._bridge.hooked_model() if self._bridge else contextlib.nullcontext()
        with hooked:
            logits = self._prompt_forward(state, input_ids.to(state.mask.device), positions)
            self._commit(state, logits, processed=input_ids.shape[1])
            produced = self._decode(state, 1, min(2, max_new_tokens), sync_every)
            with self._guards_checked_once():
                produced = self._decode(state, produced, max_new_tokens, sync_every)
            new = state.out[:, :produced].clone()
        return torch.cat([input_ids.to(new.device), _cut_after_all_ended(new, state.eos)], dim=1)

    def _decode(self, state: _DecodeState, produced: int, until: int, sync_every: int) -> int:
        """Run steps until ``until`` tokens are produced or every row has ended (read every
        ``sync_every`` tokens); returns how many are produced."""
        step = self._compiled_step()
        mark_step = torch.compiler.cudagraph_mark_step_begin
        while produced < until:
            if produced % sync_every == 0 and bool(state.finished.all()):
                break
            mark_step()
            step()
            produced += 1
        return produced

    def _guards_checked_once(self) -> contextlib.AbstractContextManager[object]:
        """After the call's first step, which checked every guard (and compiled if needed),
        the next steps skip the checks when no bridge hook is active: then nothing the graph
        depends on but tensor contents changes during a call (hooks run the user's Python,
        which may). Dynamo still tells its cached graphs apart by the guards that differ."""
        if not self._compile or self._active_hooks:
            return contextlib.nullcontext()
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)

    def _token_ids(
        self, input: Tensor | str | list[str], attention_mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Token ids and mask of ``input`` (strings through the Bridge's tokenizer)."""
        if isinstance(input, Tensor):
            return input, attention_mask
        if self._bridge is None or not isinstance(input, str | list):
            raise TypeError(
                "StaticDecoder takes token ids [batch pos]; strings need a Bridge's tokenizer: "
                f"build it over qlens.load(model) (got {type(input).__name__})"
            )
        return self._bridge._prepare(input, attention_mask, "left")

    def generate_with_cache(
        self,
        input_ids: Int[Tensor, "batch pos"] | str | list[str],
        max_new_tokens: int,
        names_filter: NamesFilter,
        **generate_kwargs: Any,
    ) -> tuple[Int[Tensor, "batch total"], ActivationCache]:
        """``generate``, recording the activations of ``names_filter`` (a name, a list or a
        predicate, as ``Bridge.run_with_cache`` takes; None: every name it selects by default)
        at every position the forwards read: the prompt and each new token but the last, which
        no forward reads. The activations are ``[batch pos ...]`` over those positions, as
        ``run_with_cache`` of the returned tokens without the last would give them
        (``hook_pattern`` and ``hook_attn_scores``: ``[batch head pos pos]``). The step
        writes them into buffers of ``max_length`` positions in its graph, so they record at
        compiled speed; a decoder keeps the buffers of its last names and batch size."""
        bridge = self._bridge
        if bridge is None:
            raise ValueError(
                "recording activations needs hook points: build the decoder over a Bridge, "
                "StaticDecoder(qlens.load(model), max_length)"
            )
        names = resolve_names(names_filter, bridge.hook_names)
        mask = generate_kwargs.pop("attention_mask", None)
        input_ids, mask = self._token_ids(input_ids, mask)
        recorder = self._recorder_for(names, input_ids.shape[0])
        # The prompt runs eagerly: its hooks allocate the recorder's buffers.
        self._recording = True
        try:
            with bridge.hooks(fwd_hooks=recorder.hooks):
                tokens = self.generate(
                    input_ids, max_new_tokens, attention_mask=mask, **generate_kwargs
                )
        finally:
            self._recording = False
        activations = recorder.activations(tokens.shape[1] - 1)
        return tokens, ActivationCache(activations, bridge.cfg.n_layers, bridge=bridge)

    def _recorder_for(self, names: list[str], batch: int) -> DecodeRecorder:
        """The recorder of the last call when it recorded the same names for the same batch
        size (its hooks and buffers are then part of the compiled step already)."""
        state = self._state_for(batch)
        recorder = self._recorder
        if (
            recorder is None
            or recorder.names != tuple(names)
            or recorder.cursor is not state.cursor
        ):
            recorder = self._recorder = DecodeRecorder(names, state.cursor, self.max_length)
        return recorder

    def _state_for(self, batch: int) -> _DecodeState:
        """The decode tensors of the last call when its batch size and device were these, else
        new ones (a new batch shape compiles anew; dynamo would recompile anyway)."""
        device = _input_device(self.model)
        state = self._state
        if state is None or state.mask.shape[0] != batch or state.mask.device != device:
            state = self._state = _new_state(self.model.config, batch, self.max_length, device)
            self._step = None
        return state

    def _check_payloads(self) -> None:
        """Compiled steps do not guard the quantized modules' payload buffers (dynamo would
        check them at every step, ``qlens.modules.payload_guards``): compare them here, once a
        call, and drop the compiled steps of every decoder when they changed."""
        if not self._compile:
            return
        payloads = payload_signature(self.model)
        if self._payloads is not None and payloads != self._payloads:
            torch._dynamo.reset_code(StaticDecoder._decode_step.__code__)
            torch._dynamo.reset_code(StaticDecoder._prefill_forward.__code__)
        self._payloads = payloads

    def _special_ids(
        self, stop_at_eos: bool, eos_token_id: int | list[int] | None, pad_token_id: int | None
    ) -> tuple[list[int], int]:
        """The end-of-sequence ids a row stops at (none without ``stop_at_eos``) and the pad."""
        config = getattr(self.model, "generation_config", None)
        if eos_token_id is None:
            eos_token_id = getattr(config, "eos_token_id", None)
        eos = [] if eos_token_id is None else _as_list(eos_token_id)
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = eos[0] if eos else 0
        if not stop_at_eos:
            return [], int(pad_token_id)
        if len(eos) > _MAX_EOS_IDS:
            raise ValueError(f"at most {_MAX_EOS_IDS} end-of-sequence ids are supported, got {eos}")
        return eos, int(pad_token_id)

    def _prepare(
        self, input_ids: Tensor, attention_mask: Tensor | None, eos: list[int], pad: int
    ) -> tuple[_DecodeState, Tensor]:
        """The decode tensors for this batch (reused, their cache emptied, when the batch size
        is the one last seen), filled for this prompt, and the prompt's position ids."""
        batch, prompt = input_ids.shape
        self._check_payloads()
        state = self._state_for(batch)
        state.cache.reset()
        device = state.mask.device
        mask = (
            torch.ones_like(input_ids, device=device)
            if attention_mask is None
            else attention_mask.to(device=device, dtype=torch.long)
        )
        state.mask.fill_(1)
        state.mask[:, :prompt].copy_(mask)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        state.positions.copy_(positions[:, -1:])  # _commit moves it on to the first new token
        state.finished.fill_(False)
        state.index.fill_(0)
        state.cursor.fill_(0)
        state.eos.fill_(-1)
        state.eos[: len(eos)].copy_(torch.tensor(eos, dtype=torch.long))
        state.pad.fill_(pad)
        return state, positions

    def _forward(self, state: _DecodeState, ids: Tensor, positions: Tensor) -> Tensor:
        output = self.model(
            input_ids=ids,
            attention_mask=state.mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_keyword: state.cache},
        )
        return output.logits[:, -1]

    def _prompt_forward(self, state: _DecodeState, ids: Tensor, positions: Tensor) -> Tensor:
        """The prompt's last logits: through the compiled prompt forward when there is one,
        the prompt has two tokens or more and the cache holds its tensors (a static cache
        allocates them, with addresses the step's CUDA graph keeps, in its first forward),
        else eagerly; while recording, eagerly too (the hooks allocate the buffers)."""
        if (
            not self._compile_prefill
            or ids.shape[1] < 2
            or self._recording
            or not _cache_initialized(state.cache)
        ):
            return self._forward(state, ids, positions)
        if self._prefill is None:
            self._prefill = torch.compile(
                self._prefill_forward,
                backend=self._backend,
                fullgraph=True,
                options={"guard_filter_fn": without_payload_tensor_guards(self.model)},
            )
        # Contiguous (a slice of a longer batch would guard on its strides and recompile),
        # and a new view: the one marked below, not the caller's tensor.
        ids = ids.contiguous().view_as(ids)
        for tensor in (ids, positions):  # one graph for every prompt length
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        try:
            return self._prefill(state, ids, positions)
        except torch._dynamo.exc.TorchDynamoException as err:  # raised before the graph runs
            logger.warning(
                "StaticDecoder: %s's prompt forward does not compile (%s: %s); its prompts run "
                "eagerly from now on (compile_prefill=False skips the attempt)",
                type(self.model).__name__,
                type(err).__name__,
                str(err).strip().splitlines()[0] if str(err).strip() else "",
            )
            self._compile_prefill, self._prefill = False, None
            return self._forward(state, ids, positions)

    def _prefill_forward(self, state: _DecodeState, ids: Tensor, positions: Tensor) -> Tensor:
        if self._active_hooks:  # as in _decode_step: one graph per hook set
            pass
        return self._forward(state, ids, positions)

    def _commit(self, state: _DecodeState, logits: Tensor, processed: int) -> None:
        """Choose each row's next token from its last logits and move the state on past the
        ``processed`` tokens the forward read."""
        # Under a device map the logits come from the last device, the state is on the first.
        chosen = _choose(logits, self._sampling).to(state.out.device)
        chosen = torch.where(state.finished, state.pad, chosen)
        state.finished.logical_or_(torch.isin(chosen, state.eos))
        state.out.index_copy_(1, state.index, chosen[:, None])
        state.tokens.copy_(chosen[:, None])
        state.positions.add_(1)
        state.index.add_(1)
        state.cursor.add_(processed)

    def _decode_step(self) -> None:
        if self._active_hooks:  # dynamo guards the value it branched on: one graph per hook set
            pass
        state = self._state
        assert state is not None
        self._commit(state, self._forward(state, state.tokens, state.positions), processed=1)

    def _compiled_step(self) -> Callable[[], None]:
        if self._step is None:
            if not self._compile:
                self._step = self._decode_step
            else:
                mode = self._mode
                if mode is None and self._backend == "inductor":
                    cuda = self._state is not None and self._state.mask.device.type == "cuda"
                    mode = "reduce-overhead" if cuda else "default"
                options: dict[str, Any] = {
                    "guard_filter_fn": without_payload_tensor_guards(self.model)
                }
                if self._fuse_siblings:
                    backend: Any = fusing_backend(self._backend, mode)
                elif self._backend == "inductor":
                    from torch._inductor import list_mode_options

                    backend = "inductor"
                    options.update(list_mode_options(mode or "default"))
                else:
                    backend = self._backend
                self._step = torch.compile(
                    self._decode_step, backend=backend, fullgraph=True, options=options
                )
        return self._step


def _check_call(
    input_ids: Tensor,
    attention_mask: Tensor | None,
    max_new_tokens: int,
    max_length: int,
    sync_every: int,
) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if sync_every < 1:
        raise ValueError(f"sync_every must be at least 1, got {sync_every}")
    if input_ids.ndim != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            "input_ids must be integer token ids of shape [batch, pos], got "
            f"{input_ids.dtype} of shape {list(input_ids.shape)}"
        )
    prompt = input_ids.shape[1]
    if prompt + max_new_tokens > max_length:
        raise ValueError(
            f"a prompt of {prompt} tokens and {max_new_tokens} new tokens need a cache of "
            f"{prompt + max_new_tokens}, more than this decoder's max_length={max_length}: "
            "build a StaticDecoder with a larger max_length"
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {list(attention_mask.shape)}, input_ids "
            f"{list(input_ids.shape)}: they must match"
        )


def _check_sampling(do_sample: bool, temperature: float, top_k: int | None) -> None:
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be positive to sample, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")


def _new_state(config: Any, batch: int, max_length: int, device: torch.device) -> _DecodeState:
    from transformers import StaticCache

    def buffer(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        torch._dynamo.mark_static_address(tensor)
        return tensor

    return _DecodeState(
        cache=StaticCache(config=config, max_cache_len=max_length),
        mask=buffer(batch, max_length),
        tokens=buffer(batch, 1),
        positions=buffer(batch, 1),
        finished=buffer(batch, dtype=torch.bool),
        out=buffer(batch, max_length),
        index=buffer(1),
        cursor=buffer(1),
        eos=buffer(_MAX_EOS_IDS),
        pad=buffer(),
    )


def _choose(logits: Tensor, sampling: _Sampling) -> Tensor:
    """Each row's next token: the most likely one, or a draw (the exponential race: the argmax
    of p / E with E ~ Exp(1) is distributed as p, with no host sync and no multinomial)."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)


def _cut_after_all_ended(new: Tensor, eos: Tensor) -> Tensor:
    """``new`` up to and including the step at which the last row produced its first
    end-of-sequence token, as ``generate`` stops; all of it while some row has not ended."""
    ended = torch.isin(new, eos)
    if not bool(ended.any(dim=1).all()):
        return new
    last = int(ended.int().argmax(dim=1).max())
    return new[:, : last + 1]


def _active_hook_names(bridge: Bridge | None) -> str:
    if bridge is None:
        return ""
    return ",".join(sorted(name for name, point in bridge.hook_dict.items() if point.is_active))


def _cache_initialized(cache: Any) -> bool:
    """Whether every layer of a transformers static cache has allocated its tensors."""
    return all(getattr(layer, "is_initialized", True) for layer in getattr(cache, "layers", ()))


def _as_list(ids: int | list[int] | Tensor) -> list[int]:
    if isinstance(ids, Tensor):
        return [int(i) for i in ids.flatten()]
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def _cache_keyword(model: nn.Module) -> str:
    """The keyword the model's forward takes its cache by (transformers renamed it)."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise ValueError(
        f"{type(model).__name__}.forward takes neither 'cache' nor 'past_key_values': it cannot "
        "decode through a static KV cache"
    )


def _input_device(model: nn.Module) -> torch.device:
    """Where the token ids go: ``token_device`` of the model's input embedding."""
    return token_device(cast("PreTrainedModel", model).get_input_embeddings())
