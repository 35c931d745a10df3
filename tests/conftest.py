"""Test setup: offline, Triton interpreter, runtime shape checks on qlens' public tensor APIs."""

import os

# Must be set before any @triton.jit decorator runs and before transformers is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from hypothesis import HealthCheck, settings  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

# Every jaxtyping annotation in qlens is checked with beartype while the tests run (calls that
# torch.compile traces excepted: tests/typecheck_outside_compile.py).
install_import_hook("qlens", "typecheck_outside_compile.beartype_outside_compile")

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("QLENS_HYPOTHESIS_PROFILE", "ci"))
