"""The drafters: the draft model, prompt lookup, the user's history, drafting through text."""
