"""The native part of the package: the control law in C (`vgpu_agent/throttle/_lawc.c`).

Everything else is in pyproject.toml. The extension is optional: where no C compiler is found
the package installs without it and the agent runs the same law in Python (`nativelaw` says
which one runs).
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
        )
    ]
)
