"""The KV memory manager against the dense oracle: incremental pages, prefix caching, priority
and preemption (swap and recompute) change which pages hold what and when requests run, never
what they generate. Small pools force eviction and preemption; the page accounting is checked
after every step. What preemption itself keeps exact (replay, swap, aborts around it):
``test_preemption``."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import reference_model
from engine_helpers import assert_all_pages_free, check_equal, make_engine, reference_for, run_checked, run_workload
from rltjax.cache.block_tables import pages_needed
from rltjax.engine.sequence import RequestRejectedError
from rltjax.sampling_params import SamplingParams
from test_engine_huginn import TOKENS as HUGINN_TOKENS
from test_engine_oracle import TOKENS

PAGE = 4
ASYNC_MODES = ("ouro_delayed", "random_lookahead")
PLANES = {"last_exited": 4, "shared": 1}


def pool_for(kv_layout, arrivals, spare):
    """A pool that holds the largest request and ``spare`` pages per plane beside it."""
    longest = max(len(prompt) + params.max_tokens for _, _, prompt, params in arrivals)
    return 1 + PLANES[kv_layout] * (pages_needed(longest, PAGE) + spare)


request = st.tuples(
    st.integers(0, 5),                                   # arrival step
    st.sampled_from([0, 0, 8, 30]), st.integers(3, 22),  # prompt start (shared prefixes), length
    st.integers(2, 8),                                   # max_tokens
    st.sampled_from([0.0, 1.0]), st.integers(0, 2**40),  # temperature, seed
    st.sampled_from([0.4, 0.8, 1.0]),                    # exit threshold
    st.integers(0, 2),                                   # priority
    st.sampled_from([None, 2]),                          # logprobs
)


def arrivals_of(requests, priorities: bool):
    out = []
    for i, (step, start, length, max_tokens, temp, seed, q, prio, lp) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=temp, seed=seed, exit_threshold=q, logprobs=lp,
                                ignore_eos=True, priority=prio if priorities else 0)
        out.append((step, f"r{i}", TOKENS[start:start + length], params))
    return out


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(kv_layout=st.sampled_from(["last_exited", "shared"]), preemption=st.sampled_from(["recompute", "swap"]),
       prefix=st.booleans(), window=st.sampled_from([0, 3]), policy=st.sampled_from(["fcfs", "priority"]),
       exit_mode=st.sampled_from(["ouro", "ouro_delayed", "random_lookahead", "fixed"]),
       async_scheduling=st.booleans(), spare=st.integers(0, 4), requests=st.lists(request, min_size=2, max_size=5),
       aborts=st.dictionaries(st.integers(0, 40), st.integers(0, 4), max_size=2))
def test_memory_manager_matches_reference(kv_layout, preemption, prefix, window, policy, exit_mode, async_scheduling,
                                          spare, requests, aborts):
    """Random arrivals and aborts (at any step: waiting, prefilling, looping, preempted or
    swapped); every finished request equals the oracle, an aborted one is a prefix of it."""
    arrivals = arrivals_of(requests, policy == "priority")
    engine = make_engine(kv_layout=kv_layout, exit_mode=exit_mode, page_size=PAGE, prefill_chunk_size=8,
                         max_num_seqs=4, lookahead_seed=3, num_pages=pool_for(kv_layout, arrivals, spare),
                         enable_prefix_caching=prefix, preemption_mode=preemption, policy=policy,
                         decode_window=window,
                         # reading signals a pass late: the delayed modes, step by step
                         async_scheduling=async_scheduling and not window and exit_mode in ASYNC_MODES)
    outputs = run_checked(engine, arrivals, aborts={step: f"r{i % len(arrivals)}" for step, i in aborts.items()})
    ref = reference_for(kv_layout, exit_mode, lookahead_seed=3)
    for _, rid, prompt, params in arrivals:
        out, want = outputs[rid], ref.generate(prompt, params, request_id=rid)
        if out.finish_reason == "abort":
            assert out.token_ids == want.token_ids[:len(out.token_ids)]
            assert out.exit_depths == want.exit_depths[:len(out.exit_depths)]
        else:
            check_equal(out, want)
    assert_all_pages_free(engine)


def shared_prefix_workload(n=5, max_tokens=6):
    """Staggered requests on one 18-token prefix with their own tails, greedy and sampled."""
    return [(2 * i, f"s{i}", TOKENS[:18] + TOKENS[40 + 3 * i:44 + 3 * i], SamplingParams(
        max_tokens=max_tokens, temperature=[0.0, 1.0][i % 2], seed=i, exit_threshold=0.6, logprobs=2,
        ignore_eos=True)) for i in range(n)]


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("kv_layout, preemption", [("last_exited", "recompute"), ("last_exited", "swap"),
                                                   ("shared", "recompute"), ("shared", "swap")])
def test_small_pool_preempts_and_evicts_exactly(kv_layout, preemption, window):
    """Pages for about two of the five requests at once: requests are preempted (and swapped
    back or recomputed) and cached prefix blocks evicted and found again."""
    arrivals = shared_prefix_workload(max_tokens=16)
    engine = make_engine(kv_layout=kv_layout, page_size=PAGE, max_num_seqs=4, decode_window=window,
                         num_pages=pool_for(kv_layout, arrivals, 3), enable_prefix_caching=True,
                         preemption_mode=preemption)
    outputs = run_checked(engine, arrivals)
    ref = reference_for(kv_layout)
    for _, rid, prompt, params in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swapped > 0) == (preemption == "swap")
    assert stats.prefix_cache_hits > 0 and engine.scheduler.blocks.cache.stats.evictions > 0
    assert engine.replay_mismatches == 0
    assert_all_pages_free(engine)


def test_prefix_hits_skip_prefill_and_are_reported():
    """Pages hold the prefix's 16 full tokens; the last prompt token always runs."""
    arrivals = [(0, "a", TOKENS[:18], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
                (8, "b", TOKENS[:18] + TOKENS[50:53], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
                (16, "c", TOKENS[:16], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))]
    engine = make_engine(page_size=PAGE, enable_prefix_caching=True)
    tokens_prefilled = []
    real = engine.runner.prefill
    engine.runner.prefill = lambda batch: tokens_prefilled.append(int((batch.lengths > 0).sum())) or real(batch)
    outputs = run_checked(engine, arrivals)
    assert sum(tokens_prefilled) == 18 + (21 - 16) + (16 - 12)
    ref = reference_for("last_exited")
    for _, rid, prompt, params in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
    # "c" is all full pages: its last page is recomputed (its last token needs a state)
    assert [outputs[r].num_cached_tokens for r in "abc"] == [0, 16, 12]
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (16 + 20 + 12, 28)
    assert stats.prefix_cache_hit_rate == pytest.approx(28 / 48)


def test_multi_turn_never_reuses_decoded_pages():
    """A second turn whose prompt holds the first answer: the answer's pages were written by
    decode (tokens exit early) and must be prefilled again at full depth; the output equals
    the oracle's."""
    first = TOKENS[:9]
    p1 = SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=0.4, ignore_eos=True, logprobs=2)
    ref = reference_for("last_exited")
    engine = make_engine(page_size=PAGE, enable_prefix_caching=True)
    out1 = run_checked(engine, [(0, "t1", first, p1)])["t1"]
    check_equal(out1, ref.generate(first, p1, request_id="t1"))
    assert min(out1.exit_depths[1:]) < 4          # the answer's tokens exited early
    second = first + out1.token_ids + TOKENS[60:65]
    out2 = run_checked(engine, [(0, "t2", second, p1)])["t2"]
    check_equal(out2, ref.generate(second, p1, request_id="t2"))
    assert out2.num_cached_tokens == len(first) // PAGE * PAGE    # the first prompt's full pages only
    assert_all_pages_free(engine)


@pytest.mark.parametrize("state_init", ["like-init", "zero"])
def test_huginn_seeded_states_never_share_pages(state_init):
    """Huginn's random initial state depends on the seed: prompts share pages only under
    the same seed (or a zero state); boundary pages are shared with the core's."""
    overrides = {} if state_init == "like-init" else {"state_init": "zero"}
    prompt = HUGINN_TOKENS[:14]
    params = [SamplingParams(max_tokens=3, temperature=0.0, seed=s, ignore_eos=True) for s in (1, 2, 1)]
    engine = make_engine(name="huginn-tiny", hf_overrides=overrides, exit_mode="latent_diff", page_size=PAGE,
                         max_num_seqs=2, max_loops=6, enable_prefix_caching=True)
    arrivals = [(12 * i, f"h{i}", prompt, p) for i, p in enumerate(params)]
    outputs = run_checked(engine, arrivals)
    ref = reference_model("huginn-tiny", overrides=tuple(overrides.items()), exit_mode="latent_diff")
    for _, rid, p, sp in arrivals:
        check_equal(outputs[rid], ref.generate(p, sp, request_id=rid))
    cached = [outputs[f"h{i}"].num_cached_tokens for i in range(3)]
    assert cached == ([0, 0, 12] if state_init == "like-init" else [0, 12, 12])
    assert_all_pages_free(engine)


def test_priority_orders_admission_and_preempts():
    """One slot: the most urgent waiting request runs first; an urgent arrival preempts the
    running one, which resumes and still equals the oracle."""
    sp = lambda prio, n=5: SamplingParams(max_tokens=n, temperature=1.0, seed=prio + 10, priority=prio,  # noqa: E731
                                          ignore_eos=True)
    arrivals = [(0, "low", TOKENS[:6], sp(2, 8)), (0, "mid", TOKENS[10:15], sp(1)), (6, "top", TOKENS[20:26], sp(0))]
    for mode in ("recompute", "swap"):
        engine = make_engine(max_num_seqs=1, policy="priority", preemption_mode=mode)
        order = []
        real = engine.scheduler.admission._start
        engine.scheduler.admission._start = lambda r: order.append(r.request_id) or real(r)
        outputs = run_checked(engine, arrivals)
        ref = reference_for("last_exited")
        for _, rid, prompt, params in arrivals:
            check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
        assert order[0] == "mid" and "top" in order and order.index("top") < order.index("low")
        assert engine.stats().num_preemptions >= 1
        assert_all_pages_free(engine)


def test_priority_needs_the_priority_policy():
    engine = make_engine()
    with pytest.raises(RequestRejectedError, match="scheduling-policy priority"):
        engine.add_request("x", TOKENS[:4], SamplingParams(max_tokens=2, priority=1))
    assert not engine.scheduler.waiting


def growing_workload(n=4):
    """Short prompts, long outputs: admitted on their prompts' pages, they outgrow the pool."""
    return [(0, f"c{i}", TOKENS[i:i + 5], SamplingParams(max_tokens=20, temperature=[0.0, 1.0][i % 2], seed=i,
                                                          ignore_eos=True)) for i in range(n)]


def test_incremental_pages_run_more_requests_than_lifetime_reservation():
    """Long max_tokens, short prompts: lifetime reservation takes every output's pages at
    admission; incremental pages admit as the prompts fit and grow (preempting if they must)."""
    arrivals = growing_workload()
    most = {}
    for allocation in ("lifetime", "incremental"):
        engine = make_engine(page_size=PAGE, max_num_seqs=4, num_pages=1 + 4 * 14, kv_allocation=allocation)
        seen = []
        real = engine.step
        engine.step = lambda: seen.append(len(engine.scheduler.running)) or real()
        outputs = run_workload(engine, arrivals)
        ref = reference_for("last_exited")
        for _, rid, prompt, params in arrivals:
            check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
        most[allocation] = max(seen)
        if allocation == "lifetime":
            assert engine.stats().num_preemptions == 0
    assert most == {"lifetime": 2, "incremental": 4}


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_priority_never_preempts_for_a_request_that_still_would_not_fit(preemption):
    """A waiting request that would not fit even with every lower-priority request gone
    preempts none of them (else each would be preempted, re-admitted and preempted again)."""
    sp = lambda prio, n: SamplingParams(max_tokens=n, temperature=0.0, priority=prio, ignore_eos=True)  # noqa: E731
    arrivals = [(0, "H1", TOKENS[:20], sp(0, 16)),
                (1, "H2", TOKENS[20:60], sp(0, 2)),      # 10 pages: never fits beside H1
                (1, "L", TOKENS[60:64], sp(1, 12))]
    engine = make_engine(kv_layout="shared", page_size=PAGE, max_num_seqs=4, num_pages=1 + 14, policy="priority",
                         preemption_mode=preemption)
    outputs = run_checked(engine, arrivals)
    ref = reference_for("shared")
    for _, rid, prompt, params in arrivals:
        check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))
    assert engine.stats().num_preemptions == 0


def test_a_request_swapped_back_offers_its_prompt_pages_to_the_cache_again():
    """Its pages are fresh copies after a swap: its prompt blocks, evicted from the cache while
    it was out, are published again, so a later request with the same prompt finds them."""
    sp = lambda prio, n=4: SamplingParams(max_tokens=n, temperature=0.0, priority=prio, ignore_eos=True)  # noqa: E731
    prompt = TOKENS[:13]                              # 3 whole pages before the last token
    arrivals = [(0, "low", prompt, sp(2, 10)), (4, "top", TOKENS[20:26], sp(0))]
    engine = make_engine(max_num_seqs=1, policy="priority", preemption_mode="swap", enable_prefix_caching=True,
                         page_size=PAGE)
    cache, evicted = engine.scheduler.blocks.cache, []

    def evict_while_swapped(engine):
        out = [r for r in engine.scheduler.waiting if r.swapped is not None]
        if out and not evicted:
            evicted.append(cache.evict(10 ** 6))      # every evictable block: low's prompt blocks go
    run_workload(engine, arrivals, after_step=evict_while_swapped)
    assert engine.stats().num_swapped >= 1 and evicted and evicted[0] > 0
    engine.add_request("again", prompt, sp(2, 2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_output("again").num_cached_tokens == 3 * PAGE
    assert_all_pages_free(engine)
