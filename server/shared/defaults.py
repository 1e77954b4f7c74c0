"""Where the repository keeps its models, and the default pair."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO_ROOT / "models"
DEFAULT_VERIFIER_MODEL = MODELS_DIR / "smollm2-135m-instruct-q8_0.gguf"
DEFAULT_DRAFTER_MODEL = MODELS_DIR / "smollm2-135m-instruct-q4_k_m.gguf"


def default_cache_dir(kind: str) -> str:
    """This user's cache folder for `kind` (XDG_CACHE_HOME where set)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "hetero-specdecode" / kind)
