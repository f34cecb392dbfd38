"""JSON responses that survive what trials record: a diverged run's loss is NaN, a broken timer's
throughput infinite. JSON has neither, and Starlette's encoder refuses them (a 500 for the whole
page), so non-finite floats go out as null."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class FiniteJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except ValueError:  # only then walk the content: the common case pays nothing
            text = json.dumps(_finite(content), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")
