# muse-stack training image. Every version comes from a stack lock (containers/locks/<target>.toml)
# through `muse-stack stack build-args <target>`; this file holds no version of its own.
#   make image gpu=b200            (docker buildx; ENGINE=podman works too)
#   make image-test gpu=cpu        (builds the cpu image with podman and runs it)
# Builds behind a TLS-intercepting proxy: --secret id=ca,src=/path/to/ca-bundle.crt
# (pip, curl and git inside the build then trust it through PIP_CERT=/run/secrets/ca).

ARG BASE_REF
ARG STACK_KIND

# ---------------------------------------------------------------------------------------------
FROM ${BASE_REF} AS base
ARG PYTHON_VERSION
ARG CUDA_VERSION
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    VIRTUAL_ENV=/opt/muse-stack/venv \
    PATH=/opt/muse-stack/venv/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY containers/lock-env.sh /usr/local/bin/lock-env
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    rm -f /etc/apt/apt.conf.d/docker-clean \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && python3 -c 'import platform, sys; v = platform.python_version(); sys.exit(0 if v == sys.argv[1] else f"python3 is {v}, the lock pins {sys.argv[1]}")' "${PYTHON_VERSION}" \
    && python3 -m venv "${VIRTUAL_ENV}"

# --- cpu: PyTorch CPU wheel ------------------------------------------------------------------
FROM base AS stack-cpu
ARG TORCH_PACKAGE
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
# a local wheel directory mounted into the build (podman build -v DIR:DIR:ro); empty: use the index
ARG PIP_FIND_LINKS=""
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    lock-env pip-torch "${TORCH_PACKAGE}==${TORCH_VERSION}" "${TORCH_INDEX_URL}" "${PIP_FIND_LINKS}"

# --- gpu: CUDA devel base, PyTorch, TE, cuDNN, NCCL, flash-attn, DeepEP, megatron-core, EFA ----
FROM base AS stack-gpu
ARG CUDA_VERSION
ARG TORCH_PACKAGE
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ARG PIP_FIND_LINKS=""
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    apt-get update \
    && apt-get install -y --no-install-recommends python3-dev build-essential git curl \
    && nvcc --version | grep -q "release ${CUDA_VERSION}," \
    || { echo "the base image's CUDA is not the lock's ${CUDA_VERSION}:"; nvcc --version; exit 1; }
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    lock-env pip-torch "${TORCH_PACKAGE}==${TORCH_VERSION}" "${TORCH_INDEX_URL}" "${PIP_FIND_LINKS}" \
    && lock-env pip install ninja packaging wheel setuptools

# cuDNN and NCCL from pip; the apt cuDNN of the base goes first (two cuDNNs in one process break)
ARG CUDNN_PACKAGE
ARG CUDNN_VERSION
ARG CUDNN_PURGE_APT
ARG NCCL_PACKAGE
ARG NCCL_VERSION
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    if [ "${CUDNN_PURGE_APT}" = "1" ]; then \
      apt-get purge -y --allow-change-held-packages 'libcudnn*' 'cudnn*' || true; \
      ! ldconfig -p | grep -q 'libcudnn\.' || { echo "apt cuDNN still present"; exit 1; }; \
    fi \
    && lock-env pip install "${CUDNN_PACKAGE}==${CUDNN_VERSION}" "${NCCL_PACKAGE}==${NCCL_VERSION}"

# Transformer Engine: the core from the PyPI wheel, or from a pinned source commit where PyPI
# has no wheel (aarch64 on CUDA 13); the PyTorch extension is always built against this torch.
ARG TE_VERSION
ARG TE_BUILD
ARG TE_CORE_PACKAGE
ARG TE_TORCH_PACKAGE
ARG TE_SOURCE_REPO
ARG TE_SOURCE_COMMIT
ARG NVTE_CUDA_ARCHS
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    export NVTE_FRAMEWORK=pytorch MAX_JOBS="${MAX_JOBS:-8}" \
           CUDNN_PATH="$(python -c 'import nvidia.cudnn, os; print(os.path.dirname(nvidia.cudnn.__file__) + "/cudnn")')" \
    && : "${NVTE_CUDA_ARCHS:?the lock gives no Transformer Engine CUDA archs}" \
    && if [ "${TE_BUILD}" = "source" ]; then \
         : "${TE_SOURCE_COMMIT:?the lock has no components.transformer_engine.source_commit; pin it to build TE from source}"; \
         lock-env git-checkout "${TE_SOURCE_REPO}" "${TE_SOURCE_COMMIT}" /tmp/te \
         && lock-env pip install --no-build-isolation /tmp/te \
         && rm -rf /tmp/te; \
       else \
         lock-env pip install "${TE_CORE_PACKAGE}==${TE_VERSION}" \
         && lock-env pip install --no-build-isolation --no-binary "${TE_TORCH_PACKAGE}" "${TE_TORCH_PACKAGE}==${TE_VERSION}"; \
       fi \
    && if [ "${TE_BUILD}" = "source" ]; then lock-env pip-check "${TE_VERSION}" transformer_engine; \
       else lock-env pip-check "${TE_VERSION}" "${TE_CORE_PACKAGE}" "${TE_TORCH_PACKAGE}"; fi

# flash-attn takes its targets from FLASH_ATTN_CUDA_ARCHS, not TORCH_CUDA_ARCH_LIST
ARG FLASH_ATTN_PACKAGE
ARG FLASH_ATTN_VERSION
ARG FLASH_ATTN_CUDA_ARCHS
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    : "${FLASH_ATTN_CUDA_ARCHS:?the lock gives no flash-attn CUDA archs}" \
    && FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-8}" \
       lock-env pip install --no-build-isolation --no-binary "${FLASH_ATTN_PACKAGE}" "${FLASH_ATTN_PACKAGE}==${FLASH_ATTN_VERSION}"

ARG DEEPEP_PACKAGE
ARG DEEPEP_VERSION
ARG DEEPEP_TORCH_CUDA_ARCH_LIST
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    TORCH_CUDA_ARCH_LIST="${DEEPEP_TORCH_CUDA_ARCH_LIST:?the lock gives no DeepEP CUDA archs}" MAX_JOBS="${MAX_JOBS:-8}" \
    lock-env pip install --no-build-isolation --no-binary "${DEEPEP_PACKAGE}" "${DEEPEP_PACKAGE}==${DEEPEP_VERSION}"

ARG MEGATRON_CORE_PACKAGE
ARG MEGATRON_CORE_VERSION
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    lock-env pip install "${MEGATRON_CORE_PACKAGE}==${MEGATRON_CORE_VERSION}"

# AWS EFA: libfabric and the aws-ofi-nccl plugin; no kernel module, limits or self-test in a container
ARG EFA_INSTALLER_VERSION
ARG EFA_INSTALLER_URL
ARG EFA_INSTALLER_SHA256
ARG EFA_INSTALL_FLAGS
ARG AWS_OFI_NCCL_VERSION
ARG LIBFABRIC_VERSION
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    --mount=type=secret,id=ca \
    lock-env fetch "${EFA_INSTALLER_URL}" /tmp/efa.tar.gz "${EFA_INSTALLER_SHA256}" \
    && mkdir /tmp/efa && tar -xzf /tmp/efa.tar.gz -C /tmp/efa --strip-components=1 \
    && (cd /tmp/efa && apt-get update && ./efa_installer.sh -y ${EFA_INSTALL_FLAGS}) \
    && rm -rf /tmp/efa /tmp/efa.tar.gz \
    && grep -q "${EFA_INSTALLER_VERSION}" /opt/amazon/efa_installed_packages \
    && ls /opt/amazon/ofi-nccl/lib*/libnccl-net-ofi.so \
    && /opt/amazon/efa/bin/fi_info --version | grep -q "${LIBFABRIC_VERSION}" \
    && { grep -q "${AWS_OFI_NCCL_VERSION}" /opt/amazon/efa_installed_packages \
         || echo "note: efa_installed_packages does not name aws-ofi-nccl ${AWS_OFI_NCCL_VERSION}; check the NET/OFI log line at run time"; }
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib \
    FI_EFA_USE_HUGE_PAGE=0

# ---------------------------------------------------------------------------------------------
FROM stack-${STACK_KIND} AS image
# muse-stack's own dependencies (from pyproject.toml), then the source tree at /opt/muse-stack
# (installed editable: recipes and bundled data resolve against the source tree, as in a checkout)
COPY pyproject.toml /opt/muse-stack/pyproject.toml
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    python -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
       /opt/muse-stack/pyproject.toml > /tmp/requirements.txt \
    && lock-env pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY muse_stack /opt/muse-stack/muse_stack
ARG MUSE_STACK_VERSION
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    lock-env pip install --no-deps --editable /opt/muse-stack \
    && lock-env pip-check "${MUSE_STACK_VERSION}" muse-stack
COPY recipes /opt/muse-stack/recipes
COPY data /opt/muse-stack/data
COPY containers/locks /opt/muse-stack/containers/locks
COPY containers/entrypoint.sh /usr/local/bin/muse-stack-entrypoint

ARG LOCK_NAME
ARG LOCK_SHA256
ARG PLATFORM
ARG BASE_IMAGE
ARG BASE_TAG
ARG BASE_DIGEST
ARG STACK_KIND
ARG SOURCE_REVISION=""
ARG BUILT_BY=docker
# the labels promise this lock: the copy in the image must hash to the build argument
RUN mkdir -p /etc/muse-stack \
    && cp "/opt/muse-stack/containers/locks/${LOCK_NAME}.toml" /etc/muse-stack/lock.toml \
    && echo "${LOCK_SHA256}  /etc/muse-stack/lock.toml" | sha256sum -c - \
    && lock-env image-json /etc/muse-stack/image.json "${LOCK_NAME}" "${LOCK_SHA256}" "${BASE_IMAGE}:${BASE_TAG}" \
         "${BASE_DIGEST}" "${SOURCE_REVISION}" "${MUSE_STACK_VERSION}" "${PLATFORM}" "${BUILT_BY}"
RUN chmod 0755 /usr/local/bin/muse-stack-entrypoint \
    && if getent passwd 1000 >/dev/null; then userdel --remove "$(getent passwd 1000 | cut -d: -f1)"; fi \
    && useradd --create-home --uid 1000 --user-group --shell /bin/bash muse \
    && mkdir -p /workspace && chown muse:muse /workspace

ENV MUSE_STACK_RECIPES=/opt/muse-stack/recipes \
    MUSE_STACK_LOCKS=/opt/muse-stack/containers/locks \
    MUSE_STACK_IMAGE_INFO=/etc/muse-stack/image.json
ARG CREATED=""
ARG SOURCE_URL=""
LABEL org.opencontainers.image.title="muse-stack" \
      org.opencontainers.image.description="muse-stack training image (lock ${LOCK_NAME})" \
      org.opencontainers.image.version="${MUSE_STACK_VERSION}" \
      org.opencontainers.image.revision="${SOURCE_REVISION}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}:${BASE_TAG}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      dev.muse-stack.lock.name="${LOCK_NAME}" \
      dev.muse-stack.lock.sha256="${LOCK_SHA256}" \
      dev.muse-stack.platform="${PLATFORM}" \
      dev.muse-stack.kind="${STACK_KIND}"
USER muse
WORKDIR /workspace
ENTRYPOINT ["/usr/local/bin/muse-stack-entrypoint"]
CMD ["--help"]
