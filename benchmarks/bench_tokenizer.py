"""The tokenizer that turns ShareGPT text into request lengths.

With a model directory (``--tokenizer DIR``, or the benchmarked ``--model``) its
own ``tokenizer.json`` is used and lengths are exact. Without one — random
weights at a preset's shape — a byte-level BPE with the real vocabulary size
(Ouro: 49,152) is trained with ``tokenizers`` on the ShareGPT exchanges
themselves and cached under ``~/.cache/rltjax``; its token counts are comparable
to, not equal to, the real model's, and reports say which one was used.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Sequence

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")   # ids 0, 1, 2 as in Ouro's vocabulary
TRAINER_VERSION = "1"


@dataclasses.dataclass
class BenchTokenizer:
    """``encode(text) -> ids`` plus a line for the report saying where it came from."""
    backend: object           # a ``tokenizers.Tokenizer``
    vocab_size: int
    source: str               # "model:DIR" or "trained-bpe:PATH"
    note: str

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def describe(self) -> dict:
        return dict(source=self.source, vocab_size=self.vocab_size, note=self.note)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rltjax"


def from_model_dir(model_dir: str | Path) -> BenchTokenizer:
    from rltjax.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    return BenchTokenizer(tok.backend, tok.vocab_size, f"model:{model_dir}",
                          f"the tokenizer of {model_dir} (exact lengths for that model)")


def train_bpe(texts: Sequence[str], vocab_size: int) -> str:
    """A byte-level BPE (specials 0..2, the 256 byte symbols, then merges) as tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def trained_tokenizer(pairs: Sequence[tuple[str, str, str]], vocab_size: int = 49152,
                      cache_dir: str | Path | None = None, max_docs: int | None = None) -> BenchTokenizer:
    """The ShareGPT-trained BPE, from the cache or trained now (prompts and replies as the corpus)."""
    from tokenizers import Tokenizer

    docs = pairs if max_docs is None else pairs[:max_docs]
    digest = hashlib.sha256(f"{TRAINER_VERSION}|{vocab_size}|{len(docs)}|{docs[0][0] if docs else ''}|"
                            f"{docs[-1][0] if docs else ''}".encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir else cache_root() / "bench-tokenizers"
    path = root / f"sharegpt-bpe-{vocab_size}-{digest}.json"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        text = train_bpe([t for _, p, r in docs for t in (p, r)], vocab_size)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=root)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)   # atomic: a concurrent reader sees nothing or the whole file
    backend = Tokenizer.from_file(str(path))
    return BenchTokenizer(backend, backend.get_vocab_size(), f"trained-bpe:{path}",
                          f"byte-level BPE, vocab {backend.get_vocab_size()}, trained on {len(docs)} ShareGPT "
                          "exchanges (no real tokenizer given): lengths are comparable to, not equal to, "
                          "the real model's")
