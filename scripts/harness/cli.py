"""The scripts' `--help`: description paragraphs kept as written, defaults shown."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default after its help, except for a required option's (never used)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.required else super()._get_help_string(action)


def first_paragraph(doc: str | None) -> str:
    """A module docstring's first paragraph, whole: the scripts' `--help` description."""
    return (doc or "").strip().split("\n\n", 1)[0]
