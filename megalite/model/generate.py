"""Autoregressive sampling from a serial model stage (tp = pp = 1, any family): the simplest proof that a
checkpoint is a language model.

No KV cache: every new token re-runs the model on the last `n_positions` tokens (a sliding
window once the text is longer than the model's context). Temperature 0 is greedy decoding;
otherwise logits / temperature, optionally restricted to the `top_k` largest, are sampled from
`generator`, so a seeded generator makes the output deterministic. Generation stops after
`eos_token_id` (the end of the document; what follows would start an unrelated one), as
`transformers`' generate does.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megalite.model.causal_lm import CausalLM


@torch.no_grad()
def generate(model: CausalLM, ids: List[int], max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
             vocab_size: Optional[int] = None, eos_token_id: Optional[int] = None) -> List[int]:
    """`ids` (at least one token) followed by up to `max_new_tokens` sampled tokens, the last
    of them `eos_token_id` if it was sampled (None: never stop early). Only ids below
    `vocab_size` (default: the model's) are ever sampled: a tokenizer may have fewer tokens
    than the embedding has rows."""
    if not ids:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: must be >= 1 (or None = no restriction)")
    model.eval()
    device = next(model.parameters()).device
    vocab_size = vocab_size or model.cfg.vocab_size
    out = torch.tensor([ids], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(out[:, -model.cfg.n_positions:])[0, -1, :vocab_size].float()
        if temperature == 0:
            token = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < vocab_size:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        out = torch.cat([out, token.view(1, 1)], dim=1)
        if eos_token_id is not None and int(token) == eos_token_id:
            break
    return out[0].tolist()
