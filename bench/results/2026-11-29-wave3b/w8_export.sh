#!/usr/bin/env bash
# fresh machine, last call: SmolLM2, then a short GRPO recipe run on GSM8K with checkpoint and export, served by vLLM.
set -u
source .carry/jobs/env.sh
python3 -m pip install -q --no-deps --no-index --find-links .carry/pywb --target /tmp/site/mv math-verify latex2sympy2-extended antlr4-python3-runtime > $OUT/pip3.log 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/site/mv
mkdir -p /tmp/gsm8k && cp .carry/pywb/gsm8k/*.jsonl /tmp/gsm8k/
timeout 100 python3 examples/convert_smollm2.py --out /tmp/smollm2-hf > $OUT/convert.log 2>&1; echo "convert rc=$?"
R=/tmp/gsm8k_run
timeout 200 python3 examples/grpo.py --model /tmp/smollm2-hf --dataset /tmp/gsm8k/train.jsonl --eval-dataset /tmp/gsm8k/dev.jsonl \
  --input-key question --label-key answer --reward gsm8k --prompt-suffix "$(printf '\nSolve it step by step, then give the final answer as: #### <number>')" \
  --steps 8 --prompts-per-step 16 --samples-per-prompt 8 --max-new-tokens 128 --lr 2e-6 --eval-every 4 --eval-samples 0 \
  --save-every 4 --out $R --export $R/export > $OUT/gsm8k.log 2>&1
echo "rc=$?"; grep -E "^step|saved|exported|Error" $OUT/gsm8k.log | tail -14
cp $R/metrics.jsonl $OUT/gsm8k_metrics.jsonl 2>/dev/null
ls $R/export $R/checkpoints 2>&1 | head -20
(timeout 100 vllm serve $R/export --port 8011 --max-model-len 1024 --gpu-memory-utilization 0.3 --enforce-eager > $OUT/serve.log 2>&1 &)
for i in $(seq 1 90); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
curl -s localhost:8011/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "'$R/export'", "messages": [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does he have? Solve it step by step, then give the final answer as: #### <number>"}], "max_tokens": 96, "temperature": 0}' | tee $OUT/serve_answer.json | head -c 1200
pkill -f "vllm serve"; true
