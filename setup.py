"""The engine's compiled kernels (rldiag/engine/native/*.c): plain C libraries loaded through
ctypes, optional (an install without a C compiler builds none, and the engine runs their numpy
twins). Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

# IEEE float64 in the source's order: no fast-math, no fused multiply-adds (results the same
# bits on every machine and run)
FLAGS = ["-O2", "-fno-fast-math", "-ffp-contract=off", "-fno-strict-aliasing"]

setup(
    ext_modules=[
        Extension("rldiag.engine.native._mismatch_chunk", ["rldiag/engine/native/mismatch_chunk.c"],
                  depends=["rldiag/engine/native/lanes.h", "rldiag/engine/native/mismatch_block.h"],
                  extra_compile_args=FLAGS, libraries=["m"], optional=True),
        Extension("rldiag.engine.native._rollout_probs", ["rldiag/engine/native/rollout_probs.c"],
                  depends=["rldiag/engine/native/lanes.h"], extra_compile_args=FLAGS, libraries=["m"], optional=True),
        Extension("rldiag.engine.native._grad_weight", ["rldiag/engine/native/grad_weight.c"],
                  depends=["rldiag/engine/native/lanes.h"], extra_compile_args=FLAGS, libraries=["m"], optional=True),
        Extension("rldiag.engine.native._ppo_clip", ["rldiag/engine/native/ppo_clip.c"],
                  depends=["rldiag/engine/native/lanes.h"], extra_compile_args=FLAGS, optional=True),
        Extension("rldiag.engine.native._tis_counts", ["rldiag/engine/native/tis_counts.c"],
                  depends=["rldiag/engine/native/lanes.h"], extra_compile_args=FLAGS, libraries=["m"], optional=True),
        Extension("rldiag.engine.native._span_sums", ["rldiag/engine/native/span_sums.c"],
                  depends=["rldiag/engine/native/lanes.h"], extra_compile_args=FLAGS, optional=True),
        Extension("rldiag.engine.native._row_sums", ["rldiag/engine/native/row_sums.c"],
                  extra_compile_args=FLAGS, libraries=["m"], optional=True),
        Extension("rldiag.engine.native._kl_sums", ["rldiag/engine/native/kl_sums.c"],
                  depends=["rldiag/engine/native/lanes.h"], extra_compile_args=FLAGS, libraries=["m"], optional=True),
    ],
)
