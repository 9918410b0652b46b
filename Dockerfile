# Sluice production image.
#   docker build -t sluice:0.1.0 .
#   docker run --stop-timeout 35 -p 8080:8080 -p 9901:9901 -v "$PWD/my-sluice.yaml:/etc/sluice/sluice.yaml:ro" sluice:0.1.0
# --stop-timeout is server.drain_timeout + 5 s (35 for config/sluice.yaml's 30s drain), so a
# stop drains and exits before docker's SIGKILL; the baked config's 5s fits the default 10.
# The config is read from /etc/sluice/sluice.yaml (mount a file or a Kubernetes ConfigMap
# there; edits are picked up live). Both stages use the same exact base tag, so the virtualenv
# built in the first runs unchanged in the second; pin it to a digest in your registry mirror.

FROM python:3.11.13-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY policies ./policies
# Every dependency ships binary wheels, so no compiler is needed even here; pip itself is
# removed from the virtualenv so the final image has no installer either.
RUN python -m venv /opt/sluice \
    && /opt/sluice/bin/pip install --no-cache-dir . \
    && /opt/sluice/bin/pip uninstall --yes pip

FROM python:3.11.13-slim-bookworm
LABEL org.opencontainers.image.title="sluice" \
      org.opencontainers.image.description="Backpressure sidecar for AI agents' LLM and tool calls" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/sluice/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/sluice /opt/sluice
COPY deploy/docker/sluice.yaml /etc/sluice/sluice.yaml
# A writable working directory for state files, owned by the unprivileged user.
RUN install -d -o 10001 -g 10001 /var/lib/sluice
WORKDIR /var/lib/sluice
USER 10001:10001
EXPOSE 8080 9901
# SIGTERM starts the drain: /readyz turns 503, in-flight calls get server.drain_timeout.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9901/healthz', timeout=2)"]
ENTRYPOINT ["sluice"]
CMD ["serve", "--config", "/etc/sluice/sluice.yaml"]
