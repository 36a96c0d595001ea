"""A hub that lies or fails mid-download (app/engine/incoming.py): each is refused in
words, as it happens, and nothing is kept."""

from __future__ import annotations

import shutil

import pytest
from hub_server import FakeHub, Misbehaviour

from app.engine import download, incoming
from app.engine.download import DownloadError, download_model

WEIGHTS = "model.safetensors"


@pytest.fixture
def hub_repo(tiny_model_dir, tmp_path):
    folder = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def fetch(hub_repo, tmp_path, **misbehaviour: Misbehaviour) -> FakeHub:
    """Download the repo from a hub that does `misbehaviour`; the hub, afterwards."""
    hub = FakeHub({"someone/tiny": hub_repo}, misbehaviour=misbehaviour)
    with hub:
        download_model("someone/tiny", tmp_path / "models", endpoint=hub.endpoint)
    return hub


def nothing_kept(tmp_path) -> bool:
    models = tmp_path / "models"
    return not models.exists() or list(models.iterdir()) == []


def test_a_file_larger_than_the_hub_listed_is_stopped_as_it_grows(hub_repo, tmp_path):
    """Before, the bytes went on until the server stopped; only then was the size
    compared. Here the hub sends 256 MiB past the weights' listed size."""
    listed = (hub_repo / WEIGHTS).stat().st_size
    hub = FakeHub({"someone/tiny": hub_repo}, misbehaviour={WEIGHTS: Misbehaviour(extra=256 << 20)})
    with hub, pytest.raises(DownloadError, match="larger than the server said"):
        download_model("someone/tiny", tmp_path / "models", endpoint=hub.endpoint)
    assert nothing_kept(tmp_path)
    # What the hub got out before the download hung up: the file, and what the
    # loopback's buffers hold, far from the 256 MiB it meant to send.
    assert hub.sent.counts[WEIGHTS] < listed + (32 << 20)


def test_a_file_the_hub_gave_no_size_may_not_outgrow_the_disk(hub_repo, tmp_path, monkeypatch):
    """With no size listed, the cap is the disk's room: here the reserve leaves room for
    the weights and 8 MiB more, and the hub sends 256 MiB more."""
    weights = (hub_repo / WEIGHTS).stat().st_size
    free = shutil.disk_usage(tmp_path).free
    monkeypatch.setattr(download, "RESERVE_BYTES", free - weights - (8 << 20))
    bad = Misbehaviour(unlisted=True, extra=256 << 20)
    with pytest.raises(DownloadError, match=f"{WEIGHTS} is larger than"):
        fetch(hub_repo, tmp_path, **{WEIGHTS: bad})
    assert nothing_kept(tmp_path)


def test_a_model_that_does_not_fit_on_the_disk_is_refused_before_its_first_byte(
    hub_repo, tmp_path, monkeypatch
):
    free = shutil.disk_usage(tmp_path).free
    monkeypatch.setattr(download, "RESERVE_BYTES", free - 1000)
    hub = FakeHub({"someone/tiny": hub_repo})
    with hub, pytest.raises(DownloadError, match="Not enough disk space for this model"):
        download_model("someone/tiny", tmp_path / "models", endpoint=hub.endpoint)
    assert not [r for r in hub.requests if "/resolve/" in r]
    assert nothing_kept(tmp_path)


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (Misbehaviour(stall_after=1 << 16), "timed out"),
        (Misbehaviour(close_after=1 << 16), "broke off|arrived incomplete"),
        (Misbehaviour(missing=True), "answered 404"),
    ],
    ids=["stalls", "closes", "404"],
)
def test_a_line_that_fails_mid_file_is_said_in_words(hub_repo, tmp_path, monkeypatch, bad, said):
    """A stalled read escaped as TimeoutError, which the window called a bug."""
    monkeypatch.setattr(incoming, "READ_TIMEOUT_S", 0.5)
    with pytest.raises(DownloadError, match=said) as got:
        fetch(hub_repo, tmp_path, **{WEIGHTS: bad})
    assert WEIGHTS in str(got.value)
    assert nothing_kept(tmp_path)


@pytest.mark.parametrize(
    "size",
    [float("nan"), -(64 << 20), "300", True, 10**400],
    ids=["NaN", "negative", "text", "true", "10**400"],
)
def test_a_listing_with_sizes_that_are_not_counts_is_refused_before_the_first_byte(
    hub_repo, tmp_path, size
):
    """A review: a NaN size made the room check and the cap always pass (64 MiB went
    into 4 MiB of room); a negative one cancelled out a huge one."""
    hub = FakeHub({"someone/tiny": hub_repo}, misbehaviour={WEIGHTS: Misbehaviour(listed=size)})
    with hub, pytest.raises(DownloadError, match=r"its list of .* files could not be read"):
        download_model("someone/tiny", tmp_path / "models", endpoint=hub.endpoint)
    assert not [r for r in hub.requests if "/resolve/" in r]
    assert nothing_kept(tmp_path)


def test_a_file_cut_short_is_refused_also_when_no_size_was_listed(hub_repo, tmp_path, monkeypatch):
    """A review: with no size listed, a file whose line closed early was kept as whole;
    its Content-Length says what was meant to come."""
    bad = Misbehaviour(unlisted=True, close_after=1 << 16)
    with pytest.raises(DownloadError, match=f"{WEIGHTS} arrived incomplete"):
        fetch(hub_repo, tmp_path, **{WEIGHTS: bad})
    assert nothing_kept(tmp_path)


def test_progress_never_passes_its_total_when_sizes_are_missing(hub_repo, tmp_path):
    seen = []
    misbehaviour = {WEIGHTS: Misbehaviour(unlisted=True)}
    with FakeHub({"someone/tiny": hub_repo}, misbehaviour=misbehaviour) as hub:
        download_model(
            "someone/tiny",
            tmp_path / "models",
            endpoint=hub.endpoint,
            progress=lambda done, total, _file: seen.append((done, total)),
        )
    assert all(done <= total for done, total in seen), seen
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # never back
    assert seen[-1][0] == sum(f.stat().st_size for f in (tmp_path / "models" / "tiny").iterdir())


@pytest.mark.parametrize("host", ["127.0.0.2", "127.0.0.1"], ids=["host", "port"])
def test_the_hub_token_goes_to_no_other_server_on_a_redirect(hub_repo, tmp_path, monkeypatch, host):
    """Reviews: urllib copied `Authorization: Bearer hf_…` onto a redirect to another
    host (the hub sends its files on to a CDN's), then the fix kept it for another port
    of the same host. The redirect's own body, here 256 MiB, is not read (urllib read
    it whole into memory, deaf to Cancel)."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_0123456789")
    with FakeHub({"someone/tiny": hub_repo}, host=host) as elsewhere:
        sent_on = Misbehaviour(redirect_to=elsewhere.endpoint, redirect_body=256 << 20)
        hub = fetch(hub_repo, tmp_path, **{WEIGHTS: sent_on})
    assert hub.requests and all(a and a.startswith("Bearer hf_") for a in hub.authorizations)
    assert elsewhere.requests and elsewhere.authorizations == [None]
    assert (tmp_path / "models" / "tiny" / WEIGHTS).is_file()
    assert hub.sent.counts["redirect"] < 32 << 20


def test_cancel_during_a_stalled_line_is_said_as_cancelled(hub_repo, tmp_path, monkeypatch):
    """A review: Cancel pressed while the hub sent nothing was said, once the read timed
    out, as "no connection … check this computer's internet connection"."""
    monkeypatch.setattr(incoming, "READ_TIMEOUT_S", 0.5)
    cancelled_when_it_stalls(hub_repo, tmp_path, WEIGHTS, Misbehaviour(stall_after=0))


def test_cancel_while_the_last_file_s_end_is_awaited_keeps_nothing(hub_repo, tmp_path):
    """A review: the last read, waiting on a slow close, ended the loop without a look
    at Cancel, and the model was put in place although Cancel had been pressed."""
    last = "tokenizer_config.json"  # the listing's last file
    slow_close = Misbehaviour(unlisted=True, no_length=True, linger_s=1.0)
    cancelled_when_it_stalls(hub_repo, tmp_path, last, slow_close)


def cancelled_when_it_stalls(hub_repo, tmp_path, name: str, bad: Misbehaviour) -> None:
    """Cancel pressed once the hub stops sending `name`: cancelled, nothing kept."""
    hub = FakeHub({"someone/tiny": hub_repo}, misbehaviour={name: bad})
    with hub, pytest.raises(download.DownloadCancelled):
        download_model(
            "someone/tiny",
            tmp_path / "models",
            endpoint=hub.endpoint,
            should_cancel=hub.stalled.is_set,
        )
    assert nothing_kept(tmp_path)


@pytest.mark.parametrize(
    "odd",
    ["\ud800.safetensors", "a\nb.safetensors", "\u202etxt.safetensors", "", ".safetensors"],
    ids=["lone surrogate", "line end", "bidi override", "empty", "hidden"],
)
def test_a_listed_name_no_file_should_have_is_left_out(hub_repo, tmp_path, odd):
    """A review: a lone surrogate passed, then failed the file's address as "a bug"."""
    more = [{"rfilename": odd, "size": 10}]
    with FakeHub({"someone/tiny": hub_repo}, more_listed=more) as hub:
        path = download_model("someone/tiny", tmp_path / "models", endpoint=hub.endpoint)
    assert WEIGHTS in [f.name for f in path.iterdir()] and len(list(path.iterdir())) == 4


@pytest.mark.parametrize("sha", [123, ["a"], "not-hex", "\ud800" * 40])
def test_a_revision_of_the_wrong_shape_is_refused_in_words(hub_repo, tmp_path, sha):
    hub = FakeHub({"someone/tiny": hub_repo}, sha=sha)
    with hub, pytest.raises(DownloadError, match="could not be read"):
        download_model("someone/tiny", tmp_path / "models", endpoint=hub.endpoint)
    assert nothing_kept(tmp_path)


def test_a_link_to_a_folder_gone_by_the_model_s_name_is_refused_before_downloading(
    hub_repo, tmp_path
):
    """A review: a model used in place whose folder went leaves a dangling link; a
    download by its name went through to the end, then failed its rename as "a bug"."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny").symlink_to(tmp_path / "gone")
    hub = FakeHub({"someone/tiny": hub_repo})
    with hub, pytest.raises(DownloadError, match="A model named 'tiny' already exists"):
        download_model("someone/tiny", models, endpoint=hub.endpoint)
    assert not [r for r in hub.requests if "/resolve/" in r]
