"""DESIGN section 4's memory-bound limit on decode throughput.

One loop pass over B rows of mean context L reads the core weights once and
every row's KV at one plane, about W + B·L·kv bytes, so with d̄ loop passes per
output token:

    tokens/s <= B / (d̄ · (W + B·L·kv) / bandwidth)

W = core weight bytes (the weight-shared layers a pass runs), kv = K and V
bytes of one position at one plane over the core's layers, B = concurrency,
L = mean context (prompt + half the output: the mean over a request's decode),
d̄ = mean loops per output token (R at fixed depth, else the measured exit
depths). The bandwidth default 3.3e12 B/s is the low end of the H200 copy
bandwidth measured in DESIGN (3.3-4.3 TB/s); DESIGN's table uses about 4.3e12.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

DEFAULT_BANDWIDTH = 3.3e12
FORMULA = "tokens/s <= B / (d * (W + B*L*kv) / bandwidth)"


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """The sizes the bound and the ideal CDB speed-up need, for one model at one dtype."""
    name: str
    dtype: str
    core_weight_bytes: int
    kv_bytes_per_position_per_plane: int
    num_loops: int
    token_weight_bytes: int       # F0 of the ideal speed-up (``token_weight_bytes``)


def pass_seconds(batch: int, context: float, weight_bytes: float, kv_bytes: float,
                 bandwidth: float = DEFAULT_BANDWIDTH) -> float:
    """Time to read one pass's bytes at the given bandwidth."""
    return (weight_bytes + batch * context * kv_bytes) / bandwidth


def roofline_tokens_per_s(batch: int, context: float, mean_depth: float, weight_bytes: float,
                          kv_bytes: float, bandwidth: float = DEFAULT_BANDWIDTH, head_bytes: float = 0.0) -> float:
    """B / ((d̄ · (W + B·L·kv) + F0) / bandwidth); head_bytes F0: what one head step over the B
    rows reads (0: the core passes alone)."""
    return batch / (mean_depth * pass_seconds(batch, context, weight_bytes, kv_bytes, bandwidth)
                    + head_bytes / bandwidth)


def mean_context(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> float:
    """Mean over requests of prompt + output / 2."""
    return float(np.mean(np.asarray(prompt_lens, float) + np.asarray(output_lens, float) / 2))


def ideal_speedup(fixed_depth: float, mean_depth: float, loop_bytes: float, token_bytes: float) -> float:
    """DESIGN section 4's ideal CDB speed-up of an exit trace over fixed depth,
    (F0 + R·Fr) / (F0 + d̄·Fr), in bytes read: Fr = one loop pass (W + B·L·kv), F0 = the
    per-token weights (``token_weight_bytes``), R = fixed_depth, d̄ = mean_depth."""
    return (token_bytes + fixed_depth * loop_bytes) / (token_bytes + mean_depth * loop_bytes)


def token_weight_bytes(params) -> int:
    """F0's bytes: the weights a token reads once whatever its depth, i.e. every weight outside
    the looped core but the embedding table, whose one row a token gathers; the table counts
    where the head reads it (a tied lm_head). Ouro: the lm_head, the final norm and the gate."""
    import jax
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    embed = params.embed.size * params.embed.dtype.itemsize if params.lm_head is not None else 0
    return int(total - core_weight_bytes(params) - embed)


def core_weight_bytes(params) -> int:
    """Bytes of the looped core in a params pytree (Ouro / Nanbeige ``layers``; Huginn ``core`` + adapter)."""
    import jax
    parts = [params.core, params.adapter] if hasattr(params, "core") else [params.layers]
    return int(sum(x.size * x.dtype.itemsize for p in parts for x in jax.tree.leaves(p)))


def model_bytes(cfg, dtype: str = "bfloat16", name: str = "") -> ModelBytes:
    """W and kv for a ModelConfig, from the parameter shapes alone (nothing is allocated)."""
    from rltjax.checkpoints.hf import param_template
    from rltjax.cache.sizing import kv_bytes_per_token_per_plane
    template = param_template(cfg, dtype)
    return ModelBytes(name=name or cfg.arch, dtype=str(dtype), core_weight_bytes=core_weight_bytes(template),
                      kv_bytes_per_position_per_plane=int(kv_bytes_per_token_per_plane(cfg, dtype)),
                      num_loops=cfg.num_loops, token_weight_bytes=token_weight_bytes(template))


def roofline_report(mb: ModelBytes, batch: int, context: float, mean_depth: float | None,
                    measured_tokens_per_s: float | None, bandwidth: float = DEFAULT_BANDWIDTH) -> dict:
    """The bound for a measured run, its inputs, and the fraction of it reached."""
    depth_source = "measured exit depths"
    if mean_depth is None:
        mean_depth, depth_source = float(mb.num_loops), f"fixed depth R={mb.num_loops}"
    bound = roofline_tokens_per_s(batch, context, mean_depth, mb.core_weight_bytes,
                                  mb.kv_bytes_per_position_per_plane, bandwidth)
    fraction = None if measured_tokens_per_s is None else measured_tokens_per_s / bound
    return dict(formula=FORMULA, model=mb.name, dtype=mb.dtype, W_bytes=mb.core_weight_bytes,
                kv_bytes_per_position_per_plane=mb.kv_bytes_per_position_per_plane, B=batch,
                L=context, mean_depth=mean_depth, depth_source=depth_source, bandwidth=bandwidth,
                pass_ms=1e3 * pass_seconds(batch, context, mb.core_weight_bytes,
                                           mb.kv_bytes_per_position_per_plane, bandwidth),
                bound_tokens_per_s=bound, measured_tokens_per_s=measured_tokens_per_s, fraction=fraction)


def roofline_line(r: dict) -> str:
    """One human-readable line for a report."""
    frac = "" if r["fraction"] is None else f"; measured {r['measured_tokens_per_s']:.1f} = " \
                                            f"{100 * r['fraction']:.1f}% of it"
    return (f"roofline: B={r['B']} L={r['L']:.0f} d={r['mean_depth']:.2f} ({r['depth_source']}) "
            f"W={r['W_bytes'] / 1e9:.3f} GB kv={r['kv_bytes_per_position_per_plane']} B/pos/plane "
            f"bw={r['bandwidth'] / 1e12:.2f} TB/s -> pass {r['pass_ms']:.3f} ms, bound "
            f"{r['bound_tokens_per_s']:.1f} tok/s{frac}")
