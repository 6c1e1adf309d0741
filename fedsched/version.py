"""The package version (``fedsched --version``, ``SystemService.GetStatus``)."""

from __future__ import annotations

import functools
import tomllib
from importlib import metadata
from pathlib import Path


@functools.cache
def package_version() -> str:
    """The installed distribution's version; from a source checkout (not installed), the
    ``version`` of ``pyproject.toml`` beside the package; ``"unknown"`` if neither says."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():  # a checkout: the file being run is the truth, not an older install
        try:
            return str(tomllib.loads(pyproject.read_text())["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            pass
    try:
        return metadata.version("fedsched")
    except metadata.PackageNotFoundError:
        return "unknown"
