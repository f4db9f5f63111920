"""The tests' name for `vgpu_agent.standins.kubeapi` (the same module object, so patches apply)."""

import sys

from vgpu_agent.standins import kubeapi as _module

sys.modules[__name__] = _module
