"""checkpoint.dir that cannot be written is refused before launch, in one line."""
import os
from pathlib import Path

import pytest

from megalite.checkpoint.writable import check_writable_dir
from megalite.config.errors import ConfigError
from megalite.config.schema import load_config
from megalite.train.preflight import preflight
from tests.conftest import TINY


def test_a_directory_under_a_file_or_unmakeable_is_refused(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("x")
    with pytest.raises(ConfigError, match="^checkpoint.dir='.*a-file/ckpt' is under "
                                          "'.*a-file', which is not a directory"):
        check_writable_dir(file / "ckpt", "checkpoint.dir")
    with pytest.raises(ConfigError, match="a-file' is not a directory"):
        check_writable_dir(file, "checkpoint.dir")
    if os.path.isdir("/proc/self"):  # a directory no one can make anything in
        with pytest.raises(ConfigError, match="^checkpoint.dir='/proc/megalite/ckpt' cannot "
                                              "be written: no directory can be made in /proc"):
            check_writable_dir(Path("/proc/megalite/ckpt"), "checkpoint.dir")
    check_writable_dir(tmp_path / "new" / "ckpt", "checkpoint.dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # the probe left nothing


def test_preflight_refuses_it_before_the_first_step(tiny_data, tmp_path):
    (tmp_path / "a-file").write_text("x")
    cfg = load_config(TINY + [f"data.dir={tiny_data}",
                              f"checkpoint.dir={tmp_path / 'a-file' / 'ckpt'}"])
    with pytest.raises(ConfigError, match="checkpoint.dir=.*not a directory"):
        preflight(cfg, 1)
