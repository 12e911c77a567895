"""The model tests' fixtures (one tiny dummy model per session) for the pipeline tests here."""

from tests.model.conftest import cache, fingerprint, tiny, tiny_info

__all__ = ["cache", "fingerprint", "tiny", "tiny_info"]
