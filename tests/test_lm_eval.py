"""lm-eval's ``local-completions`` runs against ``rltjax serve`` unchanged (its "remote"
tokenizer is the server's /tokenize), on the tasks in tests/fixtures/eval: its
loglikelihoods and greedy generations equal what the engine computes itself for the same
token ids (prompt logprobs through ``SamplingParams``, no server in between)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES
from engine_helpers import make_engine, run_workload
from rltjax.sampling_params import SamplingParams
from server_helpers import ENGINE, MODEL, LiveServer, tok  # noqa: F401  (fixture)

TASKS = Path(__file__).parent / "fixtures" / "eval"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm_eval")
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp / "hf"))
    for name in ("tiny_choice.yaml", "tiny_gen.yaml"):   # lm-eval resolves data files from the cwd
        text = (TASKS / name).read_text().replace("DATA_FILE", str(TASKS / "tiny_choice.jsonl"))
        (tmp / name).write_text(text)
    import lm_eval
    from lm_eval.tasks import TaskManager
    tasks = TaskManager(include_path=str(tmp))
    with LiveServer() as srv:
        plain = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": srv.url + "/v1/completions", "model": MODEL, "tokenizer_backend": "remote",
                        "max_length": 512, "num_concurrent": 2, "max_retries": 1},
            tasks=["rltjax_tiny_choice", "rltjax_tiny_gen"], task_manager=tasks, log_samples=True)
        chat = lm_eval.simple_evaluate(
            model="local-chat-completions",
            model_args={"base_url": srv.url + "/v1/chat/completions", "model": MODEL, "tokenizer_backend": None,
                        "tokenized_requests": False, "num_concurrent": 2, "max_retries": 1},
            tasks=["rltjax_tiny_gen"], task_manager=tasks, apply_chat_template=True, log_samples=True)
    return {"plain": plain, "chat": chat, "tasks": tmp}


def test_loglikelihoods_equal_the_engines_own(results, tok):
    results = results["plain"]
    samples = results["samples"]["rltjax_tiny_choice"]
    pairs = [(args, resp[0]) for s in samples for args, resp in zip(s["arguments"], s["resps"])]
    assert len(pairs) == 17
    arrivals, spans = [], {}
    for i, ((context, continuation), _) in enumerate(pairs):
        whole, ctx = tok.encode(context + continuation), tok.encode(context)   # lm-eval's split
        arrivals.append((0, str(i), whole, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)))
        spans[str(i)] = (whole, len(ctx))
    outs = run_workload(make_engine(**ENGINE), arrivals)
    for i, (_, (loglik, greedy)) in enumerate(pairs):
        whole, start = spans[str(i)]
        entries = outs[str(i)].prompt_logprobs[start:]
        want = sum(e[t] for e, t in zip(entries, whole[start:]))
        np.testing.assert_allclose(loglik, want, atol=1e-4)
        assert greedy == all(e[t] == max(e.values()) for e, t in zip(entries, whole[start:]))
    assert 0.0 <= results["results"]["rltjax_tiny_choice"]["acc,none"] <= 1.0


@pytest.mark.parametrize("kind", ["plain", "chat"])
def test_greedy_generations_equal_the_engines_own(results, tok, kind):
    """local-completions sends the server's token ids; local-chat-completions sends messages,
    which the server renders with the chat template."""
    samples = results[kind]["samples"]["rltjax_tiny_gen"]
    arrivals = []
    for i, s in enumerate(samples):
        context = s["arguments"][0][0]
        ids = tok.encode(context) if kind == "plain" else tok.apply_chat_template(
            json.loads(context[0]), True, True)   # the messages, as JSON
        arrivals.append((0, str(i), ids, SamplingParams(max_tokens=6, temperature=0.0, stop=["\n"])))
    outs = run_workload(make_engine(**ENGINE), arrivals)
    assert [s["resps"][0][0] for s in samples] == [outs[str(i)].text for i in range(len(samples))]


def test_rltjax_eval_command(results, tmp_path, capsys):
    """``rltjax eval`` serves the model itself and reports what lm-eval computed against the server."""
    from rltjax.entrypoints.cli import main
    out = tmp_path / "results.json"
    rc = main(["eval", str(FIXTURES / MODEL), "--tasks", "rltjax_tiny_choice", "--include-path", str(results["tasks"]),
               "--num-concurrent", "2", "--output-path", str(out), "--no-compile-ahead", "--compilation-cache-dir", "",
               "--log-level", "warning"])
    assert rc == 0 and "rltjax_tiny_choice" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"]["rltjax_tiny_choice"]["acc,none"] == \
        results["plain"]["results"]["rltjax_tiny_choice"]["acc,none"]
