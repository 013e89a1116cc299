"""precision=bf16 on a CPU says at start-up what it costs here, measured."""
import re

from megalite.config.schema import load_config
from megalite.train.preflight import preflight
from tests.conftest import TINY


def test_bf16_on_a_cpu_says_its_measured_cost_once(tiny_data):
    _, warnings = preflight(load_config(TINY + [f"data.dir={tiny_data}", "precision=bf16"]), 1)
    notes = [w for w in warnings if w.startswith("precision=bf16 on a CPU")]
    assert len(notes) == 1, warnings
    assert re.search(r"a 256x256 matmul here takes .* \(\d+\.\d\d ms against \d+\.\d\d ms\)",
                     notes[0]), notes[0]
    _, warnings = preflight(load_config(TINY + [f"data.dir={tiny_data}", "precision=fp32"]), 1)
    assert not [w for w in warnings if "on a CPU" in w], warnings
