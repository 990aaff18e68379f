#!/usr/bin/env bash
# call 7: the GRPO recipe on SmolLM2 + GSM8K (eval on dev.jsonl, checkpoint, export), then the export served by vLLM.
set -u
source .carry/jobs/env.sh
python3 -m pip install -q --no-deps --no-index --find-links .carry/pywb --target /tmp/site/mv math-verify latex2sympy2-extended antlr4-python3-runtime > $OUT/pip3.log 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/site/mv
python3 -c "import math_verify; print(math_verify.parse(\"5\"))" >> $OUT/pip3.log 2>&1; tail -2 $OUT/pip3.log
R=/tmp/gsm8k_run
timeout 430 python3 examples/grpo.py --model /tmp/smollm2-hf --dataset /tmp/gsm8k/train.jsonl --eval-dataset /tmp/gsm8k/dev.jsonl \
  --input-key question --label-key answer --reward gsm8k --prompt-suffix "$(printf '\nSolve it step by step, then give the final answer as: #### <number>')" \
  --steps 61 --prompts-per-step 32 --samples-per-prompt 8 --max-new-tokens 256 --lr 2e-6 --eval-every 20 --eval-samples 0 \
  --save-every 1000 --out $R --export $R/export > $OUT/gsm8k.log 2>&1
echo "rc=$?"; tail -25 $OUT/gsm8k.log
cp $R/metrics.jsonl $OUT/gsm8k_metrics.jsonl 2>/dev/null; head -c 20000 $R/samples.jsonl > $OUT/gsm8k_samples.jsonl 2>/dev/null
ls $R/export $R/checkpoints 2>&1 | head -20
(timeout 150 vllm serve $R/export --port 8011 --max-model-len 1024 --gpu-memory-utilization 0.3 > $OUT/serve.log 2>&1 &)
for i in $(seq 1 120); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
curl -s localhost:8011/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "'$R/export'", "messages": [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does he have? Solve it step by step, then give the final answer as: #### <number>"}], "max_tokens": 128, "temperature": 0}' | tee $OUT/serve_answer.json | head -c 1500
pkill -f "vllm serve" ; sleep 2
