"""Named presets: the real checkpoints' config.json fields, parsed like any file.

Used to build random-weight models at the exact real shapes (benchmarks) when
the weights themselves are not available. Values follow the published
config.json files; Ouro's upstream bos/eos/pad are all 0 (a known mistake
upstream), so the chat end token ``<|im_end|>`` (id 2) is listed as eos here.
"""
from __future__ import annotations

from typing import Any, Mapping

from rltjax.config import ConfigError, ModelConfig, parse_hf_config

_OURO_BASE: dict[str, Any] = {
    "model_type": "ouro",
    "architectures": ["OuroForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 65536,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "bos_token_id": 0,
    "eos_token_id": [0, 2],
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}


def _ouro(layers: int) -> dict[str, Any]:
    return {**_OURO_BASE, "num_hidden_layers": layers,
            "layer_types": ["full_attention"] * layers}


PRESETS: dict[str, dict[str, Any]] = {
    "ouro-1.4b": _ouro(24),
    "ouro-1.4b-thinking": _ouro(24),
    "ouro-2.6b": _ouro(48),
    "ouro-2.6b-thinking": _ouro(48),
    "nanbeige4.2-3b": {
        "model_type": "nanbeige",
        "architectures": ["NanbeigeForCausalLM"],
        "vocab_size": 166144,
        "hidden_size": 3072,
        "intermediate_size": 10752,
        "num_hidden_layers": 22,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "kv_channels": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rope_theta": 70000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "rms_norm_eps": 1e-5,
        "num_loops": 2,
        "loop_loss_weights": [],
        "skip_loop_final_norm": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": 166100,
        "eos_token_id": 166101,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
    "huginn-0125": {
        "model_type": "huginn_raven",
        "architectures": ["RavenForCausalLM"],
        "architecture_class_name": "RecurrentGPT",
        "block_class_name": "SandwichBlock",
        "mlp_class_name": "GatedMLP",
        "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama",
        "n_embd": 5280,
        "n_heads": 55,
        "num_key_value_heads": 55,
        "head_dim": 96,
        "intermediate_size": 17920,
        "vocab_size": 65536,
        "padded_vocab_size": 65536,
        "n_layers": 8,
        "n_layers_in_prelude": 2,
        "n_layers_in_recurrent_block": 4,
        "n_layers_in_coda": 2,
        "injection_type": "linear",
        "state_init": "like-init",
        "mean_recurrence": 32,
        "norm_eps": 1e-6,
        "qk_bias": True,
        "bias": False,
        "tie_embeddings": True,
        "rope_base": 50000,
        "block_size": 4096,
        "init_values": {"std": (2 / (5 * 5280)) ** 0.5, "embed_scale": 5280 ** 0.5},
        "test_time_noise": 0,
        "bos_token_id": 65504,
        "eos_token_id": [65505, 65508],
        "pad_token_id": 65509,
    },
}


def preset_hf_dict(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return dict(PRESETS[name])


def preset_config(name: str, overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """The ModelConfig of a named real model (e.g. ``ouro-1.4b``)."""
    return parse_hf_config(preset_hf_dict(name), overrides)
