"""Named draft configurations shipped with the package.

Each preset is a DeepSpec-form ``config.json`` in ``dspark_jax/configs/`` (a copy of the
repository's top-level ``configs/``, kept identical by a test): the released
``dspark_qwen3_{4b,8b,14b}_block7`` draft shapes and a ``tiny`` one for tests and demos.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from dspark_jax.config import DraftConfig


def _folder():
    return resources.files("dspark_jax") / "configs"


def list_presets() -> list[str]:
    """The preset names, sorted."""
    return sorted(entry.name[: -len(".json")] for entry in _folder().iterdir() if entry.name.endswith(".json"))


def preset_hf_config(name: str) -> dict[str, Any]:
    """The preset's ``config.json`` dict (DeepSpec form).

    Raises:
      ValueError: ``name`` is not a preset, or its file is not valid JSON (named with
        its path).
    """
    names = list_presets()
    if name not in names:
        raise ValueError(f"preset={name!r} is unknown: must be one of {names}")
    path = _folder() / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"preset file {str(path)!r} is not valid JSON: {e}") from e


def load_preset(name: str, **overrides: Any) -> DraftConfig:
    """Builds the preset's :class:`DraftConfig`.

    Args:
      name: one of :func:`list_presets`.
      **overrides: fields to change (``dtype="bfloat16"`` for example).

    Raises:
      ValueError: as :func:`preset_hf_config`, or a bad override.
    """
    return DraftConfig.from_hf_config(preset_hf_config(name), **overrides)
