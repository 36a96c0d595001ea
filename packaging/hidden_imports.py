"""The modules a frozen Reprise needs that PyInstaller's import scan cannot see,
shared by packaging/linux/reprise.spec and packaging/macos/reprise.spec, and
checked on Linux by tests/test_packaging.py. Plain data and PyInstaller's own
helpers only, so the specs and the test read the same lists."""

from __future__ import annotations

# mlx-lm imports a model's module by the name in its config.json
# (`mlx_lm.models.<model_type>`), and tokenizers by class name through
# transformers' lazy modules: neither is a static import.
COLLECTED_PACKAGES = ("mlx", "mlx_lm", "transformers")

# Named one by one: reached only through importlib or at run time.
HIDDEN_IMPORTS = (
    "app.engine.gguf_import",
    "app.engine.download",
    "app.ui.first_run",
    "app.ui.smoke",
    "app.ui.models_dialog",
    "app.ui.preferences",
    "app.bench.cpu_path",
    "app.bench.reopen",
    "app.bench.kv_quality",
    "app.bench.kv_speed",
    "app.commands.chat",
    "app.commands.store",
    "reprise_resources",
    "sqlite_utils",
    "markdown_it",
    "pygments.lexers",
    "pygments.formatters.html",
    "safetensors.numpy",
    "xxhash",
    "platformdirs",
    "tokenizers",
    "jinja2",
)

# Present only on macOS (the Metal build of mlx brings no extra Python modules,
# but Qt's Cocoa platform plugin and the bundle's own helpers are mac-only).
MACOS_ONLY_IMPORTS = ("PySide6.QtDBus",)  # excluded there: no D-Bus on macOS

# Never wanted: big optional back ends transformers would pull in if installed.
EXCLUDES = ("torch", "tensorflow", "jax", "flax", "tkinter", "IPython", "matplotlib")


def keep_transformers_module(name: str) -> bool:
    """Tokenizer and configuration code only: model code needs torch, which is not
    shipped, and mlx-lm asks transformers for tokenizers and configs alone."""
    parts = name.split(".")
    if name.startswith(("transformers.commands", "transformers.kernels", "transformers.cli")):
        return False
    if len(parts) >= 4 and parts[1] == "models":
        return parts[3].startswith(("configuration_", "tokenization_"))
    return True
