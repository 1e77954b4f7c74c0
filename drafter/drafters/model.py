"""The local draft model: proposes the next k tokens with its own KV cache.

A Drafter (drafter/speculative/candidates.py): `get_candidates` drafts. The KV cache follows the
committed tokens by longest common prefix, so after each round only the rejected drafts
are dropped and only new tokens (the target's token, at most one unevaluated draft) are
evaluated.

The last drafted chain is remembered: when the committed tokens turn out to be a prefix
of it (pipelining drafted past the round in flight, and its guess of the target's token
was right), its tokens are the next draft without evaluating anything again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from drafter.drafters.draft_context import DraftContext
from drafter.drafters.draft_rules import DraftRules, rules_for
from drafter.drafters.draft_sequence import DraftSequence
from drafter.errors import DraftModelError
from drafter.speculative.candidates import Draft, Drafter
from drafter.speculative.draft_chain import DraftChain
from server.shared import vocab
from server.shared.devices import model_placement
from server.shared.prefix import common_prefix_len
from server.shared.protocol import Grammar, PrefillRequest, SamplingParams
from server.shared.runtime import LlamaError, supports_gpu_offload
from server.shared.sampling import cap_support, probabilities, sample

# Most tokens of q sent per draft position. Without top-k, q's support is the whole
# vocabulary; the drafter then samples from q cut to its 32 most likely tokens and sends
# exactly that cut q, which keeps rejection sampling lossless (server/shared/sampling.py).
MAX_Q_SUPPORT = 32
# Tokens evaluated between looks at whether to stop, where a warming or a catch-up may be
# stopped: on a CPU, pieces this long cost what one long decode does.
PIECE_TOKENS = 64


@dataclass
class DraftPolicy:
    """How drafts are chosen: the argmax, or draws from q (what rejection sampling needs)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    sample_drafts: bool = False
    seed: int | None = None
    max_support: int = MAX_Q_SUPPORT
    # Stop drafting where the model's own probability of its draft falls below p_min
    # (llama.cpp's speculative p_min); 0 drafts all k.
    p_min: float = 0.0


def default_gpu_layers() -> int:
    """All layers on the GPU (Metal, CUDA) when this llama.cpp build has one, else none."""
    return -1 if supports_gpu_offload() else 0


def gpu_layers(n_gpu_layers: int | None) -> int:
    """The layers to offload: all where the build has a GPU, unless asked; asked of a
    build without a GPU backend, refused, naming the rebuild."""
    if n_gpu_layers is None:
        return default_gpu_layers()
    if n_gpu_layers and not supports_gpu_offload():
        raise DraftModelError(
            f"--n-gpu-layers {n_gpu_layers} asks for a GPU, but this llama-cpp-python was "
            'built without GPU support: rebuild it with CMAKE_ARGS="-DGGML_METAL=on" '
            '(CUDA: "-DGGML_CUDA=on") ./scripts/setup.sh, or --n-gpu-layers 0 for the CPU'
        )
    return n_gpu_layers


def where(model: DraftModel) -> str:
    """Where a draft model computes: its backend, device and offloaded layers."""
    return model_placement(model.runtime).describe()


class DraftModel(Drafter):
    """One KV sequence of a draft context: a generation's drafts, and what its cache holds.

    `DraftModel(path, ...)` loads a context of its own with one sequence; `serve` makes
    one per concurrent generation on a shared context (`DraftModel.on(context, seq_id)`).
    Between generations the cache is kept: the next prompt re-evaluates only from where
    it parts from what is cached."""

    warms = catches_up = True

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int,
        n_seq: int = 1,
        n_gpu_layers: int | None = None,
        n_threads: int = 0,
        verbose: bool = False,
    ):
        try:
            context = DraftContext.load(
                model_path,
                n_ctx=n_ctx,
                n_seq=n_seq,
                n_threads=n_threads,
                n_gpu_layers=gpu_layers(n_gpu_layers),
                verbose=verbose,
            )
        except (FileNotFoundError, LlamaError) as exc:
            raise DraftModelError(f"cannot load the draft model: {exc}") from exc
        self._attach(context, 0, owns_context=True)

    @classmethod
    def on(cls, context: DraftContext, seq_id: int) -> DraftModel:
        """Sequence `seq_id` of a context another DraftModel owns."""
        model = cls.__new__(cls)
        model._attach(context, seq_id, owns_context=False)
        return model

    def _attach(self, context: DraftContext, seq_id: int, *, owns_context: bool) -> None:
        self.context = context
        self.runtime = context.runtime
        self.seq_id = seq_id
        self._owns_context = owns_context
        self.model_path = self.runtime.model_path
        self.name = self.runtime.metadata("general.name") or self.model_path.stem
        self.sequence = DraftSequence(context, seq_id)
        self._chain = DraftChain()
        self.configure(DraftPolicy())

    def configure(self, policy: DraftPolicy) -> None:
        """A new generation's policy. Seeded sampling decodes alone (see `reset`)."""
        self.policy = policy
        self._rng = np.random.default_rng(policy.seed)
        self._rules: DraftRules | None = None
        self._chain.forget()

    def follow(self, sampling: SamplingParams, grammar: Grammar | None, prompt_len: int) -> None:
        """Draft this generation as the verifier decodes it: under its penalties, biases
        and grammar (drafter/drafters/draft_rules.py)."""
        self._rules = rules_for(self.context, sampling, grammar, prompt_len)
        self._chain.forget()

    def vocab_facts(self) -> vocab.VocabFacts:
        return vocab.describe(self.runtime)

    @property
    def n_vocab(self) -> int:
        return self.runtime.n_vocab

    def draft_for(self, target_n_vocab: int, relation: vocab.Relation = "same") -> None:
        """Draft for a verifier whose vocabulary has `target_n_vocab` tokens and is the
        same as ours or compatible with it: ids beyond it are never drafted (their logits
        are masked before the pick or the draw), and the verifier's ids beyond ours
        (padding, in a compatible pair) are read as our padding token. Every sequence of
        the context drafts so."""
        self.context.target_n_vocab = None if target_n_vocab == self.n_vocab else target_n_vocab
        self.context.vocab_relation = relation

    @property
    def vocab_relation(self) -> str:
        """ "same", "compatible" or "translated": how drafts reach the verifier."""
        return self.context.vocab_relation

    @property
    def target_n_vocab(self) -> int:
        """The verifier's vocabulary size (ours, unless `draft_for` said otherwise)."""
        return self.context.target_n_vocab or self.n_vocab

    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < self.n_vocab:
            return b""  # a verifier's padding token: no text
        return self.runtime.token_bytes(token)

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        return self.runtime.chat_prompt(user, system)

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> str:
        return self.runtime.apply_chat_template(messages)

    def starts_with_bos(self, text: str) -> bool:
        return self.runtime.starts_with_bos(text)

    # -- Drafter ---------------------------------------------------------------------

    def get_candidates(
        self, committed: Sequence[int], k: int, stop: Callable[[], bool] | None = None
    ) -> Draft:
        """Up to k draft tokens following `committed`; fewer at EOG, where the model's
        probability of its draft falls below p_min, or when `stop()` turns true (checked
        between tokens: pipelining stops when the verifier's answer is in)."""
        sampled = self.policy.sample_drafts
        if k <= 0:
            return Draft([], [] if sampled else None)
        committed = self._own_ids(committed)
        draft_tokens, draft_probs = self._chain.reusable(committed, k, self.sequence.cached)
        reused = len(draft_tokens)
        if len(draft_tokens) < k and not (draft_tokens and self.runtime.is_eog(draft_tokens[-1])):
            logits = self._ruled(self._sync([*committed, *draft_tokens]), committed, draft_tokens)
            while True:
                q = None
                if sampled:
                    q = cap_support(
                        probabilities(logits, self.policy.sampling), self.policy.max_support
                    )
                    token = sample(q, self._rng)
                else:
                    token = int(np.argmax(logits))
                # Only argmax drafts stop on confidence: a sampled draft cut off by its own
                # value is no longer drawn from the q it sends, and rejection sampling
                # would then follow another law than the verifier's.
                p_min = self.policy.p_min
                if not sampled and p_min > 0 and _confidence(logits, token) < p_min:
                    break
                draft_tokens.append(token)
                draft_probs.append(q)
                if len(draft_tokens) == k or self.runtime.is_eog(token) or (stop and stop()):
                    break
                logits = self._ruled(self._evaluate([token]), committed, draft_tokens)
        self._chain.remember(len(committed), draft_tokens, draft_probs)
        return Draft(draft_tokens, draft_probs if sampled else None, reused)

    def likely_answers(
        self, committed: Sequence[int], draft_tokens: Sequence[int], limit: int
    ) -> list[tuple[int, int]]:
        """The verifier's likeliest answers to this draft, most probable first, as this
        model sees them: (accepted, token) pairs, where the verifier keeps the first
        `accepted` draft tokens and then `token` (its correction, or after the whole draft
        its bonus token). The chance of (i, t) is the model's probability of the draft's
        first i tokens times its probability of t there (t never the draft's own token).
        Evaluates the draft's last token (for the row after it)."""
        committed = self._own_ids(committed)
        self._sync([*committed, *draft_tokens])
        start = len(committed) - 1
        scored: list[tuple[float, int, int]] = []
        reach = 1.0  # the model's probability of the draft so far
        for i in range(len(draft_tokens) + 1):
            row = self.sequence.logits_at(start + i)
            if row is None:
                break
            q = distribution(self._within_target(row), self.policy)
            drafted = draft_tokens[i] if i < len(draft_tokens) else -1
            best = [int(t) for t in np.argsort(-q)[:3] if t != drafted][:2]
            scored += [(reach * float(q[t]), i, t) for t in best]
            if drafted < 0:
                break
            reach *= float(q[drafted])
        return _expected_first(scored, len(draft_tokens), limit)

    def catch_up(self, committed: Sequence[int], stop: Callable[[], bool] | None = None) -> bool:
        """Evaluate the committed tokens the cache lacks (rounds without a draft brought
        them), so that the next draft starts at once; no further once `stop()` is true.
        Whether the cache holds them all."""
        return _sync_in_pieces(self.sequence, self._own_ids(committed), stop, self.decodes_alone)

    def warm(self, prefill: PrefillRequest, stop: Callable[[], bool] | None = None) -> None:
        """Evaluate the prompt as the verifier will tokenize it (the same llama.cpp call
        the server makes), so that the first draft finds it cached; no further once
        `stop()` is true. Should the verifier's prompt ids differ, the first draft
        re-evaluates from where they part: only time is at stake, never the output."""
        if prefill.prompt is not None:
            tokens = self.runtime.tokenize(prefill.prompt, add_special=prefill.add_bos)
        else:
            tokens = self._own_ids(prefill.prompt_tokens or [])
        if tokens:
            _sync_in_pieces(self.sequence, tokens, stop, self.decodes_alone)

    def warm_up(self) -> None:
        """llama.cpp reads the weights in on a model's first pass (they are mapped from
        the file), which a first draft would otherwise wait for, as llama.cpp's own tools
        warm up at load; then the context's `draft_token_s` (DraftSequence.warm_up)."""
        token = (self.runtime.tokenize(" ", add_special=False)[:1] or [self.runtime.eos_id])[0]
        self.context.draft_token_s = self.sequence.warm_up(token, alone=self.decodes_alone)
        self.reset()

    @property
    def cached_tokens(self) -> list[int]:
        return list(self.sequence.cached)

    @property
    def decoded_tokens(self) -> int:
        return self.sequence.decoded_tokens

    @property
    def decodes_alone(self) -> bool:
        """Seeded sampling: the drafts (and through them the output) must not depend on
        what else the context decodes, nor on how an earlier request filled the cache
        (Q4_K kernels are not batch-invariant). So its sequence starts empty (`reset`) and
        decodes on its own: a cold, deterministic fill. Other requests take any cache
        and batch-mates: only speed is at stake for them, never the output."""
        return self.policy.sample_drafts and self.policy.seed is not None

    def reset(self) -> None:
        """Forget this sequence's cache."""
        self.sequence.reset()
        self._chain.forget()

    def close(self) -> None:
        if self._owns_context:
            self.context.close()

    def _sync(self, tokens: Sequence[int]) -> np.ndarray:
        return self.sequence.sync(tokens, alone=self.decodes_alone)

    def _evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        return self.sequence.evaluate(tokens, alone=self.decodes_alone)

    def _ruled(
        self, logits: np.ndarray, committed: Sequence[int], draft_tokens: Sequence[int]
    ) -> np.ndarray:
        """The row a draft is picked or drawn from: within the verifier's vocabulary, and
        under the generation's rules (`follow`)."""
        logits = self._within_target(logits)
        if self._rules is None:
            return logits
        return self._rules.row(logits, [*committed, *draft_tokens])

    # -- a compatible verifier's vocabulary --------------------------------------------

    def _within_target(self, logits: np.ndarray) -> np.ndarray:
        return within(logits, self.context.target_n_vocab)

    def _own_ids(self, tokens: Sequence[int]) -> Sequence[int]:
        limit = self.context.target_n_vocab
        if limit is None or limit <= self.n_vocab:
            return tokens
        pad = self.runtime.pad_id
        stand_in = pad if 0 <= pad < self.n_vocab else self.runtime.eos_id
        return [t if t < self.n_vocab else stand_in for t in tokens]


def _sync_in_pieces(
    sequence: DraftSequence,
    tokens: Sequence[int],
    stop: Callable[[], bool] | None,
    alone: bool,
) -> bool:
    """`sequence.sync(tokens)`, PIECE_TOKENS at a time until `stop()` is true (one piece
    at least: called again and again, it gets there); whether it got to the end. Without
    `stop`, in one go."""
    held = common_prefix_len(sequence.cached, tokens)
    if stop is None or held >= len(tokens):
        sequence.sync(tokens, alone)
        return True
    for end in range(held + PIECE_TOKENS, len(tokens), PIECE_TOKENS):
        sequence.sync(tokens[:end], alone)
        if stop():
            return False
    sequence.sync(tokens, alone)
    return True


def _expected_first(
    scored: list[tuple[float, int, int]], drafted: int, limit: int
) -> list[tuple[int, int]]:
    """The (accepted, token) answers scored by their chance, the `limit` likeliest: first
    the answer the model expects (its whole draft of `drafted` tokens, then its own next
    token), the one it is calibrated on; then the rest by their chance."""
    expected = max((s for s in scored if s[1] == drafted), default=None)
    rest = sorted((s for s in scored if s is not expected), key=lambda s: -s[0])
    ranked = ([expected] if expected else []) + rest
    return [(i, t) for _, i, t in ranked[:limit]]


def _confidence(logits: np.ndarray, token: int) -> float:
    """The draft model's probability of its own draft."""
    shifted = np.exp(logits - logits.max())
    return float(shifted[token] / shifted.sum())


def distribution(logits: np.ndarray, policy: DraftPolicy) -> np.ndarray:
    """The draft model's distribution as the policy draws from it (softmax for argmax)."""
    if policy.sample_drafts:
        return probabilities(logits, policy.sampling)
    shifted = np.exp(logits.astype(np.float64) - logits.max())
    return shifted / shifted.sum()


def within(logits: np.ndarray, limit: int | None) -> np.ndarray:
    """Logits with the ids from `limit` on masked (a verifier's smaller vocabulary)."""
    if limit is None or limit >= len(logits):
        return logits
    masked = logits.copy()  # the cached row stays as the model gave it
    masked[limit:] = -np.inf
    return masked
