"""Sharded, layout-independent checkpoints (see `megalite.checkpoint.format`)."""
