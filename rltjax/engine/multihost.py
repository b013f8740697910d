"""One engine over the devices of several processes (hosts), through ``jax.distributed``.

JAX runs multi-process programs SPMD: every process must launch the same jitted steps in
the same order, each feeding its own devices' shards. The engine's schedule is a pure
function of its requests and when they arrive, so processes that apply the same commands
(add, abort) before the same step run the same steps. The server runs on process 0: its
``Leader`` wraps the engine, hands every step's commands to the others through the
coordinator's key-value store (``jax.distributed``'s own), then steps; ``follow`` is what
the other processes run: take a step's commands, apply them, step, forget finished
requests. A request's random seed is drawn on process 0 before it is sent, so every
process samples the same tokens. Offline (``LLM``), every process runs the same script.
"""
from __future__ import annotations

import logging
import pickle

import jax

log = logging.getLogger(__name__)
_PREFIX = "rltjax/step/"
_ACK = "rltjax/ack/"          # each follower's last step read: the leader deletes only below all of them
PRUNE_EVERY = 64
POLL_MS = 60_000        # a follower's wait for the next step, repeated while process 0 is idle


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join the job (CPU devices talk through gloo); call before anything touches a device."""
    # CPU devices of different processes exchange through gloo (GPUs use NCCL whatever this says);
    # set before any backend starts, as jax.distributed.initialize must run
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    log.info(f"process {process_id} of {num_processes}: {len(jax.local_devices())} local of "
             f"{len(jax.devices())} devices")


def _client():
    from jax._src import distributed   # the coordinator's key-value store; no public handle yet
    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized (rltjax.engine.multihost.initialize)")
    return distributed.global_state.client


class Leader:
    """Process 0's engine: every command is sent to the other processes before the step it precedes."""

    def __init__(self, engine):
        self.engine = engine
        self._pending: list[tuple] = []
        self._step = 0
        self._pruned = 0              # step keys below this are deleted
        self._client = _client()

    def __getattr__(self, name):          # everything else is the engine's
        return getattr(self.engine, name)

    def add_request(self, request_id, prompt, params=None):
        from rltjax.engine.request_intake import resolve_seed
        params = resolve_seed(params)      # the same seed on every process
        out = self.engine.add_request(request_id, prompt, params)
        req = self.engine.requests[str(request_id)]
        self._pending.append(("add", str(request_id), {"prompt_token_ids": list(req.prompt_token_ids)}, params))
        return out

    def abort_request(self, request_id):
        out = self.engine.abort_request(request_id)
        self._pending.append(("abort", str(request_id)))
        return out

    def step(self):
        self._send(self._pending + [("step",)])
        self._pending = []
        return self.engine.step()

    def close(self) -> None:
        """The followers leave their loops."""
        self._send([("stop",)])

    def _send(self, commands: list[tuple]) -> None:
        self._client.key_value_set_bytes(f"{_PREFIX}{self._step}", pickle.dumps(commands))
        self._step += 1
        if self._step % PRUNE_EVERY == 0:
            self._prune()

    def _prune(self) -> None:
        """Delete the step keys every follower has read (a follower may lag: a step need not
        wait on it, e.g. one that launches nothing to read)."""
        acks = []
        for pid in range(1, jax.process_count()):
            try:
                acks.append(int(self._client.key_value_try_get(f"{_ACK}{pid}")))
            except Exception:  # noqa: BLE001 - no ack yet (NOT_FOUND): nothing of it is read
                acks.append(0)
        done = min(acks, default=self._step)
        for step in range(self._pruned, done):
            self._client.key_value_delete(f"{_PREFIX}{step}")
        self._pruned = max(self._pruned, done)


def follow(engine) -> int:
    """A non-zero process's loop: apply each step's commands, then step; returns the steps run."""
    client, step = _client(), 0
    while True:
        try:
            data = client.blocking_key_value_get_bytes(f"{_PREFIX}{step}", POLL_MS)
        except Exception as exc:  # noqa: BLE001 - a timeout: process 0 is idle (or gone, then this raises)
            if "DEADLINE_EXCEEDED" in str(exc) or "timed out" in str(exc).lower():
                continue
            raise
        step += 1
        if step % PRUNE_EVERY == 0:           # the leader may delete what is below
            client.key_value_set(f"{_ACK}{jax.process_index()}", str(step), allow_overwrite=True)
        for cmd in pickle.loads(data):
            if cmd[0] == "stop":
                return step
            if cmd[0] == "add":
                engine.add_request(cmd[1], cmd[2], cmd[3])
            elif cmd[0] == "abort":
                engine.abort_request(cmd[1])
            else:
                engine.step()
                for rid in [rid for rid, r in engine.requests.items() if r.finished]:
                    engine.forget(rid)
