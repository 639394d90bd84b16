"""The steps of `bench/gpu_check.py`, one module per concern; each step takes the parsed
arguments and returns its JSON section (`results.update` merges sections into the file)."""
