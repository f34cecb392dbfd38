"""The artifact store: layout, checksums on read, and paths and archives that try to escape it."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from tuner.artifacts import ArtifactError, ArtifactStore, safe_extract, write_manifest


def _build_dir(tmp_path: Path) -> Path:
    d = tmp_path / "build"
    (d / "kernels" / "rank0").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"config": {"tp": 1}}))
    (d / "kernels" / "rank0" / "cpp_fused_add_0.cpp").write_text('extern "C" void kernel() {}\n')
    write_manifest(d, {"torch": "x"})
    return d


def test_put_then_verify_and_open(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    path, digest, size = store.put("gpt-tiny-abc", 3, _build_dir(tmp_path))
    assert path == tmp_path / "store" / "gpt-tiny-abc" / f"3-{digest[:12]}.tar.gz"
    assert size == path.stat().st_size and len(digest) == 64
    manifest = store.verify(path)
    assert set(manifest["files"]) == {"config.json", "kernels/rank0/cpp_fused_add_0.cpp"}
    with store.open("gpt-tiny-abc", 3, sha256=digest) as f:
        assert f.read(2) == b"\x1f\x8b"  # gzip magic: the archive itself, ready to stream


def test_an_archive_is_as_readable_as_its_checksum_file(tmp_path):
    """Archives were 0600 (mkstemp's mode kept by the rename) beside a 0644 checksum: a service
    running as another user than the builder served a 200 it could not read."""
    old = os.umask(0o022)
    try:
        path, _, _ = ArtifactStore(tmp_path / "store").put("s", 1, _build_dir(tmp_path))
    finally:
        os.umask(old)
    side = path.with_suffix("").with_suffix(".sha256")
    assert oct(path.stat().st_mode & 0o777) == oct(side.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []  # no temporaries


def test_a_rebuild_of_the_same_trial_leaves_the_earlier_build_as_its_checksum_says(tmp_path):
    """Two jobs of one recipe share its study and usually its winner: the second build must not
    overwrite the first's archive, whose row and X-Checksum-Sha256 still name its bytes."""
    store = ArtifactStore(tmp_path / "store")
    first, first_sha, _ = store.put("s", 3, _build_dir(tmp_path / "a"))
    build = _build_dir(tmp_path / "b")
    (build / "config.json").write_text(json.dumps({"config": {"tp": 1}, "measured": "again"}))
    write_manifest(build, {"torch": "x"})
    second, second_sha, _ = store.put("s", 3, build)
    assert first != second and first_sha != second_sha
    assert store.verify(first, first_sha) and store.verify(second, second_sha)
    with store.open("s", 3) as newest:
        assert newest.name == str(second)


def test_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNER_ARTIFACT_DIR", str(tmp_path / "elsewhere"))
    assert ArtifactStore().path_for("s", 1) == tmp_path / "elsewhere" / "s" / "1.tar.gz"


@pytest.mark.parametrize("study", ["..", "../x", "/etc", "a/b", ".hidden", "", "a b", "x;rm", "é", "a\x00b"])
def test_study_names_that_could_escape_are_refused(tmp_path, study):
    with pytest.raises(ArtifactError, match="study name"):
        ArtifactStore(tmp_path).path_for(study, 1)


@pytest.mark.parametrize("trial", [-1, "1", 1.5, True])
def test_trial_must_be_a_plain_number(tmp_path, trial):
    with pytest.raises(ArtifactError, match="trial number"):
        ArtifactStore(tmp_path).path_for("s", trial)


def test_symlinked_study_directory_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    store = ArtifactStore(tmp_path / "store")
    store.root.mkdir()
    (store.root / "s").symlink_to(outside)
    with pytest.raises(ArtifactError, match="symlink"):
        store.put("s", 1, _build_dir(tmp_path))
    assert not list(outside.iterdir())


def test_symlink_inside_a_build_is_refused(tmp_path):
    d = _build_dir(tmp_path)
    (d / "link").symlink_to("/etc/passwd")
    with pytest.raises(ArtifactError, match="symlink"):
        write_manifest(d, {})


def test_archive_bytes_changed_is_detected(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    path, digest, _ = store.put("s", 1, _build_dir(tmp_path))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        store.verify(path, sha256=digest)


def test_member_not_matching_manifest_is_detected(tmp_path):
    """Re-packed with a changed kernel and a fresh outer checksum: the manifest still catches it."""
    store = ArtifactStore(tmp_path / "store")
    d = _build_dir(tmp_path)
    path, _, _ = store.put("s", 1, d)
    (d / "kernels" / "rank0" / "cpp_fused_add_0.cpp").write_text("tampered\n")
    with tarfile.open(path, "w:gz") as tar:
        for rel in ["manifest.json", "config.json", "kernels/rank0/cpp_fused_add_0.cpp"]:
            tar.add(d / rel, arcname=rel)
    from tuner.artifacts import sha256_file

    with pytest.raises(ArtifactError, match="cpp_fused_add_0.cpp does not match its checksum"):
        store.verify(path, sha256=sha256_file(path))


def test_truncated_archive_is_reported_not_a_traceback(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    path, _, _ = store.put("s", 1, _build_dir(tmp_path))
    path.write_bytes(path.read_bytes()[:100])
    from tuner.artifacts import sha256_file

    with pytest.raises(ArtifactError, match="corrupt|not a readable"):
        store.verify(path, sha256=sha256_file(path))


def _evil_archive(path: Path, name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = linkname
        payload = b"" if kind != tarfile.REGTYPE else b"owned\n"
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    path.write_bytes(gzip.compress(buf.getvalue()))


@pytest.mark.parametrize(
    ("name", "kind", "linkname"),
    [
        ("../escaped.txt", tarfile.REGTYPE, ""),
        ("/tmp/absolute-escape.txt", tarfile.REGTYPE, ""),
        ("kernels/../../escaped.txt", tarfile.REGTYPE, ""),
        ("link", tarfile.SYMTYPE, "/etc/passwd"),
        ("hard", tarfile.LNKTYPE, "/etc/passwd"),
    ],
)
def test_safe_extract_refuses_members_that_escape(tmp_path, name, kind, linkname):
    archive = tmp_path / "evil.tar.gz"
    _evil_archive(archive, name, kind, linkname)
    dest = tmp_path / "out"
    with pytest.raises(ArtifactError, match="refused"):
        safe_extract(archive, dest)
    assert not (tmp_path / "escaped.txt").exists()
    assert not os.path.exists("/tmp/absolute-escape.txt")
    assert not list(dest.iterdir())


def test_safe_extract_round_trip(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    path, _, _ = store.put("s", 1, _build_dir(tmp_path))
    out = safe_extract(path, tmp_path / "out")
    assert (out / "kernels" / "rank0" / "cpp_fused_add_0.cpp").read_text().startswith('extern "C"')


@pytest.mark.parametrize(
    "name", ["gpt-tiny", "my model @ v2/x", "gpt@nightly-2026-11-28-run2", "...", "é" * 200]
)
def test_every_recipe_name_gives_a_study_name_that_can_name_a_build(name):
    """A recipe's name is free text (a nightly job is `<recipe>@nightly-<night>`); the study, and so
    its build directory, must still be nameable."""
    from tuner.artifacts import check_study_name
    from tuner.recipe import recipe_from_dict
    from tuner.study import study_name

    recipe = recipe_from_dict(
        {"name": name, "model": {"layers": 1, "hidden": 8, "heads": 1, "seq_len": 2, "vocab": 2}}
    )
    assert check_study_name(study_name(recipe, {"family": "cpu"}))
