"""A key the schema lacks (Hydra's `+key=value`) is refused by name, with the nearest key."""
import pytest

from megalite.config.errors import ConfigError
from megalite.config.known_keys import known_keys
from megalite.config.schema import load_config


@pytest.mark.parametrize("override,nearest", [
    ("+train.max_step=30", "train.max_steps"),  # the typo a user made: it trained 300 steps
    ("+max_steps=30", "train.max_steps"),  # a section's key at the top level
    ("+model.n_layers=3", "model.n_layer"),
])
def test_a_key_the_schema_lacks_is_refused_naming_the_nearest(override, nearest):
    key, value = override.lstrip("+").split("=")
    with pytest.raises(ConfigError, match=f"^{key}={value}: megalite has no such key "
                                          f"\\(did you mean {nearest}\\?") as e:
        load_config([override])
    assert e.value.key == key


def test_every_key_of_the_presets_is_known():
    """No false refusal: the defaults and every model preset compose; the keys listed are the
    schema's leaves."""
    from megalite.config.schema import CONF_DIR

    for preset in sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")):
        load_config([f"model={preset}"])
    keys = known_keys(load_config([]))
    assert "train.max_steps" in keys and "parallel.cp_comm" in keys and "train" not in keys
