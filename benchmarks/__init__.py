"""Benchmark scripts (run each as ``python benchmarks/<name>.py``; launch sweeps in ``tuning/``
as ``python -m benchmarks.tuning.<name>``) and the helpers they share, none of them part of the
``qlens`` package: ``_timing`` (GPU timing, result headers), ``_samples`` (random library-layout
payloads, also used by the tests), ``_tinygemm`` (torch's int4 GEMM as a peer) and
``_e2e_models`` (the end-to-end benchmark's models)."""
