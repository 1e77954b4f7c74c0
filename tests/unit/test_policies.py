"""The verifier's policies, each on its own with plain inputs: admission (the queue's fair
share), packing (which id a sequence takes), eviction (whose sequence goes) and prefix
reuse (which cached prefix a prompt starts from)."""

from __future__ import annotations

from collections import Counter

from server.verifier.kv.eviction import Eviction
from server.verifier.kv.packing import Packing, runs_added
from server.verifier.kv.prefix_reuse import CachedPrefix, PrefixReuse
from server.verifier.scheduling.admission import QueueShare

# -- admission ------------------------------------------------------------------------


def test_a_key_with_nothing_queued_always_gets_in_even_past_the_limit():
    share = QueueShare(max_queue=4)
    assert share.refusal(["m"] * 10, "a") is None


def test_a_key_with_work_queued_is_held_to_its_part_of_the_queue():
    share = QueueShare(max_queue=8)
    # one other key queued: each key's part is 8 // 3 = 2
    assert share.refusal(["m", "m", "a"], "a") is None
    refusal = share.refusal(["m", "m", "a"], "m")
    assert refusal is not None and "2 of them this key's" in refusal
    assert share.refusal(["a"] * 8, "a") is not None  # the queue is full


# -- packing --------------------------------------------------------------------------


def test_a_new_sequence_goes_beside_the_held_ones_a_free_id_before_a_prefix():
    packing = Packing(enabled=True)
    held = {0, 1, 5}
    assert runs_added(2, held) == 0 and runs_added(3, held) == 1 and runs_added(4, held) == 0
    # 2 and 4 join a run; 2 is free, 4 holds a cached prefix (one copy more): 2 first
    assert packing.places(free=[2, 3, 7], cached=[4], held=held)[:2] == [2, 4]
    # a cached id between two runs joins them (-1 run): its prefix moves for it
    assert packing.places(free=[7], cached=[4], held={0, 1, 3, 5}) == [4, 7]


def test_a_reused_prefix_stays_unless_a_move_gains_a_run():
    packing = Packing(enabled=True)
    assert packing.places(free=[2, 9], cached=[], held={0, 1}, reused=7)[0] == 2
    assert packing.places(free=[9], cached=[], held={0, 1}, reused=2)[0] == 2


def test_without_packing_the_lowest_free_id_or_the_prefix_where_it_is():
    packing = Packing(enabled=False)
    assert packing.places(free=[5, 2, 7], cached=[3], held={0, 1}) == [2]
    assert packing.places(free=[2], cached=[], held={0}, reused=6) == [6]


def test_a_prefix_moved_away_goes_to_the_free_id_beside_nothing_held():
    assert Packing.spare(free=[2, 4, 7], held={0, 1, 3, 5}) == 7
    assert Packing.spare(free=[2, 4], held={1, 3, 5}) == 4  # none alone: the highest


# -- eviction -------------------------------------------------------------------------


def test_the_share_is_an_equal_part_among_the_keys_holding_any_and_the_one_asking():
    eviction = Eviction(max_sessions=8, key_share=0)
    assert eviction.share(Counter({"m": 6, "a": 2})) == 4
    assert eviction.share(Counter({"m": 8}), asking="a") == 4
    assert Eviction(max_sessions=8, key_share=3).share(Counter({"m": 8})) == 3


def test_sequences_are_taken_from_keys_over_their_share_then_from_the_asking_key():
    eviction = Eviction(max_sessions=4, key_share=0)
    assert eviction.givers(Counter({"m": 3, "a": 1}), "a") == ["m", "a"]
    # the asking key over its share gives first of all
    assert eviction.givers(Counter({"m": 4}), "m") == ["m"]
    # a newcomer shrinks the equal share: both others are over it now
    assert eviction.givers(Counter({"m": 2, "a": 2}), "b") == ["m", "a", "b"]
    fixed = Eviction(max_sessions=4, key_share=2)
    assert fixed.givers(Counter({"m": 2, "a": 2}), "b") == ["b"]  # nobody over: itself


def test_a_refusal_says_whether_the_key_holds_its_share():
    eviction = Eviction(max_sessions=4, key_share=0)
    assert "its share" in eviction.refusal(Counter({"a": 4}), "a")
    assert "busy or held by keys within" in eviction.refusal(Counter({"m": 2, "n": 2}), "a")


# -- prefix reuse ---------------------------------------------------------------------


def cache(min_tokens: int, *prefixes: tuple[int, str, list[int]]) -> PrefixReuse:
    reuse = PrefixReuse(min_tokens)
    for seq_id, owner, tokens in prefixes:
        reuse.keep(seq_id, CachedPrefix(owner, tokens))
    return reuse


def test_the_longest_shared_prefix_of_the_same_key_is_reused_short_ones_are_not():
    def reuse() -> PrefixReuse:
        return cache(
            4,
            (0, "a", [1, 2, 3, 4, 5, 6]),
            (1, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9]),
            (2, "b", list(range(1, 30))),  # another key's: never
        )

    taken = reuse()
    assert taken.take("a", [1, 2, 3, 4, 5, 6, 7, 99]) == (1, 7)
    assert list(taken) == [0, 2]  # taken out of the cache
    assert reuse().take("a", [1, 2, 3, 50]) is None  # 3 < 4
    assert reuse().take("c", list(range(1, 30))) is None


def test_within_a_key_a_prefix_is_reused_only_by_the_same_cache_scope():
    reuse = PrefixReuse(4)
    reuse.keep(0, CachedPrefix("serve", list(range(1, 20)), scope="x"))
    reuse.keep(1, CachedPrefix("serve", list(range(1, 10))))  # a client with no scope
    prompt = list(range(1, 25))
    assert reuse.take("serve", prompt, scope="y") is None  # another client's: never
    assert reuse.take("other", prompt, scope="x") is None  # nor another key's same name
    assert reuse.take("serve", prompt) == (1, 9)  # no scope: only the unscoped
    assert reuse.take("serve", prompt, scope="x") == (0, 19)


def test_the_prompts_last_token_is_never_reused_and_nothing_is_kept_when_off():
    assert cache(2, (0, "a", [1, 2, 3, 4])).take("a", [1, 2, 3, 4]) == (0, 3)
    reuse = PrefixReuse(min_tokens=2)
    assert reuse.keeps(2) and not reuse.keeps(1)
    off = cache(0, (0, "a", [1, 2, 3]))
    assert not off.keeps(100) and off.take("a", [1, 2, 3]) is None


def test_a_prefix_moved_keeps_its_place_in_the_order_and_old_ones_expire():
    reuse = cache(1, (3, "a", [1, 2]), (5, "a", [3, 4]))
    reuse.relocate(3, 7)
    assert list(reuse) == [7, 5]
    now = max(p.cached_at for _, p in reuse.items())
    assert reuse.older_than(-1.0, now) == [7, 5] and reuse.older_than(1e9, now) == []
