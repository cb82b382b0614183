"""Prompt data: verl-schema datasets, a resumable loader, built-in tasks and preprocess scripts."""

from lathe.data.builtin import BUILTIN_DATASETS, arithmetic_rows, builtin_tokenizer
from lathe.data.dataset import RLDataset
from lathe.data.errors import DataError
from lathe.data.loader import StatefulDataLoader

__all__ = [
    "BUILTIN_DATASETS",
    "DataError",
    "RLDataset",
    "StatefulDataLoader",
    "arithmetic_rows",
    "builtin_tokenizer",
]
