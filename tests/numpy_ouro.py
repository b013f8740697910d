"""An independent numpy Ouro for tests: HF tensors, dict-based KV, no JAX.

It replays a generation teacher-forced (given tokens and exit depths) and
returns the logits each output token was sampled from, so the JAX reference's
bookkeeping of planes, exits and layouts is checked against a second,
differently written implementation of the same read rules.
"""
from __future__ import annotations

import numpy as np
from safetensors.numpy import load_file


def _rms(x, w, eps):
    x = x.astype(np.float64)
    return (x / np.sqrt(np.mean(x * x) + eps) * w).astype(np.float64)


def _rope(x, pos, theta):
    """x [H, Dh] rotate-half RoPE."""
    dh = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, dh, 2) / dh)
    ang = np.concatenate([pos * inv, pos * inv])
    rot = np.concatenate([-x[:, dh // 2:], x[:, :dh // 2]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


class NumpyOuro:
    def __init__(self, model_dir, cfg):
        self.t = {k: v.astype(np.float64) for k, v in load_file(f"{model_dir}/model.safetensors").items()}
        self.cfg = cfg

    def _w(self, name):
        return self.t[name]

    def _layer(self, x, l, pos, d, kv_store, key_depth):
        c, p = self.cfg, f"model.layers.{l}."
        h = _rms(x, self._w(p + "input_layernorm.weight"), c.norm_eps)
        q = (self._w(p + "self_attn.q_proj.weight") @ h).reshape(c.num_heads, c.head_dim)
        k = (self._w(p + "self_attn.k_proj.weight") @ h).reshape(c.num_kv_heads, c.head_dim)
        v = (self._w(p + "self_attn.v_proj.weight") @ h).reshape(c.num_kv_heads, c.head_dim)
        q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
        kv_store[(l, pos, d)] = (k, v)
        keys = [kv_store[(l, j, key_depth(j))] for j in range(pos)] + [(k, v)]
        K = np.stack([kk for kk, _ in keys])                     # [T, Hkv, Dh]
        V = np.stack([vv for _, vv in keys])
        group = c.num_heads // c.num_kv_heads
        out = np.zeros((c.num_heads, c.head_dim))
        for hh in range(c.num_heads):
            s = K[:, hh // group] @ q[hh] / np.sqrt(c.head_dim)
            w = np.exp(s - s.max())
            out[hh] = (w / w.sum()) @ V[:, hh // group]
        a = self._w(p + "self_attn.o_proj.weight") @ out.reshape(-1)
        x = x + _rms(a, self._w(p + "input_layernorm_2.weight"), c.norm_eps)
        h = _rms(x, self._w(p + "post_attention_layernorm.weight"), c.norm_eps)
        g = self._w(p + "mlp.gate_proj.weight") @ h
        m = self._w(p + "mlp.down_proj.weight") @ ((g / (1 + np.exp(-g))) * (self._w(p + "mlp.up_proj.weight") @ h))
        return x + _rms(m, self._w(p + "post_attention_layernorm_2.weight"), c.norm_eps)

    def replay(self, prompt, tokens, exit_depths, kv_layout):
        """(logits before each output token, per-loop gate hazards of each decode token).

        Tokens and exit depths come from the run under test (teacher forcing)."""
        c = self.cfg
        seq = list(prompt) + list(tokens[:-1])
        depths = [c.num_loops] * len(prompt) + list(exit_depths[1:])
        store: dict = {}
        logits, hazards = [], []
        for pos, tok in enumerate(seq):
            token_hazards = []
            x = self._w("model.embed_tokens.weight")[tok]
            for d in range(1, depths[pos] + 1):
                if kv_layout == "last_exited":
                    key_depth = lambda j, d=d: min(d, depths[j])
                else:  # shared: earlier tokens are read at their final (exit) depth
                    key_depth = lambda j: depths[j]
                for l in range(c.num_layers):
                    x = self._layer(x, l, pos, d, store, key_depth)
                x = _rms(x, self._w("model.norm.weight"), c.norm_eps)
                g = self._w("model.early_exit_gate.weight")[0] @ x + self._w("model.early_exit_gate.bias")[0]
                token_hazards.append(1 / (1 + np.exp(-g)))
            if pos >= len(prompt):
                hazards.append(token_hazards)
            if pos >= len(prompt) - 1:
                logits.append(self._w("lm_head.weight") @ x)
        return np.array(logits), hazards
