"""Imports every adopter module so that each registers itself (their detectors are disjoint)."""

from qlens.quant.adopt import (
    bitnet,  # noqa: F401
    bnb,  # noqa: F401
    compressed_tensors,  # noqa: F401
    fp8,  # noqa: F401
    gpt_oss,  # noqa: F401
    gptq_awq,  # noqa: F401
    higgs_gguf,  # noqa: F401
    hqq,  # noqa: F401
    tensor_subclass,  # noqa: F401
    torchao_int4,  # noqa: F401
)
