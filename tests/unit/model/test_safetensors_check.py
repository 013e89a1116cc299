"""init_from a damaged or missing directory: one line naming the file and what is wrong,
before any process group (safetensors headers read only); a loaded one is logged."""
import logging

import pytest
import torch.distributed as dist

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import load_config
from megalite.train.build import build_trainer
from megalite.train.init_from import check_init_from
from megalite.train.runtime import init_runtime
from tests.conftest import TINY, random_hf_gpt2


@pytest.fixture
def hf_dir(tmp_path):
    model = load_config(TINY).model
    random_hf_gpt2(model).save_pretrained(tmp_path / "hf", safe_serialization=True)
    return tmp_path / "hf", model


def test_a_damaged_safetensors_file_is_named_before_launch(hf_dir):
    path, model = hf_dir
    check_init_from(str(path), model)
    weights = path / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:len(whole) - 1000])  # a truncated download
    with pytest.raises(ConfigError, match=f"^init_from='{path}': {weights} is damaged: "
                                          "truncated: tensor .* ends at byte"):
        check_init_from(str(path), model)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + whole[24:])
    with pytest.raises(ConfigError, match="is damaged: its header is not JSON"):
        check_init_from(str(path), model)
    weights.write_bytes(b"<html>404</html>")  # a page saved in place of the file
    with pytest.raises(ConfigError, match="is damaged: a header of .* bytes announced in a "
                                          "file of 16 bytes"):
        check_init_from(str(path), model)
    assert not dist.is_initialized()


def test_a_missing_path_says_it_does_not_exist(tmp_path):
    model = load_config(TINY).model
    for source in (str(tmp_path / "nowhere"), "./nowhere"):
        with pytest.raises(ConfigError, match=f"^init_from='{source}': no such file or "
                                              "directory"):
            check_init_from(source, model)


def test_the_weights_loaded_are_logged(hf_dir, tiny_data, tmp_path, caplog):
    path, _ = hf_dir
    cfg = load_config(TINY + [f"data.dir={tiny_data}", f"init_from={path}", "precision=fp32"])
    validate(cfg, 1)
    with caplog.at_level(logging.INFO, logger="megalite"):
        build_trainer(cfg, init_runtime(cfg), tmp_path / "run")
    assert f"init_from='{path}': the model starts from its weights (" in caplog.text
