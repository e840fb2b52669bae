"""The router's tokenizer: chat template, incremental detokenization, stop strings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import tiny_dir  # noqa: E402

from router.tokenizer import TextStream, Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(tiny_dir())


def stream_all(tok, ids, stop=(), step=1):
    s = TextStream(tok, stop)
    pieces = [s.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    pieces.append(s.finish())
    return pieces, s


def test_multibyte_characters_are_never_split(tok):
    text = "héllo 世界 🎉 naïve — ok"
    ids = tok.encode(text)
    pieces, _ = stream_all(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len(tok.encode("🎉")) > 1  # the emoji really spans several tokens here


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=0, max_size=40), st.integers(min_value=1, max_value=4))
def test_streamed_text_equals_decoded_text(tok, text, step):
    ids = tok.encode(text)
    pieces, _ = stream_all(tok, ids, step=step)
    assert "".join(pieces) == tok.decode(ids)


def test_stop_string_across_tokens_is_held_back_and_cut(tok):
    ids = tok.encode("one two three four")
    pieces, s = stream_all(tok, ids, stop=["three"])
    assert s.stopped and "".join(pieces) == "one two "
    assert not any("thr" in p for p in pieces)  # never shown, even in part


def test_earliest_of_several_stop_strings_wins(tok):
    pieces, s = stream_all(tok, tok.encode("alpha beta gamma"), stop=["gamma", "beta"])
    assert s.stopped and "".join(pieces) == "alpha "


def test_partial_stop_match_is_released_at_the_end(tok):
    pieces, s = stream_all(tok, tok.encode("the end is nigh"), stop=["nighty"])
    assert not s.stopped and "".join(pieces) == "the end is nigh"


def test_stop_string_inside_a_multibyte_run(tok):
    pieces, s = stream_all(tok, tok.encode("x 世界 y"), stop=["界"])
    assert s.stopped and "".join(pieces) == "x 世"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.apply_chat([{"role": "user", "content": "hi"}])
    kept = TextStream(tok, skip_special_tokens=False)
    assert kept.push(ids) + kept.finish() == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in kept.text
    skipped = TextStream(tok)
    assert "<|im_start|>" not in skipped.push(ids) + skipped.finish()


def test_chat_template_renders_every_role(tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 2+2"},
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": "tool says hi"},
        {"role": "user", "content": "thanks"},
    ]
    text = tok.decode(tok.apply_chat(messages), skip_special_tokens=False)
    for m in messages:
        assert m["content"] in text
    assert text.rstrip().endswith("assistant")  # the generation prompt opens the reply


def test_prompt_ids_are_a_prefix_of_the_next_turn(tok):
    """What makes multi-turn chat hit the cache: turn k's prompt is a prefix of turn k+1's."""
    turn1 = [{"role": "user", "content": "hello"}]
    ids1 = tok.apply_chat(turn1)
    turn2 = turn1 + [
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "more"},
    ]
    assert tok.apply_chat(turn2)[: len(ids1)] == ids1


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=0, max_size=60))
def test_fast_path_matches_transformers(tok, text):
    assert tok.fast is not None
    ids = tok.encode(text)
    assert ids == tok.hf.encode(text, add_special_tokens=True)
    for skip in (True, False):
        assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=1023), max_size=30),
    st.booleans(),
    st.integers(min_value=1, max_value=3),
)
def test_byte_level_stream_equals_decoding_all_ids(tok, ids, skip, step):
    """Any id sequence (special tokens, broken UTF-8 included) streams to the decoded text."""
    stream = TextStream(tok, skip_special_tokens=skip)
    assert stream.decoder is not None  # the tokenizer's own incremental decoder
    pieces = [stream.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    assert "".join(pieces) + stream.finish() == tok.hf.decode(ids, skip_special_tokens=skip)


def test_general_path_without_an_incremental_decoder(tok, monkeypatch):
    monkeypatch.setattr(tok, "fast", None)  # no Rust backend: the windowed decode
    text = "héllo 世界 🎉 stop here"
    pieces, s = stream_all(tok, tok.encode(text), stop=["here"])
    assert s.decoder is None and s.stopped and "".join(pieces) == "héllo 世界 🎉 stop "
    assert not any("\ufffd" in p for p in pieces)
