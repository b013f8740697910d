"""The executor: every kind of device work behind one interface.

``launch(step)`` turns a plan's step into its typed batch (``host_batches``), queues it on
the device through the runner and returns a ``Pending`` handle, whose ``read()`` waits for
the step's results and returns them as numpy (a prefill step returns nothing to read unless
it scores its prompts: prompt logprobs). The
engine decides when to read: right after the launch, or one step late. Decode windows
launch through ``window.launch``.
"""
from __future__ import annotations

import dataclasses

from rltjax.engine.host_batches import HostBatches
from rltjax.engine.plan import HeadStep, LoopStep, PrefillStep, Step, SwapInStep, SwapOutStep, WindowStep
from rltjax.engine.runner import DeviceRead, ModelRunner
from rltjax.engine.settings import EngineSettings
from rltjax.engine.window.launch import WindowLauncher


@dataclasses.dataclass
class Pending:
    """A launched step whose results are on their way to the host."""
    step: Step
    results: DeviceRead
    tags: tuple = ()          # async loop passes: (request, position, depth) of each row at launch;
                              # scored prefill: the batch row each chunk starts at

    def read(self):
        return self.results.read()


class Executor:
    def __init__(self, runner: ModelRunner, batches: HostBatches, settings: EngineSettings):
        self.runner = runner
        self.batches = batches
        self.windows = WindowLauncher(runner, batches, settings) if settings.window else None

    def launch(self, step: Step) -> Pending | None:
        if isinstance(step, PrefillStep):
            batch = self.batches.prefill(step.chunks)
            scores = self.runner.prefill(batch)
            return None if scores is None else Pending(step, scores, tuple(self.batches.chunk_starts(step.chunks)))
        if isinstance(step, LoopStep):
            batch, embed = self.batches.loop(step.rows)
            if embed is not None:       # boundary models: the prelude of the rows starting a token
                self.runner.embed(embed)
            return Pending(step, self.runner.loop(batch, len(step.rows)))
        if isinstance(step, HeadStep):
            return Pending(step, self.runner.head(self.batches.head(step.rows), len(step.rows)))
        if isinstance(step, WindowStep):
            return Pending(step, self.windows.launch(step))
        if isinstance(step, SwapOutStep):
            return Pending(step, self.runner.swap_out(step.pages, step.boundary_pages, step.slot))
        if isinstance(step, SwapInStep):
            self.runner.swap_in(step.pages, step.boundary_pages, step.slot, step.data)
            return None
        raise TypeError(f"no executor for {type(step).__name__}")
