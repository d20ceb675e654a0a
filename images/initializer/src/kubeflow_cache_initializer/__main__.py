"""`python -m kubeflow_cache_initializer`: the same as the `cache-initializer` console script."""

import sys

from kubeflow_cache_initializer.main import cli

sys.exit(cli())
