"""The trained tiny pair shipped in ``dspark_jax/assets`` (see ``assets/README.md``).

A Qwen3-style target (4 layers × 192, 2048-token byte-level BPE) trained on the Python
standard library, a DSpark draft (vanilla Markov head of rank 128, confidence head with
Markov input, γ = 7) and a DFlash-style draft (no Markov head) trained the same way.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dspark_jax.draft import DSparkDraft
    from dspark_jax.target import Qwen3Target
    from dspark_jax.tokenizer import Tokenizer

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
TARGET_DIR = os.path.join(ASSETS, "target")
DRAFT_DIRS = {"dspark": os.path.join(ASSETS, "dspark_draft"), "dflash": os.path.join(ASSETS, "dflash_draft")}


def load_bundled(draft: str = "dspark", *, dtype: str = "float32") -> tuple[Qwen3Target, DSparkDraft, Tokenizer]:
    """Loads the bundled target, one of its drafts and the tokenizer.

    Args:
      draft: ``"dspark"`` (Markov head) or ``"dflash"`` (the ablation, no Markov head).
      dtype: compute dtype (the weights are stored in float16).

    Returns:
      ``(target, draft, tokenizer)``.

    Raises:
      ValueError: an unknown ``draft`` (or, from the loaders, ``dtype``).
      TypeError: ``dtype`` is not a name (None would load the target in float16 and the
        draft in float32).
    """
    from dspark_jax.checkpoint import load_draft
    from dspark_jax.target import load_target
    from dspark_jax.tokenizer import load_tokenizer

    if not isinstance(draft, str) or draft not in DRAFT_DIRS:
        raise ValueError(f"draft={draft!r} is invalid: must be one of {sorted(DRAFT_DIRS)}")
    if not isinstance(dtype, str):  # None would mean each loader's own default: float16 and float32
        raise TypeError(f"dtype={dtype!r} is invalid: must be a dtype name such as 'float32' or 'bfloat16'")
    target = load_target(TARGET_DIR, dtype=dtype)
    return target, load_draft(DRAFT_DIRS[draft], target=target, dtype=dtype), load_tokenizer(TARGET_DIR)
