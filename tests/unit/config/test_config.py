"""Config composition and validation: every bad value is refused naming key, value and remedy."""
import pytest
from hydra.errors import ConfigCompositionException

from megalite.config.errors import ConfigError
from megalite.config.layout import validate
from megalite.config.schema import Config, load_config


def test_defaults_compose_and_validate():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert (cfg.tp, cfg.pp, cfg.zero, cfg.sp) == (1, 1, 0, False)
    assert cfg.model.name == "tiny" and cfg.data.source == "stdlib"
    validate(cfg, world_size=1)


def test_presets_use_hf_shapes():
    xl = load_config(["model=gpt2-xl"]).model
    assert (xl.n_layer, xl.n_embd, xl.n_head, xl.n_positions, xl.vocab_size) == (48, 1600, 25, 1024, 50257)


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"model='gpt5': no such preset; use one of .*gpt2-xl"):
        load_config(["model=gpt5"])


def test_unknown_key_and_wrong_type_fail_at_composition():
    with pytest.raises(ConfigCompositionException, match="train.max_stepz"):
        load_config(["train.max_stepz=3"])
    with pytest.raises(ConfigCompositionException, match="train.max_steps"):
        load_config(["train.max_steps=many"])


def bad(overrides, world_size=1):
    cfg = load_config(overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size)
    return str(e.value)


@pytest.mark.parametrize("overrides,world,expect", [
    (["train.seq_len=512"], 1, "train.seq_len=512"),
    (["train.global_batch_size=30"], 1, "train.global_batch_size=30"),
    (["train.global_batch_size=32"], 3, "micro_batch_size*dp = 8*3 = 24"),
    (["tp=3"], 3, "tp=3: must divide model.n_head=4"),
    (["tp=2", "model.n_inner=131"], 2, "MLP size 131"),
    (["tp=2", "sp=true", "train.seq_len=127"], 2, "train.seq_len=127: with sp=true"),
    (["pp=5"], 5, "pp=5: more pipeline stages than blocks"),
    (["pp=2", "parallel.edge_stage_layers=1"], 2, "parallel.edge_stage_layers=1"),
    (["pp=3", "parallel.edge_stage_layers=2"], 3, "parallel.edge_stage_layers=2"),
    (["parallel.bucket_mb=0"], 1, "parallel.bucket_mb=0"),
    (["parallel.overlap_param_gather=true"], 1, "parallel.overlap_param_gather=True: needs zero=1"),
    (["zero=3", "parallel.overlap_param_gather=true"], 1, "ZeRO-3 gathers each block"),
    (["zero=5"], 1, "zero=5"),
    (["sp=true"], 1, "sp=True"),
    (["model.n_head=3"], 1, "model.n_head=3"),
    (["precision=fp8"], 1, "precision='fp8': use one of auto, fp32, bf16, fp16"),
    (["loss_scale.static=1024"], 1, "loss_scale.static=1024.0: only precision=fp16 scales"),
    (["precision=fp16", "loss_scale.static=0"], 1, "loss_scale.static=0.0: must be a positive"),
    (["loss_scale.min=2", "loss_scale.initial=1"], 1, "loss_scale.min=2.0: must be <= "),
    (["loss_scale.window=0"], 1, "loss_scale.window=0: must be >= 1"),
    (["loss_scale.hysteresis=0"], 1, "loss_scale.hysteresis=0: must be >= 1"),
    (["optim.min_lr=1.0"], 1, "optim.min_lr=1.0"),
    (["optim.lr=-1"], 1, "optim.lr=-1.0: must be > 0"),
    (["optim.schedule=step"], 1, "optim.schedule='step': use one of cosine, linear"),
    (["optim.wsd_decay_fraction=0"], 1, "optim.wsd_decay_fraction=0.0"),
    (["optim.eps=0"], 1, "optim.eps=0.0"),
    (["model.layer_norm_epsilon=-1"], 1, "model.layer_norm_epsilon=-1.0"),
    (["model.initializer_range=0"], 1, "model.initializer_range=0.0"),
    (["device=cuda"], 1, "device='cuda': no CUDA GPU is visible"),
    (["train.recompute_layers=2"], 1, "train.recompute_layers=2: needs train.recompute=true"),
    (["train.recompute=true", "train.recompute_layers=0"], 1, "train.recompute_layers=0"),
    (["optim.betas=[0.9]"], 1, "optim.betas"),
    (["log.wandb=maybe"], 1, "log.wandb='maybe'"),
    (["checkpoint.resume=/no/such/ckpt"], 1, "checkpoint.resume='/no/such/ckpt'"),
    (["model.attn_pdrop=1.5"], 1, "model.attn_pdrop=1.5"),
    (["checkpoint.timeout_s=0"], 1, "checkpoint.timeout_s=0.0: must be a positive number"),
    (["train.attention=fa3"], 1, "train.attention='fa3': use one of auto, flash, cudnn"),
    (["train.attention=cudnn", "device=cpu"], 1, "train.attention='cudnn': this kernel runs on CUDA"),
    (["train.attention_mask=block"], 1, "train.attention_mask='block': use one of causal, document"),
    (["train.attention_mask=document", "train.attention=flash"], 1,
     "train.attention='flash': this SDPA kernel takes no document mask"),
    (["train.document_kernel=xformers"], 1, "train.document_kernel='xformers': use one of auto"),
    (["train.document_kernel=sdpa"], 1, "train.document_kernel='sdpa': chooses the kernel of "
                                        "the document mask only"),
    (["train.attention_mask=document", "train.document_kernel=varlen"], 1,
     "train.document_kernel='varlen': runs on CUDA GPUs only"),
    (["train.attention_mask=document", "train.document_kernel=flex", "train.attention=math"], 1,
     "train.attention='math': names an SDPA kernel, which train.document_kernel=flex"),
    (["cp=2", "train.attention_mask=document", "train.document_kernel=sdpa"], 2,
     "train.document_kernel='sdpa': is not supported with cp=2"),
    # context parallelism: what cp > 1 does not run, by its key
    (["cp=2", "model.attn_pdrop=0.1"], 2, "model.attn_pdrop=0.1: is not supported with cp=2"),
    (["cp=2", "train.attention=flash"], 2, "train.attention='flash': is not supported with cp=2"),
    (["cp=2", "train.compile=true"], 2, "train.compile=True: is not supported with cp=2"),
    (["cp=2", "fp8.recipe=rowwise", "fp8.emulate=true"], 2,
     "fp8.recipe='rowwise': is not supported with cp=2"),
    (["cp=2", "resilience.rerun=on_nan"], 2, "resilience.rerun='on_nan': is not supported"),
])
def test_bad_values_are_named(overrides, world, expect):
    assert expect in bad(overrides, world)


def test_global_batch_message_suggests_a_valid_value():
    msg = bad(["train.global_batch_size=44"])
    assert "multiple of micro_batch_size*dp = 8*1 = 8 (e.g. 48)" in msg


def test_world_size_must_factor():
    assert "world size 3 must equal tp*cp*pp*dp" in bad(["tp=2"], world_size=3)
    validate(load_config(), world_size=4)  # dp = 4


@pytest.mark.parametrize("value", ["true", "false", "offline", "auto"])
def test_wandb_setting_survives_yaml_booleans(value):
    cfg = load_config([f"log.wandb={value}"])
    assert cfg.log.wandb == value
    validate(cfg, 1)


def test_wandb_auto_is_offline_without_credentials(monkeypatch, tmp_path):
    from megalite.train.metrics import wandb_mode

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert wandb_mode("auto") == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert wandb_mode("false") is None and wandb_mode("offline") == "offline"


def test_warnings_for_legal_but_wasteful_settings():
    assert validate(load_config(), 1) == []
    (w,) = validate(load_config(["pp=4", "train.global_batch_size=16"]), 4)
    assert "m = global_batch_size/(micro_batch_size*dp) = 2 micro-batches < pp=4" in w
    assert "60%" in w  # (p-1)/(m+p-1) = 3/5
    (w,) = validate(load_config(["zero=1"]), 1)
    assert "zero=1 with data-parallel x context-parallel size 1 shards nothing" in w
    # ZeRO shards over DP x CP: cp=2 at dp=1 halves the optimizer state, so no warning.
    assert validate(load_config(["zero=1", "cp=2"]), 2) == []
    (w,) = validate(load_config(["tp=4"]), 4, local_gpus=2)
    assert "tp=4 is larger than the 2 GPUs of one node" in w


def test_more_ranks_per_node_than_gpus_is_refused():
    cfg = load_config(["train.global_batch_size=64"])
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node=8: this node has 4 GPUs"):
        validate(cfg, 8, local_gpus=4, local_ranks=8)
    validate(cfg, 8, local_gpus=8, local_ranks=8)
    validate(load_config(["device=cpu", "train.global_batch_size=64"]), 8, local_gpus=4,
             local_ranks=8)  # CPU ranks


@pytest.mark.parametrize("overrides,expect", [
    (["seed=-1"], "seed=-1: must be a non-negative integer"),
    (["parallel.bucket_mb=inf"], "parallel.bucket_mb=inf: must be a positive number"),
])
def test_values_that_used_to_fail_after_launch_are_refused(overrides, expect):
    assert expect in bad(overrides)


def test_precision_and_attention_follow_what_the_gpu_can_do():
    """A GPU without bf16 (V100, T4): auto trains in fp16 with loss scaling and says so, an
    explicit bf16 is refused naming the GPU; flash / cuDNN attention need half precision and
    an Ampere or newer GPU. All before launch."""
    from megalite.config.layout import GpuInfo, Layout

    v100 = GpuInfo("Tesla V100-SXM2-32GB", bf16=False)
    cfg = load_config(["device=cuda"])
    (warning,) = validate(cfg, 1, local_gpus=1, gpu=v100)
    assert "fp16 with dynamic loss scaling" in warning and "V100" in warning
    assert Layout.from_config(cfg, 1, "cuda", bf16=False).precision == "fp16"
    assert Layout.from_config(cfg, 1, "cuda").precision == "bf16"
    with pytest.raises(ConfigError, match="precision='bf16': Tesla V100.* does not compute"):
        validate(load_config(["device=cuda", "precision=bf16"]), 1, local_gpus=1, gpu=v100)
    with pytest.raises(ConfigError, match="train.attention='flash': .*fp16/bf16 only"):
        validate(load_config(["device=cuda", "precision=fp32", "train.attention=flash"]), 1,
                 local_gpus=1)
    with pytest.raises(ConfigError, match="train.attention='cudnn': .*Ampere or newer"):
        validate(load_config(["device=cuda", "train.attention=cudnn"]), 1, local_gpus=1,
                 gpu=v100)
    validate(load_config(["device=cuda", "loss_scale.static=1024"]), 1, local_gpus=1, gpu=v100)
    varlen = ["device=cuda", "train.attention_mask=document", "train.document_kernel=varlen"]
    validate(load_config(varlen), 1, local_gpus=1)
    for more, gpu, why in ((["precision=fp32"], None, "is FlashAttention-2.s .*bf16/fp16 only"),
                           ([], v100, "is FlashAttention-2.s .*needs an Ampere or newer GPU"),
                           (["model.n_embd=320", "model.n_head=1"], None,
                            "is FlashAttention-2.s .* = 320"),
                           (["model.attn_pdrop=0.1"], None, "has no attention dropout"),
                           (["cp=2"], None, "is not supported with cp=2")):
        with pytest.raises(ConfigError, match=f"train.document_kernel='varlen': {why}"):
            validate(load_config(varlen + more), 2, local_gpus=2, gpu=gpu, local_ranks=1)
    validate(load_config(["train.attention=flash", "precision=fp32"]), 1)  # CPU: fine
