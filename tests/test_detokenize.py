from localserve.engine.detokenize import IncrementalDetokenizer


def feed_all(detok, pieces):
    return "".join(detok.feed(p) for p in pieces) + detok.flush()


def test_multibyte_character_split_over_tokens_is_never_broken():
    euro = "€".encode()  # 3 bytes
    detok = IncrementalDetokenizer()
    assert detok.feed(b"price " + euro[:1]) == "price "
    assert detok.feed(euro[1:2]) == ""
    assert detok.feed(euro[2:] + b"5") == "€5"


def test_stop_string_split_over_pieces_is_held_then_dropped():
    detok = IncrementalDetokenizer(stop=("###",))
    assert detok.feed(b"hello #") == "hello "
    assert detok.feed(b"#") == ""
    assert detok.feed(b"# world") == ""
    assert detok.stopped


def test_false_start_of_stop_string_is_released():
    detok = IncrementalDetokenizer(stop=("END",))
    assert feed_all(detok, [b"the EN", b"D", b"x"]) == "the "
    detok = IncrementalDetokenizer(stop=("END",))
    assert feed_all(detok, [b"the EN", b"ough"]) == "the ENough"


def test_earliest_of_several_stops_wins():
    detok = IncrementalDetokenizer(stop=("b", "a"))
    assert detok.feed(b"xxaxb") == "xx"
