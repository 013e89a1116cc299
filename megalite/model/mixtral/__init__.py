"""Mixtral: Llama's attention and norms with MoE layers for MLPs (`megalite.model.moe`): its
stage (`stage`), its parameters, FLOPs and rules (`family`), its `transformers` mapping
(`hf`). Registered in `megalite.model.families`."""
