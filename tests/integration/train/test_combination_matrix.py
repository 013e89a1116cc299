"""The combination matrix of strength 2 (docs/combinations.md): every pair of values of two
feature axes that megalite does not refuse is in some run, and every value of every axis but
precision and FP8 in a run in fp32 without FP8 (`combination_search.matrix_rows`, seed 0: 29 runs of
1-8 ranks, 15 of them with cp 2 (8 all-gather, 7 ring) and 11 with the document mask, 5 with
both; 8 in fp32 without FP8; 14 of the Mixtral MoE family (aux loss, z-loss and bias on), 13
of them at ep 2 with either dispatcher, 6 of those with FP8; 14 in Megatron's rank order; the first one Llama
with its KV head replicated over tp=2 under optimizer offload), and each run trains through a
checkpoint and a resume on a
corpus of short documents and equals its serial run (`megalite.testing.matrix.check_row`:
losses, grad norms, final master weights; fp32 within 1e-5, bf16 and FP8 within the bounds
stated there; a document-masked run's windows hold document boundaries, and at cp 2 a document
crossing the cut between the CP ranks' chunks). The runs share spawns: one world per world
size, the serial runs made once each in one rank.
"""
from __future__ import annotations

import pytest

from megalite.config.combination_search import matrix_rows
from megalite.config.combinations import MATRIX_BASE, SUITE_SEED, labels, serial_row, world_size
from megalite.config.schema import load_config
from megalite.testing.matrix import check_row, run_rows, serial_runs

pytestmark = pytest.mark.distributed

STRENGTH, SEED = 2, SUITE_SEED


@pytest.fixture(scope="module")
def matrix(short_document_data):
    base = load_config([*MATRIX_BASE, f"data.dir={short_document_data}"])
    rows, _ = matrix_rows(base, STRENGTH, SEED)
    return base, rows


@pytest.fixture(scope="module")
def serial(matrix, tmp_path_factory):
    base, rows = matrix
    return serial_runs(base, rows, tmp_path_factory.mktemp("matrix-serial"))


WORLDS = (1, 2, 4, 8)  # the array's world sizes at SUITE_SEED


@pytest.mark.parametrize("world", WORLDS)
def test_every_run_of_the_strength_2_matrix_equals_its_serial_run(matrix, serial, tmp_path,
                                                                   world):
    base, rows = matrix
    assert {world_size(r) for r in rows} == set(WORLDS)
    mine = [r for r in rows if world_size(r) == world]
    assert mine, f"no run of {world} ranks in the array"
    failures = {}
    for row, ranks in zip(mine, run_rows(base, mine, tmp_path)):
        differs = check_row(row, serial[serial_row(row)], ranks)
        if differs:
            failures[str(labels(row))] = differs[:4]
    assert not failures, failures
