"""The expression graph that traced code records (``trace``) and the code generators write
out (``kernelgen.c``, ``kernelgen.triton``, with derivatives from ``derivative``).

A node (``Sym``) is one operation on other nodes, Python numbers and *slots*: the tensors a
traced rule reads (padding lengths, segment ids, ALiBi slopes, a bias table), which become
kernel arguments that the generated code gathers from. ``Graph`` hash-conses the nodes, so a
value computed twice is one node. ``Sym`` stands in for a tensor while a rule is traced: its
operators record nodes, and what has no straight-line form (Python control flow on a value,
its shape, a conversion to a Python number) raises ``CompileError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

BOOL, INT, FLOAT = "bool", "int", "float"
MAX_SLOTS = 4  # the kernels pass this many tensor arguments through to generated code
# Per slot, the int64 info tensor AS holds 4 strides, the element count and its bit length.
SLOT_INFO = 6

_COMPARISONS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


class CompileError(ValueError):
    """A mask or score modifier that the Triton engine cannot compile."""


def kind_of_dtype(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return BOOL
    return FLOAT if dtype.is_floating_point else INT


class Graph:
    """Hash-consed nodes plus the tensors (slots) the traced code reads."""

    def __init__(self, device, head_dim: int = 0):
        self.device = device
        self.head_dim = head_dim
        # While a pairwise term is traced: its dimension index d, at which a captured 1-D
        # tensor used whole is read (a per-dimension weight broadcasts along d, as in torch).
        self.per_dim: Sym | None = None
        # While user code is traced (``trace``): a torch function applied to a value.
        self.torch_function: Callable | None = None
        self.nodes: dict[tuple, Sym] = {}
        self.slots: list[Tensor] = []
        self.sources: list[Tensor] = []  # each slot's tensor as the traced code read it
        self._slot_of: dict[int, int] = {}

    def node(self, op: str, args: tuple, kind: str) -> Sym:
        key = (op, tuple(_key(a) for a in args))
        found = self.nodes.get(key)
        if found is None:
            found = Sym(self, op, args, kind)
            self.nodes[key] = found
        return found

    def leaf(self, name: str, kind: str) -> Sym:
        return self.node("arg", (name,), kind)

    def full(self, like, value, kind: str) -> Sym:
        """``value`` as a number of ``kind``, in the broadcast shape of ``like``."""
        return self.node("full", (like, {BOOL: bool, INT: int, FLOAT: float}[kind](value)), kind)

    def slot(self, tensor: Tensor) -> int:
        """The slot index of a captured tensor, moved to the problem's device (differentiably)."""
        index = self._slot_of.get(id(tensor))
        if index is None:
            if len(self.slots) == MAX_SLOTS:
                raise CompileError(
                    f"the mask and score modifier read more than {MAX_SLOTS} tensors; the Triton "
                    f"engine passes at most {MAX_SLOTS}"
                )
            if tensor.dim() > 4:
                raise CompileError(f"a captured tensor has {tensor.dim()} dims; at most 4 compile")
            index = len(self.slots)
            self.slots.append(self.place(tensor, self.device))
            self.sources.append(tensor)
            self._slot_of[id(tensor)] = index
        return index

    @staticmethod
    def place(tensor: Tensor, device) -> Tensor:
        """A captured tensor as a slot holds it: on ``device``, contiguous (differentiably)."""
        return tensor.to(device).contiguous()

    def load(self, tensor: Tensor, index) -> Sym:
        """``tensor[index]`` with symbolic (or integer) indices, one per dimension."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != tensor.dim() or not all(
            isinstance(i, Sym) or (isinstance(i, int) and not isinstance(i, bool)) for i in index
        ):
            raise CompileError(
                f"a captured tensor of shape {tuple(tensor.shape)} must be indexed with one "
                "integer or index expression per dimension (no slices, None or masks)"
            )
        for i in index:
            if isinstance(i, Sym) and i.kind == FLOAT:
                raise CompileError("a captured tensor is indexed with a float expression")
        return self.node("load", (self.slot(tensor), *index), kind_of_dtype(tensor.dtype))

    def lift(self, value):
        """A Sym, a Python number, or a 0-d captured tensor (loaded as a scalar)."""
        if isinstance(value, (Sym, bool, int, float)):
            return value
        if isinstance(value, Tensor):
            if value.dim() == 0:
                return self.load(value, ())
            if self.per_dim is not None and value.dim() == 1:
                if value.numel() == 1:
                    return self.load(value, (0,))
                if value.numel() == self.head_dim:
                    return self.load(value, (self.per_dim,))
                raise CompileError(
                    f"a pairwise term reads a tensor of shape {tuple(value.shape)}; per-dimension "
                    f"tensors must have shape (D,) = ({self.head_dim},)"
                )
            raise CompileError(
                f"a captured tensor of shape {tuple(value.shape)} is used whole; index it with "
                "b, h, q_idx or kv_idx so each score reads one element"
            )
        if isinstance(value, PartialLoad):
            raise CompileError(
                f"a captured tensor of shape {tuple(value.tensor.shape)} is used with "
                f"{len(value.index)} of its {value.tensor.dim()} indices; index every dimension"
            )
        raise CompileError(f"cannot compile a value of type {type(value).__name__}")


def _key(arg):
    return ("sym", id(arg)) if isinstance(arg, Sym) else (type(arg).__name__, arg)


def kind_of(value) -> str:
    if isinstance(value, Sym):
        return value.kind
    if isinstance(value, bool):
        return BOOL
    return INT if isinstance(value, int) else FLOAT


def arith_kind(*values) -> str:
    return FLOAT if any(kind_of(v) == FLOAT for v in values) else INT


class Sym:
    """A symbolic value in a traced rule: a node of a ``Graph``."""

    __slots__ = ("graph", "op", "args", "kind")
    __hash__ = None  # == builds a node

    def __init__(self, graph: Graph, op: str, args: tuple, kind: str):
        self.graph, self.op, self.args, self.kind = graph, op, args, kind

    # -- building nodes ------------------------------------------------------------------
    def _binary(self, op: str, other, reverse: bool = False):
        other = self.graph.lift(other)
        a, b = (other, self) if reverse else (self, other)
        if op in _COMPARISONS:
            kind = BOOL
        elif op in ("and", "or", "xor"):
            kind = BOOL if kind_of(a) == kind_of(b) == BOOL else INT
            if FLOAT in (kind_of(a), kind_of(b)):
                raise CompileError(f"bitwise {op} of a float expression")
        elif op == "truediv":
            kind = FLOAT
        else:
            kind = arith_kind(a, b)
        return self.graph.node(op, (a, b), kind)

    def _unary(self, op: str, kind: str | None = None):
        return self.graph.node(op, (self,), kind or self.kind)

    def __add__(self, o): return self._binary("add", o)
    def __radd__(self, o): return self._binary("add", o, True)
    def __sub__(self, o): return self._binary("sub", o)
    def __rsub__(self, o): return self._binary("sub", o, True)
    def __mul__(self, o): return self._binary("mul", o)
    def __rmul__(self, o): return self._binary("mul", o, True)
    def __truediv__(self, o): return self._binary("truediv", o)
    def __rtruediv__(self, o): return self._binary("truediv", o, True)
    def __floordiv__(self, o): return self._binary("floordiv", o)
    def __rfloordiv__(self, o): return self._binary("floordiv", o, True)
    def __mod__(self, o): return self._binary("mod", o)
    def __rmod__(self, o): return self._binary("mod", o, True)
    def __lt__(self, o): return self._binary("lt", o)
    def __le__(self, o): return self._binary("le", o)
    def __gt__(self, o): return self._binary("gt", o)
    def __ge__(self, o): return self._binary("ge", o)
    def __eq__(self, o): return self._binary("eq", o)  # type: ignore[override]
    def __ne__(self, o): return self._binary("ne", o)  # type: ignore[override]
    def __and__(self, o): return self._binary("and", o)
    def __rand__(self, o): return self._binary("and", o, True)
    def __or__(self, o): return self._binary("or", o)
    def __ror__(self, o): return self._binary("or", o, True)
    def __xor__(self, o): return self._binary("xor", o)
    def __rxor__(self, o): return self._binary("xor", o, True)
    def __neg__(self): return self._unary("neg", INT if self.kind == BOOL else None)
    def __pos__(self): return self
    def __invert__(self): return self._unary("invert")
    def __abs__(self): return self.abs()

    def __pow__(self, exponent):
        if exponent not in (0.5, 1, 2, 3, 4):
            raise CompileError(f"x ** {exponent!r}: only the exponents 0.5, 1, 2, 3, 4 compile")
        if exponent == 0.5:
            return self.sqrt()
        result = self
        for _ in range(int(exponent) - 1):
            result = result * self
        return result

    def abs(self): return self._unary("abs", INT if self.kind == BOOL else None)
    def neg(self): return -self

    def exp(self): return self._unary("exp", FLOAT)
    def log(self): return self._unary("log", FLOAT)
    def tanh(self): return self._unary("tanh", FLOAT)
    def sigmoid(self): return self._unary("sigmoid", FLOAT)
    def sqrt(self): return self._unary("sqrt", FLOAT)
    def sin(self): return self._unary("sin", FLOAT)
    def cos(self): return self._unary("cos", FLOAT)

    # The method spellings of the operators (q.sub(k), x.pow(2), ...).
    def add(self, other, *, alpha=1): return self + (other if alpha == 1 else other * alpha)
    def sub(self, other, *, alpha=1): return self - (other if alpha == 1 else other * alpha)
    def mul(self, other): return self * other
    def pow(self, exponent): return self ** exponent
    def reciprocal(self): return 1.0 / self
    multiply, subtract = mul, sub

    def div(self, other, *, rounding_mode=None):
        if rounding_mode is None:
            return self / other
        if rounding_mode == "floor":
            return self // other
        raise CompileError(f"div with rounding_mode={rounding_mode!r} does not compile")

    divide = true_divide = div

    # x.new_ones(()) and friends: a constant (FlexAttention's and_masks, or_masks and noop_mask
    # start from one).
    def new_ones(self, size=(), *, dtype=None, **kwargs): return self._new(size, 1, dtype)
    def new_zeros(self, size=(), *, dtype=None, **kwargs): return self._new(size, 0, dtype)

    def new_full(self, size, fill_value, *, dtype=None, **kwargs):
        return self._new(size, fill_value, dtype)

    def _new(self, size, value, dtype):
        if tuple(size) != ():
            raise CompileError(f"new_ones/new_zeros/new_full of shape {tuple(size)}: only a "
                               "scalar, shape (), compiles")
        return self.graph.full(self, value, self.kind if dtype is None else kind_of_dtype(dtype))

    def square(self): return self * self
    def rsqrt(self): return 1.0 / self.sqrt()

    def sign(self):
        """-1, 0 or 1 in the value's kind; 0 for NaN and for -0, as torch.sign on CPU."""
        g = self.graph
        if self.kind == FLOAT:  # one node, which each target writes in its fewest operations
            return g.node("sign", (self,), FLOAT)
        return g.node("where", (self > 0, 1, g.node("where", (self < 0, -1, 0), INT)), INT)

    def relu(self, inplace=False):
        """max(x, 0) as torch.relu: NaN stays NaN and -0 stays -0. (``inplace``, which
        ``F.relu`` passes, means nothing for a traced value.)"""
        return self.graph.node("where", (self < 0, 0.0 if self.kind == FLOAT else 0, self),
                               self.kind)

    def clamp(self, min=None, max=None):
        result, g = self, self.graph
        if min is not None:
            result = g.node("maximum", (result, g.lift(min)), arith_kind(result, min))
        if max is not None:
            result = g.node("minimum", (result, g.lift(max)), arith_kind(result, max))
        return result

    clip = clamp

    def clamp_min(self, value): return self.clamp(min=value)
    def clamp_max(self, value): return self.clamp(max=value)

    def float(self): return self._cast(FLOAT)
    def double(self): return self._cast(FLOAT)
    def long(self): return self._cast(INT)
    def int(self): return self._cast(INT)
    def bool(self): return self._cast(BOOL)

    def _cast(self, kind: str):
        return self if kind == self.kind else self.graph.node("cast", (self,), kind)

    def to(self, *args, **kwargs):
        """Casts to a dtype (or another value's dtype); moves between devices are no-ops."""
        target = kwargs.get("dtype", args[0] if args else None)
        if isinstance(target, (Sym, Tensor)):
            target = target.dtype
        if isinstance(target, torch.dtype):
            return self._cast(kind_of_dtype(target))
        return self

    def type_as(self, other): return self.to(other)

    @property
    def dtype(self) -> torch.dtype:
        return {BOOL: torch.bool, INT: torch.int64, FLOAT: torch.float32}[self.kind]

    @property
    def device(self):
        return self.graph.device

    # -- what cannot be traced -----------------------------------------------------------
    def __bool__(self):
        raise CompileError(
            "Python control flow (if, and, or, not, min, max) on a traced value; use torch.where, "
            "&, |, ~, torch.minimum or torch.maximum instead"
        )

    def _no_python_value(self, *args):
        raise CompileError("a traced value was converted to a Python number or iterated over")

    __index__ = __int__ = __float__ = __len__ = __iter__ = _no_python_value

    def __getitem__(self, index):
        raise CompileError("indexing into a traced value; index a captured tensor instead")

    @property
    def shape(self):
        raise CompileError("the shape of a traced value is not known at compile time")

    # -- torch functions: what ``trace`` installs on the graph it traces into ---------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        values = [*args, *kwargs.values()]
        values += [v for a in values if isinstance(a, (tuple, list)) for v in a]
        graph = next(a.graph for a in values if isinstance(a, Sym))
        if graph.torch_function is None:
            raise CompileError(f"{func} on a traced value outside tracing")
        return graph.torch_function(graph, func, args, kwargs)


class PartialLoad:
    """A captured tensor indexed in fewer dimensions than it has (``bias[b]`` of a (B, N)
    bias): FlexAttention code indexes one dimension after another, ``bias[b][q_idx]``. Each
    further index extends it; with one index per dimension it becomes a load."""

    def __init__(self, graph: Graph, tensor: Tensor, index: tuple):
        self.graph, self.tensor, self.index = graph, tensor, index

    def __getitem__(self, index):
        return index_into(self.graph, self.tensor, self.index + _as_tuple(index))


def _as_tuple(index) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def index_into(graph, tensor, index):
    """``tensor[index]`` in traced code: a load, or a ``PartialLoad`` while indices are missing."""
    if isinstance(tensor, Sym):
        return tensor[index]
    index = _as_tuple(index)
    if len(index) < tensor.dim() and all(
        isinstance(i, Sym) or (isinstance(i, int) and not isinstance(i, bool)) for i in index
    ):
        return PartialLoad(graph, tensor, index)
    return graph.load(tensor, index)
