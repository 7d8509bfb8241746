# elastic-allreduce for clusters without GPUs: TensorFlow 2.21 with Keras 3 (CPU build; the
# default stack; tf-keras for scripts on legacy Keras, TF_USE_LEGACY_KERAS=1),
# this project's patched Horovod 0.28.1 built with Gloo (elastic_allreduce/horovod_build, as `make
# setup` builds it), and this package. The GPU image is ./Dockerfile.gpu.
#
#   docker build -t elastic-allreduce:0.1.0 .
#
# Lint: hadolint (tests/test_dockerfiles.py).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: TensorFlow, then Horovod compiled against it (cmake, g++) --------------------------
FROM ${PYTHON_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make cmake patch \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints.txt ./
# The versions of every package come from constraints.txt, as `make setup` installs them;
# tf-keras without its dependencies, which name `tensorflow` (the CUDA build) beside ours.
RUN pip install --no-cache-dir -c constraints.txt pip setuptools wheel \
    && pip install --no-cache-dir -c constraints.txt tensorflow-cpu==2.21.0 tensorboard \
        etcd3gw kubernetes cloudpickle psutil pyyaml packaging cffi scikit-learn \
    && pip install --no-cache-dir --no-deps -c constraints.txt tf-keras
COPY pyproject.toml README.md ./
COPY elastic_allreduce ./elastic_allreduce
COPY launcher ./launcher
# Horovod 0.28.1 with the project's patches, against the TensorFlow above (the sdist is checked
# by its SHA-256; the wheel cache is dropped with the layer).
RUN PIP_CONSTRAINT=/src/constraints.txt MAKEFLAGS="-j$(nproc)" \
    python -m elastic_allreduce.horovod_build --gpu cpu --cache /tmp/horovod-build \
    && rm -rf /tmp/horovod-build \
    && python -c 'import horovod.tensorflow as hvd; assert hvd.gloo_built(), "no Gloo"'
RUN pip install --no-cache-dir --no-build-isolation --no-deps . \
    && elastic-run --version

# -- runtime: Python and the virtual environment -------------------------------------------------
FROM ${PYTHON_IMAGE}
RUN useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin elastic
COPY --from=build /opt/venv /opt/venv
COPY examples /opt/elastic-allreduce/examples
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/elastic
# A numeric user, so that Kubernetes can check runAsNonRoot.
USER 1000:1000
ENTRYPOINT ["elastic-run"]
CMD ["--help"]
