"""Config tree: TOML + --set layering, and errors that name the key and the valid choices."""

import pytest

from fivefold.config import Config, ConfigError
from fivefold.config_checks import validate
from fivefold.config_load import load_config
from fivefold.parallel.rules import check_layout


def test_defaults_presets_toml_and_overrides_layer(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "tiny"\n[train]\nlr = 1e-3\nsteps = 7\n[model]\nattention = "eager"\n')
    cfg = load_config(path, overrides=["train.steps=9", "model.num_layers=3", "train.compile=true"])
    assert cfg.model.hidden_size == 64 and cfg.model.attention == "eager"  # preset, then file
    assert cfg.train.lr == 1e-3 and cfg.train.steps == 9 and cfg.train.compile == "true"  # --set wins
    assert cfg.model.num_layers == 3
    assert cfg.global_batch_tokens == cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.train.seq_len


@pytest.mark.parametrize("overrides, message", [
    (["model.hiden_size=3"], "unknown config key 'model.hiden_size'"),
    (["trian.lr=1"], "unknown config section 'trian'"),
    (["train.precision=fp16"], "choose one of fp32, bf16-mixed"),
    (["train.recompute=some"], "choose one of none, selective, ops, full"),
    (["model.attention=flash"], "choose one of sdpa, eager"),
    (["train.steps=ten"], "train.steps='ten' is not valid; expected an integer"),
    (["train.tensorboard=maybe"], "expected true or false"),
    (["train.compile=maybe"], "choose one of auto, true, blocks, false"),
    (["train.fp8_weight_cast=sometimes"], "choose one of auto, step, use"),
    (["model.num_kv_heads=3"], "must divide model.num_heads=8; choose one of [1, 2, 4, 8]"),
    (["model.num_heads=12", "model.num_kv_heads=4"], "model.hidden_size=256 is not divisible by model.num_heads=12"),
    (["parallel.tp=3"], "parallel.tp=3 does not divide model.num_heads=8; choose tp in [1, 2, 4]"),
    (["parallel.zero=4"], "choose one of 0, 1, 2, 3"),
    (["train.batch_schedule=abc"], "tokens:grad_accum"),
    (["train.fp32_grad_accum=true"], "only applies to train.precision=bf16-mixed"),
    (["noequals"], "section.key=value"),
])
def test_invalid_values_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'llama9'; choose one of"):
        load_config(preset="llama9")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")


def test_world_size_must_match_the_layout():
    cfg = Config()
    cfg.parallel.dp, cfg.parallel.tp = 2, 2
    with pytest.raises(ConfigError, match=r"world size 8 != dp\*tp\*pp\*cp = 2\*2\*1\*1 = 4; set parallel.dp=4"):
        check_layout(cfg, world_size=8)


def test_example_configs_load_with_every_value_they_set():
    """Each shipped example: every key its TOML sets is in the loaded config with that value, the config
    validates, and it survives the round trip through the checkpoint's dict form."""
    import tomllib
    from pathlib import Path

    from fivefold.config_load import config_from_dict

    paths = sorted(Path(__file__).parent.parent.glob("configs/*.toml"))
    assert len(paths) >= 3
    for path in paths:
        cfg = load_config(path)
        validate(cfg)
        for section, values in tomllib.loads(path.read_text()).items():
            if section == "preset":
                continue
            for key, value in values.items():
                assert getattr(getattr(cfg, section), key) == value, (path.name, section, key)
        assert config_from_dict(cfg.to_dict()) == cfg
