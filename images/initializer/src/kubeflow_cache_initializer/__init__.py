"""Dataset initializer that brings up a data cache (a LeaderWorkerSet) for a Kubeflow TrainJob."""

from kubeflow_cache_initializer.config import Config, load_config
from kubeflow_cache_initializer.errors import (
    CacheFailedError,
    CacheTimeoutError,
    ConfigError,
    ForeignObjectError,
    InitializerError,
    KubeApiError,
    TrainJobNotFoundError,
)
from kubeflow_cache_initializer.initializer import CacheReady, run
from kubeflow_cache_initializer.rbac import REQUIRED_PERMISSIONS

__version__ = "0.1.0"

__all__ = [
    "REQUIRED_PERMISSIONS",
    "CacheFailedError",
    "CacheReady",
    "CacheTimeoutError",
    "Config",
    "ConfigError",
    "ForeignObjectError",
    "InitializerError",
    "KubeApiError",
    "TrainJobNotFoundError",
    "__version__",
    "load_config",
    "run",
]
