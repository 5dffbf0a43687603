"""Collective bandwidth at the message sizes a recipe's step sends (benchmarks/lab/messages.py).

    torchrun --standalone --nproc-per-node 2 benchmarks/scripts/comm.py RECIPE [OVERRIDE...] --out comm.json
    (on GPUs: NCCL; --backend gloo runs the same on CPUs, as the tests do)

For each message of one step (TP all-gather / reduce-scatter, EP all-to-all, PP send/recv, DP and
expert-DP reduce-scatter / all-gather) it times the collective over the machine's ranks, or the
message's group if smaller: ``--warmup`` untimed calls, then ``--iters`` timed ones (CUDA events
on GPUs, ``perf_counter`` around a barrier on CPUs), and reports the median with the algorithm
and bus bandwidth as NCCL's tests define them. Every result is checked against the expected
values, so a broken collective cannot pass for a fast one. On GPUs it also measures the device
memory each new communicator holds outside PyTorch's allocator (``cudaMemGetInfo`` before and
after its first collective, less what the allocator reserved meanwhile). ``--max-bytes`` caps
each message (the CPU tests use kilobytes; a capped row says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package

from lab.messages import bus_gbps, step_messages  # noqa: E402

def op_of(kind: str) -> str:
    return kind.split("_", 1)[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_op(op: str, nbytes: int, group, ranks: list[int], device: torch.device):
    """(call, check, bytes) for one message of about ``nbytes`` per rank: ``call`` issues the
    collective once, ``check`` verifies the last result, ``bytes`` is the message size used."""
    n = len(ranks)
    me = ranks.index(dist.get_rank())
    count = max(n, nbytes // 4 // n * n)  # fp32 elements, a multiple of the group size
    send = torch.full((count,), float(me + 1), device=device)
    if op == "allgather":
        out = torch.empty(count * n, device=device)

        def call():
            dist.all_gather_into_tensor(out, send, group=group)

        def check():
            return all(bool((chunk == r + 1).all()) for r, chunk in enumerate(out.chunk(n)))
    elif op == "reducescatter":
        out = torch.empty(count // n, device=device)

        def call():
            dist.reduce_scatter_tensor(out, send, group=group)

        def check():
            return bool((out == n * (n + 1) / 2).all())
    elif op == "alltoall":
        out = torch.empty(count, device=device)

        def call():
            dist.all_to_all_single(out, send, group=group)

        def check():
            return all(bool((chunk == r + 1).all()) for r, chunk in enumerate(out.chunk(n)))
    elif op == "sendrecv":
        out = torch.empty(count, device=device)
        peer = ranks[(me + 1) % n] if me % 2 == 0 else ranks[(me - 1) % n]

        def call():
            if me % 2 == 0:
                dist.send(send, peer, group=group)
                dist.recv(out, peer, group=group)
            else:
                dist.recv(out, peer, group=group)
                dist.send(send, peer, group=group)

        def check():
            return bool((out == ranks.index(peer) + 1).all())
    else:
        raise ValueError(op)
    return call, check, count * 4


def time_op(call, device: torch.device, group, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        call()
    _sync(device)
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return times


def communicator_bytes(ranks: list[int], device: torch.device) -> int | None:
    """Device memory a new communicator over ``ranks`` holds outside PyTorch's allocator."""
    if device.type != "cuda":
        dist.new_group(ranks)  # every rank takes part in creating a group, as on GPUs
        return None
    _sync(device)
    free0, _ = torch.cuda.mem_get_info(device)
    reserved0 = torch.cuda.memory_reserved(device)
    group = dist.new_group(ranks)
    if dist.get_rank() in ranks:
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe, group=group)
    _sync(device)
    free1, _ = torch.cuda.mem_get_info(device)
    return (free0 - free1) - (torch.cuda.memory_reserved(device) - reserved0)


def measure(recipe_name: str, overrides: list[str], *, warmup: int, iters: int, max_bytes: int | None,
            device: torch.device) -> dict:
    from muse_stack.recipes.catalogue import load_recipe

    recipe = load_recipe(recipe_name, overrides)
    world = dist.get_world_size()
    rows = []
    groups: dict[int, object] = {}
    comm_bytes = {}
    for message in step_messages(recipe):
        op = op_of(message.kind)
        size = min(message.group, world)
        if op == "sendrecv":
            size = 2 if world >= 2 else 1
        if size < 2:
            continue
        ranks = list(range(size))
        if size not in groups:
            comm_bytes[size] = communicator_bytes(ranks, device)
            groups[size] = dist.new_group(ranks)
        nbytes = message.bytes if max_bytes is None else min(message.bytes, max_bytes)
        row = {"kind": message.kind, "op": op, "group_in_recipe": message.group, "group_measured": size,
               "bytes_in_recipe": message.bytes, "per_step": message.per_step}
        if dist.get_rank() < size:
            call, check, measured = run_op(op, nbytes, groups[size], ranks, device)
            times = time_op(call, device, groups[size], warmup, iters)
            ok = check()
            median = statistics.median(times)
            row.update(bytes_measured=measured, capped=measured < message.bytes, iters=iters, warmup=warmup,
                       median_s=median, min_s=min(times), max_s=max(times), correct=ok,
                       algbw_gbps=measured / median / 1e9, busbw_gbps=bus_gbps(op, size, measured, median))
        dist.barrier()
        rows.append(row)
    return {"recipe": recipe.name, "overrides": overrides, "backend": dist.get_backend(), "world": world,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "communicator_bytes": {str(k): v for k, v in comm_bytes.items()}, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--max-bytes", type=int, default=None)
    args = parser.parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    try:
        result = measure(args.recipe, args.overrides, warmup=args.warmup, iters=args.iters,
                         max_bytes=args.max_bytes, device=device)
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        bad = [r["kind"] for r in result["rows"] if r.get("correct") is False]
        return 1 if bad else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
