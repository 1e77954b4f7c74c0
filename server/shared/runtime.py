"""The one module that imports llama_cpp: a thin, side-neutral wrapper over its C API.

The verifier engine and the drafter's model both sit on these classes, so the fast-moving
llama.cpp API (llama_memory_seq_rm, flash_attn_type, the vocab functions) is touched in
one place only. LlamaVocab is a model's vocabulary (loadable without its weights);
LlamaRuntime adds the weights and one context with `n_seq_max` KV sequences.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import llama_cpp
import numpy as np

from server.shared.machine import usable_cores
from server.shared.vocab import VOCAB_TYPES

log = logging.getLogger(__name__)

_backend_lock = threading.Lock()
_backend_ready = False


def _init_backend(verbose: bool) -> None:
    global _backend_ready
    # llama-cpp-python prints every llama.cpp log line unless its logger is raised.
    logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True


class LlamaError(Exception):
    """llama.cpp refused an operation (model load, context, decode)."""


class DecodeError(LlamaError):
    def __init__(self, status: int):
        self.status = status
        reason = {1: "no KV cache slot for the batch", 2: "aborted"}.get(status, "decode failed")
        super().__init__(f"llama_decode returned {status}: {reason}")


@dataclass(frozen=True, slots=True)
class BatchEntry:
    token: int
    pos: int
    seq_id: int
    want_logits: bool


def supports_gpu_offload() -> bool:
    return bool(llama_cpp.llama_supports_gpu_offload())


def ggml_library() -> ctypes.CDLL:
    """The ggml library this build loaded: server/shared/devices.py reads its devices."""
    from llama_cpp._ggml import libggml

    return cast(ctypes.CDLL, libggml)


class LlamaVocab:
    """A model file's vocabulary, chat template and metadata. With `vocab_only`, the
    weights are never read: a vocabulary file (GET /vocab) is enough."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        vocab_only: bool = False,
        n_gpu_layers: int = 0,
        verbose: bool = False,
    ):
        model_path = Path(model_path)
        if not model_path.is_file():
            raise FileNotFoundError(f"model file not found: {model_path}")
        _init_backend(verbose)
        self.model_path, self.n_gpu_layers = model_path, n_gpu_layers
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = n_gpu_layers if n_gpu_layers >= 0 else 999
        model_params.vocab_only = vocab_only
        self._model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), model_params)
        if not self._model:
            raise LlamaError(f"llama.cpp could not load the model {model_path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._closed = False

    # -- model facts ------------------------------------------------------------------

    @property
    def bos_id(self) -> int:
        return int(llama_cpp.llama_vocab_bos(self._vocab))

    @property
    def eos_id(self) -> int:
        return int(llama_cpp.llama_vocab_eos(self._vocab))

    @property
    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))

    @property
    def add_eos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_eos(self._vocab))

    def grammar_tokenizer(self):  # llguidance.LLTokenizer ([tool.mypy] overrides)
        """The vocabulary as llguidance reads it, for constrained decoding (about a second
        to build: built once, on first use; server/shared/constraint.py)."""
        from llguidance.llamacpp import lltokenizer_from_vocab

        with warnings.catch_warnings():  # it reads each token's attributes by an older name
            warnings.simplefilter("ignore", DeprecationWarning)
            # Every end-of-generation token can end a grammar's text (a chat turn's end).
            ends = [t for t in range(self.n_vocab) if self.is_eog(t)]
            return lltokenizer_from_vocab(self._vocab, eos_token=ends or None)

    @property
    def fim_ids(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle tokens (prefix, suffix, middle), or None where the
        vocabulary has none."""
        ids = (
            int(llama_cpp.llama_vocab_fim_pre(self._vocab)),
            int(llama_cpp.llama_vocab_fim_suf(self._vocab)),
            int(llama_cpp.llama_vocab_fim_mid(self._vocab)),
        )
        return None if min(ids) < 0 else ids

    @property
    def vocab_type(self) -> str:
        kind = int(llama_cpp.llama_vocab_type(self._vocab))
        return VOCAB_TYPES.get(kind, f"type {kind}")

    @property
    def pad_id(self) -> int:
        """The padding token's id, or -1 where the vocabulary has none."""
        return int(llama_cpp.llama_vocab_pad(self._vocab))

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, ctypes.sizeof(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    @property
    def n_ctx_train(self) -> int:
        return int(llama_cpp.llama_model_n_ctx_train(self._model))

    @property
    def n_layer(self) -> int:
        return int(llama_cpp.llama_model_n_layer(self._model))

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's keys and values in every layer, f16 (llama.cpp's default cache type):
        an estimate where layers differ (sliding windows, latent attention)."""
        m, arch = self._model, self.metadata("general.architecture") or ""
        head = int(self.metadata(f"{arch}.attention.key_length") or 0) or int(
            llama_cpp.llama_model_n_embd(m)
        ) // max(1, int(llama_cpp.llama_model_n_head(m)))
        return self.n_layer * 2 * int(llama_cpp.llama_model_n_head_kv(m)) * head * 2

    @property
    def quantization(self) -> str:
        ftype = int(llama_cpp.llama_model_ftype(self._model))
        name = llama_cpp.llama_ftype_name(ftype)
        return name.decode() if name else f"ftype {ftype}"

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def token_text(self, token: int) -> bytes:
        """The vocabulary's own text of a token (special tokens spelled out)."""
        return llama_cpp.llama_vocab_get_text(self._vocab, token) or b""

    def vocab_pieces(self) -> Iterator[bytes]:
        yield from map(self.token_text, range(self.n_vocab))

    # -- text <-> tokens --------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(
            self._vocab, data, len(data), buf, capacity, add_special, parse_special
        )
        if n < 0:  # buffer too small: -n is the size needed
            capacity = -n
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(
                self._vocab, data, len(data), buf, capacity, add_special, parse_special
            )
        return list(buf[:n])

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes a token contributes to the text (control tokens give b"", or
        with `special` their own spelling, `<|im_start|>`)."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        return self.apply_chat_template([*([("system", system)] if system else []), ("user", user)])

    def starts_with_bos(self, text: str) -> bool:
        """Whether a rendered prompt writes the BOS text itself (some templates do)."""
        bos_text = self.token_text(self.bos_id)
        return bool(bos_text) and text.encode().startswith(bos_text)

    def reply_opener(self) -> list[int]:
        """The tokens the model's chat template writes to open the assistant's reply
        (`<|im_start|>assistant\n`), or none where it has no template llama.cpp knows."""
        messages = [("user", "?")]
        try:
            opened = self.apply_chat_template(messages)
            closed = self.apply_chat_template(messages, add_assistant=False)
        except LlamaError:
            return []
        if not opened.startswith(closed) or opened == closed:
            return []
        return self.tokenize(opened[len(closed) :], add_special=False, parse_special=True)

    def apply_chat_template(
        self, messages: Sequence[tuple[str, str]], add_assistant: bool = True
    ) -> str:
        """Render (role, content) messages with the model's own chat template, ready for
        the assistant's turn (`add_assistant`)."""
        template = llama_cpp.llama_model_chat_template(self._model, None)
        if template is None:
            raise LlamaError(f"{self.model_path.name} has no chat template")
        chat = (llama_cpp.llama_chat_message * len(messages))()
        keep = []  # the C struct holds pointers: keep the bytes alive
        for i, (role, content) in enumerate(messages):
            role_b, content_b = role.encode(), content.encode()
            keep += [role_b, content_b]
            chat[i].role = role_b
            chat[i].content = content_b
        size = 4096 + sum(len(c) for _, c in messages) * 2
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(
                template, chat, len(messages), add_assistant, buf, size
            )
            if n < 0:
                raise LlamaError("llama.cpp does not know this model's chat template")
            if n <= size:
                return buf.raw[:n].decode("utf-8")
            size = n
        raise LlamaError("chat template output kept growing")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        llama_cpp.llama_model_free(self._model)


class LlamaRuntime(LlamaVocab):
    """A model and one context with `n_seq_max` KV sequences of `n_ctx_per_seq` cells, or
    of what a function of the loaded model (its trained context, its KV size) decides."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx_per_seq: int | Callable[[LlamaVocab], int],
        n_seq_max: int = 1,
        n_batch: int = 512,
        n_threads: int = 0,
        single_row_threads: int = 0,
        n_gpu_layers: int = 0,
        flash_attn: bool = True,
        verbose: bool = False,
    ):
        super().__init__(model_path, n_gpu_layers=n_gpu_layers, verbose=verbose)
        if callable(n_ctx_per_seq):
            n_ctx_per_seq = n_ctx_per_seq(self)
        ctx_params = llama_cpp.llama_context_default_params()
        # Each session gets its own KV stream of n_ctx_per_seq cells (kv_unified off), so
        # one session's length never eats another's room.
        ctx_params.n_ctx = n_ctx_per_seq * n_seq_max
        ctx_params.n_seq_max = n_seq_max
        ctx_params.kv_unified = False
        ctx_params.n_batch = n_batch
        ctx_params.n_ubatch = n_batch
        # llama.cpp computes a pass of one row with `n_threads`, any other with
        # `n_threads_batch`; `single_row_threads` (0: the same) sets the first apart.
        ctx_params.n_threads_batch = n_threads or usable_cores()
        ctx_params.n_threads = single_row_threads or ctx_params.n_threads_batch
        ctx_params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        ctx_params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            super().close()
            raise LlamaError("llama.cpp could not create a context (out of memory?)")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self.n_seq_max = n_seq_max
        self.n_ctx_per_seq = int(llama_cpp.llama_n_ctx_seq(self._ctx))
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self.n_threads = int(llama_cpp.llama_n_threads_batch(self._ctx))
        self.single_row_threads = int(llama_cpp.llama_n_threads(self._ctx))
        self.flash_attn = flash_attn
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.decoded_tokens_total = 0

    # -- the KV cache -----------------------------------------------------------------

    def decode(self, entries: Sequence[BatchEntry], every_logit: bool = False) -> np.ndarray:
        """One llama_decode of `entries`; returns the logits rows asked for, in order.
        `every_logit`: every row's logits computed (only those asked for are read), so the
        steps llama.cpp runs on output rows only (the last layer's feed-forward part, the
        output projection) have the same shape whatever rows are asked for."""
        if not entries:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        if len(entries) > self.n_batch:
            raise ValueError(f"{len(entries)} tokens exceed n_batch={self.n_batch}")
        batch = self._batch
        for i, entry in enumerate(entries):
            batch.token[i] = entry.token
            batch.pos[i] = entry.pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = entry.seq_id
            batch.logits[i] = every_logit or entry.want_logits
        batch.n_tokens = len(entries)
        status = llama_cpp.llama_decode(self._ctx, batch)
        if status != 0:
            raise DecodeError(status)
        self.decoded_tokens_total += len(entries)
        rows = [i for i, entry in enumerate(entries) if entry.want_logits]
        out = np.empty((len(rows), self.n_vocab), dtype=np.float32)
        # One memmove a row (no array object made around llama.cpp's buffer): a round of
        # one row pays this on every token.
        row_bytes, base = out.strides[0], out.ctypes.data
        for row, i in enumerate(rows):
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, i)
            if not ptr:
                raise LlamaError(f"llama.cpp has no logits for row {i}")
            ctypes.memmove(base + row * row_bytes, ptr, row_bytes)
        return out

    def next_position(self, seq_id: int) -> int:
        """The position after the sequence's last cell (0 when it holds none)."""
        return int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id)) + 1

    def remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        """Drop the sequence's KV entries at positions [p0, p1) (p1 = -1: to the end)."""
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq_id, p0, p1):
            raise LlamaError(f"llama_memory_seq_rm({seq_id}, {p0}, {p1}) refused")

    def copy(self, src: int, dst: int) -> None:
        """Make sequence `dst` hold what `src` holds (whatever `dst` held is dropped).
        Each sequence has a KV stream of its own (kv_unified off), so llama.cpp copies the
        whole stream's buffers, at the start of the next decode."""
        llama_cpp.llama_memory_seq_cp(self._memory, src, dst, -1, -1)

    def clear(self, seq_id: int) -> None:
        self.remove(seq_id, -1, -1)

    def close(self) -> None:
        if self._closed:
            return
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        super().close()


def quantize_model(
    source: str | Path, destination: str | Path, ftype: str, n_threads: int = 0
) -> None:
    """Write `destination` as `source` requantized to `ftype` ("Q8_0", "Q4_K_M", ...)."""
    _init_backend(verbose=False)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.allow_requantize = True
    params.nthread = n_threads
    status = llama_cpp.llama_model_quantize(
        str(source).encode(), str(destination).encode(), ctypes.byref(params)
    )
    if status != 0:
        raise LlamaError(f"llama_model_quantize({source} -> {ftype}) returned {status}")
