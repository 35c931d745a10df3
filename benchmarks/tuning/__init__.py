"""Launch sweeps and profiles that chose the kernels' launch tables (run each as
``python -m benchmarks.tuning.<name>`` from the repository root); their results are in
``benchmarks/tuning/results/`` and the tables cite them (``qlens/kernels/launch_tables.py``)."""
