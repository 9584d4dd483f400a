"""Fixtures shared across the test folders."""

import functools

import pytest

import qkv.models


@pytest.fixture(scope="module")
def load_pretrained_once():
    """Commands load checkpoints through qkv.models.load_pretrained: within a module, load each
    one once (tests must not pack or otherwise change the models they get)."""
    original = qkv.models.load_pretrained
    qkv.models.load_pretrained = functools.lru_cache(maxsize=None)(original)
    yield
    qkv.models.load_pretrained = original
