"""Llama: its stage and blocks (`stage`), rotary positions (`rope`), its parameters, FLOPs,
activation terms and config rules (`family`), its `transformers` mapping (`hf`). Registered in
`megalite.model.families`."""
