"""Launching a planned decode window: a ``WindowStep`` becomes the runner's calls.

The launcher builds the window's host rows (``window.rows``), hands new standby entries to
the device, merges host rows into the device rows the previous window left (a continued
window), builds the prompts of mixed prefill, and launches the window program. It keeps the
device rows of the last window it launched: the next continued window starts from them,
with no host read in between.
"""
from __future__ import annotations

import numpy as np

from rltjax.engine.host_batches import HostBatches
from rltjax.engine.plan import WindowStep
from rltjax.engine.runner import DeviceRead, ModelRunner
from rltjax.engine.settings import EngineSettings
from rltjax.engine.window.rows import idle_window_rows, pad_rows_to, place, window_rows
from rltjax.engine.window.state import WindowPrompt, WindowRows


class WindowLauncher:
    def __init__(self, runner: ModelRunner, batches: HostBatches, settings: EngineSettings):
        self.runner, self.batches, self.s = runner, batches, settings
        self._after: WindowRows | None = None     # device rows the last launched window left

    def launch(self, step: WindowStep) -> DeviceRead:
        if step.entries or step.reset_standby:
            self._put_standby(step)
        if not step.continues:
            if step.standby:    # every row free: the device places the requests (standby entries)
                rows = self._idle(step.bucket)
            else:
                requests = [r for _, r in step.host_rows]
                rows = pad_rows_to(self._rows(requests, [id(r) in step.first for r in requests]), step.bucket,
                                   self.s.dummy_slot)
        elif step.replace:      # fresh requests placed in the rows of finished ones
            rows = self.runner.merge_rows(self._after, self._placed(step), self._mask(step.bucket, step.replace))
        else:
            rows = self._after
        prompt = None if step.prompt is None else self._prompt(step)
        self._after, pending = self.runner.window(rows, self.batches.block_tables(), self.batches.boundary_tables(),
                                                  step.owners, step.sampler, prompt)
        return pending

    def _rows(self, requests, first) -> WindowRows:
        w = self.s.window
        return window_rows(requests, layered=self.s.layered, num_planes=self.s.num_planes, trace_width=w.trace_width,
                           first=first)

    def _idle(self, n: int) -> WindowRows:
        return idle_window_rows(n, self.s.num_planes, self.s.window.trace_width)

    @staticmethod
    def _mask(n: int, at) -> np.ndarray:
        mask = np.zeros(n, bool)
        mask[list(at)] = True
        return mask

    def _placed(self, step: WindowStep) -> WindowRows:
        """Idle host rows with the fresh requests' rows at their places; rows waiting for their
        prompts (mixed prefill) stay inactive until the prompts' first heads."""
        host = self._idle(step.bucket)
        if step.host_rows:
            requests = [r for _, r in step.host_rows]
            built = self._rows(requests, [True] * len(requests))
            if step.prompt is not None:
                built.active[:], built.first[:] = False, False
            place(host, [i for i, _ in step.host_rows], built)
        return host

    def _put_standby(self, step: WindowStep) -> None:
        """Standby entries at their requests' slots; a fresh window empties every other entry."""
        n = self.s.max_num_seqs + 1
        host = self._idle(n)
        put = np.full(n, step.reset_standby, bool)
        if step.entries:
            slots = [r.slot for r in step.entries]
            place(host, slots, self._rows(list(step.entries), [id(r) in step.first for r in step.entries]))
            put[slots] = True
        self.runner.standby_put(host, put)

    def _prompt(self, step: WindowStep) -> WindowPrompt:
        """The prompts of mixed prefill, padded to the tokens the window's row bucket carries."""
        carried = self.s.window.prompt_tokens_for(step.bucket)
        return self.batches.window_prompt(step.prompt, carried, self._mask(step.bucket, step.prompt_rows))
