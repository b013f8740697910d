"""Per-request output bookkeeping: tokens, logprobs, incremental text and stop checks.

The engine hands every sampled token to ``accept`` (after a head batch, or when it
replays a decode window's outputs), which appends it with its logprobs, extends the
detokenized text and says whether a stop (EOS, a stop token id or a stop string)
ended the request; the engine then decides on length and frees resources.
``output`` builds the user-facing ``RequestOutput``.
"""
from __future__ import annotations

from typing import Any, Sequence

from rltjax.engine.outputs import IncrementalDetokenizer, RequestOutput, StopChecker
from rltjax.engine.sequence import Request


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self._detok: dict[str, Any] = {}
        self._stops: dict[str, StopChecker] = {}
        self._texts: dict[str, str] = {}

    def add(self, req: Request) -> None:
        self._texts[req.request_id] = ""
        self._stops[req.request_id] = StopChecker(req.params, self.eos_token_ids)
        if self.tokenizer is not None:
            self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)

    def token_stop_ids(self, request_id: str) -> tuple[int, ...]:
        return self._stops[request_id].token_stop_ids

    def accept(self, r: Request, token: int, chosen, top_ids, top_lp, now: float
               ) -> tuple[bool, str | None, int | str | None]:
        """Append a sampled token (and its logprobs); returns (stopped, finish_reason, stop_reason)."""
        r.output_token_ids.append(token)
        r.first_token_time = r.first_token_time or now
        if r.params.logprobs is not None:
            entry = {int(t): float(lp) for t, lp in zip(top_ids[:r.params.logprobs], top_lp[:r.params.logprobs])}
            entry[token] = float(chosen)
            r.logprobs = (r.logprobs or []) + [entry]
        delta = self._detok[r.request_id].add_token(token) if r.request_id in self._detok else ""
        text = self._texts[r.request_id] + delta
        stopped, reason, stop_reason, text = self._stops[r.request_id].check(token, text, delta)
        self._texts[r.request_id] = text
        return stopped, reason, stop_reason

    def prompt_scores(self, chunks, starts, scores) -> None:
        """A scored prefill batch's prompt logprobs join their requests: entry p + 1 is prompt token
        p + 1's logprob after positions 0..p (top ``prompt_logprobs`` and the token itself). A
        recomputed request's prompt runs again; what it has on record is kept."""
        for c, at in zip(chunks, starts):
            r, k = c.request, c.request.params.prompt_logprobs
            if k is None or r.finished:
                continue
            if r.prompt_logprobs is None:
                r.prompt_logprobs = [None]
            for i in range(c.length):
                nxt = c.start + i + 1
                if nxt >= r.prompt_len or nxt < len(r.prompt_logprobs):
                    continue
                if nxt != len(r.prompt_logprobs):
                    raise RuntimeError(f"request {r.request_id!r}: prompt logprobs of position {nxt} before "
                                       f"{len(r.prompt_logprobs)} (this is a bug)")
                row = at + i
                entry = {int(t): float(lp) for t, lp in zip(scores.top_ids[row, :k], scores.top_lp[row, :k])}
                entry[r.prompt_token_ids[nxt]] = float(scores.chosen[row])
                r.prompt_logprobs.append(entry)

    def finish(self, req: Request, reason: str) -> None:
        """A request ended: text held back for a possible stop string is released unless a
        stop ended it."""
        detok = self._detok.get(req.request_id)
        if detok is not None and reason in ("length", "abort", "error"):
            self._texts[req.request_id] += detok.flush()

    def output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            token_ids=list(req.output_token_ids), text=self._texts.get(req.request_id, ""),
            exit_depths=list(req.exit_depths[:len(req.output_token_ids)]),
            finish_reason=req.finish_reason, logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs,
            finished=req.finished,
            stop_reason=req.stop_reason, error=req.error, num_cached_tokens=req.num_cached_tokens,
            metrics=dict(arrival_time=req.arrival_time, first_token_time=req.first_token_time,
                         finished_time=req.finished_time))

    def forget(self, request_id: str) -> None:
        for table in (self._detok, self._stops, self._texts):
            table.pop(request_id, None)
