# Local stand-in for python:3.11-slim (scripts/compose-check.sh, where Docker Hub is out of reach):
# Debian bookworm's Python 3.11 in /opt/venv. The build context is a temporary folder holding the
# host's CA bundle (ca.crt), trusted by pip inside this test image only; never committed.
ARG DEBIAN_IMAGE=kaiten-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates && rm -rf /var/lib/apt/lists/* && \
    python3 -m venv /opt/venv
COPY ca.crt /etc/ssl/certs/kaiten-host-ca.crt
ENV PATH=/opt/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/kaiten-host-ca.crt \
    SSL_CERT_FILE=/etc/ssl/certs/kaiten-host-ca.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/kaiten-host-ca.crt
CMD ["python3"]
