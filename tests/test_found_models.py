"""Models other tools keep here: LM Studio's folder, Ollama's store, the Hugging Face cache.

Each test builds the tool's real layout in tmp_path (tiny real GGUFs, a tiny MLX model
saved as a cache snapshot of links to blobs) and the hostile variants a user's disk
can hold; nothing about the filesystem is faked.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from tool_folders import REVISION, downloads_tree, hf_tree, lmstudio_tree, ollama_tree

import tiny
from app.engine import found, models
from app.engine.gguf_import import import_gguf
from app.engine.loading import load


@pytest.fixture
def places(tmp_path, tiny_model_dir) -> found.Locations:
    return found.Locations(
        lmstudio=(lmstudio_tree(tmp_path / "lms", tiny_model_dir),),
        ollama=ollama_tree(tmp_path / "ollama"),
        huggingface=hf_tree(tmp_path / "hub", tiny_model_dir),
    )


def reasons(discovery: found.Discovery) -> dict[str, str]:
    """Each skipped entry's reason, by file name (a cache snapshot: by its repository)."""
    named = {}
    for s in discovery.skipped:
        repos = [part for part in s.path.parts if part.startswith("models--")]
        named[repos[0] if repos else s.path.name] = s.reason
    return named


def test_each_tool_s_models_are_found_with_source_kind_and_size(places):
    discovery = found.discover(places)
    by_label = {f.label: f for f in discovery.found}
    assert sorted(by_label) == [
        "lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf",
        "mlx-community/Tiny-MLX",
        "mlx-community/tiny-4bit",
        "someone/Linked-GGUF/Linked-Q4_0.gguf",
        "tiny:latest",
    ]
    gguf = by_label["lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf"]
    assert (gguf.source, gguf.kind, gguf.name) == (found.LMSTUDIO, found.GGUF, "Tiny-Q8_0")
    assert gguf.size_bytes == gguf.path.stat().st_size
    ollama = by_label["tiny:latest"]
    assert (ollama.source, ollama.kind, ollama.name) == (found.OLLAMA, found.GGUF, "tiny:latest")
    assert ollama.path.parent == places.ollama / "blobs"
    hub = by_label["mlx-community/tiny-4bit"]
    assert (hub.source, hub.kind, hub.name) == (found.HUGGING_FACE, found.MLX, "tiny-4bit")
    assert hub.path.name == REVISION
    weights = (hub.path / "model.safetensors").stat().st_size
    assert hub.size_bytes > weights  # the blobs' bytes, not the links'
    assert by_label["mlx-community/Tiny-MLX"].kind == found.MLX


def test_what_cannot_be_used_is_skipped_with_its_reason(places):
    skipped = reasons(found.discover(places))
    assert "vision projector" in skipped["mmproj-Tiny-F16.gguf"]
    assert "split GGUF" in skipped["Big-00001-of-00002.gguf"]
    assert skipped["notes.gguf"] == "not a GGUF file"
    assert "link to nowhere" in skipped["gone.gguf"]
    assert "symbolic links" in skipped["self.gguf"]
    assert skipped["pipe.gguf"] == "not a regular file"
    assert skipped["pipe"] == "manifest is not a regular file"
    assert "could not be read" in skipped["json"]
    assert skipped["list"] == "manifest names no model layer"
    assert "missing" in skipped[f"sha256-{'d' * 64}"]
    assert "not a sha256 digest" in skipped["escape"]
    assert skipped[f"sha256-{'e' * 64}"] == "not a GGUF file"
    assert skipped["models--google--bert-tiny"] == "model type 'bert' is not one mlx-lm runs"
    assert "unfinished download" in skipped["models--org--partial"]
    assert skipped["models--org--empty"] == "no downloaded snapshot"


def test_a_found_gguf_imports_and_an_mlx_folder_is_used_in_place(places, tmp_path):
    library = tmp_path / "library"
    discovery = found.discover(places)
    ollama = found.find("tiny:latest", discovery)
    imported = import_gguf(ollama.path, library, ollama.name)
    hub = found.find("mlx-community/tiny-4bit", discovery)
    linked = models.link_folder(hub.path, library, hub.name)

    listed = {m.name: m for m in models.list_models(library)}
    assert sorted(listed) == ["tiny-4bit", "tiny:latest"]
    assert listed["tiny-4bit"].in_place == hub.path.resolve()
    assert listed["tiny-4bit"].source == "in place"
    assert listed["tiny:latest"].context_length == 2048
    assert "2,048 tokens of context" in listed["tiny:latest"].weights
    assert "F16" in listed["tiny:latest"].weights  # what the GGUF held, kept on import
    assert models.resolve("tiny-4bit", library) == linked
    loaded = load(models.resolve("tiny-4bit", library))
    assert loaded.name == "tiny-4bit"
    assert loaded.tokenizer.encode("the theme", add_special_tokens=False)

    # Found again, both are marked as installed.
    again = found.discover(places, models.list_models(library)).found
    again = {f.label: f.installed_as for f in again}
    assert again["tiny:latest"] == "tiny:latest" and again["mlx-community/tiny-4bit"] == "tiny-4bit"
    assert imported.path.is_dir()


def installed_as(places: found.Locations, library: Path) -> dict[str, str]:
    discovery = found.discover(places, models.list_models(library))
    return {f.label: f.installed_as for f in discovery.found}


def test_a_gguf_imported_under_another_name_is_marked_installed(places, tmp_path):
    """First start imports LM Studio's starter file as "SmolLM2-135M-Instruct", not as
    the file's name: the found list knows the file by what was imported from it."""
    library = tmp_path / "library"
    label = "lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf"
    gguf = found.find(label, found.discover(places))
    import_gguf(gguf.path, library, "My tiny")

    again = installed_as(places, library)
    assert again[label] == "My tiny"
    assert again["tiny:latest"] == ""  # another file: not installed

    # Another file of the same name (a new download of that quantization) is not that model.
    with gguf.path.open("ab") as f:
        f.write(b"\0" * 64)
    assert installed_as(places, library)[label] == ""


@pytest.mark.parametrize("size", ["missing", None, [1, 2], "123", 1.5, True, -1])
def test_an_import_that_kept_no_usable_size_marks_no_file_installed(places, tmp_path, size):
    """Review: generic names (`model.gguf`) are shared across publishers, and older
    imports kept only the name; config.json is anyone's to write."""
    library = tmp_path / "library"
    label = "lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf"
    gguf = found.find(label, found.discover(places))
    imported = import_gguf(gguf.path, library, "My tiny")
    config = json.loads((imported.path / "config.json").read_text())
    config["reprise"].pop("gguf_bytes")
    if size != "missing":
        config["reprise"]["gguf_bytes"] = size
    (imported.path / "config.json").write_text(json.dumps(config))
    assert installed_as(places, library)[label] == ""


def test_gguf_files_at_the_top_of_downloads_are_found(tmp_path):
    """New-user walk: first start found the starter in ~/Downloads; this list did not."""
    nowhere = tmp_path / "none"
    downloads = downloads_tree(tmp_path / "Downloads")
    discovery = found.discover(found.Locations((), nowhere, nowhere, (downloads,)))
    assert [(f.label, f.source, f.kind) for f in discovery.found] == [
        ("Tiny-Q4_0.gguf", found.DOWNLOADS, found.GGUF)
    ]
    assert reasons(discovery) == {
        "mmproj-Tiny-F16.gguf": "a vision projector, not a language model",
        "notes.gguf": "not a GGUF file",
        "pipe.gguf": "not a regular file",
    }
    assert found.Locations.from_environment({}, tmp_path).downloads == (downloads,)


def test_downloads_spends_its_budget_on_gguf_files_and_skips_names_that_are_not_text(tmp_path):
    """Review: 50,000 other files used the walk's budget before a GGUF sorting after
    them; a name of bytes that are not UTF-8 was listed, and could not be imported."""
    nowhere = tmp_path / "none"
    downloads = tmp_path / "Downloads"
    downloads.mkdir()
    for i in range(300):
        (downloads / f"a{i:04d}.txt").write_text("x")
    tiny.write_gguf(downloads / "z-last.gguf")
    odd = os.fsencode(downloads) + b"/caf\xe9-model.gguf"
    with open(odd, "wb") as f:
        f.write(b"GGUF" + bytes(28))
    places = found.Locations((), nowhere, nowhere, (downloads,))
    discovery = found.discover(places, max_entries=100)
    assert [f.label for f in discovery.found] == ["z-last.gguf"]
    assert any("not valid text" in s.reason for s in discovery.skipped)


def test_deleting_a_model_used_in_place_keeps_the_cache_s_files(places, tmp_path):
    library = tmp_path / "library"
    hub = found.find("mlx-community/tiny-4bit", found.discover(places))
    before = sorted(p.name for p in (hub.path.parents[1] / "blobs").iterdir())
    models.link_folder(hub.path, library, "tiny")
    models.delete("tiny", library)
    assert models.list_models(library) == []
    assert sorted(p.name for p in (hub.path.parents[1] / "blobs").iterdir()) == before
    assert (hub.path / "config.json").is_file()


def test_a_folder_that_is_no_model_is_refused_clearly(tmp_path, places):
    (tmp_path / "photos").mkdir()
    with pytest.raises(models.NotAModel, match="no readable config"):
        models.link_folder(tmp_path / "photos", tmp_path / "library", "photos")
    hub = found.find("mlx-community/tiny-4bit", found.discover(places))
    models.link_folder(hub.path, tmp_path / "library", "tiny")
    with pytest.raises(models.UserError, match="already exists"):
        models.link_folder(hub.path, tmp_path / "library", "tiny")
    with pytest.raises(models.UserError, match="not a usable model name: a model's name is"):
        models.link_folder(hub.path, tmp_path / "library", "../tiny")  # and it says what is


def test_a_cache_folder_removed_later_frees_its_name(places, tmp_path):
    library = tmp_path / "library"
    hub = found.find("mlx-community/tiny-4bit", found.discover(places))
    copy = shutil.copytree(hub.path, tmp_path / "moved", symlinks=False)
    models.link_folder(copy, library, "tiny")
    shutil.rmtree(copy)
    assert models.list_models(library) == []
    models.link_folder(hub.path, library, "tiny")
    assert [m.name for m in models.list_models(library)] == ["tiny"]


def test_a_huge_folder_is_walked_only_so_far(tmp_path):
    root = tmp_path / "lms"
    for i in range(50):
        (root / f"publisher{i:02}" / "repo").mkdir(parents=True)
    places = found.Locations((root,), tmp_path / "none", tmp_path / "none")
    discovery = found.discover(places, max_entries=20)
    assert discovery.found == []
    assert "stopped looking after 20 entries" in discovery.skipped[-1].reason


def test_locations_follow_each_tool_s_conventions(tmp_path):
    home = tmp_path / "home"
    default = found.Locations.from_environment({}, home)
    assert default.ollama == home / ".ollama/models"
    assert default.huggingface == home / ".cache/huggingface/hub"
    assert home / ".lmstudio/models" in default.lmstudio
    assert home / ".cache/lm-studio/models" in default.lmstudio

    (home / ".lmstudio").mkdir(parents=True)
    (home / ".lmstudio/settings.json").write_text(json.dumps({"downloadsFolder": "/srv/llms"}))
    assert Path("/srv/llms") in found.Locations.from_environment({}, home).lmstudio
    (home / ".lmstudio/settings.json").write_text("{broken")
    assert found.Locations.from_environment({}, home).lmstudio[0] == home / ".lmstudio/models"

    env = {"OLLAMA_MODELS": "/o", "HF_HOME": "/h", "REPRISE_LMSTUDIO_MODELS": "/l"}
    custom = found.Locations.from_environment(env, home)
    assert (custom.lmstudio, custom.ollama, custom.huggingface) == (
        (Path("/l"),),
        Path("/o"),
        Path("/h/hub"),
    )
    hub_cache = found.Locations.from_environment(env | {"HF_HUB_CACHE": "/c"}, home)
    assert hub_cache.huggingface == Path("/c")


def test_the_terminal_lists_found_models_and_adds_them_by_name(app_dirs, tiny_model_dir):
    from test_cli import reprise

    hf_tree(app_dirs["hf-hub"], tiny_model_dir)
    ollama_tree(app_dirs["ollama"])
    listed = reprise("models", "found")
    assert listed.returncode == 0, listed.stderr
    assert "reprise models import-gguf 'tiny:latest'" in listed.stdout
    assert "reprise models use 'mlx-community/tiny-4bit'" in listed.stdout
    assert "not a sha256 digest" in listed.stderr  # skipped entries, with why

    imported = reprise("models", "import-gguf", "tiny:latest")
    assert imported.returncode == 0, imported.stderr
    used = reprise("models", "use", "mlx-community/tiny-4bit")
    assert used.returncode == 0, used.stderr
    assert "nothing was copied" in used.stdout
    unknown = reprise("models", "use", "no-such-model")
    assert unknown.returncode == 1 and "no MLX model found by that name" in unknown.stderr
    assert "Traceback" not in unknown.stderr

    installed = json.loads(reprise("models", "list", "--json").stdout)
    assert {m["name"]: m["source"] for m in installed} == {
        "tiny-4bit": "in place",
        "tiny:latest": "gguf",
    }
    found_again = json.loads(reprise("models", "found", "--json").stdout)["found"]
    assert {f["installed_as"] for f in found_again} == {"tiny-4bit", "tiny:latest"}


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_entries_are_skipped_not_raised(places):
    manifest = places.ollama / "manifests/registry.ollama.ai/library/tiny/latest"
    config = places.huggingface / "models--mlx-community--tiny-4bit/blobs"
    manifest.chmod(0)
    config.chmod(0)
    try:
        discovery = found.discover(places)
    finally:
        manifest.chmod(0o644)
        config.chmod(0o755)
    skipped = reasons(discovery)
    assert "could not be read" in skipped["latest"]
    assert skipped["models--mlx-community--tiny-4bit"] == "no readable config.json"
    assert "tiny:latest" not in {f.label for f in discovery.found}


def test_a_used_folder_s_odd_config_is_listed_not_raised(tmp_path, tiny_model_dir):
    folder = shutil.copytree(tiny_model_dir, tmp_path / "odd")
    config = json.loads((folder / "config.json").read_text())
    odd = {"quantization": True, "reprise": "x", "max_position_embeddings": "big"}
    (folder / "config.json").write_text(json.dumps(config | odd))
    models.link_folder(folder, tmp_path / "library", "odd")
    [info] = models.list_models(tmp_path / "library")
    assert (info.quantization, info.context_length, info.source) == ("unknown", None, "in place")
    assert info.weights.startswith("unknown, 0.")
