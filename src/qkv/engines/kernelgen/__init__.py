"""The kernel generator: a variant's single definitions written out as kernel code.

- ``trace``: tracing. A mask rule, a score modifier or a pairwise term, called once with
  symbolic stand-ins, records an expression graph (``graph``) over the tensors it reads
  (slots).
- ``derivative``: that graph's forward-mode derivatives, as graphs.
- ``emit``: one emitter; a target is a table of what each operation is in its language
  (``c_emit``, ``triton_emit``).
- ``c`` and ``triton``: the two targets, with the functions each engine loads (C tile loops
  for the fused and graph CPU engines; ``@triton.jit`` functions for the Triton kernels).

Nothing here knows the built-in kernels: each engine keeps its own table of them and asks
for generated code only for what it has no code of its own for.
"""

from .graph import CompileError, Graph, Sym
from .trace import trace_mask, trace_score_mod, trace_term

__all__ = ["CompileError", "Graph", "Sym", "trace_mask", "trace_score_mod", "trace_term"]
