"""Document masking in parallel layouts equals the serial run with the same mask (rows of the
combination matrix, `megalite.testing.matrix`: losses, grad norms, the validation loss at
step 2 and final fp32 masters within 1e-5, through a checkpoint and a resume), on a corpus
of short documents (3-20 tokens: a 32-token window holds several, so the mask, the restarted
positions and the EOS targets left out of the loss all act). Each row runs
train.attention_mask=document with
train.reset_positions=true and train.eos_loss=false; together they cover TP with and without
SP, the 1F1B and ZB-V pipeline schedules, ZeRO 3, recompute and both families (the matrix of
the suite holds the axis too, on the stdlib corpus's long documents).

Context parallelism (no axis of the matrix: runs beside the rows, in their spawns, held to the
same serial run): both `parallel.cp_comm` modes, both families with grouped-query attention,
TP + SP and a pipeline. A CP rank's chunks carry their documents' global ids and restarted
positions, and its loss divides its counted targets' cross-entropy by the step's count over
DP x CP, so the layouts equal the serial run although the ranks hold unequal counts."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megalite.config.combinations import MATRIX_BASE, labels, row_config, row_of, serial_row
from megalite.config.schema import load_config
from megalite.data.token_arrays import write_token_arrays
from megalite.testing.matrix import TOLERANCES, check_ranks, check_row, run_rows, serial_runs

pytestmark = pytest.mark.distributed

DOCUMENT = {"attention mask": "document", "precision": "fp32"}
ROWS = {
    2: [row_of({**DOCUMENT, "family": "gpt2", "tp": "2", "sp": "on", "recompute": "all"}),
        row_of({**DOCUMENT, "family": "llama kv split", "pp": "2", "schedule": "zb-v",
                "head": "untied"})],
    4: [row_of({**DOCUMENT, "family": "llama kv replicated", "tp": "2", "dp": "2",
                "zero": "3", "recompute": "some layers", "head": "untied"}),
        row_of({**DOCUMENT, "family": "gpt2", "pp": "2", "schedule": "1f1b", "dp": "2",
                "zero": "3"})],
}

CP = {  # world -> [(row: the layout but CP, parallel.cp_comm)], run with cp=2
    2: [(row_of({**DOCUMENT, "family": "gpt2"}), "allgather"),
        (row_of({**DOCUMENT, "family": "llama kv split"}), "ring")],
    4: [(row_of({**DOCUMENT, "family": "gpt2", "tp": "2", "sp": "on"}), "ring"),
        (row_of({**DOCUMENT, "family": "llama kv replicated", "pp": "2", "schedule": "1f1b",
                 "head": "untied"}), "allgather")],
}


def _cp_config(base, row, comm):
    cfg = row_config(base, row)
    cfg.cp, cfg.parallel.cp_comm = 2, comm
    return cfg


def short_documents(out: Path, tokens: int = 40_000, vocab: int = 1024) -> Path:
    """A prepared-data directory of random documents of 3-20 tokens, each ended by EOS (0)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, size=tokens).astype(np.uint16)
    ids[np.cumsum(rng.integers(3, 21, size=tokens // 3))[:-1].clip(max=tokens - 1)] = 0
    split = int(tokens * 0.9)
    return write_token_arrays(out, {"train": [ids[:split]], "val": [ids[split:]]}, vocab, 0,
                              "synthetic short documents")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    data = short_documents(tmp_path_factory.mktemp("short-documents"))
    base = load_config([*MATRIX_BASE, f"data.dir={data}", "train.eval_every=2",
                        "train.eval_steps=1"])
    rows = [r for world in sorted(ROWS) for r in ROWS[world]]
    rows += [r for world in sorted(CP) for r, _ in CP[world]]
    serial = serial_runs(base, rows, tmp_path_factory.mktemp("document-serial"))
    return base, serial


@pytest.mark.parametrize("world", sorted(ROWS))
def test_document_masked_layouts_equal_the_serial_run(setup, tmp_path, world):
    base, serial = setup
    failures = {}
    cp_configs = [_cp_config(base, row, comm) for row, comm in CP[world]]
    results = run_rows(base, ROWS[world], tmp_path, configs=cp_configs)
    for row, ranks in zip(ROWS[world], results):
        assert labels(row)["attention mask"] == "document"
        differs = check_row(row, serial[serial_row(row)], ranks)
        if differs:
            failures[str(labels(row))] = differs[:4]
    for (row, comm), ranks in zip(CP[world], results[len(ROWS[world]):]):
        differs = check_ranks(serial[serial_row(row)], ranks, TOLERANCES["fp32", False])
        if differs:
            failures[f"cp=2 {comm} {labels(row)}"] = differs[:4]
    assert not failures, failures
