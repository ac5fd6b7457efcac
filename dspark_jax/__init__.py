"""dspark_jax: DSpark speculative decoding in JAX.

Public names are re-exported here and imported lazily, so ``import dspark_jax`` stays
cheap and the command line pays only for the subcommand it runs::

    from dspark_jax import propose, DraftConfig, DSparkDraft
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> defining module
_EXPORTS = {
    # configuration
    "DraftConfig": "dspark_jax.config",
    "TargetConfig": "dspark_jax.config",
    # modules
    "RMSNorm": "dspark_jax.layers",
    "Attention": "dspark_jax.layers",
    "MLP": "dspark_jax.layers",
    "DecoderLayer": "dspark_jax.layers",
    "rope": "dspark_jax.layers",
    "attend": "dspark_jax.layers",
    "MarkovHead": "dspark_jax.markov",
    "VanillaMarkovHead": "dspark_jax.markov",
    "GatedMarkovHead": "dspark_jax.markov",
    "RNNMarkovHead": "dspark_jax.markov",
    "make_markov_head": "dspark_jax.markov",
    "markov_walk": "dspark_jax.markov",
    "Borrowed": "dspark_jax.draft",
    "Calibration": "dspark_jax.draft",
    "ConfidenceHead": "dspark_jax.draft",
    "DSparkDraft": "dspark_jax.draft",
    # context cache
    "ContextCache": "dspark_jax.cache",
    "init_context_cache": "dspark_jax.cache",
    "write_context": "dspark_jax.cache",
    "context_mask": "dspark_jax.cache",
    "fill_context": "dspark_jax.cache",
    # sampling and proposal (issue 3)
    "TOP_K_ALL": "dspark_jax.sampling",
    "TOP_K_MAX": "dspark_jax.sampling",
    "MIN_TEMPERATURE": "dspark_jax.sampling",
    "sample_step": "dspark_jax.sampling",
    "greedy_step": "dspark_jax.sampling",
    "greedy_rows": "dspark_jax.sampling",
    "row_keys": "dspark_jax.sampling",
    "DraftBlock": "dspark_jax.proposal",
    "propose": "dspark_jax.proposal",
    "propose_with": "dspark_jax.proposal",
    "propose_eager": "dspark_jax.proposal",
    "validate_proposal_inputs": "dspark_jax.proposal",
    "FoldedSampling": "dspark_jax.memory_gate",
    "GateDecision": "dspark_jax.memory_gate",
    "plan_folded_sampling": "dspark_jax.memory_gate",
    "Proposer": "dspark_jax.proposer",
    "SplitRound": "dspark_jax.split_round",
    "spin_until_ready": "dspark_jax.ready",
    "PowerSampler": "dspark_jax.gpu_power",
    "CpuAwake": "dspark_jax.cpu_awake",
    "CompileCounter": "dspark_jax.proposer",
    "batch_buckets": "dspark_jax.proposer",
    # checkpoints and presets (issue 2)
    "load_draft": "dspark_jax.checkpoint",
    "save_draft": "dspark_jax.checkpoint",
    "load_preset": "dspark_jax.presets",
    "list_presets": "dspark_jax.presets",
    # target
    "KVCache": "dspark_jax.target",
    "Target": "dspark_jax.target",
    "Qwen3Target": "dspark_jax.target",
    # target checkpoints, verification, commit, generation (issue 4)
    "load_target": "dspark_jax.target",
    "save_target": "dspark_jax.target",
    "check_pair": "dspark_jax.target",
    "accept": "dspark_jax.verification",
    "accept_with_noise": "dspark_jax.verification",
    "apply_top_k_top_p": "dspark_jax.verification",
    "target_probs": "dspark_jax.verification",
    "required_filter_width": "dspark_jax.verification",
    "sample_tokens": "dspark_jax.verification",
    "schedule_verify_lengths": "dspark_jax.verification",
    "commit": "dspark_jax.cache",
    "prefill": "dspark_jax.cache",
    "generate": "dspark_jax.generation",
    "speculative_generate": "dspark_jax.generation",
    "GenerationResult": "dspark_jax.generation",
    "verify_widths": "dspark_jax.generation",
    "measure_verify_schedule": "dspark_jax.generation",
    "VERIFY_RULES": "dspark_jax.generation",
    "fit_sts_temperature": "dspark_jax.calibration",
    "StsFit": "dspark_jax.calibration",
    # tokenizer, corpus, training, evaluation, bundled pair (issue 5)
    "Tokenizer": "dspark_jax.tokenizer",
    "train_bpe": "dspark_jax.tokenizer",
    "load_tokenizer": "dspark_jax.tokenizer",
    "Corpus": "dspark_jax.corpus",
    "load_corpus": "dspark_jax.corpus",
    "encode_documents": "dspark_jax.corpus",
    "DraftTrainConfig": "dspark_jax.draft_training",
    "TrainResult": "dspark_jax.training",
    "train_draft": "dspark_jax.draft_training",
    "draft_loss": "dspark_jax.draft_training",
    "evaluate_draft": "dspark_jax.draft_training",
    "distillation_data": "dspark_jax.draft_training",
    "default_draft_config": "dspark_jax.draft_training",
    "check_draft_fits": "dspark_jax.draft_training",
    "TargetTrainConfig": "dspark_jax.target_training",
    "train_target": "dspark_jax.target_training",
    "measure_tau": "dspark_jax.evaluate",
    "compare_drafts": "dspark_jax.evaluate",
    "heldout_prompts": "dspark_jax.evaluate",
    "load_bundled": "dspark_jax.bundled",
    # performance (issue 6): the draft's copy-free context attention
    "attend_with_context": "dspark_jax.layers",
    "attend_block": "dspark_jax.attention_kernel",
    "context_attention": "dspark_jax.attention_kernel",
    "ATTENTION_ENV": "dspark_jax.attention_kernel",
    # the greedy-only walk's kernels (note 49)
    "GREEDY_ENV": "dspark_jax.greedy_kernel",
    "GreedyTuning": "dspark_jax.greedy_kernel",
    # the draft MLP's gate/up projections and SwiGLU in one kernel at small batches (note 69)
    "MLP_ENV": "dspark_jax.mlp_kernel",
    "MlpTuning": "dspark_jax.mlp_kernel",
    "swiglu": "dspark_jax.mlp_kernel",
    # the backbone pieces' GEMM library per batch (note 53)
    "BACKBONE_GEMM_ENV": "dspark_jax.split_round",
    "backbone_compile_options": "dspark_jax.split_round",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
