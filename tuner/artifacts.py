"""The artifact store: where builds live (`<root>/<study>/<trial>.tar.gz`), how they are written,
checked against their checksums, and unpacked without any member escaping its target directory."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import IO

from tuner.settings import absolute_path, artifact_dir

MANIFEST = "manifest.json"
# Study names become directory names: letters, digits, '.', '_', '-' only, never a leading dot
# (no hidden directories, no '.' or '..').
_STUDY_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
_CHUNK = 1 << 20


class ArtifactError(RuntimeError):
    """A build that cannot be stored, found or trusted; the message says which file and why."""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sha256_stream(f: IO[bytes]) -> str:
    h = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def check_study_name(study: str) -> str:
    if not isinstance(study, str) or not _STUDY_RE.fullmatch(study):
        raise ArtifactError(
            f"study name {study!r} cannot name a build directory: use 1-200 letters, digits, "
            "'.', '_' or '-', not starting with '.'"
        )
    return study


def check_trial_number(trial: int) -> int:
    if isinstance(trial, bool) or not isinstance(trial, int) or trial < 0:
        raise ArtifactError(f"trial number {trial!r} must be an integer >= 0")
    return trial


def file_table(directory: str | Path) -> dict[str, dict[str, int | str]]:
    """{relative posix path: {sha256, size}} for every regular file under `directory`.

    A symlink inside a build directory is refused: an archive must hold the bytes, not a pointer
    to somewhere on the build machine.
    """
    root = Path(directory)
    table: dict[str, dict[str, int | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            if p.is_symlink():
                raise ArtifactError(f"{p}: symlinks are not allowed in a build")
        for name in sorted(filenames):
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel == MANIFEST:
                continue
            table[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return dict(sorted(table.items()))


def write_manifest(directory: str | Path, info: dict) -> dict:
    """Write `manifest.json` into `directory`: `info` plus the checksum of every other file."""
    manifest = {**info, "files": file_table(directory)}
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def _member_problem(member: tarfile.TarInfo) -> str | None:
    name = member.name
    parts = Path(name).parts
    if name.startswith(("/", "\\")) or Path(name).is_absolute():
        return "absolute path"
    if ".." in parts:
        return "'..' in path"
    if not (member.isfile() or member.isdir()):
        return "not a regular file or directory (links and devices are refused)"
    return None


def _open_tar(path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(path, "r:gz")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise ArtifactError(f"{path}: not a readable .tar.gz archive ({err})") from None


def _members(tar: tarfile.TarFile, path: Path) -> list[tarfile.TarInfo]:
    try:
        members = tar.getmembers()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
        raise ArtifactError(f"{path}: archive is corrupt ({err})") from None
    for m in members:
        problem = _member_problem(m)
        if problem:
            raise ArtifactError(f"{path}: member {m.name!r} refused: {problem}")
    return members


def safe_extract(archive: str | Path, dest: str | Path) -> Path:
    """Unpack `archive` into `dest`; refuse any member that would land outside it."""
    archive, dest = Path(archive), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    with _open_tar(archive) as tar:
        members = _members(tar, archive)
        for m in members:
            target = (root / m.name).resolve()
            if target != root and root not in target.parents:
                raise ArtifactError(f"{archive}: member {m.name!r} would escape {dest}")
        try:
            # The 'data' filter repeats our checks in the standard library (and drops modes like setuid).
            tar.extractall(root, members=members, filter="data")
        except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
            raise ArtifactError(f"{archive}: archive is corrupt ({err})") from None
    return dest


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would change it for every thread
    a moment); 022 where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


class ArtifactStore:
    """A directory of builds: `<root>/<study>/<trial>-<sha256, 12 digits>.tar.gz`, each with a
    `.sha256` file beside it. Each build of a trial keeps its own file: a rebuild (a second job of
    the recipe, `tuner build` after a job) must not change the bytes an earlier build's row and
    checksum name.

    The root is `root`, else `TUNER_ARTIFACT_DIR`, else `./builds` (`tuner.settings`), made absolute
    here: builds are compiled by processes running in other directories. Every path is derived
    from a checked study name and trial number and must resolve inside the root, so a caller
    cannot reach outside it with `..`, an absolute path or a symlinked directory.
    """

    def __init__(self, root: str | Path | None = None):
        self.root = absolute_path(root) if root else artifact_dir()

    def path_for(self, study: str, trial: int, sha256: str | None = None) -> Path:
        """The archive of that build (`sha256`), or the name builds before 0.1 took (`<trial>.tar.gz`)."""
        check_study_name(study)
        check_trial_number(trial)
        if sha256 is not None and not re.fullmatch(r"[0-9a-f]{12,64}", sha256):
            raise ArtifactError(f"{sha256!r} is not a sha256 in hex")
        path = self.root / study / (f"{trial}-{sha256[:12]}.tar.gz" if sha256 else f"{trial}.tar.gz")
        self._inside(path)
        return path

    def _inside(self, path: Path) -> None:
        root = self.root.resolve()
        for p in (path.parent, path):
            if p.is_symlink():
                raise ArtifactError(f"{p} is a symlink; the artifact store does not follow links")
        resolved = path.resolve()
        if root not in resolved.parents:
            raise ArtifactError(f"{path} resolves outside the artifact store {self.root}")

    def put(self, study: str, trial: int, directory: str | Path) -> tuple[Path, str, int]:
        """Archive `directory` (which must hold a manifest.json) as this study's trial build.

        Returns (path, sha256, size in bytes). The archive is written beside its final name and
        renamed into place, so a reader never sees half a build.
        """
        directory = Path(directory)
        if not (directory / MANIFEST).is_file():
            raise ArtifactError(f"{directory}: no {MANIFEST}; call write_manifest first")
        folder = self.path_for(study, trial).parent
        folder.mkdir(parents=True, exist_ok=True)
        self._inside(folder / ".")
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{trial}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
                for rel in [MANIFEST, *sorted(file_table(directory))]:
                    tar.add(directory / rel, arcname=rel, recursive=False, filter=_normalise)
            digest = sha256_file(tmp)
            path = self.path_for(study, trial, digest)
            # Readable as any file this user writes (mkstemp makes it 0600): the service that
            # serves builds may run as another user than the one who built.
            os.chmod(tmp, 0o666 & ~_umask())
            # The checksum first, then the archive: a reader that finds the archive finds its sum.
            side = path.with_suffix("").with_suffix(".sha256")
            side_tmp = Path(f"{tmp}.sha256")
            side_tmp.write_text(f"{digest}  {path.name}\n")
            os.replace(side_tmp, side)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            Path(f"{tmp}.sha256").unlink(missing_ok=True)
            raise
        return path, digest, path.stat().st_size

    def registered_sha256(self, path: str | Path) -> str | None:
        side = Path(path).with_suffix("").with_suffix(".sha256")
        try:
            return side.read_text().split()[0]
        except (OSError, IndexError):
            return None

    def open(self, study: str, trial: int, sha256: str | None = None) -> IO[bytes]:
        """The verified archive of that build (`sha256`; else the trial's newest), opened for
        reading (e.g. to stream a download)."""
        path = self.path_for(study, trial, sha256)
        if sha256 is None:
            builds = sorted(path.parent.glob(f"{trial}-*.tar.gz"), key=lambda p: p.stat().st_mtime)
            path = builds[-1] if builds else path
        if not path.is_file():
            raise ArtifactError(f"no build for study {study!r} trial {trial} in {self.root}")
        self.verify(path, sha256)
        return open(path, "rb")

    def verify(self, path: str | Path, sha256: str | None = None) -> dict:
        """Check a build and return its manifest; raise ArtifactError on any mismatch.

        The archive's sha256 must equal `sha256` (the one registered in the database) or, when
        none is given, the `.sha256` file written by `put`; then every member must match the
        checksum and size in manifest.json, and no file may be missing or extra.
        """
        path = Path(path)
        if path.is_symlink():
            raise ArtifactError(f"{path} is a symlink; the artifact store does not follow links")
        if not path.is_file():
            raise ArtifactError(f"{path}: no such build archive")
        expected = sha256 or self.registered_sha256(path)
        if expected is None:
            raise ArtifactError(f"{path}: no registered checksum to verify against")
        actual = sha256_file(path)
        if actual != expected:
            raise ArtifactError(
                f"{path}: archive checksum mismatch (registered {expected[:16]}..., "
                f"file has {actual[:16]}...); the build was modified or damaged, rebuild it"
            )
        with _open_tar(path) as tar:
            members = {m.name: m for m in _members(tar, path) if m.isfile()}
            if MANIFEST not in members:
                raise ArtifactError(f"{path}: archive holds no {MANIFEST}")
            try:
                manifest = json.load(_extract(tar, members[MANIFEST]))
                files = manifest["files"]
            except (ValueError, KeyError, TypeError) as err:
                raise ArtifactError(f"{path}: {MANIFEST} is unreadable ({err})") from None
            missing = sorted(set(files) - set(members))
            extra = sorted(set(members) - set(files) - {MANIFEST})
            if missing:
                raise ArtifactError(f"{path}: files listed in {MANIFEST} are missing: {', '.join(missing)}")
            if extra:
                raise ArtifactError(f"{path}: files not listed in {MANIFEST}: {', '.join(extra)}")
            for name, want in files.items():
                try:
                    got = _sha256_stream(_extract(tar, members[name]))
                except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
                    raise ArtifactError(f"{path}: archive is corrupt at {name} ({err})") from None
                if got != want["sha256"]:
                    raise ArtifactError(f"{path}: {name} does not match its checksum in {MANIFEST}")
        return manifest


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    f = tar.extractfile(member)
    return f if f is not None else io.BytesIO(b"")


def _normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Builds of the same content should not differ by who built them.
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
