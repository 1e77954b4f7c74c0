"""Errors a user of the drafter can act on; the CLI turns each into one clear message."""


class DrafterError(Exception):
    exit_code = 1


class VerifierUnavailable(DrafterError):
    """The verifier could not be reached or did not answer in time."""


class VerifierRejected(DrafterError):
    """The verifier answered with an error body."""

    def __init__(self, status: int, error_type: str, message: str):
        super().__init__(f"verifier error {status} ({error_type}): {message}")
        self.status = status
        self.error_type = error_type
        self.message = message


class VocabularyMismatch(DrafterError):
    exit_code = 3


class DraftModelError(DrafterError):
    """The local draft model could not be loaded or used."""
