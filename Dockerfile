# The operator and agent image: `docker build -t tasklease:dev .`; `make dist` builds it with buildah
# into dist/ as an OCI archive, with the build arguments below set.
# `make node` builds this same file with buildah on a debootstrap'd Debian base:
# --build-arg BASE_IMAGE=localhost/tasklease/debian-python:bookworm (no registry needed).
# The default base is python:3.11-slim pinned by digest, so a build is reproducible.
ARG BASE_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7
# What the build stage starts from: the base, or the base with /opt/tasklease already holding
# constraints.txt's packages (the development tools pass one they keep, so that a change of the
# source alone does not download and install every dependency again).
ARG BUILD_BASE=${BASE_IMAGE}

FROM ${BUILD_BASE} AS build
# Only for builds behind an egress proxy with its own CA (unset otherwise; not kept in the image).
ARG PIP_CERT
WORKDIR /src
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY operator ./operator
# A venv the runtime stage copies whole; dumb-init is the container's init (below).
RUN { test -x /opt/tasklease/bin/pip || python3 -m venv /opt/tasklease; } \
 && /opt/tasklease/bin/pip install --no-cache-dir --disable-pip-version-check -c constraints.txt '.[operator]' dumb-init \
 && /opt/tasklease/bin/pip uninstall -y -q pip setuptools

FROM ${BASE_IMAGE}
# Set by `make dist` (from pyproject.toml and git); the defaults say they were not.
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG SOURCE=https://github.com/tasklease/tasklease
LABEL org.opencontainers.image.title="tasklease" \
      org.opencontainers.image.description="Kubernetes-native task leases: the tasklease operator and agent runner" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.url="${SOURCE}" \
      org.opencontainers.image.documentation="${SOURCE}/tree/main/docs" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="tasklease"
COPY --from=build /opt/tasklease /opt/tasklease
# A user that exists (kopf and getpass look the uid up); the chart runs as 65532:65532.
RUN echo 'tasklease:x:65532:65532:tasklease:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'tasklease:x:65532:' >> /etc/group
ENV PATH=/opt/tasklease/bin:$PATH PYTHONUNBUFFERED=1
USER 65532:65532
# dumb-init as PID 1: forwards signals to `tasklease` (which releases its task on SIGTERM)
# and reaps orphaned children, so `tasklease run` behaves in a pod as in a terminal.
ENTRYPOINT ["dumb-init", "--", "tasklease"]
CMD ["operator"]
