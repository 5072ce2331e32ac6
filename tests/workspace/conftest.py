"""The workspace tests' agents run on the server suite's tiny model."""

from tests.serve.conftest import tiny_model_folder

__all__ = ["tiny_model_folder"]
