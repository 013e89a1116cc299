"""Checkpoints as models: scripts/export_hf.py and scripts/generate.py on the checkpoints of the
same steps trained serially and with tp=2 pp=2 (4 gloo ranks under torchrun)."""
import contextlib
import io
import json
import re
import runpy
import subprocess
import sys
import tempfile

import pytest
import torch
from safetensors.torch import load_file

from megalite.checkpoint.export import ExportError, export_hf, load_model, model_config
from megalite.data.loader import TokenShards, val_batches
from megalite.eval.lm_harness import OFFLINE_VARIABLES
from megalite.model.families import num_parameters
from megalite.model.gpt2.hf import hf_config
from tests.integration.cli.test_pretrain import REPO, pretrain, read_metrics

STEPS = 4
COMMON = ["precision=fp32", "model.resid_pdrop=0", "model.embd_pdrop=0", "model.attn_pdrop=0",
          f"train.max_steps={STEPS}", f"train.eval_every={STEPS}", "log.wandb=false",
          "log.peak_tflops=1"]  # no CPU matmul peak measurement (test_pretrain.py has one)
PROMPT = "def main("


def checkpoint(run):
    return run / "checkpoints" / f"step_{STEPS:08d}"


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Run directories of the serial and the tp=2 pp=2 run, each checkpointed at the end."""
    root = tmp_path_factory.mktemp("runs")
    pretrain(root / "serial", f"data.dir={tiny_data}", *COMMON)
    pretrain(root / "tp2pp2", f"data.dir={tiny_data}", *COMMON, "tp=2", "pp=2", nproc=4)
    return root


@pytest.fixture(scope="module")
def exported(runs):
    """transformers directories: tp2pp2 exported by the script, serial by export_hf."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"),
                           str(checkpoint(runs / "tp2pp2")), str(runs / "hf_tp2pp2")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    export_hf(runs / "serial" / "checkpoints", runs / "hf_serial")  # its latest checkpoint
    return {"tp2pp2": runs / "hf_tp2pp2", "serial": runs / "hf_serial"}


def run_script(name, *args):
    """scripts/<name> in this process (saves the interpreter start): (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    argv, sys.argv = sys.argv, [name, *map(str, args)]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(REPO / "scripts" / name), run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


@pytest.mark.distributed
def test_export_loads_in_transformers_with_the_runs_validation_loss(runs, exported, tiny_data):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    out, ckpt = exported["tp2pp2"], checkpoint(runs / "tp2pp2")
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    cfg = model_config(ckpt)
    params = sum(p.numel() for p in hf.parameters())
    assert params == GPT2LMHeadModel(hf_config(cfg)).num_parameters() == num_parameters(cfg)

    _, records = read_metrics(runs / "tp2pp2")
    run_val = records[-1]["val_loss"]
    batches = val_batches([TokenShards(tiny_data, "val")], micro_batch_size=4, seq_len=32,
                          eval_steps=2, global_batch_size=16, dp_rank=0, dp_size=1,
                          device=torch.device("cpu"))
    serial = load_model(ckpt)
    with torch.no_grad():
        windows = [torch.cat([x, y[:, -1:]], dim=1) for x, y in batches]
        hf_val = sum(hf(w, labels=w).loss.item() for w in windows) / len(windows)
        ours_val = sum(serial(x, y).item() for x, y in batches) / len(batches)
    assert hf_val == pytest.approx(run_val, rel=1e-5)
    assert ours_val == pytest.approx(run_val, rel=1e-5)

    tok = AutoTokenizer.from_pretrained(out)
    data_tok = AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    assert len(tok) == len(data_tok) == cfg.vocab_size
    assert tok.encode(PROMPT) == data_tok.encode(PROMPT)
    assert hf.config.eos_token_id == hf.generation_config.eos_token_id == tok.eos_token_id
    assert tok.model_max_length == cfg.n_positions  # truncation=True fits the model's context
    long = tok("x = 1\n" * 200, truncation=True)["input_ids"]
    assert len(long) == cfg.n_positions


@pytest.mark.distributed
def test_exports_of_different_layouts_agree(exported):
    parallel = load_file(exported["tp2pp2"] / "model.safetensors")
    serial = load_file(exported["serial"] / "model.safetensors")
    assert parallel.keys() == serial.keys()
    for name in serial:
        assert (parallel[name] - serial[name]).abs().max().item() <= 1e-5, name


@pytest.mark.distributed
def test_export_streams_shards_in_parts_that_transformers_loads(runs, exported, tmp_path):
    """Shards of at most 150 kB written by two parts (`--part 1/2` then `0/2`, as two processes
    would): named and indexed as transformers writes them, complete only when the last part is
    done, and the model transformers loads from them is bitwise the one-file export's."""
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    out, limit = runs / "hf_sharded", 150_000
    for part in ("1/2", "0/2"):
        assert not (out / "model.safetensors.index.json").exists()  # incomplete until the last
        code, _, err = run_script("export_hf.py", checkpoint(runs / "tp2pp2"), out,
                                  "--max-shard-size", "150KB", "--part", part)
        assert code == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert shards == [f"model-{j:05d}-of-{len(shards):05d}.safetensors"
                      for j in range(1, len(shards) + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    total = 0
    for name in shards:
        with safe_open(out / name, "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
        nbytes = sum(4 * torch.Size(s).numel() for s in sizes)
        assert nbytes <= limit or len(sizes) == 1  # a tensor over the limit is a shard alone
        total += nbytes
    assert index["metadata"]["total_size"] == total
    sharded = GPT2LMHeadModel.from_pretrained(out).state_dict()
    single = GPT2LMHeadModel.from_pretrained(exported["tp2pp2"]).state_dict()
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


@pytest.mark.distributed
def test_export_refuses_to_overwrite_unless_forced(runs, tmp_path):
    ckpt = checkpoint(runs / "serial")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=re.escape(f"{out}: exists and is not empty")):
        export_hf(ckpt, out)
    assert (out / "notes.txt").is_file()
    with pytest.raises(ExportError, match="contains"):
        export_hf(ckpt, runs / "serial", force=True)  # would delete the checkpoint itself
    export_hf(ckpt, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left


@pytest.mark.distributed
def test_export_bad_paths_are_named(runs, tmp_path):
    code, _, err = run_script("export_hf.py", tmp_path / "nowhere", tmp_path / "out")
    assert code == 2 and f"{tmp_path / 'nowhere'}: does not exist" in err, err
    missing = tmp_path / "no_tokenizer"
    code, _, err = run_script("export_hf.py", checkpoint(runs / "serial"), tmp_path / "out",
                              "--tokenizer", missing)
    assert code == 2 and f"no tokenizer at {missing}" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_generate_is_seeded_and_greedy_equals_transformers_argmax(runs, exported):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    ckpt = checkpoint(runs / "tp2pp2")
    sampled = [run_script("generate.py", ckpt, "--prompt", PROMPT, "--max-new-tokens", 12,
                          "--seed", seed, "--top-k", 50) for seed in (7, 7, 8)]
    assert all(code == 0 for code, _, _ in sampled), sampled
    assert sampled[0][1] == sampled[1][1] and sampled[0][1].startswith(PROMPT)
    assert sampled[0][1] != sampled[2][1]

    code, greedy, err = run_script("generate.py", ckpt, "--prompt", PROMPT, "--temperature", 0,
                                   "--max-new-tokens", 8)
    assert code == 0, err
    hf = GPT2LMHeadModel.from_pretrained(exported["tp2pp2"]).eval()
    tok = AutoTokenizer.from_pretrained(exported["tp2pp2"])
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        for _ in range(8):
            ids.append(hf(torch.tensor([ids])).logits[0, -1].argmax().item())
            if ids[-1] == tok.eos_token_id:  # the end of the document: generate stops too
                break
    assert greedy == tok.decode(ids) + "\n"


@pytest.mark.distributed
def test_generate_bad_checkpoint_path_exits_naming_it(tmp_path):
    bad = tmp_path / "not_a_checkpoint"
    bad.mkdir()
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(bad),
                           "--prompt", "x"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"{bad}: holds no meta.json" in proc.stderr, proc.stderr


# A multiple-choice task of four made-up examples in lm-eval's yaml, on a local jsonl file
# (no network): lm-eval scores each ending by its log-likelihood after the context.
MC_EXAMPLES = [
    {"context": "def main(", "endings": ["self):", "args):", "x, y):", "):"], "label": 1},
    {"context": "import os\nimport", "endings": ["sys", "re", "the", "12"], "label": 0},
    {"context": "for i in", "endings": ["range(10):", "foo", "bar baz", "("], "label": 0},
    {"context": "return", "endings": ["None", "True", "self.", "x"], "label": 2},
]
MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def ending_logliks(hf, tok, example):
    """Summed log-probabilities of " " + each ending after the context (lm-eval's target
    delimiter; the ending's tokens are those of context + ending past the context's)."""
    context = tok.encode(example["context"])
    out = []
    for ending in example["endings"]:
        whole = tok.encode(example["context"] + " " + ending)
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].double(), dim=-1)
        out.append(sum(logp[i - 1, whole[i]].item() for i in range(len(context), len(whole))))
    return out


@pytest.mark.distributed
def test_evaluate_runs_lm_eval_on_a_checkpoint_with_a_local_task(runs, exported, tmp_path,
                                                                 monkeypatch, capsys):
    pytest.importorskip("lm_eval", reason="lm-eval comes with the eval extra "
                        "(pip install -e '.[dev,eval]'; the README's test command installs it)")
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from megalite.cli import evaluate

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in MC_EXAMPLES))
    (tasks / "tiny_mc.yaml").write_text(MC_TASK.format(data=data))
    for name in OFFLINE_VARIABLES:  # a local task; and no Hub probe (it would set them here)
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the export's temporary
    (tmp_path / "tmp").mkdir()
    evaluate.main([str(runs / "serial" / "checkpoints"), "--tasks", "tiny_mc", "--include-path",
                   str(tasks), "--device", "cpu", "--batch-size", "4", "--log-samples",
                   "--output", str(tmp_path / "results.json")])
    assert "tiny_mc" in capsys.readouterr().out
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary export is gone
    results = json.loads((tmp_path / "results.json").read_text())

    hf = GPT2LMHeadModel.from_pretrained(exported["serial"]).eval()  # the same checkpoint
    tok = AutoTokenizer.from_pretrained(exported["serial"])
    samples = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC_EXAMPLES)
    acc = acc_norm = 0
    for example, sample in zip(MC_EXAMPLES, samples):
        direct = ending_logliks(hf, tok, example)
        assert [r[0] for r in sample["filtered_resps"]] == pytest.approx(direct, abs=1e-4)
        per_char = [ll / len(e) for ll, e in zip(direct, example["endings"])]
        acc += direct.index(max(direct)) == example["label"]
        acc_norm += per_char.index(max(per_char)) == example["label"]
    scores = results["results"]["tiny_mc"]
    assert scores["acc,none"] == acc / len(MC_EXAMPLES)
    assert scores["acc_norm,none"] == acc_norm / len(MC_EXAMPLES)


@pytest.mark.distributed  # the runs fixture; lm-eval indexes its ~14,000 task files (~10 s)
def test_evaluate_refuses_unknown_tasks_and_paths_before_exporting(runs, tmp_path, capsys,
                                                                   monkeypatch):
    from megalite.cli import evaluate

    for name in OFFLINE_VARIABLES:  # no Hub probe in this process (it would set them)
        monkeypatch.setenv(name, "1")

    code, _, err = run_script("evaluate.py", tmp_path / "nowhere", "--tasks", "hellaswag")
    assert code == 2 and f"{tmp_path / 'nowhere'}: neither a transformers directory" in err, err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    code, _, err = run_script("evaluate.py", checkpoint(runs / "serial"), "--tasks", "hellaswag",
                              "--export-dir", busy)
    assert code == 2 and f"--export-dir {busy}: exists and is not an empty" in err, err
    pytest.importorskip("lm_eval", reason="lm-eval comes with the eval extra "
                        "(pip install -e '.[dev,eval]'; the README's test command installs it)")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(MC_TASK.format(data=tmp_path / "data.jsonl"))
    out = tmp_path / "hf"
    with pytest.raises(SystemExit) as exit_:
        evaluate.main([str(checkpoint(runs / "serial")), "--tasks", "tiny_mcq,arc_easy,hellaswg",
                       "--include-path", str(tasks), "--export-dir", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--tasks 'tiny_mcq': no such lm-eval task" in err and "(closest: tiny_mc" in err, err
    assert "--tasks 'hellaswg': no such lm-eval task" in err and "(closest: hellaswag" in err
    assert "arc_easy" not in err  # a task lm-eval has
    assert not out.exists()  # refused before the checkpoint was exported or a model loaded
