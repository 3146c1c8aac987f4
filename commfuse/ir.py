"""The IR: define-by-run loops, buffers with layouts, views and extern kernels.

Lowering produces `TensorBox`es. A box holds one of:
  Pointwise / Reduction  -- not yet stored anywhere; consumers inline `inner_fn`
  Buffer subclasses      -- stored: inputs, computed loops, extern outputs
  View                   -- an index remapping of another box (no data of its own)
`realize()` turns loops into a ComputedBuffer that the scheduler will fuse.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import sympy
import torch

from . import sizevars
from .dependencies import trace_body
from .sizevars import Expr, index_symbol
from .virtualized import V, ops


class NoOpFallback(Exception):
    """Neither lowered nor runnable as its aten op here (its aten op would read our layout as if it
    were eager's): the graph cannot compile, and runs op by op through aten."""


class Unsupported(Exception):
    """A lowering cannot handle these arguments: fall back to the aten op."""


class Declined(Unsupported):
    """The aten op runs by design (its message is the whole reason the dumps give)."""


# ----------------------------------------------------------------------------- layouts
@dataclasses.dataclass
class Layout:
    device: torch.device
    dtype: torch.dtype
    size: list
    stride: list
    offset: Expr = sympy.Integer(0)

    def index(self, index: Sequence[Expr]) -> Expr:
        assert len(index) == len(self.stride), (index, self.stride)
        return self.offset + sum((i * s for i, s in zip(index, self.stride) if s != 0),
                                 sympy.Integer(0))

    def store_index(self, index: Sequence[Expr]) -> Expr:
        """Where a kernel stores element `index` (run under the ops handler: ScatterLayout loads)."""
        return self.index(index)

    def storage_numel(self) -> Expr:
        """Elements the storage must span (max offset + 1)."""
        if any(s == 0 for s in self.size):
            return sympy.Integer(0)
        return self.offset + 1 + sum(((n - 1) * s for n, s in zip(self.size, self.stride)),
                                     sympy.Integer(0))

    def numel(self) -> Expr:
        return sizevars.product(self.size)

    def nbytes_hint(self) -> int:
        return sizevars.hint(self.storage_numel()) * self.dtype.itemsize

    def is_dense(self) -> bool:
        """Strides form a permutation of contiguous strides (no gaps, no overlap)."""
        expected = sympy.Integer(1)
        for i in self.stride_order()[::-1]:
            if self.size[i] != 1 and not sizevars.equal(self.stride[i], expected):
                return False
            expected = expected * self.size[i]
        return True

    def stride_order(self) -> list:
        """Dims from the largest stride to the smallest (outermost in memory first)."""
        return sorted(range(len(self.size)), key=lambda i: -sizevars.hint(self.stride[i]))

    def unravel(self, flat: Expr) -> list:
        """The index stored at element `flat` of a dense layout: the inverse of `index`."""
        order = self.stride_order()
        digits = sizevars.unravel(flat - self.offset, [self.size[i] for i in order])
        index = [sympy.Integer(0)] * len(self.size)
        for i, v in zip(order, digits):
            index[i] = v
        return index

    def has_strides(self, stride) -> bool:
        """These strides, where a dim has more than one element (a size-1 dim's stride is moot)."""
        return all(n == 1 or sizevars.equal(a, b) for n, a, b in zip(self.size, self.stride, stride))

    def is_contiguous(self) -> bool:
        return self.has_strides(sizevars.contiguous_strides(self.size))


class FlexibleLayout(Layout):
    """Strides not yet committed: contiguous unless the compiler decides otherwise."""


class FixedLayout(Layout):
    """Strides dictated from outside (inputs, outputs, extern kernels)."""


@dataclasses.dataclass
class CommLayout(FixedLayout):
    """A buffer living in a persistent symmetric-memory pool of one process group."""
    group: str = ""
    kind: str = ""


@dataclasses.dataclass
class MutationLayout(FixedLayout):
    """The storage of graph input `target`, which the graph updates (`copy_`): the kernel computing
    the new value stores it there, and no copy follows."""
    target: str = ""


@dataclasses.dataclass
class ScatterLayout(MutationLayout):
    """Rows of graph input `target` stored in place at positions read from the device (a KV-cache
    update, `index_copy_` / `index_put_` along `dim`): the layout spans the values (`size`), at
    the target's strides; element i goes to position `positions([i[dim]])` of `bound` there."""
    dim: int = 0
    positions: Any = None
    bound: Expr = sympy.Integer(1)

    def store_index(self, index):
        index = list(index)
        index[self.dim] = ops.indirect_indexing(self.positions([index[self.dim]]), self.bound)
        return self.index(index)


def contiguous_layout(device, dtype, size, cls=FlexibleLayout) -> Layout:
    return cls(device, dtype, list(size), sizevars.contiguous_strides(size))


CHANNELS_LAST = [0, 2, 3, 1]  # NCHW dims, outermost in memory first


def ordered_layout(device, dtype, size, order) -> Layout:
    """Dense, with the dims of `order` outermost first (range(len(size)): contiguous)."""
    stride, acc = [sympy.Integer(0)] * len(size), sympy.Integer(1)
    for i in reversed(order):
        stride[i], acc = acc, acc * size[i]
    return FlexibleLayout(device, dtype, list(size), stride)


def row_padded(layout: Layout, multiple: int) -> Layout:
    """`layout` (row-major) with each row's stride rounded up to a multiple of `multiple` elements:
    the same values, rows starting aligned."""
    *outer, row = layout.size
    padded = multiple * sizevars.FloorDiv(row + multiple - 1, multiple)
    return dataclasses.replace(layout, stride=sizevars.contiguous_strides([*outer, padded]))


def is_row_padded(layout: Layout) -> bool:
    """Row-major with rows wider apart than they are long: what `row_padded` gives."""
    size, stride = layout.size, layout.stride
    if len(size) < 2 or not all(sizevars.is_static(x) for x in (*size, *stride)) or int(size[-2]) == 1:
        return False
    return int(stride[-2]) > int(size[-1]) and layout.has_strides(sizevars.contiguous_strides([*size[:-1], stride[-2]]))


def meta_layout(val: torch.Tensor, cls=FixedLayout) -> Layout:
    """Layout of a tensor (an FX node's meta value) as the kernels see it: offsets count from its
    data pointer."""
    return cls(val.device, val.dtype, [sizevars.from_torch(s) for s in val.shape],
               [sizevars.from_torch(s) for s in val.stride()])


# ----------------------------------------------------------------------------- base
class IRNode:
    def get_size(self) -> list:
        raise NotImplementedError

    def get_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def get_device(self) -> torch.device:
        raise NotImplementedError

    def make_loader(self) -> Callable[[Sequence[Expr]], Any]:
        raise NotImplementedError

    def get_numel(self) -> Expr:
        return sizevars.product(self.get_size())


# ----------------------------------------------------------------------------- loops
@dataclasses.dataclass(eq=False)
class Loops(IRNode):
    device: torch.device
    dtype: torch.dtype
    inner_fn: Callable
    ranges: list

    def get_size(self):
        return self.ranges

    def get_dtype(self):
        return self.dtype

    def get_device(self):
        return self.device

    reduction_ranges = ()  # a Reduction's own field; none for a Pointwise

    def value(self, index, rindex=None):
        """The body's value at `index` under the active ops handler (a Reduction's: the values
        over `rindex` combined)."""
        return self.inner_fn(index)


class Pointwise(Loops):
    def make_loader(self):
        return self.inner_fn

    def __str__(self):
        return f"Pointwise({self.dtype}, ranges={self.ranges}, body={body_str(self)})"


@dataclasses.dataclass(eq=False)
class Reduction(Loops):
    reduction_ranges: list = dataclasses.field(default_factory=list)
    reduction_type: str = "sum"
    src_dtype: torch.dtype = torch.float32
    # (parts, rows) of a column sum's first stage (lowering/reduction.py): part s sums rows s,
    # s + parts, ...; only the parts' total is read, so a row kernel may deal them out (mix_order.py)
    column_parts: tuple = ()

    def make_loader(self):
        raise AssertionError("a Reduction is realized before it is read")

    def value(self, index, rindex=None):
        return ops.reduction(self.dtype, self.src_dtype, self.reduction_type, self.inner_fn(index, rindex))

    def __str__(self):
        return (f"Reduction({self.reduction_type}, {self.dtype}, ranges={self.ranges}, "
                f"reduction_ranges={self.reduction_ranges}, body={body_str(self)})")


def body_str(loops: Loops) -> str:
    """Render a loop body with the dependency recorder (for dumps)."""
    return trace_body(loops).text


# ----------------------------------------------------------------------------- buffers
class LaidOut(IRNode):
    """Something stored: size, dtype and device come from its `layout`."""
    layout: Layout

    def get_size(self):
        return self.layout.size

    def get_dtype(self):
        return self.layout.dtype

    def get_device(self):
        return self.layout.device


@dataclasses.dataclass(eq=False)
class Buffer(LaidOut):
    name: str
    layout: Layout

    def make_loader(self):
        name, layout = self.name, self.layout

        def loader(index):
            return ops.load(name, layout.index(index))
        return loader

    def freeze_layout(self):
        if isinstance(self.layout, FlexibleLayout):
            self.layout = FixedLayout(**{f.name: getattr(self.layout, f.name)
                                         for f in dataclasses.fields(Layout)})


class InputBuffer(Buffer):
    """A graph input; named by its FX placeholder."""


@dataclasses.dataclass(frozen=True)
class OpaqueInput:
    """A graph input that is an object, not a tensor or a number (a DeviceMesh, which DTensor
    graphs take and hand back): the generated code uses the one each call receives, never the
    (fake) object seen while compiling."""
    name: str
    example: Any


class DonatedBuffer(InputBuffer):
    """A backward input whose memory is the graph's: a saved activation that only this graph
    still references (AOTAutograd donates it), spanning its whole storage alone. Freed after
    its last use like a buffer of ours, and its memory may be taken over by one."""


class ConstantBuffer(Buffer):
    """A tensor constant of the graph module (get_attr)."""


@dataclasses.dataclass(eq=False)
class ComputedBuffer(Buffer):
    data: Loops = None

    def is_reduction(self) -> bool:
        return isinstance(self.data, Reduction)

    @property
    def mutates(self) -> list:
        return [self.layout.target] if isinstance(self.layout, MutationLayout) else []

    def store_body(self, index, rindex=None):
        """Run the body at `index` under the active ops handler: load, compute, store."""
        store = ops.store_reduction if self.is_reduction() else ops.store
        value = self.data.value(index, rindex)
        return store(self.name, self.layout.store_index(index), value)

    def __str__(self):
        return f"{self.name}: {type(self.layout).__name__}{list(self.layout.size)} = {self.data}"


@dataclasses.dataclass(eq=False)
class ExternKernel(Buffer):
    """An aten op run as is. With `out_variant`, the wrapper allocates the output."""
    op: Any = None
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    out_variant: bool = False
    multi_output: bool = False  # returns a tuple; MultiOutput nodes pick its items
    mutates: list = dataclasses.field(default_factory=list)  # buffers the op writes in place
    aliases: bool = False       # outputs may alias inputs: never reuse the inputs' memory
    side_effect: bool = False   # no output; never dead code
    out_view: "ReinterpretView | None" = None  # writes into this slice of another buffer (a cat)
    binds: dict = dataclasses.field(default_factory=dict)  # data-dependent symbol -> keypath into the result

    def inputs(self) -> list:
        leaves = torch.utils._pytree.tree_leaves((self.args, self.kwargs))
        return [x for x in leaves if isinstance(x, (Buffer, ReinterpretView))]

    def __str__(self):
        return f"{self.name}: ExternKernel {self.op}({', '.join(map(_arg_str, self.args))})"


@dataclasses.dataclass(eq=False)
class MatmulTemplate(ExternKernel):
    """`a @ b` by our own Triton kernel (codegen/matmul.py) where aten's mm would run: an out
    variant like it, so it can write into a comm buffer or a cat's slice. `a_loader` is how the
    kernel loads `a`: a buffer's loads, or a pointwise producer recomputed where it is loaded
    (the prologue), never stored; `a_reads` are the buffers that loader reads."""
    a_loader: Any = None
    a_reads: list = dataclasses.field(default_factory=list)
    a_size: list = dataclasses.field(default_factory=list)
    prologue: bool = False

    def inputs(self) -> list:
        return list(self.a_reads) + [self.args[1]]

    def __str__(self):
        what = "prologue" if self.prologue else "a"
        return (f"{self.name}: MatmulTemplate({what} reading {[b.name for b in self.a_reads]}, "
                f"{_arg_str(self.args[1])})")


@dataclasses.dataclass(eq=False)
class DecodeAttention(ExternKernel):
    """SDPA of one query token per sequence over a K/V cache by our own split-KV Triton kernels
    (codegen/decode_attention.py); args (q, k, v, mask or None), each stored. `mask` is "bool",
    "float" or None; `mask_strides` its strides broadcast to [B, Hq, 1, S]."""
    scale: float = 1.0
    mask: str | None = None
    mask_strides: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class ConcatBuffer(Buffer):
    """A cat whose inputs write their own slices of it (extern kernels through `out=`): no copy."""
    parts: list = dataclasses.field(default_factory=list)  # ExternKernels, each with an `out_view`

    def inputs(self) -> list:
        return list(self.parts)

    def __str__(self):
        return f"{self.name}: ConcatBuffer{list(self.layout.size)} written by {', '.join(p.name for p in self.parts)}"


@dataclasses.dataclass(eq=False)
class CommKernel(Buffer):
    """A collective the wrapper renders from its plan (commfuse/collectives.py: `CommPlan`): a
    standalone kernel over symmetric memory, or a call (torch's kernel). `input` is the placed
    buffer its producer wrote; with `plan.inplace`, the result overwrites it."""
    plan: object = None
    input: Buffer = None

    def inputs(self) -> list:
        return [self.input]

    def __str__(self):
        p = self.plan
        return (f"{self.name}: CommKernel {p.collective}[{p.algorithm.name}, {p.reduce_op}, "
                f"group={p.group}, ranks={p.world}]({self.input.name})" + (" in place" if p.inplace else ""))


@dataclasses.dataclass(eq=False)
class MultiOutput(Buffer):
    """The item of a multi-output extern kernel's result at path `index` (`result[i][j]...`)."""
    parent: ExternKernel = dataclasses.field(default=None, repr=False)  # its args list its items: no cycle
    index: tuple = ()


def _arg_str(a):
    if isinstance(a, Buffer):
        return a.name
    if isinstance(a, ReinterpretView):
        return f"reinterpret({a.base.name}, {a.layout.size}, {a.layout.stride})"
    if isinstance(a, (list, tuple)):  # an index list: buffers by name, never a repr with addresses
        return f"[{', '.join(map(_arg_str, a))}]"
    return repr(a)


# ----------------------------------------------------------------------------- what meets other ranks
def is_wait(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and op.name() == "_c10d_functional::wait_tensor"


def is_collective(op) -> bool:  # a c10d functional collective: asynchronous on c10d's stream until its wait
    return isinstance(op, torch._ops.OpOverload) and op.namespace == "_c10d_functional" and not is_wait(op)


def is_p2p(op) -> bool:  # meets one peer, not the group: out of the group's plan
    return is_collective(op) and op._opname in ("isend", "irecv", "batch_p2p_ops")


def sizes_agree(op) -> bool:
    """Do a collective's tensors have the same sizes on every rank? Not all_to_all_single's: each
    rank sends and receives its own split (a mixture of experts' dispatch)."""
    return op._opname != "all_to_all_single"


def meets_ranks(op, effects_only: bool = False) -> bool:
    """May a call of `op` (an FX node's target, an extern's op) meet other ranks, for all we can see? A
    c10d collective, and every op we cannot see into: outside aten / prims / ours (runtime/*.py), such
    as a custom op, send / recv or a higher-order op; or (`effects_only`) one run for its effects alone."""
    if not isinstance(op, torch._ops.OpOverload):
        return True
    return not (is_wait(op) or op.namespace == "commfuse") and (effects_only or op.namespace not in ("aten", "prims"))


# ----------------------------------------------------------------------------- views
@dataclasses.dataclass(eq=False)
class View(IRNode):
    """Reads `base` through `reindex`: view index -> base index."""
    base: "TensorBox"
    size: list
    reindex: Callable[[Sequence[Expr]], Sequence[Expr]]
    dtype: torch.dtype | None = None  # set for bitcast-free dtype views (not used yet)

    def get_size(self):
        return self.size

    def get_dtype(self):
        return self.base.get_dtype()

    def get_device(self):
        return self.base.get_device()

    def make_loader(self):
        inner = self.base.make_loader()
        reindex = self.reindex
        return lambda index: inner(reindex(index))


@dataclasses.dataclass(eq=False)
class ReinterpretView(LaidOut):
    """A strided view of a stored buffer (the wrapper passes it with as_strided)."""
    base: Buffer
    layout: Layout

    def make_loader(self):
        name, layout = self.base.name, self.layout
        return lambda index: ops.load(name, layout.index(index))


# ----------------------------------------------------------------------------- boxes
class TensorBox(IRNode):
    """What lowerings pass around; `data` changes when the value is realized."""

    def __init__(self, data: IRNode):
        self.data = data

    def get_size(self):
        return self.data.get_size()

    def get_dtype(self):
        return self.data.get_dtype()

    def get_device(self):
        return self.data.get_device()

    def make_loader(self):
        return self.data.make_loader()

    def __repr__(self):
        return f"TensorBox({type(self.data).__name__})"

    # realization -------------------------------------------------------------
    def realize(self, order=None) -> Buffer | ReinterpretView:
        """Store this value in a buffer (or find the strided view it already is); loops are
        stored with their dims in `order` (else as the policy says, by default contiguous)."""
        d = self.data
        if isinstance(d, (Buffer, ReinterpretView)):
            return d
        if isinstance(d, Loops):
            order = order or V.choices.stored_order(d) or range(len(d.get_size()))
            layout = V.choices.pad_rows(ordered_layout(d.device, d.dtype, d.get_size(), order))
            buf = V.graph.register_buffer(ComputedBuffer, layout=layout, data=d)
            self.data = buf
            return buf
        if isinstance(d, View):
            root = view_root(self)
            if isinstance(root.data, Pointwise) and V.choices.realize_view_base(self, root):
                root.realize()  # the view becomes a strided view of it: one copy of the values
            strided = as_strided_view(self)
            if strided is not None:
                return strided
            self.data = Pointwise(d.get_device(), d.get_dtype(), d.make_loader(), list(d.get_size()))
            return self.realize(order)
        raise AssertionError(type(d))

    def realize_in_order(self, order) -> Buffer | ReinterpretView:
        """Stored dense with its dims in `order`: loops stored so, a value stored otherwise copied."""
        stored = self.realize(order)
        if stored.layout.has_strides(ordered_layout(None, None, stored.get_size(), order).stride):
            return stored
        copy = Pointwise(stored.get_device(), stored.get_dtype(), stored.make_loader(), list(stored.get_size()))
        return TensorBox(copy).realize(order)

    def realize_rows_aligned(self, multiple: int) -> Buffer | ReinterpretView:
        """Stored with rows that start at multiples of `multiple` elements: loops stored so (rows
        padded where they are not that long), a value stored otherwise copied."""
        d = self.data
        if not isinstance(d, Loops):
            stored = self.realize()
            st = stored.layout.stride
            if not st or st[-1] == 1 and all(sizevars.is_static(x) and int(x) % multiple == 0 for x in st[:-1]):
                return stored
            d = Pointwise(stored.get_device(), stored.get_dtype(), stored.make_loader(), list(stored.get_size()))
        size = d.get_size()
        layout = row_padded(ordered_layout(d.device, d.dtype, size, range(len(size))), multiple)
        buf = V.graph.register_buffer(ComputedBuffer, layout=layout, data=d)
        if d is self.data:
            self.data = buf
        return buf



def stored(x):
    """The buffer that holds `x`: a ReinterpretView's base, else `x` itself."""
    return x.base if isinstance(x, ReinterpretView) else x


def view_root(box: TensorBox) -> TensorBox:
    """The box a chain of views reads from."""
    while isinstance(box.data, View):
        box = box.data.base
    return box


def _view_affine(box: TensorBox, layout: Layout):
    """(strides, offset) of a view chain over storage laid out as `layout`, if affine."""
    size = box.get_size()
    vars = [index_symbol("v", i) for i in range(len(size))]
    chain, node = [], box.data
    while isinstance(node, View):
        chain.append(node.reindex)
        node = node.base.data
    index = list(vars)
    for reindex in chain:
        index = list(reindex(index))
    flat = layout.index(index)
    # heads split off a flattened dim leave x // 24 beside x % 12 terms, affine only knowing x < 12
    return sizevars.affine_coefficients(flat, vars) or sizevars.affine_coefficients(
        sizevars.simplify_with_ranges(flat, dict(zip(vars, size))), vars)


def is_strided_over_contiguous(box: TensorBox) -> bool:
    """Would this view chain be a strided view if the value it reads were stored contiguously?"""
    root = view_root(box)
    return _view_affine(box, contiguous_layout(root.get_device(), root.get_dtype(), root.get_size())) is not None


def is_reshape_of_root(box: TensorBox) -> bool:
    """Does this view chain read its root's values in their row-major order (a reshape, or none)?"""
    root = view_root(box)
    affine = _view_affine(box, contiguous_layout(root.get_device(), root.get_dtype(), root.get_size()))
    want = sizevars.contiguous_strides(box.get_size())
    return affine is not None and sizevars.equal(affine[1], 0) and all(
        sizevars.equal(a, b) for a, b, n in zip(affine[0], want, box.get_size()) if not sizevars.equal(n, 1))


def as_strided_view(box: TensorBox) -> ReinterpretView | None:
    """If a view chain over a stored buffer is affine in its index, the strided view it is."""
    size = box.get_size()
    node = view_root(box).data
    if isinstance(node, ReinterpretView):
        base, layout = node.base, node.layout
    elif isinstance(node, Buffer):
        base, layout = node, node.layout
    else:
        return None
    affine = _view_affine(box, layout)
    if affine is None:
        return None
    strides, offset = affine
    if isinstance(base, ComputedBuffer) and isinstance(base.layout, FlexibleLayout):
        base.freeze_layout()
    return ReinterpretView(base, FixedLayout(layout.device, layout.dtype, list(size),
                                             list(strides), offset))


def body_reads(loops: Loops) -> set:
    return {r.name for r in trace_body(loops).reads}
