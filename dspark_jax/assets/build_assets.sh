#!/usr/bin/env bash
# Rebuilds the bundled pair from scratch: tokenizer + target, then the DSpark draft and the
# DFlash-style draft (trained the same way, in parallel on one GPU, each on the corpus plus
# 8192 sequences the target generated itself), then the held-out eval.
#
#   PYTHONPATH=. bash dspark_jax/assets/build_assets.sh OUT_DIR   # a new folder: the trainers refuse to overwrite a model
#
# Step counts and batch sizes can be overridden through the environment (the defaults are
# the ones used for the shipped weights). Everything is built from the running Python's
# standard library, so the corpus exists offline on every machine.
set -euo pipefail
OUT=${1:?usage: build_assets.sh OUT_DIR}
PY=${PYTHON:-python3}
TARGET_STEPS=${TARGET_STEPS:-2500}
TARGET_BATCH=${TARGET_BATCH:-64}
DRAFT_STEPS=${DRAFT_STEPS:-4500}
DRAFT_BATCH=${DRAFT_BATCH:-32}
DRAFT_ANCHORS=${DRAFT_ANCHORS:-64}
SEQ_LEN=${SEQ_LEN:-256}
DRAFT_LR=${DRAFT_LR:-1e-3}
DISTILL=${DISTILL:-8192}
TARGET_SECONDS=${TARGET_SECONDS:-80}
DRAFT_SECONDS=${DRAFT_SECONDS:-95}
EVAL_PROMPTS=${EVAL_PROMPTS:-64}
EVAL_NEW=${EVAL_NEW:-128}
mkdir -p "$OUT"

# --max-seconds is a safety net for a fixed device budget; training.json records steps_done.
$PY -m dspark_jax.cli train-target --out "$OUT/target" --steps "$TARGET_STEPS" --batch "$TARGET_BATCH" \
  --seq-len "$SEQ_LEN" --max-seconds "$TARGET_SECONDS"

# Where the Hugging Face libraries are installed, check that they read the target and the
# tokenizer as dspark_jax does (on the CPU, beside the draft training).
JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES= $PY - "$OUT/target" >"$OUT/hf_check.log" 2>&1 <<'PYEOF' &
import sys

import numpy as np

from dspark_jax.corpus import load_corpus
from dspark_jax.tokenizer import load_tokenizer

path = sys.argv[1]
tok = load_tokenizer(path)
text = load_corpus().texts("heldout")[0][:20000]
ids = tok.encode(text)
try:
    import tokenizers

    hf = tokenizers.Tokenizer.from_file(path + "/tokenizer.json")
    print("tokenizers", tokenizers.__version__, "encode equal:", hf.encode(text).ids == ids, len(ids))
    print("tokenizers decode equal:", hf.decode(ids, skip_special_tokens=False) == text)
except Exception as e:
    print("tokenizers check failed:", repr(e))
try:
    import jax.numpy as jnp
    import torch
    import transformers

    from dspark_jax.target import load_target

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    x = ids[:128]
    with torch.no_grad():
        ref = model(torch.tensor([x])).logits.numpy()
    target = load_target(path, dtype="float32")
    logits, _, _ = target(jnp.asarray([x]), jnp.arange(len(x))[None], target.init_cache(1, len(x)))
    diff = float(np.abs(np.asarray(logits) - ref).max())
    print("transformers", transformers.__version__, "Qwen3 max |logit diff|:", diff)
except Exception as e:
    print("transformers check failed:", repr(e))
PYEOF

# Two processes share the GPU: cap each one's memory pool.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.4}
DRAFT_ARGS=(--target "$OUT/target" --steps "$DRAFT_STEPS" --batch "$DRAFT_BATCH" --anchors "$DRAFT_ANCHORS"
  --seq-len "$SEQ_LEN" --gamma 7 --layers 2 --lr "$DRAFT_LR" --distill "$DISTILL" --max-seconds "$DRAFT_SECONDS")
$PY -m dspark_jax.cli train-draft "${DRAFT_ARGS[@]}" --out "$OUT/dspark_draft" --markov-rank 128 \
  >"$OUT/dspark_draft.log" 2>&1 &
DSPARK=$!
$PY -m dspark_jax.cli train-draft "${DRAFT_ARGS[@]}" --out "$OUT/dflash_draft" --markov-rank 0 \
  >"$OUT/dflash_draft.log" 2>&1 &
DFLASH=$!
wait "$DSPARK"
wait "$DFLASH"
wait
tail -c 3000 "$OUT/dspark_draft.log" "$OUT/dflash_draft.log"
cat "$OUT/hf_check.log"
rm -rf "$OUT/target/checkpoint" "$OUT/dspark_draft/checkpoint" "$OUT/dflash_draft/checkpoint"

$PY -m dspark_jax.cli eval --target "$OUT/target" --draft "$OUT/dspark_draft" \
  --baseline-draft "$OUT/dflash_draft" --prompts "$EVAL_PROMPTS" --max-new "$EVAL_NEW" --json "$OUT/eval.json"
