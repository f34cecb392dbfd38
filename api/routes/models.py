"""`GET /v1/models`: the model families, hf model types and installed plugins (with their option
schemas) a recipe submitted here can name."""

from __future__ import annotations

from typing import Any

from api.deps import ReadAuth
from api.routes import v1_router

router = v1_router(tags=["models"])


@router.get("/models")
def list_models(_: ReadAuth) -> dict[str, Any]:
    """Families, the hf family's supported model types, installed plugins and option schemas."""
    from tuner.models.catalog import models_catalog

    return models_catalog()
