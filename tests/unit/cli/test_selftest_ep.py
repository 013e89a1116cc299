"""The EP exchange check's group size (megalite/train/selftest_ep.py)."""
from __future__ import annotations

from megalite.train import selftest_ep


def test_the_ep_size_stays_inside_a_node_up_to_8():
    assert selftest_ep.ep_size(16, 8) == 8 and selftest_ep.ep_size(64, 16) == 8
    assert selftest_ep.ep_size(12, 4) == 4 and selftest_ep.ep_size(6, 6) == 2
    assert selftest_ep.ep_size(3, 3) == 1 and selftest_ep.ep_size(4, 1) == 4
