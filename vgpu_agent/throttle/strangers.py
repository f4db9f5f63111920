"""A GPU whose use NVML gives only to processes no container claims, while containers spend.

The controller measures a container by the samples NVML gives its processes. Where a GPU's busy
samples all go to processes that no container claims (an MPS server, if the driver attributes its
clients' work to it; or a process outside Kubernetes taking the GPU) while containers spend
tokens, none of them can be measured: they get no reading, and their rates rest on guesses
(simulated, two strict containers of 60 and 40 % ran at 30 and 19 %, and their turns alone were
spoiled by the stranger's periods). The operator is told once per episode,
after it has lasted `hold_s`, with the pids; the episode ends when a container's process is
seen busy again, or no container spends.

Pure: the controller feeds it what each batch of samples showed.
"""

from __future__ import annotations

from collections.abc import Collection

STRANGERS_ONLY_HOLD_S = 10.0  # longer than the host's placement of a new process takes


class StrangerWatch:
    """Per GPU: since when its busy samples have gone only to strangers, and whether told."""

    __slots__ = ("hold_ns", "since", "told")

    def __init__(self, hold_s: float = STRANGERS_ONLY_HOLD_S) -> None:
        if not 0 < hold_s < 3600:
            raise ValueError(f"strangers-only hold must be in (0, 3600) s, got {hold_s!r}")
        self.hold_ns = round(hold_s * 1e9)
        self.since: dict[str, int] = {}  # uuid -> when the episode began (ns)
        self.told: set[str] = set()  # GPUs whose episode was reported

    def observe(self, uuid: str, now_ns: int, containers_spent: bool, ours_busy: bool,
                strangers_busy: Collection[int]) -> tuple[int, ...]:
        """One batch of a GPU's samples: whether any container spent tokens, whether any of
        their processes was sampled busy, and the pids of busy processes no container claims.
        Returns those pids, sorted, the one time an episode has lasted the hold; else ()."""
        if not containers_spent or ours_busy or not strangers_busy:
            # (a batch with nobody busy says nothing either way: the episode neither grows
            # nor ends on it, unless containers stopped spending)
            if not containers_spent or ours_busy:
                self.since.pop(uuid, None)
                self.told.discard(uuid)
            return ()
        since = self.since.setdefault(uuid, now_ns)
        if uuid in self.told or now_ns - since < self.hold_ns:
            return ()
        self.told.add(uuid)
        return tuple(sorted(strangers_busy))

    @property
    def reported(self) -> frozenset[str]:
        """The GPUs whose episode has been told and goes on."""
        return frozenset(self.told)

    def forget(self, uuid: str) -> None:
        """The GPU is gone (or its controller state dropped)."""
        self.since.pop(uuid, None)
        self.told.discard(uuid)
