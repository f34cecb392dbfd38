# One image for every service in docker-compose.yml (api, worker, nightly, ray-head, ray-worker):
# Ray refuses to join nodes whose Python or Ray versions differ, so they must all share it.
#
# CPU build (default):    docker compose build
# NVIDIA build:           docker compose build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Ascend builds install torch_npu on top of the CPU wheel; see the ray-worker-gpu comment in docker-compose.yml.
FROM python:3.11-slim

# torch comes from this index, at the version pinned in constraints/cpu.txt; a plain PyPI install
# would pull a multi-GB CUDA build onto CPU-only machines.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# g++: torch.compile (Inductor) generates and compiles C++ kernels on CPU trials.
# curl: the healthchecks in docker-compose.yml.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# torch first, in its own layer: it is the slow download and changes least often.
COPY constraints/ constraints/
RUN pip install --index-url "$TORCH_INDEX_URL" -c constraints/cpu.txt torch

COPY . .
# Editable: search spaces (search_spaces/*.yaml) are read from the source tree next to the package.
RUN pip install -c constraints/cpu.txt -e . \
    && useradd --create-home --uid 1000 tuner \
    && mkdir -p /data /reports \
    && chown tuner:tuner /data /reports

# No secrets here: the database password and API tokens come from the environment (.env) at run time.
USER tuner
ENV TUNER_ARTIFACT_DIR=/data/artifacts
# Trial folders (runs/), the default SQLite file and caches go to the writable /data volume.
WORKDIR /data
EXPOSE 8000
CMD ["tuner", "--help"]
