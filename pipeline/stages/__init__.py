"""One module per pipeline stage. Each exposes `run(cfg, run, model_path) -> dict` with at least `output`
(the model directory the next stage starts from, or None) and a short `summary` for the console and manifest."""
