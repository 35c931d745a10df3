"""The Bridge's token side: strings to token ids and back, as TransformerLens makes them."""

from __future__ import annotations

from typing import Any, cast

import torch
from jaxtyping import Int
from torch import Tensor, nn

from qlens.bridge.tokens import PaddingSide, require_tokenizer, token_device, tokenize

Input = str | list[str] | Tensor


class TokenAPI:
    """Mixin for :class:`qlens.bridge.Bridge`; needs ``tokenizer``, ``cfg`` and ``embed``."""

    tokenizer: Any
    cfg: Any
    embed: nn.Module

    def _tokenize(
        self,
        texts: list[str],
        prepend_bos: bool | None,
        padding_side: PaddingSide | None,
    ) -> tuple[Tensor, Tensor]:
        """Ids and mask; ``None`` takes ``cfg.default_prepend_bos`` / ``default_padding_side``."""
        bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        side = self.cfg.default_padding_side if padding_side is None else padding_side
        return tokenize(require_tokenizer(self.tokenizer), texts, bos, side)

    def to_tokens(
        self,
        input: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
    ) -> Int[Tensor, "batch pos"]:
        """Token ids ``[batch pos]``, as TransformerLens makes them: one BOS first when
        ``prepend_bos`` (default ``cfg.default_prepend_bos``), padded on ``padding_side``
        (default ``cfg.default_padding_side``)."""
        texts = [input] if isinstance(input, str) else list(input)
        return self._tokenize(texts, prepend_bos, padding_side)[0]

    def to_str_tokens(
        self,
        input: str | list[str] | Tensor,
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
    ) -> list[str] | list[list[str]]:
        """Each token as a string: of a string or a 1-D / batch-1 token tensor (a list), or of
        each string of a list or each row of a batch (a list of lists). Tensors are decoded as
        given (``prepend_bos`` applies to strings only)."""
        tokenizer = require_tokenizer(self.tokenizer)
        if isinstance(input, list):
            return [cast(list[str], self.to_str_tokens(text, prepend_bos)) for text in input]
        if isinstance(input, str):
            tokens = self.to_tokens(input, prepend_bos, padding_side)[0]
        else:
            tokens = input.reshape(-1) if input.ndim == 2 and input.shape[0] == 1 else input
        if tokens.ndim == 2:
            return [[tokenizer.decode([int(t)]) for t in row] for row in tokens]
        if tokens.ndim != 1:
            raise ValueError(
                f"to_str_tokens takes a sequence or a batch, got shape {tuple(tokens.shape)}"
            )
        return [tokenizer.decode([int(t)]) for t in tokens]

    def to_string(self, tokens: Tensor | list[int]) -> str | list[str]:
        """Decode token ids: one token or sequence -> str, a batch -> list of str."""
        tokenizer = require_tokenizer(self.tokenizer)
        tokens = torch.as_tensor(tokens)
        if tokens.ndim == 0:
            tokens = tokens.reshape(1)
        if tokens.ndim == 1:
            return tokenizer.decode(tokens.tolist())
        return [tokenizer.decode(row.tolist()) for row in tokens]

    def _input_device(self) -> torch.device:
        """Where token ids go (``token_device`` of the embedding)."""
        return token_device(self.embed)

    def _prepare(
        self,
        input: Input,
        attention_mask: Tensor | None,
        padding_side: PaddingSide | None = None,
        prepend_bos: bool | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Token ids ``[batch pos]`` on the input device and the mask (None: no padding) of
        strings or ids, checked."""
        if isinstance(input, str):
            input = [input]
        if isinstance(input, list):
            tokens, mask = self._tokenize(input, prepend_bos, padding_side)
            if attention_mask is not None:
                raise ValueError("attention_mask is built from strings; pass it only with tokens")
            attention_mask = mask if bool((mask == 0).any()) else None
        elif isinstance(input, Tensor):
            if input.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"token tensors must be int64/int32 ids, got {input.dtype}")
            tokens = input.unsqueeze(0) if input.ndim == 1 else input
            if tokens.ndim != 2:
                raise ValueError(f"token tensors must be [batch pos], got {tuple(input.shape)}")
        else:
            raise TypeError(
                f"input must be a string, a list of strings or a token tensor, got {type(input).__name__}"
            )
        if attention_mask is not None:
            attention_mask = (
                attention_mask.unsqueeze(0) if attention_mask.ndim == 1 else attention_mask
            )
            if attention_mask.shape != tokens.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} != tokens shape {tuple(tokens.shape)}"
                )
        device = self._input_device()
        tokens = tokens.to(device)
        if attention_mask is None:
            return tokens, None
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (real token) only")
        return tokens, attention_mask.to(device=device, dtype=torch.long)

    def _decode_generated(self, out: Tensor, bos_mask: Tensor | None) -> list[str]:
        """Each row as a string; with ``bos_mask`` (the prompt's mask), the BOS the strings were
        given (each row's first real token) is left out."""
        tokenizer = require_tokenizer(self.tokenizer)
        if bos_mask is None:
            return [tokenizer.decode(row.tolist()) for row in out]
        first_real = bos_mask.argmax(-1).tolist()  # index of the first 1
        return [
            tokenizer.decode(row[:start].tolist() + row[start + 1 :].tolist())
            for row, start in zip(out, first_real, strict=True)
        ]
