# The appliance image. Two builds from one file:
#   GPU (default):  docker build -t appliance .
#   CPU:            docker build --build-arg ENGINE_BUILD=cpu -t appliance:cpu .
FROM python:3.11-slim AS base
ARG ENGINE_BUILD=gpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    APPLIANCE_HOST=0.0.0.0 APPLIANCE_STATE_DIR=/var/lib/appliance
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libnuma1 curl \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/appliance
COPY pyproject.toml README.md ./
COPY appliance ./appliance
RUN pip install ".[${ENGINE_BUILD}]" \
    && if [ "$ENGINE_BUILD" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec || true; fi
RUN useradd --system --create-home --home-dir /var/lib/appliance appliance
USER appliance
EXPOSE 8000
# SIGTERM drains: in-flight requests finish (drain_timeout_seconds), then engines stop, exit 0.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health/ready || exit 1
ENTRYPOINT ["appliance"]
CMD ["serve"]
