"""Text <-> ids for a Hugging Face model directory, without running its code.

Only data files are read: ``tokenizer.json`` (through the Rust ``tokenizers``
library), ``generation_config.json``, ``config.json`` and
``tokenizer_config.json``. Chat templates are rendered in a jinja2 sandbox, so
a downloaded model directory can never execute Python here (no
``trust_remote_code``, no ``transformers`` dependency).

Special ids are taken per field from ``generation_config.json`` first (that is
what ``generate`` uses upstream), then ``config.json``, then the token strings
in ``tokenizer_config.json``. The stop set (``eos_token_ids``) also holds the
chat end token: upstream Ouro configs say bos = eos = pad = 0
(``<|endoftext|>``), a known mistake, yet chat turns end with ``<|im_end|>``;
without it a chat reply would never stop.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# Used when tokenizer_config.json has no chat_template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Tokens that end a chat turn. <|im_end|> always stops when the vocab has it;
# the others stop when the chat template emits them.
_IM_END = "<|im_end|>"
_CHAT_END_TOKENS = ("<|end_turn|>", "<|eot_id|>", "<|end|>")


class TokenizerError(ValueError):
    """A model directory's tokenizer files are missing or unreadable; the message names the file."""


class TemplateKwargsError(ValueError):
    """``chat_template_kwargs`` that would replace what the template is given itself."""


class PromptTooLong(ValueError):
    """A text has more than ``limit`` tokens (at least ``at_least``), found without tokenizing all of it."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"at least {at_least} tokens, more than the limit of {limit}")
        self.at_least, self.limit = at_least, limit

    def __reduce__(self):   # crosses from a tokenizing process intact
        return PromptTooLong, (self.at_least, self.limit)


# encode_bounded counts a long text in pieces of 4 characters a token of the limit, at most this
# many, and stops once the count proves it too long: a 10 MB prompt is refused after its first
# pieces, not 10 s later.
COUNT_PIECE_CHARS = 1 << 18
MIN_PIECE_CHARS = 4096
# A piece boundary can change the count by a token or two (a word's merges, a prefix space);
# each boundary is charged this many so the bound never refuses a text that fits.
_PER_CUT_SLACK = 4
_WORD_SPACE = re.compile(r"(?<=\S) ")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _pick_template(tok_cfg: dict[str, Any], model_dir: Path) -> str | None:
    tpl = tok_cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if tpl is None and (model_dir / "chat_template.jinja").is_file():
        tpl = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    return tpl if isinstance(tpl, str) else None


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes; HF templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def validate_messages(messages: Any) -> None:
    """Raise ValueError naming the first bad message index and field."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', "
                             f"got {type(msg).__name__}")
        for field in ("role", "content"):
            if field not in msg:
                raise ValueError(f"messages[{i}] is missing field {field!r}")
            if not isinstance(msg[field], str):
                raise ValueError(f"messages[{i}][{field!r}] must be a str, "
                                 f"got {type(msg[field]).__name__}")


class Tokenizer:
    """A model directory's tokenizer, special ids and chat template."""

    def __init__(self, backend: _HFTokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], pad_token_id: int | None,
                 chat_template: str | None, special_strings: dict[str, str] | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self.special_strings = dict(special_strings or {})  # bos_token etc. for templates
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {model_dir}: rltjax needs a fast-tokenizer file "
                "(slow sentencepiece/vocab.txt tokenizers are not supported)")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own types
            raise TokenizerError(f"{path}: not a readable fast-tokenizer file ({exc})") from exc
        gen = _read_json(model_dir / "generation_config.json")
        cfg = _read_json(model_dir / "config.json")
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")

        def from_tok_cfg(name: str) -> int | None:
            s = _token_str(tok_cfg.get(name))
            return None if s is None else backend.token_to_id(s)

        def pick(key: str, tok_key: str) -> Any:
            for src in (gen, cfg):
                if src.get(key) is not None:
                    return src[key]
            return from_tok_cfg(tok_key)

        template = _pick_template(tok_cfg, model_dir)
        eos = _as_ids(pick("eos_token_id", "eos_token"))
        ends = [_IM_END] + [t for t in _CHAT_END_TOKENS if template and t in template]
        eos += [i for i in map(backend.token_to_id, ends) if i is not None]

        specials = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            s = _token_str(tok_cfg.get(name))
            if s is not None:
                specials[name] = s
        bos, pad = pick("bos_token_id", "bos_token"), pick("pad_token_id", "pad_token")
        for name, tid in (("bos_token", bos), ("pad_token", pad)):
            if name not in specials and tid is not None and backend.id_to_token(tid) is not None:
                specials[name] = backend.id_to_token(tid)
        return cls(backend, bos_token_id=bos, eos_token_ids=eos, pad_token_id=pad,
                   chat_template=template, special_strings=specials)

    @property
    def vocab_size(self) -> int:
        """Entries in the tokenizer (may be fewer than the model's embedding rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings inside ``text`` map to their ids (templates rely on it)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_bounded(self, text: str, limit: int, add_special_tokens: bool = False) -> list[int]:
        """``encode(text)``, or PromptTooLong as soon as ``text`` provably has over ``limit`` tokens.

        Texts shorter than 8 x ``limit`` characters (or two pieces) are simply encoded. Longer
        ones are first counted piece by piece, cut before a space that starts a word (where
        the pre-tokenisers of these models split anyway); the count less a slack per cut (the
        most a cut can add: an added token cut in two falls apart into its characters) is a
        lower bound, so crossing ``limit`` proves the whole text too long. A long text
        that fits is then encoded whole, so the ids never depend on the pieces.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        piece = min(COUNT_PIECE_CHARS, max(4 * limit, MIN_PIECE_CHARS))
        if len(text) > max(2 * piece, 8 * limit):
            # a cut inside an added token (no space to cut at) splits it into its characters' tokens
            slack = max(_PER_CUT_SLACK, self._longest_added + 1)
            counted, start = 0, 0
            for cuts, end in enumerate(_piece_ends(text, piece)):
                counted += len(self.backend.encode(text[start:end], add_special_tokens=False).ids)
                start = end
                if counted - slack * cuts > limit:
                    raise PromptTooLong(counted - slack * cuts, limit)
        return self.encode(text, add_special_tokens)

    @property
    def _longest_added(self) -> int:
        return max((len(t.content) for t in self.backend.get_added_tokens_decoder().values()), default=0)

    def __getstate__(self):   # picklable for a tokenizing process; the compiled template is rebuilt there
        return {**self.__dict__, "_compiled": None}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            try:
                self._compiled = env.from_string(self.chat_template or CHATML_TEMPLATE)
            except jinja2.exceptions.TemplateError as exc:
                raise ValueError(f"chat_template does not compile: {exc}") from exc
        return self._compiled

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, template_kwargs: dict[str, Any] | None = None
                            ) -> str | list[int]:
        """Render the model's chat template (ChatML if it has none); ids if ``tokenize``.

        ``template_kwargs`` are extra template variables (vLLM's ``chat_template_kwargs``,
        e.g. ``enable_thinking``); they cannot replace ``messages`` or the special tokens.
        """
        validate_messages(messages)
        template_kwargs = template_kwargs or {}
        fixed = {"messages", "add_generation_prompt", *self.special_strings}
        clash = sorted(fixed & set(template_kwargs))
        if clash:
            raise TemplateKwargsError(f"may not set {', '.join(clash)} (the template gets them from the request "
                                      f"and the tokenizer)")
        try:
            text = self._template().render(**template_kwargs, messages=list(messages),
                                           add_generation_prompt=add_generation_prompt,
                                           **self.special_strings)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat_template failed to render: {exc}") from exc
        return self.encode(text) if tokenize else text


def _piece_ends(text: str, size: int) -> Iterable[int]:
    """End offsets of consecutive pieces of about ``size`` characters, each cut just before a
    space that follows a non-space (the last piece ends at ``len(text)``)."""
    start = 0
    while len(text) - start > size:
        found = _WORD_SPACE.search(text, start + size, start + 2 * size)
        cut = found.start() if found else start + size   # one huge word: cut inside it
        yield cut
        start = cut
    yield len(text)
