"""Whose history a `serve` request is drafted from (drafter/principals.py): the scope
resolved from where `serve` listens and who may call it, one history per principal, and
whose caches it reuses (CacheScopes)."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from drafter.principals import (
    FOREIGN,
    CacheScopes,
    Histories,
    client_keys,
    host_name,
    is_loopback,
    request_principal,
    resolve_history_scope,
    serve_history_scope,
)
from drafter.settings import DrafterSettings, HistoryScope
from server.shared.protocol import PrefillRequest

AUTO, USER, KEY, NONE = HistoryScope.auto, HistoryScope.user, HistoryScope.key, HistoryScope.none


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.168.1.10", False),
        ("my-laptop.local", False),  # a name may resolve anywhere
    ],
)
def test_loopback_is_this_machine_only(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("host", "keyed", "any_origin", "resolved"),
    [
        ("127.0.0.1", False, False, USER),  # one user's own machine: as before
        ("127.0.0.1", True, False, NONE),  # a key is there to let others in
        ("0.0.0.0", False, False, NONE),  # reached from other machines
        ("0.0.0.0", True, False, NONE),
        ("127.0.0.1", False, True, NONE),  # any web page the user opens may call it
    ],
)
def test_auto_keeps_one_history_only_where_serve_is_one_users(host, keyed, any_origin, resolved):
    assert resolve_history_scope(AUTO, host=host, keyed=keyed, any_origin=any_origin) is resolved


@pytest.mark.parametrize("scope", [USER, KEY, NONE])
def test_a_scope_set_is_kept_wherever_serve_listens(scope):
    for host, keyed in [("127.0.0.1", False), ("0.0.0.0", True)]:
        assert resolve_history_scope(scope, host=host, keyed=keyed, any_origin=False) is scope


def test_the_default_scope_follows_the_settings():
    assert serve_history_scope(DrafterSettings()) is USER
    assert serve_history_scope(DrafterSettings(serve_api_key="sk-team")) is NONE
    assert serve_history_scope(DrafterSettings(host="0.0.0.0")) is NONE
    assert serve_history_scope(DrafterSettings(cors_origins=["*"])) is NONE
    assert serve_history_scope(DrafterSettings(cors_origins=["http://localhost:3000"])) is USER
    keyed = DrafterSettings(serve_api_key="sk-a,sk-b", history_scope="key")
    assert serve_history_scope(keyed) is KEY


def test_scope_key_without_client_keys_is_refused():
    with pytest.raises(ValueError, match="needs client keys"):
        serve_history_scope(DrafterSettings(history_scope="key"))


def test_a_history_file_is_refused_where_requests_keep_no_shared_history(tmp_path):
    path = tmp_path / "history.jsonl"
    with pytest.raises(ValueError, match=r"--history-file.*auto"):
        serve_history_scope(DrafterSettings(history_file=path, serve_api_key="sk-team"))
    with pytest.raises(ValueError, match="--history-file"):
        serve_history_scope(DrafterSettings(history_file=path, history_scope="none"))
    assert serve_history_scope(DrafterSettings(history_file=path)) is USER  # loopback, no key
    shared = DrafterSettings(history_file=path, serve_api_key="sk-team", history_scope="user")
    assert serve_history_scope(shared) is USER
    # A drafter that keeps no history: nothing to refuse.
    plain = DrafterSettings(history_file=path, serve_api_key="sk-team", drafter="model")
    assert serve_history_scope(plain) is NONE


def test_client_keys_come_comma_separated_and_from_a_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the team\nsk-c\n\nsk-d\n")
    keys = client_keys(DrafterSettings(serve_api_key="sk-a, sk-b", serve_api_key_file=path))
    assert len(keys) == 4
    assert [keys.identify(k) for k in ("sk-a", "sk-b", "sk-c", "sk-d", "sk-e")] == [
        "key-0",
        "key-1",
        "key-2",
        "key-3",
        None,
    ]
    assert not client_keys(DrafterSettings()).enabled


def test_key_settings_that_hold_no_key_are_refused_not_left_open(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# nobody yet\n")
    for settings in (
        DrafterSettings(serve_api_key_file=empty),
        DrafterSettings(serve_api_key=" , "),
    ):
        with pytest.raises(ValueError, match="open to anyone"):
            client_keys(settings)
    with pytest.raises(ValueError, match="--serve-api-key-file"):
        client_keys(DrafterSettings(serve_api_key_file=tmp_path / "missing"))


def test_each_key_has_its_own_history_and_none_is_shared():
    histories = Histories(DrafterSettings(history_tokens=100), KEY)
    a, b = histories.of("key-0"), histories.of("key-1")
    assert a is not None and b is not None and a is not b
    assert histories.of("key-0") is a  # kept across requests
    assert histories.of(None) is None  # no key to tell whose: nobody's
    a.add(list(range(20)))
    assert a.n_tokens == 20 and b.n_tokens == 0
    assert a.max_tokens == 100


def test_scope_user_is_one_history_for_every_request():
    histories = Histories(DrafterSettings(), USER)
    shared = histories.of(None)
    assert shared is not None and histories.of("key-0") is shared is histories.of("key-1")


def test_scope_none_and_drafters_without_history_draft_from_none():
    assert Histories(DrafterSettings(), NONE).of("key-0") is None
    assert Histories(DrafterSettings(drafter="model"), USER).of(None) is None
    assert Histories(DrafterSettings(drafter="model"), KEY).of("key-0") is None


@pytest.mark.parametrize(
    ("header", "host"),
    [("127.0.0.1:8080", "127.0.0.1"), ("[::1]:8080", "::1"), ("localhost", "localhost"),
     ("evil.example:8080", "evil.example"), ("::1", "::1")],
)  # fmt: skip
def test_the_host_of_a_host_header(header, host):
    assert host_name(header) == host


def test_a_keyless_request_naming_no_loopback_host_gets_no_history_from_auto():
    """DNS rebinding: a web page whose name resolves to 127.0.0.1 reaches a loopback
    `serve`, and the browser's Host header is the page's name. Under `auto` (one user's
    machine) it is nobody's history; under a scope the operator set, as that scope says."""
    assert request_principal(None, "127.0.0.1:8080") is None
    assert request_principal(None, "localhost") is None
    assert request_principal(None, "rebound.example:8080") == FOREIGN
    assert request_principal("key-0", "rebound.example") == "key-0"
    auto = Histories(DrafterSettings(), HistoryScope.user)
    assert auto.of(None) is not None and auto.of(FOREIGN) is None
    chosen = Histories(DrafterSettings(history_scope="user"), HistoryScope.user)
    assert chosen.of(FOREIGN) is chosen.of(None) is not None


@pytest.mark.parametrize("scope", [KEY, NONE])
def test_each_client_key_is_its_own_caches_principal_and_a_shared_key_one(scope):
    caches = CacheScopes(scope, from_auto=True, secret=b"s" * 32)
    assert caches.of("key-0") == "key-0" and caches.of("key-1") == "key-1"
    assert caches.of(None) is None and caches.of(FOREIGN) == FOREIGN
    names = {caches.verifier_scope(p) for p in ("key-0", "key-1", FOREIGN)}
    assert len(names) == 3 and caches.verifier_scope(None) is None  # None: the key's own
    assert caches.verifier_scope("key-0") == caches.verifier_scope("key-0")  # stable


def test_scope_user_is_one_caches_principal_but_a_foreign_request_from_auto():
    chosen = CacheScopes(USER, from_auto=False)
    assert chosen.of("key-0") is chosen.of(FOREIGN) is chosen.of(None) is None
    auto = CacheScopes(USER, from_auto=True)
    assert auto.of(None) is None and auto.of(FOREIGN) == FOREIGN


def test_the_verifier_gets_a_keyed_hash_never_the_principal_and_fit_for_the_wire():
    """An opaque name the verifier cannot map back to a key, nor match across `serve`
    processes (each its own secret)."""
    one, other = CacheScopes(KEY, False), CacheScopes(KEY, False)
    name = one.verifier_scope("key-0")
    assert name is not None and "key" not in name
    assert PrefillRequest(prompt="x", cache_scope=name).cache_scope == name  # the wire's rule
    assert other.verifier_scope("key-0") != name
    keyed = CacheScopes(KEY, False, secret=b"k" * 32)
    expected = hmac.new(b"k" * 32, b"key-0", hashlib.sha256).hexdigest()[:32]
    assert keyed.verifier_scope("key-0") == expected
