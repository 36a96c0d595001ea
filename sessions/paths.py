"""Where Reprise keeps its files.

Each directory comes from platformdirs and can be overridden by an environment
variable, which is how tests point the app at a temporary folder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import platformdirs

APP_NAME = "Reprise"


def _dir(env_var: str, default: str) -> Path:
    override = os.environ.get(env_var)
    path = Path(override).expanduser() if override else Path(default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    """Holds the SQLite database."""
    return _dir("REPRISE_DATA_DIR", platformdirs.user_data_dir(APP_NAME))


def cache_dir() -> Path:
    """Holds KV-cache files; everything here may be deleted without losing text."""
    return _dir("REPRISE_CACHE_DIR", platformdirs.user_cache_dir(APP_NAME))


def models_dir() -> Path:
    """Holds one folder per model, each loadable by mlx-lm."""
    return _dir("REPRISE_MODELS_DIR", str(Path(platformdirs.user_data_dir(APP_NAME)) / "models"))


def log_dir() -> Path:
    """Holds the log file."""
    return _dir("REPRISE_LOG_DIR", platformdirs.user_log_dir(APP_NAME))


def log_file() -> Path:
    return log_dir() / "reprise.log"


def downloads_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the user's browser saves files (platformdirs: the XDG user folder on Linux,
    ~/Downloads on a Mac), looked in for GGUF files and never created here;
    REPRISE_DOWNLOADS_DIR overrides."""
    override = (os.environ if env is None else env).get("REPRISE_DOWNLOADS_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_downloads_dir())
