"""Checkpoint import at full scale: what each expert-parallel rank reads of one real-width layer.

Writes a synthetic HF-named safetensors checkpoint of one decoder layer of the real Muse Spark
width with all its experts (256: about 26 GB in bf16), then loads it as EP ranks would, one
rank after another in fresh processes on this CPU (``read_rank_weights`` of
:mod:`muse_stack.engines.mcore.load`: each rank reads its experts and its TP/ETP shard, once).
Per rank it records the bytes read, the number of reads, the wall time to copy its weights
out of the files into host memory, and the peak resident memory of the loading process
(its copied weights plus the file pages it touched).

    PYTHONPATH=. python benchmarks/scripts/import_slices.py --dir /scratch/ckpt --out benchmarks/results/import-slices/results.json
    PYTHONPATH=. python benchmarks/scripts/import_slices.py --experts 16 --sparse   # quick: a sparse file, no disk I/O

The checkpoint is sharded as Hugging Face shards it (at most 5 GB a file unless one tensor is
larger: the stacked expert tensors are 17 and 9 GB). ``--sparse`` writes the headers and leaves
the data a hole: bytes and memory are as for real
data, times are not (reading a hole costs no disk I/O). Not part of ``make test``; the test
suite runs the same check at the real widths with 16 experts (tests/unit/test_engine_import_slices.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DTYPES = {"torch.bfloat16": ("BF16", 2), "torch.float32": ("F32", 4)}


def layer_specs(experts: int, layer: int = 0) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, torch dtype name) of every tensor of one real-width decoder layer."""
    import torch

    from muse_stack.models.muse_spark import MuseSparkForCausalLM
    from muse_stack.models.muse_spark.checkpoint import keeps_fp32
    from muse_stack.models.muse_spark.config import ModelConfig

    cfg = ModelConfig().with_overrides(num_hidden_layers=layer + 1, num_local_experts=experts)
    with torch.device("meta"):
        model = MuseSparkForCausalLM(cfg, seed=None)
    prefix = f"model.language_model.layers.{layer}."
    return [(n, tuple(t.shape), "torch.float32" if keeps_fp32(n) else "torch.bfloat16")
            for n, t in model.state_dict().items() if n.startswith(prefix)]


def _write_file(file: Path, specs: list[tuple[str, tuple[int, ...], str]], *, sparse: bool) -> int:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        code, size = DTYPES[dtype]
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        start = fh.tell()
        if sparse:
            fh.truncate(start + offset)
        else:
            block = os.urandom(64 * 2**20)
            left = offset
            while left:
                left -= fh.write(block[:min(left, len(block))])
            fh.flush()
            os.fsync(fh.fileno())
    return start + offset


def write_checkpoint(path: Path, specs: list[tuple[str, tuple[int, ...], str]], *, sparse: bool,
                     max_shard_bytes: int = 5 * 10**9) -> int:
    """An HF-style checkpoint (safetensors shards of at most ``max_shard_bytes`` unless one tensor
    is larger, and the index) with the given tensors; returns its size in bytes. Sparse: the data
    is left a hole. Otherwise it is filled with a repeated random 64 MiB block."""
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for spec in specs:
        n = DTYPES[spec[2]][1]
        for d in spec[1]:
            n *= d
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    path.mkdir(parents=True, exist_ok=True)
    total, weight_map = 0, {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += _write_file(path / file, shard, sparse=sparse)
        weight_map.update({name: file for name, _, _ in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def load_rank(path: Path, experts: int, ep: int, etp: int, rank: int) -> dict[str, object]:
    """Rank ``rank`` of EP ``ep`` (ETP rank 0 of ``etp``; TP 1) loads its part of layer 0."""
    from muse_stack.engines.mcore.load import CheckpointSlices, read_rank_weights
    from muse_stack.engines.mcore.weights import rank_names

    source = CheckpointSlices(path)
    names = [n for n, _, _ in layer_specs(experts)]
    local = rank_names(names, experts, ep_rank=rank, ep_size=ep, layers=range(0, 1))
    t0 = time.perf_counter()
    held = []  # the rank's weights in host memory, copied out of the file (as into parameters)
    for _, _, part in read_rank_weights(source, local, layer_offset=0, expert_offset=rank * (experts // ep),
                                        tp_rank=0, tp_size=1, etp_rank=0, etp_size=etp):
        held.append(part.clone())
        del part
    seconds = time.perf_counter() - t0
    return {"rank": rank, "bytes_read": source.bytes_read, "reads": source.reads, "tensors": len(local),
            "seconds": seconds, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--etp", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    ap.add_argument("--sparse", action="store_true", help="leave the data a hole (bytes and memory only)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    ap.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    ap.add_argument("--load-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.load_rank is not None:  # one rank, in its own process (its own peak memory)
        print(json.dumps(load_rank(args.dir, args.experts, args.ep, args.etp, args.load_rank)))
        return 0
    directory = args.dir or Path(tempfile.mkdtemp(prefix="muse-import-"))
    specs = layer_specs(args.experts)
    t0 = time.perf_counter()
    size = write_checkpoint(directory, specs, sparse=args.sparse)
    write_s = time.perf_counter() - t0
    print(f"wrote {size / 1e9:.1f} GB in {write_s:.0f} s to {directory}", file=sys.stderr)
    ranks = []
    try:
        for rank in range(args.ep):
            cmd = [sys.executable, __file__, "--experts", str(args.experts), "--ep", str(args.ep), "--etp",
                   str(args.etp), "--dir", str(directory), "--load-rank", str(rank)]
            done = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
            if done.returncode != 0:
                sys.stderr.write(done.stderr)
                raise SystemExit(f"rank {rank} failed (exit {done.returncode})")
            ranks.append(json.loads(done.stdout.splitlines()[-1]))
            r = ranks[-1]
            print(f"rank {rank}: {r['bytes_read'] / 1e9:.2f} GB in {r['reads']} reads, {r['seconds']:.1f} s, "
                  f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
    finally:
        if not args.keep:
            for file in directory.glob("model*.safetensors*"):
                file.unlink()
            if args.dir is None:
                shutil.rmtree(directory, ignore_errors=True)
    result = {"command": " ".join(["python", "benchmarks/scripts/import_slices.py", *(argv or sys.argv[1:])]),
              "experts": args.experts, "ep": args.ep, "etp": args.etp, "sparse": args.sparse,
              "checkpoint_bytes": size, "write_seconds": write_s, "host": platform.node(),
              "cpu_count": os.cpu_count(), "ranks": ranks}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
