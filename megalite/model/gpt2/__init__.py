"""GPT-2: its stage and blocks (`stage`), its parameters, FLOPs, activation terms and config
rules (`family`), its `transformers` mapping (`hf`). Registered in `megalite.model.families`."""
