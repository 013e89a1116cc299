"""The configuration a command's overrides give, validated for a world size (the planning and
simulation commands, which launch nothing): a bad configuration exits 2, naming the key."""
from __future__ import annotations

import sys

from megalite.cli.refusal import refuse
from megalite.config.errors import ConfigError
from megalite.train.preflight import validated_config


def config_for_world(overrides, world_size: int, gpus_per_node: int, device: str):
    """The configuration of `overrides`, validated as a launch on `world_size` ranks would be
    (`gpus_per_node` GPUs a node on cuda); prints the warnings."""
    try:
        cfg, warnings = validated_config(overrides, world_size, gpus_per_node, device)
    except ConfigError as e:
        refuse(f"megalite: bad configuration: {e}", 2)
    for w in warnings:
        print(f"megalite: warning: {w}", file=sys.stderr)
    return cfg
