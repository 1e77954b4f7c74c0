"""The pure parts of drafting through text: bytes to text at a token boundary that may
fall inside a character, and the vocabulary file fetched once per hash."""

from __future__ import annotations

import pytest

from drafter.drafters.translate import cached_vocab_file


def test_the_vocabulary_file_is_fetched_once_per_hash(tmp_path, monkeypatch):
    import drafter.drafters.translate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    checked: list[str] = []

    class Loaded:
        def close(self) -> None:
            pass

    def vocab_matches(path, vocab_hash):
        checked.append(vocab_hash)  # loaded from the part file, before it is kept
        assert path.suffix == ".part"
        return Loaded()

    monkeypatch.setattr(drafter.drafters.translate, "vocab_matches", vocab_matches)
    fetched: list[str] = []

    def fetch() -> bytes:
        fetched.append("GET /vocab")
        return b"GGUF..."

    first = cached_vocab_file("a" * 64, fetch)
    again = cached_vocab_file("a" * 64, fetch)
    other = cached_vocab_file("b" * 64, fetch)
    assert first == again != other
    assert first.read_bytes() == b"GGUF..." and len(fetched) == 2 and len(checked) == 2
    assert not list(first.parent.glob("*.part"))


@pytest.mark.parametrize("data", [b"<html>a proxy's page</html>", b"GGUF but broken"])
def test_a_file_that_is_not_the_vocabulary_is_never_kept(tmp_path, monkeypatch, data):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(Exception, match=r"GGUF|load|vocabulary"):
        cached_vocab_file("c" * 64, lambda: data)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing poisons a later run


def test_a_vocab_hash_that_is_not_a_sha256_never_becomes_a_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="not a sha256"):
        cached_vocab_file("../../escape", lambda: b"GGUF")
    assert not any(tmp_path.rglob("*escape*"))
