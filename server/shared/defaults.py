"""Where the repository keeps its models, and the default pair."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO_ROOT / "models"
DEFAULT_VERIFIER_MODEL = MODELS_DIR / "smollm2-135m-instruct-q8_0.gguf"
DEFAULT_DRAFTER_MODEL = MODELS_DIR / "smollm2-135m-instruct-q4_k_m.gguf"
