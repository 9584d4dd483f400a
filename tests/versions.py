"""What the tests need of the torch they run on: pyproject declares torch 2.11, and CI runs
the core, layer, model and training tests on it as well (.ci/run)."""

import pytest
import torch

# Dynamo traces qkv's variant objects (vars() of their attributes) from torch 2.12 on; torch
# 2.11 cannot, so there a plain torch.compile breaks the graph around qkv.attention and the
# engines run eagerly in between (docs/attention.md, "Limits").
ONE_GRAPH = torch.torch_version.TorchVersion(torch.__version__) >= (2, 12)

# A test of one graph (fullgraph=True) or of torch.export.
one_graph = pytest.mark.skipif(
    not ONE_GRAPH, reason=f"one graph and torch.export need torch 2.12 (docs/attention.md, "
                          f"'Limits'); this is {torch.__version__}")
