"""Recall tasks (tasks/retrieval.py, docs/retrieval.md): determinism, disjoint splits, lengths, the
needle once and retrievable, task options refused with the file and key, exact grading, and the eval report's
breakdowns by context length, pairs and query position (metrics on hand-made samples, and the runner end to
end with a stand-in engine)."""
import json
import re
import uuid
from types import SimpleNamespace

import pytest

from eval import runner
from eval.metrics import accuracy_by_group, compute_metrics, query_position_accuracy
from eval.runner import evaluate, markdown_report, problem_seed
from pipeline import config
from pipeline.config import ConfigError, DataSource, GeneratorSettings
from rewards import build_reward
from rewards.retrieval import grade_answer
from tasks import retrieval
from tasks.loaders import (
    DataError,
    benchmark_source,
    load_benchmark,
    load_rl_dataset,
    load_sft_dataset,
    tokenize_codes,
)
from tasks.retrieval import (
    ADJECTIVES,
    ANIMALS,
    COLORS,
    NIAH_WORD_LINE_WORDS,
    NOUNS,
    TaskOptionError,
    check_options,
    generate_task,
    split_of,
)
from tasks.tokenizer import conversation_texts, train_tokenizer

SMALL_MQAR = {"vocab_size": 512, "mix": [{"context_length": 32, "num_pairs": 4},
                                         {"context_length": 64, "num_pairs": 8},
                                         {"context_length": 96, "num_pairs": 16}]}
SMALL = {"mqar": SMALL_MQAR, "niah_word": {"context_lengths": [64, 200, 1024]},
         "s_niah": {"context_lengths": [64, 300, 1024], "value": "uuid"}}


# ---------------------------------------------------------------------------------------------------- rows

@pytest.mark.parametrize("task", retrieval.TASKS)
def test_same_arguments_same_rows(task):
    rows = generate_task(task, 12, seed=3, options=SMALL[task])
    assert rows == generate_task(task, 12, seed=3, options=SMALL[task])
    assert rows != generate_task(task, 12, seed=4, options=SMALL[task])
    assert [r["id"] for r in rows] == [f"{task}-train-3-{i}" for i in range(12)]
    # The first rows do not depend on how many are asked for (an eval `limit` generates only those).
    assert generate_task(task, 5, seed=3, options=SMALL[task]) == rows[:5]
    for r in rows:
        assert r["solution"] == f"The answer is \\boxed{{{r['answer']}}}." and r["task"] == task


@pytest.mark.parametrize("task", retrieval.TASKS)
def test_train_and_test_never_overlap(task):
    train = generate_task(task, 300, options=SMALL[task], split="train")
    test = generate_task(task, 300, options=SMALL[task], split="test")
    assert not {r["canonical"] for r in train} & {r["canonical"] for r in test}
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert all(split_of(r["canonical"]) == "train" for r in train)
    assert all(split_of(r["canonical"]) == "test" for r in test)


def _mqar_parts(problem: str) -> tuple[list[str], list[str]]:
    lines = problem.splitlines()
    assert lines[0] == "Key-value pairs:" and lines[2] == "Queries:"
    return lines[1].split(), lines[3].split()


def test_mqar_shape_and_answer():
    rows = generate_task("mqar", 30, options=SMALL_MQAR)
    mix = SMALL_MQAR["mix"]
    for i, r in enumerate(rows):
        length, pairs = mix[i % 3]["context_length"], mix[i % 3]["num_pairs"]
        assert (r["context_length"], r["num_pairs"], r["num_queries"]) == (length, pairs, pairs)
        context, queries = _mqar_parts(r["problem"])
        assert len(context) + len(queries) == length  # the sequence is exactly context_length codes
        assert all(re.fullmatch("[a-z]{2}", c) for c in context + queries)  # 512 codes: two letters each
        keys, values = context[0:2 * pairs:2], context[1:2 * pairs:2]
        assert len(set(keys)) == pairs and sorted(queries) == sorted(keys)  # every key asked once, random order
        # Keys from the first half of the vocabulary, values from the second (Zoology's token ids).
        assert all(c < "jw" for c in keys) and all(c >= "jw" for c in values)  # code(256, 2) == "jw"
        for q in queries:
            assert context.count(q) == 1  # noise never repeats a key
        lookup = dict(zip(keys, values))
        assert r["answer"] == " ".join(lookup[q] for q in queries)
    assert retrieval.code(256, 2) == "jw" and retrieval.code_width(8192) == 3 and retrieval.code_width(676) == 2


def test_mqar_fewer_queries_than_pairs():
    r = generate_task("mqar", 1, options={**SMALL_MQAR, "num_queries": 2})[0]
    context, queries = _mqar_parts(r["problem"])
    assert len(queries) == 2 and len(context) == 30 and len(r["answer"].split()) == 2


def _haystack_words(problem: str, strong: bool) -> str:
    parts = problem.split("\n\n")
    assert len(parts) == (3 if strong else 2) and parts[-1].startswith("Question: what is the ")
    return parts[-2]


@pytest.mark.parametrize("instruction", ["strong", "none"])
def test_niah_word_haystack(instruction):
    options = {"context_lengths": [64, 200, 1024], "instruction": instruction}
    rows = generate_task("niah_word", 30, options=options)
    for i, r in enumerate(rows):
        length = options["context_lengths"][i % 3]
        haystack = _haystack_words(r["problem"], instruction == "strong")
        words = haystack.split()
        assert length - NIAH_WORD_LINE_WORDS < len(words) <= length == r["context_length"]
        assert r["problem"].startswith("The text below") == (instruction == "strong")
        facts = re.findall(r"The (\w+ \w+) is the (\w+ \w+)\.", haystack)
        assert len(facts) == r["num_pairs"] == len(words) // NIAH_WORD_LINE_WORDS
        keys = [k for k, _ in facts]
        assert len(set(keys)) == len(keys)  # every key once: one fact answers the question
        key = re.search(r"Question: what is the (\w+ \w+)\?$", r["problem"]).group(1)
        assert keys.count(key) == 1 and dict(facts)[key] == r["answer"]
        assert not re.search(r"\d", r["problem"])  # words, not digits
        assert keys.index(key) == round(r["depth"] * (len(keys) - 1))
    # A fresh order per sample: the needle moves.
    assert len({round(r["depth"], 2) for r in rows if r["context_length"] == 1024}) > 3


def test_niah_word_needle_once_in_a_full_haystack():
    """Near the largest length almost every key is in the haystack: the needle's key must still occur once."""
    for r in generate_task("niah_word", 4, options={"context_lengths": [44800]}):
        key = re.search(r"Question: what is the (\w+ \w+)\?$", r["problem"]).group(1)
        assert r["num_pairs"] == 6400 and r["problem"].count(f"The {key} is the ") == 1
        assert f"The {key} is the {r['answer']}." in r["problem"]


def test_word_lists_are_disjoint():
    lists = [ADJECTIVES, NOUNS, COLORS, ANIMALS]
    words = [w for lst in lists for w in lst]
    assert len(words) == len(set(words))
    assert all(re.fullmatch("[a-z]+", w) for w in words)


@pytest.mark.parametrize("value", retrieval.S_NIAH_VALUES)
def test_s_niah_needle(value):
    lengths = [64, 300, 4096]
    rows = generate_task("s_niah", 9, options={"context_lengths": lengths, "value": value}, split="test")
    for i, r in enumerate(rows):
        head, context, question = r["problem"].split("\n")
        assert head.startswith(f"Some special magic {value}s are hidden")
        assert lengths[i % 3] - 6 < len(context.split()) <= lengths[i % 3] == r["context_length"]
        needles = re.findall(rf"One of the special magic {value}s for (\S+) is: (\S+)\.", context)
        assert len(needles) == 1
        key, found = needles[0]
        assert found == r["answer"] and context.count(r["answer"]) == 1 and context.count(key) == 1
        assert question == f"What is the special magic {value} for {key} mentioned in the provided text?"
        # What is left is RULER's noise, unbroken around the needle.
        rest = context.replace(f"One of the special magic {value}s for {key} is: {found}. ", "").replace(
            f" One of the special magic {value}s for {key} is: {found}.", "")
        assert set(re.split(r"(?<=\.) ", rest)) <= set(retrieval.RULER_NOISE)
        if value == "number":
            assert re.fullmatch(r"\d{7}", r["answer"])
        elif value == "word":
            assert re.fullmatch(r"[a-z]+-[a-z]+", r["answer"])
        else:
            assert uuid.UUID(r["answer"]).version == 4 and str(uuid.UUID(r["answer"])) == r["answer"]


def test_every_registered_eval_set_resolves():
    names = [n for n, s in config.BENCHMARKS.items() if s.source == "generator"]
    assert {"mqar_test", "niah_word_1k", "niah_word_32k", "niah_word_noinst_4k", "s_niah_uuid_32k"} <= set(names)
    for name in names:
        src = benchmark_source(name)
        assert src.split == "test" and src.name == name
        check_options(src.generator.task, src.generator.options)
    name, rows = load_benchmark("niah_word_2k", limit=2)
    assert name == "niah_word_2k" and len(rows) == 2 and rows[0]["context_length"] == 2048
    lengths = {(m["context_length"], m["num_pairs"]) for m in retrieval.MQAR_TEST_MIX}
    assert (1024, 256) in lengths and (512, 128) in lengths
    assert {m["context_length"] for m in retrieval.MQAR_TRAIN_MIX} == {64, 128, 256}
    assert {m["num_pairs"] for m in retrieval.MQAR_TRAIN_MIX} == {4, 8, 16, 32, 64}


def test_sources_in_trl_formats():
    src = DataSource(source="generator", split="train", limit=4,
                     generator=GeneratorSettings(task="mqar", num_examples=10, options=SMALL_MQAR))
    rl = load_rl_dataset(src)
    assert rl.column_names == ["prompt", "answer", "id", "task", "context_length", "num_pairs"]
    assert len(rl) == 4 and rl["context_length"] == [32, 64, 96, 32] and set(rl["task"]) == {"mqar"}
    assert rl[0]["prompt"][-1]["content"].startswith("Key-value pairs:") and "\\boxed{}" in rl[0]["prompt"][-1][
        "content"]
    sft = load_sft_dataset(src)
    assert sft.column_names == ["prompt", "completion"]
    assert sft[0]["completion"][0]["content"] == f"The answer is \\boxed{{{rl[0]['answer']}}}."
    arithmetic = load_rl_dataset(DataSource(source="generator", limit=2))
    assert arithmetic.column_names == ["prompt", "answer", "id"]  # math sets keep their three columns


# ---------------------------------------------------------------------------------------------------- options

@pytest.mark.parametrize("task, options, key, message", [
    ("mqr", {}, "task", "unknown task 'mqr' (did you mean 'mqar'?)"),
    ("mqar", {"num_pair": 4}, "options.num_pair", "unknown option for task mqar"),
    ("mqar", {"vocab_size": "big"}, "options.vocab_size", "expected int, got str 'big'"),
    ("mqar", {"mix": []}, "options.mix", "non-empty list"),
    ("mqar", {"mix": [{"context_length": 64}]}, "options.mix[0]", "context_length and num_pairs"),
    ("mqar", {"mix": [{"context_length": 64, "num_pairs": 0}]}, "options.mix[0].num_pairs", "at least 1"),
    ("mqar", {"mix": [{"context_length": 64, "num_pairs": 32}]}, "options.mix[0].context_length",
     "cannot hold 32 pairs"),
    ("mqar", {"vocab_size": 100}, "options.vocab_size", "must exceed every context_length"),
    ("mqar", {"num_queries": 8}, "options.num_queries", "only 4 pairs"),
    ("mqar", {"format": "zoo"}, "options.format", "expected one of 'prose', 'zoology'"),
    ("mqar", {"format": "zoology", "mix": [{"context_length": 15, "num_pairs": 4}]}, "options.mix[0].context_length",
     "(2 * num_pairs + 2 * queries = 16)"),
    ("niah_word", {"instruction": "weak"}, "options.instruction", "expected one of 'strong', 'none'"),
    ("niah_word", {"context_lengths": [10]}, "options.context_lengths[0]", "at least 14"),
    ("niah_word", {"context_lengths": [65536]}, "options.context_lengths[0]", "at most 44800 words"),
    ("niah_word", {"context_lengths": 4096}, "options.context_lengths", "non-empty list"),
    ("s_niah", {"value": "uuid4"}, "options.value", "expected one of 'number', 'word', 'uuid'"),
    ("s_niah", {"context_lengths": [True]}, "options.context_lengths[0]", "expected int, got bool"),
])
def test_bad_options_are_refused(task, options, key, message):
    with pytest.raises(TaskOptionError) as e:
        check_options(task, options)
    assert e.value.key == key and message in e.value.message
    with pytest.raises(ValueError, match=re.escape(f"{task}: {key}: ")):
        generate_task(task, 1, options=options)


def _write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text("name: t\nmodel: {tokenizer: {train: true}}\n" + text)
    return path


@pytest.mark.parametrize("text, message", [
    ("data:\n  grpo:\n    generator: {task: mqar, options: {mix: [{context_length: 64, num_pairs: 40}]}}\n",
     "c.yaml: data.grpo.generator.options.mix[0].context_length: 64 codes cannot hold 40 pairs"),
    ("data:\n  sft:\n    generator: {task: niah_wrd}\n",
     "c.yaml: data.sft.generator.task: unknown task 'niah_wrd' (did you mean 'niah_word'?)"),
    ("data:\n  eval:\n    - {name: x, split: test, generator: {task: s_niah, options: {valu: uuid}}}\n",
     "c.yaml: data.eval[0].generator.options.valu: unknown option for task s_niah (did you mean 'value'?)"),
    ("data:\n  grpo:\n    generator: {task: mqar, levels: [3]}\n",
     "c.yaml: data.grpo.generator.levels: applies to the arithmetic task only, not mqar"),
    ("data:\n  grpo:\n    generator: {options: {vocab_size: 64}}\n",
     "c.yaml: data.grpo.generator.options: the arithmetic task takes levels and in_head_probability"),
    ("data:\n  grpo:\n    source: d.jsonl\n    generator: {task: mqar}\n",
     "c.yaml: data.grpo.generator.task: a task needs source: generator, got source 'd.jsonl'"),
    ("data:\n  eval: [niah_word_4kk]\n",
     "c.yaml: data.eval[0]: unknown eval set 'niah_word_4kk' (did you mean 'niah_word_4k'?)"),
    ("data:\n  grpo:\n    generator: {task: mqar, options: {format: zoology}}\n",
     "c.yaml: data.grpo.generator.options.format: zoology is for SFT and eval only"),
    ("eval: {n: 4}\ndata:\n  eval:\n"
     "    - {name: z, split: test, generator: {task: mqar, options: {format: zoology}}}\n",
     "c.yaml: eval.n: data.eval[0] is Zoology-format MQAR, scored teacher-forced with one greedy prediction per query: "
     "n must be 1, got 4"),
])
def test_config_errors_name_file_and_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.load_config(_write(tmp_path, text))


def test_config_with_tasks_loads_and_round_trips(tmp_path):
    path = _write(tmp_path, "data:\n  grpo:\n"
                            "    generator: {task: mqar, num_examples: 100, options: {vocab_size: 512}}\n"
                            "  eval: [mqar_test, niah_word_4k, s_niah_uuid_8k]\n")
    cfg = config.load_config(path, ["data.grpo.generator.options.num_queries=2"])
    assert cfg.data.grpo.generator.task == "mqar"
    assert cfg.data.grpo.generator.options == {"vocab_size": 512, "num_queries": 2}
    assert config.config_from_dict(config.resolve(cfg)) == cfg
    with pytest.raises(ConfigError, match=re.escape("--set: data.grpo.generator.options.num_queries: 100 queries")):
        config.load_config(path, ["data.grpo.generator.options.num_queries=100"])


# ---------------------------------------------------------------------------------------------------- grading

def test_exact_grading():
    assert grade_answer("niah_word", "amber heron", "amber heron") == (True, None)
    assert grade_answer("niah_word", "  amber   heron. ", "amber heron") == (True, None)
    assert grade_answer("niah_word", "amber", "amber heron") == (False, None)
    assert grade_answer("niah_word", "amberheron", "amber heron") == (False, None)  # words stay apart
    assert grade_answer("s_niah", "0042", "42") == (False, None)  # text, not numbers
    assert grade_answer("s_niah", None, "42") == (False, None)
    assert grade_answer("mqar", "ab cd ef", "ab cd ef") == (True, [True, True, True])
    assert grade_answer("mqar", "ab xx ef gh", "ab cd ef") == (False, [True, False, True])
    assert grade_answer("mqar", "ab", "ab cd ef") == (False, [True, False, False])
    assert grade_answer("mqar", None, "ab cd") == (False, [False, False])
    reward = build_reward("retrieval_accuracy")
    partial = build_reward("retrieval_accuracy", {"per_query": True})
    completions = ["so \\boxed{ab cd}", "\\boxed{ab xx}", "no box"]
    columns = {"answer": ["ab cd"] * 3, "task": ["mqar"] * 3}
    assert reward([""] * 3, completions, **columns) == [1.0, 0.0, 0.0]
    assert partial([""] * 3, completions, **columns) == [1.0, 0.5, 0.0]


# ---------------------------------------------------------------------------------------------------- metrics

def _sample(correct, queries=None, **fields):
    s = {"correct": correct, "extracted": "x" if correct else "y", "num_tokens": 4, "truncated": False, **fields}
    if queries is not None:
        s["query_correct"] = queries
    return s


def test_query_position_accuracy_by_hand():
    # Problem A asks 3 queries, problem B 2; two samples each.
    problems = [[_sample(False, [True, False, True]), _sample(True, [True, True, True])],
                [_sample(False, [False, False]), _sample(False, [True, False])]]
    assert query_position_accuracy(problems) == [
        {"position": 1, "count": 4, "accuracy": 0.75},
        {"position": 2, "count": 4, "accuracy": 0.25},
        {"position": 3, "count": 2, "accuracy": 1.0},  # only A has a third query
    ]


def test_accuracy_by_group_by_hand():
    groups = accuracy_by_group([1.0, 0.0, 0.5, 1.0], [4096, 1024, 1024, 4096], "context_length")
    assert [(g["context_length"], g["num_problems"], g["accuracy"]) for g in groups] == [(1024, 2, 0.25),
                                                                                         (4096, 2, 1.0)]
    assert groups[1]["ci95"] == [1.0, 1.0] and groups[0]["ci95"][0] <= 0.25 <= groups[0]["ci95"][1]
    with pytest.raises(ValueError, match="one context_length per problem"):
        accuracy_by_group([1.0], [1, 2], "context_length")


def test_compute_metrics_breaks_recall_down():
    fields = [{"context_length": 64, "num_pairs": 4}, {"context_length": 64, "num_pairs": 4},
              {"context_length": 256, "num_pairs": 16}]
    problems = [
        [_sample(True, [True, True], **fields[0]), _sample(False, [True, False], **fields[0])],
        [_sample(True, [True, True], **fields[1]), _sample(True, [True, True], **fields[1])],
        [_sample(False, [False, False], **fields[2]), _sample(False, [False, True], **fields[2])],
    ]
    m = compute_metrics(problems, max_tokens=8)
    assert m["avg@2"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    by_length = m["accuracy_by_context_length"]
    assert [(g["context_length"], g["num_problems"]) for g in by_length] == [(64, 2), (256, 1)]
    assert by_length[0]["accuracy"] == pytest.approx(0.75) and by_length[1]["accuracy"] == 0.0
    assert [g["num_pairs"] for g in m["accuracy_by_num_pairs"]] == [4, 16]
    # Per problem, the mean over samples of the fraction of its queries right: 0.75, 1.0, 0.25.
    assert m["query_accuracy"] == pytest.approx(2 / 3)
    assert [g["accuracy"] for g in m["query_accuracy_by_num_pairs"]] == pytest.approx([0.875, 0.25])
    assert [p["accuracy"] for p in m["accuracy_by_query_position"]] == pytest.approx([4 / 6, 4 / 6])
    low, high = m["query_accuracy_ci95"]
    assert low <= m["query_accuracy"] <= high
    # Math sets have none of it.
    plain = compute_metrics([[{k: v for k, v in s.items() if k not in ("context_length", "num_pairs",
                                                                         "query_correct")} for s in p]
                             for p in problems], max_tokens=8)
    assert not {k for k in plain if "context_length" in k or "query" in k or "pairs" in k}


# ---------------------------------------------------------------------------------------------------- runner

class RecallLLM:
    """Stands in for vllm.LLM on MQAR: sample j of a problem answers its first [0, 1, 2, all][j] queries right
    and the others with "zz" (the problem is known by its sampling seed)."""

    def __init__(self, tokenizer, answers: dict[int, str]):
        self.tokenizer, self.answers = tokenizer, answers
        self.model_config = SimpleNamespace(max_model_len=4096)

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, requests, params, use_tqdm=False):
        outputs = []
        for p in params:
            gold = self.answers[p.seed].split()
            texts = []
            for j in range(p.n):
                right = [0, 1, 2, len(gold)][j]
                texts.append("\\boxed{" + " ".join(gold[:right] + ["zz"] * (len(gold) - right)) + "}")
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(text=t, token_ids=[0] * 4, finish_reason="stop")
                                                    for t in texts]))
        return outputs


def test_runner_reports_recall_by_length_and_query_position(tmp_path):
    name = "mqar_small"
    src = DataSource(source="generator", name=name, split="test",
                     generator=GeneratorSettings(task="mqar", num_examples=6, options=SMALL_MQAR))
    rows = load_rl_dataset(src)
    tokenizer = train_tokenizer(["Key-value pairs:", "Queries:"], vocab_size=300)
    llm = RecallLLM(tokenizer, {problem_seed(0, name, r["id"]): r["answer"] for r in rows})
    m = evaluate(llm, [src], tmp_path, n=4, max_tokens=8)[name]
    assert m["avg@4"] == 0.25  # only the last sample is exact
    pairs = [4, 8, 16] * 2
    # Query accuracy of a problem with q queries: (0 + 1/q + 2/q + 1) / 4.
    assert m["query_accuracy"] == pytest.approx(sum((3 / q + 1) / 4 for q in pairs) / 6)
    assert [p["accuracy"] for p in m["accuracy_by_query_position"][:4]] == [0.75, 0.5, 0.25, 0.25]
    assert [p["count"] for p in m["accuracy_by_query_position"]] == [24] * 4 + [16] * 4 + [8] * 8
    assert [(g["context_length"], g["num_problems"], g["accuracy"]) for g in m["accuracy_by_context_length"]] == [
        (32, 2, 0.25), (64, 2, 0.25), (96, 2, 0.25)]
    samples = [json.loads(line) for line in (tmp_path / f"{name}.samples.jsonl").read_text().splitlines()]
    assert {s["task"] for s in samples} == {"mqar"} and all("query_correct" in s for s in samples)
    report = (tmp_path / "results.md").read_text()
    assert report == markdown_report(json.loads((tmp_path / "metrics.json").read_text()))
    assert "Recall accuracy (%) by context length" in report and "| mqar_small | 96 | 25.0 (25.0-25.0) [2] |" in report
    assert "mqar_small: accuracy (%) by query position" in report and "| position | 1 | 2-3 | 4-7 | 8-15 |" in report


# ---------------------------------------------------------------------------------------------------- Zoology format

ZOOLOGY = {"format": "zoology", "vocab_size": 64, "mix": [{"context_length": 8, "num_pairs": 2},
                                                          {"context_length": 20, "num_pairs": 4}]}


def _zoology_source(split="train", n=40, options=ZOOLOGY) -> DataSource:
    return DataSource(source="generator", name="z", split=split,
                      generator=GeneratorSettings(task="mqar", num_examples=n, options=options))


def _zoology_parts(codes: list[str], pairs: int):
    """(key -> value of the pairs, [(position of a query, its key)]) of a Zoology-format code sequence."""
    lookup = dict(zip(codes[0:2 * pairs:2], codes[1:2 * pairs:2]))
    return lookup, [(p, c) for p, c in enumerate(codes) if p >= 2 * pairs and c in lookup]


def test_mqar_zoology_sequence():
    rows = generate_task("mqar", 20, options=ZOOLOGY)
    for i, r in enumerate(rows):
        length, pairs = ZOOLOGY["mix"][i % 2]["context_length"], ZOOLOGY["mix"][i % 2]["num_pairs"]
        codes = r["problem"].split()
        assert len(codes) == length and r["num_queries"] == pairs and r["format"] == "zoology"
        lookup, queries = _zoology_parts(codes, pairs)
        # Every key queried once, each in a query slot (an even offset after the pairs); the answers are the
        # queried keys' values in order, and no value is ever an input after the pairs: the answer slot and every
        # other position there holds filler, none of this sample's codes.
        assert sorted(k for _, k in queries) == sorted(lookup)
        assert all((p - 2 * pairs) % 2 == 0 for p, _ in queries)
        assert r["answer"] == " ".join(lookup[k] for _, k in queries)
        at_queries = {p for p, _ in queries}
        for p in range(2 * pairs, length):
            if p not in at_queries:
                assert codes[p] not in lookup and codes[p] not in lookup.values()
    test = generate_task("mqar", 20, options=ZOOLOGY, split="test")
    assert not {r["problem"] for r in rows} & {r["problem"] for r in test}


def test_mqar_zoology_query_gaps_follow_the_power_law():
    """Zoology's gaps: with power_a 0.01 the queries crowd the first slots after the pairs; 1 spreads them."""
    def mean_first_slot(power_a):
        options = {**ZOOLOGY, "vocab_size": 128, "mix": [{"context_length": 64, "num_pairs": 4}], "power_a": power_a}
        slots = [(_zoology_parts(r["problem"].split(), 4)[1][0][0] - 8) // 2
                 for r in generate_task("mqar", 300, options=options)]
        return sum(slots) / len(slots)
    # 28 slots, 4 queries: uniform gives the first query at slot 4.8 on average, the power law about 1.
    assert mean_first_slot(0.01) < 2.0 < 3.5 < mean_first_slot(1.0)
    with pytest.raises(ValueError, match="mqar: options.power_a: expected a number in"):
        generate_task("mqar", 1, options={**ZOOLOGY, "power_a": 0})


def test_zoology_sft_rows_label_every_answer_and_show_none():
    sft = load_sft_dataset(_zoology_source())
    assert sft.column_names == ["text", "num_pairs"] and sft[0]["text"].startswith(" ")
    tokenizer = train_tokenizer(conversation_texts(sft), vocab_size=400)
    tokens = tokenize_codes(sft, tokenizer)
    assert tokens.column_names == ["input_ids", "labels"]
    for row, example in zip(sft, tokens):
        codes = row["text"].split()
        ids, labels = example["input_ids"], example["labels"]
        assert len(ids) == len(codes) == len(labels)  # one token per code
        # The same code is the same token wherever it stands: the first key, its query, its value.
        token = {c: tokenizer.convert_tokens_to_ids("\u0120" + c) for c in codes}
        assert {c: i for c, i in zip(codes, ids)} == token
        lookup, queries = _zoology_parts(codes, row["num_pairs"])
        want = [-100] * len(codes)
        for p, key in queries:
            want[p + 1] = token[lookup[key]]
            assert ids[p + 1] != want[p + 1]  # the label, never the input
        assert labels == want
    # A tokenizer that splits codes is refused, not trained on misplaced answers.
    with pytest.raises(DataError, match="codes gave [0-9]+ tokens .*: Zoology-format MQAR needs one token per code"):
        tokenize_codes(sft, train_tokenizer(["a b c"], vocab_size=270))


class RecallOracle:
    """A stand-in causal LM that solves MQAR: at each position it predicts the token that followed the first
    earlier copy of the current token (at a query: the key's value), except at the first query of the
    sequence when `wrong_first`, where it predicts the next token id instead."""

    def __init__(self, vocab: int, wrong_first: bool):
        self.vocab, self.wrong_first = vocab, wrong_first

    def __call__(self, ids):
        import torch
        ids = ids[0].tolist()
        logits = torch.zeros(1, len(ids), self.vocab)
        first_query = True
        for i in range(len(ids) - 1):
            earlier = [j for j in range(i) if ids[j] == ids[i]]
            guess = ids[earlier[0] + 1] if earlier else 0
            if earlier and first_query:
                first_query = False
                guess = (guess + self.wrong_first) % self.vocab
            logits[0, i, guess] = 1.0
        return SimpleNamespace(logits=logits)


def test_zoology_eval_is_teacher_forced_per_query(tmp_path, monkeypatch):
    src = _zoology_source(split="test", n=8)
    rows = load_rl_dataset(src)
    assert {"sequence", "num_queries", "num_pairs"} <= set(rows.column_names) and rows[0]["sequence"].startswith(" ")
    tokenizer = train_tokenizer(conversation_texts(load_sft_dataset(_zoology_source(n=200))), vocab_size=400)

    real = runner.TeacherForced

    def scorer(model_dir):  # wrong at the first query of every sequence: 1 of its q queries
        s = real.__new__(real)
        import torch
        s.torch, s.tokenizer, s.model = torch, tokenizer, RecallOracle(len(tokenizer), wrong_first=True)
        return s

    monkeypatch.setattr(runner, "TeacherForced", scorer)
    m = evaluate(lambda: pytest.fail("no generation engine for teacher-forced rows"), [src], tmp_path, n=1,
                 max_tokens=8, model_name="unused")["z"]
    assert m["avg@1"] == 0.0  # every row has one query wrong
    assert [(g["num_pairs"], g["accuracy"]) for g in m["query_accuracy_by_num_pairs"]] == [(2, 0.5), (4, 0.75)]
    assert [p["accuracy"] for p in m["accuracy_by_query_position"]] == [0.0, 1.0, 1.0, 1.0]
    sample = json.loads((tmp_path / "z.samples.jsonl").read_text().splitlines()[1])
    assert sample["query_correct"] == [False, True, True, True]
    assert sample["completion"].split()[1:] == rows[1]["answer"].split()[1:]
    with pytest.raises(ValueError, match="teacher-forced .* n must be 1, got 2"):
        evaluate(None, [src], tmp_path / "n2", n=2, model_name="unused")
