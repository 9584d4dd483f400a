"""Embedded data sets (generated or shipped in installed packages), user-file loaders and
tokenizers. Nothing here downloads."""

from .atomic import write_atomic, write_bytes_atomic, write_json_atomic, write_text_atomic
from .docstrings import stdlib_docstrings
from .errors import DataError
from .images import ImageSet, digits, load_images
from .numbers import number_splits
from .text import read_pairs_tsv, read_text_file
from .tokenizers import BPETokenizer, CharTokenizer, read_tokenizer, save_tokenizer, train_tokenizer

__all__ = [
    "BPETokenizer", "CharTokenizer", "DataError", "ImageSet", "digits", "load_images",
    "read_tokenizer", "number_splits", "read_pairs_tsv", "read_text_file", "save_tokenizer",
    "stdlib_docstrings", "train_tokenizer", "write_atomic", "write_bytes_atomic",
    "write_json_atomic", "write_text_atomic",
]
