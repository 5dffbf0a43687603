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
ARG LOCK_NAME
# the lock's [apt.base]: NAME=VERSION pins (muse-stack stack build-args)
ARG APT_BASE_PACKAGES
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    VIRTUAL_ENV=/opt/muse-stack/venv \
    PATH=/opt/muse-stack/venv/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY containers/lock-env.sh /usr/local/bin/lock-env
# the lock's hash-pinned wheel set (PEP 751) and the two stdlib-only helpers that read it
COPY muse_stack/stack/pylock.py containers/flash_attn_prepare.py /usr/local/lib/muse-stack/
COPY containers/locks/pylock.${LOCK_NAME}.toml /usr/local/lib/muse-stack/wheelset.toml
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    rm -f /etc/apt/apt.conf.d/docker-clean \
    && : "${APT_BASE_PACKAGES:?the lock pins no [apt.base] packages}" \
    && apt-get update \
    && apt-get install -y --no-install-recommends ${APT_BASE_PACKAGES} \
    && python3 -c 'import platform, sys; v = platform.python_version(); sys.exit(0 if v == sys.argv[1] else f"python3 is {v}, the lock pins {sys.argv[1]}")' "${PYTHON_VERSION}" \
    && python3 -m venv "${VIRTUAL_ENV}"

# Every component the lock pins must be what the wheel set pins, before anything is installed
ARG TORCH_PACKAGE
ARG TORCH_VERSION
ARG TE_VERSION
ARG TE_BUILD
ARG TE_CORE_PACKAGE
ARG TE_TORCH_PACKAGE
ARG CUDNN_PACKAGE
ARG CUDNN_VERSION
ARG NCCL_PACKAGE
ARG NCCL_VERSION
ARG FLASH_ATTN_PACKAGE
ARG FLASH_ATTN_VERSION
ARG DEEPEP_PACKAGE
ARG DEEPEP_VERSION
ARG MEGATRON_CORE_PACKAGE
ARG MEGATRON_CORE_VERSION
RUN te_core="" te_torch=""; if [ "${TE_BUILD}" = "wheel" ]; then te_core="${TE_CORE_PACKAGE}" te_torch="${TE_TORCH_PACKAGE}"; fi \
    && lock-env set-pins "${TORCH_PACKAGE}" "${TORCH_VERSION}" "$te_core" "${TE_VERSION}" "$te_torch" "${TE_VERSION}" \
         "${CUDNN_PACKAGE}" "${CUDNN_VERSION}" "${NCCL_PACKAGE}" "${NCCL_VERSION}" \
         "${FLASH_ATTN_PACKAGE}" "${FLASH_ATTN_VERSION}" "${DEEPEP_PACKAGE}" "${DEEPEP_VERSION}" \
         "${MEGATRON_CORE_PACKAGE}" "${MEGATRON_CORE_VERSION}"

# --- cpu: the wheel set (PyTorch CPU wheel and muse-stack's dependencies) ---------------------
FROM base AS stack-cpu
ARG TORCH_INDEX_URL
# a local wheel directory mounted into the build (podman build -v DIR:DIR:ro); empty: use the indexes
ARG PIP_FIND_LINKS=""
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    lock-env install-set "${PIP_FIND_LINKS}" "${TORCH_INDEX_URL}"

# --- gpu: CUDA devel base; the wheel set (PyTorch, cuDNN, NCCL, TE core, DeepEP, megatron-core,
#     ...), then TE's PyTorch extension and flash-attn compiled from the set's sdists; EFA ------
FROM base AS stack-gpu
# the registry base is pulled by its pinned index digest, or the build stops here (a direct
# `docker buildx build` without the lock's BASE_DIGEST, or with a BASE_REF by tag, is refused)
ARG BASE_REF
ARG BASE_DIGEST
RUN : "${BASE_DIGEST:?the lock pins no base.digest: run make pins gpu=TARGET on a networked builder, then make image}" \
    && case "${BASE_REF}" in *"@${BASE_DIGEST}") ;; \
         *) echo "BASE_REF ${BASE_REF} is not pulled by the lock's digest ${BASE_DIGEST}"; exit 1 ;; esac
ARG CUDA_VERSION
ARG TORCH_INDEX_URL
ARG PIP_FIND_LINKS=""
ARG CUDNN_PURGE_APT
ARG TE_VERSION
ARG TE_BUILD
ARG TE_CORE_PACKAGE
ARG TE_TORCH_PACKAGE
ARG FLASH_ATTN_PACKAGE
ARG FLASH_ATTN_VERSION
ARG DEEPEP_PACKAGE
ARG DEEPEP_VERSION
ARG MEGATRON_CORE_PACKAGE
ARG MEGATRON_CORE_VERSION
# the lock's [apt.build]: the compilers of the sdist builds and the tools of the fetches, NAME=VERSION
ARG APT_BUILD_PACKAGES
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    : "${APT_BUILD_PACKAGES:?the lock pins no [apt.build] packages}" \
    && apt-get update \
    && apt-get install -y --no-install-recommends ${APT_BUILD_PACKAGES} \
    && nvcc --version | grep -q "release ${CUDA_VERSION}," \
    || { echo "the base image's CUDA is not the lock's ${CUDA_VERSION}:"; nvcc --version; exit 1; }
# TE looks for cuDNN in CUDNN_HOME, and for NVRTC and cuRAND in NVRTC_HOME and CURAND_HOME, before
# CUDA_HOME (the base's toolkit, which keeps its own copies). Every library folder of the set comes
# first on the loader's path for every process of the image, in the replay's order: the path is
# `lock-env lib-path` of the folders `lock-env link-libs` makes (the set's nvidia/*/lib, by name, the
# CUDA major's as `cuda`), as the replay's is of the set's nvidia/ itself, and the install below stops
# unless this line is that path (lock-env lib-path-check)
ENV CUDNN_HOME=/opt/muse-stack/cuda-libs/cudnn \
    CUDNN_PATH=/opt/muse-stack/cuda-libs/cudnn \
    NVRTC_HOME=/opt/muse-stack/cuda-libs/cuda \
    CURAND_HOME=/opt/muse-stack/cuda-libs/cuda \
    NCCL_HOME=/opt/muse-stack/cuda-libs/nccl \
    LD_LIBRARY_PATH=/opt/muse-stack/cuda-libs/cuda/lib:/opt/muse-stack/cuda-libs/cudnn/lib:/opt/muse-stack/cuda-libs/cusparselt/lib:/opt/muse-stack/cuda-libs/nccl/lib:/opt/muse-stack/cuda-libs/nvshmem/lib
# the base's apt cuDNN and NCCL go first: cuDNN 9's libcudnn.so.9 opens its sub-libraries by
# soname, so a second cuDNN on the loader's path mixes two versions in one process (seen on an H200
# machine); the base's held libnccl2 in /usr/lib/<triplet> would be a second NCCL for any process
# whose loader path reaches that folder first. Neither is left in a system folder.
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    if [ "${CUDNN_PURGE_APT}" = "1" ]; then \
      apt-get purge -y --allow-change-held-packages 'libcudnn*' 'cudnn*' || true; \
      ! ldconfig -p | grep -q 'libcudnn' || { echo "apt cuDNN still present"; exit 1; }; \
    fi \
    && { apt-get purge -y --allow-change-held-packages 'libnccl2' 'libnccl-dev' || true; } \
    && ldconfig \
    && { ! ldconfig -p | grep -q 'libnccl\.so' || { echo "apt NCCL still present:"; ldconfig -p | grep 'libnccl\.so'; exit 1; }; } \
    && lock-env install-set "${PIP_FIND_LINKS}" "${TORCH_INDEX_URL}" \
    && lock-env link-libs /opt/muse-stack/cuda-libs \
    && lock-env lib-path-check /opt/muse-stack/cuda-libs "${LD_LIBRARY_PATH}"

# Transformer Engine: the core from the set's wheel and the PyTorch extension compiled from the
# set's sdist against this torch (NVTE_PYTORCH_FORCE_BUILD: never a prebuilt download), or the
# whole of TE from a pinned source commit where the registry has no wheel (the lock says which).
# MAX_JOBS: parallel compiles; each of TE's nvcc jobs takes about 3 GB, so 8 want about 24 GB (flash-attn
# takes fewer where memory is short: below).
# NVTE_WITH_NCCL_EP: the lock's components.transformer_engine.with_nccl_ep (TE's optional NCCL EP
# extension), passed to both builds. A source build runs CMake: the set's `cmake` wheel, in the venv.
ARG MAX_JOBS=8
ARG TE_SOURCE_REPO
ARG TE_SOURCE_COMMIT
ARG NVTE_CUDA_ARCHS
ARG NVTE_WITH_NCCL_EP
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    export NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS}" NVTE_CUDA_ARCHS NVTE_WITH_NCCL_EP \
           CPATH="${CUDNN_HOME}/include:${NCCL_HOME}/include" \
    && : "${NVTE_CUDA_ARCHS:?the lock gives no Transformer Engine CUDA archs}" \
    && : "${NVTE_WITH_NCCL_EP:?the lock states no components.transformer_engine.with_nccl_ep}" \
    && if [ "${TE_BUILD}" = "source" ]; then \
         : "${TE_SOURCE_COMMIT:?the lock has no components.transformer_engine.source_commit; pin it to build TE from source}"; \
         command -v cmake >/dev/null || { echo "no cmake in the venv: the wheel set of a source-built TE carries the cmake wheel (muse-stack stack resolve TARGET)"; exit 1; }; \
         lock-env git-checkout "${TE_SOURCE_REPO}" "${TE_SOURCE_COMMIT}" /tmp/te \
         && lock-env pip-install --no-build-isolation --no-deps /tmp/te \
         && rm -rf /tmp/te \
         && lock-env pip-check "${TE_VERSION}" transformer_engine; \
       else \
         lock-env install-sdist "${TE_TORCH_PACKAGE}" \
         && lock-env pip-check "${TE_VERSION}" "${TE_CORE_PACKAGE}" "${TE_TORCH_PACKAGE}"; \
       fi

# flash-attn from the set's sdist (hash-checked), its -std flags raised to the C++ standard this
# torch's headers require, compiled for the lock's archs (FLASH_ATTN_CUDA_ARCHS, not TORCH_CUDA_ARCH_LIST).
# Its jobs are budgeted as its own setup.py budgets them (about 9 GB a job): the builder's available
# memory over that estimate, at most MAX_JOBS (flash_attn_prepare.py jobs says how it got the number)
ARG FLASH_ATTN_CUDA_ARCHS
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    : "${FLASH_ATTN_CUDA_ARCHS:?the lock gives no flash-attn CUDA archs}" \
    && lock-env fetch-sdist "${FLASH_ATTN_PACKAGE}" /tmp/fa \
    && python3 /usr/local/lib/muse-stack/flash_attn_prepare.py patch /tmp/fa/src \
         --torch "$(python -c 'import os, torch; print(os.path.dirname(torch.__file__))')" \
    && fa_jobs=$(python3 /usr/local/lib/muse-stack/flash_attn_prepare.py jobs /tmp/fa/src --max "${MAX_JOBS}") \
    && FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${fa_jobs}" \
       lock-env pip-install --no-build-isolation --no-deps /tmp/fa/src \
    && rm -rf /tmp/fa \
    && lock-env pip-check "${FLASH_ATTN_VERSION}" "${FLASH_ATTN_PACKAGE}"

# DeepEP and megatron-core came with the set (DeepEP as its registry wheel, not compiled here). The
# lock's DeepEP archs are the machine code that wheel carries: `stack selfcheck` at the end of the
# build reads the .nv_fatbin of the loaded deep_ep extension and fails unless it is exactly that list
ARG DEEPEP_TORCH_CUDA_ARCH_LIST
RUN lock-env pip-check "${DEEPEP_VERSION}" "${DEEPEP_PACKAGE}" \
    && lock-env pip-check "${MEGATRON_CORE_VERSION}" "${MEGATRON_CORE_PACKAGE}" \
    && : "${DEEPEP_TORCH_CUDA_ARCH_LIST:?the lock gives no DeepEP CUDA archs}"

# AWS EFA: libfabric and the aws-ofi-nccl plugin, with the lock's installer flags (as both sources of its
# checksum run it: the container mode --build-ngc, no kernel module, limits, MPI or self-test).
# The tarball is checked against the lock's sha256 or the build stops (an empty sha256 is refused).
# On Ubuntu the installer puts the plugin in /opt/amazon/ofi-nccl/lib/<triplet> (flat lib/ on NGC
# bases): `lock-env efa-links` finds both folders wherever they are and links them at fixed paths.
ARG EFA_INSTALLER_VERSION
ARG EFA_INSTALLER_URL
ARG EFA_INSTALLER_SHA256
ARG EFA_INSTALL_FLAGS
ARG AWS_OFI_NCCL_VERSION
ARG LIBFABRIC_VERSION
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    --mount=type=secret,id=ca \
    : "${EFA_INSTALLER_SHA256:?the lock pins no components.efa.installer_sha256: run make pins gpu=TARGET on a networked builder}" \
    && lock-env fetch "${EFA_INSTALLER_URL}" /tmp/efa.tar.gz "${EFA_INSTALLER_SHA256}" \
    && mkdir /tmp/efa && tar -xzf /tmp/efa.tar.gz -C /tmp/efa --strip-components=1 \
    && (cd /tmp/efa && apt-get update && ./efa_installer.sh -y ${EFA_INSTALL_FLAGS}) \
    && rm -rf /tmp/efa /tmp/efa.tar.gz \
    && grep -q "${EFA_INSTALLER_VERSION}" /opt/amazon/efa_installed_packages \
    && lock-env efa-links /opt/amazon /opt/muse-stack/efa \
    && { grep -ls ofi-nccl /etc/ld.so.conf.d/* | xargs -r rm -f; ldconfig; } \
    && /opt/amazon/efa/bin/fi_info --version | grep -q "${LIBFABRIC_VERSION}" \
    && { grep -q "${AWS_OFI_NCCL_VERSION}" /opt/amazon/efa_installed_packages \
         || echo "note: efa_installed_packages does not name aws-ofi-nccl ${AWS_OFI_NCCL_VERSION}; check the NET/OFI log line at run time"; }
# the set's library folders first, then the EFA folders. The EFA plugin is opt-in: the folder NCCL
# searches holds libnccl-net-ofi.so only (no libnccl-net.so, the name NCCL loads by default, and the
# installer's ld.so.conf.d entry is removed above), so NCCL loads it only where NCCL_NET_PLUGIN=ofi
# asks for it; `muse-stack launch` sets that for machines whose fabric is EFA. Loaded on an
# InfiniBand host the plugin slows NCCL down; without it NCCL uses its own IB or socket transport.
ENV LD_LIBRARY_PATH=${LD_LIBRARY_PATH}:/opt/muse-stack/efa/ofi-nccl-lib:/opt/muse-stack/efa/libfabric-lib \
    FI_EFA_USE_HUGE_PAGE=0

# ---------------------------------------------------------------------------------------------
FROM stack-${STACK_KIND} AS image
# muse-stack's own dependencies and build backend (setuptools) came with the wheel set; the source
# tree is installed editable without dependency resolution and without build isolation (no
# unpinned setuptools download), so nothing here can change the set (the self-check below proves it)
COPY pyproject.toml /opt/muse-stack/pyproject.toml
COPY muse_stack /opt/muse-stack/muse_stack
ARG MUSE_STACK_VERSION
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca \
    lock-env pip-install --no-deps --no-build-isolation --editable /opt/muse-stack \
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
# The image is what its lock says, or the build fails: every package of the wheel set at its
# version and nothing else installed; torch, TE (core and extension), cuDNN and NCCL as the loaded
# libraries report them, flash-attn, DeepEP, megatron-core and Python at the locked versions.
# (No GPU driver during a build: the CUDA toolkit's stub libcuda lets the extensions load.)
RUN stub=""; if [ "${STACK_KIND}" = gpu ]; then \
      stub=/tmp/cuda-stub && mkdir -p "$stub" && ln -sf /usr/local/cuda/lib64/stubs/libcuda.so "$stub/libcuda.so.1"; fi \
    && LD_LIBRARY_PATH="${stub}${stub:+:}${LD_LIBRARY_PATH:-}" \
       muse-stack stack selfcheck "${LOCK_NAME}" --image --json /etc/muse-stack/selfcheck.json \
    && rm -rf /tmp/cuda-stub
RUN chmod 0755 /usr/local/bin/muse-stack-entrypoint \
    && if getent passwd 1000 >/dev/null; then userdel --remove "$(getent passwd 1000 | cut -d: -f1)"; fi \
    && useradd --create-home --uid 1000 --user-group --shell /bin/bash muse \
    && mkdir -p /workspace/runs && chown -R muse:muse /workspace

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
# run directories: mount a host folder here (docker run -v "$PWD/runs:/workspace/runs" ...)
VOLUME /workspace/runs
ENTRYPOINT ["/usr/local/bin/muse-stack-entrypoint"]
CMD ["--help"]
