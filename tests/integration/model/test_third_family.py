"""A model family of the test's own registers once and trains under tp2 + SP + pp2 equal to
its serial run (fp32, dropout 0), touching no file of megalite: what a third family costs.
The toy is a decoder of attention-free blocks (pre-LayerNorm ReLU MLP, a residual each), the
LM head tied to the token embedding."""
from __future__ import annotations

from typing import List

import pytest
import torch.nn as nn
import torch.nn.functional as F

from megalite.model.causal_lm import CausalLM, dropout
from megalite.model.families import register
from megalite.model.family import Family, Initial, token_embedding_spec
from megalite.model.gpt2.family import GPT2_FAMILY
from megalite.parallel.param_spec import ParamSpec
from megalite.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megalite.testing.spawn import run_ranks
from tests.layouts import _many, assert_equal, composed, train_in_process

pytestmark = pytest.mark.distributed


class ToyFamily(Family):
    name, probe_tensor, embedding_module, hf = "toy", "h.0.ln.weight", "wte", GPT2_FAMILY.hf

    def block_specs(self, cfg, index, tp):
        h, f, p = cfg.n_embd, cfg.ffn_size, f"h.{index}."
        split = {"ln.weight": ((h,), None), "ln.bias": ((h,), None), "fc.weight": ((f, h), 0),
                 "fc.bias": ((f,), 0), "proj.weight": ((h, f), 1), "proj.bias": ((h,), None)}
        return [(p + n, ParamSpec(p + n, shape, tp_dim=d)) for n, (shape, d) in split.items()]

    def first_specs(self, cfg, tp):
        return [("wte.weight", token_embedding_spec("wte.weight", cfg.vocab_size, cfg.n_embd,
                                                    tp, cfg.tie_word_embeddings))]

    def final_norm_specs(self, cfg, tp):
        return [(n, ParamSpec(n, (cfg.n_embd,))) for n in ("ln_f.weight", "ln_f.bias")]

    def initial_value(self, cfg, name):
        if ".ln" in "." + name:
            return Initial(1.0 if name.endswith("weight") else 0.0)
        return Initial(0.0) if name.endswith("bias") else Initial(std=cfg.initializer_range)

    def block_parameters(self, cfg):
        return 4 * cfg.n_embd + 2 * cfg.n_embd * cfg.ffn_size + cfg.ffn_size

    def num_parameters(self, cfg):
        return cfg.n_layer * self.block_parameters(cfg) + 2 * cfg.n_embd \
            + cfg.vocab_size * cfg.n_embd

    def flops_per_token(self, cfg, seq_len):
        return 6 * self.num_parameters(cfg)

    def flops_formula(self):
        return "6N"

    def fp8_linears(self, cfg, tp):
        h, f = cfg.n_embd, cfg.ffn_size
        return [("h.*.fc", "model.n_embd", h, "model.n_inner / tp", f // tp),
                ("h.*.proj", "model.n_inner / tp", f // tp, "model.n_embd", h)]

    def head_forward_flops_per_token(self, cfg):
        return 2 * (cfg.vocab_size * cfg.n_embd + 2 * cfg.n_embd)

    def layer_activation_bytes(self, cfg, s, b, t, sp, e, dropout=False, math_attention=False):
        return e * s * b * (2 * cfg.n_embd + 2 * cfg.ffn_size / t)

    def block_backward_bytes(self, cfg, s, b, t, e):
        return e * s * b * cfg.ffn_size / t


class ToyBlock(nn.Module):
    def __init__(self, cfg, tp_group, sp, residual_region):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.fc = ColumnParallelLinear(cfg.n_embd, cfg.ffn_size, tp_group, sp)
        self.proj = RowParallelLinear(cfg.ffn_size, cfg.n_embd, tp_group, sp)
        self.pdrop, self.region = cfg.resid_pdrop, residual_region

    def forward(self, x, attn=None):  # attn: the block interface's attention inputs (unused)
        y = self.proj(F.relu(self.fc(self.ln(x))))
        return x + dropout(y, self.pdrop, self.training, self.region)


class Toy(CausalLM):
    family = ToyFamily()

    @staticmethod
    def make_block(cfg, tp_group, sp, tp_region, residual_region, attention="auto", cp=None):
        return ToyBlock(cfg, tp_group, sp, residual_region)

    def build(self, attention):
        if self.first:
            self.wte = VocabParallelEmbedding(self.padded_vocab, self.cfg.n_embd, self.tp_group,
                                              self.sequence_parallel)
        self.h = nn.ModuleDict({str(i): self.make_block(
            self.cfg, self.tp_group, self.sequence_parallel, self.tp_region,
            self.residual_region) for i in self.blocks})
        if self.last:
            self.ln_f = nn.LayerNorm(self.cfg.n_embd, eps=self.cfg.layer_norm_epsilon)

    def block_list(self) -> List[nn.Module]:
        return list(self.h.values())

    def final_norm(self):
        return self.ln_f

    def token_embedding(self):
        return self.wte

    def embed(self, ids, positions=None):  # no positions: the toy has none
        return self.wte(ids.t())

    def sharding_units(self):
        return ([self.wte] if self.first else []) + self.block_list() \
            + ([self.ln_f, self.lm_head] if self.last else [])


register(Toy)  # in every rank too: each imports this module to run `_train`


def _train(rank, world, configs, run_dir, steps):
    return _many(rank, world, configs, run_dir, steps, None)


def test_a_third_family_trains_under_tp2_sp_pp2_equal_to_serial(tiny_data, tmp_path):
    # optim.eps=1e-4: the toy's ReLU MLPs and tied embedding leave many gradients of ~1e-7,
    # which AdamW at eps 1e-6 turns into whole lr-sized updates whose sign is the rounding's:
    # a matmul cut by TP sums in another order (on a CPU with AVX-512 MKL's kernels differ
    # by shape), and the weights part by 2e-5 after two steps though losses and norms agree
    # (update error 2e-3; at 1e-4, 1.4e-6 and every weight within 1e-5)
    toy = [f"data.dir={tiny_data}", "model.arch=toy", "train.micro_batch_size=2",
           "train.global_batch_size=8", "model.n_layer=4", "optim.eps=1e-4"]
    serial = train_in_process(tmp_path / "serial", toy, steps=4)
    per_rank = run_ranks(_train, 4, args=([composed(toy + ["tp=2", "sp=true", "pp=2"])],
                                          str(tmp_path / "w4"), 4), timeout_s=600)
    assert_equal(serial, [ranks[0] for ranks in per_rank])
