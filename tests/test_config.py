from __future__ import annotations

import pytest

from syncwise.config import ConfigError, config_to_dict, load_config, load_config_dict


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg.engine.strategy == "fsdp2"
    assert cfg.sync.mode == "auto"


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("engine:\n  strategy: fsdp1\n  micro_batch_size: 4\noptim:\n  lr: 3.0e-4\n")
    cfg = load_config(path, ["optim.lr=1e-3", "sync.mode=per_microbatch", "optim.betas=[0.9, 0.95]"])
    assert cfg.engine.strategy == "fsdp1"
    assert cfg.engine.micro_batch_size == 4
    assert cfg.optim.lr == pytest.approx(1e-3)  # "1e-3" is a string to YAML; coerced
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.sync.mode == "per_microbatch"


def test_round_trip_through_dict():
    cfg = load_config(None, ["model.path=/models/x", "engine.cpu_offload=true"])
    assert load_config_dict(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("engine.strategy=fsdp3", "engine.strategy: 'fsdp3' is not one of fsdp2, fsdp1, ddp, none"),
        ("sync.mode=lazy", "sync.mode: 'lazy' is not one of per_microbatch, deferred"),
        ("engine.stratgy=fsdp2", "unknown key 'engine.stratgy' (did you mean 'engine.strategy'?)"),
        ("engin.strategy=fsdp2", "unknown key 'engin' (did you mean 'engine'?)"),
        ("engine.micro_batch_size=two", "engine.micro_batch_size: expected an integer, got 'two'"),
        ("engine.micro_batch_size=-1", "engine.micro_batch_size: must be >= 0 (0 = the token cap decides), got -1"),
        ("engine.cpu_offload=maybe", "engine.cpu_offload: expected true or false, got 'maybe'"),
        ("engine.max_tokens_per_micro_batch=lots", "engine.max_tokens_per_micro_batch: expected a token count or auto"),
        ("engine.max_tokens_per_micro_batch=-5", "engine.max_tokens_per_micro_batch: must be >= 0"),
        ("engine.fused_lm_head=sometimes", "engine.fused_lm_head: expected true, false or auto, got 'sometimes'"),
        ("optim.lr=fast", "optim.lr: expected a number, got 'fast'"),
        ("optim.betas=0.9", "optim.betas: expected a list of 2 values, got 0.9"),
        ("model.param_dtype=fp8", "model.param_dtype: 'fp8' is not one of float32, bfloat16, float16"),
        ("sft.max_len=2", "sft.max_len: must be >= sft.min_len"),
        ("engine", "override 'engine': expected section.key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_every_unknown_key_is_named_in_one_error(tmp_path):
    """Issue 80 (4): a command line or YAML with several unknown keys was one error a run. Now one error names each,
    across sections, with its hint (TRL's logging_steps pointing at every job's log_every)."""
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text("engine:\n  stratgy: fsdp2\ntrain:\n  logging_steps: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(yaml_file, ["optim.learning_rate=1e-6", "rl.num_generations=8", "nosection.key=1"])
    assert len([part for part in str(info.value).split("; ") if "unknown key" in part]) == 5, str(info.value)
    for words in ("'engine.stratgy' (did you mean 'engine.strategy'?)",
                  "'train.logging_steps': TRL's logging_steps is train.log_every, sft.log_every or dpo.log_every",
                  "'optim.learning_rate': TRL's learning_rate is optim.lr",
                  "'rl.num_generations': TRL's num_generations", "'nosection'"):
        assert words in str(info.value), words


def test_impossible_combinations():
    with pytest.raises(ConfigError, match="engine.hsdp_replicas=2 needs engine.strategy fsdp2 or fsdp1"):
        load_config(None, ["engine.strategy=ddp", "engine.hsdp_replicas=2"])
    with pytest.raises(ConfigError, match="mixed precision"):
        load_config(None, ["engine.strategy=ddp", "model.param_dtype=bfloat16"])


def test_missing_file_and_bad_top_level(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


def test_cpu_offload_on_a_cpu_run_is_a_clear_error():
    import torch

    from syncwise.engine.wrap import wrap_model
    from syncwise.models import build_model

    cfg = load_config(None, ["engine.cpu_offload=true", "model.preset=qwen2-test"])
    with pytest.raises(ValueError, match="engine.cpu_offload=true needs a CUDA device"):
        wrap_model(build_model(cfg.model), cfg.engine, cfg.model, torch.device("cpu"), None)


def test_an_override_that_is_not_yaml_is_one_line_naming_the_key():
    from syncwise.config import ConfigError

    with pytest.raises(ConfigError, match=r"^rl.stop: cannot read '\[####\]' as a YAML value"):
        load_config(None, ["rl.stop=[####]"])
    assert load_config(None, ["rl.stop=['####']"]).rl.stop == ["####"]


def test_the_split_auto_chooses_unless_a_size_or_a_cap_is_set():
    """engine.max_tokens_per_micro_batch=auto (the default) is auto's to choose; a set micro_batch_size wins
    over it; a set cap wins over the size; neither: 2 sequences."""
    assert load_config(None, []).engine.auto_cap and load_config(None, []).engine.fused_lm_head == "auto"
    sized = load_config(None, ["engine.micro_batch_size=4"]).engine
    assert not sized.auto_cap and sized.fixed_split == (4, 0)
    capped = load_config(None, ["engine.micro_batch_size=4", "engine.max_tokens_per_micro_batch=512"]).engine
    assert not capped.auto_cap and capped.fixed_split == (4, 512)
    assert load_config(None, ["engine.max_tokens_per_micro_batch=0"]).engine.fixed_split == (2, 0)
    assert load_config(None, ["engine.fused_lm_head=false"]).engine.fused_lm_head is False
