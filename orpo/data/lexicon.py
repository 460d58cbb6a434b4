"""The small, regular English the synthetic data set is written in: topics, sentence templates, phrases.

Everything here is plain data. The vocabulary is kept to a few hundred words on purpose: a ~1M
parameter model with a ~2k-token BPE must be able to learn it in minutes, and the eval topics are
held out (disjoint from the training topics) so eval prompts are never seen in training.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Topic:
    """One thing to write about: a name ("fox"), its category and the words its templates need."""

    name: str
    category: str
    attrs: tuple[tuple[str, str], ...]

    def attr(self, key: str) -> str:
        """The value of one attribute."""
        return dict(self.attrs)[key]


# Per category: the attribute slots (in table order) and the fact templates. The first template is
# the defining sentence and always opens a response. Templates with an introductory ", " read well
# with the comma dropped, which is how a no-comma response is written.
CATEGORIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "animal": (
        ("size", "color", "cover", "home", "food", "skill", "trait", "time"),
        (
            "The {n} is a {size} animal.",
            "The {n} has {color} {cover}.",
            "The {n} lives in the {home}.",
            "It likes to eat {food}.",
            "It can {skill}.",
            "Many people say the {n} is {trait}.",
            "You can often see the {n} {time}.",
            "A young {n} stays close to its mother.",
            "In the winter, the {n} looks for a warm place to rest.",
            "Like many animals, the {n} needs clean water.",
            "If you ever see the {n}, you should stay calm and watch it.",
        ),
    ),
    "place": (
        ("size", "feature", "activity", "air", "sound", "color"),
        (
            "The {n} is a {size} place.",
            "It is known for its {feature}.",
            "People go to the {n} to {activity}.",
            "The air at the {n} is {air}.",
            "At the {n}, you can hear {sound}.",
            "The {n} looks {color} in the evening light.",
            "Many families visit the {n} on the weekend.",
            "It is a good idea to bring water when you visit the {n}.",
            "Some people come back to the {n} every year.",
            "In the summer, the {n} is full of visitors.",
            "For many people, the {n} is a place to feel calm.",
        ),
    ),
    "tool": (
        ("material", "use", "hold", "place", "weight"),
        (
            "The {n} is a useful tool.",
            "It is made of {material}.",
            "People use the {n} to {use}.",
            "You hold the {n} with {hold}.",
            "You can find a {n} in {place}.",
            "The {n} is {weight} to carry.",
            "A good {n} can last for many years.",
            "Be careful when you use the {n}.",
            "After you use it, keep the {n} in a dry place.",
            "With a little practice, anyone can use the {n}.",
            "In a busy home, the {n} is used every week.",
        ),
    ),
    "food": (
        ("taste", "origin", "meal", "pair", "color", "benefit"),
        (
            "The {n} is a {taste} food.",
            "It comes from {origin}.",
            "Many people eat the {n} for {meal}.",
            "The {n} goes well with {pair}.",
            "It is often {color}.",
            "The {n} gives you {benefit}.",
            "You should keep the {n} in a cool place.",
            "Children and adults both like the {n}.",
            "In many homes, the {n} is part of the daily meal.",
            "When it is fresh, the {n} tastes best.",
            "For a quick meal, you can eat the {n} with {pair}.",
        ),
    ),
    "weather": (
        ("season", "feel", "effect", "response", "sky"),
        (
            "The {n} is common in the {season}.",
            "It makes the air feel {feel}.",
            "The {n} can make {effect}.",
            "Farmers watch the {n} with care.",
            "The {n} can change the plans for the day.",
            "Some people enjoy the {n} and some do not.",
            "People often talk about the {n}.",
            "Some animals hide from the {n}.",
            "When the {n} comes, people {response}.",
            "After the {n}, the sky often looks {sky}.",
            "In the {season}, the {n} can come at any time.",
        ),
    ),
    "plant": (
        ("height", "where", "color", "needs"),
        (
            "The {n} is a {height} plant.",
            "It grows in {where}.",
            "It is often {color}.",
            "The {n} needs {needs}.",
            "Bees and birds like the {n}.",
            "Many people grow the {n} at home.",
            "The {n} makes the world look more alive.",
            "You should not pull up a young {n}.",
            "In the spring, the {n} starts to grow again.",
            "With enough care, the {n} can live for many years.",
            "In a small garden, the {n} can still grow well.",
        ),
    ),
}

# Sentences that fit every topic; they pad the pool so long answers have enough to say.
GENERIC_TEMPLATES: tuple[str, ...] = (
    "There is a lot to learn about the {n}.",
    "I think the {n} is very interesting.",
)

# name, category, attribute values in the category's slot order.
_TRAIN_TABLE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("fox", "animal", ("small", "red", "fur", "forest", "mice and berries", "run fast", "clever", "at night")),
    ("horse", "animal", ("large", "brown", "hair", "fields", "grass and hay", "run for a long time", "strong", "in the morning")),
    ("rabbit", "animal", ("small", "white", "fur", "meadow", "grass and carrots", "jump high", "shy", "in the morning")),
    ("duck", "animal", ("small", "white", "feathers", "lake", "seeds and small fish", "swim well", "calm", "during the day")),
    ("frog", "animal", ("small", "green", "skin", "pond", "insects", "jump far", "quiet", "in the evening")),
    ("bear", "animal", ("large", "brown", "fur", "hills", "fish and honey", "climb trees", "strong", "in the summer")),
    ("goat", "animal", ("small", "gray", "hair", "farm", "grass and leaves", "climb rocks", "curious", "during the day")),
    ("mouse", "animal", ("tiny", "gray", "fur", "field", "seeds", "hide well", "shy", "at night")),
    ("river", "place", ("quiet", "cold water", "fish", "fresh", "water moving", "blue")),
    ("mountain", "place", ("big", "high rocks", "climb", "cool", "the wind", "gray")),
    ("desert", "place", ("wide", "hot sand", "see the stars", "dry", "the wind", "gold")),
    ("beach", "place", ("busy", "soft sand", "swim", "warm", "the waves", "yellow")),
    ("village", "place", ("small", "old houses", "rest", "fresh", "children playing", "green")),
    ("island", "place", ("small", "green hills", "explore", "warm", "the sea", "green")),
    ("lake", "place", ("peaceful", "clear water", "fish", "cool", "birds singing", "blue")),
    ("valley", "place", ("wide", "green fields", "walk", "fresh", "birds singing", "green")),
    ("hammer", "tool", ("metal and wood", "hit nails", "one hand", "a workshop", "heavy")),
    ("shovel", "tool", ("metal", "dig holes", "both hands", "a garden shed", "heavy")),
    ("ladder", "tool", ("wood", "reach high places", "both hands", "a garage", "heavy")),
    ("rope", "tool", ("cotton", "tie things together", "both hands", "a boat", "light")),
    ("saw", "tool", ("steel", "cut wood", "one hand", "a workshop", "light")),
    ("brush", "tool", ("wood and hair", "paint walls", "one hand", "a garage", "light")),
    ("bucket", "tool", ("plastic", "carry water", "one hand", "a garden shed", "light")),
    ("knife", "tool", ("steel", "cut food", "one hand", "a kitchen", "light")),
    ("apple", "food", ("sweet", "apple trees", "lunch", "cheese", "red", "energy")),
    ("bread", "food", ("soft", "wheat", "breakfast", "butter", "brown", "energy")),
    ("rice", "food", ("mild", "wet fields", "dinner", "vegetables", "white", "energy")),
    ("soup", "food", ("warm", "vegetables and water", "dinner", "bread", "orange", "strength")),
    ("cheese", "food", ("salty", "milk", "lunch", "bread", "yellow", "strength")),
    ("honey", "food", ("sweet", "bees", "breakfast", "tea", "gold", "energy")),
    ("carrot", "food", ("sweet", "the ground", "dinner", "rice", "orange", "strength")),
    ("egg", "food", ("mild", "hens", "breakfast", "bread", "white", "strength")),
    ("rain", "weather", ("spring", "wet", "the ground soft", "carry an umbrella", "clear")),
    ("snow", "weather", ("winter", "cold", "the roads white", "wear a warm coat", "bright")),
    ("wind", "weather", ("autumn", "cool", "the trees move", "close the doors", "clear")),
    ("fog", "weather", ("autumn", "damp", "the roads hard to see", "drive slowly", "gray")),
    ("storm", "weather", ("summer", "wild", "the lights go out", "stay inside", "dark")),
    ("frost", "weather", ("winter", "cold", "the grass white", "cover their plants", "clear")),
    ("hail", "weather", ("spring", "cold", "small holes in leaves", "stay inside", "dark")),
    ("sunshine", "weather", ("summer", "warm", "the fields dry", "wear a hat", "blue")),
    ("oak", "plant", ("tall", "old forests", "green", "a lot of space")),
    ("rose", "plant", ("short", "gardens", "red", "a lot of sun")),
    ("fern", "plant", ("short", "shady woods", "green", "wet soil")),
    ("cactus", "plant", ("short", "the desert", "green", "very little water")),
    ("tulip", "plant", ("short", "gardens", "yellow", "cool winters")),
    ("ivy", "plant", ("climbing", "old walls", "green", "some shade")),
    ("bamboo", "plant", ("tall", "warm places", "green", "a lot of water")),
    ("moss", "plant", ("tiny", "wet stones", "green", "shade and water")),
)

# Held out for the eval prompts: never named anywhere in the training rows (tests check it).
_EVAL_TABLE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("owl", "animal", ("small", "brown", "feathers", "forest", "mice", "fly without a sound", "wise", "at night")),
    ("turtle", "animal", ("small", "green", "skin", "pond", "plants and insects", "swim well", "patient", "during the day")),
    ("harbor", "place", ("busy", "many boats", "watch the boats", "fresh", "the waves", "gray")),
    ("canyon", "place", ("deep", "steep red walls", "hike", "dry", "the wind", "red")),
    ("wrench", "tool", ("steel", "turn bolts", "one hand", "a workshop", "heavy")),
    ("needle", "tool", ("metal", "sew cloth", "two fingers", "a sewing box", "light")),
    ("pear", "food", ("sweet", "trees", "lunch", "yogurt", "green", "energy")),
    ("lemon", "food", ("sour", "trees", "dinner", "fish", "yellow", "energy")),
    ("breeze", "weather", ("summer", "cool", "the leaves move", "open the doors", "clear")),
    ("drizzle", "weather", ("autumn", "damp", "the streets wet", "carry an umbrella", "gray")),
    ("maple", "plant", ("tall", "cool forests", "red", "rich soil")),
    ("lily", "plant", ("short", "ponds", "white", "a lot of water")),
)


def _topics(table: tuple[tuple[str, str, tuple[str, ...]], ...]) -> tuple[Topic, ...]:
    out = []
    for name, category, values in table:
        slots = CATEGORIES[category][0]
        assert len(slots) == len(values), name  # a table typo must not pass silently
        out.append(Topic(name, category, tuple(zip(slots, values))))
    return tuple(out)


TRAIN_TOPICS: tuple[Topic, ...] = _topics(_TRAIN_TABLE)
EVAL_TOPICS: tuple[Topic, ...] = _topics(_EVAL_TABLE)


@cache
def fact_pool(topic: Topic) -> tuple[str, ...]:
    """Every fact sentence about `topic`, in template order (defining sentence first)."""
    fields = dict(topic.attrs, n=topic.name)
    return tuple(t.format(**fields) for t in CATEGORIES[topic.category][1] + GENERIC_TEMPLATES)


# Words too common to be worth forbidding: forbidding them would empty the answer.
_STOP = frozenset(
    {
        "a", "an", "and", "the", "of", "to", "in", "on", "at", "for", "with", "it", "its", "is", "are",
        "be", "can", "you", "not", "some", "many", "very", "things", "lot", "little", "high", "small",
    }
)


@cache
def forbidden_candidates(topic: Topic) -> tuple[str, ...]:
    """Attribute words a prompt may forbid: each appears in the topic's facts, but in few of them."""
    pool = fact_pool(topic)
    out: list[str] = []
    for _, value in topic.attrs:
        for word in value.split():
            if len(word) < 3 or word in _STOP or word == topic.name or word in out:
                continue
            hits = sum(bool(re.search(rf"\b{word}\b", s, re.IGNORECASE)) for s in pool)
            # avoiding it must leave enough facts for a long answer
            if 1 <= hits <= 2:
                out.append(word)
    return tuple(out)


# The base tasks a prompt starts with.
TASKS: tuple[str, ...] = (
    "Write a short description of the {n}.",
    "Tell me about the {n}.",
    "Describe the {n} in a few sentences.",
    "What do you know about the {n}?",
    "Write a short note about the {n}.",
    "Explain what the {n} is like.",
    "Write a few sentences about the {n}.",
    "Give me some facts about the {n}.",
)

# keywords:existence draws from these. None occurs, even as a substring, in any fact, frame or
# phrase above or below (a test checks), so leaving a keyword out really breaks the instruction.
KEYWORDS: tuple[str, ...] = (
    "music", "journey", "picture", "story", "school", "market", "holiday", "lesson",
    "dream", "song", "silence", "adventure", "memory", "poem", "promise", "secret", "treasure",
)
KEYWORD_FRAMES: tuple[str, ...] = (
    "The {n} makes me think of the {kw}.",
    "I like the {n} and I like the {kw} too.",
)

# startend:end_checker phrases (no commas, so they combine with punctuation:no_comma).
END_PHRASES: tuple[str, ...] = (
    "Is there anything else I can help with?",
    "Any other questions?",
    "Let me know if you have additional questions.",
    "That is all I know about it.",
)
# Words a response that breaks end_checker writes after the phrase.
END_TAILS: tuple[str, ...] = ("I hope this helps.", "Have a good day.")

POSTSCRIPT_MARKERS: tuple[str, ...] = ("P.S.", "P.P.S")
POSTSCRIPT_TEXTS: tuple[str, ...] = (
    "I hope this helps you learn about the {n}.",
    "I will write more about the {n} soon.",
    "Please ask me if you want to know more.",
)

TITLE_FRAMES: tuple[str, ...] = ("The {N}", "All About the {N}", "A Note on the {N}", "Facts About the {N}")
BULLET_INTROS: tuple[str, ...] = ("Here are {k} facts about the {n}:", "Here are {k} things to know about the {n}:")
BULLET_INTRO_ONE = "Here is 1 fact about the {n}:"
JSON_PREFACE = "Here is my answer in JSON format:"
JSON_KEY = "answer"

# UltraFeedback-style metadata: fictional model names and the four principles with system prompts.
MODEL_NAMES: tuple[str, ...] = (
    "synth-writer-a", "synth-writer-b", "synth-writer-c", "synth-writer-d",
    "synth-writer-e", "synth-writer-f", "synth-writer-g", "synth-writer-h",
)
SYSTEM_PROMPTS: dict[str, tuple[str, ...]] = {
    "helpfulness": (
        "As an AI assistant, give answers that are clear, useful and on topic.",
        "You are a helpful assistant. Answer the request as well as you can.",
    ),
    "honesty": (
        "As an AI assistant, be honest about what you know and do not make things up.",
    ),
    "truthfulness": (
        "As an AI assistant, only state facts you are sure of and keep to the request.",
    ),
    "verbalized_calibration": (
        "As an AI assistant, answer the request and say how confident you are when it matters.",
    ),
}
PRINCIPLES: tuple[str, ...] = tuple(SYSTEM_PROMPTS)
