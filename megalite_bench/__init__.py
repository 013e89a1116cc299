"""Benchmarks behind `scripts/bench.py`: each measures megalite side by side with a reference
in the same run and reports ratios (absolute times on a shared machine are noise)."""
