"""Helpers for engine behaviour tests: a plan recorder and a workload driver."""
from __future__ import annotations


from conftest import reference_npz
from engine_helpers import check_equal  # noqa: F401  (re-exported)
from rltjax.sampling_params import SamplingParams

TOKENS = [int(t) for t in reference_npz("ouro-tiny")["p2_input_ids"]] * 3   # 120 prompt ids
R = 4
SMALL_PAGES = 25      # 24 usable pages: 6 per plane, i.e. at most 24 positions for one request

TRACE = {"fast": [4, 1, 1, 1, 1, 1, 1, 1], "slow": [4, 4, 4, 4, 4, 4, 4, 4],
         "short": [4, 1], "first": [3, 1, 1, 1], "range": [4, 1, 3, 1], "float": [4, 1, 2.0, 1]}


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)




def check_against_reference(outputs, arrivals, ref, skip=()):
    for _, rid, prompt, params in arrivals:
        if rid not in skip:
            check_equal(outputs[rid], ref.generate(prompt, params, request_id=rid))


def plan_kind(plan) -> str:
    """A plan's kind as the scheduling traces name it: its one step's (prefill, loop, head),
    "window" for any plan that launches a decode window, "idle" for none; swaps queued
    before a step count as "swap" only when nothing else runs."""
    from rltjax.engine.plan import HeadStep, LoopStep, PrefillStep, SwapInStep, SwapOutStep, WindowStep
    kinds = {PrefillStep: "prefill", LoopStep: "loop", HeadStep: "head", WindowStep: "window",
             SwapOutStep: "swap", SwapInStep: "swap"}
    steps = [kinds[type(step)] for step in plan.steps]
    return "window" if "window" in steps else (steps[-1] if steps else "idle")


class PlanLog:
    """Wraps ``engine.scheduler.schedule``: per step, the plan and the requests' states
    at the moment it was chosen (after admission, before the batch ran)."""

    def __init__(self, engine):
        self.entries: list[dict] = []
        schedule = engine.scheduler.schedule

        def recorded():
            sched = engine.scheduler
            # a loop pass's rows as they enter it (the plan does not change them)
            plan = schedule()
            kind, step = plan_kind(plan), plan.steps[-1] if plan.steps else None
            if kind == "loop":
                rows = tuple((r.request_id, r.loops_done) for r in step.rows)
            elif kind == "head":
                rows = tuple(r.request_id for r in step.rows)
            elif kind == "prefill":
                rows = tuple((c.request.request_id, c.start, c.length) for c in step.chunks)
            else:
                rows = ()
            self.entries.append(dict(
                kind=kind, rows=rows, plan=plan,
                status={r.request_id: (r.status, r.loops_done) for r in sched.running},
                waiting=[r.request_id for r in sched.waiting]))
            return plan

        engine.scheduler.schedule = recorded

    def compact(self):
        return [(e["kind"], e["rows"]) for e in self.entries]

    def admitted_at(self, rid):
        return next(i for i, e in enumerate(self.entries) if rid in e["status"])


def drive(engine, arrivals, aborts=None, max_steps=2000):
    """Like run_workload, but aborts ``rid`` before the first step at which
    ``aborts[rid](request)`` holds, and collects every output ``step`` returns.
    Returns (outputs by id, what each abort saw, outputs returned per step)."""
    aborts = aborts or {}
    pending = sorted(arrivals, key=lambda a: a[0])
    seen, returned, step = {}, [], 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for rid, when in aborts.items():
            req = engine.requests.get(rid)
            if rid not in seen and req is not None and not req.finished and when(req):
                seen[rid] = dict(status=req.status, loops_done=req.loops_done,
                                 num_prefilled=req.num_prefilled, num_output=len(req.output_token_ids))
                out = engine.abort_request(rid)
                assert out.finished and out.finish_reason == "abort" and out.request_id == rid
        returned.append(engine.step())
        step += 1
        assert step < max_steps, "workload did not finish"
    return {rid: engine.get_output(rid) for _, rid, _, _ in arrivals}, seen, returned




FAST_SLOW = [(0, "fast", TOKENS[:3], greedy(4)),
             (0, "slow", TOKENS[10:15], SamplingParams(max_tokens=3, temperature=1.0, seed=7, ignore_eos=True))]
