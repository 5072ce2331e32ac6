"""The benchmarks' tests (kvtrace/bench and scripts/) take the engine's and the server's
tiny models from those suites' fixtures."""

from tests.engine.conftest import engine_root, tiny_engine, tiny_folder, tokenizer_dir
from tests.serve.conftest import tiny_model_folder

__all__ = ["engine_root", "tiny_engine", "tiny_folder", "tiny_model_folder", "tokenizer_dir"]
