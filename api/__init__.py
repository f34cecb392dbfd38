"""The REST service: FastAPI app that validates recipes, persists jobs and serves results."""

from api.app import create_app
from api.settings import Settings

__all__ = ["Settings", "create_app"]
