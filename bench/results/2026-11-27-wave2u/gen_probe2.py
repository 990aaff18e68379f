"""The probe behind s28gen_in.json / s28gen_mp.json (session 21): vLLM's LLM.generate alone at the scale runs'
workload (16 prompts x n=8 x 128 tokens, ignore_eos): a seed per prompt (as the hybrid's engine passed them) against
no per-request seed (as TRL), log-probs 0 against none. The engine core in-process or not comes from the environment
(VLLM_ENABLE_V1_MULTIPROCESSING). Usage: python3 gen_probe2.py MODEL OUT.json"""
import json
import os
import sys
import time

import vllm
from transformers import AutoTokenizer

model, out = sys.argv[1], sys.argv[2]
llm = vllm.LLM(model=model, dtype="bfloat16", gpu_memory_utilization=0.35, max_model_len=1024, max_num_seqs=128,
               max_num_batched_tokens=4096, enable_sleep_mode=True, seed=0, enable_prefix_caching=False)
tok = AutoTokenizer.from_pretrained(model)
prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {2 * i}?"}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=False)}
           for i in range(16)]


def params(seed, logprobs):
    return vllm.SamplingParams(n=8, max_tokens=128, min_tokens=128, ignore_eos=True, temperature=1.0, seed=seed,
                               logprobs=logprobs, detokenize=False)


variants = {"seeded_lp0": lambda: [params(1000 + i, 0) for i in range(16)], "unseeded_lp0": lambda: params(None, 0),
            "unseeded_nolp": lambda: params(None, None),
            "seeded_nolp": lambda: [params(1000 + i, None) for i in range(16)]}
result = {"multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
          "async_scheduling": getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", None)}
llm.generate(prompts, params(None, 0), use_tqdm=False)
for name, make in variants.items():
    times = []
    for _ in range(4):
        start = time.perf_counter()
        outputs = llm.generate(prompts, make(), use_tqdm=False)
        times.append(time.perf_counter() - start)
    result[name] = {"times": times, "median_s": sorted(times)[2],
                    "tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs)}
    print(name, result[name]["median_s"], flush=True)
with open(out, "w") as f:
    json.dump(result, f, indent=1)
