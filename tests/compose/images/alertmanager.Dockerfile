# Stand-in for prom/alertmanager (no registry here): Debian's prometheus-alertmanager package, with the upstream
# image's user, working folder, port, volume and entrypoint. The compose test tags it with the name compose.yaml uses.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       prometheus-alertmanager wget \
    && rm -rf /var/lib/apt/lists/* && ln -sf /usr/bin/prometheus-alertmanager /usr/bin/alertmanager \
    && install -d -o nobody -g nogroup /alertmanager
USER nobody
WORKDIR /alertmanager
EXPOSE 9093
VOLUME ["/alertmanager"]
ENTRYPOINT ["/bin/alertmanager"]
CMD ["--config.file=/etc/alertmanager/alertmanager.yml", "--storage.path=/alertmanager"]
