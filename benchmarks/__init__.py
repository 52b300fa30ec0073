"""Benchmarks: ops (python -m benchmarks.ops), all-reduce, end-to-end fit."""
