"""The Llama family on real gloo ranks: logits equal transformers' `LlamaForCausalLM` under tp2 +
SP and pp2; training equals the serial run (fp32, dropout 0: losses, grad norms, validation
loss, every parameter slice after every step) under tp2 + SP with the KV heads split and with
them replicated (n_kv_head = 1 < tp; also with recompute, and with optimizer offload), pp2
zb-v, pp2 interleaved, dp2 zero 3, and two 4-rank layouts with the KV head replicated (tp2 +
SP + pp2 zb-h1, tp2 + SP + dp2 zero 3) that resume from the tp2 layout's checkpoint; the same
checkpoint resumed serially (tp2 -> tp1: the shared KV slices read once) and exported to
transformers; each layout against the plan; `fit()` with the default-on services."""
from __future__ import annotations

import pytest
import torch

from megalite.config.model import ModelConfig, RopeScaling
from megalite.parallel.topology import build_topology
from megalite.testing.spawn import run_ranks
from tests.conftest import random_hf_llama
from tests.layouts import (
    assert_equal,
    close,
    composed,
    from_step,
    serial_global,
    train_in_process,
    train_layouts,
)

pytestmark = pytest.mark.distributed

STEPS, SAVE_AT = 6, 3
LLAMA = ["model.arch=llama", "model.n_layer=4", "model.n_kv_head=2", "model.n_inner=96",
         "model.tie_word_embeddings=false", "model.rope_theta=50000"]
KV1 = ["model.n_kv_head=1"]  # tp2: the one KV head replicated over both TP ranks


def _common(tiny_data, *extra):
    return [f"data.dir={tiny_data}", "train.micro_batch_size=2", "train.global_batch_size=8",
            *LLAMA, *extra]


def _logits(rank, world, cfg, state, ids):
    """This rank's logits of `ids` under tp2 + SP, then under pp2 (stage 0 sends its hidden
    states to stage 1): the last stage returns them."""
    import torch.distributed as dist

    from megalite.model.families import causal_lm
    from megalite.model.init import load_global_state

    topo = build_topology(world, 1, 1)
    tp = causal_lm(cfg, tp_group=topo.tp_group, sequence_parallel=True).eval()
    load_global_state(tp, state)
    half = cfg.n_layer // 2
    stage = causal_lm(cfg, blocks=range(rank * half, (rank + 1) * half), first=rank == 0,
                      last=rank == 1).eval()
    load_global_state(stage, state)
    with torch.no_grad():
        tp_logits = tp(ids)
        if rank == 0:
            dist.send(stage(ids).contiguous(), 1)
            return tp_logits, None
        hidden = torch.empty(ids.shape[1], ids.shape[0], cfg.n_embd)
        dist.recv(hidden, 0)
        return tp_logits, stage(hidden)


def _activation_bytes(rank, world):
    """A block's saved bytes measured against `LlamaFamily.layer_activation_bytes` at tp2,
    with and without SP, KV heads split (2) and replicated (1)."""
    from megalite.bench.tensor import saved_activation_bytes
    from megalite.model.families import causal_lm, family
    from megalite.model.init import init_parameters

    topo = build_topology(world, 1, 1)
    ids = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for kv in (2, 1):
        cfg = ModelConfig(arch="llama", n_layer=1, n_embd=64, n_head=4, n_kv_head=kv,
                          n_positions=32, vocab_size=256, n_inner=96, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
        for sp in (False, True):
            model = causal_lm(cfg, tp_group=topo.tp_group, sequence_parallel=sp).train()
            init_parameters(model, seed=0)
            x = model.embed(ids).detach().requires_grad_()
            measured = saved_activation_bytes(lambda: model.model.layers["0"](x),
                                              model.parameters())
            out[kv, sp] = (measured, family(cfg).layer_activation_bytes(cfg, 32, 3, world, sp, 4))
    return out


def test_logits_equal_transformers_under_tp2_sp_and_pp2():
    """fp32 logits within 1e-5 of LlamaForCausalLM's: GQA (2 KV heads for 8 query heads),
    rope_theta 500000 and Llama 3's scaling (positions past its original context of 16); in
    the same spawn, a block's saved activation bytes equal the plan's formula exactly."""
    from megalite.model.hf_llama import from_hf_state_dict

    cfg = ModelConfig(name="t", arch="llama", n_layer=2, n_embd=64, n_head=8, n_kv_head=2,
                      n_positions=64, vocab_size=300, n_inner=96, tie_word_embeddings=False,
                      rope_theta=500000.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=16))
    hf = random_hf_llama(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    (tp0, _, bytes0), (tp1, pp, bytes1) = run_ranks(
        _both, 2, args=(cfg, from_hf_state_dict(hf.state_dict()), ids))
    for logits in (tp0, tp1, pp):
        assert (logits - ref).abs().max().item() <= 1e-5
    for key, (measured, formula) in [*bytes0.items(), *bytes1.items()]:
        assert measured == pytest.approx(formula, rel=1e-9), (key, measured, formula)


def _both(rank, world, cfg, state, ids):
    """One spawn for the logits and the activation bytes."""
    return (*_logits(rank, world, cfg, state, ids), _activation_bytes(rank, world))


@pytest.fixture(scope="module")
def serial(tiny_data, tmp_path_factory):
    """The serial runs: the KV heads as configured (2) and one KV head."""
    root = tmp_path_factory.mktemp("llama-serial")
    return {"kv2": train_in_process(root / "kv2", _common(tiny_data), STEPS),
            "kv1": train_in_process(root / "kv1", _common(tiny_data, *KV1), STEPS)}


def test_layouts_equal_serial_and_resume_under_another_layout(tiny_data, tmp_path, serial):
    ckpt = tmp_path / "ckpt"
    two = {"tp2 sp, activation offload": ("kv2", ["tp=2", "sp=true", "offload.activations=true"]),
           "tp2 sp replicated kv": ("kv1", ["tp=2", "sp=true", *KV1, f"checkpoint.dir={ckpt}"]),
           "tp2 replicated kv, recompute": ("kv1", ["tp=2", *KV1, "train.recompute=true"]),
           # the shared KV head's host pieces squared after its TP sum (the grad norm)
           "tp2 replicated kv, optimizer offload": ("kv1", ["tp=2", *KV1,
                                                            "offload.optimizer=1"]),
           "pp2 zb-v": ("kv2", ["pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2"]),
           "pp2 interleaved": ("kv2", ["pp=2", "parallel.virtual_stages=2"]),
           "dp2 zero3, optimizer offload": ("kv2", ["zero=3", "offload.optimizer=0.5"])}
    results = train_layouts(tmp_path / "w2", 2, [_common(tiny_data, *extra)
                                                 for _, extra in two.values()],
                            steps=STEPS, save_at=SAVE_AT)
    for (name, (reference, extra)), ranks in zip(two.items(), results):
        assert_equal(serial[reference], ranks)
        _assert_plan(_common(tiny_data, *extra), 2, ranks)

    resume = [f"checkpoint.resume={ckpt / f'step_{SAVE_AT:08d}'}"]
    expected = from_step(serial["kv1"], SAVE_AT)
    combined = _common(tiny_data, *KV1, "tp=2", "sp=true", "pp=2", "parallel.schedule=zb-h1",
                       *resume)
    zero3 = _common(tiny_data, *KV1, "tp=2", "sp=true", "zero=3", *resume)
    for run, ranks in zip((combined, zero3), train_layouts(tmp_path / "w4", 4, [combined, zero3],
                                                           steps=STEPS - SAVE_AT)):
        assert_equal(expected, ranks)
        _assert_plan(run, 4, ranks)
    assert_equal(expected, [train_in_process(tmp_path / "r1", _common(tiny_data, *KV1, *resume),
                                             STEPS - SAVE_AT)])
    _assert_export_is_serial(ckpt / f"step_{SAVE_AT:08d}", tmp_path / "hf",
                             serial_global(serial["kv1"], SAVE_AT - 1))


def _assert_plan(overrides, world, ranks):
    """The plan of the layout against what its ranks measured: parameters per rank, model-state
    bytes, and each group's wire bytes per step (the mean over a stage's ranks, as
    tests/integration/test_plan.py compares GPT-2's; the shared KV heads' gradient sum in tp)."""
    from megalite.config.layout import Layout
    from megalite.plan.memory import make_plan

    cfg = composed(overrides)
    plan = make_plan(cfg, Layout.from_config(cfg, world, "cpu"))
    for res in ranks:
        stage = plan.stages[res["coords"][1]]
        assert res["local_numel"] == stage.params, overrides
        for kind, got in res["bytes"].items():
            assert got == pytest.approx(stage.bytes[kind], rel=0.01), (overrides, kind)
    # zb-v's pp bytes are left out: the plan counts the V's turn on the last stage (local, no
    # transfer) as two sends, for every family
    groups = ("tp", "dp") if cfg.parallel.schedule == "zb-v" else ("tp", "pp", "dp")
    for stage in plan.stages:
        mine = [r for r in ranks if r["coords"][1] == stage.stage]
        for group in groups:
            got = sum(sum(v["wire_bytes"] for k, v in r["step_comm"].items()
                          if k.startswith(group + "/")) for r in mine) / len(mine)
            assert got == pytest.approx(stage.comm[group], rel=0.02, abs=64), \
                (overrides, stage.stage, group, got, stage.comm[group])


def _assert_export_is_serial(ckpt, out, weights):
    """The tp2 checkpoint (one KV head shared by both TP ranks) exported: a LlamaForCausalLM
    whose every tensor is the serial run's at that step (gate and up split back)."""
    from transformers import LlamaForCausalLM

    from megalite.checkpoint.export import export_hf
    from megalite.model.hf_llama import to_hf_state_dict

    export_hf(ckpt, out)
    hf = LlamaForCausalLM.from_pretrained(out).state_dict()
    expected = to_hf_state_dict(weights)
    assert set(hf) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(hf[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


DEFAULTS_IN_RUN = ["checkpoint.every=2", "resilience.check_every=2",
                   "resilience.straggler_report_every=2", "train.eval_every=2",
                   "train.eval_steps=1", f"train.max_steps={STEPS}"]


def _fit(rank, world, cfg, run_dir):
    """A run as `pretrain.py` makes it: validated, built, trained by `fit()`."""
    from megalite.config.layout import validate
    from megalite.train.build import build_trainer
    from megalite.train.runtime import init_runtime

    validate(cfg, world)
    trainer = build_trainer(cfg, init_runtime(cfg), run_dir)
    records = trainer.fit()
    return ([r["loss"] for r in records], [r["grad_norm"] for r in records],
            trainer.replicas.checks)


def test_fit_with_the_defaults_on_equals_serial(tiny_data, tmp_path, serial):
    """tp2 + SP with the KV head replicated, trained by `fit()` with the default-on services
    in the run (checkpoints, replica checks, straggler reports, validation): its losses and
    grad norms equal the serial run's, and the replica checks (steps 2, 4, 6) pass."""
    cfg = composed(_common(tiny_data, *KV1, "tp=2", "sp=true", *DEFAULTS_IN_RUN,
                           f"checkpoint.dir={tmp_path}/ckpt"))
    for losses, norms, checks in run_ranks(_fit, 2, args=(cfg, str(tmp_path)), timeout_s=600):
        assert checks == STEPS // 2
        for s in range(STEPS):
            assert close(losses[s], serial["kv1"]["losses"][s], 1e-5), (s, losses)
            assert close(norms[s], serial["kv1"]["norms"][s], 1e-5), (s, norms)
