"""``appliance quantize``: argument parsing and exit codes only (the work is appliance.model.quantize).

``register(subparsers)`` adds the command to the appliance's parser, as appliance.loadtest.cli does for its
commands. Exit codes: 0 written (the JSON summary on stdout), 1 refused (one line on stderr, nothing written),
2 bad arguments (argparse).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SCHEMES = ("int8", "fp8", "auto")  # appliance.model.precision.SCHEME_NAMES, without importing torch to parse


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "quantize", help="BF16/FP16 HF checkpoint -> W8A8 compressed-tensors checkpoint (INT8 or FP8)",
        description="Quantize a Hugging Face checkpoint to W8A8 (per-channel weights, dynamic per-token "
                    "activations) in the compressed-tensors format vLLM loads, and print one JSON summary: "
                    "bytes_before, bytes_after, scheme, top1_agreement, mean_kl, ppl_before, ppl_after.")
    p.add_argument("src", type=Path, help="source checkpoint directory (bf16, fp16 or fp32 safetensors)")
    p.add_argument("dst", type=Path, help="new directory for the quantized checkpoint (must not exist or be empty)")
    p.add_argument("--scheme", choices=SCHEMES, default="int8",
                   help="int8: CPUs and GPUs before Blackwell; fp8 (e4m3): GPUs of compute capability 8.9+ "
                        "(Ada, Hopper, Blackwell); auto: fp8 when NVML reports 8.9+ on every GPU here, else int8 "
                        "(default: %(default)s)")
    p.add_argument("--no-eval", action="store_true",
                   help="skip the quality comparison on held-out text (it runs one decoder layer at a time)")
    p.set_defaults(handler=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    from appliance.model.quantize import QuantizeError, quantize_checkpoint

    try:
        summary = quantize_checkpoint(args.src, args.dst, scheme=args.scheme, evaluate=not args.no_eval)
    except QuantizeError as exc:
        print(f"appliance quantize: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, default=str))
    return 0
