"""The folded-sampling memory gate: mode resolution, the rule, and the estimates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.memory_gate import (
    ENV_VAR,
    GIB,
    FoldedSampling,
    closed_form_bytes,
    free_device_bytes,
    plan_folded_sampling,
)

SHAPE = dict(max_batch=16, gamma=7, vocab=1000)
NEEDED = 16 * 1000 * 4 + 16 * 7 * 1000 * 4  # noise + float32 corrected logits


def test_closed_form_matches_the_spec_example():
    # DSPARK_SPEC §3: about 0.65 GiB at max_bs 256, V 151936, γ 7 with bf16 logits.
    size = closed_form_bytes(max_batch=256, gamma=7, vocab=151936, logits_itemsize=2)
    assert size == 256 * 151936 * 4 + 256 * 7 * 151936 * 2
    assert abs(size / GIB - 0.65) < 0.01
    assert closed_form_bytes(**SHAPE) == NEEDED
    # no noise array where the race kernel draws the noise in registers
    assert closed_form_bytes(**SHAPE, noise_itemsize=0) == NEEDED - 16 * 1000 * 4
    decision = plan_folded_sampling("force", noise_itemsize=0, **SHAPE)
    assert decision.closed_form_bytes == NEEDED - 16 * 1000 * 4


def test_default_mode_is_auto(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert FoldedSampling.resolve() is FoldedSampling.AUTO
    monkeypatch.setenv(ENV_VAR, "")
    assert FoldedSampling.resolve() is FoldedSampling.AUTO


def test_environment_variable_sets_the_mode_and_argument_wins(monkeypatch):
    monkeypatch.setenv(ENV_VAR, " Force ")
    assert FoldedSampling.resolve() is FoldedSampling.FORCE
    assert plan_folded_sampling(free_bytes=0, **SHAPE).enabled
    assert FoldedSampling.resolve("off") is FoldedSampling.OFF
    assert FoldedSampling.resolve(FoldedSampling.AUTO) is FoldedSampling.AUTO


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=rf"{ENV_VAR}='sometimes' is invalid: must be one of off, auto, force"):
        FoldedSampling.resolve()


def test_bad_argument_names_the_argument(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match=r"folded_sampling='on' is invalid"):
        FoldedSampling.resolve("on")
    with pytest.raises(ValueError, match=r"folded_sampling=1 is invalid"):
        FoldedSampling.resolve(1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(max_batch=0), r"max_batch=0 is invalid: must be an integer >= 1"),
        (dict(gamma=-1), r"gamma=-1 is invalid: must be an integer >= 1"),
        (dict(vocab=1.5), r"vocab=1.5 is invalid: must be an integer >= 1"),
        (dict(max_batch=True), r"max_batch=True is invalid"),
        (dict(logits_itemsize=0), r"logits_itemsize=0 is invalid: must be an integer >= 1"),
        (dict(noise_itemsize=-4), r"noise_itemsize=-4 is invalid: must be an integer >= 0 \(bytes\)"),
        (dict(free_bytes=-1), r"free_bytes=-1 is invalid: must be None or an integer >= 0 \(bytes\)"),
        (dict(free_bytes="x"), r"free_bytes='x' is invalid"),
        (dict(compiled_bytes=2.5), r"compiled_bytes=2.5 is invalid: must be None or an integer >= 0"),
        (dict(headroom=-5), r"headroom=-5 is invalid: must be an integer >= 0 \(bytes\)"),
        # NaN compared false with everything: AUTO turned folded sampling off without a word
        (dict(headroom=float("nan")), r"headroom=nan is invalid"),
        (dict(headroom=None), r"headroom=None is invalid"),
    ],
)
def test_bad_sizes_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        plan_folded_sampling("auto", **{**SHAPE, "free_bytes": NEEDED + GIB, **change})


def test_numpy_integer_sizes_are_taken_as_ints():
    decision = plan_folded_sampling(
        "auto", max_batch=np.int64(16), gamma=np.int32(7), vocab=np.uint32(1000), free_bytes=np.int64(NEEDED + GIB)
    )
    assert decision.enabled and decision.closed_form_bytes == NEEDED and type(decision.free_bytes) is int


def test_off_never_folds_sampling():
    decision = plan_folded_sampling("off", free_bytes=1 << 50, **SHAPE)
    assert not decision.enabled and decision.mode is FoldedSampling.OFF


def test_force_folds_sampling_without_memory():
    decision = plan_folded_sampling("force", free_bytes=0, **SHAPE)
    assert decision.enabled and decision.mode is FoldedSampling.FORCE


def test_auto_keeps_one_gib_headroom_after_the_estimate():
    exact = plan_folded_sampling("auto", free_bytes=NEEDED + GIB, **SHAPE)
    short = plan_folded_sampling("auto", free_bytes=NEEDED + GIB - 1, **SHAPE)
    assert exact.enabled and not short.enabled
    assert exact.headroom == GIB and exact.closed_form_bytes == NEEDED and exact.free_bytes == NEEDED + GIB
    assert "AUTO" in short.reason


def test_auto_compares_xla_estimate_once_compiled_else_the_closed_form():
    larger = plan_folded_sampling("auto", free_bytes=NEEDED + GIB, compiled_bytes=NEEDED + 10_000, **SHAPE)
    assert not larger.enabled and larger.needed_bytes == NEEDED + 10_000 and larger.closed_form_bytes == NEEDED
    # XLA's buffer assignment can need less than the closed form (the XLA sampler's noise
    # array, say, is not always live at the peak)
    smaller = plan_folded_sampling("auto", free_bytes=GIB + 5_000, compiled_bytes=5_000, **SHAPE)
    assert smaller.enabled and smaller.needed_bytes == 5_000 and smaller.closed_form_bytes == NEEDED
    assert not plan_folded_sampling("auto", free_bytes=GIB + 4_999, compiled_bytes=5_000, **SHAPE).enabled
    before = plan_folded_sampling("auto", free_bytes=GIB + 5_000, **SHAPE)
    assert not before.enabled and before.needed_bytes == NEEDED


def test_auto_measures_free_memory_when_not_given():
    free = free_device_bytes()
    assert isinstance(free, int) and free > 0
    decision = plan_folded_sampling("auto", **SHAPE)
    assert decision.free_bytes is not None and decision.free_bytes > 0


def _stats(temp, out, alias=0):
    from types import SimpleNamespace

    stats = SimpleNamespace(temp_size_in_bytes=temp, output_size_in_bytes=out, alias_size_in_bytes=alias)
    return SimpleNamespace(memory_analysis=lambda: stats)


def test_sampling_extra_bytes_is_the_growth_of_the_rounds_largest_footprint():
    from dspark_jax.memory_gate import sampling_extra_bytes

    # footprint = scratch + outputs − outputs aliased to donated arguments
    assert sampling_extra_bytes(_stats(300, 2600), _stats(1000, 40)) == 2900 - 1040  # a smaller scratch counts
    assert sampling_extra_bytes(_stats(300, 2600, alias=600), _stats(1000, 40)) == 2300 - 1040
    # a backbone piece that already needs 2000 sets the greedy round's peak
    assert sampling_extra_bytes(_stats(300, 2600), _stats(1000, 40), (_stats(1500, 500), _stats(10, 10))) == 900
    assert sampling_extra_bytes(_stats(300, 2600), _stats(1000, 40), (_stats(3000, 0),)) == 0
    assert sampling_extra_bytes(object(), _stats(1, 1)) is None
    assert sampling_extra_bytes(_stats(1, 1), _stats(1, 1), (object(),)) is None


def test_sampling_extra_bytes_of_real_executables_counts_the_other_programs():
    from dspark_jax.memory_gate import sampling_extra_bytes

    spec = jax.ShapeDtypeStruct((1000,), jnp.float32)
    small = jax.jit(lambda x: x * 2).lower(spec).compile()
    large = jax.jit(lambda x: (x * 2, jnp.tile(x, 3))).lower(spec).compile()  # 12000 more output bytes
    larger = jax.jit(lambda x: jnp.tile(x, 5)).lower(spec).compile()  # 20000 output bytes
    alone = sampling_extra_bytes(large, small)
    assert alone is not None and alone >= 12000
    assert sampling_extra_bytes(large, small, (larger,)) < alone
    assert sampling_extra_bytes(small, large, (larger,)) == 0
    assert sampling_extra_bytes(small, small) == 0


@pytest.mark.parametrize("blank", ["  ", "\t", " \n "])
def test_a_blank_environment_variable_means_auto(monkeypatch, blank):
    monkeypatch.setenv(ENV_VAR, blank)
    assert FoldedSampling.resolve() is FoldedSampling.AUTO
    assert plan_folded_sampling(free_bytes=NEEDED + GIB, **SHAPE).mode is FoldedSampling.AUTO


def test_force_hint_advises_the_argument_when_given_else_the_environment_variable():
    """The argument overrides the variable, so setting the variable only helps where no
    argument was given (the module docstring's rule)."""
    from dspark_jax.memory_gate import force_hint

    for given in ("auto", "AUTO", FoldedSampling.AUTO, FoldedSampling.OFF, "force"):
        hint = force_hint(given)
        assert 'folded_sampling="force"' in hint and ENV_VAR not in hint, given
    hint = force_hint(None)
    assert f"{ENV_VAR}=FORCE" in hint and 'folded_sampling="force"' in hint


class _Device:
    """A device stand-in for :func:`free_device_bytes`: ``stats`` from ``memory_stats()``, or
    no ``memory_stats`` at all (as a backend that reports none)."""

    def __init__(self, stats=None):
        if stats is not None:
            self.memory_stats = lambda: stats


def test_free_device_memory_is_the_limit_less_what_is_in_use(monkeypatch):
    device = _Device({"bytes_limit": 10 * GIB, "bytes_in_use": 7 * GIB})
    assert free_device_bytes(device) == 3 * GIB
    assert free_device_bytes(_Device({"bytes_limit": 10 * GIB})) == 10 * GIB  # nothing in use
    # AUTO measures the first device: 3 GiB free, 2.5 GiB needed leaves less than the 1 GiB headroom
    from dspark_jax import memory_gate

    monkeypatch.setattr(memory_gate.jax, "devices", lambda: [device])
    short = plan_folded_sampling("auto", compiled_bytes=5 * GIB // 2, **SHAPE)
    assert short.free_bytes == 3 * GIB and not short.enabled
    fits = plan_folded_sampling("auto", compiled_bytes=2 * GIB, **SHAPE)
    assert fits.free_bytes == 3 * GIB and fits.enabled


def test_free_host_memory_reads_mem_available_in_kilobytes(monkeypatch):
    """``/proc/meminfo`` gives kB (units of 1024 bytes): a device without memory statistics
    (the CPU) reports ``MemAvailable`` in bytes."""
    import io

    from dspark_jax import memory_gate

    meminfo = "MemTotal:        8192 kB\nMemFree:         1024 kB\nMemAvailable:    2048 kB\nBuffers:  1 kB\n"
    real_open = open

    def fake_open(path, *args, **kwargs):
        return io.StringIO(meminfo) if str(path) == "/proc/meminfo" else real_open(path, *args, **kwargs)

    monkeypatch.setattr(memory_gate, "open", fake_open, raising=False)
    assert free_device_bytes(_Device()) == 2048 * 1024 == 2_097_152
