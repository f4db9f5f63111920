"""The tests' name for `vgpu_agent.standins.dra_allocator` (the same module object, so patches apply)."""

import sys

from vgpu_agent.standins import dra_allocator as _module

sys.modules[__name__] = _module
