"""Serving a build archive: the one check both download routes make. The file the builds table
names must still be the archive its checksum names (a byte flipped on disk, or the file replaced,
was served under the stored `X-Checksum-Sha256`). Hashing a large archive costs seconds, so a
verified file is remembered by its size and modification time until either changes."""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi.responses import FileResponse

from api.errors import ApiError
from tuner.artifacts import sha256_file
from tuner.db import Build

_verified: dict[tuple[str, int, int], str] = {}  # (path, size, mtime ns) -> its sha256
_lock = threading.Lock()


def _digest(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _lock:
        known = _verified.get(key)
    if known is None:
        known = sha256_file(path)
        with _lock:
            if len(_verified) > 4096:
                _verified.clear()
            _verified[key] = known
    return known


def build_response(build: Build, field: tuple[str, str], missing: str) -> FileResponse:
    """The archive of `build` as a download, or a 404 (`missing`: why, for the detail) when its
    file is gone, a 409 when its bytes no longer match its checksum. `field`: the request field
    the error names."""
    path = Path(build.path)
    try:
        digest = _digest(path) if path.is_file() else None
    except OSError:
        digest = None
    if digest is None:
        raise ApiError(404, missing, [field])
    if digest != build.sha256:
        raise ApiError(
            409,
            f"the build file {path.name} no longer matches its checksum (damaged or replaced on disk); "
            "build the trial again with `tuner build`",
            [(field[0], "checksum mismatch")],
        )
    return FileResponse(
        path, media_type="application/gzip", filename=path.name, headers={"X-Checksum-Sha256": build.sha256}
    )
