"""Model configuration: parsed strictly from a Hugging Face ``config.json``.

Each supported ``model_type`` lists the fields it understands. A field the
parser does not know, or a known field set to a value rltjax cannot honour
(rope scaling, sliding windows, biases the architecture does not have), is an
error naming the field: silently ignoring it would serve a different model.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping


class ConfigError(ValueError):
    """A checkpoint's config.json (or an override) cannot be served."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str                    # "ouro" | "nanbeige" | "huginn"
    vocab_size: int              # embedding rows (padded vocab for Huginn)
    hidden_size: int
    intermediate_size: int
    num_layers: int              # layers of the looped core
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_loops: int               # R: loops every prompt token runs
    rope_theta: float
    norm_eps: float
    max_position: int            # positions the model accepts
    tie_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    initializer_range: float = 0.02
    num_prelude_layers: int = 0  # Huginn boundary stages
    num_coda_layers: int = 0
    qk_bias: bool = False
    state_init: str = "like-init"  # Huginn: "like-init" (seeded) or "zero"
    has_exit_gate: bool = False  # Ouro's learned early_exit_gate

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


# Fields every HF config may carry that do not change the computation.
_BOOKKEEPING = {
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "attention_dropout", "_name_or_path", "model_type",
    "output_attentions", "output_hidden_states", "return_dict", "pretraining_tp",
    "initializer_range", "_attn_implementation_autoset",
}


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _require(cfg: Mapping[str, Any], name: str, model_type: str) -> Any:
    if name not in cfg or cfg[name] is None:
        raise ConfigError(f"config.json for model_type={model_type!r} is missing required field {name!r}")
    # Every required field is numeric; check here so the error names the field.
    if isinstance(cfg[name], bool) or not isinstance(cfg[name], (int, float)):
        raise ConfigError(f"config.json for model_type={model_type!r} has a malformed field "
                          f"{name}={cfg[name]!r}: expected a number")
    return cfg[name]


def _expect(cfg: Mapping[str, Any], name: str, allowed: tuple, why: str) -> None:
    if name in cfg and cfg[name] not in allowed:
        raise ConfigError(f"unsupported config field {name}={cfg[name]!r}: {why} (supported: {allowed})")


def _check_known(cfg: Mapping[str, Any], known: set[str], model_type: str) -> None:
    unknown = sorted(set(cfg) - known - _BOOKKEEPING)
    if unknown:
        raise ConfigError(
            f"config.json for model_type={model_type!r} has fields rltjax does not support: {unknown}. "
            "Remove them if they are inert, or this checkpoint is not a supported architecture.")


def _no_rope_scaling(cfg: Mapping[str, Any]) -> None:
    if cfg.get("rope_scaling") not in (None, {}):
        raise ConfigError(f"unsupported config field rope_scaling={cfg['rope_scaling']!r}: "
                          "only plain RoPE is implemented")


_LLAMA_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
}

_OURO_FIELDS = _LLAMA_FIELDS | {
    "total_ut_steps", "early_exit_threshold", "layer_types", "max_window_layers",
    "sliding_window", "use_sliding_window",
}

_NANBEIGE_FIELDS = _LLAMA_FIELDS | {
    "num_loops", "attention_bias", "mlp_bias", "kv_channels", "loop_loss_weights",
    "qk_layernorm", "skip_loop_final_norm",
}

_HUGINN_FIELDS = {
    "activation_checkpoint_impl", "architecture_class_name", "bias", "block_class_name",
    "block_size", "bos_token_id", "eos_token_id", "pad_token_id", "effective_expected_depth",
    "head_dim", "init_orthogonal", "init_strategy", "init_values", "injection_type",
    "intermediate_size", "mean_backprop_depth", "mean_recurrence", "mlp_class_name",
    "n_embd", "n_heads", "n_layers", "n_layers_in_coda", "n_layers_in_prelude",
    "n_layers_in_recurrent_block", "nonlin_name", "norm_class_name", "norm_eps",
    "num_key_value_heads", "padded_vocab_size", "padding_multiple", "qk_bias",
    "rope_base", "sampling_scheme", "state_init", "test_time_noise",
    "test_time_noise_type", "tie_embeddings", "vocab_size",
}


def _llama_common(cfg: Mapping[str, Any], mt: str) -> dict[str, Any]:
    _no_rope_scaling(cfg)
    _expect(cfg, "hidden_act", ("silu",), "the MLP is SwiGLU")
    hidden = int(_require(cfg, "hidden_size", mt))
    heads = int(_require(cfg, "num_attention_heads", mt))
    return dict(
        vocab_size=int(_require(cfg, "vocab_size", mt)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", mt)),
        num_layers=int(_require(cfg, "num_hidden_layers", mt)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(_require(cfg, "rope_theta", mt)),
        norm_eps=float(_require(cfg, "rms_norm_eps", mt)),
        max_position=int(_require(cfg, "max_position_embeddings", mt)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
        pad_token_id=cfg.get("pad_token_id"),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
    )


def _parse_ouro(cfg: Mapping[str, Any]) -> ModelConfig:
    _check_known(cfg, _OURO_FIELDS, "ouro")
    if cfg.get("use_sliding_window"):
        raise ConfigError("unsupported config field use_sliding_window=true: "
                          "rltjax implements full attention only")
    bad_layers = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if bad_layers:
        raise ConfigError(f"unsupported config field layer_types containing {sorted(set(bad_layers))}: "
                          "rltjax implements full attention only")
    common = _llama_common(cfg, "ouro")
    if common["tie_embeddings"]:
        raise ConfigError("unsupported config field tie_word_embeddings=true for ouro: Ouro has an untied lm_head")
    return ModelConfig(arch="ouro", num_loops=int(_require(cfg, "total_ut_steps", "ouro")),
                       has_exit_gate=True, **common)


def _parse_nanbeige(cfg: Mapping[str, Any]) -> ModelConfig:
    _check_known(cfg, _NANBEIGE_FIELDS, "nanbeige")
    _expect(cfg, "attention_bias", (False,), "Nanbeige attention has no bias")
    _expect(cfg, "mlp_bias", (False,), "Nanbeige MLP has no bias")
    _expect(cfg, "qk_layernorm", (False,), "q/k layernorm is not implemented")
    _expect(cfg, "skip_loop_final_norm", (False,), "the final norm runs after every loop")
    common = _llama_common(cfg, "nanbeige")
    return ModelConfig(arch="nanbeige", num_loops=int(_require(cfg, "num_loops", "nanbeige")), **common)


def _parse_huginn(cfg: Mapping[str, Any]) -> ModelConfig:
    mt = "huginn_raven"
    _check_known(cfg, _HUGINN_FIELDS, mt)
    _expect(cfg, "bias", (False,), "Huginn linear layers have no bias")
    _expect(cfg, "injection_type", ("linear",), "only the linear adapter is implemented")
    _expect(cfg, "block_class_name", ("SandwichBlock",), "only sandwich blocks are implemented")
    _expect(cfg, "mlp_class_name", ("GatedMLP",), "only the gated MLP is implemented")
    _expect(cfg, "nonlin_name", ("SiLU",), "only SiLU is implemented")
    _expect(cfg, "norm_class_name", ("RMSNorm_llama",), "only llama RMSNorm is implemented")
    _expect(cfg, "state_init", ("like-init", "zero"), "state initialisation")
    _expect(cfg, "test_time_noise", (0, 0.0, None), "test-time noise is not implemented")
    hidden = int(_require(cfg, "n_embd", mt))
    heads = int(_require(cfg, "n_heads", mt))
    prelude = int(_require(cfg, "n_layers_in_prelude", mt))
    core = int(_require(cfg, "n_layers_in_recurrent_block", mt))
    coda = int(_require(cfg, "n_layers_in_coda", mt))
    return ModelConfig(
        arch="huginn",
        vocab_size=int(cfg.get("padded_vocab_size") or _require(cfg, "vocab_size", mt)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", mt)),
        num_layers=core,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        num_loops=int(_require(cfg, "mean_recurrence", mt)),
        rope_theta=float(_require(cfg, "rope_base", mt)),
        norm_eps=float(_require(cfg, "norm_eps", mt)),
        max_position=int(_require(cfg, "block_size", mt)),
        tie_embeddings=bool(cfg.get("tie_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
        pad_token_id=cfg.get("pad_token_id"),
        initializer_range=float((cfg.get("init_values") or {}).get("std", 0.02)),
        num_prelude_layers=prelude,
        num_coda_layers=coda,
        qk_bias=bool(cfg.get("qk_bias", False)),
        state_init=str(cfg.get("state_init", "like-init")),
    )


PARSERS = {"ouro": _parse_ouro, "nanbeige": _parse_nanbeige, "huginn_raven": _parse_huginn}


def parse_hf_config(cfg: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """Parse an HF config dict; ``overrides`` replace fields first (vLLM's ``hf_overrides``)."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
    merged = dict(cfg)
    merged.update(overrides or {})
    model_type = merged.get("model_type")
    if model_type not in PARSERS:
        raise ConfigError(f"unsupported model_type {model_type!r}; rltjax serves {sorted(PARSERS)}")
    try:
        return PARSERS[model_type](merged)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"config.json for model_type={model_type!r} has a malformed field: {exc}") from exc


def read_hf_config_dict(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}: not a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc


def load_hf_config(model_dir: str | Path, overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    return parse_hf_config(read_hf_config_dict(model_dir), overrides)
