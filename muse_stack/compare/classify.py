"""Which differences between two fingerprints matter, and how.

Every field path gets exactly one class (the first rule that matches; informational when
none does):

- ``numerics``: can change the numbers a run computes — Transformer Engine, cuDNN, torch
  (and its determinism/TF32 settings), megatron-core, flash-attn, triton (it generates
  kernels), the CUDA runtime, cuBLAS, NVRTC/nvJitLink, the GPU architecture (compute
  capability), NVTE_*/CUBLAS_*/CUDNN_* and other determinism variables, the variables that
  decide which code runs (PYTHONPATH, LD_PRELOAD, LD_LIBRARY_PATH, CUDA_HOME, ...), the recipe
  and the data rows, and a CPU run compared with a GPU run.
- ``performance``: can change speed but not results — NCCL and its variables, EFA,
  libfabric, the aws-ofi-nccl plugin, the driver, GPU count/model/memory/clocks/NVLink,
  CPU, memory, kernel, OS, glibc, DeepEP, the Python version and the other allow-listed
  variables.
- ``informational``: where and when — host names, file locations, image labels, process
  ids and rank numbers, container hints, the hash of the whole package listing (each
  package that differs is classified on its own).

Between two run directories the resolved recipes are compared too (``recipe.*``): what the
run computes (model, layout, batch, precision, optimizer, training schedule, data, engine options,
frozen modules, PEFT, the held-out split's size ``validation.eval_iters``) is numerics; recompute,
offload, hardware, checkpoint cadence and validation cadence (``validation.eval_interval``) are
performance (the recipe's ``env`` is classed like the environment); names, descriptions,
provenance, notes, where metrics are logged (``logging``) and the recorded stack and results are
informational, and so is the record of which values the fill policy filled (``filled``,
``fill_policy``): a filled value that differs differs at its own path, as numerics.

Paths that change on every capture (capture time and duration, pid) are not differences.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

NUMERICS = "numerics"
PERFORMANCE = "performance"
INFORMATIONAL = "informational"
CLASSES = (NUMERICS, PERFORMANCE, INFORMATIONAL)
SEVERITY = {INFORMATIONAL: 1, PERFORMANCE: 1, NUMERICS: 2}

VOLATILE: tuple[str, ...] = ("capture", "capture.*", "process.pid")

NUMERICS_PACKAGES = (
    "torch",
    "transformer-engine*",
    "megatron-core",
    "flash-attn*",
    "triton",
    "pytorch-triton",
    "apex",
    "nvidia-cudnn-*",
    "nvidia-cublas*",
    "nvidia-cuda-runtime*",
    "nvidia-cuda-nvrtc*",
    "nvidia-nvjitlink*",
    "nvidia-cusparse*",
    "nvidia-cufft*",
    "nvidia-curand*",
    "nvidia-cusolver*",
    "nvidia-cudnn-frontend",
    "cuda-python",
    "cuda-bindings",
)
PERFORMANCE_PACKAGES = ("nvidia-nccl*", "deep-ep", "sgl-deep-ep", "deepep", "nvidia-nvshmem*", "nvidia-ml-py")

#: variables that decide which code runs (which Python modules, which shared libraries, which CUDA
#: toolkit and ptxas compile kernels): a different value can run different code, so numerics
CODE_PATH_ENV = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONUSERBASE",
    "PYTHONNOUSERSITE",
    "PYTHONSAFEPATH",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "CUDA_HOME",
    "CUDA_PATH",
    "TRITON_PTXAS_PATH",
    "TRITON_LIBCUDA_PATH",
)
NUMERICS_ENV = (
    "NVTE_*",
    "CUBLAS_*",
    "CUBLASLT_*",
    "CUDNN_*",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "TORCH_CUDNN_*",
    "TORCH_DETERMINISTIC*",
    "PYTHONHASHSEED",
    "MEGATRON_*",
    *CODE_PATH_ENV,
)
INFORMATIONAL_ENV = (
    "MUSE_STACK_*",
    "HF_*",
    "TRANSFORMERS_*",
    "TOKENIZERS_PARALLELISM",
    "*_CACHE_DIR",
    "TRITON_CACHE_DIR",
)

RULES: list[tuple[str, str]] = [
    # where things are, not what they are
    ("*.path", INFORMATIONAL),
    ("*.resolved", INFORMATIONAL),
    ("*.location", INFORMATIONAL),
    ("*.loaded", INFORMATIONAL),
    ("*.other_candidates", INFORMATIONAL),
    ("*.git.root", INFORMATIONAL),
    ("schema_version", INFORMATIONAL),
    ("kind", INFORMATIONAL),
    ("identity", INFORMATIONAL),
    ("identity.*", INFORMATIONAL),
    ("process", INFORMATIONAL),
    ("process.*", INFORMATIONAL),
    ("ranks", INFORMATIONAL),
    ("ranks.*", INFORMATIONAL),
    ("extra", INFORMATIONAL),
    ("extra.*", INFORMATIONAL),
    ("host.hostname", INFORMATIONAL),
    ("host.container", INFORMATIONAL),
    ("host.container.*", INFORMATIONAL),
    ("host.scheduler", INFORMATIONAL),
    ("host.scheduler.*", INFORMATIONAL),
    ("host", PERFORMANCE),
    ("host.*", PERFORMANCE),
    # GPUs: the architecture decides the kernels; the rest decides speed
    ("gpu", NUMERICS),  # a CPU run against a GPU run
    ("gpu.compute_capabilities", NUMERICS),
    ("gpu.devices.*.compute_capability", NUMERICS),
    ("gpu.devices.*.uuid", INFORMATIONAL),
    ("gpu.devices.*.pci_bus_id", INFORMATIONAL),
    ("gpu.devices.*.fabric.cluster_uuid", INFORMATIONAL),
    ("gpu.devices.*.fabric.clique_id", INFORMATIONAL),
    ("gpu.*", PERFORMANCE),
    # CUDA libraries as loaded
    ("cuda_libraries.initialised", INFORMATIONAL),
    ("cuda_libraries.nccl", PERFORMANCE),
    ("cuda_libraries.nccl.*", PERFORMANCE),
    ("cuda_libraries.driver", PERFORMANCE),
    ("cuda_libraries.driver.*", PERFORMANCE),
    ("cuda_libraries.nvshmem", PERFORMANCE),
    ("cuda_libraries.nvshmem.*", PERFORMANCE),
    ("cuda_libraries", NUMERICS),
    ("cuda_libraries.*", NUMERICS),
    # frameworks
    ("frameworks.torch.settings.num_threads", PERFORMANCE),
    ("frameworks.transformer_engine.imported", INFORMATIONAL),
    ("frameworks.deepep", PERFORMANCE),
    ("frameworks.deepep.*", PERFORMANCE),
    ("frameworks", NUMERICS),
    ("frameworks.*", NUMERICS),
    # network
    ("network", PERFORMANCE),
    ("network.*", PERFORMANCE),
    # python
    ("python.executable", INFORMATIONAL),
    ("python.prefix", INFORMATIONAL),
    ("python.distributions_sha256", INFORMATIONAL),
    ("python.distribution_count", INFORMATIONAL),
    *((f"python.distributions.{p}", NUMERICS) for p in NUMERICS_PACKAGES),
    *((f"python.distributions.{p}", PERFORMANCE) for p in PERFORMANCE_PACKAGES),
    ("python.distributions", INFORMATIONAL),
    ("python.distributions.*", INFORMATIONAL),
    ("python", PERFORMANCE),
    ("python.*", PERFORMANCE),
    # environment
    ("environment.secrets_set", INFORMATIONAL),
    *((f"environment.variables.{p}", NUMERICS) for p in NUMERICS_ENV),
    *((f"environment.variables.{p}", INFORMATIONAL) for p in INFORMATIONAL_ENV),
    ("environment", PERFORMANCE),
    ("environment.*", PERFORMANCE),
    # the resolved recipe (run directories only)
    *((f"recipe.{p}", INFORMATIONAL) for p in (
        "name", "aliases", "aliases.*", "description", "provenance", "provenance.*", "notes", "notes.*",
        "run_command", "author", "author.*", "status", "result", "result.*", "stack", "stack.*",
        "correctness", "correctness.*", "hardware.instance", "hardware.price_per_gpu_hour",
        "hardware.nominal_memory_gb", "layout.label", "layout.summary", "layout.highlights",
        "training.log_interval", "training.measure_warmup_steps", "logging", "logging.*",
        # where a value came from (stated, or filled by the fill policy): the value itself is
        # compared at its own path (recipe.optimizer.lr ...), so only its record is informational
        "fill_policy", "filled", "filled.*")),
    *((f"recipe.env.{p}", NUMERICS) for p in NUMERICS_ENV),
    *((f"recipe.{p}", PERFORMANCE) for p in (
        "recompute", "recompute.*", "offload", "offload.*", "hardware", "hardware.*", "env", "env.*",
        "training.checkpoint_interval", "training.keep_checkpoints", "training.final_checkpoint",
        "training.async_checkpoint", "training.gc", "training.gc.*",
        # how often the held-out loss is measured (it draws no random number training would);
        # validation.eval_iters sizes the held-out split, so it changes the rows trained on: numerics
        "validation.eval_interval")),
    ("recipe", NUMERICS),
    ("recipe.*", NUMERICS),
    # what was trained on
    ("run_inputs", NUMERICS),
    ("run_inputs.*", NUMERICS),
]


def classify(path: str) -> str:
    """The class of a difference at this dotted field path (total: always one of CLASSES)."""
    for pattern, cls in RULES:
        if fnmatchcase(path, pattern):
            return cls
    return INFORMATIONAL
