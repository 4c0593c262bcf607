from server.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher


def test_incremental_decode_equals_full_decode(default_tokenizer):
    text = "Héllo wörld — 日本語のテキスト 🎉🎉 and emoji, mixed\nlines  with  spaces."
    ids = default_tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(default_tokenizer)
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_deltas_is_cut_and_held_back():
    stops = StopStringMatcher(("END",))
    out = []
    for delta in ["hello E", "N", "D tail"]:
        text, hit = stops.feed(delta)
        out.append(text)
        if hit:
            break
    assert hit == "END"
    assert "".join(out) == "hello "


def test_stop_string_included_when_asked():
    stops = StopStringMatcher(("\n\n",), include_stop=True)
    text, hit = stops.feed("a\n\nb")
    assert hit == "\n\n" and text == "a\n\n"


def test_no_stop_flush_returns_held_text():
    stops = StopStringMatcher(("xyz",))
    text, hit = stops.feed("abcx")
    assert hit is None and text == "ab"
    assert stops.flush() == "cx"


# --------------------------------------------------------------------------- stop_regex, special-token spacing

import regex  # noqa: E402


def _feed_all(stops: StopStringMatcher, deltas: list[str]) -> tuple[str, str | None]:
    out, hit = [], None
    for delta in deltas:
        text, hit = stops.feed(delta)
        out.append(text)
        if hit:
            break
    else:
        out.append(stops.flush())
    return "".join(out), hit


def test_stop_regex_across_deltas_is_cut_and_never_emitted_early():
    stops = StopStringMatcher((), regexes=(regex.compile(r"\d{3}-\d{4}"),))
    emitted = []
    for delta in ["call 55", "5-12", "34 now"]:
        text, hit = stops.feed(delta)
        emitted.append(text)
        if hit:
            break
    assert emitted == ["call ", "", ""]  # "555-12" could still become the stop: held back
    assert hit == "555-1234"


def test_stop_regex_included_when_asked_and_text_after_partial_released():
    text, hit = _feed_all(StopStringMatcher((), include_stop=True, regexes=(regex.compile(r"<[a-z]+>"),)),
                          ["a <b", "c1 d <", "tag> rest"])
    assert hit == "<tag>" and text == "a <bc1 d <tag>"


def test_earliest_of_string_and_regex_stops_wins():
    text, hit = _feed_all(StopStringMatcher(("STOP",), regexes=(regex.compile(r"x+y"),)), ["aa xx", "y STOP"])
    assert hit == "xxy" and text == "aa "
    text, hit = _feed_all(StopStringMatcher(("STOP",), regexes=(regex.compile(r"q.*z"),)), ["q STO", "P z"])
    assert hit == "q STOP z" and text == ""  # the regex match starts first
    text, hit = _feed_all(StopStringMatcher(("STOP",), regexes=(regex.compile(r"q.*z"),)), ["q STO", "P y"])
    assert hit == "STOP" and text == "q "


def test_complete_match_found_while_an_earlier_partial_one_is_open():
    text, hit = _feed_all(StopStringMatcher((), regexes=(regex.compile(r"a.*z|b"),)), ["xx a", " q", "bc"])
    assert hit == "b" and text == "xx a q"


def test_runaway_stop_regex_raises_instead_of_hanging():
    import pytest

    stops = StopStringMatcher((), regexes=(regex.compile(r"(x+x+)+y"),))
    with pytest.raises(TimeoutError):
        stops.feed("x" * 5000)


def test_spaces_between_special_tokens(default_tokenizer):
    ids = default_tokenizer("a<|im_start|>b<|im_end|>", add_special_tokens=False).input_ids
    spaced = IncrementalDetokenizer(default_tokenizer, skip_special_tokens=False, spaces_between_special_tokens=True)
    joined = IncrementalDetokenizer(default_tokenizer, skip_special_tokens=False)
    assert "".join([spaced.push([t]) for t in ids] + [spaced.flush()]) == "a <|im_start|> b <|im_end|>"
    assert "".join([joined.push([t]) for t in ids] + [joined.flush()]) == "a<|im_start|>b<|im_end|>"
    skipped = IncrementalDetokenizer(default_tokenizer, spaces_between_special_tokens=True)
    assert "".join([skipped.push([t]) for t in ids] + [skipped.flush()]) == "a b"


# --------------------------------------------------------------------------- an output cut inside a character

import pytest  # noqa: E402

from server.engine.detokenizer import _token_bytes, ends_inside_character  # noqa: E402


def _byte_tokens(tokenizer) -> dict[int, int]:
    """Byte → the id of the token that is that byte alone (byte-level BPE has one per byte)."""
    return {raw[0]: i for i, raw in enumerate(_token_bytes(tokenizer)) if len(raw) == 1}


@pytest.mark.parametrize("char", ["д", "€", "日", "😀"])
def test_an_output_cut_inside_a_character_never_shows_a_replacement_character(default_tokenizer, char):
    byte_token = _byte_tokens(default_tokenizer)
    data = ("ok " + char).encode()
    for cut in range(3, len(data) + 1):  # "ok " then each of the character's bytes
        ids = [byte_token[b] for b in data[:cut]]
        detok = IncrementalDetokenizer(default_tokenizer)
        streamed = [detok.push([t]) for t in ids] + [detok.flush()]
        assert "".join(streamed) == ("ok " + char if cut == len(data) else "ok "), (char, cut)
        assert ends_inside_character(default_tokenizer, ids) is (3 < cut < len(data))


def test_a_replacement_character_written_whole_is_kept(default_tokenizer):
    byte_token = _byte_tokens(default_tokenizer)
    ids = [byte_token[b] for b in "a\ufffd".encode()]
    detok = IncrementalDetokenizer(default_tokenizer)
    assert "".join([detok.push(ids), detok.flush()]) == "a\ufffd"
