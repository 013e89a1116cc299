"""torchtitan both ways, against torchtitan itself (0.3.0, the `interop` extra): a tiny Llama 3
built by torchtitan's own code and saved with DCP as its CheckpointManager saves a model
(`ModelWrapper`'s flat keys) is megalite's `init_from` under tp2 (+ SP) and pp2 with logits
equal to torchtitan's forward (fp32, 1e-5); the tp2 run's checkpoint, exported by
`export_dcp` on both ranks (each its own share), loads in torchtitan with equal logits; and
megalite -> DCP -> torchtitan -> DCP (torchtitan's save) -> megalite is bitwise. Skipped where
torchtitan is not installed."""
from __future__ import annotations

import pytest
import torch

from megalite.config.model import ModelConfig, RopeScaling

pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed (pip "
                    "install -e '.[interop]'); the DCP/torchtitan tests need it")

pytestmark = pytest.mark.distributed

SHAPE = dict(n_layer=2, n_embd=64, n_head=8, n_kv_head=2, vocab_size=1024, n_inner=96)
ROPE = dict(theta=500000.0, factor=8.0, original=16)  # scaling matters past 16 positions
LLAMA = ["model=llama3.2-1b", "model.n_layer=2", "model.n_embd=64", "model.n_head=8",
         "model.n_kv_head=2", "model.vocab_size=1024", "model.n_inner=96", "model.n_positions=64",
         "model.tie_word_embeddings=false", "model.rope_scaling.factor=8.0",
         "model.rope_scaling.original_max_position_embeddings=16"]


def titan_model(seed: int = 0):
    """torchtitan's Llama 3 (its config builders, flex attention) of SHAPE, every weight random
    (norms too: unit norms would hide swapped norms)."""
    import torchtitan.models.llama3 as titan
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim, vocab = SHAPE["n_embd"], SHAPE["vocab_size"]
    rope = ComplexRoPE.Config(dim=dim // SHAPE["n_head"], max_seq_len=64, theta=ROPE["theta"],
                              scaling="llama", scaling_factor=ROPE["factor"],
                              original_max_position_embeddings=ROPE["original"])
    cfg = titan.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=titan._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=titan._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=titan._output_linear_init(dim)),
        layers=titan._build_llama3_layers(
            n_layers=SHAPE["n_layer"], dim=dim, n_heads=SHAPE["n_head"],
            n_kv_heads=SHAPE["n_kv_head"], hidden_dim=SHAPE["n_inner"], rope=rope,
            attn_backend="flex"))
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def titan_logits(model, ids):
    """torchtitan's forward ([batch, seq, vocab]) with its causal block mask."""
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(ids, positions, model.get_attention_masks(positions))


def megalite_cfg() -> ModelConfig:
    return ModelConfig(arch="llama", tie_word_embeddings=False, rope_theta=ROPE["theta"],
                       rope_scaling=RopeScaling(factor=ROPE["factor"],
                                                original_max_position_embeddings=ROPE["original"]),
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_positions=64, **SHAPE)


def _from_titan_and_back(rank, world, tiny_data, titan_dir, run_dir, out_dir, ids):
    """init_from torchtitan's DCP under tp2 (the trainer's path), this rank's logits under tp2 +
    SP and pp2 from the same state, the tp2 checkpoint saved and exported to DCP by both ranks."""
    from megalite.checkpoint.dcp_export import export_dcp
    from megalite.config.layout import validate
    from megalite.config.schema import load_config
    from megalite.train.build import build_trainer
    from megalite.train.init_from import load_init_state
    from megalite.train.runtime import init_runtime
    from tests.conftest import TINY
    from tests.integration.model.test_llama import _logits
    from tests.layouts import FP32_NO_DROPOUT

    cfg = load_config(TINY + FP32_NO_DROPOUT + LLAMA + [
        f"data.dir={tiny_data}", "tp=2", f"init_from={titan_dir}",
        f"checkpoint.dir={run_dir}/checkpoints"])
    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    ckpt = trainer.save()
    logits = _logits(rank, world, cfg.model, load_init_state(titan_dir, cfg.model), ids)
    export_dcp(ckpt, out_dir)
    return logits, str(ckpt)


def test_torchtitan_checkpoints_both_ways(tiny_data, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    from megalite.checkpoint.dcp_export import read_titan_state
    from megalite.checkpoint.format import read_global_state
    from megalite.model.families import causal_lm
    from megalite.model.init import load_global_state
    from megalite.model.llama import titan as titan_names
    from megalite.testing.spawn import run_ranks

    titan = titan_model()
    dcp.save(ModelWrapper(titan).state_dict(), checkpoint_id=str(tmp_path / "titan" / "step-10"),
             no_dist=True)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    ref = titan_logits(titan, ids)

    (tp0, _), (tp1, pp) = [r[0] for r in run_ranks(
        _from_titan_and_back, 2, args=(tiny_data, str(tmp_path / "titan"), str(tmp_path / "run"),
                                       str(tmp_path / "exported"), ids), timeout_s=600)]
    for logits in (tp0, tp1, pp):
        assert (logits - ref).abs().max().item() <= 1e-5

    cfg = megalite_cfg()
    serial = causal_lm(cfg).eval()
    load_global_state(serial, read_titan_state(tmp_path / "titan", cfg))
    with torch.no_grad():
        assert (serial(ids) - ref).abs().max().item() <= 1e-5
    monkeypatch.setattr(titan_names, "to_rotate_half", lambda w, heads: w)  # no permutation
    load_global_state(serial, read_titan_state(tmp_path / "titan", cfg))
    with torch.no_grad():
        assert (serial(ids) - ref).abs().max().item() > 1e-2  # the test sees a wrong layout
    monkeypatch.undo()

    files = sorted(p.name for p in (tmp_path / "exported").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # a share per rank
    back = titan_model(seed=1)
    wrapper = ModelWrapper(back)
    state = wrapper.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "exported"), no_dist=True)
    wrapper.load_state_dict(state)
    assert (titan_logits(back, ids) - ref).abs().max().item() <= 1e-5
    original = titan.state_dict()
    assert all(torch.equal(t, original[k]) for k, t in back.state_dict().items())

    dcp.save(ModelWrapper(back).state_dict(), checkpoint_id=str(tmp_path / "titan2" / "step-0"),
             no_dist=True)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000000"
    ours, again = read_global_state(ckpt), read_titan_state(tmp_path / "titan2", cfg)
    assert ours.keys() == again.keys()
    assert all(torch.equal(ours[k], again[k]) for k in ours)  # megalite -> torchtitan -> back
