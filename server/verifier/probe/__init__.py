"""The startup probe: whether this build gives a row the same logits in every pass shape."""
