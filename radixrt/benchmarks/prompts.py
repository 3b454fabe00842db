"""Deterministic benchmark text: every string comes from a seeded `random.Random`.

Texts are grown sentence by sentence until the model's tokenizer counts at
least a target number of tokens, so a workload asks for "a ~1,000-token
prefix" and gets one on any tokenizer (the bundled SmolLM2's, or a tiny test
tokenizer), with the exact count measured afterwards.
"""

from __future__ import annotations

import random
from typing import Callable

_PEOPLE = [
    "Ada Moreno", "Bruno Keller", "Chiara Russo", "Dmitri Volkov", "Elena Sato", "Farid Haddad",
    "Greta Lindqvist", "Hugo Laurent", "Ines Costa", "Jonas Weber", "Keiko Tanaka", "Liam Byrne",
    "Maya Patel", "Nils Eriksen", "Olga Novak", "Pedro Alves", "Rania Aziz", "Stefan Horvat",
]
_TOWNS = [
    "Ashford", "Brightwater", "Coldspring", "Dunmore", "Eastwick", "Fairhaven", "Glenrock",
    "Highmoor", "Ironbridge", "Juniper Falls", "Kingsport", "Larkhill", "Millbrook", "Northcliff",
    "Oakridge", "Pinecrest", "Queensbury", "Riverton", "Stonehaven", "Thornbury",
]
_TRADES = ["wool", "salt", "timber", "copper", "glass", "cheese", "paper", "clocks", "silk", "olive oil"]
_JOBS = ["a miller", "a surveyor", "a schoolteacher", "a ship captain", "a clockmaker", "a botanist", "a banker"]
_SIGHTS = ["a stone bridge", "a lighthouse", "a covered market", "a clock tower", "a botanical garden", "an old mill"]
_CITIES = ["Lisbon", "Kyoto", "Oslo", "Cape Town", "Montreal", "Vienna", "Hanoi", "Lima", "Reykjavik", "Seville"]
_MONTHS = ["January", "March", "May", "July", "September", "November"]
_ITEMS = ["apples", "notebooks", "lanterns", "baskets", "candles", "jars of honey", "bicycles", "kites"]


def grow(sentence: Callable[[random.Random], str], count_tokens: Callable[[str], int], target_tokens: int,
         rng: random.Random, head: str = "", tail: str = "") -> str:
    """head + seeded sentences + tail, adding sentences until the whole has >= target_tokens tokens."""
    body: list[str] = []
    text = head + tail
    while count_tokens(text) < target_tokens:
        body.append(sentence(rng))
        text = head + " ".join(body) + tail
    return text


def town_fact(rng: random.Random) -> str:
    town, person = rng.choice(_TOWNS), rng.choice(_PEOPLE)
    return rng.choice([
        f"{town} was founded in {rng.randint(1200, 1900)} by {person}, {rng.choice(_JOBS)}.",
        f"{town} lies {rng.randint(3, 240)} km from {rng.choice(_TOWNS)} and trades mostly in {rng.choice(_TRADES)}.",
        f"The population of {town} was {rng.randint(800, 90000):,} at the last census.",
        f"Visitors to {town} come to see {rng.choice(_SIGHTS)} built in {rng.randint(1300, 1950)}.",
        f"{person} served as mayor of {town} for {rng.randint(2, 19)} years.",
    ])


def founding_question(rng: random.Random, num_sentences: int) -> tuple[str, str, int]:
    """A passage of `num_sentences` town facts and a question about who founded the town, and when.

    Returns the text up to "Answer:", the founder and the year. Solved
    examples and open questions are drawn alike, so the few-shot examples
    teach exactly the format the questions ask for.
    """
    town, year, founder = rng.choice(_TOWNS), rng.randint(1200, 1900), rng.choice(_PEOPLE)
    facts = [f"{town} was founded in {year} by {founder}, {rng.choice(_JOBS)}."]
    facts += [town_fact(rng) for _ in range(num_sentences - 1)]
    rng.shuffle(facts)
    return f"Passage: {' '.join(facts)}\nQuestion: Who founded {town}, and in which year?\nAnswer:", founder, year


def few_shot_example(rng: random.Random, num_sentences: int) -> str:
    """One solved example: a passage of town facts, a question about its first fact, the answer."""
    question, founder, year = founding_question(rng, num_sentences)
    return f"{question} {founder}, in {year}.\n\n"


def few_shot_prefix(rng: random.Random, count_tokens: Callable[[str], int], target_tokens: int,
                    num_shots: int = 5) -> str:
    """An instruction and `num_shots` examples, grown one sentence (in one example) at a time to the target."""
    head = "Answer each question using only the passage above it. Give the name and the year.\n\n"
    state = rng.getstate()
    sentences = [1] * num_shots
    for step in range(200 * num_shots):
        rng.setstate(state)  # every round redraws the same examples, one of them a sentence longer
        text = head + "".join(few_shot_example(rng, n) for n in sentences)
        if count_tokens(text) >= target_tokens:
            return text
        sentences[step % num_shots] += 1
    raise ValueError(f"could not grow a few-shot prefix to {target_tokens} tokens")


def few_shot_question(rng: random.Random, num_sentences: int = 2) -> str:
    """The variable part of a few-shot prompt: a short passage and its question, answer left open."""
    return founding_question(rng, num_sentences)[0]


def word_problem_fact(rng: random.Random) -> str:
    person, item = rng.choice(_PEOPLE).split()[0], rng.choice(_ITEMS)
    return rng.choice([
        f"{person} buys {rng.randint(2, 40)} {item} at {rng.randint(2, 19)} coins each.",
        f"{person} gives away {rng.randint(1, 9)} {item} to a neighbour.",
        f"On {rng.choice(_MONTHS)} {rng.randint(1, 28)}, {person} sells {rng.randint(1, 12)} {item} "
        f"for {rng.randint(3, 30)} coins each.",
        f"A storm destroys {rng.randint(1, 5)} of the {item} that {person} keeps in the shed.",
        f"{person} borrows {rng.randint(10, 90)} coins from the market guild and repays a tenth every week.",
    ])


def reasoning_question(rng: random.Random, count_tokens: Callable[[str], int], target_tokens: int) -> str:
    """A long arithmetic word problem (self-consistency): many facts, one question, an invitation to reason."""
    return grow(word_problem_fact, count_tokens, target_tokens, rng,
                head="Read the story carefully and answer the question at the end.\n\nStory: ",
                tail="\n\nQuestion: how many coins does everyone have at the end of the story, person by person?"
                     "\nLet's think step by step.\n")


def tree_root(rng: random.Random, count_tokens: Callable[[str], int], target_tokens: int) -> str:
    """The root of a tree-of-thought program: a planning problem whose branches propose next steps."""
    return grow(town_fact, count_tokens, target_tokens, rng,
                head="You plan a week-long trip that visits several towns. What you know:\n",
                tail="\nPropose the next step of the plan, then explain it in one or two sentences.\nStep 1:")


def system_prompt(rng: random.Random, count_tokens: Callable[[str], int], target_tokens: int) -> str:
    """A support assistant's system prompt (multi-turn chat), grown from numbered policy lines."""
    counter = iter(range(1, 1000))

    def policy(rng: random.Random) -> str:
        city = rng.choice(_CITIES)
        rule = rng.choice([
            f"bookings to {city} may be changed free of charge up to {rng.randint(2, 30)} days before departure",
            f"luggage on flights to {city} is limited to {rng.randint(15, 32)} kg per passenger",
            f"hotel partners in {city} offer late check-out until {rng.randint(12, 16)}:00 for members",
            f"refunds for cancelled tours in {city} are paid within {rng.randint(3, 21)} working days",
            f"travellers to {city} in {rng.choice(_MONTHS)} should be warned about local holidays",
        ])
        return f"\n{next(counter)}. Remember that {rule}."

    return grow(policy, count_tokens, target_tokens, rng,
                head="You are Wayfarer, the support assistant of a travel agency. Be brief, friendly and exact. "
                     "Follow these policies:",
                tail="\nNever invent a policy that is not listed above.")


def user_message(rng: random.Random, turn: int) -> str:
    """The user's message at a chat turn (0-based); later turns follow up on the earlier ones."""
    city, month = rng.choice(_CITIES), rng.choice(_MONTHS)
    templates = [
        [f"Hi! I am planning a trip to {city} in {month}. What should I know before booking?",
         f"Hello, can I still change my booking to {city}? I travel in {month}."],
        [f"How much luggage can I take to {city}?", "What happens if my flight is cancelled?"],
        [f"Could you suggest {rng.randint(2, 5)} things to do there on a rainy day?",
         "Is late check-out possible at the hotel?"],
        ["Thanks. Please summarise what you told me in three short points.",
         "Great, one last thing: how do I get a refund if I cancel?"],
    ]
    return rng.choice(templates[turn % len(templates)])

