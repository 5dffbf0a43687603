{
  # muse-stack images and dev shells from the same stack locks as the Dockerfile
  # (containers/locks/<target>.toml, read by containers/nix/lock.nix).
  #   nix build .#image-b200 && ./result | docker load      (one build per system; see README "Images")
  #   nix develop .#cpu
  # Versions come from the lock only. Where nixpkgs carries another version than the lock pins,
  # evaluation stops with a message naming both (pin a nixpkgs revision that carries the lock's
  # version, or change the lock); nothing silently builds another version.
  description = "muse-stack: reproducible training stack for Muse Spark Open (pinned images)";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs = { self, nixpkgs }:
    let
      lib = nixpkgs.lib;
      systems = [ "x86_64-linux" "aarch64-linux" ];
      lockNames = map (f: lib.removeSuffix ".toml" f)
        (builtins.filter (f: lib.hasSuffix ".toml" f && !(lib.hasPrefix "pylock." f)) (builtins.attrNames (builtins.readDir ./containers/locks)));
      readLock = name: import ./containers/nix/lock.nix { lockFile = ./containers/locks + "/${name}.toml"; };
      locks = lib.genAttrs lockNames readLock;
      revision = self.rev or self.dirtyRev or null;

      # the package set of one lock: CUDA version and capabilities from the lock, versions checked
      stackFor = system: l:
        let
          cudaAttr = "cudaPackages_" + lib.replaceStrings [ "." ] [ "_" ] l.cudaVersion;
          pkgs0 = import nixpkgs {
            inherit system;
            config = { allowUnfree = true; } // lib.optionalAttrs (l.kind == "gpu") {
              cudaSupport = true;
              cudaCapabilities = l.cudaCapabilities;
            };
          };
          pkgs =
            if l.kind == "cpu" then pkgs0
            else if pkgs0 ? ${cudaAttr} then pkgs0.extend (final: prev: { cudaPackages = prev.${cudaAttr}; })
            else throw "lock ${l.name}: CUDA ${l.cudaVersion} is not in this nixpkgs (no ${cudaAttr}); pin a nixpkgs revision that has it";

          mustBe = what: wanted: got:
            if got == wanted then true
            else throw "lock ${l.name}: ${what} is ${wanted} in the lock but ${got} in this nixpkgs; pin a nixpkgs revision carrying ${wanted} or change the lock";
          # a lock version "<v>+cpu" names the PyTorch build variant; nixpkgs' torch has no suffix
          plain = v: builtins.head (lib.splitString "+" v);

          pyAttr = "python" + lib.concatStrings (lib.take 2 (lib.splitString "." l.pythonVersion));
          python = pkgs.${pyAttr} or (throw "lock ${l.name}: nixpkgs has no ${pyAttr}");
          ps = python.pkgs;
          c = l.components;

          checks = [
            (mustBe "python" l.pythonVersion python.version)
            (mustBe "torch" (plain c.torch.version) ps.torch.version)
            (mustBe "muse-stack (pyproject.toml)" l.museStackVersion (builtins.fromTOML (builtins.readFile ./pyproject.toml)).project.version)
          ] ++ lib.optionals (l.kind == "gpu") [
            (mustBe "CUDA" l.cudaVersion (lib.versions.majorMinor pkgs.cudaPackages.cudaMajorMinorVersion))
            (mustBe "transformer-engine" c.transformer_engine.version ps.transformer-engine.version)
            (mustBe "cuDNN" c.cudnn.version pkgs.cudaPackages.cudnn.version)
            (mustBe "NCCL" c.nccl.version pkgs.cudaPackages.nccl.version)
            (mustBe "flash-attn" c.flash_attn.version (ps.flash-attn.version or "absent"))
            (mustBe "aws-ofi-nccl" c.efa.aws_ofi_nccl (pkgs.aws-ofi-nccl.version or "absent"))
            (mustBe "libfabric" c.efa.libfabric pkgs.libfabric.version)
            # not packaged in nixpkgs: DeepEP and megatron-core
            (throw "lock ${l.name}: nixpkgs packages neither ${c.deepep.package} ${c.deepep.version} nor ${c.megatron_core.package} ${c.megatron_core.version}; build the GPU image with the Dockerfile (make image gpu=${l.name})")
          ];

          # muse-stack runs from its source tree at /opt/muse-stack (recipes and bundled data resolve
          # against it, as in a checkout); the Python environment carries its dependencies
          deps = p: with p; [
            pydantic typer rich pyyaml matplotlib nvidia-ml-py safetensors datasets pyarrow tokenizers jinja2 torch
          ] ++ lib.optionals (l.kind == "gpu") [ p.transformer-engine ];
          pythonEnv = python.withPackages deps;
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
            exec ${pythonEnv}/bin/python -m muse_stack.cli "$@"
          '';
        in
        assert lib.all (x: x) checks;
        { inherit pkgs python pythonEnv deps sourceTree museStack; };

      imageFor = system: l:
        let
          s = stackFor system l;
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
          contents = [ s.museStack s.pythonEnv pkgs.bashInteractive pkgs.coreutils pkgs.gnugrep pkgs.gawk pkgs.cacert root ];
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
              "PATH=/bin:/usr/local/bin"
              "HOME=/home/muse"
              "MUSE_STACK_RECIPES=/opt/muse-stack/recipes"
              "MUSE_STACK_LOCKS=/opt/muse-stack/containers/locks"
              "MUSE_STACK_IMAGE_INFO=/etc/muse-stack/image.json"
              "SSL_CERT_FILE=${pkgs.cacert}/etc/ssl/certs/ca-bundle.crt"
              # the host driver: the entrypoint links it to /run/opengl-driver/lib, else this path
              "LD_LIBRARY_PATH=/run/opengl-driver/lib:/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu:/usr/lib/aarch64-linux-gnu"
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
            };
          };
        };

      locksOf = system: lib.filterAttrs (_: l: l.system == system) locks;
    in
    {
      # the pure lock reading, for tooling: nix eval .#lib.locks.b200.buildArgs --json
      lib = { inherit locks; };

      packages = lib.genAttrs systems (system:
        lib.mapAttrs' (name: l: lib.nameValuePair "image-${name}" (imageFor system l)) (locksOf system));

      devShells = lib.genAttrs systems (system:
        let
          shells = lib.mapAttrs
            (name: l:
              let s = stackFor system l; in
              s.pkgs.mkShell {
                packages = [ (s.python.withPackages (p: s.deps p ++ [ p.pytest p.hypothesis ])) ];
                MUSE_STACK_LOCK = name;
                shellHook = ''
                  export LD_LIBRARY_PATH=/run/opengl-driver/lib''${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
                '';
              })
            (locksOf system);
        in
        shells // lib.optionalAttrs (shells ? cpu) { default = shells.cpu; });
    };
}
