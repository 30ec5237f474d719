# Xronos: one image for the node agent and the controller (and the operator's
# `xronos train` / `xronos status`); the command picks the role:
#   docker run --network host IMAGE node --node-id gw-kitchen --metrics-port 9101
#   docker run --network host IMAGE controller --metrics-port 9100 --state-dir /var/lib/xronos
# Configuration: flags, or XRONOS_BROKER / XRONOS_USERNAME / XRONOS_PASSWORD(_FILE).
# Logs go to stdout/stderr (docker logs). Build notes: deploy/README.md.

# Any Debian-like image with Python >= 3.11 and its venv module: the official
# slim image by default, or one made without a registry (deploy/README.md).
ARG BASE_IMAGE=python:3.11-slim

# -- deps: the virtual environment, from wheels only (nothing is compiled) -----
FROM ${BASE_IMAGE} AS deps
# CPU-only torch: the PyPI build of torch for Linux x86-64 is the CUDA one (GBs).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# An air-gapped site fills ./wheels (deploy/README.md); it holds only a README otherwise.
COPY wheels/ /wheels/
COPY pyproject.toml ./
# The dependencies, read from pyproject.toml (the one place they are pinned).
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
 && python3 -m venv /opt/xronos \
 && if ls /wheels/*.whl >/dev/null 2>&1; then \
        /opt/xronos/bin/pip install --no-index --find-links /wheels -r requirements.txt; \
    else \
        /opt/xronos/bin/pip install --index-url "$TORCH_INDEX_URL" "$(grep '^torch==' requirements.txt)" \
        && /opt/xronos/bin/pip install -r requirements.txt; \
    fi \
 && /opt/xronos/bin/python -c "import torch; assert not torch.version.cuda, 'a CUDA build of torch was installed'"

# -- builder: the project's own wheel. Apart from the venv, so that a code change
# rebuilds a layer of a few hundred KB, not the 1.4 GB of the venv (what every
# device downloads again)
FROM deps AS builder
COPY README.md ./
COPY xronos/ xronos/
COPY edge_node/ edge_node/
COPY controller/ controller/
RUN if ls /wheels/*.whl >/dev/null 2>&1; then set -- --no-index --find-links /wheels; fi \
 && /opt/xronos/bin/pip wheel --no-deps "$@" --wheel-dir /dist .

# -- the image: the base, the venv and a user; no compilers, no pip cache ------
FROM ${BASE_IMAGE}
# Named volumes mounted on these directories start owned by the user (Docker
# copies a mount point's ownership into a fresh volume); `xronos deploy` puts
# the MQTT password in /run/secrets.
RUN groupadd --system --gid 10001 xronos \
 && useradd --system --no-log-init --create-home --home-dir /home/xronos --uid 10001 --gid 10001 xronos \
 && mkdir -p /models /data /checkpoints /var/lib/xronos /run/secrets \
 && chown xronos:xronos /models /data /checkpoints /var/lib/xronos
COPY --from=deps /opt/xronos /opt/xronos
COPY --from=builder /dist/ /dist/
RUN /opt/xronos/bin/pip install --no-cache-dir --no-deps --no-index /dist/*.whl \
 && rm -rf /dist \
 && /opt/xronos/bin/xronos --version
# Unbuffered: a log line reaches `docker logs` when it is written. Models are
# local directories: never ask the Hugging Face hub.
ENV PATH=/opt/xronos/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
USER 10001:10001
WORKDIR /home/xronos
# Healthy = the process's --metrics-port answers /metrics (xronos/healthcheck.py).
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 CMD ["python", "-m", "xronos.healthcheck"]
ENTRYPOINT ["xronos"]
CMD ["--help"]
