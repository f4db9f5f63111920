"""The native part of the package: the control law in C (`vgpu_agent/throttle/_lawc.c`), the
common path of the steering around it (`vgpu_agent/throttle/_steerc.c`), the time-sliced
split's loops over a GPU's containers (`vgpu_agent/throttle/_splitc.c`), the lean read of a
`state` header (`vgpu_agent/shm/_statec.c`) and the metrics' read of a whole `state`
(`vgpu_agent/shm/_usagec.c`).

Everything else is in pyproject.toml. The extensions are optional: where no C compiler is
found the package installs without them and the agent runs the same law and the same read in
Python (`nativelaw.NATIVE`, `headerread.NATIVE_READ` and `usageread.NATIVE_USAGE` say which runs).
"""

from setuptools import Extension, setup

# floats as Python computes them: no fused multiply-adds, no fast-math
PYTHON_FLOATS = ["-ffp-contract=off", "-fno-fast-math"]


def native(name: str, *flags: str, depends: tuple[str, ...] = ()) -> Extension:
    """The optional C module `vgpu_agent.<name>`, from `vgpu_agent/<name>.c` (and the headers
    it includes, `depends`: rebuilt when they change, shipped in the sdist)."""
    return Extension(f"vgpu_agent.{name}", [f"vgpu_agent/{name.replace('.', '/')}.c"],
                     extra_compile_args=["-std=c11", "-O2", *flags, "-Wall", "-Wextra"],
                     depends=list(depends), optional=True)


ABI_WORDS = ("vgpu_agent/shm/_abiwords.h",)


setup(
    ext_modules=[
        native("throttle._lawc", *PYTHON_FLOATS),
        native("throttle._steerc", *PYTHON_FLOATS),
        native("throttle._splitc", *PYTHON_FLOATS),
        native("shm._statec", depends=ABI_WORDS),
        native("shm._usagec", depends=ABI_WORDS),
    ]
)
