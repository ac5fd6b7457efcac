"""Settings for the whole suite, and fixtures shared by several modules.

Float32 products at full precision on every backend: on GPUs XLA multiplies float32
matrices through TF32 by default (about 1e-3 relative error), which the comparisons with
NumPy references would report as bugs; on the CPU (CI) this changes nothing.
"""

import jax
import pytest
from proposer_testing import build_forced

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def forced_session(tmp_path_factory):
    """``(draft, proposer, cache, store)``: a precompiled FORCE proposer (``proposer_testing``)
    that saved its programs in the executable store ``store``, built once for the Proposer's
    and the executable store's tests."""
    store = tmp_path_factory.mktemp("executable_store")
    return (*build_forced(store), store)
