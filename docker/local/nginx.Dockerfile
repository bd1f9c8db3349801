# Local stand-in for nginx:1.27-alpine: Debian bookworm's nginx, and wget for the healthcheck.
ARG DEBIAN_IMAGE=kaiten-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        nginx-light wget && rm -rf /var/lib/apt/lists/*
EXPOSE 80
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
