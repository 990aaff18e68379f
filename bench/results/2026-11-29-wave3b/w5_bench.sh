#!/usr/bin/env bash
# call 5: the default command against TRL GRPOTrainer, SmolLM2-135M-Instruct, one command chain; then the plans.
set -u
source .carry/jobs/env.sh
eval "$(bash bench/peers/install-peers.sh)" >/dev/null 2>&1
pip install -q --no-deps --no-index --find-links .carry/pywb math-verify latex2sympy2-extended antlr4-python3-runtime > $OUT/pip2.log 2>&1; python3 -c "import math_verify; print(math_verify.parse(\"#### 5\"))" >> $OUT/pip2.log 2>&1
timeout 360 python3 bench/hybrid.py --model /tmp/smollm2-hf --steps 15 --timeout 280 --out $OUT/hybrid_smollm2.json > $OUT/hybrid_smollm2.log 2>&1
echo "rc=$?"
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/hybrid_smollm2.json"))
print({k: r[k] for k in r if k.startswith("ratio")})
for side in ("rlhfkit", "trl"):
    s = r.get(side, {})
    print(side, {k: s.get(k) for k in ("step_s", "peak_gib", "launch_to_first_step_s")})
PY
tail -c 1500 $OUT/hybrid_smollm2.log
