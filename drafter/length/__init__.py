"""Draft-length policy: how many tokens the next round drafts, or asks the verifier for."""
