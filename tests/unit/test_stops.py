from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from hotlora.server.engine.generate import Delta, GenerationJob, SampledToken
from hotlora.server.engine.sampling import SamplingParams
from hotlora.server.engine.sequences import Row
from hotlora.server.engine.stops import StopMatcher
from hotlora.server.engine.tokens import RowDetokenizers, TokenPieces

from tests.support.scheduling import Recorder


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = "".join(matcher.feed(d) for d in deltas)
    return out + matcher.flush(), matcher.stopped


CASES = [
    # stops, deltas, expected text, stopped
    (["STOP"], ["Hello ", "world"], "Hello world", False),
    (["STOP"], ["Hello ", "STOP", " more"], "Hello ", True),
    (["STOP"], ["Hel", "lo S", "TO", "P tail"], "Hello ", True),  # spans three deltas
    (["\n\n"], ["a\n", "\nb"], "a", True),
    (["ab", "b"], ["xab"], "x", True),  # the earliest match wins
    (["STOP"], ["ST", "ART"], "START", False),  # a held-back prefix that did not complete
    (["STOP"], ["abc ST"], "abc ST", False),  # end of text releases the held tail
    ([], ["a", "b"], "ab", False),
]


@pytest.mark.parametrize(("stops", "deltas", "expected", "stopped"), CASES)
def test_stop_text_never_leaks(stops, deltas, expected, stopped):
    assert run(stops, deltas) == (expected, stopped)


def test_held_back_text_is_released_as_soon_as_it_is_ruled_out():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a S") == "a "
    assert matcher.feed("T") == ""
    assert matcher.feed("x") == "STx"


def test_nothing_after_a_stop():
    matcher = StopMatcher(["."])
    assert matcher.feed("Hi. there") == "Hi"
    assert matcher.feed("more") == ""
    assert matcher.flush() == ""


INCLUDED = [
    # stops, deltas, expected text
    (["STOP"], ["Hel", "lo S", "TO", "P tail"], "Hello STOP"),
    (["ab", "abc"], ["xabc d"], "xabc"),  # at one place, the longest stop is kept whole
    (["b", "ab"], ["xab"], "xab"),  # the earliest match still wins
]


@pytest.mark.parametrize(("stops", "deltas", "expected"), INCLUDED)
def test_an_included_stop_is_kept_and_nothing_after_it(stops, deltas, expected):
    matcher = StopMatcher(stops, include=True)
    out = "".join(matcher.feed(d) for d in deltas) + matcher.flush()
    assert (out, matcher.stopped) == (expected, True)


def test_text_fed_unarmed_goes_out_unchecked():
    matcher = StopMatcher(["."])
    assert matcher.feed("a. b", armed=False) == "a. b"
    assert not matcher.stopped
    assert matcher.feed("c. d") == "c"
    assert matcher.stopped


def generate(tokenizer, ids: list[int], params: SamplingParams) -> list[Delta]:
    """A row on the real tokenizer fed `ids` (each with a logprob when `params` ask for them)
    until it ends: the deltas it sent."""
    pieces = TokenPieces(tokenizer)
    sink = Recorder()
    detokenizer = RowDetokenizers(tokenizer)()
    row = Row(GenerationJob([1, 2], params), sink, 0, detokenizer, frozenset(), pieces=pieces)
    for token in ids:
        sampled = SampledToken(pieces(token), -1.0, ()) if params.logprobs else None
        if not row.advance(token, sampled):
            break
    return [event for _, event in sink.events if isinstance(event, Delta)]


@pytest.mark.parametrize(("stop", "shown"), [("\n", ["x", " "]), (" \n", ["x"]), ("x", [])])
def test_a_rows_logprobs_end_where_its_text_does(embedded_model_dir: Path, stop: str, shown):
    """mlx-lm's byte-level BPE detokenizer holds a lone space token back and sends it with the
    next token's text: that token's own text still starts after the space, so a stop string
    at it leaves it out of the logprobs, as it leaves it out of the text."""
    tokenizer = load_tokenizer(embedded_model_dir)
    pieces = TokenPieces(tokenizer)
    ids = [tokenizer.encode(text, add_special_tokens=False)[0] for text in ("x", " ", "\n", "y")]
    assert [pieces(i).text for i in ids] == ["x", " ", "\n", "y"]
    params = SamplingParams(max_tokens=8, stop=(stop,), logprobs=True)
    deltas = generate(tokenizer, ids, params)
    text = "".join(delta.text for delta in deltas)
    assert text == "x \ny"[: "x \ny".index(stop)]
    assert [token.token.text for delta in deltas for token in delta.logprobs] == shown
    assert "".join(shown) == text


def test_logprobs_of_characters_split_over_byte_tokens_go_out_with_them(embedded_model_dir: Path):
    """A character the vocabulary spells in several byte tokens is written once, whole: the
    logprobs before a stop are every token of the text before it, counted in bytes."""
    tokenizer = load_tokenizer(embedded_model_dir)
    pieces = TokenPieces(tokenizer)
    text = "日本語です 😀\nfoo"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # characters split over tokens
    assert b"".join(pieces(i).bytes for i in ids) == text.encode()
    params = SamplingParams(max_tokens=64, stop=("\n",), logprobs=True)
    deltas = generate(tokenizer, ids, params)
    assert "".join(delta.text for delta in deltas) == "日本語です 😀"
    shown = b"".join(token.token.bytes for delta in deltas for token in delta.logprobs)
    assert shown == "日本語です 😀".encode()


@pytest.mark.parametrize("logprobs", [True, False])
@pytest.mark.parametrize("cut", ["ends", "inside"])
def test_an_answer_cut_inside_a_split_character_ends_before_it(
    embedded_model_dir: Path, cut: str, logprobs: bool
):
    """max_tokens reached between the byte tokens of one character: the answer ends before
    that character (never U+FFFD for bytes the model had not finished), the cut token's
    logprobs still go out, and each token's width counts the characters its bytes complete,
    so that the widths add up to the text."""
    tokenizer = load_tokenizer(embedded_model_dir)
    pieces = TokenPieces(tokenizer)
    text = "ok 😀 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    spans, at = [], 0  # each token's bytes in the text's
    for token in ids:
        spans.append((at, at + len(pieces(token).bytes)))
        at = spans[-1][1]
    whole = {len(text[:i].encode()) for i in range(len(text) + 1)}  # character boundaries
    k = next(i for i, (_, end) in enumerate(spans) if end not in whole) + 1  # cut inside 😀
    if cut == "ends":
        k = len(ids)
    deltas = generate(tokenizer, ids[:k], SamplingParams(max_tokens=k, logprobs=logprobs))
    answer = "".join(delta.text for delta in deltas)
    sent = text.encode()[: spans[k - 1][1]]
    expected = text if cut == "ends" else sent.decode(errors="ignore")
    assert answer == expected and "\ufffd" not in answer
    if not logprobs:
        return
    logprobs = [token for delta in deltas for token in delta.logprobs]
    assert [token.token.bytes for token in logprobs] == [pieces(i).bytes for i in ids[:k]]
    assert sum(token.width for token in logprobs) == len(answer)
    assert logprobs[-1].token.whole == (cut == "ends")  # the cut one holds part of 😀
