"""The parts of ``benchmarks/gpu_suite.py`` (the entry point): the workload and its training
step, the report, and the sections, one module per group."""
