"""Tests of config.py and cli.py: validation, presets, command-line and file overrides."""

import json
import math
import re

import pytest

import config
from config import ModelConfig, TrainConfig
from llm.base.cli import parse_config
from llm.base.errors import ConfigError


@pytest.mark.parametrize("kwargs,field", [
    (dict(hidden_size=100, num_attention_heads=3), "hidden_size"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    (dict(hidden_size=96, num_attention_heads=32), "head_dim"),  # head_dim 3 is odd
    (dict(head_dim=7), "head_dim"),
    (dict(hidden_size=-1), "hidden_size"),
    (dict(num_hidden_layers=-1), "num_hidden_layers"),
    (dict(vocab_size=-8), "vocab_size"),
    (dict(rope_theta=0.0), "rope_theta"),
])
def test_invalid_model_configs_name_the_field(kwargs, field):
    """A bad shape must fail at construction with the field's name, not deep inside forward."""
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(learning_rate=-1e-3), "learning_rate"),
    (dict(muon_lr=-1.0), "muon_lr"),
    (dict(warmup_ratio=1.0), "warmup_ratio"),
    (dict(max_minutes=-1.0), "max_minutes"),
    (dict(micro_batch_size=-2), "micro_batch_size"),
    (dict(adam_beta2=1.0), "adam_beta2"),
    (dict(grad_clip=-1.0), "grad_clip"),
    (dict(min_lr_ratio=2.0), "min_lr_ratio"),
    (dict(data_parallel="zero3"), "data_parallel"),  # choices are checked in code too, not only on the CLI
    (dict(optimizer="sgd"), "optimizer"),
])
def test_invalid_train_configs_name_the_field(kwargs, field):
    """Out-of-range training values must be refused with the field's name."""
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**kwargs)


def test_derived_sizes_follow_their_inputs_unless_set():
    """head_dim and the SwiGLU width are derived, rounded as documented, and never overwrite a user's value.
    """
    m = ModelConfig(hidden_size=768, num_attention_heads=12)
    assert m.head_dim == 64 and m.intermediate_size == 2048
    assert ModelConfig(hidden_size=1000, num_attention_heads=10).intermediate_size == 2816  # 2666.7 -> 2816
    assert ModelConfig(hidden_size=256, head_dim=32, intermediate_size=100).intermediate_size == 100
    cfg, _ = parse_config(["--preset", "tiny", "--hidden_size", "384", "--num_attention_heads", "6"])
    assert cfg.model.head_dim == 64 and cfg.model.intermediate_size == 1024


def test_cli_overrides_apply_on_top_of_preset():
    """--preset picks the base; field overrides replace only what they name, parsed to the field's type."""
    cfg, _ = parse_config(["--preset", "small", "--learning_rate", "5e-4", "--qk_norm", "false",
                           "--sources", "a.txt", "b.jsonl"])
    assert cfg.model.hidden_size == 768 and cfg.train.learning_rate == 5e-4
    assert cfg.model.qk_norm is False and cfg.data.sources == ["a.txt", "b.jsonl"]
    assert cfg.train.max_steps == config.preset_small().train.max_steps


def test_unknown_name_and_wrong_type_are_refused_with_valid_names():
    """Typos must not be silently ignored; the message lists what is valid."""
    with pytest.raises(ConfigError, match="valid names are:.*learning_rate"):
        parse_config(["--preset", "tiny", "--learnig_rate", "1e-3"])
    with pytest.raises(ConfigError, match="learning_rate"):
        parse_config(["--preset", "tiny", "--learning_rate", "fast"])
    with pytest.raises(ConfigError, match="unknown preset"):
        parse_config(["--preset", "huge"])


def test_json_and_yaml_files_override_preset_and_cli_overrides_file(tmp_path):
    """A config file sits between the preset and the command line; nested run configs load too."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": {"num_hidden_layers": 3}, "learning_rate": 1e-3, "qk_norm": False}))
    cfg, _ = parse_config(["--preset", "tiny", "--config", str(path), "--learning_rate", "2e-3"])
    assert cfg.model.num_hidden_layers == 3 and cfg.model.qk_norm is False
    assert cfg.train.learning_rate == 2e-3
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("max_steps: 77\nsources:\n  - x.txt\n")
    pytest.importorskip("yaml")
    cfg, _ = parse_config(["--preset", "tiny", "--config", str(yaml_path)])
    assert cfg.train.max_steps == 77 and cfg.data.sources == ["x.txt"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        parse_config(["--config", str(bad)])


def test_saved_run_config_round_trips(tmp_path):
    """A run folder's config.json, passed back with --config, must rebuild the same configuration."""
    cfg, _ = parse_config(["--preset", "tiny", "--max_steps", "123", "--hidden_size", "96"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    again, _ = parse_config(["--preset", "tiny", "--config", str(path)])
    assert again.to_dict() == cfg.to_dict()


def test_a_run_in_epochs_config_json_loads_back(tmp_path):
    """A run in epochs writes the max_steps its epochs gave into config.json; passed back with --config, that
    file was refused ("set epochs or max_steps, not both"). The epochs decide again."""
    from llm.base.sizing import Machine
    from llm.train.autofill import fill_run_length
    cfg, _ = parse_config(["--preset", "tiny", "--epochs", "2"])
    run, _ = fill_run_length(cfg, Machine("cpu", "cpu"), train_tokens=100_000)
    assert run.train.max_steps == math.ceil(2 * 100_000 / 256 / 16) and cfg.train.max_steps == 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(run.to_dict()))
    again, _ = parse_config(["--config", str(path)])
    assert (again.train.epochs, again.train.max_steps) == (2, 0)


def test_large_preset_is_the_seed_shape():
    """The large preset must keep the seed configuration's shape."""
    m = config.preset_large().model
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads, m.vocab_size,
            m.max_seq_len) == (1536, 12, 24, 6, 32000, 384)


def test_no_float_setting_takes_inf_or_nan():
    """float() reads "inf" and "nan", so --lora_alpha inf trained adapters scaled by infinity without a word;
    every float field of every section refuses them, by name."""
    from dataclasses import fields

    from config import DataConfig, SampleConfig
    for section in (ModelConfig, DataConfig, TrainConfig, SampleConfig):
        for f in fields(section):
            if f.type is float:
                for bad in (math.inf, -math.inf, math.nan):
                    with pytest.raises(ConfigError, match=f"{f.name}=.*finite"):
                        section(**{f.name: bad})
    with pytest.raises(ConfigError, match="lora_alpha=inf"):
        parse_config(["--lora_alpha", "inf"])


@pytest.mark.parametrize("minutes", ["1e308", "1e10", "525601"])
def test_a_time_budget_past_a_year_is_one_line_from_the_trainer(minutes, capsys):
    """--max_minutes 1e308 overflowed into a traceback (minutes x 60 is inf, rounded for the progress bar),
    and 1e10 was taken: its warmup then spans a budget no run reaches, so the learning rate stayed near 0 all
    run. The trainer's command line refuses both, naming the field, with exit 2 and nothing written."""
    import gpu_training_optimized as trainer
    from conftest import one_error_line
    with pytest.raises(SystemExit) as e:
        trainer.run(["--preset", "tiny", "--max_minutes", minutes, "--run_dir", "/nonexistent/run"])
    assert "max_minutes=" in one_error_line(capsys, 2, e)
    assert TrainConfig(max_minutes=525_600).max_minutes == 525_600  # a year is still a budget


@pytest.mark.parametrize("section, name, value, rule", [
    ("EvalConfig", "limit", 2**63, "from 0 to 1,000,000,000"),
    ("TrainConfig", "beta", 1e308, "from 0 to 1000"),
])
def test_numbers_past_any_sense_are_refused_in_one_line(section, name, value, rule):
    """evaluate.py --limit 9223372036854775808 once ended in OverflowError deep in the task reader, and --beta
    1e308 trained a DPO run to NaN gradients that it blamed on the learning rate."""
    import config
    with pytest.raises(ConfigError, match=re.escape(f"{name}={value!r} is invalid")) as e:
        getattr(config, section)(**{name: value})
    assert rule in str(e.value)


def test_every_numeric_setting_has_a_range_that_refuses_what_lies_past_it():
    """Every int and float field of every config has a range (llm/base/ranges.py): a value past either bound
    is one ConfigError naming the field (a learning rate of 30, a 10**12-token context, --beta 1e308 once
    ran), and a new numeric field without a range fails here."""
    import math
    from dataclasses import fields
    from llm.base.errors import ConfigError
    from llm.base.ranges import RANGES, Above, Below
    sections = (config.ModelConfig, config.DataConfig, config.TrainConfig, config.LoadConfig, config.SampleConfig,
                config.ServeConfig, config.EvalConfig)
    numeric = {f.name for c in sections for f in fields(c) if f.type in (int, float)}
    assert numeric == set(RANGES)
    for section in sections:
        for f in fields(section):
            if f.type not in (int, float):
                continue
            low, high = RANGES[f.name][:2]
            open_ends = [b for b in (low, high) if isinstance(b, (Above, Below))]  # refused at the bound too
            for bad in (low - (1 if f.type is int else max(abs(low), 1e-9)), high * 2 + 1, *open_ends):
                bad = f.type(bad) if f.type is int or math.isfinite(bad) else bad
                with pytest.raises(ConfigError, match=f"{f.name}=.* must be from"):
                    section(**{f.name: bad})
    assert config.TrainConfig(epsilon=0.0).epsilon == 0 and config.SampleConfig(top_p=1.0).top_p == 1
    with pytest.raises(ConfigError, match="epsilon=1.0 is invalid: must be from 0 to 1, 1 excluded"):
        config.TrainConfig(epsilon=1.0)


def test_help_says_each_range(capsys):
    """--help prints each numeric flag's range beside its help, and the command line refuses a value past it
    in one line (exit 2)."""
    import gpu_training_optimized as trainer
    from conftest import one_error_line
    with pytest.raises(SystemExit):
        trainer.main(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    # learning_rate, num_generations, epsilon
    assert "[0 to 10]" in said and "[1 to 1024]" in said and "[0 to 1)" in said
    with pytest.raises(SystemExit) as e:
        trainer.run(["--preset", "tiny", "--learning_rate", "30"])
    assert "learning_rate=30.0 is invalid: must be from 0 to 10" in one_error_line(capsys, 2, e)
