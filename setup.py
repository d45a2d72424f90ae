"""The one part of the build that pyproject.toml cannot say in a stable table: the optional C extension.

The compiled float32 passes of reproducible sums (src/collectives/_kernels.c: plain C, no Python API,
loaded with ctypes by collectives._reproducible). Optional: where no C compiler works the package builds
without them and the NumPy passes run instead, with the same bits (docs/performance.md, "Reproducible
sums"). Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("collectives._kernels", ["src/collectives/_kernels.c"], optional=True,
                             extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math"])])
