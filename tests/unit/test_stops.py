from drafter.serve.stops import StopScanner


def test_text_without_stops_passes_through():
    scanner = StopScanner([])
    assert scanner.feed("hello") == "hello"
    assert scanner.flush() == ""


def test_stop_inside_one_piece():
    scanner = StopScanner(["END"])
    assert scanner.feed("abc END def") == "abc "
    assert scanner.stopped
    assert scanner.feed("more") == ""


def test_a_possible_stop_start_is_held_back_until_decided():
    scanner = StopScanner(["\n\n"])
    assert scanner.feed("one\n") == "one"
    assert scanner.feed("two") == "\ntwo"
    assert scanner.feed("\n") == ""
    assert scanner.feed("\nrest") == ""
    assert scanner.stopped


def test_stop_split_across_pieces_and_earliest_stop_wins():
    scanner = StopScanner(["cat", "dog"])
    assert scanner.feed("hot do") == "hot "
    assert scanner.feed("g and cat") == ""
    assert scanner.stopped


def test_flush_releases_held_text_at_the_end():
    scanner = StopScanner(["###"])
    assert scanner.feed("end #") == "end "
    assert scanner.flush() == "#"
