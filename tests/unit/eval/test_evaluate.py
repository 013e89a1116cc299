"""megalite-evaluate where the task's data cannot be fetched (no network: the Hub probe and
`datasets.load_dataset` are patched): offline mode when the Hub does not answer, and one line
naming the task and its dataset instead of a minute of retries and a traceback. The command on
a real checkpoint with a local task is tests/integration/checkpoint/test_export.py's."""
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from megalite.eval import lm_harness

EVAL_EXTRA = "the eval extra: pip install -e '.[dev,eval]'"
TOKENIZER = Path(__file__).resolve().parents[2] / "fixtures" / "data_v1" / "tokenizer"

# a task of the caller's own whose data is a Hub dataset (as lm-eval's hellaswag is Rowan/hellaswag)
REMOTE_TASK = """task: remote_mc
dataset_path: someone/remote_mc
dataset_name: main
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{endings}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


def unset_offline(monkeypatch):
    """HF_HUB_OFFLINE and HF_DATASETS_OFFLINE unset, and as they were after the test (set and
    then deleted through monkeypatch, which restores what it deletes)."""
    for name in lm_harness.OFFLINE_VARIABLES:
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)


def test_an_unreachable_hub_turns_offline_mode_on_unless_the_caller_chose(monkeypatch):
    def no_network(request, timeout):
        raise urllib.error.URLError(OSError(-2, "Name or service not known"))

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    unset_offline(monkeypatch)
    assert lm_harness.hub_unreachable().startswith("https://huggingface.co: ")
    reason = lm_harness.offline_if_unreachable()
    assert "Name or service not known" in reason
    assert [os.environ[n] for n in lm_harness.OFFLINE_VARIABLES] == ["1", "1"]

    unset_offline(monkeypatch)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # the caller's choice: no probe, no change
    assert lm_harness.offline_if_unreachable() is None
    assert "HF_HUB_OFFLINE" not in os.environ

    def answers(request, timeout):  # any HTTP status is an answer
        raise urllib.error.HTTPError(request.full_url, 405, "Method Not Allowed", {}, None)

    monkeypatch.setattr(urllib.request, "urlopen", answers)
    unset_offline(monkeypatch)
    assert lm_harness.hub_unreachable() is None
    assert lm_harness.offline_if_unreachable() is None
    assert not any(n in os.environ for n in lm_harness.OFFLINE_VARIABLES)


@pytest.fixture
def tiny_hf_model(tmp_path):
    """A 1-layer GPT-2 in transformers' format with the committed fixture tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    out = tmp_path / "hf"
    config = GPT2Config(vocab_size=285, n_positions=64, n_embd=16, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(out)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.mark.slow  # imports lm-eval and builds its hf model
def test_a_task_whose_data_cannot_be_fetched_is_one_line_naming_it(tiny_hf_model, tmp_path,
                                                                   monkeypatch, capsys):
    pytest.importorskip("lm_eval", reason=f"lm-eval comes with {EVAL_EXTRA}")
    pytest.importorskip("accelerate", reason=f"accelerate comes with {EVAL_EXTRA}")
    import datasets

    from megalite.cli import evaluate

    unset_offline(monkeypatch)
    monkeypatch.setattr(lm_harness, "hub_unreachable",
                        lambda: "https://huggingface.co: [Errno -2] Name or service not known")
    calls = []

    def load_dataset(path, name=None, **kwargs):  # as datasets fails offline without a cache
        calls.append((path, name, {n: os.environ.get(n)
                                   for n in lm_harness.OFFLINE_VARIABLES}))
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "remote_mc.yaml").write_text(REMOTE_TASK)
    with pytest.raises(SystemExit) as exit_:
        evaluate.main([str(tiny_hf_model), "--tasks", "remote_mc", "--include-path", str(tasks),
                       "--device", "cpu"])
    assert exit_.value.code == 2
    # tried once, offline (no minute of retries)
    assert calls == [("someone/remote_mc", "main",
                      {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})]
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if "megalite" in line]
    assert len(ours) == 1 and "Traceback" not in err, err
    (line,) = ours
    assert line.startswith("megalite: cannot evaluate: task remote_mc: its data, the dataset "
                           "someone/remote_mc (main), could not be fetched (ConnectionError: "
                           "Couldn't reach 'someone/remote_mc' on the Hub"), line
    assert "the Hub did not answer (https://huggingface.co: [Errno -2]" in line
    assert "--include-path DIR" in line and "HF_DATASETS_OFFLINE=1" in line


def test_a_failure_elsewhere_is_not_taken_for_the_data():
    pytest.importorskip("lm_eval", reason=f"lm-eval comes with {EVAL_EXTRA}")
    try:
        raise ConnectionError("not in a task's download")
    except ConnectionError as e:
        assert lm_harness.failed_task_data(e) is None
