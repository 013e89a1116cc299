"""Document masking in the planner (`megalite.plan.document_terms`): the visible pair and
block fractions (the blocks as FlexAttention's own block mask counts them), sampled from a
prepared corpus (each dataset of a data.blend, weighted) or given as a document length, the
masked kernel charged at its calibrated ratio in the time model (under cp > 1 the CP kernel's
unskipped work: its count equals the kernels' own counters in
tests/integration/parallel/test_context_attention.py), the same masked block time hiding
activation offload's copies, the profile's `document_mask` entry, the calibration's
measurement on CPU (no timing asserted), megalite-plan's line, and the layout search and
layout=auto pricing the mask. Deterministic but for the calibration."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from megalite.cli.plan import main as plan_main
from megalite.config.layout import Layout, validate
from megalite.config.schema import load_config
from megalite.data.documents import in_document_positions
from megalite.data.token_arrays import write_token_arrays
from megalite.plan import stage_time
from megalite.plan.auto import resolve_layout
from megalite.plan.calibrate_mask import kernels_here, measure_mask_ratios
from megalite.plan.devices import load_profile_file
from megalite.plan.document_cp import DocumentSample, cp_masked_work
from megalite.plan.document_terms import (
    NO_SAVING,
    attention_forward_s,
    causal_blocks,
    cp_work,
    fixed_length,
    masked_work,
    sample_blocks,
    sample_corpus,
    work_of,
)
from megalite.plan.profile_file import ProfileError, save_profile
from megalite.plan.time_model import predict
from megalite.plan.traffic import stage_traffic
from tests.unit.plan.test_calibrate import synthetic_profile
from tests.unit.plan.test_planner import SMALL, synthetic

DOCUMENT = ["train.attention_mask=document"]


def _ids(eos: np.ndarray) -> torch.Tensor:
    ids = np.zeros(eos.shape, dtype=np.int64)
    np.cumsum(eos[:, :-1], axis=1, out=ids[:, 1:])
    return torch.from_numpy(ids)


def visible_blocks(eos: np.ndarray) -> int:
    return sample_blocks(DocumentSample.of(eos))


def test_visible_blocks_are_flex_attentions_and_pairs_the_loaders():
    from torch.nn.attention.flex_attention import create_block_mask

    eos = np.random.default_rng(0).random((3, 600)) < 0.004
    ids = _ids(eos)

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (ids[b, q] == ids[b, kv])

    mask = create_block_mask(same_document_causal, B=3, H=None, Q_LEN=600, KV_LEN=600,
                             device="cpu", _compile=False)
    full = mask.full_kv_num_blocks
    assert visible_blocks(eos) == int(mask.kv_num_blocks.sum()) + \
        (int(full.sum()) if full is not None else 0)
    dense = (torch.ones(600, 600).tril().bool() & (ids[:, :, None] == ids[:, None, :]))
    work = work_of(eos, "test")
    assert work.pairs == pytest.approx(int(dense.sum()) / (3 * 600 * 601 / 2))
    assert work.blocks == pytest.approx(visible_blocks(eos) / (3 * causal_blocks(600)))
    t = np.arange(600)
    assert (DocumentSample.of(eos).document_start(t) == t - in_document_positions(eos)).all()


def test_documents_of_a_fixed_length_and_the_default():
    whole = fixed_length(32, 32, windows=1)  # one document a window, from its start
    assert (whole.pairs, whole.blocks) == (1.0, 1.0)
    cfg = load_config(SMALL + DOCUMENT + ["data.dir=/nonexistent"])
    assert masked_work(cfg, None) is NO_SAVING
    assert masked_work(load_config(SMALL), 8) is None  # causal: nothing to price
    eighth = masked_work(cfg, 4)
    assert 0 < eighth.pairs < eighth.blocks <= 1 and "--document-tokens 4" in eighth.source


def _corpus(path, seq_len: int, length: int, windows: int):
    """A prepared train split of documents of `length` tokens (EOS id 0 ending each)."""
    tokens = np.arange(1, seq_len * windows + 2, dtype=np.uint16) % 7 + 1
    tokens[length - 1::length] = 0
    return write_token_arrays(path, {"train": [tokens], "val": [tokens]}, 1024, 0,
                              f"documents of {length} tokens")


def test_the_corpus_is_sampled_not_scanned(tmp_path):
    data = _corpus(tmp_path / "data", 32, 8, windows=1000)
    work = sample_corpus(data, 32, windows=16)
    assert work.pairs == pytest.approx(9 / 33)  # 4 documents of 8: 4·36 of 528 pairs
    assert work.source.startswith("16 of 1000 windows")
    cfg = load_config(SMALL + DOCUMENT + [f"data.dir={data}"])
    assert masked_work(cfg, None).pairs == pytest.approx(9 / 33)


def test_a_blend_weights_each_datasets_fractions(tmp_path):
    short = _corpus(tmp_path / "short", 32, 4, windows=64)  # every window: (L + 1)/33 pairs
    long = _corpus(tmp_path / "long", 32, 16, windows=64)
    each = [sample_corpus(d, 32) for d in (short, long)]
    assert [w.pairs for w in each] == pytest.approx([5 / 33, 17 / 33])
    cfg = load_config(SMALL + DOCUMENT + [f"data.blend=[3,{short},1,{long}]"])
    blend = masked_work(cfg, None)
    assert blend.pairs == pytest.approx(0.75 * 5 / 33 + 0.25 * 17 / 33)
    assert blend.blocks == 1.0 and blend.source.startswith("blend of 0.75 x (64 of 64")
    for comm in ("allgather", "ring"):
        cp = [cp_masked_work(w.sample, 2, comm, 1) for w in each]
        assert cp[0].mean < cp[1].mean  # shorter documents: more skipped
        assert cp_work(blend, 2, comm, 1).mean == pytest.approx(  # 3:1 drawn, micro-batch 1
            0.75 * cp[0].mean + 0.25 * cp[1].mean)
        if comm == "allgather":  # its pieces are per sequence: a micro-batch's windows add
            assert cp_work(blend, 2, comm, 2).mean == pytest.approx(
                cp_work(blend, 2, comm, 1).mean)
            continue
        # the ring's micro-batches of 2 mix the datasets as training draws them: a batch
        # skips only what both its windows allow, more than the datasets' own batches would
        pooled = cp_work(blend, 2, comm, 2).slowest
        alone = [cp_masked_work(w.sample, 2, comm, 2).slowest for w in each]
        assert 0.75 * alone[0] + 0.25 * alone[1] < pooled <= alone[1]
    unprepared = load_config(SMALL + DOCUMENT + [f"data.blend=[3,{short},1,{tmp_path}]"])
    assert masked_work(unprepared, None) is NO_SAVING


def _predict(overrides, work=None, profile=None, world=1,
             batch=("train.global_batch_size=2", "train.micro_batch_size=1")):
    cfg = load_config(SMALL + list(batch) + overrides)
    validate(cfg, world, 8)
    lay = Layout.from_config(cfg, world, "cuda")
    profile = profile or synthetic()
    return cfg, lay, predict(cfg, lay, stage_traffic(cfg, lay), profile, 8, masked_work=work)


def test_the_time_model_charges_the_masked_kernels_work_at_its_ratio():
    cfg, lay, causal = _predict([])
    assert causal.document_mask is None
    work = fixed_length(8, 32)
    attention = attention_forward_s(cfg, lay, synthetic(), 4)  # the stage's 4 blocks
    for profile, ratio in ((synthetic(), 1.0), (replace(synthetic(), mask_ratios={"flex": 3.0}),
                                                3.0)):
        _, _, masked = _predict(DOCUMENT, work, profile)
        d = masked.document_mask
        assert d["kernel"] == "flex" and d["factor"] == pytest.approx(work.blocks * ratio)
        assert masked.terms["compute"] - causal.terms["compute"] == pytest.approx(
            2 * 3 * attention * (d["factor"] - 1))  # 2 micro-batches, forward + backward
        assert d["attention_causal_s"] == pytest.approx(2 * 3 * attention)
        assert d["attention_s"] == pytest.approx(d["attention_causal_s"] * d["factor"])
    _, _, sdpa = _predict(DOCUMENT + ["model.attn_pdrop=0.1"], work,
                          replace(synthetic(), mask_ratios={"sdpa": 1.5}))
    assert sdpa.document_mask["kernel"] == "sdpa" and sdpa.document_mask["factor"] == 1.5
    _, _, varlen = _predict(DOCUMENT + ["train.document_kernel=varlen"], work,
                            replace(synthetic(), mask_ratios={"varlen": 2.0, "flex": 9.0}))
    assert varlen.document_mask["kernel"] == "varlen"
    assert varlen.document_mask["factor"] == pytest.approx(2.0 * work.pairs)
    assert varlen.document_mask["measured"] == {"varlen": pytest.approx(2.0 * work.pairs),
                                                "flex": pytest.approx(9.0 * work.blocks)}
    assert "measured kernels for these documents (train.document_kernel): varlen" \
        in varlen.summary()


def test_under_cp_the_time_model_charges_the_cp_kernels_unskipped_work():
    work = fixed_length(8, 32)
    for comm in ("allgather", "ring"):
        over = ["cp=2", f"parallel.cp_comm={comm}"]
        cfg, lay, causal = _predict(over, world=2)
        _, _, masked = _predict(over + DOCUMENT, work, world=2)
        d, cp = masked.document_mask, cp_work(work, 2, comm, 1)
        assert cp.mean < cp.slowest < 1  # the ranks' shares differ: the slowest paces
        assert (d["kernel"], d["ratio"], d["factor"], d["cp_mean"]) == (
            f"cp {comm}", None, cp.slowest, cp.mean)
        attention = attention_forward_s(cfg, lay, synthetic(), 4)  # the stage's 4 blocks
        assert masked.terms["compute"] - causal.terms["compute"] == pytest.approx(
            2 * 3 * attention * (cp.slowest - 1))
        assert f"the cp=2 {comm} kernel computes {cp.mean:.1%}" in masked.summary()
        # a measured flex ratio prices the all-gather path's FlexAttention on CUDA (a
        # measured sdpa ratio nothing: no SDPA with a mask runs); the ring: causal
        ratios = {"sdpa": 1.5, "flex": 1.25}
        _, _, rated = _predict(over + DOCUMENT, work, replace(synthetic(), mask_ratios=ratios),
                               world=2)
        ratio = 1.25 if comm == "allgather" else None
        assert (rated.document_mask["ratio"], rated.document_mask["factor"]) == (
            ratio, pytest.approx(cp.slowest * (ratio or 1.0)))
        cpu = replace(synthetic(), device="cpu", mask_ratios=ratios)  # maskless flash pieces
        _, _, on_cpu = _predict(over + DOCUMENT, work, cpu, world=2)
        assert (on_cpu.document_mask["ratio"], on_cpu.document_mask["factor"]) == (
            None, cp.slowest)


def test_the_masked_block_hides_less_of_activation_offloads_copies(monkeypatch):
    """The offload term's block time is the masked block's: its forward shorter by the
    attention's saving, its backward by twice that; the head's time unchanged."""
    handed, real = [], stage_time.activation_offload_s
    monkeypatch.setattr(stage_time, "activation_offload_s",
                        lambda *a: handed.append(a) or real(*a))
    over = ["train.seq_len=512", "model.n_positions=512", "offload.activations=true",
            "offload.activations_layers=2"]
    batch = ("train.global_batch_size=8", "train.micro_batch_size=2")  # 4 micro-batches
    work = fixed_length(64, 512)
    for tflops, hidden in ((0.01, True), (0.3, False)):  # slow compute hides every copy
        profile = replace(synthetic(tflops=tflops, hbm=None), h2d_gbps=1.0, d2h_gbps=1.0)
        handed.clear()
        cfg, lay, causal = _predict(over, None, profile, batch=batch)
        _, _, masked = _predict(over + DOCUMENT, work, profile, batch=batch)
        factor = masked.document_mask["factor"]
        assert factor == work.blocks < 1
        saved = (1 - factor) * attention_forward_s(cfg, lay, profile, 1)
        (*_, c_block, c_after), (*_, m_block, m_after) = handed
        assert m_block == pytest.approx((c_block[0] - saved, c_block[1] - 2 * saved))
        assert m_after == pytest.approx(c_after)
        assert masked.terms["offload"] == pytest.approx(4 * real(*handed[1]))
        if hidden:
            assert masked.terms["offload"] == pytest.approx(0, abs=1e-15)
            assert causal.terms["offload"] == pytest.approx(0, abs=1e-15)
        else:
            assert masked.terms["offload"] > 2 * causal.terms["offload"] > 0


def test_the_profiles_document_mask_entry(tmp_path):
    entry = {"kernel": "sdpa", "ratio": 1.7, "document_tokens": 8}
    save_profile(tmp_path / "p.json", {**synthetic_profile(), "document_mask": entry})
    assert load_profile_file(tmp_path / "p.json").mask_ratios == {"sdpa": 1.7}
    entries = [entry, {"kernel": "varlen", "ratio": 0.9}, {"kernel": "flex", "ratio": 1.2}]
    save_profile(tmp_path / "p.json", {**synthetic_profile(), "document_mask": entries})
    assert load_profile_file(tmp_path / "p.json").mask_ratios == {"sdpa": 1.7, "varlen": 0.9,
                                                                  "flex": 1.2}
    for bad, why in (({"kernel": "xformers", "ratio": 1}, "document_mask=.*flex, varlen or"),
                     ([entry, entry], "kernel 'sdpa' is measured twice")):
        with pytest.raises(ProfileError, match=why):
            save_profile(tmp_path / "bad.json", {**synthetic_profile(), "document_mask": bad})
    assert not (tmp_path / "bad.json").exists()


def test_calibration_times_the_masked_attention_beside_the_causal_one():
    cfg = load_config(SMALL)
    kernels = kernels_here(torch.device("cpu"), 0.0, "fp32", None)
    [m] = measure_mask_ratios(cfg.model, 32, 1, "fp32", 0.01, torch.device("cpu"), kernels)
    assert (m["kernel"], m["document_tokens"], m["work"]) == ("sdpa", 8, 1.0)
    assert m["pairs"] == pytest.approx(9 / 33) and m["ratio"] >= 0
    assert m["causal_s"] > 0 and m["masked_s"] > 0
    cuda = torch.device("cuda")
    assert kernels_here(cuda, 0.0, "bf16", (9, 0)) == ["flex", "varlen", "sdpa"]
    assert kernels_here(cuda, 0.0, "fp32", (9, 0)) == ["flex", "sdpa"]
    assert kernels_here(cuda, 0.0, "fp16", (7, 0)) == ["flex", "sdpa"]
    assert kernels_here(cuda, 0.1, "bf16", (9, 0)) == ["sdpa"]


def test_megalite_plan_shows_the_fraction_and_the_attention_with_and_without(capsys):
    args = ["--world-size", "1", "--device", "h100-80gb", "--document-tokens", "8",
            *SMALL, *DOCUMENT, "train.global_batch_size=2", "train.micro_batch_size=1"]
    plan_main(args)
    out = capsys.readouterr().out
    assert "of the causal (query, key) pairs visible" in out and "(causal: " in out
    plan_main(["--world-size", "2", "--document-tokens", "8", *SMALL, *DOCUMENT, "cp=2",
               "parallel.cp_comm=ring", "train.global_batch_size=2", "train.micro_batch_size=1"])
    out = capsys.readouterr().out  # no device profile: the fractions alone
    ring = cp_work(fixed_length(8, 32), 2, "ring", 1)
    assert f"the cp=2 ring kernel computes {ring.mean:.1%} of its causal chunk pairs' work over the " \
        f"ranks, {ring.slowest:.1%} on the slowest rank" in out
    with pytest.raises(SystemExit) as e:
        plan_main(args[:4] + ["--document-tokens", "0"] + args[6:])
    assert e.value.code == 2 and "--document-tokens=0" in capsys.readouterr().err


LONG = ["model.n_layer=2", "model.n_positions=2048", "train.seq_len=2048",
        "train.global_batch_size=2", "train.attention=math"]  # SDPA with the boolean mask


def test_the_search_and_layout_auto_price_the_mask_which_can_change_the_fastest(capsys,
                                                                               tmp_path):
    """Under the mask SDPA (train.attention=math) still computes the dense causal work at
    cp 1 while the CP kernels skip what documents of 64 tokens leave out of s = 2048: causal,
    dp=2 is the fastest layout of 2 ranks; masked, cp=2. `--search --document-tokens 64`
    and layout=auto on a corpus of 64-token documents choose it, at the step `predict` gives
    it with those documents."""
    path = tmp_path / "p.json"
    save_profile(path, {**synthetic_profile(), "matmul_tflops": {"bf16": 10.0, "fp32": 10.0}})
    profile = load_profile_file(path)

    def best(mask):
        with pytest.raises(SystemExit) as done:
            plan_main(["--search", "--json", "--top", "1", "--world-size", "2", "--profile",
                       str(path), "--document-tokens", "64", *SMALL, *LONG,
                       f"train.attention_mask={mask}"])
        assert done.value.code == 0
        return json.loads(capsys.readouterr().out)["best"][0]
    causal, masked = best("causal"), best("document")
    assert "cp=1" in causal["overrides"] and "cp=2" in masked["overrides"]
    assert masked["prediction"]["step_s"] < causal["prediction"]["step_s"]
    assert masked["prediction"]["document_mask"]["source"] == "--document-tokens 64"
    *_, alone = _predict(LONG + DOCUMENT + masked["overrides"], fixed_length(64, 2048),
                         profile, world=2, batch=())
    assert alone.step_s == pytest.approx(masked["prediction"]["step_s"], rel=1e-12)
    data = _corpus(tmp_path / "data", 2048, 64, windows=8)
    chosen, auto = resolve_layout(load_config(SMALL + LONG + DOCUMENT + [f"data.dir={data}"]),
                                  2, profile, 8, {})
    assert chosen.cp == 2 and auto.prediction["document_mask"]["source"].endswith(str(data))
