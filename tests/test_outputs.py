"""rltjax.engine.outputs on the ouro-tiny byte-level BPE tokenizer."""
from pathlib import Path

from hypothesis import given, settings, strategies as st

from rltjax.engine.outputs import (REPLACEMENT, IncrementalDetokenizer, RequestOutput,
                                   StopChecker)
from rltjax.sampling_params import SamplingParams
from rltjax.tokenizer import Tokenizer

TOK = Tokenizer.from_dir(Path(__file__).parent / "fixtures" / "ouro-tiny")
EOS = TOK.eos_token_ids            # (2,) = <|im_end|>
IDS = st.lists(st.integers(3, 503), max_size=40)
ANY_IDS = st.lists(st.integers(0, 511), max_size=40)
# Mixed scripts so multi-byte characters are split across byte-level tokens.
TEXT = st.text(st.one_of(st.characters(codec="utf-8", exclude_characters=REPLACEMENT),
                         st.sampled_from("中文日本語한국어😀🙂🎉👍🏽é—ü ")),
               max_size=30).filter(lambda t: "<|" not in t)  # no special-token strings


def feed(ids, prompt=(), skip=True):
    det = IncrementalDetokenizer(TOK, list(prompt), skip_special_tokens=skip)
    deltas = [det.add_token(t) for t in ids]
    return det, deltas


def run(ids, params, prompt=(), skip=True):
    """The engine's text loop: returns (final text, finish_reason, stop_reason, streamed, used)."""
    det = IncrementalDetokenizer(TOK, list(prompt), skip_special_tokens=skip)
    checker = StopChecker(params, EOS)
    streamed, sent = [], 0
    for n, t in enumerate(ids, 1):
        delta = det.add_token(t)
        done, reason, stop_reason, text = checker.check(t, det.text, delta)
        if not done and n == len(ids):
            done, reason, stop_reason, text = True, "length", None, det.text + det.flush()
        upto = len(text) if done else checker.releasable(text)
        assert upto >= sent
        streamed.append(text[sent:upto])
        sent = upto
        if done:
            assert "".join(streamed) == text
            return text, reason, stop_reason, streamed, n
    return det.text, None, None, streamed, len(ids)


@given(IDS)
def test_deltas_concatenate_to_decode_random_ids(ids):
    det, deltas = feed(ids)
    for i in range(len(ids)):
        # Released text is exactly the decode so far minus an unfinished U+FFFD tail:
        # nothing is shown early (no replacement char that later changes), nothing late.
        assert "".join(deltas[:i + 1]) == TOK.decode(ids[:i + 1]).rstrip(REPLACEMENT)
    assert "".join(deltas) + det.flush() == TOK.decode(ids)
    assert det.text == TOK.decode(ids) and det.output_token_ids == ids


@given(ANY_IDS, st.booleans(), st.lists(st.integers(0, 511), max_size=8))
def test_special_tokens_and_prompt_context(ids, skip, prompt):
    det, deltas = feed(ids, prompt=prompt, skip=skip)
    assert "".join(deltas) + det.flush() == TOK.decode(ids, skip_special_tokens=skip)


@given(TEXT)
def test_unicode_text_never_shows_replacement_char(text):
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    det, deltas = feed(ids, prompt=TOK.encode("Say: "))
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text and det.flush() == ""


def test_split_character_is_held_then_released():
    ids = TOK.encode("a中b")
    pieces = [TOK.decode([i]) for i in ids]
    assert REPLACEMENT in "".join(pieces)        # the fixture really splits 中 across tokens
    det, deltas = feed(ids)
    assert deltas == ["a", "", "", "中", "b"]      # 中 = 3 byte tokens, shown when complete


def test_invalid_tail_is_flushed():
    ids = TOK.encode("x中")[:-1]                  # ends inside 中: never completes
    det, deltas = feed(ids)
    assert "".join(deltas) == "x"
    assert det.flush() == REPLACEMENT and det.text == TOK.decode(ids)


def test_window_stays_short():
    class Counting:
        def __init__(self):
            self.longest = 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return TOK.decode(ids, skip_special_tokens)
    tok = Counting()
    text = "naïve 日本語 🙂 text " * 40
    ids = TOK.encode(text)
    det = IncrementalDetokenizer(tok, TOK.encode("prompt " * 50))
    assert "".join(det.add_token(t) for t in ids) == text
    assert len(ids) > 300 and tok.longest <= 12


def test_eos_and_ignore_eos():
    ids = TOK.encode("hello there") + [2] + TOK.encode(" more")
    text, reason, stop_reason, _, used = run(ids, SamplingParams())
    assert (text, reason, stop_reason, used) == ("hello there", "stop", None, len(ids) - 2)
    # EOS text is left out even when special tokens are shown.
    text, *_ = run(ids, SamplingParams(), skip=False)
    assert text == "hello there"
    text, reason, stop_reason, _, used = run(ids, SamplingParams(ignore_eos=True))
    assert (text, reason, used) == ("hello there more", "length", len(ids))


def test_stop_token_ids():
    ids = TOK.encode("one two three")
    stop_id = ids[3]
    text, reason, stop_reason, _, used = run(ids, SamplingParams(stop_token_ids=[stop_id]))
    assert (reason, stop_reason, used) == ("stop", stop_id, 4)
    assert text == TOK.decode(ids[:3])


def test_stop_string_spanning_tokens():
    ids = TOK.encode("Hello world, the END is near")
    # "END" arrives over several tokens (it is no single token's text).
    assert not any("END" in TOK.decode([i]) for i in ids)
    text, reason, stop_reason, streamed, used = run(ids, SamplingParams(stop=["END", "xyz"]))
    assert (text, reason, stop_reason) == ("Hello world, the ", "stop", "END")
    assert "END" in TOK.decode(ids[:used]) and "END" not in TOK.decode(ids[:used - 1])
    assert "E" not in "".join(streamed)


def test_first_completed_stop_wins():
    # The stop that a character-by-character check would meet first: earliest end,
    # then the longer one; so the cut does not depend on how the text was tokenized.
    c = StopChecker(SamplingParams(stop=["cd", "bc", "b"]), EOS)
    assert c.check(7, "abcd", "bcd") == (True, "stop", "b", "a")
    c = StopChecker(SamplingParams(stop=["aba", "b"]), EOS)
    assert c.check(7, "aba", "aba")[2:] == ("b", "a")
    c = StopChecker(SamplingParams(stop=["bc", "abc"]), EOS)
    assert c.check(7, "xabc", "abc")[2:] == ("abc", "x")
    # Only the region a new match can touch is searched; older text is not re-read.
    assert c.check(7, "abc__d", "d") == (False, None, None, "abc__d")
    assert c.check(7, "xab", "") == (False, None, None, "xab")


def test_releasable():
    c = StopChecker(SamplingParams(stop=["END", "###"]), EOS)
    assert c.releasable("the EN") == 4
    assert c.releasable("the E") == 4
    assert c.releasable("a ##") == 2
    assert c.releasable("the ENx") == 7
    assert StopChecker(SamplingParams(), EOS).releasable("abc") == 3


@settings(max_examples=150)
@given(TEXT, TEXT, st.lists(st.text("ab中😀 ", min_size=1, max_size=4), min_size=1, max_size=3))
def test_streaming_matches_final_text(before, after, stops):
    """Stop strings (spanning tokens or not) cut the text; the stream never shows a
    partial stop string and its concatenation is the final text."""
    full = before + stops[0] + after
    ids = TOK.encode(full)
    text, reason, stop_reason, streamed, used = run(ids, SamplingParams(stop=stops))
    # Expected: the stop string that ends first in the text, then the longer one.
    _, cut, first = min((full.find(s) + len(s), full.find(s), s) for s in stops if s in full)
    assert (text, reason, stop_reason) == (full[:cut], "stop", first)
    assert "".join(streamed) == text
    # Stopped at the first token whose decode holds a stop string.
    assert not any(s in TOK.decode(ids[:used - 1]) for s in stops)


def test_request_output_defaults():
    out = RequestOutput(request_id="r1", prompt_token_ids=[1, 2])
    assert (out.finished, out.finish_reason, out.stop_reason, out.text) == (False, None, None, "")
    assert set(out.metrics) == {"arrival_time", "first_token_time", "finished_time"}
    assert RequestOutput("r2").metrics is not out.metrics
