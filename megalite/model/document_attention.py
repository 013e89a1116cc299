"""Attention within documents (`train.attention_mask=document`): a token attends to the earlier
tokens of its own document only, as Llama 3 trained ("an attention mask that prevents
self-attention between different documents within the same sequence", Dubey et al. 2024 §3.2)
and Megatron's --reset-attention-mask does. The documents come with the batch
(`megalite.data.documents`: ids from the EOS tokens of each window); query t sees key u iff

    u <= t  and  ids[u] == ids[t]

(a block-diagonal of causal triangles). Three kernels compute it (`train.document_kernel`,
`megalite.config.document_kernel`: which runs where, and auto's choice):

  flex    FlexAttention (Dong et al. 2024, `torch.nn.attention.flex_attention`, compiled) with
          a block-sparse `BlockMask` made once per micro-batch from the ids: blocks of 128×128
          that the mask empties are never computed, so packed documents cost about their own
          causal work (to the 128-token block).
  varlen  FlashAttention-2's variable-length kernel (`torch.nn.attention.varlen.varlen_attn`):
          the b·s tokens of the micro-batch as one packed sequence cut at every document start
          (and every window start), each piece causal on its own (the cumulative lengths,
          `cu_seqlens`, made once per micro-batch). Exactly the documents' triangles.
  sdpa    SDPA with the dense boolean mask [b, 1, s, s] (memory s² per sequence).

flex and varlen have not yet run on a GPU in megalite's tests (tests/unit/model/
test_cuda_document_attention.py runs them where CUDA is); flex's block mask runs forward on CPU
against the boolean mask (tests/unit/parallel/test_context_documents.py). Under cp > 1 the CP
kernels take `DocumentSpans` instead (`megalite.parallel.context_documents`).

`AttentionInputs` is what one micro-batch's forward gives every block beyond its activations
(the documents' ids, the positions when they restart per document, the kernel); it is made
once per forward and its masks are cached in it, so every block (and a recomputed one, in
backward) uses the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megalite.config.document_kernel import resolved_document_kernel
from megalite.data.documents import Documents, packed_sequences
from megalite.parallel.context_attention import ContextParallel, cp_attention
from megalite.parallel.context_documents import DocumentSpans, compiled_flex_attention


@dataclass
class AttentionInputs:
    """The per-micro-batch inputs of attention: `ids` [b, s] (None: causal across documents),
    `positions` [b, s] (None: 0..s-1), `kernel` the document mask's (train.document_kernel).
    Over the whole sequence, as attention sees it (with sequence parallelism q and k are made
    from the gathered sequence)."""

    ids: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    kernel: str = "auto"
    cu_seqlens: Optional[torch.Tensor] = None
    longest: int = 0
    spans: Optional[DocumentSpans] = None  # under cp > 1: what the CP kernels take
    _masks: dict = field(default_factory=dict, repr=False)

    @staticmethod
    def of(documents: Optional[Documents], kernel: str = "auto"
           ) -> Optional["AttentionInputs"]:
        if documents is None or (documents.ids is None and documents.positions is None):
            return None
        return AttentionInputs(documents.ids, documents.positions, kernel,
                               documents.cu_seqlens, documents.longest, documents.spans)

    def sdpa_mask(self) -> torch.Tensor:
        """[b, 1, s, s] bool: True where the query may see the key."""
        if "sdpa" not in self._masks:
            ids = self.ids
            s = ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
            self._masks["sdpa"] = (causal & (ids[:, :, None] == ids[:, None, :]))[:, None]
        return self._masks["sdpa"]

    def block_mask(self):
        """FlexAttention's block-sparse mask of the documents (built compiled on CUDA, which
        never forms the [s, s] mask; eagerly elsewhere, where flex_attention's forward runs
        unfused)."""
        if "flex" not in self._masks:
            from torch.nn.attention.flex_attention import create_block_mask

            ids = self.ids

            def same_document_causal(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])

            b, s = ids.shape
            self._masks["flex"] = create_block_mask(same_document_causal, B=b, H=None,
                                                    Q_LEN=s, KV_LEN=s, device=ids.device,
                                                    _compile=ids.device.type == "cuda")
        return self._masks["flex"]

    def packed_sequences(self) -> Tuple[torch.Tensor, int]:
        """The variable-length kernel's cumulative lengths and longest document
        (`megalite.data.documents.packed_sequences`): the batch's, made on the host, else
        made here from the ids (once)."""
        if self.cu_seqlens is not None:
            return self.cu_seqlens, self.longest
        if "varlen" not in self._masks:
            self._masks["varlen"] = packed_sequences(self.ids)
        return self._masks["varlen"]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     inputs: AttentionInputs) -> torch.Tensor:
    """`document_attention` through FlashAttention-2's variable-length kernel: q [b, hq, s, d]
    and k, v [b, hk, s, d] become [b·s, h, d] (a copy each unless b = 1: the kernel reads
    tokens, then heads), one causal sequence a document."""
    from torch.nn.attention import varlen

    b, hq, s, d = q.shape
    cu, longest = inputs.packed_sequences()

    def tokens(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(b * s, t.shape[1], d)
    out = varlen.varlen_attn(tokens(q), tokens(k), tokens(v), cu, cu, longest, longest,
                             window_size=(-1, 0), enable_gqa=hq != k.shape[1])
    return out.view(b, s, hq, d).transpose(1, 2)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       inputs: AttentionInputs, p: float, choice: str,
                       cp: Optional[ContextParallel] = None) -> torch.Tensor:
    """Attention within documents of q [b, hq, s, d] over k, v [b, hk, s, d] (hq a multiple
    of hk: grouped-query attention, query head i reading KV head i // (hq / hk)), dropout
    `p` on the probabilities, `choice` = train.attention (the SDPA kernel where SDPA runs), the
    kernel `inputs.kernel` resolved for q's device (module docstring). With a CP group of
    more than one rank, `s` is this rank's chunks and `inputs.spans` their documents as the
    CP kernels take them, made on the host (`megalite.parallel.context_documents`; no
    attention dropout and only train.document_kernel=auto with cp > 1, refused before
    launch)."""
    if cp is not None and cp.group.size > 1:
        if inputs.spans is None:
            raise ValueError("CP attention within documents takes the batch's DocumentSpans "
                             "(DocumentRule.of with the CP rank), made on the host")
        return cp_attention(q, k, v, cp.group, cp.comm, documents=inputs.spans)
    gqa = q.shape[1] != k.shape[1]
    kernel = resolved_document_kernel(inputs.kernel, q.device.type, p, choice)
    if kernel == "flex":
        return compiled_flex_attention()(q, k, v, block_mask=inputs.block_mask(),
                                          enable_gqa=gqa)
    if kernel == "varlen":
        return varlen_attention(q, k, v, inputs)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=inputs.sdpa_mask(), dropout_p=p)
