"""Benchmarks behind `kvscope bench`; one module each (see engine/commands/bench.py)."""
