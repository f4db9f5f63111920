# syntax=docker/dockerfile:1.7
# vgpu-agent node image: the agent (entrypoint `vgpu-agent run`) and the shim it installs on hosts.
# Bases are pinned to exact tags; pin them by digest as well in a release pipeline that can
# resolve them (`docker buildx imagetools inspect <image>`).

# --- shim: compiled against an older glibc than the runtime image on purpose --------------------
# libvgpu.so is loaded into *user* containers, whose glibc may be older than ours. Built on
# Ubuntu 20.04 (glibc 2.31, kept in the archive for years) it loads in any image with
# glibc >= 2.31; built against glibc >= 2.34 it would need dlsym@GLIBC_2.34 and fail there.
FROM ubuntu:20.04 AS shim
ARG DEBIAN_FRONTEND=noninteractive
# Exact package versions are not pinned: the archive drops superseded updates, so pins break
# rebuilds; the base image's release fixes the toolchain (gcc 9, make 4.2).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src/shim
COPY shim/ ./
RUN make \
 && test -f build/libvgpu.so

# --- wheels: the agent and its dependencies, built from the project, not copied as sources ------
# The agent's wheel carries the control law in C (setup.py): the compiler stays in this stage.
FROM python:3.11.7-slim-bookworm AS wheels
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY vgpu_agent/ vgpu_agent/
RUN pip wheel --no-cache-dir --disable-pip-version-check --wheel-dir /wheels . \
 && python -c "import zipfile, glob; names = zipfile.ZipFile(glob.glob('/wheels/vgpu_agent-*.whl')[0]).namelist(); missing = [m for m in ('_lawc', '_steerc', '_splitc', '_statec', '_usagec') if not any(m in n for n in names)]; assert not missing, f'not built in C: {missing}'"

# --- runtime: no compiler, no build tools, no sources -------------------------------------------
FROM python:3.11.7-slim-bookworm
LABEL org.opencontainers.image.title="vgpu-agent" \
      org.opencontainers.image.description="Kubernetes node agent that splits NVIDIA GPUs into enforced vGPU slices" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-index --disable-pip-version-check --find-links=/wheels /wheels/vgpu_agent-*.whl \
 && pip uninstall -y --disable-pip-version-check pip setuptools wheel
COPY --from=shim /src/shim/build/libvgpu.so /opt/vgpu/libvgpu.so
COPY deploy/base/config.yaml /etc/vgpu-agent/config.yaml
# Non-root by default (e.g. `docker run <image> simulate`). The DaemonSet runs the agent as uid 0
# because the kubelet's device-plugin and pod-resources directories are root-owned; it still
# drops every capability there (see deploy/base/daemonset.yaml).
USER 65532:65532
EXPOSE 9394
ENTRYPOINT ["vgpu-agent", "run"]
CMD ["--config", "/etc/vgpu-agent/config.yaml"]
