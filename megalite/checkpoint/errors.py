"""The one error a checkpoint that cannot be used raises (incomplete, corrupted, incompatible)."""


class CheckpointError(RuntimeError):
    pass
