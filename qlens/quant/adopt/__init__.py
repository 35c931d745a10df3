"""Adopt: read library-quantized modules (bitsandbytes, GPTQ, FP8...) into qlens payloads."""

from qlens.quant.adopt.core import adopt_module, is_quantized_module, supported_modules

__all__ = ["adopt_module", "is_quantized_module", "supported_modules"]
