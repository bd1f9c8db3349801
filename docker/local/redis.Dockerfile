# Local stand-in for redis:7-alpine: Debian bookworm's redis-server (7.0).
ARG DEBIAN_IMAGE=kaiten-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        redis-server && rm -rf /var/lib/apt/lists/*
# The official image is built without protected mode (it would refuse other containers); so is this one.
RUN printf '#!/bin/sh\n[ "$1" = redis-server ] && shift && set -- redis-server --protected-mode no "$@"\nexec "$@"\n' \
        > /usr/local/bin/entrypoint.sh && chmod +x /usr/local/bin/entrypoint.sh
EXPOSE 6379
ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]
CMD ["redis-server"]
