# The appliance image, built offline: every Python package comes from ./wheelhouse (pip --no-index), which
# scripts/build-wheelhouse fills where an index is reachable. Targets from one file:
#   GPU (default):      docker build -t appliance:gpu .                       (wheelhouse: APPLIANCE_WHEELHOUSE_EXTRAS=gpu)
#   CPU:                docker build --build-arg ENGINE_BUILD=cpu -t appliance:cpu .
#   monitoring-config:  docker build --target config -t appliance:config .   (renders Prometheus/Alertmanager files)
#   quota store:        docker build --target quota-store -t appliance:quota-store .  (Redis for several gateways)
# BASE_IMAGE: any Debian-family image; one without Python gets Debian's python3 (bookworm: 3.11, as vLLM needs).
# compose.yaml builds all three.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH APPLIANCE_MONITORING__ASSETS_DIR=/opt/appliance
# tini: PID 1 that reaps orphans (an engine's children outlive it when it crashes) and forwards SIGTERM.
RUN set -eux; packages="tini"; \
    command -v python3 >/dev/null || packages="$packages python3 python3-venv python3-dev"; \
    apt-get update; DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -c 'import sys; assert sys.version_info >= (3, 11), f"Python {sys.version}: vLLM needs 3.11+"'

# Only the build stages see the wheelhouse; the images get the installed virtualenv.
FROM base AS wheels
COPY wheelhouse /wheelhouse
RUN test -f /wheelhouse/.complete || { echo "wheelhouse/ is incomplete: run scripts/build-wheelhouse" >&2; exit 1; }

# What `appliance monitoring-config` imports (tests/monitoring/test_bundle.py keeps that list true).
FROM wheels AS config-venv
RUN python3 -m venv /opt/venv \
    && pip install --no-index --find-links /wheelhouse \
       "pydantic-settings>=2.6" "pyyaml>=6" "httpx>=0.27" "prometheus-client>=0.20" "setuptools>=68"

# The dependencies before the source, so that a code change reuses this (slow) layer.
# PyPI's torchvision/torchaudio/torchcodec break imports beside the +cpu torch; vLLM's CPU build needs none.
FROM wheels AS engine-venv
ARG ENGINE_BUILD=gpu
# Only pyproject.toml: an edit of README.md (or of the code) must not reinstall gigabytes of dependencies.
COPY pyproject.toml /tmp/deps/
# One wheelhouse may hold both torch builds, and pip prefers torch==X+cpu to torch==X (a higher local version),
# which also satisfies vllm's pin: the GPU image excludes the +cpu build and checks that torch has CUDA.
RUN mkdir /tmp/deps/appliance && touch /tmp/deps/appliance/__init__.py /tmp/deps/README.md \
    && if [ "$ENGINE_BUILD" = gpu ]; then \
         ls /wheelhouse | sed -n 's/^torch-\([0-9.]*+cpu\)-.*/torch!=\1/p' >/tmp/deps/constraints.txt; \
       else : >/tmp/deps/constraints.txt; fi \
    && python3 -m venv /opt/venv \
    && pip install --no-index --find-links /wheelhouse -c /tmp/deps/constraints.txt \
       "setuptools>=68" "/tmp/deps[${ENGINE_BUILD}]" \
    && pip uninstall -y appliance \
    && if [ "$ENGINE_BUILD" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi \
    && if [ "$ENGINE_BUILD" = gpu ]; then \
         python3 -c 'import sys, torch; sys.exit(None if torch.version.cuda else f"torch {torch.__version__}: no CUDA")'; \
       fi

# Small image for `appliance monitoring-config`: the package without the engine and its GBs of dependencies.
FROM base AS config
COPY --from=config-venv /opt/venv /opt/venv
WORKDIR /opt/appliance
COPY pyproject.toml README.md ./
COPY appliance ./appliance
COPY alerts ./alerts
COPY dashboards ./dashboards
RUN pip install --no-index --no-deps --no-build-isolation . && rm -rf build *.egg-info
ENTRYPOINT ["appliance"]
CMD ["monitoring-config", "--help"]

FROM base AS appliance
ENV APPLIANCE_HOST=0.0.0.0 APPLIANCE_STATE_DIR=/var/lib/appliance
# gcc/g++: torch's CPU inductor compiles kernels at run time; libnuma: vLLM's CPU thread binding.
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       gcc g++ libnuma1 curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=engine-venv /opt/venv /opt/venv
WORKDIR /opt/appliance
COPY pyproject.toml README.md ./
COPY appliance ./appliance
COPY alerts ./alerts
COPY dashboards ./dashboards
# Served by the gateway at /runbooks/{alertname} (every alert's runbook_url; appliance/paths.py RUNBOOKS_DIR).
COPY docs/runbooks ./docs/runbooks
RUN pip install --no-index --no-deps --no-build-isolation . && rm -rf build *.egg-info
# A fixed UID, so that a host folder mounted as APPLIANCE_MODELS_DIR can be given to it: chown 10001.
# The models folder exists (owned by the appliance) so that a fresh named volume mounted there inherits it.
# appliance-engine (10002, a group of its own and no other): the engines' user where the appliance can switch to it
# (engine.user; compose starts the image as root for that, deploy/image/entrypoint): it reads the models and
# writes only its home (a volume in compose), never the appliance's secrets. The state folder is searchable by it
# (o+x, not listable), so that it reaches the models and the statistics folder below.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /var/lib/appliance appliance \
    && useradd --system --uid 10002 --user-group --create-home --home-dir /var/lib/appliance-engine \
       --shell /usr/sbin/nologin appliance-engine \
    && chmod 0711 /var/lib/appliance && chmod 0700 /var/lib/appliance-engine \
    && install -d -o appliance -g appliance /var/lib/appliance/models /var/lib/appliance/logs
COPY deploy/image/entrypoint /usr/local/bin/appliance-entrypoint
USER appliance
# Engine output on the container's stdout too (`docker logs`), besides the rotated files under logs/.
ENV APPLIANCE_ENGINE_LOG_STDOUT=true
EXPOSE 8000
# SIGTERM drains: in-flight requests finish (drain_timeout_seconds), then engines stop, exit 0.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health/ready || exit 1
# As root (compose), the entrypoint becomes the appliance user before anything runs; as the appliance, it just runs.
ENTRYPOINT ["tini", "--", "appliance-entrypoint"]
CMD ["up", "--no-monitoring"]

# The tenants' shared quota store for several gateways (Kubernetes: deploy/kubernetes/base/quota-store.yaml):
# Debian's redis-server and nothing else, no Python. docker build --target quota-store -t appliance:quota-store .
FROM ${BASE_IMAGE} AS quota-store
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server tini \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/image/quota-store /usr/local/bin/quota-store
# Any non-root user will do (Kubernetes sets 10003); the store writes only /tmp (its config with the password).
USER 10003:10003
EXPOSE 6379
ENTRYPOINT ["tini", "--", "quota-store"]
