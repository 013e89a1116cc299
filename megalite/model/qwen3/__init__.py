"""Qwen3 and Qwen3-MoE: Llama's and Mixtral's blocks with an RMSNorm over each query and key
head before RoPE and a head size of their own (`model.head_dim`): the stages (`stage`), the
families (`family`), the `transformers` mappings (`hf`). Registered in
`megalite.model.families`."""
