"""Recall tasks for issue 16 ("show that SSE's larger state earns its keep"): generators of rows like the
arithmetic generator's, used as data sources (`source: generator` with `generator.task`) and as eval sets by
name (`mqar_test`, `niah_word_4k`, `s_niah_uuid_8k`, ...; `tasks.sources.BENCHMARKS`). docs/retrieval.md
describes them; this module is stdlib only, so `pipeline.config` can check task options with it.

Tasks:
  mqar       Multi-query associative recall in the Zoology form (Arora et al. 2023): key-value pairs, then
             queries of keys; the answer is the queried keys' values in order. Keys and values are fixed-width
             lowercase letter codes (a vocabulary of `vocab_size` codes, keys from the first half, values from
             the second, as Zoology's token ids), so with the project's tokenizer trained on the fly one code is
             one to three tokens and never splits into digits (the tokenizer spells digits one by one).
             `format: zoology` renders a sample as Zoology's token sequence instead of a prompt and an answer:
             `k1 v1 .. kn vn` then filler codes with the query keys among them at power-law gaps (`power_a`,
             Zoology's `multiquery_ar`); a query's value is the label of the position after it, never an input
             there (a filler code stands in), so a model cannot rule out values it has already seen answered.
             For SFT with the loss on every answer and for teacher-forced eval (`query_answers`).
  niah_word  Needle in a haystack of word facts ("The quiet harbor is the amber heron."), word keys and word
             values, the facts in a fresh random order per sample, with an instruction before the haystack
             ("strong") or none; one fact is asked for. After SILA's NIAH-Word (see docs/retrieval.md).
  s_niah     RULER's single needle: one "special magic" number, word or UUID hidden in RULER's repeated noise
             sentences; UUIDs come from the seeded RNG, never uuid4.

Lengths are counted in whitespace-separated words (MQAR: codes) of the context, the part that grows; a
real tokenizer gives about 1.3 tokens per word, the on-the-fly BPE a few per code or number (docs/retrieval.md).

Every row has id, problem, solution ("The answer is \\boxed{...}."), answer, canonical, task, context_length
(the requested length: what the eval report breaks accuracy down by), num_pairs, and task fields (MQAR:
num_queries; NIAH: depth, the needle's relative position). A row's split is a hash of its canonical form (the
MQAR sample's pairs and queries, a NIAH needle's key and value), so train and test never share one.
"""
import difflib
import hashlib
import random
import uuid
from collections.abc import Callable
from typing import Any

TASKS = ("mqar", "niah_word", "s_niah")
# Columns that RL and eval rows of these tasks keep beside prompt/answer/id (tasks.loaders).
TASK_COLUMNS = ("task", "context_length", "num_pairs")
TEST_PERCENT = 50

# ---------------------------------------------------------------------------------------------------- words
# Keys are ADJECTIVE NOUN, values COLOR ANIMAL: four disjoint lists, so a value never reads as a key.
ADJECTIVES = [
    "ancient", "brave", "calm", "clever", "crisp", "curious", "daring", "distant", "eager", "early", "faint",
    "fancy", "fierce", "fragile", "gentle", "giant", "glad", "gloomy", "graceful", "grand", "hasty", "hidden",
    "hollow", "humble", "icy", "jolly", "keen", "kind", "lively", "lonely", "loud", "lucky", "mellow", "merry",
    "mighty", "modest", "narrow", "noble", "odd", "patient", "plain", "polite", "proud", "quick", "quiet", "rapid",
    "rare", "restless", "rough", "royal", "rustic", "sacred", "shallow", "sharp", "shy", "silent", "simple",
    "sleepy", "slow", "smooth", "soft", "solemn", "steady", "steep", "stormy", "strange", "sturdy", "subtle",
    "sudden", "swift", "tall", "tender", "tiny", "vast", "vivid", "wandering", "warm", "weary", "wild", "wise",
]
NOUNS = [
    "anchor", "arrow", "bakery", "balcony", "basket", "beacon", "bell", "blanket", "bridge", "bucket", "cabin",
    "candle", "canyon", "castle", "cellar", "chapel", "chimney", "cliff", "clock", "compass", "cottage", "crown",
    "desert", "doorway", "engine", "fountain", "garden", "gate", "glacier", "harbor", "helmet", "hill", "island",
    "jacket", "kettle", "ladder", "lagoon", "lantern", "library", "lighthouse", "market", "meadow", "mirror",
    "mountain", "needle", "orchard", "palace", "pasture", "pebble", "pillar", "pocket", "pond", "quarry", "river",
    "saddle", "school", "shelter", "shovel", "statue", "stove", "street", "summit", "temple", "tower", "tunnel",
    "valley", "village", "wagon", "wall", "whistle", "window", "workshop", "barn", "harp", "forest", "bench",
    "curtain", "oven", "piano", "ribbon",
]
COLORS = [
    "amber", "azure", "beige", "black", "blue", "bronze", "brown", "cobalt", "copper", "coral", "crimson", "cyan",
    "golden", "gray", "green", "indigo", "ivory", "jade", "khaki", "lemon", "lilac", "magenta", "maroon", "mauve",
    "navy", "ochre", "olive", "orange", "peach", "pink", "plum", "purple", "red", "rose", "ruby", "rust", "scarlet",
    "silver", "teal", "violet",
]
ANIMALS = [
    "badger", "bear", "beaver", "bison", "camel", "cat", "cobra", "crane", "crow", "deer", "dolphin", "donkey",
    "eagle", "falcon", "ferret", "finch", "fox", "frog", "gecko", "goat", "goose", "hare", "hawk", "heron", "horse",
    "hyena", "ibis", "jackal", "koala", "lemur", "leopard", "lion", "lizard", "llama", "lynx", "magpie", "mole",
    "moose", "mouse", "otter", "owl", "panda", "parrot", "pelican", "penguin", "pigeon", "puma", "rabbit", "raven",
    "salmon", "seal", "shark", "sheep", "sparrow", "squirrel", "swan", "tiger", "toad", "turtle", "walrus", "whale",
    "wolf", "zebra",
]
NUM_KEYS = len(ADJECTIVES) * len(NOUNS)

NIAH_WORD_LINE = "The {key} is the {value}."  # 7 words
NIAH_WORD_LINE_WORDS = 7
NIAH_WORD_STRONG = ("The text below is a list of facts of the form \"The A B is the C D.\", each about a "
                    "different A B. Read every fact and remember it: after the list you will be asked what one "
                    "A B is, and you must answer with its C D, the two words exactly as written.")
RULER_NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
               "There and back again.")
S_NIAH_VALUES = ("number", "word", "uuid")

# Zoology's MQAR mix (Arora et al. 2023, vocabulary 8192): train sequences of 64-256 tokens with 4-64 pairs,
# test up to 1024 tokens with 256 pairs. Here a sequence is the pairs, noise codes and the queries.
MQAR_TRAIN_MIX = [{"context_length": 64, "num_pairs": 4}, {"context_length": 128, "num_pairs": 8},
                  {"context_length": 256, "num_pairs": 16}, {"context_length": 256, "num_pairs": 32},
                  {"context_length": 256, "num_pairs": 64}]
# MQAR renderings: "prose" a prompt and a generated \boxed{} answer (every task's shape), "zoology" one plain
# sequence of codes whose answers are labels only (tasks.loaders.tokenize_codes).
MQAR_FORMATS = ("prose", "zoology")
MQAR_TEST_MIX = [*MQAR_TRAIN_MIX, {"context_length": 512, "num_pairs": 64},
                 {"context_length": 512, "num_pairs": 128}, {"context_length": 1024, "num_pairs": 256}]

K = 1024
NIAH_WORD_LENGTHS = [1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K]
S_NIAH_LENGTHS = [4 * K, 8 * K, 16 * K, 32 * K]

# Options per task: name -> default. `check_options` checks the values.
DEFAULTS: dict[str, dict[str, Any]] = {
    "mqar": {"vocab_size": 8192, "mix": MQAR_TRAIN_MIX, "num_queries": None, "format": "prose", "power_a": 0.01},
    "niah_word": {"context_lengths": NIAH_WORD_LENGTHS, "instruction": "strong"},
    "s_niah": {"context_lengths": S_NIAH_LENGTHS, "value": "number"},
}


class TaskOptionError(ValueError):
    """A bad task or option; `key` is the option's path below the generator settings (`options.mix[1].num_pairs`)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


# ---------------------------------------------------------------------------------------------------- options

def check_options(task: str, options: dict) -> dict:
    """The task's options with defaults filled in; raises TaskOptionError naming the option."""
    if task not in TASKS:
        close = difflib.get_close_matches(str(task), ["arithmetic", *TASKS], n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid: arithmetic, {', '.join(TASKS)}"
        raise TaskOptionError("task", f"unknown task {task!r} ({hint})")
    if not isinstance(options, dict):
        raise TaskOptionError("options", f"expected a mapping, got {type(options).__name__}")
    defaults = DEFAULTS[task]
    for name in options:
        if name not in defaults:
            close = difflib.get_close_matches(str(name), list(defaults), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"{task} takes {', '.join(defaults)}"
            raise TaskOptionError(f"options.{name}", f"unknown option for task {task} ({hint})")
    out = {**defaults, **options}
    if task == "mqar":
        vocab = _int(out["vocab_size"], "options.vocab_size", 4)
        mix = out["mix"]
        if not isinstance(mix, list) or not mix:
            raise TaskOptionError("options.mix", "expected a non-empty list of {context_length, num_pairs}")
        _choice(out["format"], "options.format", MQAR_FORMATS)
        power = out["power_a"]
        if isinstance(power, bool) or not isinstance(power, (int, float)) or not 0 < power <= 1:
            raise TaskOptionError("options.power_a", f"expected a number in (0, 1] (1: uniform gaps), got {power!r}")
        # In Zoology's sequence every query is followed by its answer's position: 2 codes a query instead of 1.
        query_codes = 2 if out["format"] == "zoology" else 1
        queries = out["num_queries"]
        if queries is not None:
            _int(queries, "options.num_queries", 1)
        for i, entry in enumerate(mix):
            where = f"options.mix[{i}]"
            if not isinstance(entry, dict) or set(entry) != {"context_length", "num_pairs"}:
                raise TaskOptionError(where, f"expected a mapping with context_length and num_pairs, got {entry!r}")
            length = _int(entry["context_length"], f"{where}.context_length", 1)
            pairs = _int(entry["num_pairs"], f"{where}.num_pairs", 1)
            asked = pairs if queries is None else queries
            if queries is not None and queries > pairs:
                raise TaskOptionError("options.num_queries", f"{queries} queries but mix[{i}] has only {pairs} "
                                      "pairs (each query asks a different key)")
            need = 2 * pairs + query_codes * asked
            if need > length:
                per_query = "2 * queries" if query_codes == 2 else "queries"
                raise TaskOptionError(f"{where}.context_length", f"{length} codes cannot hold {pairs} pairs and "
                                      f"{asked} queries (2 * num_pairs + {per_query} = {need})")
            if vocab <= length:
                raise TaskOptionError("options.vocab_size", f"must exceed every context_length (as in Zoology), "
                                      f"got {vocab} for mix[{i}].context_length={length}")
        out["mix"] = [dict(e) for e in mix]
        return out
    lengths = out["context_lengths"]
    if not isinstance(lengths, list) or not lengths:
        raise TaskOptionError("options.context_lengths", f"expected a non-empty list of lengths in words, got "
                              f"{lengths!r}")
    if task == "niah_word":
        low, high = 2 * NIAH_WORD_LINE_WORDS, NUM_KEYS * NIAH_WORD_LINE_WORDS
        for i, n in enumerate(lengths):
            if _int(n, f"options.context_lengths[{i}]", low) > high:
                raise TaskOptionError(f"options.context_lengths[{i}]", f"at most {high} words ({NUM_KEYS} distinct "
                                      f"keys of {NIAH_WORD_LINE_WORDS}-word facts), got {n}")
        _choice(out["instruction"], "options.instruction", ("strong", "none"))
    else:
        for i, n in enumerate(lengths):
            _int(n, f"options.context_lengths[{i}]", 64)
        _choice(out["value"], "options.value", S_NIAH_VALUES)
    out["context_lengths"] = list(lengths)
    return out


def _int(value, key: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TaskOptionError(key, f"expected int, got {type(value).__name__} {value!r}")
    if value < low:
        raise TaskOptionError(key, f"must be at least {low}, got {value}")
    return value


def _choice(value, key: str, choices: tuple) -> None:
    if value not in choices:
        raise TaskOptionError(key, f"expected one of {', '.join(map(repr, choices))}, got {value!r}")


# ---------------------------------------------------------------------------------------------------- rows

def split_of(canonical: str) -> str:
    """'test' for about TEST_PERCENT % of canonical samples, 'train' for the rest; stable across runs."""
    h = int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "big")
    return "test" if h % 100 < TEST_PERCENT else "train"


def generate_task(task: str, num_examples: int, seed: int = 0, split: str = "train",
                  options: dict | None = None) -> list[dict]:
    """`num_examples` rows of `task` for the split, the lengths of the options' mix in turn. The same arguments
    always give the same rows."""
    if split not in ("train", "test"):
        raise ValueError(f"{task} split must be 'train' or 'test', got {split!r}")
    try:
        opts = check_options(task, options or {})
    except TaskOptionError as e:
        raise ValueError(f"{task}: {e}") from None
    rng = random.Random(f"{task}:{seed}:{split}")
    make: Callable = {"mqar": _mqar, "niah_word": _niah_word, "s_niah": _s_niah}[task]
    settings = opts["mix"] if task == "mqar" else opts["context_lengths"]
    rows = []
    for i in range(num_examples):
        row = make(rng, settings[i % len(settings)], split, opts)
        row.update(id=f"{task}-{split}-{seed}-{i}", task=task,
                   solution=f"The answer is \\boxed{{{row['answer']}}}.")
        rows.append(row)
    return rows


def code_width(vocab_size: int) -> int:
    """Letters per MQAR code: the fewest with 26**width >= vocab_size."""
    width = 1
    while 26 ** width < vocab_size:
        width += 1
    return width


def code(index: int, width: int) -> str:
    letters = []
    for _ in range(width):
        index, r = divmod(index, 26)
        letters.append(chr(ord("a") + r))
    return "".join(reversed(letters))


def _mqar(rng: random.Random, entry: dict, split: str, opts: dict) -> dict:
    vocab, length, pairs = opts["vocab_size"], entry["context_length"], entry["num_pairs"]
    asked = opts["num_queries"] or pairs
    half, width = vocab // 2, code_width(vocab)
    while True:
        keys = rng.sample(range(half), pairs)
        values = rng.sample(range(half, vocab), pairs)
        order = rng.sample(range(pairs), asked)
        canonical = f"mqar:{vocab}:{length}:" + ",".join(f"{k}={v}" for k, v in zip(keys, values)) + \
            "?" + ",".join(str(keys[j]) for j in order)
        if split_of(canonical) == split:
            break
    # Filler codes (Zoology's noise tokens) bring the sequence to `length` codes; they never use a code of this
    # sample's keys or values, so each key occurs once in the context and a query is the only later copy of it.
    used = set(keys) | set(values)

    def filler(n: int) -> list[str]:
        codes = []
        while len(codes) < n:
            c = rng.randrange(vocab)
            if c not in used:
                codes.append(code(c, width))
        return codes
    pair_codes = [code(c, width) for k, v in zip(keys, values) for c in (k, v)]
    queries = [code(keys[j], width) for j in order]
    answers = [code(values[j], width) for j in order]
    if opts["format"] == "zoology":
        # Zoology's multiquery_ar: the rest is (query slot, answer slot) pairs; the queries take slots drawn
        # without replacement with p(gap) ~ gap^(power_a - 1) (small gaps likely), in query order. The answer slot
        # holds filler: the value is only the label there (`query_answers` finds it).
        region = filler(length - 2 * pairs)
        for slot, key in zip(sorted(_power_law_slots(rng, (length - 2 * pairs) // 2, asked, opts["power_a"])),
                             queries):
            region[2 * slot] = key
        return {"problem": " ".join(pair_codes + region), "answer": " ".join(answers), "canonical": canonical,
                "context_length": length, "num_pairs": pairs, "num_queries": asked, "format": "zoology"}
    context = pair_codes + filler(length - 2 * pairs - asked)
    problem = (f"Key-value pairs:\n{' '.join(context)}\nQueries:\n{' '.join(queries)}\n"
               "Give the value of each queried key, in the order of the queries, separated by spaces.")
    return {"problem": problem, "answer": " ".join(answers), "canonical": canonical,
            "context_length": length, "num_pairs": pairs, "num_queries": asked}


def query_answers(ids: list[int], num_pairs: int) -> list[tuple[int, int]]:
    """(answer slot, value token) of each query of a Zoology-format sequence, in order: a query is a later copy
    of one of the first `num_pairs` keys (filler never repeats a key of its sample), its answer slot the next
    position, whose input is filler and whose label is that key's value."""
    value_of = dict(zip(ids[0:2 * num_pairs:2], ids[1:2 * num_pairs:2]))
    return [(p + 1, value_of[ids[p]]) for p in range(2 * num_pairs, len(ids) - 1) if ids[p] in value_of]


def answer_labels(ids: list[int], num_pairs: int) -> list[int]:
    """Training labels of a Zoology-format sequence: each query's value at its answer slot, -100 elsewhere."""
    labels = [-100] * len(ids)
    for slot, value in query_answers(ids, num_pairs):
        labels[slot] = value
    return labels


def _power_law_slots(rng: random.Random, slots: int, k: int, power_a: float) -> list[int]:
    """k distinct slots of range(slots), drawn one by one with weights (slot + 1)^(power_a - 1), as numpy's
    weighted choice without replacement in Zoology's generator."""
    weights = [(s + 1) ** (power_a - 1) for s in range(slots)]
    chosen = []
    for _ in range(k):
        s = rng.choices(range(slots), weights)[0]
        chosen.append(s)
        weights[s] = 0.0
    return chosen


def _phrase(index: int, first: list[str], second: list[str], sep: str = " ") -> str:
    return first[index // len(second)] + sep + second[index % len(second)]


def _niah_word(rng: random.Random, length: int, split: str, opts: dict) -> dict:
    facts = length // NIAH_WORD_LINE_WORDS
    num_values = len(COLORS) * len(ANIMALS)
    while True:
        needle_key, needle_value = rng.randrange(NUM_KEYS), rng.randrange(num_values)
        canonical = f"niah_word:{_phrase(needle_key, ADJECTIVES, NOUNS)}={_phrase(needle_value, COLORS, ANIMALS)}"
        if split_of(canonical) == split:
            break
    # The other facts: distinct keys (never the needle's), any values; a fresh order in every sample.
    others = rng.sample(range(NUM_KEYS - 1), facts - 1)
    keys = [k + (k >= needle_key) for k in others]
    values = [rng.randrange(num_values) for _ in keys]
    position = rng.randrange(facts)
    keys.insert(position, needle_key)
    values.insert(position, needle_value)
    key_text = _phrase(needle_key, ADJECTIVES, NOUNS)
    haystack = " ".join(NIAH_WORD_LINE.format(key=_phrase(k, ADJECTIVES, NOUNS), value=_phrase(v, COLORS, ANIMALS))
                        for k, v in zip(keys, values))
    head = NIAH_WORD_STRONG + "\n\n" if opts["instruction"] == "strong" else ""
    problem = f"{head}{haystack}\n\nQuestion: what is the {key_text}?"
    return {"problem": problem, "answer": _phrase(needle_value, COLORS, ANIMALS), "canonical": canonical,
            "context_length": length, "num_pairs": facts, "depth": position / max(facts - 1, 1),
            "instruction": opts["instruction"]}


def _s_niah(rng: random.Random, length: int, split: str, opts: dict) -> dict:
    kind = opts["value"]
    while True:
        key = _phrase(rng.randrange(NUM_KEYS), ADJECTIVES, NOUNS, sep="-")
        if kind == "number":
            value = str(rng.randint(1_000_000, 9_999_999))  # RULER's 7-digit numbers
        elif kind == "word":
            value = _phrase(rng.randrange(len(COLORS) * len(ANIMALS)), COLORS, ANIMALS, sep="-")
        else:
            value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        canonical = f"s_niah:{kind}:{key}={value}"
        if split_of(canonical) == split:
            break
    needle = f"One of the special magic {kind}s for {key} is: {value}."
    budget = length - len(needle.split())
    sentences, words = [], 0
    while words + len(RULER_NOISE[len(sentences) % 5].split()) <= budget:
        sentences.append(RULER_NOISE[len(sentences) % 5])
        words += len(sentences[-1].split())
    position = rng.randint(0, len(sentences))
    sentences.insert(position, needle)
    problem = (f"Some special magic {kind}s are hidden within the following text. Make sure to memorize it. "
               f"I will quiz you about the {kind}s afterwards.\n{' '.join(sentences)}\n"
               f"What is the special magic {kind} for {key} mentioned in the provided text?")
    return {"problem": problem, "answer": value, "canonical": canonical, "context_length": length,
            "num_pairs": 1, "depth": position / max(len(sentences) - 1, 1), "value_type": kind}


# ---------------------------------------------------------------------------------------------------- eval sets

def _k(n: int) -> str:
    return f"{n // K}k"


# name -> (task, rows, options): the eval sets registered in tasks.sources.BENCHMARKS (split "test", seed 0).
BENCHMARKS: dict[str, tuple[str, int, dict]] = {
    "mqar_test": ("mqar", 100 * len(MQAR_TEST_MIX), {"mix": MQAR_TEST_MIX}),
    **{f"niah_word_{_k(n)}": ("niah_word", 100, {"context_lengths": [n], "instruction": "strong"})
       for n in NIAH_WORD_LENGTHS},
    **{f"niah_word_noinst_{_k(n)}": ("niah_word", 100, {"context_lengths": [n], "instruction": "none"})
       for n in NIAH_WORD_LENGTHS},
    **{f"s_niah_{kind}_{_k(n)}": ("s_niah", 100, {"context_lengths": [n], "value": kind})
       for kind in S_NIAH_VALUES for n in S_NIAH_LENGTHS},
}
