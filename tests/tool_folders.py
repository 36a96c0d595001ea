"""Other tools' model folders, built for real: LM Studio's, Ollama's, the Hugging Face cache,
and a Downloads folder.

Each holds models Reprise can use (tiny real GGUFs, the tiny MLX model as a cache
snapshot of links to blobs) beside the hostile entries a user's disk can hold.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import tiny

REVISION = "0123456789abcdef0123456789abcdef01234567"


def lmstudio_tree(root: Path, tiny_model_dir: Path) -> Path:
    repo = root / "lmstudio-community" / "Tiny-GGUF"
    repo.mkdir(parents=True)
    tiny.write_gguf(repo / "Tiny-Q8_0.gguf")
    tiny.write_gguf(repo / "mmproj-Tiny-F16.gguf")
    tiny.write_gguf(repo / "Big-00001-of-00002.gguf")
    (repo / "notes.gguf").write_text("not a model")
    (repo / "gone.gguf").symlink_to(root / "nowhere.gguf")
    (repo / "loop").symlink_to(repo)  # a folder link back up: walked once
    linked = root.parent / "elsewhere" / "Linked-GGUF"
    linked.mkdir(parents=True)
    tiny.write_gguf(linked / "Linked-Q4_0.gguf")
    (root / "someone").mkdir()
    (root / "someone" / "Linked-GGUF").symlink_to(linked)  # a repo kept elsewhere, linked in
    (repo / "self.gguf").symlink_to(repo / "self.gguf")  # a file link to itself
    os.mkfifo(repo / "pipe.gguf")  # opening it would wait for a writer forever
    shutil.copytree(tiny_model_dir, root / "mlx-community" / "Tiny-MLX")
    return root


def ollama_tree(root: Path) -> Path:
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    gguf = tiny.write_gguf(root / "tiny.gguf")
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    gguf.rename(blobs / f"sha256-{digest}")
    (blobs / f"sha256-{'e' * 64}").write_bytes(b"\x00" * 64)  # a blob that is not GGUF
    library = root / "manifests" / "registry.ollama.ai" / "library"

    def manifest(model: str, tag: str, content: str) -> None:
        (library / model).mkdir(parents=True, exist_ok=True)
        (library / model / tag).write_text(content)

    def layers(digest: str) -> str:
        model = {"mediaType": "application/vnd.ollama.image.model", "digest": digest}
        template = {"mediaType": "application/vnd.ollama.image.template", "digest": "x"}
        return json.dumps({"schemaVersion": 2, "layers": [template, model]})

    manifest("tiny", "latest", layers(f"sha256:{digest}"))
    manifest("broken", "json", "{not json")
    manifest("broken", "list", "[1, 2]")
    manifest("broken", "missing", layers(f"sha256:{'d' * 64}"))
    manifest("broken", "escape", layers("sha256:../../../../etc/passwd"))
    manifest("broken", "notgguf", layers(f"sha256:{'e' * 64}"))
    os.mkfifo(library / "broken" / "pipe")
    return root


def hf_snapshot(repo: Path, model_dir: Path, revision: str = REVISION) -> Path:
    """The hub cache's layout: files are blobs named by hash, snapshots link to them."""
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def hf_tree(hub: Path, tiny_model_dir: Path) -> Path:
    hf_snapshot(hub / "models--mlx-community--tiny-4bit", tiny_model_dir)
    bert = hf_snapshot(hub / "models--google--bert-tiny", tiny_model_dir)
    config = json.loads((bert / "config.json").read_text())
    (bert / "config.json").unlink()
    (bert / "config.json").write_text(json.dumps(config | {"model_type": "bert"}))
    partial = hf_snapshot(hub / "models--org--partial", tiny_model_dir)
    (partial / "model.safetensors").unlink()
    (partial / "model.safetensors").symlink_to("../../blobs/never-arrived")
    (hub / "models--org--empty" / "snapshots").mkdir(parents=True)
    (hub / "datasets--org--data").mkdir()
    return hub


def downloads_tree(root: Path) -> Path:
    """A browser's Downloads: a GGUF at the top, one in a folder (not looked into), and
    what else a name ending in .gguf can be."""
    root.mkdir(parents=True)
    tiny.write_gguf(root / "Tiny-Q4_0.gguf")
    (root / "unpacked").mkdir()
    tiny.write_gguf(root / "unpacked" / "Deep-Q4_0.gguf")
    (root / "notes.gguf").write_text("not a model")
    tiny.write_gguf(root / "mmproj-Tiny-F16.gguf")
    os.mkfifo(root / "pipe.gguf")
    (root / "report.pdf").write_bytes(b"%PDF")
    return root
