"""The KV memory manager's benchmark: prefix caching, incremental pages and preemption.

    python scripts/bench_memory.py --quick --max-num-seqs 8 --num-requests 32        # CPU, tiny model
    python scripts/bench_memory.py --preset ouro-1.4b --max-num-seqs 64 --num-requests 512

Three parts, each a closed loop of ``--max-num-seqs`` clients on an in-process engine with
random weights (one engine per run, the same flags but the one compared):

- ``prefix``: two shared-prefix workloads, caching off then on. *system*: a common
  ``--system-prompt-len``-token prompt (ShareGPT text) before each ShareGPT question;
  *multi-turn*: ShareGPT conversations replayed turn by turn, each turn's prompt the whole
  conversation so far (earlier questions and the dataset's replies). Reported: TTFT p50/p99,
  output tokens/s and the prefix-cache hit rate (prompt tokens found / looked up).
- ``capacity``: first exchanges on a fixed pool (``--capacity-pages``, default half the pages
  ``--max-num-seqs`` requests reserve for their lifetimes), ``lifetime`` against
  ``incremental`` pages: requests running at once (mean over steps, max), tokens/s and
  preemptions.
- ``pressure``: the capacity workload on half that pool, recompute and swap preemption:
  preemptions, how they were served, tokens/s.

Every request's output length is its reply's (capped), with ``ignore_eos``. The JSON holds
each run's summary and the engine's counters.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from benchmarks import bench_tokenizer, dataset, metrics, report, startup, workload
from benchmarks.clients import clock, fold_ids

PARTS = ("prefix", "capacity", "pressure")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--system-prompt-len", type=int, default=512, help="tokens of the shared system prompt")
    p.add_argument("--turns", type=int, default=3, help="turns a multi-turn conversation replays at most")
    p.add_argument("--capacity-pages", type=int, default=None,
                   help="KV pool of the capacity runs (default: half the pages max_num_seqs requests reserve "
                        "for their lifetimes; the pressure runs get half of it)")
    startup.add_model_arguments(p)
    workload.add_workload_arguments(p)
    return p


@dataclasses.dataclass
class Turn:
    prompt_ids: list[int]
    output_len: int


def sessions_system(pairs, tok, args) -> list[list[Turn]]:
    """The shared system prompt before each sampled question: one turn a session."""
    text = " ".join(reply for _, _, reply in pairs[:200])
    system = list(tok.encode(text))[:args.system_prompt_len]
    reqs = dataset.sample_requests(pairs, tok.encode, args.num_requests[0], args.seed,
                                   max_output_len=args.max_output_len, max_prompt_len=args.max_prompt_len)
    return [[Turn(system + list(r.prompt_ids), r.output_len)] for r in reqs]


def sessions_multi_turn(data, tok, args) -> list[list[Turn]]:
    """Conversations of two or more exchanges, replayed: turn k's prompt is every earlier
    question and reply, then question k."""
    out = []
    rng = np.random.default_rng(args.seed)
    for i in rng.permutation(len(data.records)):
        conv = data.records[i].get("conversations") if isinstance(data.records[i], dict) else None
        if not isinstance(conv, list):
            continue
        turns, context = [], []
        for q, a in zip(conv[::2], conv[1::2]):
            if not (isinstance(q, dict) and isinstance(a, dict) and q.get("from") in dataset.HUMAN_ROLES):
                break
            question, reply = list(tok.encode(str(q.get("value", "")))), list(tok.encode(str(a.get("value", ""))))
            context += question
            if len(context) > args.max_prompt_len or not question or not reply:
                break
            turns.append(Turn(list(context), min(len(reply), args.max_output_len)))
            context += reply
            if len(turns) == args.turns:
                break
        if len(turns) >= 2:
            out.append(turns)
        if sum(map(len, out)) >= args.num_requests[0]:
            break
    return out


def run_sessions(engine, sessions: list[list[Turn]], clients: int, tag: str) -> dict:
    """``clients`` closed-loop clients, each replaying one session's turns in order."""
    from rltjax.sampling_params import SamplingParams
    vocab, queue = engine.cfg.vocab_size, list(enumerate(sessions))
    active, timings, running = {}, [], []
    before = engine.stats()
    t0 = clock()

    def submit(sid, session, k):
        rid = f"{tag}-{sid}-{k}"
        t = metrics.RequestTiming(start=clock(), prompt_tokens=len(session[k].prompt_ids))
        timings.append(t)
        active[rid] = (sid, session, k, t)
        engine.add_request(rid, fold_ids(session[k].prompt_ids, vocab), SamplingParams(
            max_tokens=session[k].output_len, temperature=0.0, ignore_eos=True, seed=sid))

    while queue or active:
        while queue and len({a[0] for a in active.values()}) < clients:
            sid, session = queue.pop(0)
            submit(sid, session, 0)
        outputs = engine.step()
        running.append(len(engine.scheduler.running))
        now = clock()
        for out in outputs:
            sid, session, k, t = active[out.request_id]
            t.arrivals.extend([now] * (len(out.token_ids) - t.output_tokens))
            t.output_tokens = len(out.token_ids)
            if out.finished:
                t.end, t.exit_depths = now, list(out.exit_depths)
                t.error = out.error if out.finish_reason == "error" else None
                del active[out.request_id]
                engine.forget(out.request_id)
                if k + 1 < len(session):
                    submit(sid, session, k + 1)
    summary = metrics.summarize(timings, clock() - t0)
    after = dataclasses.asdict(engine.stats())
    counted = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_swapped", "num_recomputed")
    stats = {k: v - getattr(before, k) if k in counted else v for k, v in after.items()}   # this run's
    return dict(summary=summary, running_mean=float(np.mean(running)), running_max=int(max(running)), stats=stats,
                hit_rate=stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]))


def _engine(args, max_model_len, **flags):
    for k, v in flags.items():
        setattr(args, k, v)
    engine, _ = startup.build_engine_from_args(args, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len)
    return engine


def _line(name: str, r: dict) -> str:
    s = r["summary"]
    return (f"{name:<34} {s['output_throughput']:9.1f} tok/s  TTFT p50 {s['ttft_ms']['p50']:8.1f} p99 "
            f"{s['ttft_ms']['p99']:8.1f} ms  hit {100 * r['hit_rate']:5.1f}%  running mean {r['running_mean']:5.1f} "
            f"max {r['running_max']:3d}  preempted {r['stats']['num_preemptions']} "
            f"(swapped {r['stats']['num_swapped']})  failed {s['failed']}")


def run(args) -> dict:
    cfg, _ = startup.model_config(args)
    data = dataset.load_sharegpt(args.dataset)
    pairs = dataset.exchanges(data)
    tok = bench_tokenizer.trained_tokenizer(pairs, args.tokenizer_vocab_size or cfg.vocab_size)
    max_model_len = args.max_model_len or args.system_prompt_len + args.max_prompt_len + args.max_output_len
    env = report.environment(with_jax=True)
    result = dict(kind="memory", config=vars(args).copy(), environment=env, runs={})
    report.print_header(env, result["config"])
    firsts = [[Turn(list(r.prompt_ids), r.output_len)] for r in dataset.sample_requests(
        pairs, tok.encode, args.num_requests[0], args.seed, max_output_len=args.max_output_len,
        max_prompt_len=args.max_prompt_len)]
    warm = [[Turn(s[0].prompt_ids[:16], 2)] for s in firsts[:2]]
    runs = []
    if "prefix" in args.parts:
        workloads = dict(system=sessions_system(pairs, tok, args), multi_turn=sessions_multi_turn(data, tok, args))
        for name, sessions in workloads.items():
            for caching in (False, True):
                runs.append((f"prefix/{name}/{'on' if caching else 'off'}", sessions,
                             dict(enable_prefix_caching=caching)))
    planes = cfg.num_loops if args.kv_layout == "last_exited" else 1
    # half the pages the first max_num_seqs requests reserve for their lifetimes: lifetime
    # reservation runs about half of them at once
    need = sum(-(-(len(s[0].prompt_ids) + s[0].output_len) // args.page_size) for s in firsts[:args.max_num_seqs])
    largest = max(-(-(len(s[0].prompt_ids) + s[0].output_len) // args.page_size) for s in firsts)
    pages = args.capacity_pages or 1 + planes * max(need // 2, largest)
    if "capacity" in args.parts:
        for allocation in ("lifetime", "incremental"):
            runs.append((f"capacity/{allocation}", firsts, dict(kv_allocation=allocation, num_pages=pages)))
    if "pressure" in args.parts:
        for mode in ("recompute", "swap"):
            small = 1 + planes * max((pages - 1) // planes // 2, largest)
            runs.append((f"pressure/{mode}", firsts, dict(preemption_mode=mode, num_pages=small)))
    out = workload.out_dir(args, "memory")
    out.mkdir(parents=True, exist_ok=True)
    for name, sessions, flags in runs:
        engine = _engine(args, max_model_len, **{"enable_prefix_caching": False, "num_pages": None,
                                                 "kv_allocation": "incremental", "preemption_mode": "swap",
                                                 **flags})
        run_sessions(engine, warm, 2, "warm")                  # compiles outside the timed run
        t = time.perf_counter()
        r = run_sessions(engine, sessions, args.max_num_seqs, name.replace("/", "-"))
        r.update(flags=flags, num_pages=engine.scheduler.allocator.num_pages, seconds=time.perf_counter() - t,
                 replay_mismatches=engine.replay_mismatches)
        result["runs"][name] = r
        print(_line(name, r), flush=True)
        del engine
        report.write_json(out / "results.json", result)   # after every run: a time-limited call keeps its runs
    print(f"[bench] wrote {out / 'results.json'}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
