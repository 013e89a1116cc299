"""The gloo rank launcher used by the tests (it lives in the package for the benchmarks too)."""
from megalite.spawn import RankFailure, free_port, run_ranks

__all__ = ["RankFailure", "free_port", "run_ranks"]
