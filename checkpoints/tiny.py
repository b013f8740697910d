"""Write tiny random-weight checkpoints in the Hugging Face layout.

Why: tests, demos and CI need a real model directory (config, tokenizer,
safetensors) without downloading gigabytes. The directory looks exactly like
an upstream one (same config field names, tensor names and shapes), so it
exercises the same loading path as a real checkpoint.

Weights follow the golden fixtures' recipe (tests/fixtures/README.md): matrices
N(0, 0.02²), norm weights 1 + 0.1·N(0,1) so the norms matter, and an exit gate
with weight N(0, (1.1/√hidden)²) and bias N(0, 0.3²) so that different positions
exit at different loop steps. Leaves are drawn in rltjax's params layout from
numpy's PCG64 and converted with the model's own ``hf_tensor_specs``, so the
writer can never disagree with the reader.

The tokenizer is a byte-level BPE trained on ``data/corpus.txt``. The
``tokenizers`` trainer is deterministic: it counts words into hash maps, but
breaks merge ties by the pair's content and sorts the alphabet, so two runs (in
two processes, with different hash seeds) give byte-identical tokenizer.json.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from rltjax.config import parse_hf_config

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": "bfloat16"}
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "model.safetensors")
DEMO_VERSION = "1"  # bump when the demo checkpoint's content changes; caches rewrite


def _ouro_config(hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
                 intermediate_size, vocab_size, num_loops, dtype) -> dict:
    return {
        "architectures": ["OuroForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "early_exit_threshold": 1.0,
        "eos_token_id": 2,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": 512,
        "max_window_layers": 28,
        "model_type": "ouro",
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "total_ut_steps": num_loops,
        "transformers_version": "4.57.6",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def train_tokenizer(vocab_size: int) -> str:
    """Byte-level BPE on the corpus: specials 0..2, the 256 byte symbols, then merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} entries, wanted {vocab_size}: "
                           "the corpus is too small for this vocab_size")
    return tok.to_str(pretty=True)


def _tokenizer_config() -> dict:
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "tokenizer_class": "GPT2Tokenizer",
    }


def _ouro_tensors(config: dict, seed: int, dtype) -> dict[str, np.ndarray]:
    from rltjax.models.ouro import hf_tensor_specs

    cfg = parse_hf_config(config)
    rng = np.random.Generator(np.random.PCG64(seed))
    tensors: dict[str, np.ndarray] = {}
    for spec in hf_tensor_specs(cfg):  # fixed order -> fixed draws
        z = rng.standard_normal(spec.leaf_shape())
        if spec.param.endswith("norm"):
            leaf = 1.0 + 0.1 * z
        elif spec.param == "gate_w":
            leaf = (1.1 / np.sqrt(cfg.hidden_size)) * z
        elif spec.param == "gate_b":
            leaf = 0.3 * z
        else:
            leaf = 0.02 * z
        tensors.update(spec.from_leaf(leaf.astype(np.float32)))
    if dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    return {name: np.ascontiguousarray(t.astype(dtype)) for name, t in sorted(tensors.items())}


def _dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def write_tiny_checkpoint(dst, arch: str = "ouro", seed: int = 0, hidden_size: int = 64,
                          num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 4,
                          head_dim: int = 16, intermediate_size: int = 160, vocab_size: int = 512,
                          num_loops: int = 4, dtype: str = "float32") -> Path:
    """Write a complete HF model directory at ``dst`` (created if needed); returns its path."""
    if arch != "ouro":
        raise NotImplementedError(f"write_tiny_checkpoint supports arch='ouro' only, got {arch!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    from safetensors.numpy import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = _ouro_config(hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
                          intermediate_size, vocab_size, num_loops, dtype)
    tensors = _ouro_tensors(config, seed, _DTYPES[dtype])
    _dump(dst / "config.json", config)
    _dump(dst / "generation_config.json", {"_from_model_config": False, "bos_token_id": 1,
                                           "do_sample": False, "eos_token_id": 2,
                                           "pad_token_id": 0, "transformers_version": "4.57.6"})
    (dst / "tokenizer.json").write_text(train_tokenizer(vocab_size), encoding="utf-8")
    _dump(dst / "tokenizer_config.json", _tokenizer_config())
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rltjax"


def _complete(path: Path) -> bool:
    stamp = path / ".rltjax-demo-version"
    return (all((path / f).is_file() for f in FILES) and stamp.is_file()
            and stamp.read_text().strip() == DEMO_VERSION)


def default_demo_checkpoint() -> Path:
    """The demo Ouro checkpoint, written once under $XDG_CACHE_HOME/rltjax (or ~/.cache).

    Written into a temp dir next to the target and renamed into place, so a
    concurrent caller sees either nothing or a complete directory. An
    incomplete or stale directory (missing files, old DEMO_VERSION) is replaced.
    """
    root = _cache_root()
    dst = root / "demo-ouro-tiny"
    if _complete(dst):
        return dst
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-ouro-tiny.tmp-", dir=root))
    try:
        write_tiny_checkpoint(tmp)
        (tmp / ".rltjax-demo-version").write_text(DEMO_VERSION + "\n")
        if dst.exists() and not _complete(dst):
            trash = Path(tempfile.mkdtemp(prefix=".demo-ouro-tiny.old-", dir=root))
            try:
                os.rename(dst, trash / "old")
            except FileNotFoundError:  # another caller moved it first
                pass
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, dst)
        except OSError:  # another caller won the race: its directory is complete
            if not _complete(dst):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
