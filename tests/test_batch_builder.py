"""BatchBuilder.prefill builds a chunk batch per chunk with numpy; a per-token oracle (one
row per prompt position, each slot looked up on its own) must give the same arrays."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from rltjax.engine.batch_builder import BatchBuilder
from rltjax.engine.scheduler import Scheduler
from rltjax.engine.sequence import Request
from rltjax.engine_config import SchedulerConfig
from rltjax.sampling_params import SamplingParams

PAGE_SIZE, R, DUMMY = 4, 3, 99


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
    config = SchedulerConfig(max_num_seqs=4, max_model_len=64).with_prefill_defaults(False)
    sched = Scheduler(config, num_pages=200, page_size=PAGE_SIZE, num_planes=planes_n, max_model_len=64,
                      position_sequential_prefill=False)
    for i, n in enumerate(prompt_lens):
        sched.add(Request(f"r{i}", list(range(100 * i, 100 * i + n)), SamplingParams(max_tokens=5), seed=i,
                          arrival_index=i, min_loops=1, max_loops=cap))
    sched.schedule()                                  # admits every request (4 slots, pages to spare)
    chunks = []
    for req in sched.running:                         # a chunk from a random start of each prompt
        start = data.draw(st.integers(0, req.prompt_len - 1))
        chunks.append((req, start, data.draw(st.integers(1, req.prompt_len - start))))
    builder = BatchBuilder(sched, page_size=PAGE_SIZE, num_loops=R, num_planes=planes_n, layered=layered,
                           prefill_alignment=align, dummy_slot=DUMMY)
    tokens, positions, write_page, write_offset, row_tables, out_slots, _, boundary = builder.prefill(chunks)
    want = per_token_prefill(sched.block_tables, chunks, align=align, planes_n=planes_n, layered=layered)
    got = dict(tokens=tokens, positions=positions, write_page=write_page, write_offset=write_offset,
               row_tables=row_tables, out_slots=out_slots)
    for name, value in got.items():
        assert value.dtype == np.int32, name
        np.testing.assert_array_equal(value, np.asarray(want[name], np.int32), err_msg=name)
    assert boundary is None
