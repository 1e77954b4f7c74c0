"""A verifier's /metrics read with prometheus_client's own parser: samples by name and
labels, summed over the labels not asked for."""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families


class Metrics:
    def __init__(self, text: str):
        self.samples = [
            (sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    @classmethod
    def scrape(cls, url: str, api_key: str | None = None, timeout: float = 30.0) -> Metrics:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        response = httpx.get(f"{url}/metrics", headers=headers, timeout=timeout)
        response.raise_for_status()
        return cls(response.text)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels` (0 if none)."""
        return sum(
            value
            for sample, sample_labels, value in self.samples
            if sample == name and _includes(sample_labels, labels)
        )

    def has(self, name: str) -> bool:
        return any(sample == name for sample, _, _ in self.samples)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """`name`'s samples by the value of one label."""
        out: dict[str, float] = {}
        for sample, labels, value in self.samples:
            if sample == name and label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + value
        return out


def _includes(labels: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in wanted.items())
