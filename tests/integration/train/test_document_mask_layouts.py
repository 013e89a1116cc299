"""Document masking in parallel layouts equals the serial run with the same mask (rows of the
combination matrix, `megalite.testing.matrix`: losses, grad norms, the validation loss at
step 2 and final fp32 masters within 1e-5, through a checkpoint and a resume), on a corpus
of short documents (3-20 tokens, `megalite.testing.documents`: a 32-token window holds
several, so the mask, the restarted positions and the EOS targets left out of the loss all
act; the harness checks that the windows read hold boundaries). Each row runs
train.attention_mask=document with train.reset_positions=true and train.eos_loss=false;
together they cover TP with and without SP, the 1F1B and ZB-V pipeline schedules, ZeRO 3,
recompute and both families (the matrix of the suite holds the axis too, on the same corpus).

Context parallelism (configurations beside the rows, in their spawns, held to the same
serial run, and each must read a document crossing the cut between the CP ranks' chunks):
both `parallel.cp_comm` modes, both families with grouped-query attention, TP + SP and a
pipeline. A CP rank's chunks carry their documents' global ids and restarted
positions, and its loss divides its counted targets' cross-entropy by the step's count over
DP x CP, so the layouts equal the serial run although the ranks hold unequal counts."""
from __future__ import annotations

import pytest

from megalite.config.combinations import MATRIX_BASE, labels, row_config, row_of, serial_row
from megalite.config.schema import load_config
from megalite.testing.documents import document_failures
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


@pytest.fixture(scope="module")
def setup(short_document_data, tmp_path_factory):
    base = load_config([*MATRIX_BASE, f"data.dir={short_document_data}", "train.eval_every=2",
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
        differs += document_failures(ranks, cp=2)
        if differs:
            failures[f"cp=2 {comm} {labels(row)}"] = differs[:4]
    assert not failures, failures
