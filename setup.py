"""The one part of the build that pyproject.toml cannot say in a stable table: the optional C extensions.

- The compiled passes (src/collectives/_kernels.c: plain C, no Python API, loaded with ctypes by
  collectives._native): reproducible sums of float32 terms, the node-shared window's float sums. Where they
  are missing the NumPy passes run instead, with the same bits (docs/performance.md, "Reproducible sums").
- The flight recorder's record of a call (src/collectives/_recorder.c, a CPython extension module): where
  it is missing, the Python function makes the same record (collectives._comm.record.begin).

Both are optional: where no C compiler works the package builds without them. Everything else about the
package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("collectives._kernels", ["src/collectives/_kernels.c"], optional=True,
                             extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math"]),
                   Extension("collectives._recorder", ["src/collectives/_recorder.c"], optional=True,
                             extra_compile_args=["-O2"])])
