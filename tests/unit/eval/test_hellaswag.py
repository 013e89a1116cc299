"""HellaSwag during training (eval.hellaswag): the scores against a direct `transformers`
computation on the same weights, the metrics they produce, and bad input refused before launch.
The same scores under tp2 pp2 dp2 zero3 (with SP, with virtual stages): tests/*/*/test_plan.py,
whose 8-rank launch they share."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F

from megalite.checkpoint.export import export_hf
from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.train.build import build_trainer
from megalite.train.metrics import wandb_row
from megalite.train.preflight import preflight
from megalite.train.runtime import init_runtime
from tests.conftest import TINY
from tests.layouts import FP32_NO_DROPOUT

# Made-up examples (the tiny corpus's tokenizer knows Python best); the last context is long
# enough to be cut at train.seq_len=32.
CONTEXTS = ["def add(a, b):\n    return", "for i in range(10):\n   ", "import os\npath = os.path.",
            "class Point:\n    def __init__(self, x, y):\n        self.x =",
            "with open(name) as f:\n    data =", "if x is None:\n   ", "try:\n    run()\nexcept",
            "# The quick brown fox jumps over the lazy dog while the cat sleeps on the warm "
            "windowsill and the bird sings in the old oak tree\nresult ="]
ENDINGS = [["a + b", "a - b", "print(a)", "import sys"],
           ["print(i)", "return", "x = [", "pass"],
           ["join(a, b)", "sep", "exists(path)", "x"],
           ["x", "y", "self", "None"],
           ["f.read()", "1", "[]", "open"],
           ["x = 0", "return None", "raise ValueError('no x given')", "continue"],
           ["ValueError:\n        pass", "Exception as e:", ":", "KeyError"],
           ["42", "the end of a very long ending that goes on", "None", "fox"]]
LABELS = [0, 0, 2, 0, 0, 1, 1, 0]


def write_hellaswag(path: Path, records=None) -> Path:
    """A HellaSwag jsonl file (official field names, plus one the reader ignores)."""
    records = records if records is not None else [
        {"ind": i, "ctx": c, "endings": e, "label": label, "activity_label": "code"}
        for i, (c, e, label) in enumerate(zip(CONTEXTS, ENDINGS, LABELS))]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def random_weights(tiny_data, root: Path, n_layer: int = 2) -> Path:
    """A step-0 megalite checkpoint of the TINY shape with every parameter random (biases and
    LayerNorms too), written by a serial trainer in this process: `init_from` loads it in
    every layout without the ranks importing transformers."""
    trainer = serial_trainer(tiny_data, root / f"random{n_layer}", f"model.n_layer={n_layer}")
    g = torch.Generator().manual_seed(n_layer)
    with torch.no_grad():  # on CPU in fp32 the parameters are the master weights a save writes
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return trainer.save()


def hellaswag_overrides(tmp: Path, tiny_data, n_layer: int = 2, examples: int = 7
                        ) -> List[str]:
    """init_from random weights, the made-up HellaSwag file, its first `examples`."""
    weights = tmp / f"random{n_layer}" / "checkpoints" / "step_00000000"
    if not weights.exists():
        assert random_weights(tiny_data, tmp, n_layer) == weights
    data = tmp / "hellaswag.jsonl"
    if not data.exists():
        write_hellaswag(data)
    return [f"init_from={weights}", f"eval.hellaswag={data}",
            f"eval.hellaswag_examples={examples}", "train.eval_every=1000"]


def transformers_scores(checkpoint: Path, examples: int, seq_len: int
                        ) -> Tuple[torch.Tensor, torch.Tensor, float, float]:
    """Per-ending summed losses and token counts, acc and acc_norm computed directly: the
    checkpoint exported to `transformers` (megalite's HF export), each context + ending
    unpadded through the family's transformers model (GPT2LMHeadModel, LlamaForCausalLM), cut
    to its last seq_len + 1 tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = checkpoint.parent.parent / "hf"
    if not exported.exists():
        export_hf(checkpoint, exported)
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    tok = AutoTokenizer.from_pretrained(exported)
    losses, counts = [], []
    for ctx, endings in zip(CONTEXTS[:examples], ENDINGS[:examples]):
        ctx_ids = tok.encode(ctx, add_special_tokens=False)
        for ending in endings:
            end_ids = tok.encode(" " + ending, add_special_tokens=False)
            ids = torch.tensor((ctx_ids + end_ids)[-(seq_len + 1):])
            n = min(len(end_ids), len(ids) - 1)
            with torch.no_grad():
                logits = model(ids[None]).logits[0, :-1]
            per_token = F.cross_entropy(logits, ids[1:], reduction="none")
            losses.append(per_token[-n:].double().sum().item())
            counts.append(n)
    losses = torch.tensor(losses, dtype=torch.float64).view(-1, 4)
    counts = torch.tensor(counts).view(-1, 4)
    labels = torch.tensor(LABELS[:examples])
    acc = (losses.argmin(1) == labels).double().mean().item()
    acc_norm = ((losses / counts).argmin(1) == labels).double().mean().item()
    return losses, counts, acc, acc_norm


def assert_scores(scores, reference) -> None:
    losses, counts, acc, acc_norm = reference
    assert torch.equal(scores.counts, counts)
    torch.testing.assert_close(scores.losses, losses, rtol=1e-5, atol=1e-5)
    assert (scores.acc, scores.acc_norm) == (acc, acc_norm)


def serial_trainer(tiny_data, run_dir, *overrides):
    cfg = load_config(TINY + FP32_NO_DROPOUT + [f"data.dir={tiny_data}", "log.peak_tflops=1",
                                                *overrides])
    validate(cfg, 1)
    return build_trainer(cfg, init_runtime(cfg), run_dir)


def test_scores_equal_transformers_and_reach_the_metrics(tiny_data, tmp_path):
    """Serially, 7 examples in micro-batches of 8 endings (the last one padded): per-ending
    losses, counts, acc and acc_norm equal GPT2LMHeadModel's on the same weights; a context
    longer than seq_len is cut and counted; fit() logs the scores to metrics.jsonl and wandb's
    val/ keys."""
    overrides = hellaswag_overrides(tmp_path, tiny_data)
    checkpoint = Path(overrides[0].split("=", 1)[1])
    trainer = serial_trainer(tiny_data, tmp_path / "run", *overrides, "train.micro_batch_size=8",
                             "train.max_steps=1", "train.eval_every=1")
    scores = trainer.evaluate_hellaswag()
    assert_scores(scores, transformers_scores(checkpoint, 7, seq_len=32))
    assert trainer.hellaswag.choices.truncated == 0  # the long context is the 8th example
    assert not torch.equal(scores.losses.argmin(1), (scores.losses / scores.counts).argmin(1))

    long = serial_trainer(tiny_data, tmp_path / "long",
                          *hellaswag_overrides(tmp_path, tiny_data, examples=8))
    assert long.hellaswag.choices.truncated == 4  # every ending of the long context
    assert_scores(long.evaluate_hellaswag(), transformers_scores(checkpoint, 8, seq_len=32))

    records = trainer.fit()
    assert set(records[-1]) >= {"hellaswag_acc", "hellaswag_acc_norm"}
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert lines[0]["run"]["hellaswag"]["examples"] == 7
    assert lines[-1]["hellaswag_acc"] == records[-1]["hellaswag_acc"]
    row = wandb_row(records[-1])
    assert row["val/hellaswag_acc"] == records[-1]["hellaswag_acc"]
    assert row["val/hellaswag_acc_norm"] == records[-1]["hellaswag_acc_norm"]


def _check(tiny_data, *overrides):
    cfg = load_config(TINY + [f"data.dir={tiny_data}", *overrides])
    preflight(cfg, 1)


def _bad_file(tmp_path, mutate) -> Path:
    records = [{"ctx": c, "endings": list(e), "label": label}
               for c, e, label in zip(CONTEXTS, ENDINGS, LABELS)]
    mutate(records)
    return write_hellaswag(tmp_path / "bad.jsonl", records)


@pytest.mark.parametrize("mutate,expected", [
    (lambda r: r[2].pop("endings"), ["line 3", "'endings'", "ctx, endings, label"]),
    (lambda r: r[4].update(label=4), ["line 5", "'label'", "0 to 3", "4"]),
    (lambda r: r[1].update(label="x"), ["line 2", "'label'", "'x'"]),
    (lambda r: r[0].update(endings=["a", "b", "c"]), ["line 1", "'endings'", "4 non-empty"]),
    (lambda r: r[6].update(ctx=""), ["line 7", "'ctx'"]),
], ids=["missing-endings", "label-out-of-range", "label-not-a-number", "three-endings",
        "empty-ctx"])
def test_bad_hellaswag_file_is_refused_naming_line_and_field(tiny_data, tmp_path, mutate,
                                                             expected):
    path = _bad_file(tmp_path, mutate)
    with pytest.raises(ConfigError) as e:
        _check(tiny_data, f"eval.hellaswag={path}")
    assert str(path) in str(e.value)
    for part in expected:
        assert part in str(e.value)


def test_bad_hellaswag_settings_are_refused_before_launch(tiny_data, tmp_path):
    good = write_hellaswag(tmp_path / "ok.jsonl")
    _check(tiny_data, f"eval.hellaswag={good}")  # accepted, also with the label as a string
    _check(tiny_data, f"eval.hellaswag={_bad_file(tmp_path, lambda r: r[0].update(label='2'))}")
    cases = [
        ([f"eval.hellaswag={good}", "train.eval_every=0"], ["eval.hellaswag=", "eval_every"]),
        ([f"eval.hellaswag={tmp_path / 'nope.jsonl'}"], ["no such file", "hellaswag_val.jsonl"]),
        ([f"eval.hellaswag={good}", "eval.hellaswag_examples=9"],
         ["eval.hellaswag_examples=9", "only 8"]),
        ([f"eval.hellaswag={good}", "eval.hellaswag_examples=0"], ["eval.hellaswag_examples=0"]),
    ]
    as_array = tmp_path / "array.json"  # a .json file may hold one array of examples
    as_array.write_text(json.dumps([json.loads(line) for line in good.open()][:3]))
    _check(tiny_data, f"eval.hellaswag={as_array}", "eval.hellaswag_examples=3")
    cases.append(([f"eval.hellaswag={tmp_path}"], ["is a directory"]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"ctx": c, "endings": e, "label": str(label)}  # the hub's parquet: label a string
            for c, e, label in zip(CONTEXTS, ENDINGS, LABELS)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ok.parquet")
    _check(tiny_data, f"eval.hellaswag={tmp_path / 'ok.parquet'}")
    rows[3]["label"] = "7"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    cases.append(([f"eval.hellaswag={tmp_path / 'bad.parquet'}"], ["row 3", "'label'", "'7'"]))
    (tmp_path / "notjson.jsonl").write_text('{"ctx": "a"\n')
    cases.append(([f"eval.hellaswag={tmp_path / 'notjson.jsonl'}"], ["line 1", "not JSON"]))
    for overrides, expected in cases:
        with pytest.raises(ConfigError) as e:
            _check(tiny_data, *overrides)
        for part in expected:
            assert part in str(e.value), (overrides, str(e.value))
