"""Codecs: pack, unpack and dequantize for each format family (pure torch)."""
