"""HostBatches.prefill builds a chunk batch per chunk with numpy; a per-token oracle (one
row per prompt position, each slot looked up on its own) must give the same arrays, and the
rows past them up to the token bucket must be padding."""
from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings, strategies as st

from engine_helpers import settings_for
from rltjax.engine.host_batches import HostBatches
from rltjax.engine.plan import Chunk
from rltjax.engine.scheduler import Scheduler
from rltjax.engine.sequence import Request
from rltjax.engine_config import SchedulerConfig
from rltjax.sampling_params import SamplingParams

PAGE_SIZE, R, DUMMY = 4, 3, 4


def per_token_prefill(tables, chunks, *, align, planes_n, layered):
    rows = []
    for req, start, n in chunks:
        rows += [None] * (-len(rows) % align) + [(req, p) for p in range(start, start + n)]
    planes = [d if layered else 0 for d in range(max(R, planes_n))]
    pick = lambda f, pad: [f(*r) if r is not None else pad for r in rows]
    slots = [pick(lambda req, p: tables.slot_for(req.tables[pl], p, PAGE_SIZE), (0, 0)) for pl in planes]
    return dict(tokens=pick(lambda req, p: req.prompt_token_ids[p], 0), positions=pick(lambda req, p: p, -1),
                write_page=[[s[0] for s in per] for per in slots], write_offset=[s[1] for s in slots[0]],
                row_tables=[pick(lambda req, p: req.tables[pl], 0) for pl in planes[:R]],
                out_slots=pick(lambda req, p: req.slot if p == req.prompt_len - 1 else DUMMY, DUMMY))


@given(prompt_lens=st.lists(st.integers(1, 23), min_size=1, max_size=4), align=st.sampled_from([1, 4, 8]),
       layered=st.booleans(), cap=st.integers(R, R + 2), data=st.data())
@settings(max_examples=60, deadline=None)
def test_prefill_batch_equals_a_per_token_build(prompt_lens, align, layered, cap, data):
    planes_n = cap if layered else 1
    config = SchedulerConfig(max_num_seqs=4, max_model_len=64)
    engine_settings = dataclasses.replace(
        settings_for(config, page_size=PAGE_SIZE, num_planes=planes_n, max_model_len=64, layered=layered,
                     alignment=align), num_loops=R)
    assert engine_settings.dummy_slot == DUMMY
    sched = Scheduler(engine_settings, num_pages=200)
    for i, n in enumerate(prompt_lens):
        sched.add(Request(f"r{i}", list(range(100 * i, 100 * i + n)), SamplingParams(max_tokens=5), seed=i,
                          arrival_index=i, min_loops=1, max_loops=cap))
    sched.schedule()                                  # admits every request (4 slots, pages to spare)
    chunks = []
    for req in sched.running:                         # a chunk from a random start of each prompt
        start = data.draw(st.integers(0, req.prompt_len - 1))
        chunks.append((req, start, data.draw(st.integers(1, req.prompt_len - start))))
    batch = HostBatches(engine_settings, sched.blocks.block_tables).prefill([Chunk(*c) for c in chunks])
    want = per_token_prefill(sched.blocks.block_tables, chunks, align=align, planes_n=planes_n, layered=layered)
    n = len(want["tokens"])
    got = dict(tokens=batch.tokens[:n], positions=batch.positions[:n], write_page=batch.write_page[:, :n],
               write_offset=batch.write_offset[:n], row_tables=batch.row_tables[:, :n], out_slots=batch.out_slots[:n])
    for name, value in got.items():
        assert value.dtype == np.int32, name
        np.testing.assert_array_equal(value, np.asarray(want[name], np.int32), err_msg=name)
    np.testing.assert_array_equal(batch.lengths[:n], np.maximum(np.asarray(want["positions"]) + 1, 0))
    t = len(batch.tokens)                             # the token bucket: padding past the chunks
    assert t >= n and t & (t - 1) == 0
    assert not batch.lengths[n:].any() and not batch.write_page[:, n:].any() and (batch.out_slots[n:] == DUMMY).all()
    assert batch.boundary is None
