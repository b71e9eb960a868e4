"""Compile recorded launches for a target, as Triton would at the first launch on that GPU.

Triton's launch binds the arguments (JITFunction's binder: which integers are 1 or multiples of 16, which
pointers are 16-byte aligned, which arguments are constexprs), then compiles an ASTSource for the current GPU.
Here the binder is the one Triton builds for the target's backend, and the compile names the target explicitly,
so no GPU (and no driver) is needed.
"""
from __future__ import annotations

import dataclasses
import warnings

from .discovery import Launch
from .targets import Target


@dataclasses.dataclass
class Compiled:
    """One distinct launch configuration of one kernel, compiled (or not) for one target."""
    kernel: str
    source: str
    target: str
    config: dict                    # the launch's constexprs and options as the caller chose them
    paths: set = dataclasses.field(default_factory=set)     # model paths that launch it
    presets: set = dataclasses.field(default_factory=set)   # presets at which they do
    error: str | None = None        # the compiler's error, one line
    asm: dict = dataclasses.field(default_factory=dict)     # "amdgcn" text / "cubin" bytes, "ttgir" text
    shared: int = 0                 # bytes of shared memory / LDS Triton asks for at launch
    num_warps: int = 0


def _bind(launch: Launch, backend):
    from triton.runtime.jit import create_function_from_signature
    fn = launch.fn
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    return fn._pack_args(backend, launch.kwargs, bound, specialization, options)


def one_line(error: BaseException) -> str:
    """The compiler's message in one line: its last non-empty line (Triton puts the source excerpt first)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return f"{type(error).__name__}: {text}"[:300]


def _describe(value):
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def distinct_launches(launches: list[Launch], target: Target, preset: str, into: dict) -> dict:
    """Group `launches` by what the compiler sees (kernel, signature, constexprs, attributes, options) into
    `into` (key -> (Compiled, compile arguments)); returns `into`."""
    from triton.compiler.compiler import make_backend
    backend = make_backend(target.triton_target())
    for launch in launches:
        options, signature, constexprs, attrs = _bind(launch, backend)
        key = (launch.source, launch.kernel, repr(signature), repr(sorted(constexprs.items())),
               repr(sorted(attrs.items())), options.num_warps, options.num_stages)
        if key not in into:
            config = {k: _describe(v) for k, v in launch.kwargs.items()}
            config.setdefault("num_warps", options.num_warps)
            config.setdefault("num_stages", options.num_stages)
            into[key] = (Compiled(launch.kernel, launch.source, target.name, config),
                         (launch.fn, signature, constexprs, attrs, options))
        into[key][0].paths.add(launch.path)
        into[key][0].presets.add(preset)
    return into


def compile_one(result: Compiled, arguments, target: Target) -> Compiled:
    import triton
    from triton.compiler import ASTSource
    fn, signature, constexprs, attrs, options = arguments
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # Triton's notices about defaults that will change
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target.triton_target(),
                                    options=options.__dict__)
    except Exception as error:   # any compiler failure is a result to report, not a crash
        result.error = one_line(error)
        return result
    # The machine code for the resources, and Triton's GPU-level IR (ttgir) for the layouts the compiler chose.
    result.asm = {name: kernel.asm[name] for name in ("amdgcn", "cubin", "ttgir") if name in kernel.asm}
    result.shared = int(kernel.metadata.shared)
    result.num_warps = int(kernel.metadata.num_warps)
    return result
