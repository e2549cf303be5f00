r"""Arithmetic and algebra word problems with step-by-step solutions from a programmatic teacher.

Levels of difficulty:
  1  one operation (+ or -) in a one-sentence story
  2  two events in a story, mixing +, - and * (bags of items)
  3  a linear equation a*x + b = c
  4  x on both sides: a*x + b = c*x + d
  5  two numbers from their sum and difference

The teacher writes one equation per line, always in the same phrasing, and ends with
"The answer is \boxed{N}." so a tiny model can learn the format by distillation. Additions and subtractions
with a number of two or more digits are written out first ("18 + 3"), then worked in columns ("ones: 8 + 3 = 11",
"tens: 1 + 0 + 1 = 2"), then concluded ("18 + 3 = 21"): the test split holds out whole computations, and only
single-digit steps, which every split shares, let a small model add numbers it has never seen added. Writing the
operands first puts their digits right above the columns that read them (measured: 43 % vs 26 % held-out
accuracy at level 1 for the same training, and 14 % without columns).

`in_head_probability` makes a teacher that sometimes works a multi-digit sum in its head: the columns are left
out and only the conclusion line is written. A tiny model copies the habit but not the skill (it gets most such
one-line sums wrong on numbers it has not seen added), which gives reinforcement learning a choice to learn:
the embedded default distills from this mixed teacher, and GRPO's gain comes largely from writing the columns
more often (docs/pipeline.md).

A problem belongs to the train or the test split by a hash of its canonical form (the numbers and
operations, not the names in the story), so the test split never holds a train computation in new words.
"""
import hashlib
import random
import re
from typing import Callable, Sequence

NAMES = ["Ann", "Ben", "Cat", "Dan", "Eve", "Tom", "Mia", "Sam"]
ITEMS = ["apples", "pens", "books", "coins", "cards", "stones"]
TEST_PERCENT = 10


PLACES = ["ones", "tens", "hundreds", "thousands"]
OPERANDS = re.compile(r"\d+ [+-] \d+")  # the line that opens a column computation


def _digits(n: int) -> list[int]:
    return [int(d) for d in reversed(str(n))]


def add_steps(a: int, b: int) -> list[str]:
    """`a + b = s`, after `a + b` and its column additions (with the carry), unless it is a single-digit fact."""
    if a + b < 10:
        return [f"{a} + {b} = {a + b}"]
    da, db, carry, lines = _digits(a), _digits(b), 0, [f"{a} + {b}"]
    for i in range(max(len(da), len(db))):
        x, y = da[i] if i < len(da) else 0, db[i] if i < len(db) else 0
        total = x + y + carry
        lines.append(f"{PLACES[i]}: {x} + {y}{' + 1' if carry else ''} = {total}")
        carry = total // 10
    return lines + [f"{a} + {b} = {a + b}"]


def sub_steps(a: int, b: int) -> list[str]:
    """`a - b = d` (a >= b), after `a - b` and its column subtractions (borrowing shown as 10 + digit), unless
    both numbers are single digits."""
    if a < 10:
        return [f"{a} - {b} = {a - b}"]
    da, db, borrow, lines = _digits(a), _digits(b), 0, [f"{a} - {b}"]
    for i in range(len(da)):
        x, y = da[i], db[i] if i < len(db) else 0
        top = x + 10 if x < y + borrow else x
        lines.append(f"{PLACES[i]}: {top} - {y}{' - 1' if borrow else ''} = {top - y - borrow}")
        borrow = int(top > x)
    return lines + [f"{a} - {b} = {a - b}"]


def _story_start(rng: random.Random) -> tuple[str, str]:
    return rng.choice(NAMES), rng.choice(ITEMS)


def _level1(rng: random.Random):
    name, item = _story_start(rng)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    if rng.random() < 0.5:
        return (f"1:{a}+{b}", f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
                add_steps(a, b), a + b)
    a, b = max(a, b), min(a, b)
    return (f"1:{a}-{b}", f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have now?",
            sub_steps(a, b), a - b)


def _level2(rng: random.Random):
    name, item = _story_start(rng)
    total = rng.randint(1, 20)
    sentences, steps, canonical = [f"{name} has {total} {item}."], [], [f"2:{total}"]
    for then in ("", "Then "):
        kind = rng.choice(["gets", "gives", "bags"] if total > 1 else ["gets", "bags"])
        if kind == "gets":
            b = rng.randint(1, 10)
            sentences.append(f"{then}{name} gets {b} more.")
            steps += add_steps(total, b)
            canonical.append(f"+{b}")
            total += b
        elif kind == "gives":
            b = rng.randint(1, total - 1)
            sentences.append(f"{then}{name} gives away {b}.")
            steps += sub_steps(total, b)
            canonical.append(f"-{b}")
            total -= b
        else:
            bags, each = rng.randint(2, 5), rng.randint(2, 9)
            sentences.append(f"{then}{name} buys {bags} bags with {each} {item} in each.")
            steps += [f"{bags} * {each} = {bags * each}", *add_steps(total, bags * each)]
            canonical.append(f"+{bags}*{each}")
            total += bags * each
    sentences.append(f"How many {item} does {name} have now?")
    return "".join(canonical), " ".join(sentences), steps, total


def _signed(term: str, b: int) -> str:
    return f"{term} + {b}" if b >= 0 else f"{term} - {-b}"


def _level3(rng: random.Random):
    while True:
        a, x, b = rng.randint(2, 9), rng.randint(0, 12), rng.choice([-1, 1]) * rng.randint(1, 20)
        c = a * x + b
        if c >= 0:
            break
    rest = f"{c} - {b}" if b >= 0 else f"{c} + {-b}"
    return (f"3:{a}x{b:+d}={c}", f"Solve for x: {_signed(f'{a}x', b)} = {c}.",
            [f"{a}x = {rest} = {c - b}", f"x = {c - b} / {a} = {x}"], x)


def _level4(rng: random.Random):
    while True:
        c, diff, x, b = rng.randint(1, 6), rng.randint(2, 5), rng.randint(-5, 12), rng.randint(1, 20)
        a, d = c + diff, diff * x + b
        if d >= 1:
            break
    return (f"4:{a}x+{b}={c}x+{d}", f"Solve for x: {a}x + {b} = {c}x + {d}.",
            [f"{a}x - {c}x = {d} - {b}", f"{diff}x = {d - b}", f"x = {d - b} / {diff} = {x}"], x)


def _level5(rng: random.Random):
    small, large = sorted(rng.sample(range(1, 40), 2))
    s, d = large + small, large - small
    return (f"5:{s},{d}", f"The sum of two numbers is {s} and their difference is {d}. What is the larger number?",
            ["Let x be the larger number and y the smaller.", f"x + y = {s}", f"x - y = {d}",
             f"2x = {s} + {d} = {2 * large}", f"x = {2 * large} / 2 = {large}"],
            large)


LEVELS: dict[int, Callable] = {1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5}


def split_of(canonical: str) -> str:
    """'test' for about TEST_PERCENT % of canonical problems, 'train' for the rest; stable across runs."""
    h = int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "big")
    return "test" if h % 100 < TEST_PERCENT else "train"


def in_head(steps: list[str], rng: random.Random, probability: float) -> list[str]:
    """Each multi-digit addition or subtraction worked in columns becomes, with `probability`, its one-line
    conclusion, as a teacher that sometimes does a sum in its head would write it."""
    out, i = [], 0
    while i < len(steps):
        conclusion = None
        if OPERANDS.fullmatch(steps[i]):
            conclusion = next((j for j in range(i + 1, len(steps)) if steps[j].startswith(steps[i] + " = ")), None)
        if conclusion is not None and rng.random() < probability:
            out.append(steps[conclusion])
            i = conclusion + 1
        else:
            out.append(steps[i])
            i += 1
    return out


def generate(num_examples: int, levels: Sequence[int] = (1, 2), seed: int = 0, split: str = "train",
             in_head_probability: float = 0.0) -> list[dict]:
    """`num_examples` problems of the split, levels in turn, each row with id, problem, solution, answer,
    level and canonical. The same arguments always give the same rows; `in_head_probability` changes only the
    solutions (see `in_head`)."""
    if split not in ("train", "test"):
        raise ValueError(f"generator split must be 'train' or 'test', got {split!r}")
    if not 0.0 <= in_head_probability <= 1.0:
        raise ValueError(f"generator in_head_probability must be in [0, 1], got {in_head_probability}")
    head_rng = random.Random(f"{seed}:{split}:in-head")
    unknown = sorted(set(levels) - set(LEVELS))
    if unknown or not levels:
        raise ValueError(f"generator levels must be a non-empty list from {sorted(LEVELS)}, got {list(levels)}")
    rng = random.Random(f"{seed}:{split}")
    rows = []
    while len(rows) < num_examples:
        level = levels[len(rows) % len(levels)]
        canonical, problem, steps, answer = LEVELS[level](rng)
        if split_of(canonical) != split:
            continue
        if in_head_probability:
            steps = in_head(steps, head_rng, in_head_probability)
        rows.append({
            "id": f"gen-{split}-{seed}-{len(rows)}",
            "problem": problem,
            "solution": "\n".join(steps + [f"The answer is \\boxed{{{answer}}}."]),
            "answer": str(answer),
            "level": level,
            "canonical": canonical,
        })
    return rows
