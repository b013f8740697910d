"""Exit-trace record and replay.

A trace pins what a run decided: per request the prompt, the sampling settings,
the output tokens and the exit depth of every token, plus what they depend on
(a fingerprint of the model's config and weights, the dtype, the KV layout and
the exit mode that produced them). Replaying it runs the same requests with
``ExitConfig(mode="trace")`` (each token loops exactly its recorded depth, no
gate) and checks that the outputs come back token for token, so a benchmark of
adaptive depth can be repeated exactly, and a trace from another model,
dtype or layout is rejected before it runs.

    trace = ExitTrace.record(llm, prompts, outputs, params)   # after llm.generate(...)
    trace.save("trace.json")
    trace = ExitTrace.load("trace.json")
    llm = LLM(model, exit_config=trace.exit_config(), ...)
    outputs = trace.replay(llm)                  # raises TraceMismatchError on any difference
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rltjax.engine_config import ExitConfig
from rltjax.models.layers import SplitLayers, unfuse_qkv
from rltjax.sampling_params import SamplingParams

FORMAT = "rltjax-exit-trace/1"


class TraceMismatchError(ValueError):
    """A trace that does not belong to this engine, or outputs that differ from it."""


@jax.jit
def _leaf_digest(x: jax.Array) -> jax.Array:
    """[2] uint32: wrap-around sums of the raw bits and of bits x (position hash). Integer
    sums do not depend on reduction order, so the digest is the same on every backend."""
    bits = jax.lax.bitcast_convert_type(x.reshape(-1), {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
    bits = bits.astype(jnp.uint32)
    weights = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)])


_POSITION_HASH = 2654435761      # _leaf_digest's position weights: i * _POSITION_HASH + 1


def _stacked_digest(digests: list, m: int) -> jax.Array:
    """``_leaf_digest`` of a stack from its layers' digests (each layer m elements): stacked,
    layer l's element i sits at l * m + i, so its weight gains l * m * _POSITION_HASH (uint32
    sums wrap, so the split is exact); no stacked copy is built."""
    total, weighted = jnp.uint32(0), jnp.uint32(0)
    for layer, d in enumerate(digests):
        shift = jnp.uint32((layer * m * _POSITION_HASH) % 2**32)
        total, weighted = total + d[0], weighted + d[1] + shift * d[0]
    return jnp.stack([total, weighted])


def _stacked_view(cfg, params):
    """(shapes, digests): two trees shaped like ``params`` with its layer stacks stacked, split
    (``SplitLayers``, q | k | v fused or not) or not, so the fingerprint does not depend on the
    layout."""
    shapes, digests = {}, {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, SplitLayers):
            layer_digests, shape = [], None
            for layer in value.layers:          # one layer's unfused q / k / v copies at a time
                plain = unfuse_qkv(layer, cfg.q_width, cfg.kv_width)
                layer_digests.append(jax.tree.map(_leaf_digest, plain))
                shape = shape or jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct((len(value.layers),) + x.shape, x.dtype), plain)
            shapes[f.name] = shape
            digests[f.name] = jax.tree.map(lambda s, *ds: _stacked_digest(ds, math.prod(s.shape[1:])),
                                           shape, *layer_digests)
        elif value is not None:
            shapes[f.name] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), value)
            digests[f.name] = jax.tree.map(_leaf_digest, value)
    return dataclasses.replace(params, **shapes), dataclasses.replace(params, **digests)


def model_fingerprint(cfg, params) -> str:
    """sha256 over the config and every weight's name, shape, dtype and bit digest. Layer
    stacks count as stacked whether they are or are held per layer (``SplitLayers``)."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode())
    shapes, digests = _stacked_view(cfg, params)
    for (path, leaf), digest in zip(jax.tree_util.tree_leaves_with_path(shapes), jax.tree.leaves(digests)):
        h.update(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype}".encode())
        h.update(np.asarray(digest).tobytes())
    return h.hexdigest()[:32]


def _params_dict(sp: SamplingParams) -> dict[str, Any]:
    d = dataclasses.asdict(sp)
    d["stop_token_ids"] = list(d["stop_token_ids"])
    d["stop"] = [d["stop"]] if isinstance(d["stop"], str) else list(d["stop"])
    return d


@dataclasses.dataclass
class ExitTrace:
    fingerprint: str
    arch: str
    dtype: str
    kv_layout: str
    exit_mode: str
    records: list[dict[str, Any]]       # request_id, prompt_token_ids, sampling, token_ids, exit_depths

    @classmethod
    def record(cls, llm, prompts: Sequence[Any], outputs: Sequence[Any],
               sampling_params: SamplingParams | Sequence[SamplingParams]) -> "ExitTrace":
        """From one ``llm.generate(prompts, sampling_params)`` call and its outputs. Requests
        need a fixed seed (or temperature 0) for their tokens to be reproducible."""
        engine = llm.engine
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(outputs)
        records = []
        for i, (out, sp) in enumerate(zip(outputs, sampling_params)):
            if sp.temperature > 0 and sp.seed is None:
                raise TraceMismatchError(f"request {i}: a sampled request needs SamplingParams.seed to be "
                                         f"replayable (or temperature=0)")
            records.append(dict(request_id=f"t{i}", prompt_token_ids=list(out.prompt_token_ids),
                                sampling=_params_dict(sp), token_ids=list(out.token_ids),
                                exit_depths=list(out.exit_depths)))
        return cls(engine.model_fingerprint(), engine.cfg.arch, engine.dtype_name,
                   engine.settings.kv_layout, engine.settings.exit_config.mode, records)

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(dict(format=FORMAT, **dataclasses.asdict(self)), f)

    @classmethod
    def load(cls, path) -> "ExitTrace":
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != FORMAT:
            raise TraceMismatchError(f"{path}: not an exit trace of format {FORMAT!r} (got {data.get('format')!r})")
        data.pop("format")
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(data) != fields:
            raise TraceMismatchError(f"{path}: fields {sorted(data)} differ from {sorted(fields)}")
        return cls(**data)

    @property
    def mean_depth(self) -> float:
        depths = [d for r in self.records for d in r["exit_depths"][1:]]
        return float(np.mean(depths)) if depths else float("nan")

    def depth_histogram(self) -> dict[int, int]:
        values, counts = np.unique([d for r in self.records for d in r["exit_depths"][1:]], return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts)}

    def exit_config(self) -> ExitConfig:
        """The ExitConfig that replays this trace (each token's recorded depth)."""
        def depths(r):   # an early stop (EOS) leaves fewer than max_tokens: pad with a valid depth
            d = [int(x) for x in r["exit_depths"]]
            return d + [int(r["sampling"]["min_loops"])] * max(0, r["sampling"]["max_tokens"] - len(d))
        return ExitConfig(mode="trace", depths_by_request={r["request_id"]: depths(r) for r in self.records})

    def check_engine(self, engine) -> None:
        """Reject an engine whose model, dtype or KV layout differs from the recording's."""
        ours = dict(dtype=engine.dtype_name, kv_layout=engine.settings.kv_layout, arch=engine.cfg.arch,
                    fingerprint=engine.model_fingerprint())     # the most specific explanation first
        for key, value in ours.items():
            if getattr(self, key) != value:
                raise TraceMismatchError(f"trace {key} is {getattr(self, key)!r} but this engine's is {value!r}: "
                                         f"the trace was recorded with a different "
                                         f"{'model or weights' if key in ('fingerprint', 'arch') else key}")

    def replay(self, llm, use_tqdm: bool = False) -> list:
        """Run every recorded request with its recorded depths and check the outputs."""
        engine = llm.engine
        self.check_engine(engine)
        if engine.settings.exit_config.mode != "trace":
            raise TraceMismatchError("replay needs an LLM built with exit_config=trace.exit_config()")
        outputs = []
        for r in self.records:
            engine.add_request(r["request_id"], r["prompt_token_ids"], SamplingParams(**r["sampling"]))
        while engine.has_unfinished_requests():
            engine.step()
        for r in self.records:
            out = engine.get_output(r["request_id"])
            engine.forget(r["request_id"])
            outputs.append(out)
            if out.token_ids != r["token_ids"] or out.exit_depths != r["exit_depths"]:
                first = next((i for i, (a, b) in enumerate(zip(out.token_ids, r["token_ids"])) if a != b),
                             min(len(out.token_ids), len(r["token_ids"])))
                raise TraceMismatchError(
                    f"request {r['request_id']!r}: replayed output differs from the recording at token {first} "
                    f"(recorded {r['token_ids'][first:first + 4]}, replayed {out.token_ids[first:first + 4]})")
        return outputs
