#!/usr/bin/env bash
# call 4: last kit chunk, extra wheels, SmolLM2 conversion, then the GPU-marked tests of what wave 3b changed.
set -u
source .carry/jobs/env.sh
pip install -q --no-index --find-links .carry/pywb math-verify > $OUT/pip.log 2>&1; echo "math-verify rc=$?" >> $OUT/pip.log
pip install -q --no-index --find-links .carry/pywb datasets >> $OUT/pip.log 2>&1; echo "datasets rc=$?" >> $OUT/pip.log
python3 -c "import pyarrow" >> $OUT/pip.log 2>&1; echo "pyarrow rc=$?" >> $OUT/pip.log
mkdir -p /tmp/gsm8k && cp .carry/pywb/gsm8k/* /tmp/gsm8k/
timeout 150 python3 examples/convert_smollm2.py --out /tmp/smollm2-hf > $OUT/convert.log 2>&1; echo "convert rc=$?"
python3 -m compileall -q src >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; free -g | head -2;
  python3 -c "import torch, vllm, deepspeed, ray, transformers; print(torch.__version__, vllm.__version__, deepspeed.__version__, ray.__version__, transformers.__version__)"; } > $OUT/device.txt 2>&1
cat $OUT/device.txt $OUT/pip.log
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_weight_sync.py tests/test_network_security.py 2>&1 | tail -15 > $OUT/t_weight_sync.log
tail -3 $OUT/t_weight_sync.log
timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_hybrid_examples.py -k "grpo_hybrid or docs_hybrid" 2>&1 | tail -40 > $OUT/t_hybrid.log
tail -5 $OUT/t_hybrid.log
