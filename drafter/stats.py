"""What a generation cost and achieved, with the derived rates computed in one place."""

from __future__ import annotations

from dataclasses import dataclass

STATS_KEYS = (
    "prompt_tokens",
    "generated_tokens",
    "rounds",
    "drafted",
    "accepted",
    "acceptance_rate",
    "tokens_per_round",
    "total_time_s",
    "tokens_per_s",
    "bytes_sent",
    "bytes_received",
    "bytes_sent_per_round",
    "bytes_received_per_round",
    "recoveries",
)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    total_time_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    recoveries: int = 0  # new sessions opened after the verifier lost ours

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    @property
    def bytes_sent_per_round(self) -> float:
        return self.bytes_sent / self.rounds if self.rounds else 0.0

    @property
    def bytes_received_per_round(self) -> float:
        return self.bytes_received / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            key: round(value, 4) if isinstance(value, float) else value
            for key in STATS_KEYS
            for value in [getattr(self, key)]
        }
