"""Sessions and the KV cache: which session holds which sequence, prefix reuse, where prompts are
cut."""
