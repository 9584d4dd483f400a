"""Bridges from other libraries to qkv's attention. Each submodule imports its library, so
importing qkv imports none of them: ``import qkv.integrations.transformers`` does."""
