"""The speculative loop: its rounds, its contracts with drafters, drafts made while a round is
out."""
