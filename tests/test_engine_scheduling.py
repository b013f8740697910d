"""Engine scheduling (DESIGN section 2): exact traces of ``refill`` (CDB), ``no_refill`` and
``min_coda_batch_size``; batch invariance; admission (bypass limit, scan limit,
max_num_seqs) and forced decode after prefill batches.

Engines are built with the same shapes (page_size 4, 4 seqs, the default pool) so
their jitted steps are compiled once per process; only the small-pool engines used
for admission add a second set.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engine_helpers import assert_all_pages_free, make_engine, reference_for, run_workload
from engine_trace_helpers import (FAST_SLOW, R, SMALL_PAGES, TOKENS, TRACE, PlanLog, check_against_reference,
                                  greedy)
from rltjax.engine.sequence import Status
from rltjax.sampling_params import SamplingParams


# -- 1. scheduling traces ------------------------------------------------------------------


def loop(*rows):
    return ("loop", tuple(rows))


PREFILL_BOTH = ("prefill", (("fast", 0, 3), ("slow", 0, 5)))
HEADS_BOTH, HEAD_FAST, HEAD_SLOW = ("head", ("fast", "slow")), ("head", ("fast",)), ("head", ("slow",))
# A cohort that loops until its slow row exits; the fast row's head waits for it.
COHORT_TRACE = [PREFILL_BOTH, HEADS_BOTH,
                loop(("fast", 0), ("slow", 0)), loop(("slow", 1)), loop(("slow", 2)), loop(("slow", 3)),
                HEADS_BOTH,
                loop(("fast", 0), ("slow", 0)), loop(("slow", 1)), loop(("slow", 2)), loop(("slow", 3)),
                HEADS_BOTH,                                   # slow's 3rd token: slow finishes
                loop(("fast", 0)), HEAD_FAST]                 # no loop work left: a 1-row head
EXPECTED_TRACES = {
    # CDB: fast's next token starts its loop 0 beside slow's deeper rows
    ("refill", 1): [PREFILL_BOTH, HEADS_BOTH,
                    loop(("fast", 0), ("slow", 0)), HEAD_FAST,
                    loop(("fast", 0), ("slow", 1)), HEAD_FAST,
                    loop(("fast", 0), ("slow", 2)), HEAD_FAST,   # fast's 4th token: fast finishes
                    loop(("slow", 3)), HEAD_SLOW,
                    loop(("slow", 0)), loop(("slow", 1)), loop(("slow", 2)), loop(("slow", 3)), HEAD_SLOW],
    ("no_refill", 1): COHORT_TRACE,
    ("refill", 2): COHORT_TRACE,   # min_coda_batch_size=2: fast's head waits for a second row
}


@pytest.mark.parametrize("mode,min_coda", list(EXPECTED_TRACES))
def test_exact_scheduling_trace(mode, min_coda):
    engine = make_engine(mode=mode, exit_mode="trace", depths_by_request=TRACE, min_coda_batch_size=min_coda)
    log = PlanLog(engine)
    outputs = run_workload(engine, FAST_SLOW)
    assert log.compact() == EXPECTED_TRACES[mode, min_coda]

    # The property behind each trace: does a new token of fast start (loops_done 0) while
    # slow's current token is mid-loop (loops_done 1..3)?
    mixed = [e for e in log.entries if e["kind"] == "loop"
             and ("fast", 0) in e["rows"] and any(rid == "slow" and 1 <= d <= 3 for rid, d in e["rows"])]
    fast_starts_mid_slow = [e for e in log.entries if e["kind"] == "loop" and ("fast", 0) in e["rows"]
                            and e["status"].get("slow", (None, 0))[0] is Status.LOOPING
                            and 1 <= e["status"]["slow"][1] <= 3]
    if (mode, min_coda) == ("refill", 1):
        assert len(mixed) == 2 and len(fast_starts_mid_slow) == 2
    else:
        assert mixed == [] and fast_starts_mid_slow == []
    if min_coda > 1:   # a head with fewer rows only when no loop work remained
        for e in log.entries:
            if e["kind"] == "head" and len(e["rows"]) < min_coda:
                assert not any(s is Status.LOOPING for s, _ in e["status"].values())

    check_against_reference(outputs, FAST_SLOW, reference_for("last_exited", depths_by_request=TRACE))
    for _, rid, _, params in FAST_SLOW:
        assert outputs[rid].exit_depths == TRACE[rid][:params.max_tokens]
    assert_all_pages_free(engine)


# -- 2. batch invariance -----------------------------------------------------------------
def random_requests(rng, n, prefix, max_arrival=4):
    out = []
    for i in range(n):
        start, length = int(rng.integers(0, 80)), int(rng.integers(1, 30))
        out.append((int(rng.integers(0, max_arrival + 1)), f"{prefix}{i}", TOKENS[start:start + length],
                    SamplingParams(max_tokens=int(rng.integers(2, 10)), temperature=float(rng.choice([0.0, 0.7, 1.0])),
                                   top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.8])),
                                   seed=int(rng.integers(0, 2**40)),
                                   exit_threshold=float(rng.choice([0.3, 0.6, 0.9, 1.0])),
                                   min_loops=int(rng.integers(1, 3)), logprobs=[None, 2][int(rng.integers(0, 2))],
                                   ignore_eos=True)))
    return out


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_batch_invariance(mode):
    target = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=2024, exit_threshold=0.6,
                            logprobs=3, ignore_eos=True)
    prompt = TOKENS[7:20]
    alone = run_workload(make_engine(mode=mode), [(0, "t", prompt, target)])["t"]
    engine = make_engine(mode=mode)
    log = PlanLog(engine)
    together = run_workload(engine, random_requests(np.random.default_rng(11), 3, "o") + [(1, "t", prompt, target)])
    assert together["t"].token_ids == alone.token_ids
    assert together["t"].exit_depths == alone.exit_depths
    for a, b in zip(together["t"].logprobs, alone.logprobs):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[t] for t in sorted(a)], [b[t] for t in sorted(b)], rtol=1e-6, atol=1e-6)
    # not vacuous: t exits early, and really shared passes (at other depths) and heads with others
    assert max(alone.exit_depths[1:]) < R
    shared = [e for e in log.entries if e["kind"] in ("loop", "head") and len(e["rows"]) > 1
              and any((r[0] if isinstance(r, tuple) else r) == "t" for r in e["rows"])]
    assert {e["kind"] for e in shared} == {"loop", "head"}
    assert any(len({d for _, d in e["rows"]}) > 1 for e in shared if e["kind"] == "loop") or mode == "no_refill"
    assert_all_pages_free(engine)


# -- 6. admission and prefill/decode interleaving ----------------------------------------------
def bypass_run(max_bypasses, scan_limit):
    """s0 runs; then a request needing the whole pool (24 pages) arrives while 4-page
    requests keep arriving, one per step."""
    engine = make_engine(num_pages=SMALL_PAGES, max_admission_bypasses=max_bypasses,
                         admission_scan_limit=scan_limit)
    log = PlanLog(engine)
    arrivals = ([(0, "s0", TOKENS[:3], greedy(2)), (1, "big", TOKENS[30:51], greedy(4, exit_threshold=0.6))]
                + [(i, f"s{i}", TOKENS[3 * i:3 * i + 3], greedy(2, exit_threshold=0.6)) for i in range(1, 16)])
    outputs = run_workload(engine, arrivals)
    check_against_reference(outputs, arrivals, reference_for("last_exited"))
    assert_all_pages_free(engine)
    big = log.admitted_at("big")
    passed = [f"s{i}" for i in range(1, 16) if log.admitted_at(f"s{i}") < big]
    assert log.entries[big - 1]["waiting"][0] == "big"       # it really waited at the head of the queue
    return passed, engine.requests["big"].bypassed


@pytest.mark.parametrize("max_bypasses,scan_limit,expected", [(0, 32, 0), (2, 32, 2), (8, 32, 8), (8, 1, 0)])
def test_admission_bypass_and_scan_limits(max_bypasses, scan_limit, expected):
    passed, bypassed = bypass_run(max_bypasses, scan_limit)
    assert len(passed) == expected and bypassed == expected
    assert passed == [f"s{i}" for i in range(1, expected + 1)]          # the earliest smalls, in order


@pytest.mark.parametrize("k", [1, 3])
def test_prefill_batches_interleave_with_decode_and_max_num_seqs(k):
    engine = make_engine(max_prefill_batches_before_decode=k)            # chunk 8, budget 16, 4 seqs
    log = PlanLog(engine)
    arrivals = [(2 * i, f"r{i}", TOKENS[7 * i:7 * i + 30 + 5 * (i % 3)], greedy(3, exit_threshold=0.6))
                for i in range(8)]
    outputs = run_workload(engine, arrivals)
    run, forced, longest_with_decode = 0, 0, 0
    for e in log.entries:
        decode_work = any(s in (Status.LOOPING, Status.AWAITING_HEAD) for s, _ in e["status"].values())
        prefilling = any(s is Status.PREFILLING for s, _ in e["status"].values())
        if e["kind"] == "prefill":
            run += 1
            if decode_work:
                assert run <= k, "decode not forced after max_prefill_batches_before_decode"
                longest_with_decode = max(longest_with_decode, run)
        else:
            forced += run == k and prefilling
            run = 0
        assert len(e["status"]) <= 4 and len(e["rows"]) <= (4 if e["kind"] != "prefill" else 16)
    assert forced > 0 and longest_with_decode == k
    assert max(len(e["status"]) for e in log.entries) == 4                # max_num_seqs caps running
    assert any(e["waiting"] for e in log.entries)
    check_against_reference(outputs, arrivals, reference_for("last_exited"))
    assert_all_pages_free(engine)


def test_min_coda_batch_size_on_a_random_workload():
    engine = make_engine(min_coda_batch_size=2)
    log = PlanLog(engine)
    arrivals = random_requests(np.random.default_rng(3), 6, "m", max_arrival=8)
    outputs = run_workload(engine, arrivals)
    deferred = 0
    for e in log.entries:
        statuses = [s for s, _ in e["status"].values()]
        if e["kind"] == "head" and len(e["rows"]) < 2:
            assert Status.LOOPING not in statuses
        if e["kind"] == "loop" and Status.AWAITING_HEAD in statuses:
            deferred += 1
    assert deferred > 0
    check_against_reference(outputs, arrivals, reference_for("last_exited"))
    assert_all_pages_free(engine)


@pytest.mark.parametrize("budget, align, prompts, expected", [
    # every chunk's padded size counts; a chunk whose padding would overrun is cut to a multiple
    (80, 32, [20, 20, 20], [20, 20]),               # 32 + 32 = 64, then 16 left < 32: stop
    (80, 32, [50, 40], [50]),                       # 64 used, 16 left: a padded 32-row chunk would overrun
    (20, 32, [50, 7], [20]),                        # budget < alignment: the first chunk still runs
    (64, 1, [30, 30, 30], [30, 30, 4]),             # no alignment: the plain token budget
])
def test_prefill_budget_counts_alignment_padding(budget, align, prompts, expected):
    from engine_helpers import settings_for
    from rltjax.engine.plan import PrefillStep
    from rltjax.engine.scheduler import Scheduler
    from rltjax.engine.sequence import Request
    from rltjax.engine_config import SchedulerConfig
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, prefill_chunk_size=min(budget, 64))
    sched = Scheduler(settings_for(cfg, alignment=align), num_pages=200)
    for i, n in enumerate(prompts):
        sched.add(Request(f"p{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=2), i, i, 1, 4))
    [step] = sched.schedule().steps
    assert isinstance(step, PrefillStep)
    assert [c.length for c in step.chunks] == expected
    padded = sum(-(-n // align) * align for n in expected)
    assert padded <= max(budget, align)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_prefill_batches_never_exceed_the_runner_bound(data):
    """Over random budgets, alignments, slot counts and prompts, every prefill batch the
    scheduler plans (alignment padding included) fits ``prefill_batch_bound``: the runner
    compiles token buckets only up to it, so a batch above it would compile mid-serving."""
    from engine_helpers import settings_for
    from rltjax.engine.plan import PrefillStep
    from rltjax.engine.scheduler import Scheduler
    from rltjax.engine.sequence import Request
    from rltjax.engine.settings import prefill_batch_bound
    from rltjax.engine_config import SchedulerConfig
    align = data.draw(st.sampled_from([1, 16, 32]))
    budget = data.draw(st.integers(8, 160))
    max_num_seqs = data.draw(st.integers(1, 4))
    max_model_len = data.draw(st.integers(2, 120))
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          prefill_chunk_size=data.draw(st.integers(1, budget)))
    sequential = data.draw(st.booleans())
    settings = settings_for(cfg, max_model_len=max_model_len, layered=not sequential,
                            alignment=1 if sequential else align)
    sched = Scheduler(settings, num_pages=4096)
    # the same bound resolve_settings sizes the token buckets by
    bound = prefill_batch_bound(budget, max_num_seqs, settings.max_prefill_chunk, settings.prefill_alignment)
    prompts = data.draw(st.lists(st.integers(1, max_model_len - 1), min_size=1, max_size=8))
    for i, n in enumerate(prompts):
        sched.add(Request(f"p{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=1), i, i, 1, 4))
    done = 0
    while done < len(prompts):
        [step] = sched.schedule().steps
        assert isinstance(step, PrefillStep)    # every request is released when its prompt is in
        end = 0
        for c in step.chunks:
            req = c.request
            end += -end % settings.prefill_alignment + c.length
            req.num_prefilled = c.start + c.length          # as the engine does when it launches the chunk
            if req.num_prefilled == req.prompt_len:
                sched.release(req)
                done += 1
        assert 0 < end <= bound        # the runner pads a batch of `end` rows to bucket(end) <= bucket(bound)


def test_prefill_budget_defaults_follow_the_prefill_attention():
    """Unset budgets: 4,096 tokens a step where prefill attention runs on the Pallas kernel,
    256 on XLA's dense attention (it gathers every token's whole table); the chunk ceiling is
    min(4096, the budget), so a small budget alone is valid. The runner's token buckets follow."""
    from conftest import load_fixture
    from rltjax.engine_config import (CacheConfig, EngineConfigError, ExecutionConfig, SchedulerConfig)
    from rltjax.entrypoints.llm import build_engine
    from rltjax.engine.settings import prefill_budgets
    base = SchedulerConfig()
    assert (base.max_num_batched_tokens, base.prefill_chunk_size) == (None, None)
    assert prefill_budgets(base, True).max_num_batched_tokens == 4096
    assert prefill_budgets(base, True).prefill_chunk_size == 4096
    assert prefill_budgets(base, False).prefill_chunk_size == 256
    small = prefill_budgets(SchedulerConfig(max_num_batched_tokens=96), True)
    assert (small.max_num_batched_tokens, small.prefill_chunk_size) == (96, 96)
    kept = prefill_budgets(SchedulerConfig(max_num_batched_tokens=2048, prefill_chunk_size=64), False)
    assert (kept.max_num_batched_tokens, kept.prefill_chunk_size) == (2048, 64)

    ckpt = load_fixture("ouro-tiny", "float32", ())

    def engine(scheduler_config, **execution):
        return build_engine(None, params=ckpt.params, cfg=ckpt.cfg, cache_config=CacheConfig(page_size=8),
                            scheduler_config=scheduler_config,
                            execution_config=ExecutionConfig(compile_ahead=False, compilation_cache_dir=None,
                                                             show_progress=False, **execution))
    on_xla = engine(SchedulerConfig(max_num_seqs=2))                     # CPU: "auto" runs XLA's attention
    assert (on_xla.scheduler.config.max_num_batched_tokens, on_xla.scheduler.config.prefill_chunk_size) == (256, 256)
    assert max(on_xla.settings.token_buckets) == 256
    on_kernel = engine(SchedulerConfig(max_num_seqs=2), attn_impl="pallas", interpret=True)
    assert on_kernel.scheduler.config.max_num_batched_tokens == 4096
    assert on_kernel.scheduler.config.prefill_chunk_size == 4096
    # the fixture's prompts are at most max_model_len - 1 = 511 tokens, a chunk pads to 512:
    # two slots reach 1,024 tokens a step, not the budget
    assert on_kernel.settings.max_model_len == 512 and max(on_kernel.settings.token_buckets) == 1024
    # one slot holds one chunk of at most 512 tokens: no 1,024-token bucket that nothing reaches
    one_slot = engine(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1024, prefill_chunk_size=512),
                      attn_impl="pallas", interpret=True)
    assert max(one_slot.settings.token_buckets) == 512
    with pytest.raises(EngineConfigError, match=r"prefill_chunk_size cannot exceed max_num_batched_tokens.*left "
                                                 r"unset, the budget is 4096 .* else 256"):
        engine(SchedulerConfig(max_num_seqs=2, prefill_chunk_size=512))   # the budget resolves to 256 here
    # the engine's scheduler gets the budgets resolved, never None
    assert None not in (on_xla.settings.scheduler.max_num_batched_tokens, on_xla.settings.scheduler.prefill_chunk_size)
