# A fresh Debian machine for tests/compose/test_fresh_clone.py: the base image plus only the packages the README's
# fresh-machine command installs (the test reads them from README.md and passes them as PACKAGES), installed as
# that command does (recommends included). No Python packages, no pip configuration.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
ARG PACKAGES
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y ${PACKAGES} \
    && rm -rf /var/lib/apt/lists/*
