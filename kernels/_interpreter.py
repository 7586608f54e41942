"""Fixes for Triton 3.6's interpreter, applied on import (the last three at the first launch, which
only a process that interprets makes). Compiled kernels are not touched.

Loop bounds under NumPy 2.4 and later. The interpreter (TRITON_INTERPRET=1: the kernels on the
CPU, as their tests run them) turns a tensor used as a Python integer, such as a loop bound, into
one with `int(tensor.handle.data)`. Scalars are arrays of one element and one dimension there,
which NumPy 2.4 refuses to convert: `range(0, tl.max(lim, 0), BN)` in kernels/paged_prefill.py,
and every loop with a bound read from memory, raise TypeError. This takes the element instead
(`.item()`), as upstream did (triton-lang/triton#9171).

The language patched once a launch. Every launch, and every call of a @triton.jit helper inside
one, patches triton.language anew (`_patch_lang`): it finds the language's builtins with
`inspect.getmembers` and wraps each in a new function, milliseconds each time; with the helpers
our kernels call in their loops, that was over a third of the interpreter's time. Here a launch
patches triton.language and its core (the modules `_patch_lang` patches) with wrappers made
once, and restores them when it returns, as before; a helper called inside the launch finds
them patched and is not patched again. The wrappers are those Triton makes (`_patch_attr`).

A shape's type made once. Every tensor the interpreter makes holds its shape as a
`triton.language.tuple` (the module's name `tuple` is that class), whose type Triton builds
anew from the values, a type object and a name string per dimension; a tensor's block type does
it again. Over a third of an interpreted kernel's time went there. Under the interpreter, the
type of a tuple of plain integers (and constexprs of them) is now looked up by its values; it is
the same type Triton would build, shared. With the next two, a test of the serving engine's
graphs (tests/serve/test_engine_graphs.py's script) went from 40.6 s to 22.9 s.

Overflow checks in NumPy. Under the interpreter every 32-bit integer add, subtract and multiply
is checked for overflow by redoing it in 64 bits through Triton's semantic layer (two casts, the
operation, two constants, two comparisons, an and and an assert: each a Python object per
program); here the same check runs on the operands' NumPy arrays, with Triton's message.
A NumPy dtype per Triton dtype is looked up in a table made once, not built at each call.
"""

from __future__ import annotations

try:
    from triton.runtime import interpreter as _interpreter
except ImportError:  # another Triton: nothing to fix
    _interpreter = None


def _index(self) -> int:
    return int(self.handle.data.item())


def _patch() -> None:
    original = getattr(_interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "one_element_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)  # restored with the rest when the kernel returns

    patch_lang_tensor.one_element_index = True
    _interpreter._patch_lang_tensor = patch_lang_tensor


class _Both:
    """A function whose globals name both modules `_patch_lang` patches."""

    __globals__: dict = {}


def _patch_once() -> None:
    it = _interpreter
    needed = ("GridExecutor", "_patch_lang", "_patch_builtin", "_patch_attr", "_LangPatchScope", "tl")
    if not all(hasattr(it, n) for n in needed) or getattr(it._patch_lang, "once_a_launch", False):
        return
    original, patch_attr, tl = it._patch_lang, it._patch_attr, it.tl
    _Both.__globals__ = {"tl": tl, "core": tl.core}
    wrappers: dict[int, list[tuple[str, object]]] = {}  # id(module or class) -> (name, Triton's wrapper)
    state = {"launch": False}

    class Made:  # collects the wrapper _patch_attr makes instead of setting it
        def set_attr(self, obj, name, value):
            self.value = value

    def patch_builtin(pkg, builder, scope):
        found = wrappers.get(id(pkg))
        if found is None:  # the first launch: nothing is patched yet
            import inspect

            found = wrappers[id(pkg)] = []
            for name, member in inspect.getmembers(pkg):
                if tl.core.is_builtin(member):
                    made = Made()
                    patch_attr(pkg, name, member, builder, made)
                    found.append((name, made.value))
        for name, wrapper in found:
            scope.set_attr(pkg, name, wrapper)

    def patch_lang(fn):
        if state["launch"]:  # a helper inside a launch: the launch patched everything it can see
            return it._LangPatchScope()
        return original(fn)

    launch = it.GridExecutor.__call__

    def call(self, *args, **kwargs):
        if not state.get("interpreting"):  # the first launch: this process interprets
            state["interpreting"] = True
            _patch_tuple_types()
            _patch_overflow_checks()
            _patch_np_dtypes()
        if state["launch"]:  # a launch inside a launch: as Triton does it
            return launch(self, *args, **kwargs)
        scope = original(_Both)
        state["launch"] = True
        try:
            return launch(self, *args, **kwargs)  # its own _patch_lang is patch_lang: nothing
        finally:
            state["launch"] = False
            scope.restore()

    patch_lang.once_a_launch = True
    it._patch_lang = patch_lang
    it._patch_builtin = patch_builtin
    it.GridExecutor.__call__ = call


def _patch_tuple_types() -> None:
    core = getattr(_interpreter.tl, "core", None)
    cls = getattr(core, "tuple", None)
    needed = ("constexpr", "tuple_type", "_type_for_tuple_values")
    if cls is None or not all(hasattr(core, n) for n in needed) or getattr(cls.__init__, "types_once", False):
        return
    original, constexpr, type_for = cls.__init__, core.constexpr, core._type_for_tuple_values
    made: dict[tuple, object] = {}

    def init(self, args, type=None):
        if type is not None:
            return original(self, args, type)
        values = [i for i in args]
        key = []
        for v in values:
            if v.__class__ is int:
                key.append(v)
            elif v.__class__ is constexpr and v.value.__class__ is int:
                key.append((v.value,))  # a constexpr's type is built from its value, as an int's
            else:  # anything else: as Triton does it
                self.values = values
                self.type = type_for(values)
                return
        key = (*key,)
        t = made.get(key)
        if t is None:
            if len(made) >= 4096:
                made.clear()
            t = made[key] = type_for(values)
        self.values = values
        self.type = t

    init.types_once = True
    cls.__init__ = init


def _patch_overflow_checks() -> None:
    import numpy as np
    from triton.language.semantic import TritonSemantic

    original = getattr(TritonSemantic, "binary_op_sanitize_overflow_impl", None)
    if original is None or getattr(original, "numpy", False):
        return
    ops = {"add": np.add, "sub": np.subtract, "mul": np.multiply}

    def check(self, lhs, rhs, binary_op):
        ty = lhs.type.scalar
        if ty.int_bitwidth >= 64 or not self.builder.options.sanitize_overflow:
            return None
        op = ops.get(getattr(binary_op, "__name__", ""))
        a, b = getattr(lhs.handle, "data", None), getattr(rhs.handle, "data", None)
        if op is None or not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray) or ty != rhs.type.scalar:
            return original(self, lhs, rhs, binary_op)
        r = op(a.astype(np.int64), b.astype(np.int64))
        assert ((r <= ty.get_int_max_value()) & (r >= ty.get_int_min_value())).all(), \
            f"int{ty.int_bitwidth} overflow detected for operation {binary_op.__name__}"
        return None

    check.numpy = True
    TritonSemantic.binary_op_sanitize_overflow_impl = check


def _patch_np_dtypes() -> None:
    it, tl = _interpreter, _interpreter.tl
    original = getattr(it, "_get_np_dtype", None)
    if original is None or getattr(original, "table", False):
        return
    table: dict = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return original(tt_dtype)
        try:
            return table[tt_dtype]
        except KeyError:
            table[tt_dtype] = found = original(tt_dtype)
            return found

    np_dtype.table = True
    it._get_np_dtype = np_dtype


if _interpreter is not None:
    _patch()
    _patch_once()
