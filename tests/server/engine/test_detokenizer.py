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
