"""The data and task layer that training (pipeline/) and evaluation (eval/) share: generated tasks, benchmark
loaders, the prompt template, the recall tasks and the tokenizer. It imports neither of them."""
