"""The tests' name for `vgpu_agent.standins.resourceapi` (the same module object, so patches apply)."""

import sys

from vgpu_agent.standins import resourceapi as _module

sys.modules[__name__] = _module
