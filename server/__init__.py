"""hetero-specdecode verifier: a FastAPI server that checks drafts against a llama.cpp model."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
DEFAULT_VERIFIER_MODEL = MODELS_DIR / "smollm2-135m-instruct-q8_0.gguf"
DEFAULT_DRAFTER_MODEL = MODELS_DIR / "smollm2-135m-instruct-q4_k_m.gguf"
