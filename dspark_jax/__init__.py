"""dspark_jax: DSpark speculative decoding in JAX."""

from dspark_jax.cache import ContextCache, context_mask, fill_context, init_context_cache, write_context
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.draft import Borrowed, Calibration, ConfidenceHead, DSparkDraft
from dspark_jax.markov import GatedMarkovHead, MarkovHead, RNNMarkovHead, VanillaMarkovHead, markov_walk

__all__ = [
    "Borrowed",
    "Calibration",
    "ConfidenceHead",
    "ContextCache",
    "DSparkDraft",
    "DraftConfig",
    "GatedMarkovHead",
    "MarkovHead",
    "RNNMarkovHead",
    "TargetConfig",
    "VanillaMarkovHead",
    "context_mask",
    "fill_context",
    "init_context_cache",
    "markov_walk",
    "write_context",
]
