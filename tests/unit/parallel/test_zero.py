"""ZeRO stages 0-3 over the data-parallel dimension, alone and composed with TP and PP.

Gradient integrity and state consistency: every run's losses, grad norms and validation loss
equal the single-process run, and after every step every rank's parameters (gathered from the
shards for zero 3) are its slice of the serial parameters — hence DP replicas are identical.

Memory and traffic, fp32 on CPU: the ZeRO table of `megalite.plan.memory` (`model_state_bytes`,
`dp_traffic_elements`; docs/zero.md renders it with `zero_table()`), with Ψ = elements of this
rank's TP x PP shard (vocabulary padded), N = DP size, m = micro-batches per step. For m = 1
these are the ZeRO paper's 2Ψ and 3Ψ; zero 2 and 3 reduce-scatter every micro-batch because
they keep no full gradient to accumulate into.
"""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("bucket_numel", [1e3, 1e30, float("inf")])
def test_the_tied_embedding_is_a_bucket_of_its_own_on_both_pipeline_ends(bucket_numel):
    """Its gradient is summed over the embedding group bucket by bucket, so the first and
    the last stage must hold it alone, whatever the bucket size."""
    from megalite.config.schema import ModelConfig
    from megalite.model.gpt2.stage import GPT2
    from megalite.parallel.bucket import bucket_groups

    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=100)
    for stage in (GPT2(cfg, blocks=range(1), last=False), GPT2(cfg, blocks=range(1, 2),
                                                              first=False)):
        sizes = [(n, p.numel(), stage.param_specs[n].tied) for n, p in stage.named_parameters()]
        groups = bucket_groups(sizes, bucket_numel, tied_alone=True)
        tied = [g for g in groups if any(stage.param_specs[n].name == "transformer.wte.weight"
                                         for n in g)]
        assert len(tied) == 1 and len(tied[0]) == 1, groups
        assert sorted(n for g in groups for n in g) == sorted(n for n, _ in
                                                              stage.named_parameters())
