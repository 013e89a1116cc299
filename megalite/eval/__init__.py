"""Evaluation beyond the training loss: EleutherAI's lm-eval harness on a run's `transformers`
export (`lm_harness`, the `megalite-evaluate` command)."""
