"""``appliance demo-model`` and ``appliance quantize``: checkpoints built and converted offline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from appliance.cli.argtypes import non_negative_float
from appliance.cli.common import CLIError, add_command
from appliance.exit_codes import EXIT_FAILED, EXIT_USAGE

SCHEME_NAMES = ("int8", "fp8", "auto")  # appliance.model.precision's, without importing torch to parse


def register(sub: Any) -> None:
    p = add_command(sub, "demo-model", "build the tiny demo Llama (offline, deterministic)", cmd_demo_model)
    p.add_argument("dir", type=Path, help="folder to write the checkpoint to")
    p.add_argument("--int8", action="store_true", help="also quantize it to W8A8 INT8 (DIR is then the INT8 one, "
                                                       "the BF16 one goes to DIR.bf16)")
    p.add_argument("--train-seconds", type=non_negative_float, default=60.0,
                   help="training time budget in seconds (0: untrained weights)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")

    p = add_command(sub, "quantize", "BF16/FP16 HF checkpoint -> W8A8 (INT8 or FP8) compressed-tensors checkpoint; "
                                     "prints a JSON summary", cmd_quantize)
    p.add_argument("src", type=Path, help="source checkpoint folder (config.json + safetensors)")
    p.add_argument("dst", type=Path, help="destination folder (must not exist)")
    p.add_argument("--scheme", choices=SCHEME_NAMES, default="int8",
                   help="int8: CPUs and GPUs before Blackwell; fp8 (e4m3): GPUs of compute capability 8.9 and up "
                        "(Ada, Hopper, Blackwell); auto: fp8 when NVML reports 8.9+ on every GPU here, else int8")
    p.add_argument("--no-eval", action="store_true", help="skip the quality check (top-1 agreement, KL, perplexity; "
                                                          "it runs one decoder layer at a time)")


def cmd_demo_model(args: argparse.Namespace) -> int:
    from appliance.model.demo import build_demo_model
    from appliance.model.quantize import QuantizeError, quantize_checkpoint

    target: Path = args.dir
    if target.exists() and any(target.iterdir()) and not args.overwrite:
        raise CLIError(f"{target} already exists and is not empty; add --overwrite to replace it", EXIT_USAGE)
    build = {"overwrite": args.overwrite, "train_seconds": args.train_seconds}
    print(f"appliance demo-model: building in {target} (training takes about a minute)", flush=True)
    try:
        if args.int8:
            bf16 = target.with_name(target.name + ".bf16")
            summary = {"bf16": build_demo_model(bf16, **build)}
            summary["int8"] = quantize_checkpoint(bf16, target)
        else:
            summary = build_demo_model(target, **build)
    except (QuantizeError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from appliance.model.quality import QualityError
    from appliance.model.quantize import QuantizeError, quantize_checkpoint

    try:
        summary = quantize_checkpoint(args.src, args.dst, scheme=args.scheme, evaluate=not args.no_eval)
    except QuantizeError as exc:  # input that cannot work (nothing written), unless the quality check itself failed
        raise CLIError(str(exc), EXIT_FAILED if isinstance(exc.__cause__, QualityError) else EXIT_USAGE) from None
    print(json.dumps(summary, default=str))
    return 0
