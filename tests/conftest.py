"""Settings for the whole suite: float32 products at full precision on every backend.

On GPUs XLA multiplies float32 matrices through TF32 by default (about 1e-3 relative
error), which the comparisons with NumPy references would report as bugs; on the CPU (CI)
this changes nothing.
"""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
