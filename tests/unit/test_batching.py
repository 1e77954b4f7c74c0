"""Batched decoding shared by both sides: what a failure leaves behind."""

from __future__ import annotations

import pytest

from server.shared.batching import Piece, decode_pieces, together_or_alone
from tests.fixtures.fake_runtime import FakeRuntime


def test_a_shaping_cell_that_cannot_be_removed_undoes_the_decode_and_fails_only_its_job(
    monkeypatch,
):
    runtime = FakeRuntime(n_seq_max=2, n_batch=64, n_ctx_per_seq=64)
    padded = Piece(0, 0, [1, 2, 3], logits=(0,), keep=1)  # two padding rows after one
    plain = Piece(1, 0, [4, 5], logits=(1,))
    remove = runtime.remove

    def refuse_the_padding(seq_id: int, p0: int, p1: int = -1) -> None:
        if (seq_id, p0) == (0, 1):
            raise RuntimeError("llama_memory_seq_rm refused")
        remove(seq_id, p0, p1)

    monkeypatch.setattr(runtime, "remove", refuse_the_padding)
    with pytest.raises(RuntimeError, match="refused"):
        decode_pieces(runtime, [padded, plain])
    assert runtime.cells[0] == [] and runtime.cells[1] == []  # as before the decode

    results = together_or_alone([padded, plain], lambda items: decode_pieces(runtime, items))
    assert isinstance(results[0], RuntimeError)  # the job at fault fails alone
    assert len(results[1]) == 1 and len(runtime.cells[1]) == 2  # its batch-mate is decoded
    assert runtime.cells[0] == []
