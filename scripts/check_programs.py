"""Record the programs an engine's start-up compiles, and compare two records.

A refactor of the engine's host side must not change what runs on the device. This
script builds engines on the tiny fixture checkpoints in several configurations (the
decode windows with standby entries and mixed prefill, the step-by-step and async
paths, Huginn's boundary stages, the Pallas kernels in interpret mode), lets each
compile every executable ahead (``compile_ahead``), and records the StableHLO that jit
hands to XLA (``jax_dump_ir_to``). Each module is normalised so that only the
computation remains: module, function and value names, ``jax.arg_info`` /
``jax.result_info`` names and locations are dropped, and the entry function's
parameters are renumbered in the order the body first uses them (a parameter order
that changes with how arguments are grouped into pytrees does not count; what each
parameter is, its type, donation and aliasing, does).

    python scripts/check_programs.py --out before.json          # on the old tree
    python scripts/check_programs.py --out after.json --compare before.json

``--compare`` prints, per configuration, how many programs are equal, and names the
ones found on one side only; it exits 1 when any engine step differs.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "fixtures"

# Each configuration: (name, fixture, hf_overrides, CacheConfig, SchedulerConfig, ExitConfig, ExecutionConfig) kwargs.
CONFIGS = {
    # windows of 8 and 16 rows take standby entries; 32 rows carry mixed prefill (auto)
    "ouro-windows": ("ouro-tiny", {}, dict(page_size=8), dict(max_num_seqs=32), dict(mode="ouro"), {}),
    "ouro-window-rows": ("ouro-tiny", {}, dict(page_size=8), dict(max_num_seqs=16), dict(mode="ouro_delayed"),
                         dict(decode_window_rows=8)),
    "ouro-mixed-8": ("ouro-tiny", {}, dict(page_size=8), dict(max_num_seqs=8), dict(mode="random_lookahead"),
                     dict(mixed_prefill_tokens=64)),
    "ouro-shared-steps": ("ouro-tiny", {}, dict(page_size=4, kv_layout="shared"), dict(max_num_seqs=4),
                          dict(mode="ouro"), dict(decode_window=0)),
    "ouro-async": ("ouro-tiny", {}, dict(page_size=4), dict(max_num_seqs=4), dict(mode="ouro_delayed"),
                   dict(decode_window=0, async_scheduling=True)),
    "ouro-no-refill": ("ouro-tiny", {}, dict(page_size=4), dict(max_num_seqs=4, mode="no_refill"),
                       dict(mode="ouro"), {}),
    "ouro-early-stop-cap": ("ouro-tiny", {}, dict(page_size=4), dict(max_num_seqs=4), dict(mode="ouro"),
                            dict(window_trip="early_stop", decode_window=4)),
    "nanbeige-trace": ("nanbeige-tiny", {}, dict(page_size=4), dict(max_num_seqs=4),
                       dict(mode="trace", depths_by_request={}), {}),
    "huginn-windows": ("huginn-tiny", {"state_init": "zero"}, dict(page_size=4, max_loops=6), dict(max_num_seqs=8),
                       dict(mode="latent_diff"), {}),
    "huginn-steps": ("huginn-tiny", {}, dict(page_size=4), dict(max_num_seqs=4), dict(mode="fixed"),
                     dict(decode_window=0)),
    # the GPU's choices (attention, projections and norms on the Pallas kernels, Ouro's shapes
    # at head_dim 64, the smallest the kernels take), run in interpret mode on the CPU
    "ouro-gpu-path": ("gpu:ouro-1.4b", {}, dict(page_size=8), dict(max_num_seqs=32), dict(mode="ouro"),
                      dict(interpret=True)),
    "ouro-pallas-interpret": ("small:ouro-1.4b", {}, dict(page_size=8), dict(max_num_seqs=8), dict(mode="ouro"),
                              dict(attn_impl="pallas", matmul_impl="pallas", interpret=True)),
}
# the preset's shapes cut down to a model the CPU compiles in seconds (head_dim 64)
SMALL = {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "hidden_size": 128,
         "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
         "vocab_size": 256, "max_position_embeddings": 256}


def _weights(source: str, overrides: dict):
    """(cfg, params) of a fixture, or of a preset cut to SMALL with random weights."""
    try:        # the installed layout, else the repository's top-level packages
        from rltjax.checkpoints.loader import load_checkpoint
        from rltjax.checkpoints.random_init import random_checkpoint
    except ImportError:
        from checkpoints.loader import load_checkpoint
        from checkpoints.random_init import random_checkpoint
    if ":" in source:
        from rltjax.presets import preset_config
        cfg = preset_config(source.split(":")[1], SMALL)
        return cfg, random_checkpoint(cfg, seed=1, dtype="float32")
    ckpt = load_checkpoint(FIXTURES / source, dtype="float32", hf_overrides=overrides or None)
    return ckpt.cfg, ckpt.params


def record(name: str, dump_dir: Path) -> None:
    import jax
    from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
    from rltjax.entrypoints.llm import build_engine
    source, overrides, cache, sched, exits, execution = CONFIGS[name]
    cfg, params = _weights(source, overrides)
    backend = jax.default_backend
    if source.startswith("gpu:"):   # the engine picks what it would on a GPU; interpret mode runs it here
        jax.default_backend = lambda: "gpu"
    jax.config.update("jax_dump_ir_to", str(dump_dir))
    jax.config.update("jax_dump_ir_modes", "stablehlo")
    jax.config.update("jax_include_debug_info_in_dumps", False)
    try:
        build_engine(None, params=params, cfg=cfg, cache_config=CacheConfig(**cache),
                     scheduler_config=SchedulerConfig(max_num_batched_tokens=32, prefill_chunk_size=16, **sched),
                     exit_config=ExitConfig(**exits),
                     execution_config=ExecutionConfig(compile_ahead=True, compilation_cache_dir=None,
                                                      executable_cache=False, show_progress=False, **execution))
    finally:
        jax.config.update("jax_dump_ir_to", "")
        jax.default_backend = backend


_ARG = re.compile(r"%arg(\d+)\b")
_SIGNATURE = re.compile(r"func\.func public @main\((.*?)\)\s*->\s*(.*?)\{\n", re.S)


def _split_top(s: str) -> list[str]:
    """Split a signature's argument list at commas outside brackets."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "<({[":
            depth += 1
        elif ch in ">)}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def normalise(text: str) -> str:
    """The module's computation with names, locations and the parameter order taken out."""
    text = re.sub(r'\s*jax\.(arg|result)_info = "[^"]*"', "", text)
    text = re.sub(r"\{\s*,\s*", "{", re.sub(r",\s*\}", "}", text))
    text = re.sub(r"\{\s*\}", "", text)
    text = re.sub(r"\bloc\([^)]*\)", "", text)
    text = re.sub(r"^module @[\w.$-]+", "module @m", text, flags=re.M)
    # private functions named by order of first appearance
    names = []
    for n in re.findall(r"@([\w.$-]+)", text):
        if n not in ("main", "m") and n not in names:
            names.append(n)
    for i, n in enumerate(sorted(names, key=len, reverse=True)):
        text = re.sub(rf"@{re.escape(n)}\b", f"@__f{names.index(n)}", text)
    match = _SIGNATURE.search(text)
    if not match:
        return text
    args = _split_top(match.group(1))
    body_start = match.end()
    main_end = text.find("\n  }\n", body_start)
    body = text[body_start:main_end]
    # %argN past the entry's parameters are block arguments of nested regions (reductions,
    # loops): renumbered by first appearance in a namespace of their own
    order, nested = [], {}
    for m in _ARG.finditer(body):
        i = int(m.group(1))
        if i < len(args) and i not in order:
            order.append(i)
        elif i >= len(args):
            nested.setdefault(i, len(nested))
    unused = sorted((i for i in range(len(args)) if i not in order), key=lambda i: args[i].split(":", 1)[1])
    order += unused
    rename = {old: new for new, old in enumerate(order)}
    body = _ARG.sub(lambda m: (f"%a{rename[int(m.group(1))]}" if int(m.group(1)) < len(args)
                               else f"%b{nested[int(m.group(1))]}"), body)
    sig = ", ".join(f"%a{rename[i]}:{args[i].split(':', 1)[1]}" for i in order)
    return text[:match.start()] + f"func.func public @main({sig}) -> {match.group(2)}{{\n" + body + text[main_end:]


def collect(name: str, texts: Path | None = None) -> dict[str, list[str]]:
    """{normalised digest: [module names]} of the programs one configuration compiles;
    texts: a folder for the normalised modules (to diff two records' programs)."""
    import jax
    jax.clear_caches()      # every configuration compiles all of its programs
    with tempfile.TemporaryDirectory() as tmp:
        record(name, Path(tmp))
        found = collections.defaultdict(list)
        for path in sorted(Path(tmp).glob("*.mlir")):
            text = path.read_text()
            module = re.search(r"^module @([\w.$-]+)", text, re.M)
            norm = normalise(text)
            digest = hashlib.sha256(norm.encode()).hexdigest()[:16]
            if texts is not None:
                texts.mkdir(parents=True, exist_ok=True)
                (texts / f"{name}-{digest}.mlir").write_text(norm)
            found[digest].append(module.group(1) if module else path.stem)
        return dict(found)


def is_step(module_names: list[str]) -> bool:
    """Engine steps (jit of the engine's own functions), not jnp's one-op programs."""
    return any(not re.fullmatch(r"jit_(convert_element_type|broadcast_in_dim|_?\w{1,20})", n)
               or "step" in n or "window" in n or "merge" in n for n in module_names)


def compare(before: dict, after: dict) -> bool:
    ok = True
    for name in (n for n in CONFIGS if n in before and n in after):
        b, a = before[name], after[name]
        same = sorted(set(b) & set(a))
        only_b = {d: b[d] for d in set(b) - set(a)}
        only_a = {d: a[d] for d in set(a) - set(b)}
        steps_b = sum(len(v) for d, v in b.items() if is_step(v))
        print(f"{name}: {len(same)} programs equal ({sum(len(b[d]) for d in same)} compiles before, "
              f"{sum(len(a[d]) for d in same)} after; {steps_b} engine-step compiles before)")
        for label, side in (("only before", only_b), ("only after", only_a)):
            for digest, names in sorted(side.items()):
                print(f"  {label}: {digest} {sorted(set(names))} x{len(names)}")
                ok &= not is_step(names)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file for this tree's record")
    ap.add_argument("--compare", help="an earlier record to compare with")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--texts", type=Path, help="a folder for the normalised modules")
    args = ap.parse_args(argv)
    recorded = {name: collect(name, args.texts) for name in args.configs}
    Path(args.out).write_text(json.dumps(recorded, indent=1, sort_keys=True))
    print(f"recorded {sum(len(v) for v in recorded.values())} distinct programs in {len(recorded)} "
          f"configurations -> {args.out}")
    if args.compare:
        return 0 if compare(json.loads(Path(args.compare).read_text()), recorded) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
