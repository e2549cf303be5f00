"""The benchmark suite (bench/README.md): entry points run as `python -m bench.<name>` from the checkout.

op (the SSE operator against its baselines; registry.py names them), train_step (the whole-model training step),
rollouts (vLLM rollout throughput), grpo_phases (a GRPO run's step split into phases), recall (the MQAR
comparison), and report (docs/performance.md, docs/cost.md through cost.py, and README.md's table from the
baselines). baseline.py says where runs and baselines go.
"""
