"""Strict config.json parsing: the fixtures parse to the right ModelConfig, the rest is refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltjax.config import ConfigError, ModelConfig, load_hf_config, parse_hf_config, read_hf_config_dict

FIXTURES = Path(__file__).parent / "fixtures"


def raw(name: str) -> dict:
    return read_hf_config_dict(FIXTURES / name)


def test_ouro_tiny():
    cfg = load_hf_config(FIXTURES / "ouro-tiny")
    assert isinstance(cfg, ModelConfig)
    assert (cfg.arch, cfg.num_loops, cfg.num_layers) == ("ouro", 4, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_width, cfg.kv_width) == (4, 4, 16, 64, 64)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (512, 64, 160)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_position) == (1e6, 1e-6, 512)
    assert cfg.tie_embeddings is False and cfg.has_exit_gate is True
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (1, (2,), 0)
    assert cfg.initializer_range == 0.02 and cfg.num_prelude_layers == cfg.num_coda_layers == 0


def test_ouro_tiny_gqa():
    cfg = load_hf_config(FIXTURES / "ouro-tiny-gqa")
    assert (cfg.arch, cfg.num_loops, cfg.num_layers) == ("ouro", 4, 3)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_width, cfg.kv_width) == (8, 2, 16, 128, 32)
    assert cfg.q_width != cfg.hidden_size
    assert cfg.tie_embeddings is False and cfg.eos_token_ids == (2,)


def test_nanbeige_tiny():
    cfg = load_hf_config(FIXTURES / "nanbeige-tiny")
    assert (cfg.arch, cfg.num_loops, cfg.num_layers) == ("nanbeige", 2, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_width, cfg.kv_width) == (4, 2, 32, 128, 64)
    assert cfg.hidden_size == 64 and cfg.q_width != cfg.hidden_size
    assert (cfg.rope_theta, cfg.norm_eps) == (7e7, 1e-5)
    assert cfg.tie_embeddings is False and cfg.has_exit_gate is False
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (504, (505,), 0)


def test_huginn_tiny():
    cfg = load_hf_config(FIXTURES / "huginn-tiny")
    assert (cfg.arch, cfg.num_loops, cfg.num_layers) == ("huginn", 4, 2)
    assert (cfg.num_prelude_layers, cfg.num_coda_layers) == (1, 1)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_width) == (4, 4, 24, 96)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (512, 96, 192)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_position) == (50000.0, 1e-6, 512)
    assert cfg.tie_embeddings is True and cfg.qk_bias is True and cfg.has_exit_gate is False
    assert cfg.state_init == "like-init"
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (504, (505,), 509)
    assert cfg.initializer_range == pytest.approx(0.06454972243679027)


def test_eos_list():
    cfg = parse_hf_config(raw("ouro-tiny"), {"eos_token_id": [0, 2]})
    assert cfg.eos_token_ids == (0, 2)


@pytest.mark.parametrize("fixture,override,loops", [
    ("ouro-tiny", {"total_ut_steps": 2}, 2),
    ("nanbeige-tiny", {"num_loops": 3}, 3),
    ("huginn-tiny", {"mean_recurrence": 32}, 32),
])
def test_hf_overrides(fixture, override, loops):
    assert load_hf_config(FIXTURES / fixture, override).num_loops == loops
    assert parse_hf_config(raw(fixture), override).num_loops == loops


REJECTIONS = [
    # (fixture, changes (None = delete the field), text the message must contain)
    ("ouro-tiny", {"model_type": "llama"}, "model_type"),
    ("ouro-tiny", {"model_type": None}, "model_type"),
    ("ouro-tiny", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("nanbeige-tiny", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ("ouro-tiny", {"use_sliding_window": True}, "use_sliding_window"),
    ("ouro-tiny", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("ouro-tiny", {"some_new_knob": 1}, "some_new_knob"),
    ("huginn-tiny", {"some_new_knob": 1}, "some_new_knob"),
    ("ouro-tiny", {"hidden_act": "gelu"}, "hidden_act"),
    ("nanbeige-tiny", {"hidden_act": "relu"}, "hidden_act"),
    ("ouro-tiny", {"hidden_size": None}, "hidden_size"),
    ("ouro-tiny", {"total_ut_steps": None}, "total_ut_steps"),
    ("nanbeige-tiny", {"num_loops": None}, "num_loops"),
    ("huginn-tiny", {"n_embd": None}, "n_embd"),
    ("huginn-tiny", {"mean_recurrence": None}, "mean_recurrence"),
    ("ouro-tiny", {"hidden_size": "sixty-four"}, "hidden_size"),
    ("ouro-tiny", {"tie_word_embeddings": True}, "tie_word_embeddings"),
    ("nanbeige-tiny", {"attention_bias": True}, "attention_bias"),
    ("nanbeige-tiny", {"qk_layernorm": True}, "qk_layernorm"),
    ("huginn-tiny", {"injection_type": "add"}, "injection_type"),
    ("huginn-tiny", {"test_time_noise": 0.1}, "test_time_noise"),
    ("huginn-tiny", {"bias": True}, "bias"),
]


def _apply(cfg: dict, changes: dict) -> dict:
    cfg = dict(cfg)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


@pytest.mark.parametrize("fixture,changes,field", REJECTIONS,
                         ids=[f"{f}-{next(iter(c))}" for f, c, _ in REJECTIONS])
def test_rejections_name_the_field(fixture, changes, field):
    with pytest.raises(ConfigError) as e:
        parse_hf_config(_apply(raw(fixture), changes))
    assert field in str(e.value)


def test_overrides_are_validated_like_the_file():
    with pytest.raises(ConfigError, match="rope_scaling"):
        parse_hf_config(raw("ouro-tiny"), {"rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="not_a_field"):
        load_hf_config(FIXTURES / "ouro-tiny", {"not_a_field": 3})


def test_inert_fields_are_accepted():
    cfg = parse_hf_config(_apply(raw("ouro-tiny"), {"rope_scaling": None, "use_sliding_window": False,
                                                     "sliding_window": None, "torch_dtype": "bfloat16"}))
    assert cfg.arch == "ouro"


def test_malformed_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "ouro", ')
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        load_hf_config(tmp_path)
    assert "config.json" in str(e.value)


def test_config_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_hf_config(tmp_path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_hf_config(tmp_path)


def test_fixture_configs_are_unchanged_on_disk():
    # The parser must not mutate the dict it is given (overrides merge into a copy).
    before = raw("ouro-tiny")
    parse_hf_config(before, {"total_ut_steps": 2})
    assert before == json.loads((FIXTURES / "ouro-tiny" / "config.json").read_text())
