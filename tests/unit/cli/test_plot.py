"""scripts/plot.py (megalite-plot) on synthetic metrics.jsonl files, and reading a run's records
back (megalite.train.metrics_file): a resumed launch replaces the steps after its start."""
import json
import struct

import pytest

from megalite.cli import plot
from megalite.train.metrics_file import MetricsFileError, metric, run_records

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, segments):
    """metrics.jsonl of launches [(start_step, [step, ...]), ...]; the values are functions of
    the step and the launch, so a record from the wrong launch shows."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for launch, (start, steps) in enumerate(segments):
        lines.append({"run": {"start_step": start, "tokens_per_step": 512}})
        for step in steps:
            lines.append({"step": step, "loss": 10.0 - step / 10 + launch,
                          "val_loss": 11.0 - step / 10 if step % 20 == 0 else None,
                          "tokens_per_s": 1000.0 + step, "mfu": 0.3 + 0.01 * launch,
                          "consumed_tokens": 512 * step})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def png_size(path):
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, data[:8]
    return struct.unpack(">II", data[16:24])


def test_a_resumed_launch_replaces_the_steps_after_its_start(tmp_path):
    write_metrics(tmp_path / "run", [(0, [10, 20, 30]), (20, [30, 40])])
    header, records = run_records(tmp_path / "run")
    assert header["start_step"] == 20
    assert [(r["step"], r["loss"]) for r in records] == [(10, 9.0), (20, 8.0), (30, 8.0),
                                                         (40, 7.0)]
    write_metrics(tmp_path / "fresh", [(0, [10, 20]), (0, [10])])  # a new run, same directory
    assert [r["loss"] for r in run_records(tmp_path / "fresh")[1]] == [10.0]


def test_metric_names_written_either_way_are_found():
    assert metric({"val/hellaswag_acc": 0.3}, "hellaswag_acc") == 0.3
    assert metric({"hellaswag_acc": 0.25}, "hellaswag_acc") == 0.25
    assert metric({"val_loss": None, "val/loss": 2.0}, "val_loss") == 2.0
    assert metric({"loss": 1.0}, "hellaswag_acc") is None


@pytest.mark.slow
def test_two_runs_plot_into_a_png_with_a_hellaswag_panel_only_when_logged(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib comes with the eval extra "
                        "(pip install -e '.[dev,eval]')")
    write_metrics(tmp_path / "a" / "run", [(0, [10, 20, 30])])
    write_metrics(tmp_path / "b" / "run", [(0, [10, 20]), (10, [20, 30])])
    out = tmp_path / "plots" / "runs.png"
    plot.main([str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run"), "--out", str(out)])
    assert "wrote" in capsys.readouterr().out
    assert out.stat().st_size > 10_000
    four_panels = png_size(out)
    assert four_panels == (1200, 720)  # 2 x 2 panels: loss, val loss, tokens/s, MFU
    assert sorted(p.name for p in out.parent.iterdir()) == ["runs.png"]  # no temporary left

    with_hellaswag = tmp_path / "c"
    write_metrics(with_hellaswag, [(0, [10, 20])])
    lines = (with_hellaswag / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[-1])
    record.update({"step": 30, "val/hellaswag_acc": 0.26, "val/hellaswag_acc_norm": 0.27})
    (with_hellaswag / "metrics.jsonl").write_text("\n".join(lines + [json.dumps(record)]) + "\n")
    plot.main([str(with_hellaswag)])  # one run: <run dir>/metrics.png
    assert png_size(with_hellaswag / "metrics.png") == (1200, 1080)  # a fifth panel, 3 rows
    assert plot.labels([tmp_path / "a" / "run", tmp_path / "b" / "run", with_hellaswag]) == \
        ["a/run", "b/run", "c"]


def test_a_directory_without_metrics_is_refused_naming_it(tmp_path, capsys):
    (tmp_path / "not_a_run").mkdir()
    write_metrics(tmp_path / "run", [(0, [10])])
    with pytest.raises(SystemExit) as exit_:
        plot.main([str(tmp_path / "run"), str(tmp_path / "not_a_run"), "--out",
                   str(tmp_path / "x.png")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'not_a_run'}: no metrics.jsonl" in err, err
    assert not (tmp_path / "x.png").exists()
    write_metrics(tmp_path / "empty", [(0, [])])
    with pytest.raises(MetricsFileError, match="no metric lines yet"):
        plot.read_runs([tmp_path / "empty"])


def test_an_moe_run_gets_an_expert_load_panel_of_its_worst_layer(tmp_path):
    """metric("moe_imbalance"): the largest over the MoE layers, from metrics.jsonl's nested
    figures or wandb's flat keys; the plot draws it as a panel of its own."""
    record = {"moe": {"0": {"imbalance": 1.5, "dropped": 0.0},
                      "1": {"imbalance": 2.5, "dropped": 0.1}, "aux_hf": 2.0}}
    assert metric(record, "moe_imbalance") == 2.5 and metric(record, "moe_dropped") == 0.1
    assert metric({"moe/0/imbalance": 1.2, "moe/3/imbalance": 1.7}, "moe_imbalance") == 1.7
    assert metric({"loss": 1.0}, "moe_imbalance") is None
    pytest.importorskip("matplotlib", reason="matplotlib comes with the eval extra "
                        "(pip install -e '.[dev,eval]')")
    write_metrics(tmp_path, [(0, [10, 20])])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for x in lines[1:]:
        x["moe"] = record["moe"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    plot.main([str(tmp_path)])
    assert png_size(tmp_path / "metrics.png") == (1200, 1080)  # a fifth panel, 3 rows
