# syntax=docker/dockerfile:1
# kv-sidecar daemon image. ROCm by default; for NVIDIA build with a CUDA base and NIXL from PyPI:
#   docker build -t kv-sidecar:rocm .
#   docker build -t kv-sidecar:cuda --build-arg BASE_IMAGE=vllm/vllm-openai:v0.33.0 --build-arg EXTRAS=daemon,nixl .
# The base must already hold a GPU build of torch (and, on ROCm, NIXL with its UCX): the daemon reuses them
# through a venv with --system-site-packages instead of pulling a second, CPU-only torch.
# The image also carries the pure-Python shim for vLLM in /opt/kv-sidecar/shim (deploy/k8s copies it into the
# vLLM container with an init container, so the vLLM image stays stock).

ARG BASE_IMAGE=rocm/vllm:latest
ARG BUILD_IMAGE=python:3.12-slim

# ---------------------------------------------------------------------------------------------------- build
FROM ${BUILD_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
COPY vllm_glue ./vllm_glue
# A pure-Python wheel (py3-none-any): the build interpreter's version does not matter.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist . \
 && pip install --no-cache-dir --no-deps --target /shim /dist/kv_sidecar-*.whl \
 && rm -rf /shim/bin /shim/*.dist-info

# -------------------------------------------------------------------------------------------------- runtime
FROM ${BASE_IMAGE} AS runtime
# daemon: the daemon's Python deps; add nixl on CUDA bases (EXTRAS=daemon,nixl), where NIXL comes from PyPI.
ARG EXTRAS=daemon
ARG KV_SIDECAR_UID=10001
ARG KV_SIDECAR_GID=10001

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=build /dist /tmp/dist
RUN python3 -m venv --system-site-packages /opt/kv-sidecar \
 && /opt/kv-sidecar/bin/pip install --no-cache-dir "$(ls /tmp/dist/kv_sidecar-*.whl)[${EXTRAS}]" \
 && /opt/kv-sidecar/bin/python -c "import torch, sidecar; print('torch', torch.__version__)" \
 && rm -rf /tmp/dist
COPY --from=build /shim /opt/kv-sidecar/shim

# Non-root. In Kubernetes/systemd run it as the uid vLLM runs as: UCX's cma transport and IPC handle imports
# need the same user (runAsUser / User=).
RUN groupadd --system --gid "${KV_SIDECAR_GID}" kv-sidecar \
 && useradd --system --uid "${KV_SIDECAR_UID}" --gid kv-sidecar --home-dir /var/lib/kv-sidecar --create-home \
      --shell /usr/sbin/nologin kv-sidecar \
 && install -d -o kv-sidecar -g kv-sidecar -m 0750 /run/kv-sidecar /var/cache/kv-sidecar

ENV PATH=/opt/kv-sidecar/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HOME=/var/lib/kv-sidecar \
    XDG_CACHE_HOME=/var/cache/kv-sidecar \
    TRITON_CACHE_DIR=/var/cache/kv-sidecar/triton

USER ${KV_SIDECAR_UID}:${KV_SIDECAR_GID}
WORKDIR /var/lib/kv-sidecar
EXPOSE 9464

# /healthz: the process is alive and its event loop answers (readiness, /readyz, also needs vLLM's caches). The
# check reads the port as the daemon does (9464 + N for `serve --gpu N`, or metrics_port from flags, variables
# or the config file), so one image serves every GPU of a host.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
  CMD ["/opt/kv-sidecar/bin/python", "-m", "sidecar.ops.healthcheck"]

ENTRYPOINT ["/opt/kv-sidecar/bin/kv-sidecar"]
CMD ["serve", "--gpu", "0"]
