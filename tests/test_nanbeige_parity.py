"""Parity of the JAX Nanbeige (looped Llama) + dense reference with the upstream PyTorch outputs (float32)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import reference_model, reference_npz
from rltjax.reference.stages import sequence_forward
from rltjax.sampling_params import SamplingParams

PROMPTS = ["p0", "p1", "p2"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
NAME = "nanbeige-tiny"


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def run():
    ref = reference_npz(NAME)
    rm = reference_model(NAME)
    outs = {p: rm.generate(ref[f"{p}_input_ids"], GREEDY, record_prompt=True, record_logits=True)
            for p in PROMPTS}
    return rm, ref, outs


def test_config_and_weights():
    rm = reference_model(NAME)
    cfg = rm.cfg
    assert (cfg.num_loops, cfg.has_exit_gate, cfg.q_width, cfg.hidden_size) == (2, False, 128, 64)
    assert rm.params.layers.wq.shape == (2, 64, 128) and rm.params.layers.wo.shape == (2, 128, 64)


@pytest.mark.parametrize("p", PROMPTS)
def test_per_loop_hidden_and_logits(run, p):
    rm, ref, outs = run
    out = outs[p]
    assert rel_err(out.prompt_states, ref[f"{p}_hidden"]) < 1e-4      # token by token, per loop
    assert np.all(out.prompt_gate_logits == 0.0)                       # no gate: zero signal
    logits = np.asarray(rm._head(rm.params, jnp.asarray(out.prompt_states[-1])))
    assert rel_err(logits, ref[f"{p}_logits"]) < 1e-4


@pytest.mark.parametrize("p", ["p1"])
def test_whole_prompt_forward(run, p):
    rm, ref, _ = run
    fwd = sequence_forward(rm.model, rm.params, ref[f"{p}_input_ids"], 2)
    assert rel_err(fwd["states"], ref[f"{p}_hidden"]) < 1e-4
    assert rel_err(fwd["logits"], ref[f"{p}_logits"]) < 1e-4


@pytest.mark.parametrize("p", PROMPTS)
def test_greedy_continuation(run, p):
    rm, ref, outs = run
    out = outs[p]
    assert out.token_ids == [int(t) for t in ref[f"{p}_gen_ids"]]
    assert out.exit_depths == [2] * 12
    assert rel_err(np.stack(out.logits), ref[f"{p}_gen_logits"]) < 1e-4


def test_no_gate_runs_fixed_depth():
    """The default exit mode (ouro) falls back to fixed depth: a threshold changes nothing."""
    ref = reference_npz(NAME)
    rm = reference_model(NAME)
    sp = SamplingParams(max_tokens=4, temperature=0.0, exit_threshold=0.3, ignore_eos=True)
    out = rm.generate(ref["p0_input_ids"], sp, record_logits=True)
    assert out.exit_depths == [2] * 4
    assert out.token_ids == [int(t) for t in ref["p0_gen_ids"][:4]]
    shallow = rm.generate(ref["p0_input_ids"], SamplingParams(max_tokens=4, temperature=0.0, max_loops=1,
                                                               ignore_eos=True))
    assert shallow.exit_depths == [2, 1, 1, 1]
