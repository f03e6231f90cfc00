# The appliance image. Targets from one file:
#   GPU (default):      docker build -t appliance:gpu .
#   CPU:                docker build --build-arg ENGINE_BUILD=cpu -t appliance:cpu .
#   monitoring-config:  docker build --target config -t appliance:config .   (renders Prometheus/Alertmanager files)
# compose.yaml builds all three.

# Small image for `appliance monitoring-config`: the package without the engine and its GBs of dependencies.
FROM python:3.11-slim AS config
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    APPLIANCE_MONITORING__ASSETS_DIR=/opt/appliance
WORKDIR /opt/appliance
COPY pyproject.toml README.md ./
COPY appliance ./appliance
COPY alerts ./alerts
COPY dashboards ./dashboards
# What `appliance monitoring-config` imports (tests/monitoring/test_bundle.py keeps that list true).
RUN pip install "pydantic-settings>=2.6" "pyyaml>=6" "httpx>=0.27" "prometheus-client>=0.20" \
    && pip install --no-deps .
ENTRYPOINT ["appliance"]
CMD ["monitoring-config", "--help"]

FROM python:3.11-slim AS appliance
ARG ENGINE_BUILD=gpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    APPLIANCE_HOST=0.0.0.0 APPLIANCE_STATE_DIR=/var/lib/appliance \
    APPLIANCE_MONITORING__ASSETS_DIR=/opt/appliance
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libnuma1 curl \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/appliance
COPY pyproject.toml README.md ./
COPY appliance ./appliance
COPY alerts ./alerts
COPY dashboards ./dashboards
# The CPU build takes torch's CPU wheel (PyPI's default torch for x86_64 is the CUDA one, several GB).
RUN if [ "$ENGINE_BUILD" = cpu ]; then export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu; fi \
    && pip install ".[${ENGINE_BUILD}]" \
    && if [ "$ENGINE_BUILD" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec || true; fi
RUN useradd --system --create-home --home-dir /var/lib/appliance appliance
USER appliance
EXPOSE 8000
# SIGTERM drains: in-flight requests finish (drain_timeout_seconds), then engines stop, exit 0.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health/ready || exit 1
ENTRYPOINT ["appliance"]
CMD ["up", "--no-monitoring"]
