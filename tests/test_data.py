"""Data layer: generator (determinism, exact answers, disjoint splits), loaders (every source, row-level errors),
tokenizer (digits, chat template with assistant masks, save/reload)."""
import gzip
import json
import re
from pathlib import Path

import datasets
import pytest

from conftest import shared_data_file
from pipeline.config import DataSource, GeneratorSettings
from tasks.generator import LEVELS, generate, split_of
from tasks.loaders import DataError, filter_long_prompts, load_rl_dataset, load_sft_dataset, preview
from tasks.prompts import INSTRUCTION, build_prompt, instruct
from tasks.tokenizer import CHAT_TEMPLATE, conversation_texts, train_tokenizer

ALL_LEVELS = sorted(LEVELS)


# ---------------------------------------------------------------------------------------------------- generator

def test_generator_is_deterministic():
    assert generate(300, ALL_LEVELS, seed=3) == generate(300, ALL_LEVELS, seed=3)
    assert generate(300, ALL_LEVELS, seed=3) != generate(300, ALL_LEVELS, seed=4)
    assert [r["level"] for r in generate(10, [1, 3])] == [1, 3] * 5


def test_splits_never_overlap():
    train = generate(5000, ALL_LEVELS, seed=0, split="train")
    test = generate(1000, ALL_LEVELS, seed=0, split="test")
    assert not {r["canonical"] for r in train} & {r["canonical"] for r in test}
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert all(split_of(r["canonical"]) == "test" for r in test)


def _check_equation_lines(solution: str):
    """Every arithmetic line `expr = value` of the teacher's solution is true."""
    for line in solution.splitlines()[:-1]:
        line = re.sub(r"^(ones|tens|hundreds|thousands): ", "", line)  # column steps are equations too
        parts = [p.strip() for p in line.split("=")]
        if all(re.fullmatch(r"[-\d +*/]+", p) for p in parts):
            values = {eval(p) for p in parts}  # digits and operators only, checked above
            assert len(values) == 1, line


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_teacher_solutions_are_right(level):
    for row in generate(200, [level], seed=level):
        solution, answer = row["solution"], row["answer"]
        assert solution.endswith(f"The answer is \\boxed{{{answer}}}.")
        _check_equation_lines(solution)
        x = int(answer)
        if level in (3, 4):  # substitute the answer into the equation of the problem
            lhs, rhs = re.fullmatch(r"Solve for x: (.*) = (.*)\.", row["problem"]).groups()
            assert eval(re.sub(r"(\d)x", r"\1*x", lhs)) == eval(re.sub(r"(\d)x", r"\1*x", rhs))  # digits, operators, x
        if level == 5:
            s, d = map(int, re.findall(r"\d+", row["problem"]))
            assert (x, s - x) == ((s + d) // 2, (s - d) // 2)


def test_generator_bad_arguments():
    with pytest.raises(ValueError, match=r"levels must be a non-empty list from \[1, 2, 3, 4, 5\], got \[9\]"):
        generate(5, [9])
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        generate(5, [1], split="validation")
    with pytest.raises(ValueError, match=r"in_head_probability must be in \[0, 1\], got 1.5"):
        generate(5, [1], in_head_probability=1.5)


def test_sums_in_the_head():
    """A teacher that works some multi-digit sums in one line: same problems and answers, solutions still right,
    about the asked share of column computations collapsed to their conclusion, and none at 1.0."""
    columns = generate(2000, [1, 2], seed=5)
    opened = sum(row["solution"].count("ones:") for row in columns)
    for probability in (0.3, 1.0):
        mixed = generate(2000, [1, 2], seed=5, in_head_probability=probability)
        assert [(r["problem"], r["answer"]) for r in mixed] == [(r["problem"], r["answer"]) for r in columns]
        for row in mixed:
            _check_equation_lines(row["solution"])
            assert row["solution"].endswith(f"The answer is \\boxed{{{row['answer']}}}.")
        kept = sum(row["solution"].count("ones:") for row in mixed) / opened
        assert abs(kept - (1 - probability)) < 0.03, (probability, kept)


# ---------------------------------------------------------------------------------------------------- loaders

def _gen(**kw):
    return DataSource(source="generator", generator=GeneratorSettings(num_examples=50, levels=[1, 2]), **kw)


def test_generator_sources_in_trl_formats():
    sft = load_sft_dataset(_gen())
    assert sft.column_names == ["prompt", "completion"] and len(sft) == 50
    row = generate(1, [1, 2])[0]
    assert sft[0] == {"prompt": build_prompt(row["problem"]),
                      "completion": [{"role": "assistant", "content": row["solution"]}]}
    rl = load_rl_dataset(_gen(split="test", limit=7))
    assert rl.column_names == ["prompt", "answer", "id"] and len(rl) == 7
    assert rl[0]["id"] == "gen-test-0-0" and rl[0]["answer"] == generate(1, [1, 2], split="test")[0]["answer"]


def test_shared_training_file():
    ds = load_rl_dataset(DataSource(source=str(shared_data_file("train_math_aime.jsonl"))))
    assert len(ds) == 8442 and ds.column_names == ["prompt", "answer", "id"]
    assert all(a.strip() for a in ds["answer"]) and len(set(ds["id"])) == len(ds)
    assert ds[0]["prompt"][0]["role"] == "user" and "\\boxed{}" in ds[0]["prompt"][0]["content"]


def test_shared_eval_file():
    path = shared_data_file("math500.jsonl")
    ds = load_rl_dataset(DataSource(source=str(path)))
    first = json.loads(path.read_text().splitlines()[0])
    assert len(ds) == 500
    assert ds[0] == {"prompt": build_prompt(first["problem"]), "answer": first["answer"], "id": first["id"]}
    # solutions make it an SFT source too
    assert load_sft_dataset(DataSource(source=str(path), limit=3))[0]["completion"][0]["content"] == first["solution"]


ROWS = [
    {"id": "a", "problem": "What is 1+1?", "answer": "2", "solution": "1+1=2, \\boxed{2}",
     "chat": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "\\boxed{2}"}]},
    {"id": None, "problem": "What is 2+2?", "answer": "4", "solution": "\\boxed{4}",  # no id
     "chat": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}]},
]


def test_hugging_face_path_offline(tmp_path, monkeypatch):
    """A local dataset directory goes through `datasets.load_dataset`, the same code path as a hub id."""
    (tmp_path / "ds" / "data").mkdir(parents=True)
    datasets.Dataset.from_list(ROWS).to_parquet(tmp_path / "ds" / "data" / "test-00000-of-00001.parquet")
    calls = []
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    src = str(tmp_path / "ds")
    rl = load_rl_dataset(DataSource(source=src, split="test"))
    assert calls == [((src, None), {"split": "test", "streaming": False})]
    assert rl["answer"] == ["2", "4"] and rl["id"] == ["a", "ds-2"]
    sft = load_sft_dataset(DataSource(source=src, split="test", messages_field="chat", limit=2))
    assert sft[1] == {"prompt": instruct(ROWS[1]["chat"][:2]), "completion": ROWS[1]["chat"][2:]}
    with pytest.raises(DataError, match=rf"^{src} \(split train\): cannot load dataset: ValueError: .*split"):
        load_rl_dataset(DataSource(source=src, split="train"))
    bad = tmp_path / "bad" / "data"
    bad.mkdir(parents=True)
    datasets.Dataset.from_list([ROWS[0], {**ROWS[0], "problem": " "}]).to_parquet(bad / "test-0.parquet")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'bad'} \(split test\): row 2: problem: empty$"):
        load_rl_dataset(DataSource(source=str(tmp_path / "bad"), split="test"))


def test_parquet_file(tmp_path):
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(path)
    assert load_rl_dataset(DataSource(source=str(path)))["id"] == ["a", "rows-2"]
    assert len(load_sft_dataset(DataSource(source=str(path), limit=1))) == 1


def _jsonl(tmp_path, *lines: bytes) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


GOOD = json.dumps({"id": "ok", "problem": "What is 1+1?", "answer": "2"}).encode()
MALFORMED = [
    ("missing answer", json.dumps({"id": "x", "problem": "p"}).encode(),
     "row 3: answer: missing (row has id, problem)"),
    ("null answer", json.dumps({"problem": "p", "answer": None}).encode(),
     "row 3: answer: missing (row has problem, answer)"),
    ("float answer", json.dumps({"problem": "p", "answer": 2.5}).encode(),
     "row 3: answer: expected a string, got float 2.5"),
    ("list problem", json.dumps({"problem": [1, 2], "answer": "3"}).encode(),
     "row 3: problem[0]: expected {role: system|user|assistant, content: str}, got int 1"),
    ("int problem", json.dumps({"problem": 7, "answer": "3"}).encode(), "row 3: problem: expected a string, got int 7"),
    ("empty problem", json.dumps({"problem": "  \n", "answer": "3"}).encode(), "row 3: problem: empty"),
    ("bad id", json.dumps({"id": [1], "problem": "p", "answer": "3"}).encode(),
     "row 3: id: expected a string or integer, got list [1]"),
    ("non-UTF-8", b'{"problem": "caf\xe9", "answer": "1"}', "row 3: not valid UTF-8 (byte 0xe9 at column 17)"),
    ("invalid JSON", b'{"problem": "p", "answer": }', "row 3: invalid JSON: Expecting value at column 28"),
    ("not an object", b'["p", "1"]', "row 3: expected a JSON object, got list ['p', '1']"),
]


@pytest.mark.parametrize("case,line,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_rl_rows(tmp_path, case, line, message):
    path = _jsonl(tmp_path, GOOD, b"", line)  # the blank line still counts: rows are numbered by line
    with pytest.raises(DataError) as e:
        load_rl_dataset(DataSource(source=str(path)))
    assert str(e.value) == f"{path}: {message}"


@pytest.mark.parametrize("row,field,message", [
    ({"problem": "p"}, "solution", "row 1: solution: missing (row has problem)"),
    ({"chat": [{"role": "user", "content": "p"}]}, "chat",
     "row 1: chat: expected turns ending with an assistant turn, got roles ['user']"),
    ({"chat": [{"role": "user", "content": "p"}, {"role": "bot", "content": "a"}]}, "chat",
     "row 1: chat[1]: expected {role: system|user|assistant, content: str}, got dict {'role': 'bot', 'content': 'a'}"),
    ({"chat": [{"role": "user", "content": "p"}, {"role": "assistant", "content": ""}]}, "chat",
     "row 1: chat[1].content: empty"),
])
def test_malformed_sft_rows(tmp_path, row, field, message):
    path = _jsonl(tmp_path, json.dumps(row).encode())
    src = DataSource(source=str(path), messages_field=field if field == "chat" else None)
    with pytest.raises(DataError) as e:
        load_sft_dataset(src)
    assert str(e.value) == f"{path}: {message}"


def test_integer_answers_and_chat_prompts_in_the_shared_template(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = _jsonl(tmp_path, json.dumps({"id": 7, "problem": chat, "answer": 4}).encode())
    templated = [chat[0], {"role": "user", "content": f"2+2?\n{INSTRUCTION}"}]
    assert load_rl_dataset(DataSource(source=str(path)))[0] == {"prompt": templated, "answer": "4", "id": "7"}
    assert instruct(templated) == templated  # given once, never twice


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope.jsonl: no such file$"):
        load_rl_dataset(DataSource(source=str(tmp_path / "nope.jsonl")))


# ---------------------------------------------------------------------------------------------------- tokenizer

@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(conversation_texts(load_sft_dataset(_gen())), vocab_size=512)


def test_digits_are_single_tokens(tokenizer):
    tokens = tokenizer.tokenize("Ann has 1234 pens: 56 + 7 = 63")
    assert [t for t in tokens if any(c.isdigit() for c in t)] == list("1234567" + "63")
    assert len(tokenizer) <= 512


def test_chat_template_masks_the_assistant_turn(tokenizer):
    row = load_sft_dataset(_gen())[0]
    messages = row["prompt"] + row["completion"]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    prompt_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    # The prompt with the generation prompt is a token prefix of prompt + completion (TRL's completion mask) ...
    assert ids[:len(prompt_ids)] == prompt_ids
    # ... and the assistant mask covers exactly the completion and its end-of-turn token (the model learns to stop).
    trained = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(trained) == row["completion"][0]["content"] + tokenizer.eos_token
    assert ids[len(prompt_ids):][:len(trained)] == trained


def test_tokenizer_round_trips_through_save_pretrained(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Solve for x: 3x - 4 = 11.\nPlease reason step by step. \\boxed{5} é"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.chat_template == CHAT_TEMPLATE
    assert (loaded.eos_token, loaded.pad_token, loaded.bos_token) == ("<|im_end|>", "<|pad|>", "<|endoftext|>")


def test_filter_long_prompts(tokenizer):
    ds = load_rl_dataset(_gen(limit=20))
    lengths = [len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
               for p in ds["prompt"]]
    limit = sorted(lengths)[10]
    kept, skipped = filter_long_prompts(ds, tokenizer, limit, "skip")
    assert skipped == sum(n > limit for n in lengths) and len(kept) == 20 - skipped
    first = next(i for i, n in enumerate(lengths) if n > limit)
    with pytest.raises(DataError, match=rf"^prompt '{ds[first]['id']}': {lengths[first]} tokens, over "
                                        rf"max_prompt_length={limit} \({skipped} prompts in all"):
        filter_long_prompts(ds, tokenizer, limit, "error")


def test_column_steps_spell_out_the_result():
    """The teacher's columns are the written algorithm: each column's last digit, read from the highest place
    down (plus a final carry), is the result."""
    from tasks.generator import add_steps, sub_steps

    def from_columns(lines):
        values = [int(line.rsplit("= ", 1)[1]) for line in lines[:-1] if "=" in line]  # the first line: operands
        if not values:
            return int(lines[-1].rsplit("= ", 1)[1])
        return int(str(values[-1]) + "".join(str(v % 10) for v in reversed(values[:-1])))

    for a in range(0, 130):
        for b in range(0, 130, 7):
            assert from_columns(add_steps(a, b)) == a + b, (a, b, add_steps(a, b))
            if a >= b:
                assert from_columns(sub_steps(a, b)) == a - b, (a, b, sub_steps(a, b))


# ---------------------------------------------------------------------------------------------------- formats

def _write_formats(tmp_path) -> dict[str, str]:
    """ROWS in every local form `datasets` reads; {form: source}."""
    ds = datasets.Dataset.from_list(ROWS)
    lines = b"".join(json.dumps(r).encode() + b"\n" for r in ROWS)
    (tmp_path / "rows.jsonl").write_bytes(lines)
    with gzip.open(tmp_path / "rows.jsonl.gz", "wb") as f:
        f.write(lines)
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))  # one JSON array
    ds.remove_columns("chat").to_csv(tmp_path / "rows.csv")
    ds.to_parquet(tmp_path / "rows.parquet")
    for i, row in enumerate(ROWS):  # a glob and a folder of shards
        (tmp_path / "shards").mkdir(exist_ok=True)
        datasets.Dataset.from_list([row]).to_parquet(tmp_path / "shards" / f"train-{i:05d}-of-00002.parquet")
    ds.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"test": ds}).save_to_disk(tmp_path / "saved_dict")
    return {"jsonl": "rows.jsonl", "jsonl.gz": "rows.jsonl.gz", "json": "rows.json", "csv": "rows.csv",
            "parquet": "rows.parquet", "glob": "shards/*.parquet", "folder": "shards", "save_to_disk": "saved",
            "save_to_disk dict": "saved_dict"}


@pytest.mark.parametrize("form", ["jsonl", "jsonl.gz", "json", "csv", "parquet", "glob", "folder", "save_to_disk",
                                  "save_to_disk dict"])
def test_every_local_form(tmp_path, form):
    src = str(tmp_path / _write_formats(tmp_path)[form])
    split = "test" if form == "save_to_disk dict" else "train"
    rl = load_rl_dataset(DataSource(source=src, split=split))
    assert rl["answer"] == ["2", "4"] and rl["prompt"][0] == build_prompt("What is 1+1?")
    assert rl.cache_files, "rows should be memory-mapped Arrow, not Python lists"
    assert preview(DataSource(source=src, split=split), "rl", rows=1) == [rl[0]]
    assert load_sft_dataset(DataSource(source=src, split=split, limit=1))[0]["completion"][0]["content"] == \
        ROWS[0]["solution"]


def test_missing_sources_say_what_is_there(tmp_path):
    _write_formats(tmp_path)
    with pytest.raises(DataError, match=r"rows.jsnol.gz: no such file \(did you mean 'rows.jsonl.gz'\?\)$"):
        load_rl_dataset(DataSource(source=str(tmp_path / "rows.jsnol.gz")))
    with pytest.raises(DataError, match=r"nope/\*.parquet: no file matches$"):
        preview(DataSource(source=str(tmp_path / "nope" / "*.parquet")), "rl")
    with pytest.raises(DataError, match=r"saved_dict: no split 'tset' \(did you mean 'test'\?\)$"):
        load_rl_dataset(DataSource(source=str(tmp_path / "saved_dict"), split="tset"))
    with pytest.raises(DataError, match=r"row 1: answr: missing \(did you mean 'answer'\?\) \(row has id, "):
        preview(DataSource(source=str(tmp_path / "rows.parquet"), answer_field="answr"), "rl")


def test_preview_reads_only_the_first_rows(tmp_path):
    path = _jsonl(tmp_path, GOOD, GOOD, b"{broken")
    assert len(preview(DataSource(source=str(path)), "rl", rows=2)) == 2
    with pytest.raises(DataError, match=r"row 3: invalid JSON"):
        load_rl_dataset(DataSource(source=str(path)))


def test_an_edited_jsonl_file_is_read_again(tmp_path):
    path = _jsonl(tmp_path, GOOD)
    assert len(load_rl_dataset(DataSource(source=str(path)))) == 1
    _jsonl(tmp_path, GOOD, GOOD)
    assert len(load_rl_dataset(DataSource(source=str(path)))) == 2


OPENR1 = [  # OpenR1-Math's columns: several traces per problem and which of them Math-Verify accepted
    {"problem": "1+1?", "answer": "2", "generations": ["<think>x</think> 3", "<think>y</think> \\boxed{2}"],
     "correctness_math_verify": [False, True]},
    {"problem": "2+2?", "answer": "4", "generations": ["<think>z</think> 5"], "correctness_math_verify": [False]},
    {"problem": "3+3?", "answer": "6", "generations": ["<think>w</think> \\boxed{6}", "6"],
     "correctness_math_verify": [True, True]},
]


@pytest.mark.parametrize("form", ["jsonl", "parquet"])
def test_first_verified_candidate_trace_is_the_completion(tmp_path, form):
    path = tmp_path / f"openr1.{form}"
    if form == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in OPENR1))
    else:
        datasets.Dataset.from_list(OPENR1).to_parquet(path)
    src = DataSource(source=str(path), candidates_field="generations", selection_field="correctness_math_verify")
    sft = load_sft_dataset(src)
    chosen = [OPENR1[0]["generations"][1], OPENR1[2]["generations"][0]]  # the second row has no verified trace
    assert [r["completion"][0]["content"] for r in sft] == chosen
    assert sft[0]["prompt"] == build_prompt("1+1?")
    assert preview(src, "sft", rows=3) == sft.to_list()
    first = DataSource(source=str(path), candidates_field="generations")  # no selection field: the first trace
    assert load_sft_dataset(first)[1]["completion"][0]["content"] == "<think>z</think> 5"
    bad = DataSource(source=str(path), candidates_field="generations", selection_field="correctness")
    with pytest.raises(DataError, match=r"row 1: correctness: missing \(did you mean 'correctness_math_verify'\?\)"):
        load_sft_dataset(bad)


def test_sft_chat_prompts_get_the_same_instruction_as_grpo_and_eval(tmp_path):
    path = _jsonl(tmp_path, json.dumps({"problem": "What is 1+1?", "answer": "2", "chat": ROWS[0]["chat"]}).encode())
    sft = load_sft_dataset(DataSource(source=str(path), messages_field="chat"))[0]
    rl = load_rl_dataset(DataSource(source=str(path)))[0]
    assert sft["prompt"][-1]["content"].endswith(INSTRUCTION) and rl["prompt"][-1]["content"].endswith(INSTRUCTION)


def test_shared_files_in_other_forms(tmp_path):
    """The real benchmark file, gzipped and as Parquet, loads to the same rows as the plain JSONL."""
    path = shared_data_file("aime24.jsonl")
    plain = load_rl_dataset(DataSource(source=str(path)))
    with gzip.open(tmp_path / "aime24.jsonl.gz", "wb") as f:
        f.write(path.read_bytes())
    datasets.load_dataset("json", data_files=str(path), split="train").to_parquet(tmp_path / "aime24.parquet")
    for other in ("aime24.jsonl.gz", "aime24.parquet"):
        assert load_rl_dataset(DataSource(source=str(tmp_path / other))).to_list() == plain.to_list()
    assert len(preview(DataSource(source=str(shared_data_file("train_math_aime.jsonl"))), "rl", rows=3)) == 3


# ---------------------------------------------------------------------------------------------------- files

def test_write_atomic_replaces_the_whole_file_and_leaves_nothing_beside_it(tmp_path):
    from tasks.files import write_atomic

    path = tmp_path / "metrics.json"
    write_atomic(path, "x" * 100_000)
    write_atomic(path, "é\n")  # text is UTF-8 whatever the locale
    assert path.read_bytes() == "é\n".encode()
    write_atomic(path, b"\x00\x01", durable=False)
    assert path.read_bytes() == b"\x00\x01"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_write_atomic_keeps_the_old_version_when_the_write_fails(tmp_path, monkeypatch):
    """A write that fails (here the fsync, where a full disk shows) leaves the old file and no temporary one; a
    file that did not exist is still absent."""
    import tasks.files
    from tasks.files import write_atomic

    old, new = tmp_path / "run.json", tmp_path / "new.json"
    write_atomic(old, "old")

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tasks.files.os, "fsync", disk_full)
    for path in (old, new):
        with pytest.raises(OSError, match="No space"):
            write_atomic(path, "new")
    assert old.read_text() == "old" and not new.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]
    write_atomic(new, "new", durable=False)  # without fsync, the same file system would take it
    assert new.read_text() == "new"


def test_replace_dir_swaps_in_the_complete_directory(tmp_path):
    from tasks.files import replace_dir

    out, staging = tmp_path / "model", tmp_path / ".partial-model"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    replace_dir(staging, out)
    assert [p.name for p in out.iterdir()] == ["config.json"] and not staging.exists()
