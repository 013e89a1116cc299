"""Evaluation beyond the validation loss: multiple-choice scoring through the pipeline in any
layout (`choice`), the HellaSwag examples it scores during training (`hellaswag`), and
EleutherAI's lm-eval harness on a run's `transformers` export (`lm_harness`, the
`megalite-evaluate` command)."""
