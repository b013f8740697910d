"""Self-speculative decoding on converging random weights: acceptance, tokens per round, and
the device-side round against the same round driven from the host.

    python scripts/bench_speculation.py                  # the tiny Ouro fixture, CPU, float32
    python scripts/bench_speculation.py --preset ouro-1.4b --dtype bfloat16     # a GPU

Part 1, per branch scale (``checkpoints.random_init.converging``): C greedy requests through the
engine with speculation; the draft acceptance the engine counted, the tokens each round made
(decode tokens / (decode tokens - kept drafts): a round makes its kept drafts and one more), and
the same workload's tokens/s without speculation at the target depth.

Part 2, at the last scale: the C requests are prefilled and their windows read; then the same
``--rounds`` rounds run twice from the same KV: as device windows of one round each, launched
back to back with one read at the end (what the engine runs), and from the host: each draft's
token read before the next draft launches, the target's tokens read after the verify, the
acceptance in numpy. The tokens must agree; the ratio of the two times is the device-side
round's gain.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.speculation import break_even  # noqa: E402


def build(cfg, params, args, spec):
    from rltjax.engine_config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
    from rltjax.entrypoints.llm import build_engine
    # a pool of its own size (not 90% of a GPU): part 2 copies it to start both variants from one KV
    return build_engine(None, params=params, cfg=cfg, cache_config=CacheConfig(page_size=16, num_pages=2048),
                        scheduler_config=SchedulerConfig(max_num_seqs=args.concurrency, max_model_len=1024),
                        exit_config=ExitConfig(mode="fixed"), speculative_config=spec,
                        execution_config=ExecutionConfig(compile_ahead=True, show_progress=False))


def generate(engine, prompts, tokens: int) -> tuple[float, int]:
    from rltjax.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"g{time.perf_counter_ns()}-{i}", p, sp)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0, len(prompts) * tokens


def part1(cfg, base, args, prompts, spec_config):
    from rltjax.checkpoints.random_init import converging
    for scale in args.scales:
        params = converging(base, scale)
        plain = build(cfg, params, args, None)
        generate(plain, prompts, 4)                               # first calls
        t_plain, n = generate(plain, prompts, args.tokens)
        del plain
        engine = build(cfg, params, args, spec_config)
        generate(engine, prompts, 4)
        before = engine.stats()
        t_spec, _ = generate(engine, prompts, args.tokens)
        after = engine.stats()
        drafted = after.spec_draft_tokens - before.spec_draft_tokens
        kept = after.spec_accepted_tokens - before.spec_accepted_tokens
        decode = n - len(prompts)                                 # the first tokens come from prefill
        by_pos = [a - b for a, b in zip(after.spec_accepted_by_position, before.spec_accepted_by_position)]
        print(f"scale {scale:g}: acceptance {kept / max(drafted, 1):.3f} (kept by position {by_pos}), "
              f"{decode / max(decode - kept, 1):.2f} tokens a round; {n / t_spec:.1f} tok/s speculative, "
              f"{n / t_plain:.1f} plain ({t_plain / t_spec:.2f}x)", flush=True)
        del engine
    return params


def ready(engine, prompts, rounds: int):
    """The requests prefilled and decoding, nothing in flight, pages for ``rounds`` rounds."""
    from rltjax.engine.sequence import Status
    from rltjax.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=engine.settings.max_model_len - max(map(len, prompts)), temperature=0.0,
                        ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    while not all(r.status is Status.LOOPING and r.output_token_ids for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    engine._drain()                     # every launched window read; the next starts from the host
    sp_settings = engine.settings.window.speculative
    assert engine.scheduler.admission.reserve_window(-(-rounds // sp_settings.rounds))
    return list(engine.scheduler.running)


def device_rounds(engine, requests, rounds: int):
    import jax
    from rltjax.engine.window.rows import pad_rows_to, window_rows
    s, runner = engine.settings, engine.runner
    rows = pad_rows_to(window_rows(requests, layered=True, num_planes=s.num_planes, trace_width=1),
                       s.window.bucket_for(len(requests)), s.dummy_slot)
    owners = np.full(s.max_num_seqs + 1, -1, np.int32)
    for r in requests:
        owners[r.slot] = rows.tag[requests.index(r)]
    tables = engine.batches.block_tables()
    jax.block_until_ready(runner.kv.k)
    t0 = time.perf_counter()
    reads = []
    for _ in range(rounds):
        rows, pending = runner.window(rows, tables, None, owners, "greedy")
        reads.append(pending)
    outs = [p.read() for p in reads]
    elapsed = time.perf_counter() - t0
    tokens = [np.concatenate([o.out.tokens[i, :o.out.count[i]] for o in outs]) for i in range(len(requests))]
    return elapsed, tokens


class HostRounds:
    """The same rounds with a host read after every draft and after the verify (its draft and
    verify programs are the device round's own pieces, compiled once)."""

    def __init__(self, engine):
        import jax
        import jax.numpy as jnp
        from rltjax.engine.window import speculative
        self.engine, s, runner = engine, engine.settings, engine.runner
        self.sp, spec = s.window.speculative, runner.window_spec("greedy")
        ctx = types.SimpleNamespace(spec=spec, inputs=types.SimpleNamespace(block_tables=engine.batches.block_tables()))
        weights, model, k, d = runner.params, spec.model, self.sp.num_tokens, self.sp.draft_loops

        def draft(kv, x, rows, p, first):
            run = rows.active & (p <= jnp.minimum(rows.spec_tokens, k))
            x, kv = speculative._draft(ctx, weights, rows, kv, x, p, first, run)
            tok = jnp.argmax(model.head(weights, x, project=spec.backend.head_matmul), axis=-1).astype(jnp.int32)
            return kv, x, tok, model.embed(weights, tok)[0]

        def verify(kv, states, rows, start):
            target, kv = speculative._verify(ctx, weights, rows, kv, states, jnp.minimum(rows.spec_tokens, k), start,
                                             d, self.sp.target_loops)
            return kv, jnp.argmax(target, axis=-1).astype(jnp.int32)
        self.draft, self.verify = jax.jit(draft, donate_argnums=0), jax.jit(verify, donate_argnums=0)
        self.embed = jax.jit(lambda t: model.embed(weights, t)[0])

    def run(self, requests, rounds: int):
        import jax
        import jax.numpy as jnp
        from rltjax.engine.window.rows import pad_rows_to, window_rows
        s, runner, k = self.engine.settings, self.engine.runner, self.sp.num_tokens
        host = pad_rows_to(window_rows(requests, layered=True, num_planes=s.num_planes, trace_width=1),
                           s.window.bucket_for(len(requests)), s.dummy_slot)
        n = len(requests)
        made = [[] for _ in range(n)]
        kv = runner.kv
        jax.block_until_ready(kv.k)
        t0 = time.perf_counter()
        for _ in range(rounds):
            rows = jax.device_put(host)
            start = jnp.asarray(host.loops_done)
            zero = jnp.zeros_like(start)
            x = self.embed(rows.tokens)
            states, drafts = [], []
            for p in range(k + 1):
                kv, state, tok, x = self.draft(kv, x, rows, jnp.int32(p), start if p == 0 else zero)
                states.append(state)
                drafts.append(np.asarray(tok))                    # the host read between drafts
            kv, best = self.verify(kv, jnp.stack(states, 1), rows, start)
            best = np.asarray(best)
            for i in range(n):
                kept = 0
                while kept < k and best[i, kept] == drafts[kept][i]:
                    kept += 1
                made[i] += best[i, :kept + 1].tolist()
                host.tokens[i], host.positions[i] = best[i, kept], host.positions[i] + kept + 1
                host.num_out[i] += kept + 1
                host.loops_done[i] = 0
        elapsed = time.perf_counter() - t0
        runner.kv = kv
        return elapsed, [np.asarray(m) for m in made]


def part2(cfg, params, args, prompts, spec_config):
    import jax
    import jax.numpy as jnp
    engine = build(cfg, params, args, dataclasses.replace(spec_config, rounds_per_window=1))
    requests = ready(engine, prompts, args.rounds + 2)
    kv0 = jax.tree.map(jnp.copy, engine.runner.kv)
    device_rounds(engine, requests, 2)                            # first calls
    engine.runner.kv = jax.tree.map(jnp.copy, kv0)
    t_dev, dev_tokens = device_rounds(engine, requests, args.rounds)
    engine.runner.kv = jax.tree.map(jnp.copy, kv0)
    host = HostRounds(engine)
    host.run(requests, 2)
    engine.runner.kv = jax.tree.map(jnp.copy, kv0)
    t_host, host_tokens = host.run(requests, args.rounds)
    same = all(np.array_equal(a, b) for a, b in zip(dev_tokens, host_tokens))
    total = sum(len(t) for t in dev_tokens)
    print(f"{args.rounds} rounds x {len(requests)} requests ({total} tokens): device-side {t_dev * 1e3:.1f} ms, "
          f"host reads between drafts {t_host * 1e3:.1f} ms: {t_host / t_dev:.2f}x; same tokens: {same}")
    return same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="random weights at a preset's shape (default: tests' ouro-tiny)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.1, 0.05, 0.02])
    ap.add_argument("--speculative-tokens", type=int, default=4)
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--target-loops", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--head-cost", type=float, default=0.25, help="a head's cost in loop passes (break-even)")
    args = ap.parse_args(argv)
    from rltjax.checkpoints.random_init import random_checkpoint
    from rltjax.engine_config import SpeculativeConfig
    if args.preset:
        from rltjax.presets import preset_config
        cfg = preset_config(args.preset)
        base = random_checkpoint(cfg, seed=0, dtype=args.dtype)
    else:
        from rltjax.checkpoints.loader import load_checkpoint
        ckpt = load_checkpoint(os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "ouro-tiny"),
                               dtype=args.dtype)
        cfg, base = ckpt.cfg, ckpt.params
    spec = SpeculativeConfig(args.speculative_tokens, args.draft_loops, args.target_loops)
    depth = args.target_loops or cfg.num_loops
    prompts = [np.random.default_rng(i).integers(3, cfg.vocab_size, 16).tolist() for i in range(args.concurrency)]
    print(f"K = {spec.num_speculative_tokens}, d = {spec.draft_loops}, D = {depth}; {args.concurrency} greedy "
          f"requests x {args.tokens} tokens")
    params = part1(cfg, base, args, prompts, spec)
    same = part2(cfg, params, args, prompts, spec)
    for k in (2, 4, 8):
        print(f"K = {k}: a round pays from acceptance {break_even(k, args.draft_loops, depth, args.head_cost):.3f} "
              f"(head = {args.head_cost} pass)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
