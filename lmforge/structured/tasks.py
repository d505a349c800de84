"""A shipped task set with exact answers, and its answer templates: the material of the format study.

Five kinds of task, each drawn from a seeded generator (the same seed gives the same tasks on
every machine):
- reasoning: `last_letters` (join the last letters of 2-4 words), `addition` (two or three digit
  numbers, at least one carry, worked column by column), `counting` (how many words of a category
  a list holds, counted one by one);
- classification and extraction: `sentiment` (a one-sentence review: positive or negative) and
  `extraction` (the person, city or year named in a sentence).

Every task carries its reasoning and its answer, so one task renders as a complete reply in any
of the answer templates: free text (the reasoning, then "So the answer is X."), or JSON, YAML or
XML with the keys `reasoning` and `answer` in either order (reasoning-first lets the reply think
before it answers; answer-first makes it answer first, as in Tam et al. 2024, section 3).

Train and test tasks never share a question: a hash of the question puts one in five into the
test split, the rest into the train split, whatever the seed.
"""

import hashlib
import itertools
import json
import random
from dataclasses import dataclass
from xml.sax.saxutils import escape

import yaml

from lmforge.common.errors import LmforgeError

REASONING_KINDS = ("last_letters", "addition", "counting")
KINDS = (*REASONING_KINDS, "sentiment", "extraction")
ORDERS = ("reasoning-first", "answer-first")
SPLITS = ("train", "test")

CATEGORIES = {
    "fruit": "apple banana cherry grape lemon mango melon orange peach pear plum kiwi lime papaya".split(),
    "animal": "cat dog horse mouse tiger lion zebra sheep goat rabbit eagle snake whale otter camel".split(),
    "color": "red blue green yellow purple black white brown pink gray violet indigo".split(),
    "tool": "hammer saw drill wrench shovel ladder chisel rake axe knife brush spade".split(),
}
_ARTICLE = {"fruit": "a fruit", "animal": "an animal", "color": "a color", "tool": "a tool"}
_SUBJECTS = ("the soup|the hotel|the film|the service|the trip|the concert|the book|the room|the staff|"
             "the bread").split("|")
_POSITIVE = "great lovely superb wonderful excellent pleasant delightful charming tasty friendly".split()
_NEGATIVE = "awful terrible dull rude bland boring dreadful noisy dirty stale".split()
_NAMES = "Alice Bruno Carla Deepak Elena Farid Greta Hiro Ines Jonas Keiko Luis Mara Nadia Omar Priya".split()
_CITIES = "Lisbon Oslo Cairo Lima Quito Dublin Vienna Nairobi Seoul Hanoi Madrid Prague Athens Bogota Manila".split()
_EVENTS = ("{name} moved to {city} in {year}.", "In {year}, {name} flew to {city} to see a friend.",
           "{name} opened a small shop in {city} in {year}.", "The letter {name} wrote from {city} is dated {year}.")


@dataclass(frozen=True)
class Task:
    kind: str
    question: str
    reasoning: str  # the worked steps, one sentence or more, with no colons (YAML-safe as a plain scalar)
    answer: str | int  # int for addition and counting, a string otherwise

    @property
    def answer_type(self) -> str:
        """The JSON Schema type of the answer."""
        return "integer" if isinstance(self.answer, int) else "string"


def _last_letters(rng: random.Random) -> Task:
    pool = [word for words in CATEGORIES.values() for word in words]
    words = rng.sample(pool, rng.randint(2, 4))
    steps = " ".join(f"The last letter of {word} is {word[-1]}." for word in words)
    answer = "".join(word[-1] for word in words)
    return Task("last_letters", f'Take the last letter of each word in "{" ".join(words)}" and join them.',
                f"{steps} Joined they make {answer}.", answer)


def _addition(rng: random.Random) -> Task:
    while True:
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        if any(int(x) + int(y) >= 10 for x, y in zip(str(a)[::-1], str(b)[::-1])):
            break  # at least one carry: the step the reasoning is for
    steps, carry = [], 0
    for x, y in itertools.zip_longest(map(int, str(a)[::-1]), map(int, str(b)[::-1]), fillvalue=0):  # from the right
        total = x + y + carry
        terms = " + ".join(str(t) for t in (x, y, *([carry] if carry else [])))
        steps.append(f"{terms} = {total}, write {total % 10}" + (" carry 1." if total >= 10 else "."))
        carry = total // 10
    if carry:
        steps.append("Then write the carry 1.")
    return Task("addition", f"What is {a} + {b}?", f"From the right, {' '.join(steps)}", a + b)


def _counting(rng: random.Random) -> Task:
    category = rng.choice(list(CATEGORIES))
    others = [word for name, words in CATEGORIES.items() if name != category for word in words]
    size = rng.randint(4, 7)
    hits = rng.randint(0, min(4, size))
    words = rng.sample(CATEGORIES[category], hits) + rng.sample(others, size - hits)
    rng.shuffle(words)
    steps, count = [], 0
    for word in words:
        if word in CATEGORIES[category]:
            count += 1
            steps.append(f"{word} is {_ARTICLE[category]}, {count}.")
        else:
            steps.append(f"{word} is not.")
    return Task("counting", f"How many {category}s are in this list? {', '.join(words)}",
                f"{' '.join(steps)} That makes {count}.", count)


def _sentiment(rng: random.Random) -> Task:
    label = rng.choice(("positive", "negative"))
    adjectives = _POSITIVE if label == "positive" else _NEGATIVE
    first, second = rng.sample(_SUBJECTS, 2)
    adj1, adj2 = rng.sample(adjectives, 2)
    very = rng.choice(("", "very ", "really "))
    review = f"{first.capitalize()} was {very}{adj1} and {second} was {adj2}."
    return Task("sentiment", f'Is this review positive or negative? "{review}"',
                f"The words {adj1} and {adj2} are {label}.", label)


def _extraction(rng: random.Random) -> Task:
    name, city, year = rng.choice(_NAMES), rng.choice(_CITIES), str(rng.randint(1950, 2023))
    sentence = rng.choice(_EVENTS).format(name=name, city=city, year=year)
    field, answer = rng.choice((("person", name), ("city", city), ("year", year)))
    return Task("extraction", f"Which {field} does this sentence name? {sentence}",
                f"The {field} in the sentence is {answer}.", answer)


_GENERATORS = {"last_letters": _last_letters, "addition": _addition, "counting": _counting,
               "sentiment": _sentiment, "extraction": _extraction}


def split_of(question: str) -> str:
    """`test` for one question in five (by a hash of its text), `train` for the others."""
    return "test" if hashlib.sha256(question.encode()).digest()[0] % 5 == 0 else "train"


def make_tasks(kind: str, n: int, seed: int = 0, split: str = "test") -> list[Task]:
    """`n` distinct tasks of `kind` from `split`, the same for the same seed on every machine."""
    if kind not in _GENERATORS:
        raise LmforgeError(f"unknown task kind {kind!r}: use one of {', '.join(KINDS)}")
    if split not in SPLITS:
        raise LmforgeError(f"unknown split {split!r}: use train or test")
    rng = random.Random(f"{seed}:{kind}")  # a string seed hashes the same in every process
    tasks, seen = [], set()
    for _ in range(200 * n + 1000):  # bounded: every kind has thousands of questions per split
        if len(tasks) == n:
            return tasks
        task = _GENERATORS[kind](rng)
        if task.question not in seen and split_of(task.question) == split:
            seen.add(task.question)
            tasks.append(task)
    raise LmforgeError(f"only {len(tasks)} distinct {kind} tasks in the {split} split: ask for fewer")


# --- answer templates -------------------------------------------------------------------------

_FORMAT_NAMES = {"json": "JSON", "yaml": "YAML", "xml": "XML"}


def instruction(template: str, order: str = "reasoning-first") -> str:
    """The line of the prompt that asks for `template` with its keys in `order`."""
    if template == "text":
        return 'Reply in plain text, reasoning first, then "So the answer is ...".'
    keys = ("reasoning", "answer") if order == "reasoning-first" else ("answer", "reasoning")
    if template == "xml":
        return f"Reply in XML, a <response> holding <{keys[0]}> then <{keys[1]}>."
    return f"Reply in {_FORMAT_NAMES[template]} with the keys {keys[0]} then {keys[1]}."


def prompt(task: Task, template: str, order: str = "reasoning-first") -> str:
    """What the model is given: the question, the instruction, and the start of its reply."""
    return f"Question: {task.question}\n{instruction(template, order)}\nAnswer:\n"


def reply(task: Task, template: str, order: str = "reasoning-first") -> str:
    """The correct reply to `prompt(task, template, order)`, written as each format's own writer writes it."""
    if template == "text":
        return f"{task.reasoning} So the answer is {task.answer}."
    items = [("reasoning", task.reasoning), ("answer", task.answer)]
    if order == "answer-first":
        items.reverse()
    if template == "json":
        return json.dumps(dict(items))  # one line, ", " and ": ": the layout constrained decoding allows
    if template == "yaml":
        return yaml.safe_dump(dict(items), sort_keys=False, width=10**6).rstrip("\n")
    return "<response>" + "".join(f"<{key}>{escape(str(value))}</{key}>" for key, value in items) + "</response>"


def conversion_prompt(task: Task, free_reply: str, template: str) -> str:
    """Answer-then-convert: the free-text exchange, then a request to restate it in `template`
    (reasoning first), to which the model replies as to prompt(task, template)."""
    return f"{prompt(task, 'text')}{free_reply}\nNow {instruction(template)[0].lower()}{instruction(template)[1:]}\n"


# The training mix of `lmforge tasks`: what a model trained on it has seen of each reply.
TRAINING_MIX = {"text": 0.4, "formatted": 0.4, "converted": 0.2}


def training_documents(n: int, seed: int = 0) -> list[str]:
    """`n` training documents from the train split, kinds in turn, in TRAINING_MIX proportions:
    a free-text exchange; a formatted one (JSON, YAML or XML, either key order, in turn); or a
    free-text exchange followed by its conversion to a format (reasoning first)."""
    per_kind = -(-n // len(KINDS))
    tasks = {kind: make_tasks(kind, per_kind, seed, split="train") for kind in KINDS}
    rng = random.Random(f"{seed}:mix")
    formats = [(fmt, order) for fmt in _FORMAT_NAMES for order in ORDERS]
    docs = []
    for index in range(n):
        task = tasks[KINDS[index % len(KINDS)]][index // len(KINDS)]
        pick = rng.random()
        if pick < TRAINING_MIX["text"]:
            docs.append(prompt(task, "text") + reply(task, "text"))
        elif pick < TRAINING_MIX["text"] + TRAINING_MIX["formatted"]:
            fmt, order = formats[index % len(formats)]
            docs.append(prompt(task, fmt, order) + reply(task, fmt, order))
        else:
            fmt = list(_FORMAT_NAMES)[index % len(_FORMAT_NAMES)]
            docs.append(conversion_prompt(task, reply(task, "text"), fmt) + reply(task, fmt))
    return docs
