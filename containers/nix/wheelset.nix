# The part of the flake's wheel-set handling that needs no nixpkgs: read a hash-pinned wheel set
# (containers/locks/pylock.<target>.toml, PEP 751) and list every file the image installs, with
# its url and sha256, plus the pip requirement lines that pin them. flake.nix turns each file
# into a fixed-output fetch, so a Nix build installs the same bytes as the Dockerfile.
#   nix-instantiate --eval --strict --json -E \
#     '(import ./containers/nix/wheelset.nix { pylockFile = ./containers/locks/pylock.b200.toml; }).files'
# Must agree with muse_stack/stack/pylock.py (tests/system/test_stack_nix.py): the same packages, the
# same hashes, the same requirement lines.
{ pylockFile }:
let
  inherit (builtins) concatStringsSep concatLists filter map head isList split replaceStrings
    substring stringLength sort elem length listToAttrs attrNames hasAttr;

  where = toString pylockFile;

  # builtins.fromTOML refuses TOML dates and times (Nix has no such type), and PEP 751 writes
  # `upload-time = 2026-11-18T11:06:55Z`, its only datetime key. Each upload-time value that
  # starts a line or follows `{` or `,` is quoted first; nothing else changes, and a datetime
  # under any other key still stops fromTOML with its own error.
  datetime = "[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9]{2}:[0-9]{2}(:[0-9]{2}(\\.[0-9]+)?)?(Z|[+-][0-9]{2}:[0-9]{2})?";
  quoteDatetimes = text:
    concatStringsSep "" (map (p: if isList p then "${builtins.elemAt p 0}\"${builtins.elemAt p 1}\"" else p)
      (split "([{,\n][ \t]*upload-time[ \t]*=[ \t]*)(${datetime})" text));
  doc = builtins.fromTOML (quoteDatetimes (builtins.readFile pylockFile));

  fail = msg: throw "${where}: ${msg}";

  # PEP 503 names: lower case, runs of - _ . as one dash (pylock.canonical)
  upper = [ "A" "B" "C" "D" "E" "F" "G" "H" "I" "J" "K" "L" "M" "N" "O" "P" "Q" "R" "S" "T" "U" "V" "W" "X" "Y" "Z" ];
  lower = [ "a" "b" "c" "d" "e" "f" "g" "h" "i" "j" "k" "l" "m" "n" "o" "p" "q" "r" "s" "t" "u" "v" "w" "x" "y" "z" ];
  canonical = name:
    replaceStrings upper lower (concatStringsSep "" (map (p: if isList p then "-" else p) (split "[-_.]+" name)));

  isHex64 = s: builtins.match "[0-9a-f]{64}" s != null;

  artifact = pkgName: kind: raw:
    let
      url = raw.url or raw.path or (fail "${pkgName}: a ${kind} has no url (or path)");
      sha256 = raw.hashes.sha256 or (fail "${pkgName}: ${url} has no sha256 hash");
      parts = split "/" url;
      filename = builtins.elemAt parts (length parts - 1);
      local = substring 0 7 url == "file://";
    in
    if !isHex64 sha256 then fail "${pkgName}: sha256 ${sha256} of ${url} is not 64 hex digits"
    else {
      inherit url sha256 filename kind local;
      # the file a file:// url names on the machine that resolved the set
      path = if local then substring 7 (stringLength url - 7) url else null;
    };

  lockVersion = toString (doc.lock-version or "absent");
  tool = doc.tool.muse-stack or (fail "no [tool.muse-stack] table (regenerate it: muse-stack stack resolve)");
  sdistNames = map canonical (tool.sdists or (fail "[tool.muse-stack] has no sdists list"));

  packages0 = map
    (raw:
      let
        name = raw.name or (fail "a [[packages]] entry has no name");
        version = raw.version or (fail "${name} has no version");
        wheels = map (artifact name "wheel") (raw.wheels or [ ]);
        sdist = if raw ? sdist then artifact name "sdist" raw.sdist else null;
      in
      if wheels == [ ] && sdist == null then fail "${name} ${version}: no wheel and no sdist"
      else { inherit name version wheels sdist; key = canonical name; marker = raw.marker or null; })
    (doc.packages or [ ]);
  packages = sort (a: b: a.key < b.key) packages0;
  keys = map (p: p.key) packages;
  byKey = listToAttrs (map (p: { name = p.key; value = p; }) packages);

  duplicates = filter (k: length (filter (x: x == k) keys) > 1) keys;
  missingSdists = filter (k: !(hasAttr k byKey) || byKey.${k}.sdist == null) sdistNames;
  wheelless = filter (p: p.wheels == [ ] && !(elem p.key sdistNames)) packages;

  built = p: elem p.key sdistNames;
  hashesOf = p: if built p then [ p.sdist.sha256 ] else map (a: a.sha256) p.wheels;
  line = p: "${p.name}==${p.version} " + concatStringsSep " " (map (h: "--hash=sha256:${h}") (hashesOf p));
  lines = ps: concatStringsSep "\n" (map line ps) + "\n";

  # every wheel of the set, and the sdist of each package the image compiles
  files = concatLists (map
    (p: map (a: a // { inherit (p) name version key; }) (p.wheels ++ (if built p then [ p.sdist ] else [ ])))
    packages);

  # Each file as a fixed-output fetch of its url and sha256: `fetchurl` and `requireFile` are
  # nixpkgs' (flake.nix) or a test's stand-ins that record their arguments. A file:// url (the
  # cpu set's local PyTorch wheel) names a file on the machine that resolved the set, which no
  # fetch can reach: it becomes a requireFile, which fails with the command that adds it.
  fetchWith = { fetchurl, requireFile }:
    map
      (f: f // {
        src =
          if f.local then
            requireFile {
              name = f.filename;
              inherit (f) sha256;
              message = ''
                The wheel set ${where} takes ${f.name} ${f.version} from a local file,
                ${f.url}, which no fixed-output fetch can download.
                Add that file (its sha256 must be ${f.sha256}) to the Nix store, then build again:
                  nix-store --add-fixed sha256 ${f.path}
              '';
            }
          else fetchurl { name = f.filename; inherit (f) url sha256; };
      })
      files;

  # the components a stack lock pins through the registry, against the set: a list of mismatches
  # (empty when the set carries each at the lock's version). `components` is lock.nix's.
  componentMismatches = components:
    let
      c = components;
      te = c.transformer_engine or null;
      pin = pkg: version: { key = canonical pkg; inherit version; };
      comp = n: if (c.${n} or null) == null then [ ] else [ (pin c.${n}.package c.${n}.version) ];
      pins = [ (pin c.torch.package c.torch.version) ]
        ++ (if te != null && te.build == "wheel" then [ (pin te.core_package te.version) (pin te.torch_package te.version) ] else [ ])
        ++ concatLists (map comp [ "cudnn" "nccl" "flash_attn" "deepep" "megatron_core" ]);
      # as `stack check`: the release must agree; a local label (+cpu) only where the lock names one
      release = v: head (builtins.match "([^+]*).*" v);
      differs = want: got: release want != release got || (want != release want && want != got);
      bad = filter (x: !(hasAttr x.key byKey) || differs x.version byKey.${x.key}.version) pins;
    in
    map (x: "${x.key} ${x.version} (the set has ${if hasAttr x.key byKey then byKey.${x.key}.version else "none"})") bad;
in
if lockVersion != "1.0" then fail "lock-version must be 1.0 (PEP 751), found ${lockVersion}"
else if duplicates != [ ] then fail "listed twice: ${concatStringsSep ", " duplicates}"
else if missingSdists != [ ] then fail "[tool.muse-stack].sdists names ${concatStringsSep ", " missingSdists}, which the set has no sdist for"
else if wheelless != [ ] then fail "${(head wheelless).name} has only an sdist and is not in [tool.muse-stack].sdists"
else {
  inherit packages files componentMismatches fetchWith;
  lockName = tool.lock or (fail "[tool.muse-stack] has no lock name");
  inputsSha256 = tool.inputs-sha256 or null;
  sdists = sdistNames;
  # pip requirement lines (`name==version --hash=sha256:...`), as pylock.requirement_lines writes them
  requirements = lines packages;
  wheelRequirements = lines (filter (p: !(built p)) packages);
  sdistPackages = filter built packages;
  localFiles = filter (f: f.local) files;
}
