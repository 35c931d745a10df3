"""qlens: mechanistic interpretability for Hugging Face causal LMs, quantized or not."""

__version__ = "0.1.0"
