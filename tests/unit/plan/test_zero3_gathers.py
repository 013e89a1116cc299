"""ZeRO-3's gathers a step by the schedule walk (`megalite.plan.zero3_gathers`), against counts
worked out by hand from `megalite.parallel.zero3`'s rules."""
from __future__ import annotations

from megalite.plan.zero3_gathers import unit_gathers

# GPT-2 at pp 1: wte, wpe, two blocks, ln_f, and the head that is wte (one unit)
TIED = ((0, True), (1, False), (2, True), (3, True), (4, False), (0, True))
# a stage of three blocks (no ends), and a last stage: two blocks, ln_f, its own head
MIDDLE = ((0, True), (1, True), (2, True))
LAST = ((0, True), (1, True), (2, False), (3, True))


def test_pp1_keeps_the_embedding_from_each_backward_into_the_next_forward():
    """Each unit twice a micro-batch (wte: the embedding's and the head's forward, kept into
    the backward), but the embedding the backward ends with is the next forward's first:
    m - 1 gathers fewer; without resharding each unit once."""
    m = 4
    assert unit_gathers(1, 0, m, 1, "auto", (TIED,), True) == (2 * m - (m - 1), *[2 * m] * 4)
    assert unit_gathers(1, 0, m, 1, "auto", (TIED,), False) == (1,) * 5


def test_1f1b_two_stages():
    """Stage 0, F0 F1 B0 F2 B1 F3 B2 B3: F0 holds unit 0 for F1 and keeps its last unit (2)
    into F1 and B0; each B holds unit 0 for the next F, B2 unit 2 for B3 (gathered again):
    unit 0 gathered in F0 twice, then in B0..B3 (F2, F3 find it held); unit 2 in F0, F2, F3
    and B2. Stage 1, F B F B ...: the last unit kept from each F into its B, the first from
    each B into the next F."""
    m = 4
    assert unit_gathers(2, 0, m, 1, "auto", (MIDDLE,), True) == (2 + m, 2 * m, m)
    assert unit_gathers(2, 1, m, 1, "auto", (LAST,), True) == (m + 1, 2 * m, 2 * m, m)


def test_interleaved_and_zb_h1_gather_no_more_than_two_a_micro_batch():
    """Interleaved (v = 2) and ZB-H1: every unit at most twice per micro-batch and chunk, and
    under ZB-H1 a unit whose W comes after the next forward stays gathered through it."""
    m = 4
    counts = unit_gathers(2, 0, m, 2, "interleaved", (MIDDLE, ((3, True), (4, True))), True)
    assert all(0 < n <= 2 * m for n in counts) and sum(counts) < 2 * m * len(counts)
    zb = unit_gathers(2, 1, m, 1, "zb-h1", (LAST,), True)
    one = unit_gathers(2, 1, m, 1, "1f1b", (LAST,), True)
    assert all(a <= b for a, b in zip(zb, one)) and zb[2] == one[2]  # ln_f: reported in B
