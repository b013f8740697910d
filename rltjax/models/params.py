"""Parameter pytrees <-> flat name maps, and the HF tensor layout contract.

Every model module declares ``hf_tensor_specs(cfg)``: one ``TensorSpec`` per
parameter leaf, saying which Hugging Face tensor(s) feed it. The checkpoint
readers use only this declaration, so adding an architecture never touches
the loading code.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    param: str                 # dotted leaf path in the params pytree, e.g. "layers.wq"
    hf_name: str               # HF tensor name; "{i}" is the layer index when num_stacked > 0
    hf_shape: tuple[int, ...]  # shape of one HF tensor
    num_stacked: int = 0       # > 0: the leaf stacks this many per-layer HF tensors on axis 0
    transpose: bool = False    # HF Linear stores [out, in]; rltjax multiplies x @ W[in, out]
    param_shape: tuple[int, ...] | None = None  # per-layer leaf shape if it differs (reshape)

    def hf_names(self) -> list[str]:
        if self.num_stacked:
            return [self.hf_name.format(i=i) for i in range(self.num_stacked)]
        return [self.hf_name]

    def leaf_shape(self) -> tuple[int, ...]:
        one = self.param_shape if self.param_shape is not None else (
            tuple(reversed(self.hf_shape)) if self.transpose else self.hf_shape)
        return ((self.num_stacked,) + tuple(one)) if self.num_stacked else tuple(one)

    def to_leaf(self, tensors: list[np.ndarray]) -> np.ndarray:
        """HF tensor(s) -> one leaf (numpy, dtype unchanged)."""
        one = self.leaf_shape()[1:] if self.num_stacked else self.leaf_shape()
        parts = [(t.T if self.transpose else t).reshape(one) for t in tensors]
        return np.stack(parts) if self.num_stacked else parts[0]

    def from_leaf(self, leaf: np.ndarray) -> dict[str, np.ndarray]:
        """One leaf -> {HF name: tensor}; the inverse of ``to_leaf``."""
        hf_view = tuple(reversed(self.hf_shape)) if self.transpose else self.hf_shape
        parts = list(leaf) if self.num_stacked else [leaf]
        out = {}
        for name, part in zip(self.hf_names(), parts):
            t = np.asarray(part).reshape(hf_view)
            out[name] = np.ascontiguousarray(t.T if self.transpose else t)
        return out


def _key_name(entry: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flatten_params(params: Any) -> dict[str, Any]:
    """Pytree -> {"layers.wq": leaf, ...}."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    return {".".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def unflatten_params(template: Any, flat: dict[str, Any]) -> Any:
    """Fill ``template``'s structure from a flat name map (names must match exactly)."""
    names = list(flatten_params(template))
    missing = sorted(set(names) - set(flat))
    extra = sorted(set(flat) - set(names))
    if missing or extra:
        raise KeyError(f"parameter names do not match the model: missing {missing}, unexpected {extra}")
    treedef = jax.tree_util.tree_structure(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[n] for n in names])


def llama_stack_specs(cfg, layer_norms: dict[str, str]) -> list[TensorSpec]:
    """The Llama-family layout shared by Ouro and Nanbeige: embeddings, the stacked
    q/k/v/o and SwiGLU projections, ``layer_norms`` ({param: HF name under the layer}),
    the final norm and an untied lm_head."""
    D, F, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.q_width, cfg.kv_width

    def stacked(param, name, shape, transpose=False):
        return TensorSpec("layers." + param, "model.layers.{i}." + name, shape, num_stacked=L,
                          transpose=transpose)

    return [
        TensorSpec("embed", "model.embed_tokens.weight", (V, D)),
        *(stacked(param, name, (D,)) for param, name in layer_norms.items()),
        stacked("wq", "self_attn.q_proj.weight", (q, D), transpose=True),
        stacked("wk", "self_attn.k_proj.weight", (kv, D), transpose=True),
        stacked("wv", "self_attn.v_proj.weight", (kv, D), transpose=True),
        stacked("wo", "self_attn.o_proj.weight", (D, q), transpose=True),
        stacked("w_gate", "mlp.gate_proj.weight", (F, D), transpose=True),
        stacked("w_up", "mlp.up_proj.weight", (F, D), transpose=True),
        stacked("w_down", "mlp.down_proj.weight", (D, F), transpose=True),
        TensorSpec("norm", "model.norm.weight", (D,)),
        TensorSpec("lm_head", "lm_head.weight", (V, D), transpose=True),
    ]
