"""results.json from metrics.jsonl: the measurement window, throughput, MFU, cost."""

from __future__ import annotations

import math
import statistics
from typing import Any

from muse_stack.models.muse_spark.flops import FORMULA, PEFT_FORMULA, TOWERS_FORMULA, training_flops_per_token
from muse_stack.models.muse_spark.config import ModelConfig


def measurement_window(steps_completed: int, warmup: int) -> tuple[int, int] | None:
    """1-based inclusive window that skips ``warmup`` steps; None when nothing is left."""
    first = warmup + 1
    if steps_completed < first:
        return None
    return first, steps_completed


def summarise(metrics: list[dict[str, Any]], *, model: ModelConfig, world_size: int, seq_lens: list[int],
              warmup: int, peak_tflops: float | None, peak_source: str, price_per_gpu_hour: float | None,
              wall_seconds: float, status: str, device: str, engine: str, peft=None,
              towers: dict[str, float] | None = None) -> dict[str, Any]:
    """Everything results.json reports. tokens/s per GPU is Σ tokens / Σ step time / GPUs over
    the window (the time-weighted mean of the per-step values in metrics.jsonl). Beside the mean
    step time: the median and the slowest window step's ratio to it (a stall such as a garbage
    collection shows there while the mean hides it), with that step's number."""
    done = len(metrics)
    window = measurement_window(done, warmup)
    flops = dict(training_flops_per_token(model, seq_lens, peft=peft))
    if towers is not None:  # the perception towers' FLOPs per token of the steps that ran them
        flops["towers_training"], flops["towers_training_6n"] = towers["training"], towers["training_6n"]
        flops["training"] += towers["training"]
        flops["training_6n"] += towers["training_6n"]
    out: dict[str, Any] = {
        "status": status,
        "steps_completed": done,
        "window": list(window) if window else None,
        "warmup_steps": warmup,
        "world_size": world_size,
        "device": device,
        "engine": engine,
        "active_params": model.active_params,
        "flops_per_token": flops,
        "flops_formula": (PEFT_FORMULA if peft is not None else FORMULA) + (TOWERS_FORMULA if towers else ""),
        "peak_tflops": peak_tflops,
        "peak_source": peak_source,
        "wall_seconds": wall_seconds,
        "gpu_hours": world_size * wall_seconds / 3600.0,
        "first_loss": metrics[0]["loss"] if metrics else None,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "peak_memory_gib": max((m["peak_memory_gib"] for m in metrics if m.get("peak_memory_gib") is not None),
                               default=None),
    }
    keys = ("tokens_per_s_per_gpu", "step_time_mean_s", "step_time_median_s", "step_time_worst_ratio",
            "step_time_worst_step", "step_time_cv_percent", "model_tflops_per_gpu", "mfu", "mfu_6n",
            "usd_per_million_tokens", "window_tokens")
    out.update({k: None for k in keys})
    if window is None:
        out["window_note"] = f"fewer than {warmup + 1} steps completed: no measurement window"
        return out
    rows = metrics[window[0] - 1: window[1]]
    times = [r["step_time_s"] for r in rows]
    tokens = sum(r["tokens"] for r in rows)
    tps_gpu = tokens / sum(times) / world_size
    mean = statistics.fmean(times)
    median = statistics.median(times)
    worst = max(range(len(rows)), key=lambda i: times[i])  # the slowest window step (the first of equals)
    cv = statistics.stdev(times) / mean * 100 if len(times) > 1 else 0.0
    tflops = flops["training"] * tps_gpu / 1e12
    out.update({
        "tokens_per_s_per_gpu": tps_gpu,
        "window_tokens": tokens,
        "step_time_mean_s": mean,
        "step_time_median_s": median,
        "step_time_worst_ratio": times[worst] / median if median > 0 else None,
        "step_time_worst_step": rows[worst]["step"],
        "step_time_cv_percent": cv,
        "model_tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "mfu_6n": flops["training_6n"] * tps_gpu / 1e12 / peak_tflops if peak_tflops else None,
        "usd_per_million_tokens": price_per_gpu_hour * 1e6 / (tps_gpu * 3600) if price_per_gpu_hour else None,
    })
    for key, value in list(out.items()):
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
    return out
