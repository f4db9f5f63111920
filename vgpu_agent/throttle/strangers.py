"""A GPU whose use NVML gives only to processes no container claims, while containers spend.

The controller measures a container by the samples NVML gives its processes. Where a GPU's busy
samples all go to processes that no container claims (an MPS server, if the driver attributes its
clients' work to it; or a process outside Kubernetes taking the GPU) while containers spend
tokens, none of them can be measured: they get no reading, and their rates rest on guesses
(simulated, two strict containers of 60 and 40 % ran at 30 and 19 %, and their turns alone were
spoiled by the stranger's periods). The operator is told once per episode,
after it has lasted `hold_s`, with the pids; the episode ends when a container's process is
seen busy again, or no container spends. Meanwhile the containers that spent in it are the
ones unmeasured (`unmeasured`, their `open_loop` series): a container's claim of spending marks
its own series only, never an idle neighbour's (a tenant may claim up to what its bucket lets
through without running a kernel; beside a process outside the cluster, such a claim alone can
keep an episode going).

Pure: the controller feeds it what each batch of samples showed.
"""

from __future__ import annotations

from collections.abc import Collection

STRANGERS_ONLY_HOLD_S = 10.0  # longer than the host's placement of a new process takes


class _Episode:
    """One GPU's episode: when it began, whether it was told, who spent in it."""

    __slots__ = ("since_ns", "spenders", "told")

    def __init__(self, since_ns: int) -> None:
        self.since_ns = since_ns
        self.told = False
        self.spenders: set[str] = set()


class StrangerWatch:
    """Per GPU: since when its busy samples have gone only to strangers, whether told, and the
    containers that spent meanwhile."""

    __slots__ = ("episodes", "hold_ns")

    def __init__(self, hold_s: float = STRANGERS_ONLY_HOLD_S) -> None:
        if not 0 < hold_s < 3600:
            raise ValueError(f"strangers-only hold must be in (0, 3600) s, got {hold_s!r}")
        self.hold_ns = round(hold_s * 1e9)
        self.episodes: dict[str, _Episode] = {}  # uuid -> its episode going on

    def observe(self, uuid: str, now_ns: int, spent: Collection[str], ours_busy: bool,
                strangers_busy: Collection[int]) -> tuple[int, ...]:
        """One batch of a GPU's samples: the containers that spent tokens, whether any of
        their processes was sampled busy, and the pids of busy processes no container claims.
        Returns those pids, sorted, the one time an episode has lasted the hold; else ()."""
        if not spent or ours_busy:
            self.forget(uuid)
            return ()
        episode = self.episodes.get(uuid)
        if not strangers_busy:
            # a batch with nobody busy says nothing either way: the episode neither grows nor
            # ends on it (but who spent meanwhile is kept)
            if episode is not None:
                episode.spenders.update(spent)
            return ()
        if episode is None:
            episode = self.episodes[uuid] = _Episode(now_ns)
        episode.spenders.update(spent)
        if episode.told or now_ns - episode.since_ns < self.hold_ns:
            return ()
        episode.told = True
        return tuple(sorted(strangers_busy))

    @property
    def reported(self) -> frozenset[str]:
        """The GPUs whose episode has been told and goes on."""
        return frozenset(uuid for uuid, episode in self.episodes.items() if episode.told)

    def unmeasured(self, uuid: str) -> frozenset[str]:
        """The containers that spent on `uuid` during its episode, once told (else none)."""
        episode = self.episodes.get(uuid)
        return frozenset(episode.spenders) if episode is not None and episode.told \
            else frozenset()

    def forget(self, uuid: str) -> None:
        """The episode is over, or the GPU is gone (or its controller state dropped)."""
        self.episodes.pop(uuid, None)
