"""The native part of the package: the control law in C (`vgpu_agent/throttle/_lawc.c`) and
the lean read of a `state` header (`vgpu_agent/shm/_statec.c`).

Everything else is in pyproject.toml. Both extensions are optional: where no C compiler is
found the package installs without them and the agent runs the same law and the same read in
Python (`nativelaw.NATIVE` and `headerread.NATIVE_READ` say which runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "vgpu_agent.throttle._lawc",
            ["vgpu_agent/throttle/_lawc.c"],
            # floats as Python computes them: no fused multiply-adds, no fast-math
            extra_compile_args=["-std=c11", "-O2", "-ffp-contract=off", "-fno-fast-math",
                                "-Wall", "-Wextra"],
            optional=True,
        ),
        Extension(
            "vgpu_agent.shm._statec",
            ["vgpu_agent/shm/_statec.c"],
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra"],
            optional=True,
        ),
    ]
)
