"""The engine and its passes: prompts and rounds decoded, judged and answered, the draft length
advised."""
