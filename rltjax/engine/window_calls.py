"""The runner's decode-window calls (``ModelRunner`` inherits them): launch a window over
host or device rows, merge host rows or standby entries into the device's, pick the head's
sampler, read a window's results. They use the runner's device state (the KV pool, slot
buffers, standby entries) and its jitted steps."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rltjax.engine.mixed_prefill import WindowPrompt
from rltjax.engine.window_state import RowsRead, WindowOutputs, WindowRows
from rltjax.sampling import SAMPLERS, sampler_for

WINDOW_SAMPLERS = SAMPLERS   # a window executable per sampler and row bucket


class WindowCalls:
    def window_sampler(self, sampling_params) -> str:
        """The window head's sampler for requests with these SamplingParams: the cheapest of
        WINDOW_SAMPLERS exact for them; "truncate" (the one computing logprobs) when any asks
        for logprobs (0 too: the sampled token's own)."""
        if any(p.logprobs is not None for p in sampling_params):
            return "truncate"
        return sampler_for([p.temperature for p in sampling_params], [p.top_k for p in sampling_params],
                           [p.top_p for p in sampling_params], self.cfg.vocab_size)

    def window(self, rows: WindowRows, block_tables, boundary_tables=None,
               sampler: str = "truncate") -> tuple[RowsRead, WindowOutputs]:
        """A decode window (``decode_window``) over rows padded to a row bucket, read at once:
        numpy out, cut back to the given rows. No slot has an owner here, so the runner's
        standby entries are emptied (warm-up calls)."""
        return self.window_read(*self.window_launch(rows, block_tables, boundary_tables, sampler), len(rows.slots))

    def window_prompt(self, prefill_args: tuple, rows: np.ndarray) -> WindowPrompt:
        """A window's prompts from ``BatchBuilder.prefill``'s arguments, padded to the prompt
        tokens its row bucket carries (``prompt_tokens_for``); rows: [row bucket] bool, the rows
        waiting for them."""
        tokens, positions, write_page, write_offset, row_tables, out_slots = prefill_args[:6]
        carried = self.prompt_tokens_for(len(rows))
        pad = carried - len(tokens)
        if pad < 0 or not carried:
            raise ValueError(f"{len(tokens)} prompt tokens for a window of {len(rows)} rows, which carries {carried} "
                             f"(this is a bug)")
        return WindowPrompt(np.pad(tokens, (0, pad)), np.pad(positions, (0, pad), constant_values=-1),
                            np.pad(write_page, ((0, 0), (0, pad))), np.pad(write_offset, (0, pad)),
                            np.pad(row_tables, ((0, 0), (0, pad))),
                            np.pad(out_slots, (0, pad), constant_values=self.dummy_slot), np.asarray(rows, bool))

    def window_launch(self, rows: WindowRows, block_tables, boundary_tables=None, sampler: str = "truncate",
                      prompt: WindowPrompt | None = None, owners: np.ndarray | None = None):
        """Launch a window; returns its (rows after, outputs) on the device, copies to the host
        started (of the outputs and the ``RowsRead`` fields: only what the host reads).
        ``rows``: host rows (padded here), or a previous launch's rows after (device, padded),
        which continues those rows without the host in between. boundary_tables: the
        boundary pool's block tables (models with boundary stages only). sampler: one of
        WINDOW_SAMPLERS (``window_sampler``); only "truncate" computes logprobs. prompt:
        prompts riding the first R passes (``window_prompt``). owners: [max_num_seqs + 1] int32
        each slot's request tag (-1: free; None: every slot free), which rows and standby
        entries must match to run (``standby``); the runner's standby entries ride along and
        come back updated."""
        if sampler not in WINDOW_SAMPLERS:
            raise ValueError(f"sampler={sampler!r}: must be one of {WINDOW_SAMPLERS}")
        if isinstance(rows.slots, np.ndarray):
            pad = self.window_bucket(len(rows.slots)) - len(rows.slots)
            fill = dict(slots=self.dummy_slot, tag=-1)
            rows = WindowRows(**{f.name: np.pad(getattr(rows, f.name),
                                                [(0, pad)] + [(0, 0)] * (getattr(rows, f.name).ndim - 1),
                                                constant_values=fill.get(f.name, 0))
                                 for f in dataclasses.fields(WindowRows)})
            # committed, like the device rows a continued window gets: one executable for both
            # (uncommitted host rows compiled a second variant at the first continued window,
            # tens of seconds inside a run on the H200)
            rows = jax.device_put(rows, self.device)
        # this bucket's way of taking requests (decode_window refuses standby entries with a prompt)
        standby = self.standby if self.standby_for(rows.slots.shape[0]) else None
        mixed = {} if prompt is None else dict(prompt=jax.device_put(prompt, self.device),
                                               prefill_backend=self.prefill_backend)
        if owners is None:
            owners = np.full(self.max_num_seqs + 1, -1, np.int32)
        owners = jax.device_put(np.asarray(owners, np.int32), self.device)
        self.kv, self.slot_state, self.bkv, self.slot_inject, after, out, new_standby = self.steps.window(
            self.params, self.kv, self.slot_state, rows, block_tables, self.lookahead_w, self.bkv,
            self.slot_inject, boundary_tables, self.slot_tokens, standby=standby, owners=owners,
            model=self.model, backend=self.backend, num_top=self.num_top if sampler == "truncate" else 0,
            sampler=sampler, dummy_slot=self.dummy_slot, swap_every_pass=self.swap_every_pass, **mixed,
            **self.window_spec)
        if standby is not None:
            self.standby = new_standby
        for leaf in jax.tree.leaves((RowsRead.of(after), out)):
            leaf.copy_to_host_async()
        return after, out

    def window_merge(self, after, host: WindowRows, replace: np.ndarray):
        """Rows for a window continued from ``after`` (a launched window's rows after it, on
        the device) with the rows where ``replace`` is set taken from ``host`` (host rows of
        the same padded length); stays on the device, nothing is read."""
        host, replace = jax.device_put((host, np.asarray(replace, bool)), self.device)
        return self.steps.merge_rows(after, host, replace)

    def standby_put(self, host: WindowRows, put: np.ndarray) -> None:
        """Standby entries from the host: entry s (the request in slot s) taken from ``host``
        ([max_num_seqs + 1] rows) where ``put`` is set, the device's kept elsewhere."""
        host, put = jax.device_put((host, np.asarray(put, bool)), self.device)
        self.standby = self.steps.merge_rows(self.standby, host, put)

    @staticmethod
    def window_read(after, out, n: int) -> tuple[RowsRead, WindowOutputs]:
        """A launched window's results (outputs, and the rows' ``RowsRead`` fields) as numpy,
        cut back to its first n rows."""
        cut = lambda tree: jax.tree.map(lambda a: np.asarray(a)[:n] if np.ndim(a) else np.asarray(a), tree)
        return cut(RowsRead.of(after)), cut(out)
