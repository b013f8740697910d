"""Parity of the JAX Ouro + dense reference with the upstream PyTorch outputs (float32)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import reference_model, reference_npz
from rltjax.reference.exits import TokenExit
from rltjax.sampling_params import SamplingParams

PROMPTS = ["p0", "p1", "p2"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module", params=["ouro-tiny", "ouro-tiny-gqa"])
def run(request):
    name = request.param
    ref = reference_npz(name)
    rm = reference_model(name)
    outs = {p: rm.generate(ref[f"{p}_input_ids"], GREEDY, record_prompt=True, record_logits=True)
            for p in PROMPTS}
    return name, rm, ref, outs


@pytest.mark.parametrize("p", PROMPTS)
def test_per_loop_states_gates_and_logits(run, p):
    _, rm, ref, outs = run
    out = outs[p]
    assert rel_err(out.prompt_states, ref[f"{p}_hidden"]) < 1e-4
    assert rel_err(out.prompt_gate_logits, ref[f"{p}_gate_logits"]) < 1e-4
    step_logits = np.stack([np.asarray(rm._head(rm.params, jnp.asarray(s))) for s in out.prompt_states])
    assert rel_err(step_logits, ref[f"{p}_step_logits"]) < 1e-4
    assert rel_err(step_logits[-1], ref[f"{p}_logits"]) < 1e-4


@pytest.mark.parametrize("p", PROMPTS)
@pytest.mark.parametrize("q", [0.3, 0.6, 0.9])
def test_exit_step_per_position(run, p, q):
    """The `ouro` rule (min_loops=1) on the per-loop gates picks upstream's exit step exactly."""
    _, rm, ref, outs = run
    hazards = np.asarray(1 / (1 + np.exp(-jnp.asarray(outs[p].prompt_gate_logits))), np.float32)
    R = rm.cfg.num_loops
    steps = []
    for s in range(hazards.shape[1]):
        rule = TokenExit("ouro", min_loops=1, max_loops=R, threshold=q)
        steps.append(next(r for r in range(1, R + 1) if rule.after_loop(r, hazards[r - 1, s])) - 1)
    expected = ref[f"{p}_exit_q{int(q * 100):02d}_steps"]
    np.testing.assert_array_equal(steps, expected)
    step_logits = np.stack([np.asarray(rm._head(rm.params, jnp.asarray(st))) for st in outs[p].prompt_states])
    chosen = step_logits[np.array(steps), np.arange(len(steps))]
    assert rel_err(chosen, ref[f"{p}_exit_q{int(q * 100):02d}_logits"]) < 1e-4


@pytest.mark.parametrize("p", PROMPTS)
def test_greedy_continuation_full_depth(run, p):
    _, rm, ref, outs = run
    out = outs[p]
    assert out.token_ids == [int(t) for t in ref[f"{p}_gen_ids"]]
    assert out.exit_depths == [rm.cfg.num_loops] * 12
    assert rel_err(np.stack(out.logits), ref[f"{p}_gen_logits"]) < 1e-4


@pytest.mark.parametrize("p", PROMPTS)
def test_depth_two_override(p):
    """total_ut_steps overridden to 2: prefill and decode both run 2 loops."""
    ref = reference_npz("ouro-tiny")
    rm = reference_model("ouro-tiny", overrides=(("total_ut_steps", 2),))
    assert rm.cfg.num_loops == 2
    out = rm.generate(ref[f"{p}_input_ids"], GREEDY, record_prompt=True, record_logits=True)
    step_logits = np.asarray(rm._head(rm.params, jnp.asarray(out.prompt_states[-1])))
    assert rel_err(step_logits, ref[f"{p}_t2_logits"]) < 1e-4
    assert out.token_ids == [int(t) for t in ref[f"{p}_t2_gen_ids"]]
    assert rel_err(np.stack(out.logits), ref[f"{p}_t2_gen_logits"]) < 1e-4


def test_bf16_checkpoint_in_bf16():
    """The bf16 sharded checkpoint run in bf16 stays within bf16 tolerance of the fp32 reference."""
    ref = reference_npz("ouro-tiny-gqa")
    rm = reference_model("ouro-tiny-gqa", dtype="bfloat16")
    assert rm.params.embed.dtype == jnp.bfloat16
    for p in PROMPTS:
        out = rm.generate(ref[f"{p}_input_ids"], SamplingParams(max_tokens=1, temperature=0.0),
                          record_prompt=True, record_logits=True)
        assert np.max(np.abs(out.logits[0] - ref[f"{p}_logits"][-1])) < 2e-2
        assert rel_err(out.prompt_states.astype(np.float32), ref[f"{p}_hidden"]) < 5e-2
