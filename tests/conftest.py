"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Property tests judge behaviour, not speed: on a shared, loaded machine example generation and
# single examples can be slow, which must not fail a test.
settings.register_profile(
    "vgpu", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("vgpu")

REPO_ROOT = Path(__file__).resolve().parent.parent
# test modules import the fakes as `tests.fakes...` whichever directory pytest starts from
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.fakes.fakenvml import FakeNvml, build_fake_nvml  # noqa: E402

# ---- fake NVML ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fake_nvml_library() -> Path:
    """Path of the compiled fake libnvidia-ml.so.1 (built once, cached by source hash)."""
    return build_fake_nvml()


@pytest.fixture
def fake_nvml(
    tmp_path: Path, fake_nvml_library: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeNvml]:
    """A fake NVML with two A100s. Its variables are set in this process's environment too,
    so an in-process NvmlBackend(library_path=fake.library_path) reads this inventory."""
    fake = FakeNvml(tmp_path / "nvml", library=fake_nvml_library)
    for key, value in fake.env().items():
        monkeypatch.setenv(key, value)
    yield fake


# ---- logging --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """Code under test may configure structlog for a stream pytest closes afterwards."""
    yield
    import structlog

    structlog.reset_defaults()
