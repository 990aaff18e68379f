"""The hybrid plans of examples/grpo_hybrid.py's default run for each model size on one 80 GB and one 141 GB GPU.

    python bench/plans.py                       # SmolLM2-135M .. Llama-3.1-8B on 80 / 141 GB, 125 GiB of host memory
    python bench/plans.py --host-gib 64 --archs qwen2.5-7b

No GPU and no weights: each architecture's published config is written to a temporary folder and
:func:`rlhfkit.hybrid.plan_hybrid` plans the example's configs (bf16, ZeRO-1, an actor and its reference, vLLM with a
KV cache sized to the rollout batch) for the card; where nothing fits it prints the refusal (phase and shortfall).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.scale import ARCHITECTURES  # noqa: E402

# torch's total_memory of the cards, in GiB
CARDS = {"80 GB (H100)": 79.2, "141 GB (H200)": 139.8}
ARCHS = ("smollm2-135m", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.1-8b")


def write_config(arch: str, folder: Path) -> Path:
    """``arch``'s config.json (no weights: the plan reads the shape only)."""
    import transformers

    fields = dict(ARCHITECTURES[arch])
    path = folder / arch
    transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(path)
    return path


def example_configs(model: Path) -> tuple:
    """examples/grpo_hybrid.py's config and trainer roles for ``--model model`` (its defaults otherwise)."""
    spec = importlib.util.spec_from_file_location("grpo_hybrid_example", REPO / "examples" / "grpo_hybrid.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    from rlhfkit.options import parse_options

    return example.configs(parse_options(example.Options, ["--model", str(model)]))


def plans(archs: tuple[str, ...], host_gib: float) -> dict[tuple[str, str], str]:
    """``(arch, card) -> the printed plan, or the refusal``."""
    from rlhfkit.hybrid import plan_hybrid
    from rlhfkit.placement import MemoryFitError

    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for arch in archs:
            config, trainers = example_configs(write_config(arch, Path(folder)))
            for card, gib in CARDS.items():
                try:
                    out[arch, card] = str(plan_hybrid(config, trainers, gpu_memory_gib=gib, host_memory_gib=host_gib))
                except MemoryFitError as error:
                    out[arch, card] = f"does not fit: phase {error.phase!r} ({error.memory}) short by " \
                                      f"{error.shortfall_gib:.1f} GiB\n  {error}"
    return out


def main(argv=None) -> dict[tuple[str, str], str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", choices=sorted(ARCHITECTURES), default=list(ARCHS))
    parser.add_argument("--host-gib", type=float, default=125.0, help="host memory of the node (GiB)")
    parser.add_argument("--out", type=Path, help="also write the plans as JSON here")
    args = parser.parse_args(argv)
    result = plans(tuple(args.archs), args.host_gib)
    for (arch, card), text in result.items():
        print(f"== {arch} on one {card} GPU, {args.host_gib:.0f} GiB host memory\n{text}\n", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"host_gib": args.host_gib, "plans": {f"{arch} / {card}": text for
                                                                             (arch, card), text in result.items()}},
                                       indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
