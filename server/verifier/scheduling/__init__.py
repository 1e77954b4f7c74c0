"""Scheduling: the queue, the engine thread, and the cycle step that decides what shares a pass."""
