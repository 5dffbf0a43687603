# The part of the flake that needs no nixpkgs: read a stack lock (containers/locks/<target>.toml)
# and derive its sha256, the Nix system, the CUDA capabilities, the image build arguments and the
# image tag. Must agree exactly with muse_stack/stack/buildargs.py (tests/system/test_stack_nix.py):
#   nix-instantiate --eval --strict --json -E \
#     'import ./containers/nix/lock.nix { lockFile = ./containers/locks/b200.toml; }'
# A value the lock leaves null is written `{ null = "why"; }` in TOML (TOML has no null).
{ lockFile }:
let
  inherit (builtins) concatStringsSep replaceStrings isAttrs isBool substring sort compareVersions foldl' elem;

  lock = builtins.fromTOML (builtins.readFile lockFile);
  sha256 = builtins.hashFile "sha256" lockFile;

  isNull' = v: isAttrs v && v ? "null";
  val = v: if isNull' v then null else v;
  str = v:
    let x = val v; in
    if x == null then "" else if isBool x then (if x then "1" else "0") else toString x;

  comp = name: val lock.components.${name};
  get = name: attr: let c = comp name; in if c == null then "" else str c.${attr};
  archs = name: fmt: let c = comp name; in if c == null then "" else fmt c.cuda_archs;

  # capabilities "M.m" -> "Mm;..." (NVTE_CUDA_ARCHS, FLASH_ATTN_CUDA_ARCHS) or "M.m;..." (TORCH_CUDA_ARCH_LIST)
  dotless = caps: concatStringsSep ";" (map (replaceStrings [ "." ] [ "" ]) caps);
  dotted = caps: concatStringsSep ";" caps;

  kind = if isNull' lock.cuda then "cpu" else "gpu";
  baseDigest = val lock.base.digest;
  baseRef = if baseDigest != null then "${lock.base.image}@${baseDigest}" else "${lock.base.image}:${lock.base.tag}";
  system = {
    "linux/amd64" = "x86_64-linux";
    "linux/arm64" = "aarch64-linux";
  }.${lock.platform} or (throw "${toString lockFile}: platform ${lock.platform} is not linux/amd64 or linux/arm64");

  # every capability the image compiles for (TE, flash-attn): nixpkgs' config.cudaCapabilities.
  # DeepEP comes as its registry wheel; its archs are checked against the wheel, not built
  cudaCapabilities =
    let
      all = builtins.concatLists (map (n: let c = comp n; in if c == null then [ ] else c.cuda_archs)
        [ "transformer_engine" "flash_attn" ]);
      uniq = foldl' (acc: x: if elem x acc then acc else acc ++ [ x ]) [ ] all;
    in
    sort (a: b: compareVersions a b < 0) uniq;

  efa = comp "efa";
  # apt-get install's arguments, NAME=VERSION by name (attribute names are sorted)
  aptPins = pkgs: concatStringsSep " " (map (n: "${n}=${pkgs.${n}}") (builtins.attrNames pkgs));
  museStackVersion = lock.components.muse_stack.version;

  buildArgs = {
    LOCK_NAME = lock.name;
    LOCK_SHA256 = sha256;
    STACK_KIND = kind;
    PLATFORM = lock.platform;
    BASE_IMAGE = lock.base.image;
    BASE_TAG = lock.base.tag;
    BASE_DIGEST = str lock.base.digest;
    BASE_REF = baseRef;
    CUDA_VERSION = if kind == "cpu" then "" else lock.cuda.version;
    PYTHON_VERSION = lock.python.version;
    APT_BASE_PACKAGES = aptPins (lock.apt.base or { });
    APT_BUILD_PACKAGES = aptPins (lock.apt.build or { });
    TORCH_PACKAGE = lock.components.torch.package;
    TORCH_VERSION = lock.components.torch.version;
    TORCH_INDEX_URL = lock.components.torch.index_url;
    TE_VERSION = get "transformer_engine" "version";
    TE_BUILD = get "transformer_engine" "build";
    TE_CORE_PACKAGE = get "transformer_engine" "core_package";
    TE_TORCH_PACKAGE = get "transformer_engine" "torch_package";
    TE_SOURCE_REPO = get "transformer_engine" "source_repo";
    TE_SOURCE_COMMIT = get "transformer_engine" "source_commit";
    NVTE_CUDA_ARCHS = archs "transformer_engine" dotless;
    NVTE_WITH_NCCL_EP = get "transformer_engine" "with_nccl_ep";
    CUDNN_PACKAGE = get "cudnn" "package";
    CUDNN_VERSION = get "cudnn" "version";
    CUDNN_PURGE_APT = get "cudnn" "purge_apt_cudnn";
    NCCL_PACKAGE = get "nccl" "package";
    NCCL_VERSION = get "nccl" "version";
    FLASH_ATTN_PACKAGE = get "flash_attn" "package";
    FLASH_ATTN_VERSION = get "flash_attn" "version";
    FLASH_ATTN_CUDA_ARCHS = archs "flash_attn" dotless;
    DEEPEP_PACKAGE = get "deepep" "package";
    DEEPEP_VERSION = get "deepep" "version";
    DEEPEP_TORCH_CUDA_ARCH_LIST = archs "deepep" dotted;
    MEGATRON_CORE_PACKAGE = get "megatron_core" "package";
    MEGATRON_CORE_VERSION = get "megatron_core" "version";
    EFA_INSTALLER_VERSION = get "efa" "installer_version";
    EFA_INSTALLER_URL = get "efa" "installer_url";
    EFA_INSTALLER_SHA256 = get "efa" "installer_sha256";
    EFA_INSTALL_FLAGS = if efa == null then "" else concatStringsSep " " efa.install_flags;
    AWS_OFI_NCCL_VERSION = get "efa" "aws_ofi_nccl";
    LIBFABRIC_VERSION = get "efa" "libfabric";
    MUSE_STACK_VERSION = museStackVersion;
  };
in
{
  inherit lock sha256 kind system cudaCapabilities buildArgs baseRef museStackVersion;
  name = lock.name;
  platform = lock.platform;
  cudaVersion = if kind == "cpu" then null else lock.cuda.version;
  pythonVersion = lock.python.version;
  components = builtins.mapAttrs (n: v: val v) lock.components;
  tag = "muse-stack:${lock.name}-${museStackVersion}-${substring 0 12 sha256}";
  imageName = "muse-stack";
  imageTag = "${lock.name}-${museStackVersion}-${substring 0 12 sha256}";
}
