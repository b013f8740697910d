"""A random-weight model directory at a preset's shape, for ``rltjax serve``.

``rltjax serve`` needs a model directory. Without the real checkpoint, this
writes one in the Hugging Face layout: the preset's config.json, random weights
(``checkpoints.random_init``, saved with ``checkpoints.hf.save_hf_params``) and
the ShareGPT-trained BPE as tokenizer.json (ChatML specials at ids 0..2). The
server then tokenizes ShareGPT text with the same tokenizer the benchmark used
for lengths, and its throughput is that of the real shapes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tokenizer_config() -> dict:
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    return {"added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                              "single_word": False, "special": True}
                                     for i, s in enumerate(specials)},
            "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE, "add_prefix_space": False,
            "clean_up_tokenization_spaces": False, "tokenizer_class": "GPT2Tokenizer"}


def write_random_model(dst: str | Path, hf_config: dict, tokenizer_json: str | Path, *, dtype: str = "bfloat16",
                       seed: int = 0) -> Path:
    """Write config, tokenizer and random safetensors weights to ``dst``; returns it."""
    from rltjax.checkpoints.hf import save_hf_params
    from rltjax.checkpoints.random_init import random_checkpoint
    from rltjax.config import parse_hf_config

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    hf_config = {**hf_config, "torch_dtype": dtype}
    cfg = parse_hf_config(hf_config)
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size()
    if vocab > cfg.vocab_size:
        raise ValueError(f"tokenizer has {vocab} entries, more than the model's vocab_size {cfg.vocab_size}")
    save_hf_params(dst, cfg, random_checkpoint(cfg, seed=seed, dtype=dtype))
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (dst / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": hf_config.get("eos_token_id"), "bos_token_id": hf_config.get("bos_token_id"),
         "pad_token_id": hf_config.get("pad_token_id"), "do_sample": False}, indent=2) + "\n")
    shutil.copyfile(tokenizer_json, dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
    (dst / "RANDOM_WEIGHTS.txt").write_text("Random weights written by benchmarks.random_model for "
                                            "benchmarks: the text it generates is meaningless.\n")
    return dst
