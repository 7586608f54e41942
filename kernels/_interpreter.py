"""Two fixes for Triton 3.6's interpreter, applied on import. Compiled kernels are not touched.

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


if _interpreter is not None:
    _patch()
    _patch_once()
