"""Triton's interpreter before 3.7 calls int() on one-element NumPy arrays, which NumPy 2.4 refuses
(tinytransformer/triton_support.py: repair_interpreter_for_numpy). The repair is checked here against a stand-in
of the old interpreter's patching function, so it is tested whatever Triton this machine has; with Triton 3.6
itself (torch 2.11's) the interpreter tests of the kernels pass with it and fail without it."""
import types

import numpy as np
import pytest

from tinytransformer import triton_support
from tinytransformer.triton_support import interpreter_needs_the_numpy_repair

interpreter = pytest.importorskip("triton.runtime.interpreter")


@pytest.mark.parametrize("triton_version, numpy_version, needed", [
    ("3.6.0", "2.4.0", True),
    ("3.0.0", "2.5.2", True),
    ("3.6.0+git1a2b3c", "2.4.0rc1", True),
    ("3.6.0", "2.3.5", False),     # this NumPy still converts a one-element array
    ("3.7.0", "2.4.6", False),     # this Triton converts the element itself
    ("3.10.0", "2.5.0", False),    # minor versions compare as numbers, not as text
    ("4.0.0", "3.0.0", False),
])
def test_the_repair_is_needed_only_where_an_old_triton_meets_a_new_numpy(triton_version, numpy_version, needed):
    assert interpreter_needs_the_numpy_repair(triton_version, numpy_version) is needed


class RecordingScope:
    """Like the scope of newer interpreters: sets an attribute and remembers it, to restore after a launch."""
    def __init__(self):
        self.changes = []

    def set_attr(self, obj, name, value):
        self.changes.append(name)
        setattr(obj, name, value)


def old_patch_with_scope(tensor, scope):
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))


def old_patch_without_scope(tensor):
    tensor.__index__ = lambda self: int(self.handle.data)


def a_one_element_tensor_class():
    class Tensor:
        def __init__(self, value):
            self.handle = types.SimpleNamespace(data=np.array([value], dtype=np.int32))
    return Tensor


@pytest.mark.parametrize("old_patch, with_scope", [(old_patch_with_scope, True), (old_patch_without_scope, False)])
def test_after_the_repair_a_one_element_array_indexes_as_its_element(monkeypatch, old_patch, with_scope):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("triton.__version__", "3.6.0")
    monkeypatch.setattr(np, "__version__", "2.4.0")
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", old_patch)
    Tensor = a_one_element_tensor_class()

    assert triton_support.repair_interpreter_for_numpy()
    args = (Tensor, RecordingScope()) if with_scope else (Tensor,)
    interpreter._patch_lang_tensor(*args)
    assert range(7)[Tensor(5)] == 5 and list(range(Tensor(2), 6, Tensor(3))) == [2, 5]
    if with_scope:   # set through the scope, so the launch's clean-up removes it like the rest
        assert args[1].changes == ["__index__", "__index__"]

    wrapped = interpreter._patch_lang_tensor
    assert triton_support.repair_interpreter_for_numpy()
    assert interpreter._patch_lang_tensor is wrapped   # a second call does not wrap it twice


def test_without_the_repair_the_old_conversion_fails_on_this_numpy(monkeypatch):
    """What the repair is for: with NumPy 2.4 or newer, the old interpreter's int() of a one-element array
    raises. (On an older NumPy it converts, and there is nothing to show.)"""
    if not interpreter_needs_the_numpy_repair("3.6.0", np.__version__):
        pytest.skip(f"NumPy {np.__version__} still converts a one-element array to an int")
    Tensor = a_one_element_tensor_class()
    old_patch_without_scope(Tensor)
    with pytest.raises(TypeError, match="0-dimensional"):
        range(7)[Tensor(5)]


@pytest.mark.parametrize("triton_version, numpy_version, interpret", [
    ("3.9.0", "2.4.0", "1"),    # a Triton that converts the element itself
    ("3.6.0", "2.3.0", "1"),    # a NumPy that still converts
    ("3.6.0", "2.4.0", "0"),    # Triton compiles for a GPU: no interpreter to repair
])
def test_the_interpreter_is_left_alone_where_nothing_needs_repair(monkeypatch, triton_version, numpy_version,
                                                                  interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr("triton.__version__", triton_version)
    monkeypatch.setattr(np, "__version__", numpy_version)
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", old_patch_without_scope)
    assert not triton_support.repair_interpreter_for_numpy()
    assert interpreter._patch_lang_tensor is old_patch_without_scope
