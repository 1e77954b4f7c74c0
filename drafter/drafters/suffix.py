"""Drafts from the user's own history: the text this generation and the user's earlier ones
already hold, as SuffixDecoding drafts (Oliaro et al., 2024) and unlike prompt lookup,
which sees one request.

The longest suffix of the committed tokens (`min_match` to `max_match` tokens) is looked
up in this generation's text and in the history (earlier prompts and outputs, kept on
the drafter's own machine); its occurrences vote on what follows. The draft is one chain:
at each step the token that continued most of the occurrences still agreeing with the
draft, its share of them the step's probability, the chain ending where the product of
those falls below `min_score`, or past `match_factor` times the match's length (a long
match earns a long draft), or at k.

Occurrences are found through an index of every `min_match` tokens of the texts, the
latest first, and extended backwards token by token; at most `max_candidates` are
weighed. Ties go to the latest occurrence: this generation before the history, the newest
text before older ones, a later position before an earlier one.

Each draft carries an estimate of how often its tokens are accepted, learned per length
of the match it came from (`MatchAcceptance`, over every generation of the history's
user): a chance match of three tokens in text that does not repeat is seldom followed,
a copy of a file read back nearly always, and only the user's own rounds tell which
their work is. A verifier that sizes lookups (/info `lookup_sizing`) verifies as much of
the draft as its cost of a pass says pays at that estimate, none where none pays.

The history holds at most `max_tokens` tokens; a text added past that evicts the oldest
texts whole (and a text longer than the bound keeps its last `max_tokens`). It belongs to
one user: the CLI's process (and a history file only where one is named), `serve`'s
key. Pure but for its lock: no model, no clock.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from drafter.speculative.candidates import Draft, Drafter
from server.shared.draft_gain import Acceptance

DEFAULT_HISTORY_TOKENS = 200_000
MIN_MATCH = 3
MAX_MATCH = 32
MIN_SCORE = 0.3
MATCH_FACTOR = 2.0
MAX_CANDIDATES = 256
# Match lengths whose drafts share an acceptance estimate: the shortest of each band.
MATCH_BANDS = (3, 4, 6, 9, 13, 21)
# Before a band's drafts are judged: a = 0.9, as weak as one round, so that a band is
# tried before its own rounds can say it does not pay.
MATCH_PRIOR = Acceptance(accepted=1.8, rejected=0.2)
# Each draft of a band the verifier verified none of, the weight left to what the band
# learned, the rest the prior's: a band judged too poor to verify teaches nothing more,
# so it drifts back until it is tried again (the text the user works on changes).
MATCH_DRIFT = 0.9

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SuffixRules:
    min_match: int = MIN_MATCH
    max_match: int = MAX_MATCH
    min_score: float = MIN_SCORE
    match_factor: float = MATCH_FACTOR
    max_candidates: int = MAX_CANDIDATES


class TextIndex:
    """Texts and where each `n` tokens occur in them: (text id, the position after them)."""

    def __init__(self, n: int):
        self.n = n
        self.texts: OrderedDict[int, list[int]] = OrderedDict()
        self._at: defaultdict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
        self._next_id = 0
        self.n_tokens = 0
        self._dead = 0  # entries of evicted texts still in the index

    def add(self, tokens: Sequence[int]) -> int:
        text_id, self._next_id = self._next_id, self._next_id + 1
        self.texts[text_id] = list(tokens)
        self.n_tokens += len(tokens)
        self.extend(text_id, 0)
        return text_id

    def extend(self, text_id: int, indexed: int) -> None:
        """Index the text's positions past `indexed` tokens (a text that grew)."""
        text, n = self.texts[text_id], self.n
        for end in range(max(n, indexed + 1), len(text) + 1):
            self._at[tuple(text[end - n : end])].append((text_id, end))

    def drop_oldest(self) -> None:
        _, text = self.texts.popitem(last=False)
        self.n_tokens -= len(text)
        self._dead += max(0, len(text) - self.n + 1)
        if self._dead > self.n_tokens:  # most of the index is dead: rebuild it
            self._at.clear()
            self._dead = 0
            for text_id in self.texts:
                self.extend(text_id, 0)

    def occurrences(self, key: tuple[int, ...]) -> Iterator[tuple[list[int], int]]:
        """(text, end) of each occurrence of `key`, the newest text first, the latest
        position first."""
        for text_id, end in reversed(self._at.get(key, ())):
            text = self.texts.get(text_id)
            if text is not None:
                yield text, end


class MatchAcceptance:
    """How often a lookup's draft tokens are accepted, by the length of the match they
    came from (MATCH_BANDS), recent rounds weighed more. Not thread-safe: the history's
    lock guards it."""

    def __init__(self) -> None:
        self._bands = dict.fromkeys(MATCH_BANDS, MATCH_PRIOR)

    @staticmethod
    def band(match: int) -> int:
        return max((b for b in MATCH_BANDS if b <= match), default=MATCH_BANDS[0])

    def rate(self, match: int) -> float:
        return self._bands[self.band(match)].rate

    def answered(self, match: int, verified: int, accepted_prefix_len: int) -> None:
        band = self.band(match)
        learned = self._bands[band]
        if verified:
            self._bands[band] = learned.after(verified, accepted_prefix_len)
            return
        d = MATCH_DRIFT
        self._bands[band] = Acceptance(
            d * learned.accepted + (1 - d) * MATCH_PRIOR.accepted,
            d * learned.rejected + (1 - d) * MATCH_PRIOR.rejected,
        )


class SuffixHistory:
    """One user's earlier texts (prompt and output of each generation), bounded in tokens.
    Thread-safe: generations of one `serve` key share it. With `path`, read from it at
    start and each text appended to it (JSON lines: a list of token ids a line)."""

    def __init__(
        self, max_tokens: int = DEFAULT_HISTORY_TOKENS, min_match: int = MIN_MATCH,
        path: Path | None = None,
    ):  # fmt: skip
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        self.max_tokens = max_tokens
        self.index = TextIndex(min_match)
        self.path = path
        self.lock = threading.Lock()
        self.acceptance = MatchAcceptance()  # in memory only: it follows recent rounds
        self._file_lock = threading.Lock()  # one generation's line written at a time
        if path is not None:
            path.touch()  # an OSError now, at start, rather than after a generation
            text = path.read_text(errors="replace")
            if text and not text.endswith("\n"):  # cut short: the next line starts anew
                with path.open("a") as out:
                    out.write("\n")
            skipped = 0
            for line in text.splitlines():
                tokens = _tokens(line)
                if tokens is None:
                    skipped += line.strip() != ""
                else:
                    self._add(tokens)
            if skipped:  # a line cut short by a killed process: the rest is still good
                log.warning("history file %s: %d unreadable line(s) skipped", path, skipped)

    def add(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        with self.lock:
            self._add(tokens)
        if self.path is not None and tokens:
            try:
                with self._file_lock, self.path.open("a") as out:
                    out.write(json.dumps(tokens) + "\n")
            except OSError as exc:  # kept in memory still; the file misses this text
                log.warning("history file %s: %s", self.path, exc)

    def _add(self, tokens: list[int]) -> None:
        tokens = tokens[len(tokens) - self.max_tokens :] if self.max_tokens else []
        if not tokens:
            return
        while self.index.texts and self.index.n_tokens + len(tokens) > self.max_tokens:
            self.index.drop_oldest()
        self.index.add(tokens)

    @property
    def n_tokens(self) -> int:
        return self.index.n_tokens


def _tokens(line: str) -> list[int] | None:
    try:
        tokens = json.loads(line)
    except ValueError:
        return None
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        return None
    return tokens


Sources = Sequence[Callable[[tuple[int, ...]], Iterator[tuple[Sequence[int], int]]]]


def suffix_chain(
    context: Sequence[int], sources: Sources, k: int, rules: SuffixRules = SuffixRules()
) -> list[int]:
    """The draft for `context`: `sources` give the occurrences of a key, most recent first
    (the live text's first)."""
    return suffix_match(context, sources, k, rules)[0]


def suffix_match(
    context: Sequence[int], sources: Sources, k: int, rules: SuffixRules = SuffixRules()
) -> tuple[list[int], int]:
    """`suffix_chain`'s draft, and the length of the match it follows (0: none)."""
    n = rules.min_match
    if k <= 0 or len(context) < n:
        return [], 0
    key = tuple(context[-n:])
    found: list[tuple[Sequence[int], int]] = []
    best = 0
    weighed = 0
    for source in sources:
        for text, end in source(key):
            if end >= len(text):
                continue  # nothing follows it
            weighed += 1
            if weighed > rules.max_candidates:
                break
            length = n
            while (
                length < rules.max_match
                and length < end
                and length < len(context)
                and text[end - length - 1] == context[-length - 1]
            ):
                length += 1
            if length > best:
                best, found = length, [(text, end)]
            elif length == best:
                found.append((text, end))
        if weighed > rules.max_candidates:
            break
    if not found:
        return [], 0
    limit = min(k, max(1, int(rules.match_factor * best)))
    draft: list[int] = []
    score = 1.0
    while found and len(draft) < limit:
        step = len(draft)
        counts: dict[int, int] = {}
        for text, end in found:  # in recency order: the first seen wins a tie
            if end + step < len(text):
                token = text[end + step]
                counts[token] = counts.get(token, 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)
        score *= counts[token] / sum(counts.values())
        if score < rules.min_score:
            break
        draft.append(token)
        found = [(t, e) for t, e in found if e + step < len(t) and t[e + step] == token]
    return draft, best


class SuffixDrafter(Drafter):
    """Drafts from this generation's text and its user's history (`SuffixHistory`), which
    it adds the generation to when it ends. With sampled drafts the proposal is a point
    mass on each token (q = 1), as prompt lookup's. `sized`: each draft carries its
    estimated acceptance, for a verifier that sizes lookups."""

    def __init__(
        self,
        n_vocab: int,
        history: SuffixHistory | None = None,
        *,
        sample_drafts: bool = False,
        rules: SuffixRules = SuffixRules(),
        sized: bool = False,
    ):
        self.n_vocab = n_vocab
        self.sized = sized
        self.history = history if history is not None else SuffixHistory(0, rules.min_match)
        self.sample_drafts = sample_drafts
        self.rules = rules
        self._live = TextIndex(rules.min_match)
        self._live_id = self._live.add([])

    def get_candidates(
        self, committed: Sequence[int], k: int, stop: Callable[[], bool] | None = None
    ) -> Draft:
        self._follow(committed)
        sources = [self._live.occurrences, self.history.index.occurrences]
        with self.history.lock:
            tokens, match = suffix_match(committed, sources, k, self.rules)
            accept = self.history.acceptance.rate(match) if self.sized else None
        probs = [self._point_mass(t) for t in tokens] if self.sample_drafts else None
        return Draft(tokens, probs, lookup=True, accept=accept, match=match)

    def answered(self, draft: Draft, verified: int, accepted_prefix_len: int) -> None:
        if draft.lookup and draft.match:
            with self.history.lock:
                self.history.acceptance.answered(draft.match, verified, accepted_prefix_len)

    def finish(self, text: Sequence[int]) -> None:
        self.history.add(text)
        self._live = TextIndex(self.rules.min_match)
        self._live_id = self._live.add([])

    def _follow(self, committed: Sequence[int]) -> None:
        """The live text becomes `committed`: extended where it grew, else rebuilt."""
        live = self._live.texts[self._live_id]
        held = len(live)
        # Rounds only add to the committed tokens: their first and last held ones tell.
        if len(committed) >= held and (
            held == 0 or (committed[0] == live[0] and committed[held - 1] == live[-1])
        ):
            live.extend(committed[held:])
            self._live.extend(self._live_id, held)
        else:
            self._live = TextIndex(self.rules.min_match)
            self._live_id = self._live.add(committed)

    def _point_mass(self, token: int) -> np.ndarray:
        q = np.zeros(self.n_vocab, dtype=np.float32)
        q[token] = 1.0
        return q
