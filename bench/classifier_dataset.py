"""Build tests/data/classifier_prompts.jsonl: labelled prompts for the complexity classifier.

Hand-written templates with slot filling, one family per kind of traffic, labelled by the
tier a careful operator would route the family to (never by the classifier's output).
Each family includes cases that fool surface features on purpose: a long support system
prompt in front of a trivial question (small), a one-line proof request (large), a long
paste with a trivial edit (medium).

    .venv/bin/python -m bench.classifier_dataset   # rewrites the file, fixed seed
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "classifier_prompts.jsonl"
SEED = 20261121
PER_FAMILY = 12

Record = dict[str, Any]

COUNTRIES = ["France", "Kenya", "Peru", "Vietnam", "Norway", "Canada", "Egypt", "Chile", "Japan", "Poland"]
CITIES = ["Lisbon", "Osaka", "Denver", "Nairobi", "Oslo", "Hanoi", "Quito", "Perth"]
WORDS = ["ephemeral", "ubiquitous", "lucid", "candid", "tenacious", "frugal", "meticulous", "pragmatic"]
LANGS = ["Spanish", "German", "French", "Italian", "Portuguese", "Japanese"]
PLANGS = ["Python", "TypeScript", "Go", "Rust", "Java", "C#"]
SENTENCES = [
    "i dont think we can make the meeting tomorrow sorry",
    "send me the report asap",
    "The package was delivered to the wrong address again.",
    "We are excited to announce our new office in Berlin.",
    "pls confirm ur availability for next week",
    "The invoice is overdue and we need payment now.",
    "Thanks for your help yesterday, it made a big difference.",
]
TOPICS = ["autumn", "coffee", "the ocean", "a lazy cat", "Monday mornings", "mountains", "city lights"]
CONCEPTS = [
    "DNS resolution",
    "garbage collection in the JVM",
    "TLS handshakes",
    "photosynthesis",
    "compound interest",
    "vaccines",
    "HTTP caching headers",
    "database indexes",
    "inflation",
    "Git rebase",
    "OAuth 2.0",
    "the CAP theorem",
    "public key cryptography",
    "Kubernetes services",
    "the greenhouse effect",
]
PAIRS = [
    ("TCP", "UDP"),
    ("a process", "a thread"),
    ("REST", "GraphQL"),
    ("stocks", "bonds"),
    ("list", "tuple in Python"),
    ("SSD", "HDD"),
    ("mitosis", "meiosis"),
    ("let", "const in JavaScript"),
    ("weather", "climate"),
]
FACTS = [
    "The city council approved the new transit budget after a long debate.",
    "Ridership on the northern line grew by twelve percent in the last quarter.",
    "Critics argued that the plan underfunds maintenance of existing stations.",
    "The mayor said construction would begin in the spring if contracts are signed.",
    "Local businesses near the proposed stations expect more foot traffic.",
    "The project is partly financed by a federal grant that expires in two years.",
    "Engineers warned that soil conditions could delay tunnelling by several months.",
    "A public consultation drew more than four thousand written comments.",
    "The company reported revenue of 4.2 billion, up 8% from the previous year.",
    "Operating margins shrank because of higher energy and shipping costs.",
    "Management expects demand to soften in the second half of the year.",
    "The board approved a share buyback and a modest dividend increase.",
    "Researchers measured sleep quality in 300 volunteers over six weeks.",
    "Participants who exercised in the morning fell asleep faster on average.",
    "The effect was smaller among people who already slept more than seven hours.",
    "The authors caution that the sample was drawn from a single university town.",
]
SNIPPETS = [
    "def total(items):\n    s = 0\n    for i in items:\n        s += i.price * i.qty\n    return s\n",
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n",
    "async def fetch(session, url):\n    async with session.get(url) as r:\n        return await r.json()\n",
    "class Cache:\n    def __init__(self):\n        self.data = {}\n"
    "    def get(self, k):\n        return self.data[k]\n",
    "function debounce(fn, ms) {\n  let t;\n"
    "  return (...a) => { clearTimeout(t); t = setTimeout(() => fn(...a), ms); };\n}\n",
    "for i in range(len(users)):\n    if users[i]['active'] == True:\n        send_email(users[i]['email'])\n",
    "SELECT u.id, COUNT(o.id) FROM users u LEFT JOIN orders o ON o.user_id = u.id GROUP BY u.id;\n",
    "func handler(w http.ResponseWriter, r *http.Request) {\n\tbody, _ := io.ReadAll(r.Body)\n\tw.Write(body)\n}\n",
]
ERRORS = ["KeyError: 'price'", "TypeError: 'NoneType' object is not iterable", "RecursionError", "a race condition"]
SUPPORT_SYSTEM = (
    "You are the customer support assistant for Northwind Outdoor Gear. Be friendly and concise. "
    "Our stores open 9am-8pm Monday to Saturday and 10am-6pm on Sunday. Returns are accepted within 60 days "
    "with a receipt. Shipping is free above 75 dollars. Never promise refunds on clearance items. "
    "If the customer is angry, apologise once and offer to escalate to a human agent. "
) * 3
THEOREMS = [
    "the square root of 2 is irrational",
    "there are infinitely many primes",
    "every finite integral domain is a field",
    "the sum of the first n odd numbers is n^2",
    "a continuous function on a closed interval is bounded",
    "the harmonic series diverges",
    "every tree with n vertices has n - 1 edges",
    "there is no largest prime of the form 4k + 3",
]
SYSTEMS = [
    "a URL shortener",
    "a rate limiter shared by 20 API servers",
    "a chat service for 5 million users",
    "a ride-hailing dispatch system",
    "a distributed job scheduler",
    "a feature-flag service",
    "an inventory system for 300 warehouses",
    "a multi-region object store",
]


def chat(*turns: str, system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return messages


def paragraph(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(FACTS) for _ in range(n))


def code_block(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(SNIPPETS) + "\n" for _ in range(n))


# --- small: greetings, lookups, short rewrites, trivia behind long system prompts ------
def s_greeting(r: random.Random) -> Record:
    text = r.choice(["hi", "hello!", "hey there", "good morning :)", "thanks, that's all", "ok cool", "how are you?"])
    return {"messages": chat(text)}


def s_lookup(r: random.Random) -> Record:
    return {
        "messages": chat(
            r.choice(
                [
                    f"What is the capital of {r.choice(COUNTRIES)}?",
                    f"What time zone is {r.choice(CITIES)} in?",
                    f"How many {r.choice(['grams', 'ounces'])} are in a {r.choice(['pound', 'kilogram'])}?",
                    f"Define '{r.choice(WORDS)}'.",
                    f"what currency do they use in {r.choice(COUNTRIES)}",
                    f"Is {r.choice(CITIES)} in the southern hemisphere?",
                    f"Convert {r.randint(2, 90)} degrees Fahrenheit to Celsius.",
                ]
            )
        )
    }


def s_rewrite(r: random.Random) -> Record:
    s = r.choice(SENTENCES)
    return {
        "messages": chat(
            r.choice(
                [
                    f'Rewrite this more politely: "{s}"',
                    f"Fix the grammar: {s}",
                    f"Translate to {r.choice(LANGS)}: {s}",
                    f"Make this sound more professional: {s}",
                    f"Give me a synonym for {r.choice(WORDS)}",
                ]
            )
        ),
        "max_tokens": r.choice([None, 60, 100]),
    }


def s_creative_short(r: random.Random) -> Record:
    t = r.choice(TOPICS)
    return {
        "messages": chat(
            r.choice(
                [
                    f"Write a haiku about {t}.",
                    f"Tell me a short joke about {t}.",
                    f"Suggest three names for a cafe themed on {t}.",
                ]
            )
        )
    }


def s_support(r: random.Random) -> Record:
    q = r.choice(
        [
            "What are your opening hours on Sunday?",
            "Do you ship for free?",
            "Can I return boots I bought last week?",
            "thanks!",
            "Where is my nearest store?",
            "Is the Denver store open today?",
        ]
    )
    return {"messages": chat(q, system=SUPPORT_SYSTEM), "max_tokens": r.choice([None, 150])}


def s_followup(r: random.Random) -> Record:
    c = r.choice(COUNTRIES)
    return {
        "messages": chat(
            f"What's the capital of {c}?",
            "It is the capital city you asked about.",
            r.choice(["And its population?", "thanks", "What language do they speak there?"]),
        )
    }


# --- medium: summaries, explanations, moderate code, drafts ---------------------------
def m_summary(r: random.Random) -> Record:
    n = r.randint(5, 12)
    ask = r.choice(
        [
            "Summarize this in three bullet points:",
            "TL;DR please:",
            "Give me a short summary of:",
            "What are the key points here?",
        ]
    )
    return {"messages": chat(f"{ask}\n\n{paragraph(r, n)}"), "max_tokens": r.choice([None, 300])}


def m_explain(r: random.Random) -> Record:
    if r.random() < 0.5:
        text = r.choice(
            [
                f"Explain how {r.choice(CONCEPTS)} works.",
                f"Can you explain {r.choice(CONCEPTS)} to a beginner, with an example?",
                f"Why does {r.choice(CONCEPTS)} matter?",
            ]
        )
    else:
        a, b = r.choice(PAIRS)
        text = f"What's the difference between {a} and {b}?"
    return {"messages": chat(text)}


def m_code_question(r: random.Random) -> Record:
    lang = r.choice(PLANGS)
    text = r.choice(
        [
            f"Why does this raise {r.choice(ERRORS)}?\n```\n{r.choice(SNIPPETS)}```",
            f"How do I read a CSV file and skip the header in {lang}?",
            f"Write a {lang} function that checks whether a string is a palindrome.",
            f"What does this code do?\n```\n{r.choice(SNIPPETS)}```",
            f"How can I make this faster?\n```\n{r.choice(SNIPPETS)}```",
            "Write a SQL query returning the 10 customers with the highest total order value last month.",
            f"Write a regex in {lang} that matches ISO 8601 dates.",
        ]
    )
    return {"messages": chat(text), "max_tokens": r.choice([None, 500, 800])}


def m_draft(r: random.Random) -> Record:
    who = r.choice(["my landlord", "a client", "the hiring manager", "my team", "a supplier"])
    about = r.choice(
        ["a late payment", "moving the deadline by a week", "a broken heater", "a job offer", "a price increase"]
    )
    return {"messages": chat(f"Write a short professional email to {who} about {about}.")}


def m_long_trivial_edit(r: random.Random) -> Record:
    ask = r.choice(
        [
            "Fix any typos in this text:",
            "Translate this paragraph into plain English:",
            "Convert this to a bulleted list:",
        ]
    )
    return {"messages": chat(f"{ask}\n\n{paragraph(r, r.randint(8, 16))}")}


def m_conversation(r: random.Random) -> Record:
    c = r.choice(CONCEPTS)
    return {
        "messages": chat(
            f"What is {c}?",
            f"{c} is a mechanism used widely; here is an overview. " * 3,
            "Can you give a concrete example?",
            "Sure, consider a small web application. " * 3,
            r.choice(["What are the common pitfalls?", "How would I test it?"]),
        )
    }


# --- large: reasoning, proofs, long code, long documents, technical sessions ----------
def l_proof(r: random.Random) -> Record:
    t = r.choice(THEOREMS)
    text = r.choice([f"Prove that {t}.", f"Give a rigorous proof that {t}.", f"Show that {t}, step by step."])
    return {"messages": chat(text)}


def l_math(r: random.Random) -> Record:
    a, b, c = r.randint(2, 9), r.randint(2, 30), r.randint(2, 50)
    text = r.choice(
        [
            f"Find all integer solutions of x^2 - {a}y^2 = 1 with y < 100, and explain the method.",
            f"Compute the integral of x^{a} * e^(-{b}x) from 0 to infinity and justify each step.",
            f"A bag has {a} red and {b} blue balls. We draw {min(a, 3)} without replacement. What is the probability "
            "that at least two are red? Show your reasoning.",
            f"Solve the recurrence T(n) = {a}T(n/{min(a, 4)}) + n^2 and prove the bound.",
            f"Derive the closed form of the sum of k^{min(a, 4)} for k = 1..n.",
            f"Two trains leave stations {c * 10} km apart at {b + 40} km/h and {c + 30} km/h; a bird flies between "
            "them at 100 km/h. How far does it fly? Think step by step.",
        ]
    )
    return {"messages": chat(text)}


def l_design(r: random.Random) -> Record:
    s = r.choice(SYSTEMS)
    text = (
        f"Design {s}. Cover:\n1. the data model\n2. the API\n3. scaling to 10x traffic\n4. failure modes and "
        "recovery\n5. the trade-offs you made and why. Compare at least two alternatives."
    )
    return {"messages": chat(text), "max_tokens": r.choice([None, 3000, 4000])}


def l_codegen(r: random.Random) -> Record:
    lang = r.choice(PLANGS)
    thing = r.choice(
        [
            "an LRU cache with TTL",
            "a token-bucket rate limiter backed by Redis",
            "a JSON parser",
            "a thread-safe job queue with retries",
            "a CLI that syncs two directories",
            "a B-tree with insert and delete",
        ]
    )
    text = (
        f"Implement {thing} in {lang}. Requirements:\n1. full type annotations\n2. handle edge cases and "
        "errors\n3. include unit tests\n4. explain the complexity of each operation."
    )
    return {"messages": chat(text), "max_tokens": r.choice([None, 4000, 8000])}


def l_refactor(r: random.Random) -> Record:
    code = code_block(r, r.randint(6, 12))
    ask = r.choice(
        [
            "Refactor this module to use dependency injection, add type hints and tests, and explain each change:",
            "Review this code for bugs, race conditions and security issues, then rewrite it:",
            "Port this code to async and make it robust to network failures:",
        ]
    )
    return {"messages": chat(f"{ask}\n```\n{code}```"), "max_tokens": r.choice([None, 4000])}


def l_long_document(r: random.Random) -> Record:
    doc = paragraph(r, r.randint(40, 70))
    ask = r.choice(
        [
            "Analyze this report: identify the main risks, contradictions and missing data, and recommend "
            "next steps with justification.",
            "Compare the arguments in this document, evaluate their evidence, and write a structured critique.",
            "Extract every commitment and deadline, then assess which are unrealistic and why.",
        ]
    )
    return {"messages": chat(f"{doc}\n\n{ask}"), "max_tokens": r.choice([None, 2000])}


def l_session(r: random.Random) -> Record:
    turns: list[str] = []
    for i in range(r.randint(3, 6)):
        turns.append(
            r.choice(
                [
                    f"The service now fails with {r.choice(ERRORS)} under load.\n```\n{r.choice(SNIPPETS)}```",
                    "I tried your suggestion but the latency p99 went up; here are the logs: timeout after 30s on "
                    "replica 3, connection reset on replica 1.",
                    "Why would the retry make it worse? Walk me through what happens step by step.",
                ]
            )
        )
        turns.append(f"Here is my analysis of attempt {i + 1}. " * 6 + f"\n```\n{r.choice(SNIPPETS)}```")
    turns.append("OK. Given all of the above, what is the root cause and how do we fix it for good?")
    return {"messages": chat(*turns, system="You are a senior site reliability engineer.")}


def l_plan(r: random.Random) -> Record:
    a, b = r.choice(
        [
            ("MySQL", "PostgreSQL"),
            ("a monolith", "microservices"),
            ("on-prem VMs", "Kubernetes"),
            ("REST", "gRPC"),
            ("Python 2", "Python 3"),
        ]
    )
    return {
        "messages": chat(
            f"Plan a {r.randint(4, 12)}-week migration from {a} to {b} for a team of "
            f"{r.randint(3, 15)}. Break it into phases, identify the risks, the rollback plan, "
            "and how to verify each step."
        )
    }


FAMILIES: dict[str, list[Callable[[random.Random], Record]]] = {
    "small": [s_greeting, s_lookup, s_rewrite, s_creative_short, s_support, s_followup],
    "medium": [m_summary, m_explain, m_code_question, m_draft, m_long_trivial_edit, m_conversation],
    "large": [l_proof, l_math, l_design, l_codegen, l_refactor, l_long_document, l_session, l_plan],
}


def build(seed: int = SEED) -> list[Record]:
    rng = random.Random(seed)
    records: list[Record] = []
    seen: set[str] = set()
    for tier, families in FAMILIES.items():
        per_family = (110 + len(families) - 1) // len(families)
        for family in families:
            made = attempts = 0
            while made < per_family and attempts < per_family * 20:
                attempts += 1
                record = family(rng)
                key = json.dumps(record, sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
                if record.get("max_tokens") is None:
                    record.pop("max_tokens", None)
                records.append({**record, "tier": tier, "family": family.__name__})
                made += 1
    rng.shuffle(records)
    return records


def main() -> None:
    records = build()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print(f"wrote {len(records)} prompts to {OUT}")


if __name__ == "__main__":
    main()
