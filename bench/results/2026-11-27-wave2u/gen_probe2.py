"""Generation alone at the scale workload (16 prompts x n=8 x 128 tokens, ignore_eos): per-request seeds (as the
hybrid's engine passes them) vs one seed-less batch (as TRL), logprobs 0 vs none, through LLM.generate and through
our VLLMEngine. python3 gen_probe2.py MODEL OUT.json   (VLLM_ENABLE_V1_MULTIPROCESSING in env)"""
import json, os, sys, time
import vllm
model, out = sys.argv[1], sys.argv[2]
llm = vllm.LLM(model=model, dtype="bfloat16", gpu_memory_utilization=0.35, max_model_len=1024, max_num_seqs=128,
               max_num_batched_tokens=4096, enable_sleep_mode=True, seed=0, enable_prefix_caching=False)
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(model)
prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {2*i}?"}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=False)} for i in range(16)]
def sp(seed, lp):
    return vllm.SamplingParams(n=8, max_tokens=128, min_tokens=128, ignore_eos=True, temperature=1.0, seed=seed,
                               logprobs=lp, detokenize=False)
variants = {"seeded_lp0": lambda: [sp(1000 + i, 0) for i in range(16)], "unseeded_lp0": lambda: sp(None, 0),
            "unseeded_nolp": lambda: sp(None, None), "seeded_nolp": lambda: [sp(1000 + i, None) for i in range(16)]}
res = {"multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
       "async_scheduling": getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", None)}
llm.generate(prompts, sp(None, 0), use_tqdm=False)
for name, make in variants.items():
    times = []
    for _ in range(4):
        t = time.perf_counter(); outs = llm.generate(prompts, make(), use_tqdm=False); times.append(time.perf_counter() - t)
    res[name] = {"times": times, "median_s": sorted(times)[2], "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs)}
    print(name, res[name]["median_s"], flush=True)
json.dump(res, open(out, "w"), indent=1)
