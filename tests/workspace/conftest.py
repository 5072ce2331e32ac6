"""The workspace tests' agents run on the server suite's tiny model; `age` backdates files."""

import os
import time

from tests.serve.conftest import tiny_model_folder

__all__ = ["age", "tiny_model_folder"]


def age(folder, seconds=10):
    """Backdate every file, as if written a while ago (the index trusts only settled stats)."""
    then = time.time() - seconds
    for root, _, names in os.walk(folder):
        for name in names:
            os.utime(os.path.join(root, name), (then, then), follow_symlinks=False)
