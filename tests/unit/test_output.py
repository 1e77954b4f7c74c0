import json

from drafter.drafters.text import TextDecoder, complete_text
from drafter.output import BaselineResult, JsonRenderer, speedup
from drafter.speculative.loop import RoundEvent, SpeculativeResult
from drafter.speculative.stats import GenerationStats

PIECES = {1: b"h", 2: "é".encode()[:1], 3: "é".encode()[1:], 4: b" ok"}


def test_decoder_holds_a_character_split_across_tokens():
    decoder = TextDecoder(PIECES.__getitem__)
    assert decoder.feed([1, 2]) == "h"
    assert decoder.feed([3, 4]) == "é ok"
    assert decoder.flush() == ""


def test_complete_text_leaves_out_a_character_still_to_come():
    data = "naïve ☃".encode()
    assert complete_text(data) == "naïve ☃"
    assert complete_text(data[:-1]) == "naïve "  # the snowman's last byte is still to come
    assert complete_text(b"a\xffb") == "a\ufffdb"  # a byte that is never UTF-8: replaced


def test_stats_derive_rates():
    stats = GenerationStats(
        generated_tokens=30, rounds=10, drafted=40, accepted=20, total_time_s=2.0
    )
    assert stats.acceptance_rate == 0.5
    assert stats.tokens_per_round == 3.0
    assert stats.tokens_per_s == 15.0
    assert GenerationStats().acceptance_rate == 0.0


def test_speedup_is_the_ratio_of_measured_rates():
    result = SpeculativeResult(stats=GenerationStats(generated_tokens=20, total_time_s=1.0))
    assert (
        speedup(result, BaselineResult(tokens=[0] * 10, total_time_s=1.0, server_tokens_per_s=11.0))
        == 2.0
    )


def test_json_renderer_prints_one_object(capsys):
    renderer = JsonRenderer()
    renderer.start(PIECES.__getitem__)
    renderer.round(
        RoundEvent(draft_tokens=[1, 2], accepted_prefix_len=2, tokens=[1, 2, 3], eos=False)
    )
    result = SpeculativeResult(
        prompt_ids=[7],
        tokens=[1, 2, 3],
        finish_reason="max_tokens",
        stats=GenerationStats(generated_tokens=3, rounds=1),
    )
    renderer.finish(result, None)
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "hé"
    assert out["tokens"] == [1, 2, 3]
    stats = out["stats"]
    assert (stats["generated_tokens"], stats["rounds"], stats["tokens_per_round"]) == (3, 1, 3.0)
    assert {"acceptance_rate", "protocol_overhead_ms", "rounds_by_draft_len"} <= set(stats)


def test_the_stats_say_when_greedy_is_not_exact_on_this_verifier():
    import io

    from rich.console import Console

    from drafter.output import TextRenderer

    def render(lossless: bool, strategy: str = "greedy") -> str:
        out = io.StringIO()
        renderer = TextRenderer(console=Console(file=out, width=200))
        renderer.start(PIECES.__getitem__)
        renderer.round(
            RoundEvent(draft_tokens=[1], accepted_prefix_len=1, tokens=[1, 4], eos=False)
        )
        result = SpeculativeResult(
            tokens=[1, 4],
            finish_reason="max_tokens",
            strategy=strategy,
            lossless=lossless,
            stats=GenerationStats(generated_tokens=2, rounds=1, total_time_s=1.0),
        )
        baseline = BaselineResult(tokens=[1, 4], total_time_s=1.0, server_tokens_per_s=2.0)
        renderer.finish(result, baseline)
        return out.getvalue()

    assert "batch-invariant" not in render(lossless=True)
    text = render(lossless=False)
    assert "NOT exact: the verifier is not batch-invariant" in text
    assert "yes (not guaranteed: the verifier is not batch-invariant)" in text
    assert "LOSSY" in render(lossless=False, strategy="threshold")


def test_the_stats_give_acceptance_by_kind_where_a_lookup_drafts_beside_the_model():
    import io

    from rich.console import Console

    from drafter.output import TextRenderer

    def render(stats: GenerationStats) -> str:
        out = io.StringIO()
        renderer = TextRenderer(console=Console(file=out, width=200))
        renderer.start(PIECES.__getitem__)
        renderer.finish(SpeculativeResult(tokens=[1], finish_reason="eos", stats=stats), None)
        return out.getvalue()

    mixed = GenerationStats(
        rounds=6, drafted=20, accepted=15, lookup_rounds=2, lookup_drafted=12, lookup_accepted=11
    )
    assert "lookup 11 of 12 (2 rounds), model 4 of 8" in render(mixed)
    assert "accepted by kind" not in render(GenerationStats(rounds=6, drafted=20, accepted=15))
