"""rltjax.tokenizer on the golden fixtures' tokenizers (ids per tests/fixtures/README.md)."""
import json
import shutil
from pathlib import Path

import pytest

from rltjax.tokenizer import Tokenizer, TokenizerError

FIX = Path(__file__).parent / "fixtures"
CONVO = [{"role": "system", "content": "You are helpful."},
         {"role": "user", "content": "What is the weather like?"}]
CHATML = ("<|im_start|>system\nYou are helpful.<|im_end|>\n"
          "<|im_start|>user\nWhat is the weather like?<|im_end|>\n"
          "<|im_start|>assistant\n")
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "  leading spaces, tabs\tand\nnewlines  ",
         "café naïve 日本語 🙂 — ünïcödé"]


@pytest.fixture(scope="module")
def ouro():
    return Tokenizer.from_dir(FIX / "ouro-tiny")


@pytest.mark.parametrize("name,bos,eos,pad,vocab", [
    ("ouro-tiny", 1, (2,), 0, 512),
    ("ouro-tiny-gqa", 1, (2,), 0, 512),
    ("huginn-tiny", 504, (505, 508), 509, 510),
    ("nanbeige-tiny", 504, (505,), 0, 506),
])
def test_special_ids(name, bos, eos, pad, vocab):
    tok = Tokenizer.from_dir(FIX / name)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (bos, eos, pad)
    assert tok.vocab_size == vocab


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny", "nanbeige-tiny"])
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(name, text):
    tok = Tokenizer.from_dir(FIX / name)
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_ids_are_shifted_between_fixtures(ouro):
    # README: each regular Huginn/Nanbeige id is its Ouro id - 3.
    hug = Tokenizer.from_dir(FIX / "huginn-tiny")
    text = "Hello there, how are you?"
    assert hug.encode(text) == [i - 3 for i in ouro.encode(text)]


def test_decode_skips_specials(ouro):
    ids = ouro.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ouro.decode(ids) == "hi"
    assert ouro.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_chat_template_chatml(ouro):
    assert ouro.apply_chat_template(CONVO) == CHATML
    assert ouro.apply_chat_template(CONVO, add_generation_prompt=False) == CHATML.rsplit("<|im_start|>", 1)[0]
    ids = ouro.apply_chat_template(CONVO, tokenize=True)
    assert ids == ouro.encode(CHATML)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert ouro.decode(ids, skip_special_tokens=False) == CHATML


def test_chat_template_huginn_uses_bos_and_end_turn():
    tok = Tokenizer.from_dir(FIX / "huginn-tiny")
    text = tok.apply_chat_template(CONVO)
    assert text == ("<|begin_text|><|begin_header|>system<|end_header|>\n\nYou are helpful.<|end_turn|>"
                    "<|begin_header|>user<|end_header|>\n\nWhat is the weather like?<|end_turn|>"
                    "<|begin_header|>Huginn<|end_header|>\n\n")
    ids = tok.apply_chat_template(CONVO, tokenize=True)
    assert ids[:2] == [504, 506] and ids.count(508) == 2


def test_nanbeige_chatml_ids():
    tok = Tokenizer.from_dir(FIX / "nanbeige-tiny")
    ids = tok.apply_chat_template(CONVO, tokenize=True)
    assert tok.apply_chat_template(CONVO) == CHATML
    assert ids[0] == 504 and ids.count(505) == 2 and 505 in tok.eos_token_ids


@pytest.mark.parametrize("messages,match", [
    ("hello", r"messages must be a list"),
    ([{"role": "user", "content": "a"}, "oops"], r"messages\[1\] must be a dict"),
    ([{"content": "a"}], r"messages\[0\] is missing field 'role'"),
    ([{"role": "user"}], r"messages\[0\] is missing field 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}],
     r"messages\[1\]\['content'\] must be a str, got int"),
    ([{"role": None, "content": "a"}], r"messages\[0\]\['role'\] must be a str"),
])
def test_message_validation(ouro, messages, match):
    with pytest.raises(ValueError, match=match):
        ouro.apply_chat_template(messages)


def _copy(tmp_path, name="ouro-tiny", skip=("model.safetensors",)):
    dst = tmp_path / name
    shutil.copytree(FIX / name, dst, ignore=shutil.ignore_patterns(*skip))
    return dst


def _edit(path, **fields):
    data = json.loads(path.read_text())
    for k, v in fields.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def test_upstream_zero_ids_still_stop_on_im_end(tmp_path):
    d = _copy(tmp_path)
    for f in ("config.json", "generation_config.json"):
        _edit(d / f, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    tok = Tokenizer.from_dir(d)
    assert (tok.bos_token_id, tok.pad_token_id) == (0, 0)
    assert tok.eos_token_ids == (0, 2)


def test_fallbacks_to_config_then_tokenizer_config(tmp_path):
    d = _copy(tmp_path)
    (d / "generation_config.json").unlink()
    _edit(d / "config.json", eos_token_id=[2, 0])
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == (2, 0)
    (d / "config.json").unlink()
    tok = Tokenizer.from_dir(d)  # strings in tokenizer_config.json
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, (2,), 0)


def test_no_template_falls_back_to_chatml(tmp_path):
    d = _copy(tmp_path)
    _edit(d / "tokenizer_config.json", chat_template=None)
    assert Tokenizer.from_dir(d).apply_chat_template(CONVO) == CHATML


def test_template_is_sandboxed(tmp_path):
    d = _copy(tmp_path)
    _edit(d / "tokenizer_config.json",
          chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat_template failed to render.*unsafe"):
        Tokenizer.from_dir(d).apply_chat_template(CONVO)


def test_missing_tokenizer_json(tmp_path):
    d = _copy(tmp_path, skip=("model.safetensors", "tokenizer.json"))
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(d)


@pytest.mark.parametrize("content", [b"not json at all", b'{"version": "1.0", "model": 3}', b"\xff\xfe"])
def test_garbage_tokenizer_files_name_the_file(tmp_path, content):
    """A tokenizer.json (or tokenizer_config.json) that cannot be read is one error naming
    the file."""
    d = _copy(tmp_path, skip=("model.safetensors",))
    (d / "tokenizer.json").write_bytes(content)
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(d)
    if not content.startswith(b"{"):      # (a JSON object is a valid tokenizer_config.json)
        e = _copy(tmp_path / "cfg", skip=("model.safetensors",))
        (e / "tokenizer_config.json").write_bytes(content)
        with pytest.raises(TokenizerError, match="tokenizer_config.json"):
            Tokenizer.from_dir(e)


def test_cli_reports_a_bad_tokenizer_in_one_line(tmp_path, capsys):
    import shutil
    from conftest import FIXTURES
    from rltjax.entrypoints.cli import main
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "ouro-tiny", d)
    (d / "tokenizer.json").write_text("garbage")
    rc = main(["generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "2", "--compilation-cache-dir", ""])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert rc == 2 and "Traceback" not in err and len(errors) == 1 and "tokenizer.json" in errors[0]
