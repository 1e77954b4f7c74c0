"""The mirror of llama.cpp's batch split (server/shared/batching.py, `forward_passes`),
held against llama.cpp itself: the real model's compute graphs counted through its eval
callback, one per forward pass, for decodes of several shapes."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import pytest

from server.shared.batching import forward_passes

pytestmark = pytest.mark.integration

N_SEQ = 4
HISTORY = 8
SHAPES = [
    {0: 5, 1: 5, 2: 5, 3: 5},  # neighbours, equal rows: one pass
    {0: 5, 2: 5},  # a gap
    {1: 5, 0: 5},  # ids not rising in batch order
    {0: 5, 1: 3, 2: 5, 3: 2},  # unequal rows
    {2: 9},
]


@pytest.fixture(scope="module")
def counted_context(verifier_model):
    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    graphs = [0]

    @llama_cpp.ggml_backend_sched_eval_callback
    def count_graphs(tensor, ask, _):
        # Every compute graph asks once about its first layer's norm: one per pass.
        if ask and ggml.ggml_get_name(tensor) == b"attn_norm-0":
            graphs[0] += 1
        return False

    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(verifier_model).encode(), llama_cpp.llama_model_default_params()
    )
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.kv_unified = 256 * N_SEQ, N_SEQ, False
    params.n_batch = params.n_ubatch = 64
    params.n_threads = params.n_threads_batch = 1
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.cb_eval = count_graphs
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(64, 0, 1)

    def decode(rows: list[tuple[int, int]]) -> int:
        """Decode (seq, pos) rows in this order; the passes llama.cpp ran."""
        for i, (seq, pos) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = 100 + i, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, True
        batch.n_tokens = len(rows)
        before = graphs[0]
        assert llama_cpp.llama_decode(ctx, batch) == 0
        return graphs[0] - before

    for seq in range(N_SEQ):
        decode([(seq, pos) for pos in range(HISTORY)])
    yield decode, llama_cpp.llama_get_memory(ctx)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_mirror_counts_the_passes_llama_cpp_runs(counted_context, shape):
    decode, memory = counted_context
    rows = [(seq, HISTORY + i) for seq, n in shape.items() for i in range(n)]
    ran = decode(rows)
    for seq in shape:
        llama_cpp.llama_memory_seq_rm(memory, seq, HISTORY, -1)
    assert ran == len(forward_passes([seq for seq, _ in rows], 64))
