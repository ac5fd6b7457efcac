"""``dspark-jax calibrate``: fit a draft's STS confidence temperature on held-out text and save it.

Reads the held-out split of the standard-library corpus (:mod:`dspark_jax.corpus`) with the
target's tokenizer, fits one temperature per draft position
(:func:`~dspark_jax.calibration.fit_sts_temperature`) against the acceptance of sampling
(T = 1) or greedy decoding, prints the fit per position and writes the calibrated draft
(``config.json``, ``model.safetensors`` with ``confidence_head.sts_temperature``) and
``calibration.json`` to ``--out``. Defaults: the bundled target and DSpark draft.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax

from dspark_jax.bundled import DRAFT_DIRS, TARGET_DIR
from dspark_jax.calibration import CALIBRATION_LABELS
from dspark_jax.cli import add_save_dtype, as_flags, check_checkpoint, loading
from dspark_jax.training import COUNT, SEED, cast_params, check_output_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the ``dspark-jax calibrate`` flags."""
    parser.add_argument("--target", default=TARGET_DIR, help="target folder with tokenizer.json (default: bundled)")
    parser.add_argument("--draft", default=DRAFT_DIRS["dspark"], help="draft checkpoint (default: bundled DSpark)")
    parser.add_argument("--out", required=True, help="new folder for the calibrated draft")
    parser.add_argument(
        "--labels",
        choices=CALIBRATION_LABELS,
        default="sampling",
        help="calibrate for sampling (T = 1, the training label) or greedy decoding",
    )
    parser.add_argument("--batches", type=COUNT, default=16, help="batches of held-out windows")
    parser.add_argument("--batch-size", type=COUNT, default=8, help="windows per batch")
    parser.add_argument("--seq-len", type=COUNT, default=256, help="tokens per window (anchors every 4th)")
    parser.add_argument("--seed", type=SEED, default=1, help="window sampling seed")
    add_save_dtype(parser, "calibrated draft")


def run(args: argparse.Namespace) -> int:
    """Raises ``ValueError`` naming the flag for a bad ``--out``, ``--target`` or ``--draft``
    before anything loads, and for a draft without a confidence head before the corpus is read."""
    from dspark_jax.calibration import fit_sts_temperature
    from dspark_jax.checkpoint import load_draft, save_draft
    from dspark_jax.corpus import encode_documents, load_corpus
    from dspark_jax.target import load_target
    from dspark_jax.tokenizer import load_tokenizer

    check_output_folder(args.out, resume=False, resumable=False)
    check_checkpoint("--target", args.target, tokenizer=True)
    check_checkpoint("--draft", args.draft)
    with loading("--target", args.target):
        target = load_target(args.target, dtype="float32")
        tokenizer = load_tokenizer(args.target)
    with loading("--draft", args.draft):
        draft = load_draft(args.draft, target=target)
    if draft.confidence_head is None:
        raise ValueError(
            f"--draft {args.draft!r} has no confidence head (enable_confidence_head=False): nothing to calibrate"
        )
    corpus = load_corpus()
    print(f"encoding {len(corpus.texts('heldout'))} held-out files …", file=sys.stderr)
    heldout = encode_documents(tokenizer, corpus.texts("heldout"))
    with as_flags({"seq_len": "--seq-len", "batches": "--batches", "batch_size": "--batch-size"}):
        fit = fit_sts_temperature(
            draft,
            target,
            heldout,
            labels=args.labels,
            batches=args.batches,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            seed=args.seed,
        )
    print(f"STS fit on {fit.blocks} held-out blocks, {fit.labels} labels:")
    print("| position | temperature | BCE before | BCE after | predicted | observed |")
    print("|---|---|---|---|---|---|")
    for k, row in enumerate(
        zip(fit.temperatures, fit.bce_before, fit.bce_after, fit.predicted, fit.observed, strict=True)
    ):
        print(f"| {k + 1} | " + " | ".join(f"{x:.4f}" for x in row) + " |")
    draft.cfg = dataclasses.replace(draft.cfg, dtype=args.save_dtype, param_dtype=args.save_dtype)
    cast_params(draft, args.save_dtype)
    save_draft(draft, args.out)
    info = {
        "fit": dataclasses.asdict(fit),
        "draft": os.path.abspath(args.draft),
        "target": os.path.abspath(args.target),
        "settings": {k: getattr(args, k) for k in ("batches", "batch_size", "seq_len", "seed", "save_dtype")},
        "corpus": corpus.provenance(),
        "jax_version": jax.__version__,
    }
    with open(os.path.join(args.out, "calibration.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(f"calibrated draft written to {args.out}")
    return 0
