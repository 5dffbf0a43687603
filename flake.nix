{
  # muse-stack images and dev shells from the same stack locks as the Dockerfile
  # (containers/locks/<target>.toml, read by containers/nix/lock.nix) and the same hash-pinned
  # wheel sets (containers/locks/pylock.<target>.toml, read by containers/nix/wheelset.nix).
  #   nix flake metadata                                     (flake.lock's nixpkgs hash, re-read on a networked machine)
  #   nix build .#image-b200 && ./result | docker load      (one build per system; see docs/images.md)
  #   nix build .#wheelset-b200                             (the wheel set alone, in a venv)
  #   nix develop .#cpu
  # Every Python package is a fixed-output fetch of the wheel set's url and sha256 (the bytes
  # the Dockerfile installs); nixpkgs gives the interpreter, nvcc for the compiled sdists and the
  # image tools. Where the lock and this nixpkgs disagree (CUDA, the wheel set's lock), evaluation
  # stops with a message naming both; the interpreter's patch release is named in a warning.
  description = "muse-stack: reproducible training stack for Muse Spark Open (pinned images)";

  # a fixed nixpkgs commit (the stable NixOS channel of 2026-05-10): the interpreter, nvcc and the image
  # tools. flake.lock locks it with its NAR hash (docs/images.md, Nix, says where the hash was read).
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/8fd9daa3db09ced9700431c5b7ad0e8ba199b575";

  outputs = { self, nixpkgs }:
    let
      lib = nixpkgs.lib;
      systems = [ "x86_64-linux" "aarch64-linux" ];
      lockNames = map (f: lib.removeSuffix ".toml" f)
        (builtins.filter (f: lib.hasSuffix ".toml" f && !(lib.hasPrefix "pylock." f)) (builtins.attrNames (builtins.readDir ./containers/locks)));
      readLock = name: import ./containers/nix/lock.nix { lockFile = ./containers/locks + "/${name}.toml"; };
      locks = lib.genAttrs lockNames readLock;
      # the hash-pinned wheel set beside each lock (pylock.<name>.toml, PEP 751)
      readWheelset = name: import ./containers/nix/wheelset.nix { pylockFile = ./containers/locks + "/pylock.${name}.toml"; };
      wheelsets = lib.genAttrs lockNames readWheelset;
      revision = self.rev or self.dirtyRev or null;

      # the package set of one lock: nixpkgs for the interpreter, CUDA's compiler and the image
      # tools; every Python package comes from the lock's hash-pinned wheel set
      stackFor = system: l:
        let
          cudaAttr = "cudaPackages_" + lib.replaceStrings [ "." ] [ "_" ] l.cudaVersion;
          pkgs = import nixpkgs {
            inherit system;
            config = { allowUnfree = true; } // lib.optionalAttrs (l.kind == "gpu") {
              cudaCapabilities = l.cudaCapabilities;
            };
          };
          cudaPackages =
            if l.kind == "cpu" then null
            else pkgs.${cudaAttr} or (throw "lock ${l.name}: CUDA ${l.cudaVersion} is not in this nixpkgs (no ${cudaAttr}); pin a nixpkgs revision that has it");

          mustBe = what: wanted: got:
            if got == wanted then true
            else throw "lock ${l.name}: ${what} is ${wanted} in the lock but ${got} in this nixpkgs; pin a nixpkgs revision carrying ${wanted} or change the lock";

          ws = wheelsets.${l.name};
          mismatches = ws.componentMismatches l.components;
          checks = [
            (mustBe "muse-stack (pyproject.toml)" l.museStackVersion (builtins.fromTOML (builtins.readFile ./pyproject.toml)).project.version)
            (if ws.lockName == l.name then true
             else throw "containers/locks/pylock.${l.name}.toml is the wheel set of lock ${ws.lockName}, not ${l.name}; regenerate it: muse-stack stack resolve ${l.name}")
            (if mismatches == [ ] then true
             else throw "lock ${l.name}: its wheel set does not carry ${lib.concatStringsSep ", " mismatches}; regenerate it: muse-stack stack resolve ${l.name}")
          ] ++ lib.optionals (l.kind == "gpu") [
            # nvcc compiles the set's sdists (flash-attn, the TE torch extension)
            (mustBe "CUDA" l.cudaVersion (lib.versions.majorMinor cudaPackages.cudaMajorMinorVersion))
          ];

          stack = import ./containers/nix/stack.nix { inherit pkgs cudaPackages; lock = l; wheelset = ws; };

          # muse-stack runs from its source tree at /opt/muse-stack (recipes and bundled data resolve
          # against it, as in a checkout); the venv carries the wheel set
          sourceTree = lib.cleanSourceWith {
            src = ./.;
            filter = path: type:
              let rel = lib.removePrefix (toString ./. + "/") (toString path); in
              builtins.any (p: rel == p || lib.hasPrefix (p + "/") rel)
                [ "pyproject.toml" "muse_stack" "recipes" "data" "containers" ]
              && !(lib.hasSuffix ".pyc" rel);
          };
          museStack = pkgs.writeShellScriptBin "muse-stack" ''
            export PYTHONPATH=/opt/muse-stack''${PYTHONPATH:+:$PYTHONPATH}
            export LD_LIBRARY_PATH=''${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}${stack.runtimeLibraryPath}
            exec ${stack.env}/bin/python -m muse_stack.cli "$@"
          '';
        in
        assert lib.all (x: x) checks;
        stack // { inherit pkgs sourceTree museStack; };

      imageFor = system: l:
        let
          s0 = stackFor system l;
          # AWS EFA (libfabric, aws-ofi-nccl) comes from Amazon's installer of .deb packages in the
          # Dockerfile; nixpkgs carries neither of the lock's versions, so the Nix image has none
          s = lib.warnIf (l.components.efa or null != null)
            "image-${l.name}: the Nix image carries no AWS EFA (libfabric ${l.components.efa.libfabric}, aws-ofi-nccl ${l.components.efa.aws_ofi_nccl}); NCCL uses sockets or InfiniBand. For EFA use the Dockerfile image (make image gpu=${l.name})"
            s0;
          pkgs = s.pkgs;
          info = builtins.toJSON {
            lock_name = l.name;
            lock_sha256 = l.sha256;
            base_image = "nix:nixpkgs/${nixpkgs.rev or "unknown"}";
            base_digest = null;
            source_revision = revision;
            muse_stack_version = l.museStackVersion;
            platform = l.platform;
            built_by = "nix";
          };
          infoFile = pkgs.writeText "image.json" info;
          root = pkgs.runCommand "muse-stack-root-${l.name}" { } ''
            mkdir -p $out/etc/muse-stack $out/opt/muse-stack $out/usr/local/bin $out/workspace $out/tmp
            cp ${infoFile} $out/etc/muse-stack/image.json
            cp ${./containers/locks + "/${l.name}.toml"} $out/etc/muse-stack/lock.toml
            cp -r ${s.sourceTree}/. $out/opt/muse-stack/
            install -m 0755 ${./containers/entrypoint.sh} $out/usr/local/bin/muse-stack-entrypoint
          '';
        in
        pkgs.dockerTools.streamLayeredImage {
          name = l.imageName;
          tag = l.imageTag;
          # stdenv.cc: triton and torch.compile compile their launchers at run time (the Dockerfile's
          # CUDA devel base carries a compiler too)
          contents = [ s.museStack s.env s.loaderLink pkgs.stdenv.cc pkgs.bashInteractive pkgs.coreutils pkgs.gnugrep pkgs.gawk pkgs.cacert root ];
          fakeRootCommands = ''
            mkdir -p ./run/opengl-driver ./home/muse
            chown 1000:1000 ./workspace ./home/muse ./run/opengl-driver
            chmod 1777 ./tmp
          '';
          enableFakechroot = false;
          config = {
            Entrypoint = [ "/usr/local/bin/muse-stack-entrypoint" ];
            Cmd = [ "--help" ];
            User = "1000:1000";
            WorkingDir = "/workspace";
            Env = [
              "PATH=${s.env}/bin:/bin:/usr/local/bin"
              "VIRTUAL_ENV=${s.env}"
              "HOME=/home/muse"
              "MUSE_STACK_RECIPES=/opt/muse-stack/recipes"
              "MUSE_STACK_LOCKS=/opt/muse-stack/containers/locks"
              "MUSE_STACK_IMAGE_INFO=/etc/muse-stack/image.json"
              "SSL_CERT_FILE=${pkgs.cacert}/etc/ssl/certs/ca-bundle.crt"
              # the set's cuDNN and NCCL first; then the host driver: the entrypoint links it to
              # /run/opengl-driver/lib, else these folders; then libstdc++ and zlib for the wheels'
              # extension modules (installed unpatched)
              "LD_LIBRARY_PATH=${lib.optionalString (s.setLibraryPath != "") "${s.setLibraryPath}:"}/run/opengl-driver/lib:/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu:/usr/lib/aarch64-linux-gnu:${s.runtimeLibraryPath}"
            ];
            Labels = {
              "org.opencontainers.image.title" = "muse-stack";
              "org.opencontainers.image.version" = l.museStackVersion;
              "org.opencontainers.image.revision" = if revision == null then "" else revision;
              "org.opencontainers.image.base.name" = "nix:nixpkgs/${nixpkgs.rev or "unknown"}";
              "org.opencontainers.image.base.digest" = "";
              "org.opencontainers.image.created" = "1970-01-01T00:00:01Z";
              "org.opencontainers.image.source" = "";
              "dev.muse-stack.lock.name" = l.name;
              "dev.muse-stack.lock.sha256" = l.sha256;
              "dev.muse-stack.platform" = l.platform;
              "dev.muse-stack.kind" = l.kind;
              "dev.muse-stack.python" = s.python.version;
              "dev.muse-stack.wheelset.sha256" = builtins.hashFile "sha256" (./containers/locks + "/pylock.${l.name}.toml");
            };
          };
        };

      locksOf = system: lib.filterAttrs (_: l: l.system == system) locks;

      # Locks whose image Nix cannot build, and why: Transformer Engine from a source commit (the
      # gb200 lock) needs the checkout's hash with its submodules, which the lock has no field for.
      # Their image and dev shell are left out of the outputs (so `nix flake check` evaluates on
      # every system); their wheel set builds, and the Dockerfile builds their image.
      notBuiltByNix = lib.mapAttrs
        (name: l: "Transformer Engine is built from source (${l.components.transformer_engine.source_repo} at "
          + "${toString (l.components.transformer_engine.source_commit or "an unpinned commit")}); a Nix build of it "
          + "needs the checkout's hash with submodules, which the lock does not pin. Build the image with the "
          + "Dockerfile: make image gpu=${name}; nix build .#wheelset-${name} builds the wheel set alone")
        (lib.filterAttrs
          (_: l: (l.components.transformer_engine or null) != null && l.components.transformer_engine.build == "source")
          locks);
      nixImages = system: lib.filterAttrs (name: _: !(notBuiltByNix ? ${name})) (locksOf system);
    in
    {
      # the pure lock reading, for tooling: nix eval .#lib.locks.b200.buildArgs --json
      # and the wheel sets: nix eval .#lib.wheelsets.b200.files --json
      # and which images only the Dockerfile builds: nix eval .#lib.notBuiltByNix --json
      lib = { inherit locks wheelsets notBuiltByNix; };

      packages = lib.genAttrs systems (system:
        lib.concatMapAttrs
          (name: l: {
            # the wheel set alone, installed into a venv (no compiled sdists): builds for every lock
            "wheelset-${name}" = (stackFor system l).wheels;
          })
          (locksOf system)
        // lib.mapAttrs' (name: l: lib.nameValuePair "image-${name}" (imageFor system l)) (nixImages system));

      # the lock's environment: the image's venv, with LD_LIBRARY_PATH as in the image
      devShells = lib.genAttrs systems (system:
        let
          shells = lib.mapAttrs
            (name: l:
              let s = stackFor system l; in
              s.pkgs.mkShell {
                packages = [ s.env ];
                MUSE_STACK_LOCK = name;
                shellHook = ''
                  export VIRTUAL_ENV=${s.env}
                  export LD_LIBRARY_PATH=/run/opengl-driver/lib''${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:${s.runtimeLibraryPath}
                '';
              })
            (nixImages system);
        in
        shells // lib.optionalAttrs (shells ? cpu) { default = shells.cpu; });
    };
}
