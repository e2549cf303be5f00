"""SSE-H on vLLM: the model and its layers (`model`), the plugin vLLM loads (`plugin`), the engine defaults it
registers (`engine`), the weight sync from a trainer into a live engine (`sync`), and every reach past vLLM's public
model API (`seams`, one test each in tests/test_vllm_seams.py). Importing the package imports no vLLM."""
