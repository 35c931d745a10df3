"""Benchmark scripts (run each as ``python benchmarks/<name>.py``) and the helpers they share:
``_timing`` (GPU timing, result headers) and ``_samples`` (random library-layout payloads, also
used by the tests). Neither helper is part of the ``qlens`` package."""
