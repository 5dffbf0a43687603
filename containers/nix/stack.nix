# The Python environment of one stack lock, installed from its hash-pinned wheel set
# (containers/nix/wheelset.nix): the part of the flake that needs nixpkgs.
#
#   files     every wheel of the set, and the sdist of each package the image compiles, as a
#             fixed-output fetch of the set's url and sha256 (the bytes the Dockerfile installs)
#   wheels    a venv holding every package the set installs from a wheel
#             (pip --no-index --no-deps --require-hashes, from the fetched files only)
#   built     each sdist of [tool.muse-stack].sdists compiled into a wheel against `wheels`
#             (flash-attn, the Transformer Engine torch extension), with nvcc from nixpkgs' CUDA
#   env       the image's venv: the set's wheels (hashes required) and the compiled wheels
#
# Installed files are the wheels' files unchanged (no patchelf): extension modules find
# libstdc++ and zlib through LD_LIBRARY_PATH (runtimeLibraryPath), ELF programs in wheels
# (ninja, triton's ptxas) through the loader the image links at its usual path (loaderLink).
{ pkgs, lock, wheelset, cudaPackages ? null }:
let
  lib = pkgs.lib;
  l = lock;
  ws = wheelset;
  gpu = l.kind == "gpu";

  pyAttr = "python" + lib.concatStrings (lib.take 2 (lib.splitString "." l.pythonVersion));
  python0 = pkgs.${pyAttr} or (throw "lock ${l.name}: nixpkgs has no ${pyAttr}; the wheel set is resolved for Python ${l.pythonVersion}");
  # the set's wheels are tagged for the Python minor version (cp312, abi3, py3); nixpkgs carries
  # one patch release of it, which is named here and in the image labels, never hidden
  python = lib.warnIf (python0.version != l.pythonVersion)
    "lock ${l.name}: Python ${l.pythonVersion} in the lock, ${python0.version} from nixpkgs (${pyAttr}); the set's wheels install unchanged, the interpreter's patch release differs (README: Images, Nix)"
    python0;
  pipPath = "${python.pkgs.pip}/${python.sitePackages}";

  runtimeLibraryPath = lib.makeLibraryPath [ pkgs.stdenv.cc.cc.lib pkgs.zlib ];
  loader = pkgs.stdenv.cc.bintools.dynamicLinker;
  # the path manylinux programs name as their interpreter, linked to nixpkgs' glibc loader
  loaderPath = {
    x86_64-linux = "lib64/ld-linux-x86-64.so.2";
    aarch64-linux = "lib/ld-linux-aarch64.so.1";
  }.${pkgs.stdenv.hostPlatform.system} or (throw "no manylinux loader path for ${pkgs.stdenv.hostPlatform.system}");
  loaderLink = pkgs.runCommand "manylinux-loader-link" { } ''
    mkdir -p "$out/$(dirname ${loaderPath})"
    ln -s ${loader} "$out/${loaderPath}"
  '';

  files = ws.fetchWith { inherit (pkgs) fetchurl requireFile; };
  wheelFiles = builtins.filter (f: f.kind == "wheel") files;
  sdistOf = key: (lib.findFirst (f: f.kind == "sdist" && f.key == key)
    (throw "lock ${l.name}: the wheel set has no sdist of ${key}") files).src;
  findLinks = pkgs.linkFarm "pylock-${l.name}-files" (map (f: { name = f.filename; path = f.src; }) wheelFiles);

  # a venv (as the Dockerfile's /opt/muse-stack/venv) holding the set's wheels, hashes required,
  # then any compiled wheels; pip is nixpkgs' and runs from PYTHONPATH, so it is not installed
  mkVenv = name: extraWheels: pkgs.runCommand name
    {
      requirements = ws.wheelRequirements;
      passAsFile = [ "requirements" ];
      passthru = { inherit python; };
    } ''
    ${python.interpreter} -m venv --without-pip "$out"
    export PYTHONPATH=${pipPath} PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 HOME="$TMPDIR"
    "$out/bin/python" -m pip install --no-index --no-deps --require-hashes \
      --find-links ${findLinks} --requirement "$requirementsPath"
    ${lib.optionalString (extraWheels != [ ]) ''
      "$out/bin/python" -m pip install --no-index --no-deps ${lib.concatMapStringsSep " " (d: "${d}/*.whl") extraWheels}
    ''}
  '';

  wheels = mkVenv "muse-stack-${l.name}-wheels" [ ];

  # --- the sdists the image compiles (GPU locks) ---------------------------------------------
  cuda = if cudaPackages != null then cudaPackages else throw "lock ${l.name}: compiling ${lib.concatStringsSep ", " ws.sdists} needs CUDA ${toString l.cudaVersion} from nixpkgs";
  # one CUDA tree for torch.utils.cpp_extension (CUDA_HOME): nvcc, headers, libraries. Each is a
  # package of nixpkgs' cudaPackages (the keys of NVIDIA's redistributable manifest of that CUDA, which
  # nixpkgs turns into attributes one for one); every one must exist, so a misspelling stops evaluation
  cudaHomePackages = [
    "cuda_nvcc" "cuda_cudart" "cuda_cccl" "cuda_nvrtc" "cuda_nvtx" "cuda_profiler_api" "cuda_crt"
    "libcublas" "libcusparse" "libcusolver" "libcurand"
  ];
  cudaHome = pkgs.symlinkJoin {
    name = "cuda-home-${toString l.cudaVersion}";
    paths = lib.concatMap (p: [ (lib.getBin p) (lib.getDev p) (lib.getLib p) ] ++ lib.optional (p ? static) p.static)
      (map (n: cuda.${n} or (throw "lock ${l.name}: nixpkgs' cudaPackages for CUDA ${toString l.cudaVersion} has no ${n}; pin a nixpkgs revision whose CUDA ${toString l.cudaVersion} carries it"))
        cudaHomePackages);
  };

  # pip wheel of one sdist against `wheels` (--no-build-isolation: the set's torch, setuptools,
  # ninja, pybind11, ...). Jobs: Nix's --cores (about 3 GB of compiler memory per TE job; flash-attn's
  # setup narrows them to its own estimate of the memory a job takes)
  compile = { key, env, postPatch ? "", setup ? "" }:
    let p = lib.findFirst (x: x.key == key) (throw "lock ${l.name}: ${key} is not in the wheel set") ws.packages; in
    cuda.backendStdenv.mkDerivation {
      pname = "${key}-sdist-build-${l.name}";
      inherit (p) version;
      src = sdistOf key;
      inherit postPatch;
      dontConfigure = true;
      buildPhase = ''
        runHook preBuild
        export HOME="$TMPDIR" CUDA_HOME=${cudaHome} CUDA_PATH=${cudaHome}
        export PATH=${cudaHome}/bin:${wheels}/bin:$PATH
        export LD_LIBRARY_PATH=${runtimeLibraryPath}
        export MAX_JOBS="$NIX_BUILD_CORES"
        ${lib.concatStringsSep "\n" (lib.mapAttrsToList (k: v: "export ${k}=${lib.escapeShellArg v}") env)}
        ${setup}
        PYTHONPATH=${pipPath} ${wheels}/bin/python -m pip wheel --no-index --no-deps --no-build-isolation \
          --no-cache-dir --disable-pip-version-check --wheel-dir dist .
        runHook postBuild
      '';
      installPhase = ''
        runHook preInstall
        mkdir -p "$out" && cp dist/*.whl "$out/"
        runHook postInstall
      '';
    };

  builders = {
    # the locked flash-attn compiles with -std=c++17; the locked torch's headers need C++20
    flash-attn = compile {
      key = "flash-attn";
      env = {
        FLASH_ATTENTION_FORCE_BUILD = "TRUE";
        FLASH_ATTN_CUDA_ARCHS = l.buildArgs.FLASH_ATTN_CUDA_ARCHS;
      };
      postPatch = ''substituteInPlace setup.py --replace-fail "-std=c++17" "-std=c++20"'';
      # its jobs at the memory its own setup.py estimates a job takes, at most Nix's --cores
      setup = ''
        MAX_JOBS=$(${wheels}/bin/python ${../flash_attn_prepare.py} jobs . --max "$NIX_BUILD_CORES")
        export MAX_JOBS
      '';
    };
    # the PyTorch extension of Transformer Engine, against the set's torch and TE core wheel
    transformer-engine-torch = compile {
      key = "transformer-engine-torch";
      env = {
        NVTE_FRAMEWORK = "pytorch";
        NVTE_PYTORCH_FORCE_BUILD = "TRUE";
        NVTE_CUDA_ARCHS = l.buildArgs.NVTE_CUDA_ARCHS;
        NVTE_WITH_NCCL_EP = l.buildArgs.NVTE_WITH_NCCL_EP;
      };
      # the extension includes cudnn.h and nccl.h, which its sdist does not carry: the set's
      # cuDNN and NCCL wheels have them (nvidia/cudnn/include, nvidia/nccl/include)
      setup = ''
        for m in cudnn nccl; do
          d="$(${wheels}/bin/python -c "import nvidia.$m as m; print(list(m.__path__)[0])")/include"
          test -f "$d/$m.h" || { echo "no $m.h in the wheel set's nvidia.$m ($d)"; exit 1; }
          export CPATH="$d''${CPATH:+:$CPATH}"
        done
      '';
    };
  };
  builtWheel = key: (builders.${key} or (throw "lock ${l.name}: the set compiles ${key} from its sdist, and the flake has no build of ${key}"));
  built = map (p: builtWheel p.key) ws.sdistPackages;

  # Transformer Engine from a source commit (the gb200 lock) is not in the wheel set
  te = l.components.transformer_engine or null;
  unpinned = v: v == null || (builtins.isAttrs v && v ? "null");
  teSource =
    if te != null && te.build == "source" then
      throw ("lock ${l.name}: Transformer Engine is built from source (${te.source_repo}); "
        + lib.optionalString (unpinned te.source_commit)
        "components.transformer_engine.source_commit is not pinned (${te.source_commit."null" or "null"}); "
        + "a Nix build of it also needs the checkout's hash (with submodules), which the lock has no field for. "
        + "Build this image with the Dockerfile (make image gpu=${l.name}); .#wheelset-${l.name} builds the wheel set alone")
    else null;

  env =
    if built == [ ] && teSource == null then wheels
    else builtins.seq teSource (mkVenv "muse-stack-${l.name}-env" built);
in
{
  inherit python files findLinks wheels built env runtimeLibraryPath loaderLink;
  # the set's cuDNN and NCCL (GPU locks): first on the image's LD_LIBRARY_PATH, ahead of any system
  # folder a container runtime fills (/usr/lib/<triplet>), as in the Dockerfile's image
  setLibraryPath = if gpu then lib.concatMapStringsSep ":" (m: "${env}/${python.sitePackages}/nvidia/${m}/lib") [ "cudnn" "nccl" ] else "";
  cudaHome = if gpu then cudaHome else null;
}
