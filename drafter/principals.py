"""Whose earlier texts a `serve` request is drafted from: its principal's only.

A history draft goes only where the history holds text that goes on as the request's
does, and the answer says so: how much of it was drafted and accepted (`speculative`),
and how soon it came. A client that shares a history with others can end prompts in
guesses at their texts and read which guess was drafted ("When Speculation Spills
Secrets": a secret recovered a few tokens at a time). So a history is one principal's:
the user of a `serve` that only their own machine reaches (loopback, no client key), or
with `--history-scope key` each client key. A `serve` that others reach drafts no request
from others' texts unless a setting that says what it exposes turns it on (`user`, `key`).

The caches tell the same way (`draft_cached_tokens`, the verifier's `cached_tokens`: how
long a prefix a prompt shares with a recent one), and so does what `auto` measured in a
slot's earlier generations: they are one principal's too (CacheScopes).

The CLI keeps its own history (drafter/runner.py `user_history`): one user's machine.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import threading

from drafter.drafters.suffix import SuffixHistory
from drafter.runner import user_history
from drafter.settings import WITH_HISTORY, DrafterSettings, HistoryScope
from server.shared.api_keys import ApiKeys

log = logging.getLogger("drafter.serve")

# Where `serve`'s key guard leaves the identity of the key a request presented ("key-N",
# never the key), in the request's ASGI scope.
PRINCIPAL = "drafter.principal"


def is_loopback(host: str) -> bool:
    """Whether an address `serve` listens on is reached from this machine only. A name
    other than localhost may resolve anywhere: not loopback."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# A request without a key whose Host header names no loopback address: not this
# machine's user for sure (a web page that rebinds its own name to 127.0.0.1 reaches a
# loopback `serve`, and the browser sends the page's name), so no history of theirs.
FOREIGN = "drafter.foreign"


def host_name(header: str) -> str:
    """The host of a Host header, without its port (`[::1]:8080` -> `::1`)."""
    header = header.strip()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def request_principal(key_identity: str | None, host_header: str) -> str | None:
    """Whose request it is: its key's identity, or without a key, this machine's user
    (None) where the Host header names loopback, else FOREIGN."""
    if key_identity is not None:
        return key_identity
    return None if is_loopback(host_name(host_header)) else FOREIGN


def resolve_history_scope(
    scope: HistoryScope, *, host: str, keyed: bool, any_origin: bool
) -> HistoryScope:
    """`auto`: one history for every request (`user`) only where `serve` is one user's:
    it listens on loopback, with no client key (a key is there to let others in) and no
    CORS origin '*' (which lets any web page the user opens read its answers); else
    none. Any other scope is as set. Pure."""
    if scope is not HistoryScope.auto:
        return scope
    own = is_loopback(host) and not keyed and not any_origin
    return HistoryScope.user if own else HistoryScope.none


def client_keys(settings: DrafterSettings) -> ApiKeys:
    """`serve`'s client keys: --serve-api-key's (comma-separated) and
    --serve-api-key-file's. ValueError for a key file that cannot be read, or a key
    setting given that holds no key (it would leave `serve` open to anyone)."""
    given = settings.serve_api_key or ""
    path = settings.serve_api_key_file
    try:
        keys = ApiKeys.from_settings(given, path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--serve-api-key-file {path}: {exc}") from None
    if not keys.enabled and (path is not None or given.strip()):
        raise ValueError(
            "the client key settings hold no key (--serve-api-key, --serve-api-key-file): "
            "`serve` would be open to anyone"
        )
    return keys


def serve_history_scope(settings: DrafterSettings) -> HistoryScope:
    """The history scope `serve` runs with (`auto` resolved). ValueError where the
    settings ask for what it cannot keep to."""
    keyed = client_keys(settings).enabled
    scope = resolve_history_scope(
        settings.history_scope,
        host=settings.host,
        keyed=keyed,
        any_origin="*" in settings.cors_origins,
    )
    if scope is HistoryScope.key and not keyed:
        raise ValueError(
            "--history-scope key needs client keys (--serve-api-key KEY1,KEY2 or "
            "--serve-api-key-file): without them every client is the same one"
        )
    kept = settings.drafter in WITH_HISTORY and settings.history_file is not None
    if kept and scope is not HistoryScope.user:
        auto = settings.history_scope is HistoryScope.auto
        why = " (auto: `serve` is reached by others)" if auto else ""
        raise ValueError(
            f"--history-file is one history for every request, and the history scope is "
            f"{scope}{why}: --history-scope user shares it among all of `serve`'s clients, "
            "each of whom can then learn the others' texts"
        )
    return scope


class Histories:
    """Each principal's history, as the scope says: one for every request (`user`, with
    --history-file if named), one per client key made at its first request (`key`, in
    memory only), or none (`none`, or a drafter that drafts from no history)."""

    def __init__(self, settings: DrafterSettings, scope: HistoryScope):
        self.scope = scope
        self.from_auto = settings.history_scope is HistoryScope.auto
        self.max_tokens = settings.history_tokens
        kept = scope in (HistoryScope.user, HistoryScope.key)
        self.enabled = settings.drafter in WITH_HISTORY and kept
        shared = self.enabled and scope is HistoryScope.user
        self._shared = user_history(settings) if shared else None
        self._by_key: dict[str, SuffixHistory] = {}
        self._lock = threading.Lock()

    def of(self, principal: str | None) -> SuffixHistory | None:
        """The history a request of `principal` (its key's identity, None without a key)
        is drafted from and joins."""
        if not self.enabled:
            return None
        if self.scope is HistoryScope.user:
            return None if principal == FOREIGN and self.from_auto else self._shared
        if principal is None:  # no key to tell whose it is: nobody's history
            return None
        with self._lock:
            history = self._by_key.get(principal)
            if history is None:
                history = self._by_key[principal] = SuffixHistory(self.max_tokens)
            return history

    def describe(self) -> str:
        """What `serve`'s log says at start."""
        if not self.enabled:
            return "no history across requests"
        if self.scope is HistoryScope.key:
            return (
                "one history per client key (every client of one key can learn the others' "
                "texts from their answers' speculative figures and timing)"
            )
        return "one history for every request (every client can learn every other's texts)"


class CacheScopes:
    """Whose cached prompts a request may start from, on `serve` (its slots' draft caches
    and what they measured) and on the verifier (its prefixes, under the one verifier key
    `serve` uses for every client): its principal's. Under `user` every request is one
    principal's, as its history is (a foreign one apart where `auto` chose `user`); under
    `key` and `none` each client key is one, and a key shared by several clients shares
    its caches among them, as a hosted API's prompt cache is shared within an
    organisation."""

    def __init__(self, scope: HistoryScope, from_auto: bool, secret: bytes | None = None):
        self.shared = scope is HistoryScope.user
        self.from_auto = from_auto
        # Known to this process only: the verifier sees which requests share a scope,
        # never which key, nor the same name across restarts.
        self._secret = secrets.token_bytes(32) if secret is None else secret

    def of(self, principal: str | None) -> str | None:
        """The principal whose caches a request of `principal` (its key's identity, None
        without a key, FOREIGN) reuses and fills."""
        if self.shared and not (principal == FOREIGN and self.from_auto):
            return None
        return principal

    def verifier_scope(self, cache_principal: str | None) -> str | None:
        """The `cache_scope` the verifier's prefill gets for it: none for the principal
        without a key (the verifier key's own cache, as any client's without a scope),
        else a keyed hash of it."""
        if cache_principal is None:
            return None
        digest = hmac.new(self._secret, cache_principal.encode(), hashlib.sha256)
        return digest.hexdigest()[:32]
