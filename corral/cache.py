"""Where Corral keeps what it builds once per machine (converted weights, compiled kernels)."""

import os


def cache_dir() -> str:
    """``$CORRAL_CACHE_DIR``, else ``~/.cache/corral``."""
    return os.environ.get("CORRAL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "corral")
